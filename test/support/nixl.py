"""A NixlKVManager without its constructor, for tests on this machine.

The real `NixlKVManager.__init__` needs a GPU, a bootstrap server and a published runtime
context, so tests build the manager with `object.__new__` and set only the attributes the code
under test reads. Everything it then runs (handlers, message builders, registration, NIXL agents
with UCX, zmq on loopback) is upstream's real code.
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict

import zmq
from nixl._api import nixl_agent, nixl_agent_config
from sglang.srt.utils.network import get_zmq_socket_on_host

HOST = "127.0.0.1"

_agent_names = itertools.count()


def ucx_agent(role: str):
    """A real NIXL agent on UCX with a name unique in this process."""
    return nixl_agent(f"{role}-{next(_agent_names)}", nixl_agent_config(backends=["UCX"]))


def listen_as_single_rank(mgr) -> None:
    """One rank of a one-rank deployment, its control socket bound on loopback."""
    mgr.attn_tp_size, mgr.attn_tp_rank = 1, 0
    mgr.attn_cp_size, mgr.attn_cp_rank = 1, 0
    mgr.pp_size, mgr.pp_rank = 1, 0
    mgr.dcp_size, mgr.dcp_rank = 1, 0
    mgr.local_ip = HOST
    mgr._zmq_ctx = zmq.Context()
    mgr.rank_port, mgr.server_socket = get_zmq_socket_on_host(mgr._zmq_ctx, zmq.PULL, host=HOST)


def track_rooms(mgr) -> None:
    """Room status, failure records and the outgoing-socket cache, empty, as __init__ leaves them."""
    mgr.request_status, mgr.failure_records = {}, {}
    mgr.failure_lock, mgr._socket_lock = threading.Lock(), threading.Lock()
    mgr._socket_cache, mgr._monitor_cache, mgr._socket_send_locks = {}, {}, {}
    mgr._staging_outstanding = defaultdict(int)
    mgr._deferred_ack_targets, mgr._deferred_ack_poisoned_rooms = {}, set()
    mgr.enable_deferred_decode_kv_release = False
