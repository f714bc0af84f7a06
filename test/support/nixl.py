"""A NixlKVManager without its constructor, and decode peers on the wire, for tests here.

The real `NixlKVManager.__init__` needs a GPU, a bootstrap server and a published runtime
context, so tests build the manager with `object.__new__` and set only the attributes the code
under test reads. Everything it then runs (handlers, message builders, registration, NIXL agents
with UCX, zmq on loopback) is upstream's real code.
"""

from __future__ import annotations

import errno
import itertools
import os
import queue
import threading
import time
import traceback
from collections import defaultdict

import numpy as np
import pytest
import requests
import torch
import zmq
from nixl._api import nixl_agent, nixl_agent_config
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.nixl.conn import NixlKVManager, num_kv_slots
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.utils.network import get_zmq_socket_on_host
from sglang_dsv4.cpu_backend import nixl_progress

HOST = "127.0.0.1"
# The reason upstream records for a room the decode aborted.
ABORTED = "Aborted by decode-side abort notification."

_agent_names = itertools.count()


def ucx_agent(role: str):
    """A real NIXL agent on UCX with a name unique in this process. Its progress thread waits
    when idle, as in a CPU server (sglang_dsv4.cpu_backend.nixl_progress): nixl's default polls
    a core flat out for as long as the agent lives, and the suite's agents would slow every test
    after theirs."""
    nixl_progress.install()
    return nixl_agent(f"{role}-{next(_agent_names)}", nixl_agent_config(backends=["UCX"]))


def listen_as_single_rank(mgr, host: str = HOST) -> None:
    """One rank of a one-rank deployment, its control socket bound on `host` (loopback, or the
    address of the network namespace it runs in)."""
    mgr.attn_tp_size, mgr.attn_tp_rank = 1, 0
    mgr.attn_cp_size, mgr.attn_cp_rank = 1, 0
    mgr.pp_size, mgr.pp_rank = 1, 0
    mgr.dcp_size, mgr.dcp_rank = 1, 0
    mgr.local_ip = host
    mgr._zmq_ctx = zmq.Context()
    mgr.rank_port, mgr.server_socket = get_zmq_socket_on_host(mgr._zmq_ctx, zmq.PULL, host=host)


def track_rooms(mgr) -> None:
    """Room status, failure records and the outgoing-socket cache, empty, as __init__ leaves them."""
    mgr.request_status, mgr.failure_records = {}, {}
    mgr.failure_lock, mgr._socket_lock = threading.Lock(), threading.Lock()
    mgr._socket_cache, mgr._monitor_cache, mgr._socket_send_locks = {}, {}, {}
    mgr._staging_outstanding = defaultdict(int)
    mgr._deferred_ack_targets, mgr._deferred_ack_poisoned_rooms = {}, set()
    mgr.enable_deferred_decode_kv_release = False


_room_numbers = itertools.count(1000)


def new_room() -> int:
    return next(_room_numbers)


# Every wait is a hang guard, not a speed bound: it returns as soon as the predicate holds, and
# gives up no sooner than this, so a loaded shared machine cannot fail a test by the clock.
HANG_GUARD_S = 120.0


# A wait also ends once what would make its predicate true is gone: an upstream NIXL control
# thread of this test died raising (on a tree without the fix one bad message kills it, and
# nothing restarts it). The thread's death reaches threading.excepthook; the wait then polls on
# for DEATH_GRACE_S only (a peer thread of another manager may still serve), instead of sitting
# out the hang guard. With the fix no control thread dies raising, so no wait is cut short.
DEATH_GRACE_S = 5.0
_UPSTREAM_NIXL = "sglang/srt/disaggregation/"
_first_control_thread_death: dict[str, float] = {}  # test -> when (monotonic)
_previous_excepthook = threading.excepthook


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "").rpartition(" (")[0]


def _record_control_thread_death(args) -> None:
    frames = traceback.extract_tb(args.exc_traceback) if args.exc_traceback else []
    if any(_UPSTREAM_NIXL in frame.filename for frame in frames):
        _first_control_thread_death.setdefault(_current_test(), time.monotonic())
    _previous_excepthook(args)


threading.excepthook = _record_control_thread_death


def wait_until(predicate, timeout_s: float = 3.0, poll_s: float = 0.002) -> bool:
    """Poll `predicate` until it holds; False after max(timeout_s, HANG_GUARD_S), or
    DEATH_GRACE_S after an upstream NIXL control thread of this test died raising."""
    started = time.monotonic()
    deadline = started + max(timeout_s, HANG_GUARD_S)
    test = _current_test()
    while time.monotonic() < deadline:
        if predicate():
            return True
        died = _first_control_thread_death.get(test)
        if died is not None:
            deadline = min(deadline, max(died, started) + DEATH_GRACE_S)
        time.sleep(poll_s)
    return predicate()


def empty_kv_args(engine_rank: int) -> KVArgs:
    args = KVArgs()
    args.engine_rank = engine_rank
    args.gpu_id = 0
    for name in ("kv_data_ptrs", "kv_data_lens", "kv_item_lens", "kv_layer_ids"):
        setattr(args, name, [])
    args.kv_data_mem_kinds = []
    for name in ("aux_data_ptrs", "aux_data_lens", "aux_item_lens"):
        setattr(args, name, [])
    for name in ("state_data_ptrs", "state_data_lens", "state_item_lens", "state_layer_ids"):
        setattr(args, name, [])
    args.state_dim_per_tensor = []
    args.state_types = []
    return args


def bare_manager(
    mode: DisaggregationMode, agent, engine_rank: int, host: str = HOST
) -> NixlKVManager:
    mgr = object.__new__(NixlKVManager)
    mgr.disaggregation_mode = mode
    mgr.kv_args = empty_kv_args(engine_rank)
    mgr.agent = agent
    mgr.is_mla_backend = True  # DeepSeek-V4 is MLA
    mgr.is_hybrid_mla_backend = False
    mgr._kv_replica_factor = None
    listen_as_single_rank(mgr, host)
    track_rooms(mgr)
    mgr.enable_staging = False
    mgr._staging_handler = None
    if mode == DisaggregationMode.PREFILL:
        mgr.transfer_infos = {}
        mgr.req_to_decode_prefix_len = {}
        mgr.decode_kv_args_table = {}
        mgr.src_mem_kind = None
        mgr._prepared_state_plans = {}
        mgr._state_layout_rejections = {}
        mgr._prepared_state_components = frozenset()
    else:
        mgr.prefill_response_tracker = {}
        mgr.required_prefill_response_num_table = {}
        mgr._deferred_abort_ack_tracker = {}
        mgr.connection_lock = threading.Lock()
        mgr.connection_pool = {}
        mgr.prefill_info_table = {}
        mgr.addr_to_rooms_tracker = defaultdict(set)
        mgr.heartbeat_failures = {}
        mgr.session_pool = defaultdict(requests.Session)
        mgr.session_pool_lock = threading.Lock()
        mgr._heartbeat_shutdown = threading.Event()
    return mgr


def stop(mgr: NixlKVManager, *threads: threading.Thread) -> None:
    """Terminate the manager's ZMQ context: a control thread takes that as its signal to stop."""
    for sock in [*mgr._socket_cache.values(), *mgr._monitor_cache.values()]:
        sock.close(linger=0)
    if not threads:  # no control thread was started to close its socket
        mgr.server_socket.close(linger=0)
    terminating = threading.Thread(target=mgr._zmq_ctx.term, daemon=True)
    terminating.start()
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive(), f"{thread.name} did not stop with its context"
    terminating.join(5)
    assert not terminating.is_alive(), "a socket of the manager was left open"


def open_room(mgr: NixlKVManager, status: int = KVPoll.Bootstrapping) -> int:
    """A room as CommonKVSender / CommonKVReceiver open it, optionally moved on."""
    room = new_room()
    mgr.update_status(room, KVPoll.Bootstrapping)
    if status != KVPoll.Bootstrapping:
        mgr.update_status(room, status)
    return room


class Peer:
    """A decode rank as seen from the wire: upstream's builders make its messages."""

    def __init__(self, agent, engine_rank: int, port: int):
        self.mgr = bare_manager(DisaggregationMode.DECODE, agent, engine_rank)
        # Messages name this port as the decode's status endpoint.
        self.mgr.server_socket.close(linger=0)
        self.mgr.rank_port = port
        self.name = agent.name

    def registration(self) -> list[bytes]:
        return self.mgr.build_receiver_registration_message()

    def transfer_info(self, room: int, required: int = 1) -> list[bytes]:
        return self.mgr.build_receiver_metadata_message(
            bootstrap_room=room,
            required_dst_info_num=required,
            kv_indices=np.arange(8, dtype=np.int32),
            aux_index=room % 64,
            state_indices=None,
            decode_prefix_len=None,
            is_dummy=False,
        )

    def abort(self, room: int) -> list[bytes]:
        return [b"ABORT", str(room).encode()]

    def close(self) -> None:
        self.mgr._zmq_ctx.term()


class Sender:
    """A PUSH socket to a manager's control socket; one sender keeps its messages in order."""

    def __init__(self, port: int):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{HOST}:{port}")

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


class FailingSocket:
    """The manager's real socket, except that recv raises a ZMQ error once `fail` is set, or
    on every call once `broken` is set (a socket that stays broken). With `keep_port` set, close
    leaves the real socket bound, as when another process holds the port: re-binding fails."""

    def __init__(self, real: zmq.Socket):
        self.real = real
        self.fail = threading.Event()
        self.broken = threading.Event()
        self.keep_port = threading.Event()

    def close(self, *args, **kwargs):
        if not self.keep_port.is_set():
            self.real.close(*args, **kwargs)

    def poll(self, *args, **kwargs):
        # A pending failure is something to receive: the control loop polls before it receives.
        if self.fail.is_set() or self.broken.is_set():
            return zmq.POLLIN
        return self.real.poll(*args, **kwargs)

    def recv_multipart(self):
        while True:
            if self.broken.is_set():
                raise zmq.ZMQError(errno.EIO, "injected socket failure, for good")
            if self.fail.is_set():
                self.fail.clear()
                raise zmq.ZMQError(errno.EIO, "injected socket failure")
            if self.real.poll(5):
                return self.real.recv_multipart()

    def __getattr__(self, name):
        return getattr(self.real, name)


def open_room_on(mgr: NixlKVManager, room: int, status: int) -> None:
    mgr.update_status(room, KVPoll.Bootstrapping)
    mgr.update_status(room, status)


def kv_args_of(pool, page_size: int) -> KVArgs:
    """The KV args a rank of this DeepSeek-V4 pool registers, with one small aux buffer."""
    args = KVArgs()
    args.engine_rank, args.gpu_id, args.page_size = 0, 0, page_size
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = pool.get_contiguous_buf_infos()
    args.kv_data_mem_kinds = ["DRAM"] * len(args.kv_data_ptrs)
    args.kv_layer_ids = []
    args.kv_layout = pool.pd_kv_layout()
    aux = torch.zeros(64, dtype=torch.uint8)  # one metadata buffer, kept alive by the args
    args.aux_buffer = aux
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [aux.data_ptr()], [64], [8]
    for name in ("state_data_ptrs", "state_data_lens", "state_item_lens", "state_layer_ids"):
        setattr(args, name, [])
    args.state_dim_per_tensor, args.state_types = [], []
    return args


# Managers pool_manager made; close_pool_managers destroys their zmq contexts after each test (a
# context garbage-collected while its sockets are still open blocks in term()).
_POOL_MANAGERS: list[NixlKVManager] = []


@pytest.fixture(autouse=True)
def close_pool_managers():
    """Autouse in every test module that imports it."""
    yield
    while _POOL_MANAGERS:
        _POOL_MANAGERS.pop()._zmq_ctx.destroy(linger=0)


def pool_manager(mode: DisaggregationMode, pool, page_size: int) -> NixlKVManager:
    """A prefill or decode rank whose KV buffers are `pool`'s, registered with a UCX agent."""
    mgr = object.__new__(NixlKVManager)
    _POOL_MANAGERS.append(mgr)
    mgr.disaggregation_mode = mode
    mgr.kv_args = kv_args_of(pool, page_size)
    mgr.agent = ucx_agent(mode.value)
    mgr.register_buffer_to_engine()
    mgr.is_mla_backend, mgr.is_hybrid_mla_backend = False, True  # DeepSeek-V4's pools
    listen_as_single_rank(mgr)
    mgr.enable_staging = False
    track_rooms(mgr)
    if mode == DisaggregationMode.PREFILL:
        mgr.src_mem_kind = "DRAM"
        mgr._num_slots_src = num_kv_slots(mgr.kv_args.kv_data_lens, mgr.kv_args.kv_item_lens)
        mgr.prep_handles, mgr.decode_kv_args_table, mgr.transfer_infos = {}, {}, {}
        mgr._prepared_state_plans, mgr._state_layout_rejections = {}, {}
        mgr._prepared_state_components = frozenset()
        mgr.transfer_queues = [queue.SimpleQueue()]  # what workers read; can say it is empty
        mgr.deferred_bootstrap = None
    else:
        mgr.prefill_response_tracker, mgr.required_prefill_response_num_table = {}, {}
        mgr.defer_decode_allocation = False
    return mgr
