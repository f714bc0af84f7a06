"""One PD rank in its own OS process, for the two-process test (test_pd_two_process.py).

    python pd_rank.py prefill BOOTSTRAP_PORT   # upstream's bootstrap server + a prefill rank
    python pd_rank.py decode BOOTSTRAP_PORT    # a decode rank using that prefill

Real upstream code: the configuration published from a real ServerArgs, NixlKVBootstrapServer,
the prefill's register_to_bootstrap, the decode's try_ensure_parallel_info, heartbeat checker,
CommonKVReceiver (init, send_metadata, poll, failure_exception / clear), both control threads,
real NIXL agents (UCX) on loopback. Stand-ins, and why: the managers are built without their
constructor (support/nixl.py: it needs a GPU), with no KV buffers; the prefill's transfer worker
is not run, so "finish ROOM" concludes a room the way that worker does when its last chunk is done.

Addresses: loopback, or for two hosts made of network namespaces (support/netns.py) the
rank's own address in PD_RANK_HOST and, for a decode, the prefill's in PD_RANK_PREFILL_HOST.

A prefill process can be started ahead and held: it imports and configures itself, then waits
for `start` before it binds anything (how a restarted process is ready within the test's time).
Commands on stdin, one a line: `start`, `open ROOM`, `finish ROOM`, `abort ROOM`, `peers`,
`flush ROOM` (prefill), `report ROOM` (decode), `exit`. Events on stdout, one JSON object a
line: {"ready": ...} once serving, then {"room", "status", "reason", "freed"} for every change of
a room's status. `flush ROOM` fails ROOM, a marker open on both sides, on its decodes through
upstream's own status sender, after every status this prefill sent them before; once the decode
reports ROOM failed, `report OTHER` ({"report": OTHER, "status", "reason", "freed"}) shows all
that the prefill had sent about OTHER by then.

KV slots (the quarantine of a failed room's slots), on a decode started with PD_RANK_KV=1:
`open_kv ROOM` opens the room with real KV slots (DecodeKV below) and sends their pages as its
destination; `abort ROOM` aborts it (CommonKVReceiver.abort, as an AbortReq); `kv ROOM` answers
{"kv": ROOM, "held", "pages_free"}, `tables` the manager's control_table_sizes(). The decode
reports {"room", "held": true} when it holds a failed room's slots and {"room", "released":
true, "pages_free"} when it releases them. A prefill's `inflight ROOM` counts a chunk of the
room in flight (and reports {"inflight": ROOM} once counted) and `drain ROOM` ends it, as the
transfer worker counts a chunk it dequeued and, once its transfer handles are done, uncounts it
and acks a drained abort (`_maybe_ack_drained_abort`); the worker itself is not run (it needs KV
buffers to write from).
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
# Missed probes before the decode declares its prefill dead (upstream: 2). One was too few on a
# loaded machine: a probe that timed out while the prefill was merely descheduled declared a live
# prefill dead, dropped it from the probed table, and its real death later went unseen.
HEARTBEAT_FAILURES = 3
PAGE = 256
MY_HOST = os.environ.get("PD_RANK_HOST", "127.0.0.1")
PREFILL_HOST = os.environ.get("PD_RANK_PREFILL_HOST", MY_HOST)


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

    from support.nixl import bare_manager, ucx_agent

    mgr = bare_manager(DisaggregationMode(mode), ucx_agent(mode), engine_rank=0, host=MY_HOST)
    mgr.kv_args.page_size = PAGE
    mgr.kv_cache_dtype_str, mgr.kv_layout, mgr.dsv41_spec_layout = "auto", None, None
    mgr.bootstrap_host, mgr.bootstrap_port, mgr.dist_init_addr = PREFILL_HOST, bootstrap_port, None
    mgr.attn_dp_size, mgr.attn_dp_rank, mgr.system_dp_size, mgr.system_dp_rank = 1, 0, 1, 0
    mgr.enable_all_cp_ranks_for_transfer = False
    mgr.defer_decode_allocation = False
    # Upstream's defaults (300 s): the faults below must be seen long before either.
    mgr.bootstrap_timeout = envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()
    mgr.waiting_timeout = envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()
    # Deferred KV release (abort acks) as upstream's __init__ sets it: on by default for NIXL.
    mgr.enable_deferred_decode_kv_release = (
        envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get()
        and mgr.supports_deferred_decode_kv_release
    )
    mgr._deferred_abort_generation = 0
    return mgr


class DecodeKV:
    """The decode scheduler's KV path for rooms opened with `open_kv`, on upstream's objects:
    an MHA pool on the CPU, PagedTokenToKVPoolAllocator, ReqToTokenPool, RadixCache (disabled, a
    decode without radix cache), Req, alloc_for_decode_prealloc, and DecodeTransferQueue's
    deferred release (_defer_release, resolve_deferred_releases, _do_release, _release_request,
    release_kv_cache). Stand-ins, and why: the queue is built without its constructor, which
    needs a scheduler (a GPU): only the attributes those methods read are set, the scheduler's
    among them (no hisparse, no metrics). pop_transferred's Failed branch is played in its order
    (failure_exception, ensure_abort_notified(force_arm=True), then hold or release): the rest of
    that method needs the scheduler's output streamer. A one-rank gloo group stands for the
    attention TP group the queue reduces its flags over."""

    def __init__(self, mgr):
        import torch
        import torch.distributed as dist
        from sglang.srt.disaggregation.decode import DecodeTransferQueue
        from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator
        from sglang.srt.environ import envs
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache

        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        size = PAGE * 16
        pool = MHATokenToKVPool(size, PAGE, torch.bfloat16, 1, 8, 1, "cpu", False)
        self.alloc = PagedTokenToKVPoolAllocator(
            size, page_size=PAGE, dtype=torch.bfloat16, device="cpu", kvcache=pool,
            need_sort=False,
        )
        self.rows = ReqToTokenPool(
            size=8, max_context_len=PAGE * 4, device="cpu", enable_memory_saver=False
        )
        tree = RadixCache(
            CacheInitParams(
                disable=True,
                req_to_token_pool=self.rows,
                token_to_kv_pool_allocator=self.alloc,
                page_size=PAGE,
            )
        )
        q = object.__new__(DecodeTransferQueue)
        q.queue, q.gloo_group, q.tree_cache = [], dist.group.WORLD, tree
        q.enable_host_receive, q.enable_staging = False, False
        q.enable_deferred_kv_release = envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get()
        q.deferred_kv_release_timeout = (
            envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get()
        )
        q._deferred_releases = []
        q.metadata_buffers = MetadataBuffers(8, hidden_size=8, hidden_states_dtype=torch.float32,
                                             max_sampling_mask_tokens=1)
        q.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(8)
        q.scheduler = _NoGpuScheduler()
        self.queue, self.mgr = q, mgr
        self.waiting = {}  # room -> DecodeRequest not yet failed
        self.held = {}  # room -> DecodeRequest held by the queue
        self.pages = {}  # room -> its KV pages

    def open(self, receiver, room: int) -> None:
        from array import array

        from sglang.srt.disaggregation.decode import DecodeRequest, alloc_for_decode_prealloc
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        fill = PAGE * 2
        req = Req(f"r{room}", "", array("q", range(fill)), SamplingParams(max_new_tokens=1))
        req.bootstrap_room = room
        self.rows.alloc([req])
        req.kv.kv_committed_len = fill
        kv = alloc_for_decode_prealloc(
            self.alloc, req=req, fill_len=fill, delta_len=fill, prefix_len=0,
            total_prefix_len=0, prefix_indices=None, uses_swa_tail=False, swa_tail_len=0,
            req_to_token_pool=self.rows,
        )
        self.rows.write((req.kv.req_pool_idx, slice(0, len(kv))), kv)
        pages = (kv[::PAGE] // PAGE).numpy()
        self.pages[room] = sorted(int(p) for p in pages)
        receiver.send_metadata(pages.astype("int32"), aux_index=0)
        index = self.queue.req_to_metadata_buffer_idx_allocator.alloc()
        self.waiting[room] = DecodeRequest(req=req, kv_receiver=receiver,
                                           metadata_buffer_index=index)

    def pages_free(self, room: int) -> bool:
        free = set(self.alloc.free_pages.tolist())
        if self.alloc.release_pages is not None:
            free |= set(self.alloc.release_pages.tolist())
        return all(p in free for p in self.pages[room])

    def step(self) -> list[dict]:
        """One turn of the scheduler's transfer queue for these rooms; the events it makes."""
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.common.conn import KVTransferError

        events = []
        for room, decode_req in list(self.waiting.items()):
            receiver = decode_req.kv_receiver
            status = receiver.poll()
            if status != KVPoll.Failed:
                continue
            del self.waiting[room]
            try:
                receiver.failure_exception()
            except KVTransferError as e:
                reason = str(e)
            events.append(dict(room=room, status=int(status), reason=reason, freed=True))
            deferrable = (
                self.queue.enable_deferred_kv_release
                and receiver.kv_mgr.enable_deferred_decode_kv_release
            )
            if deferrable and not receiver.abort_notified:
                receiver.ensure_abort_notified(force_arm=True)
            if deferrable and receiver.abort_notified:
                self.queue._defer_release(decode_req)
                self.held[room] = decode_req
                events.append(dict(room=room, held=True))
            else:
                self.queue._do_release(decode_req, decode_req.metadata_buffer_index)
                events.append(dict(room=room, released=True, pages_free=self.pages_free(room)))
        self.queue.resolve_deferred_releases()
        for room, decode_req in list(self.held.items()):
            if decode_req.kv_receiver is None:  # _do_release ran
                del self.held[room]
                events.append(dict(room=room, released=True, pages_free=self.pages_free(room)))
        return events


class _NoGpuScheduler:
    """What the transfer queue's release path reads of its scheduler."""

    enable_hisparse = False

    class metrics_reporter:
        enable_metrics = False


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

    say(held="prefill")
    if sys.stdin.readline().split() != ["start"]:
        return
    NixlKVBootstrapServer(MY_HOST, bootstrap_port)
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
        elif verb == "flush":
            # A marker: fail room ROOM (open on both sides) on its decodes through upstream's own
            # status sender, on the sockets this rank's earlier statuses to them took, so the
            # decode applies it after them (see `report`).
            room = int(args[0])
            mgr.send_kv_status_message(
                targets=[(i.endpoint, i.dst_port) for i in mgr.transfer_infos[room].values()],
                bootstrap_room=room,
                status=KVPoll.Failed,
                failure_reason="marker",
            )
        elif verb == "peers":
            say(peers=sorted(mgr.decode_kv_args_table))
        elif verb == "inflight":
            mgr._staging_outstanding[int(args[0])] += 1
            say(inflight=int(args[0]))  # counted: an abort from now on finds the chunk
        elif verb == "drain":
            mgr._staging_outstanding[int(args[0])] -= 1
            mgr._maybe_ack_drained_abort(int(args[0]))
        elif verb == "exit":
            os._exit(0)


def run_decode(bootstrap_port: int) -> None:
    import numpy as np
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import KVTransferError
    from sglang.srt.disaggregation.nixl.conn import NixlKVReceiver

    bootstrap_addr = f"{PREFILL_HOST}:{bootstrap_port}"
    mgr = manager("decode", bootstrap_port)
    mgr.heartbeat_interval, mgr.max_failures = HEARTBEAT_S, HEARTBEAT_FAILURES
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
    # PD_RANK_KV=1: the KV path for `open_kv` rooms, built before the rank says it is ready
    # (importing the decode scheduler's modules takes long on a loaded machine).
    kv = DecodeKV(mgr) if os.environ.get("PD_RANK_KV") == "1" else None

    def serve_kv():
        while True:
            with lock:
                events = kv.step()
            for event in events:
                say(**event)
            time.sleep(0.005)

    if kv is not None:
        threading.Thread(target=serve_kv, daemon=True).start()
    say(ready="decode", agent=mgr.agent.name)
    for line in sys.stdin:
        verb, *args = line.split()
        if verb in ("open", "open_kv"):
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
                if verb == "open_kv":
                    kv.open(receiver, room)
                    continue
                receiver.send_metadata(np.arange(8, dtype=np.int32), aux_index=0)
                receivers[room] = receiver
            rooms.rooms[room] = True
        elif verb == "abort":
            with lock:
                kv.waiting[int(args[0])].kv_receiver.abort()
        elif verb == "report":
            room = int(args[0])
            status, reason, freed = status_of(room)
            say(report=room, status=int(status), reason=reason, freed=freed)
        elif verb == "kv":
            room = int(args[0])
            with lock:
                say(kv=room, held=room in kv.held, pages_free=kv.pages_free(room))
        elif verb == "tables":
            say(tables=mgr.control_table_sizes())
        elif verb == "exit":
            os._exit(0)


if __name__ == "__main__":
    role, port = sys.argv[1], int(sys.argv[2])
    from sglang.srt.plugins import load_plugins

    load_plugins()  # as in a server process: the plugin, or nothing on a patched tree
    publish_config(role, port)
    (run_prefill if role == "prefill" else run_decode)(port)
