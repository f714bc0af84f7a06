"""One PD rank in its own OS process, for the two-process test (test_pd_two_process.py).

    python pd_rank.py prefill BOOTSTRAP_PORT   # upstream's bootstrap server + a prefill rank
    python pd_rank.py decode BOOTSTRAP_PORT    # a decode rank using that prefill

Real upstream code: the configuration published from a real ServerArgs, NixlKVBootstrapServer,
the prefill's register_to_bootstrap, the decode's try_ensure_parallel_info, heartbeat checker,
CommonKVReceiver (init, send_metadata, poll, failure_exception / clear), both control threads,
real NIXL agents (UCX) on loopback. Stand-ins, and why: the managers are built without their
constructor (support/nixl.py: it needs a GPU), with no KV buffers; the prefill's transfer worker
is not run, so "finish ROOM" concludes a room the way that worker does when its last chunk is done.

A prefill process can be started ahead and held: it imports and configures itself, then waits
for `start` before it binds anything (how a restarted process is ready within the test's time).
Commands on stdin, one a line: `start`, `open ROOM`, `finish ROOM`, `abort ROOM`, `peers`
(prefill), `exit`. Events on stdout, one JSON object a line: {"ready": ...} once serving, then
{"room", "status", "reason", "freed"} for every change of a room's status.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

# The test directory, in place of this script's own (where support/nixl.py would shadow nixl).
sys.path[0] = str(Path(__file__).resolve().parents[1])

HEARTBEAT_S = 0.2  # upstream clamps it to >= 2 s in __init__; short to keep the test fast
PAGE = 256


def say(**event) -> None:
    print(json.dumps(event), flush=True)


def publish_config(mode: str, bootstrap_port: int) -> None:
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs
    from sglang_dsv4.plan import default_model_dir

    publish(
        ServerArgs(
            model_path=str(default_model_dir()),
            disaggregation_mode=mode,
            disaggregation_transfer_backend="nixl",
            disaggregation_bootstrap_port=bootstrap_port,
            page_size=PAGE,
            device="cpu",
        ),
        role="scheduler",
    )


def manager(mode, bootstrap_port: int):
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.environ import envs

    from support.nixl import HOST, bare_manager, ucx_agent

    mgr = bare_manager(DisaggregationMode(mode), ucx_agent(mode), engine_rank=0)
    mgr.kv_args.page_size = PAGE
    mgr.kv_cache_dtype_str, mgr.kv_layout, mgr.dsv41_spec_layout = "auto", None, None
    mgr.bootstrap_host, mgr.bootstrap_port, mgr.dist_init_addr = HOST, bootstrap_port, None
    mgr.attn_dp_size, mgr.attn_dp_rank, mgr.system_dp_size, mgr.system_dp_rank = 1, 0, 1, 0
    mgr.enable_all_cp_ranks_for_transfer = False
    mgr.defer_decode_allocation = False
    # Upstream's defaults (300 s): the faults below must be seen long before either.
    mgr.bootstrap_timeout = envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()
    mgr.waiting_timeout = envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()
    return mgr


class Rooms:
    """Reports every status change of the rooms this rank opened."""

    def __init__(self, status_of):
        self.status_of = status_of  # room -> (status, reason, freed) or None once forgotten
        self.rooms: dict[int, object] = {}
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        seen = {}
        while True:
            for room in list(self.rooms):
                try:
                    now = self.status_of(room)
                except Exception as e:
                    say(room=room, error=f"{type(e).__name__}: {e}")
                    raise
                if now is not None and now != seen.get(room):
                    seen[room] = now
                    status, reason, freed = now
                    say(room=room, status=int(status), reason=reason, freed=freed)
            time.sleep(0.005)


def run_prefill(bootstrap_port: int) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.nixl.conn import NixlKVBootstrapServer

    from support.nixl import HOST

    say(held="prefill")
    if sys.stdin.readline().split() != ["start"]:
        return
    NixlKVBootstrapServer(HOST, bootstrap_port)
    mgr = manager("prefill", bootstrap_port)
    mgr.register_to_bootstrap()
    mgr._start_bootstrap_thread()

    def status_of(room):
        status = mgr.request_status.get(room)
        return None if status is None else (status, mgr.failure_records.get(room), False)

    rooms = Rooms(status_of)
    say(ready="prefill", agent=mgr.agent.name, rank_port=mgr.rank_port)
    for line in sys.stdin:
        verb, *args = line.split()
        if verb == "open":
            room = int(args[0])
            mgr.update_status(room, KVPoll.Bootstrapping)
            rooms.rooms[room] = True
        elif verb == "finish":
            mgr.conclude_transfer(bootstrap_room=int(args[0]), status=KVPoll.Success)
        elif verb == "abort":
            # As CommonKVSender.abort fails a room (an AbortReq, a client gone).
            mgr.record_failure(int(args[0]), "Aborted by AbortReq.")
            mgr.update_status(int(args[0]), KVPoll.Failed)
        elif verb == "peers":
            say(peers=sorted(mgr.decode_kv_args_table))
        elif verb == "exit":
            os._exit(0)


def run_decode(bootstrap_port: int) -> None:
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError
    from sglang.srt.disaggregation.nixl.conn import NixlKVReceiver

    from support.nixl import HOST

    bootstrap_addr = f"{HOST}:{bootstrap_port}"
    mgr = manager("decode", bootstrap_port)
    mgr.heartbeat_interval, mgr.max_failures = HEARTBEAT_S, 1
    mgr._start_decode_listener_thread()
    mgr._start_heartbeat_checker_thread()
    receivers: dict[int, NixlKVReceiver] = {}
    finished: dict[int, tuple] = {}
    lock = threading.Lock()

    def status_of(room):
        # What the decode scheduler does with a receiver: poll it; on failure take the error
        # (which clears the room, releasing its slots), on success clear it.
        with lock:
            if room in finished:
                return finished[room]
            receiver = receivers[room]
            status = receiver.poll()
            if status == KVPoll.Failed:
                try:
                    receiver.failure_exception()
                except KVTransferError as e:
                    finished[room] = (status, str(e), room not in mgr.request_status)
                return finished[room]
            if status == KVPoll.Success:
                receiver.clear()
                finished[room] = (status, None, room not in mgr.request_status)
                return finished[room]
            return status, None, False

    rooms = Rooms(status_of)
    say(ready="decode", agent=mgr.agent.name)
    for line in sys.stdin:
        verb, *args = line.split()
        if verb == "open":
            room = int(args[0])
            # The decode scheduler's order: the prefill's topology, a receiver, its metadata.
            deadline = time.monotonic() + 10
            while not mgr.try_ensure_parallel_info(bootstrap_addr):
                if time.monotonic() > deadline:
                    say(error=f"no prefill at {bootstrap_addr}")
                    break
                time.sleep(0.05)
            with lock:
                receiver = NixlKVReceiver(mgr, bootstrap_addr, room)
                receiver.init(prefill_dp_rank=0)
                receiver.send_metadata(np.arange(8, dtype=np.int32), aux_index=0)
                receivers[room] = receiver
            rooms.rooms[room] = True
        elif verb == "exit":
            os._exit(0)


if __name__ == "__main__":
    role, port = sys.argv[1], int(sys.argv[2])
    from sglang.srt.plugins import load_plugins

    load_plugins()  # as in a server process: the plugin, or nothing on a patched tree
    publish_config(role, port)
    (run_prefill if role == "prefill" else run_decode)(port)
