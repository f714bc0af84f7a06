"""A prefill's control state stays bounded and no peer can block its control thread
(nixl-bootstrap-cascade).

Real upstream code: NixlKVManager's bootstrap thread and decode listener as the plugin or the
patch installs them, upstream's message builders for a decode's registration and transfer info,
_add_remote_peer with real NIXL agents (UCX), the prefill's status path and its cached PUSH
sockets (`_connect`), ZMQ on loopback. A decode that died is a loopback port nobody listens on
(connection refused), as a killed process leaves it.

Stand-ins, and why: the managers are built without their constructor (support/nixl.py says why);
a prefill room is opened and failed as CommonKVSender and its abort do it (update_status,
record_failure), since a sender needs a scheduler; a test that must see a control thread stop
making progress holds the manager's `failure_lock`, which the thread needs for an ABORT, as a
handler blocked on anything would.

No assertion reads the clock: order and state are asserted, waits are bounded and generous, and
the figures (how long a healthy decode waited) are printed.
"""

from __future__ import annotations

import inspect
import socket
import threading
import time

import pytest
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.nixl.conn import NixlKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode
from support.nixl import (
    HOST,
    Peer,
    Sender,
    bare_manager,
    new_room,
    open_room,
    open_room_on,
    stop,
    ucx_agent,
    wait_until,
)


@pytest.fixture(scope="module")
def agents():
    return {role: ucx_agent(role) for role in ("prefill", "decode", "peer", "dead", "sink")}


@pytest.fixture
def prefill(agents):
    mgr = bare_manager(DisaggregationMode.PREFILL, agents["prefill"], engine_rank=0)
    thread = mgr._start_bootstrap_thread()
    yield mgr
    stop(mgr, thread)


class StatusSink:
    """A decode's status endpoint on the wire: counts the KV_STATUS messages a prefill sends."""

    def __init__(self, port: int | None = None):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        if port is None:
            self.port = self.sock.bind_to_random_port(f"tcp://{HOST}")
        else:
            self.sock.bind(f"tcp://{HOST}:{port}")
            self.port = port
        self.failed: dict[int, str] = {}

    def drain(self) -> int:
        while self.sock.poll(0):
            frames = self.sock.recv_multipart()
            if frames[0] == NixlKVManager.kv_status_msg_tag and int(frames[2]) == KVPoll.Failed:
                self.failed[int(frames[1])] = frames[4].decode()
        return len(self.failed)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def refused_port() -> int:
    """A loopback port nobody listens on: what a killed decode leaves behind."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def ready(mgr, room) -> bool:
    return mgr.request_status.get(room) == KVPoll.WaitingForInput


def test_control_thread_target_keeps_upstreams_argument_less_signature(agents):
    """Upstream's control-thread target takes no argument; the replaced one neither (code
    written against upstream's, e.g. a supervisor restarting it, keeps working)."""
    assert list(inspect.signature(NixlKVManager._run_control_thread).parameters) == ["self"]
    mgr = bare_manager(DisaggregationMode.PREFILL, agents["prefill"], engine_rank=0)
    thread = threading.Thread(target=mgr._run_control_thread, daemon=True)
    thread.start()
    sender, peer = Sender(mgr.rank_port), Peer(agents["peer"], engine_rank=0, port=40100)
    try:
        room = open_room(mgr)
        sender.send(peer.transfer_info(room))
        assert wait_until(lambda: ready(mgr, room)), "the thread did not serve"
    finally:
        sender.close()
        peer.close()
        stop(mgr, thread)


def test_ten_thousand_infos_for_rooms_never_opened_create_nothing(prefill, agents):
    """10,000 transfer infos for rooms the prefill never opens leave no entry in upstream's
    room tables; they are held (bounded) for a while, then answered Failed to their decode."""
    sink = StatusSink()
    peer = Peer(agents["peer"], engine_rank=0, port=sink.port)
    sender = Sender(prefill.rank_port)
    control = getattr(prefill, "pd_control", None)
    if control is not None:
        control.bounds.parked_s = 2.0  # how long an info waits for its room (30 s in a server)
    try:
        junk = [new_room() for _ in range(10_000)]
        for room in junk:
            sender.send(peer.transfer_info(room))
        marker = open_room(prefill)  # one real room, after them in the same stream
        sender.send(peer.transfer_info(marker))
        assert wait_until(lambda: ready(prefill, marker), 600), "the 10,000 were not served"
        tables = {
            "request_status": len(prefill.request_status) - 1,
            "transfer_infos": len(prefill.transfer_infos) - 1,
            "req_to_decode_prefix_len": len(prefill.req_to_decode_prefix_len) - 1,
        }
        print(f"\nafter 10,000 infos for unopened rooms: {tables}")
        assert tables == {"request_status": 0, "transfer_infos": 0, "req_to_decode_prefix_len": 0}
        sizes, bounds = prefill.control_table_sizes(), prefill.pd_control.bounds
        print(f"held meanwhile: {sizes}")
        assert sizes["parked_rooms"] <= bounds.parked_rooms
        assert sizes["concluded_rooms"] <= bounds.concluded_rooms
        # Each is answered Failed to the decode that sent it, naming why.
        assert wait_until(lambda: sink.drain() >= len(junk), 600), sink.drain()
        assert set(junk) <= set(sink.failed)
        assert "no request opened room" in sink.failed[junk[-1]]
        assert prefill.control_table_sizes()["parked_rooms"] == 0
        assert not any(room in prefill.request_status for room in junk)
    finally:
        sender.close()
        peer.close()
        sink.close()


def test_an_info_that_comes_before_its_room_opens_still_serves_it(prefill, agents):
    """A decode may send its transfer info before the prefill opens the room: it is held, and
    the room is ready as soon as it opens."""
    sink = StatusSink()
    peer = Peer(agents["peer"], engine_rank=0, port=sink.port)
    sender = Sender(prefill.rank_port)
    try:
        early, marker = new_room(), open_room(prefill)
        sender.send(peer.transfer_info(early))
        sender.send(peer.transfer_info(marker))
        assert wait_until(lambda: ready(prefill, marker))
        assert early not in prefill.request_status and early not in prefill.transfer_infos
        open_room_on(prefill, early, KVPoll.Bootstrapping)
        assert ready(prefill, early)
        assert peer.name in prefill.transfer_infos[early]
        assert sink.drain() == 0
    finally:
        sender.close()
        peer.close()
        sink.close()


def test_an_info_for_a_room_that_finished_and_was_cleared_is_answered_failed(prefill, agents):
    """A late transfer info must not bring a finished room back as WaitingForInput."""
    sink = StatusSink()
    peer = Peer(agents["peer"], engine_rank=0, port=sink.port)
    sender = Sender(prefill.rank_port)
    try:
        room = open_room(prefill)
        sender.send(peer.transfer_info(room))
        assert wait_until(lambda: ready(prefill, room))
        # Concluded as the transfer worker does after its last chunk (its Transferring step
        # would wait for a heartbeat reply this stand-in decode does not send).
        prefill.update_status(room, KVPoll.Success)
        # What the sender's clear() leaves once the scheduler saw Success.
        for table in (prefill.request_status, prefill.transfer_infos):
            table.pop(room)
        prefill.req_to_decode_prefix_len.pop(room, None)
        sender.send(peer.transfer_info(room))
        # The wait also ends once the info brought the room back: then no answer will come.
        assert wait_until(lambda: sink.drain() == 1 or room in prefill.request_status)
        assert room not in prefill.request_status and room not in prefill.transfer_infos
        assert sink.drain() == 1
        assert "already finished" in sink.failed[room]
    finally:
        sender.close()
        peer.close()
        sink.close()


@pytest.mark.slow
def test_a_flood_to_a_dead_decode_does_not_delay_a_healthy_decode(prefill, agents, nixl_caplog):
    """Issue item 3: failure notices to a refused endpoint (a decode that died) must not block
    the prefill's control thread. The healthy decode's room, sent after 3,000 of them and
    before 1,000 more, is ready once served; the dead peer is dropped (counted, logged once)
    and reconnected when it registers again."""
    dead_port = refused_port()
    dead = Peer(agents["dead"], engine_rank=1, port=dead_port)
    decode = bare_manager(DisaggregationMode.DECODE, agents["decode"], engine_rank=2)
    listener = decode._start_decode_listener_thread()
    healthy = Peer(agents["peer"], engine_rank=2, port=decode.rank_port)
    sender = Sender(prefill.rank_port)
    try:
        # Rooms the prefill failed (e.g. aborted by their client): a late transfer info for each
        # is answered Failed to the decode it names, here the dead one.
        failed = []
        for _ in range(4000):
            room = open_room(prefill)
            prefill.record_failure(room, "Aborted by AbortReq.")
            prefill.update_status(room, KVPoll.Failed)
            failed.append(room)
        room = open_room(prefill)
        open_room_on(decode, room, KVPoll.WaitingForInput)
        for flood_room in failed[:3000]:
            sender.send(dead.transfer_info(flood_room))
        t0 = time.monotonic()
        sender.send(healthy.transfer_info(room))
        for flood_room in failed[3000:]:
            sender.send(dead.transfer_info(flood_room))
        assert wait_until(lambda: ready(prefill, room), 60), (
            "the healthy decode's room is not ready: the control thread is blocked on the dead "
            f"peer ({prefill.control_thread_health()})"
        )
        waited = time.monotonic() - t0
        print(f"\nhealthy decode's room ready {waited * 1000:.0f} ms after its info, behind 3,000 "
              "notices to a dead decode")
        events = prefill.control_thread_events
        assert events[("peer_send", "peer_dropped")] == 1
        dropped_lines = [m for m in nixl_caplog.messages if f":{dead_port} dropped" in m]
        assert len(dropped_lines) == 1, dropped_lines
        assert wait_until(lambda: prefill.control_thread_events.get(
            ("peer_send", "skipped"), 0) >= 2000, 60)
        assert prefill.control_thread_health()["healthy"]
        print(f"tables after the flood: {prefill.control_table_sizes()}")
        # The dead decode comes back on its port and registers again: it is sent to again.
        sink = StatusSink(dead_port)
        try:
            sender.send(dead.registration())
            late = failed[0]
            sender.send(dead.transfer_info(late))
            assert wait_until(lambda: sink.drain() >= 1 and late in sink.failed, 10)
        finally:
            sink.close()
    finally:
        sender.close()
        dead.close()
        healthy.close()
        stop(decode, listener)


def test_a_control_thread_that_stops_making_progress_is_reported_down(prefill, agents):
    """/health must see a thread that is alive but blocked, not only a dead one: its loop
    heartbeat ages past the bound and control_thread_health says so, until it moves again."""
    peer = Peer(agents["peer"], engine_rank=0, port=40101)
    sender = Sender(prefill.rank_port)
    room = open_room(prefill)
    try:
        assert prefill.control_thread_health(stalled_s=0.5)["healthy"]
        with prefill.failure_lock:  # the ABORT below needs it: the thread blocks in its handler
            sender.send(peer.abort(room))

            def stalled():
                health = prefill.control_thread_health(stalled_s=0.5)
                return (health["threads"]["prefill_bootstrap"]["down"] or "").startswith("stalled")

            assert wait_until(stalled, 30)
            health = prefill.control_thread_health(stalled_s=0.5)
            assert not health["healthy"] and health["threads"]["prefill_bootstrap"]["alive"]
        assert wait_until(lambda: prefill.control_thread_health(stalled_s=0.5)["healthy"], 30)
        assert prefill.request_status[room] == KVPoll.Failed
    finally:
        sender.close()
        peer.close()


@pytest.fixture
def nixl_caplog(caplog):
    import logging

    caplog.set_level(logging.INFO, logger="sglang.srt.disaggregation.nixl.conn")
    return caplog
