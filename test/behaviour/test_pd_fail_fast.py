"""A PD failure reaches both sides at once, with its reason (nixl-bootstrap-cascade).

Real upstream code: NixlKVManager's control threads (prefill bootstrap, decode listener), its
status path (update_status, record_failure, the KV_STATUS messages decode parses and applies with
apply_prefill_status), upstream's message builders for the decode's registration and transfer
info, _add_remote_peer with real NIXL agents (UCX), ZMQ on loopback.

Stand-ins, and why: the managers are built without their constructor (support/nixl.py says
why); a prefill room is failed as CommonKVSender.abort and _check_bootstrap_timeout fail it
(record_failure, then update_status), since a sender needs a scheduler; FailingSocket stands in
for a socket error; RaisingCounter stands in for a Prometheus counter whose multiprocess
directory vanished (prometheus_client then raises FileNotFoundError when it writes a value).
"""

from __future__ import annotations

import logging
import time

import pytest
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.nixl.conn import NixlKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode
from support.nixl import (
    ABORTED,
    HOST,
    FailingSocket,
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
    return {role: ucx_agent(role) for role in ("prefill", "decode", "peer")}


@pytest.fixture
def nixl_logs(caplog):
    caplog.set_level(logging.INFO, logger="sglang.srt.disaggregation.nixl.conn")
    return caplog


@pytest.fixture
def pd(agents):
    """A prefill rank with its bootstrap thread, a decode rank with its listener, and the decode's
    messages as its own builders make them, all on loopback."""
    prefill = bare_manager(DisaggregationMode.PREFILL, agents["prefill"], engine_rank=0)
    failing = FailingSocket(prefill.server_socket)
    prefill.server_socket = failing
    decode = bare_manager(DisaggregationMode.DECODE, agents["decode"], engine_rank=1)
    threads = [prefill._start_bootstrap_thread(), decode._start_decode_listener_thread()]
    # The wire side of the decode: its messages name the decode's own status port.
    peer = Peer(agents["peer"], engine_rank=1, port=decode.rank_port)
    sender = Sender(prefill.rank_port)
    yield prefill, decode, peer, sender, failing
    sender.close()
    peer.close()
    stop(prefill, threads[0])
    stop(decode, threads[1])


def open_pd_room(prefill, decode, prefill_status=KVPoll.Bootstrapping) -> int:
    """One request's room on both sides: decode waiting for prefill."""
    room = open_room(prefill, prefill_status)
    open_room_on(decode, room, KVPoll.WaitingForInput)
    return room


def decode_failed(decode, room, within_s=1.0) -> bool:
    return wait_until(lambda: decode.request_status[room] == KVPoll.Failed, within_s)


def decode_failed_by_now(prefill, decode, room) -> bool:
    """Whether the decode has failed `room` once all that the prefill sent it so far has arrived.

    For a failure the prefill sends from this thread (update_status): a marker status sent after
    it, through upstream's own send_kv_status_message to the same decode endpoint (so on the same
    cached socket, in order), is applied by the decode's one listener thread after it. The wait
    ends on the marker, which every tree delivers; on a tree whose prefill never sends the
    failure the answer is False then, not at the hang guard.
    """
    marker = new_room()
    open_room_on(decode, marker, KVPoll.WaitingForInput)
    prefill.send_kv_status_message(
        targets=[(HOST, decode.rank_port)],
        bootstrap_room=marker,
        status=KVPoll.Failed,
        failure_reason="marker",
    )
    assert wait_until(lambda: decode.request_status[marker] == KVPoll.Failed), "marker lost"
    return decode.request_status[room] == KVPoll.Failed


def test_death_reaches_decode_even_for_a_transfer_info_that_comes_later(pd):
    """A room the prefill failed when its thread died, then cleared by the scheduler, still
    answers the decode's transfer info that arrives after: the decode fails within a second."""
    prefill, decode, peer, sender, failing = pd
    kept, cleared = open_pd_room(prefill, decode), open_pd_room(prefill, decode)
    failing.fail.set()
    assert wait_until(lambda: prefill.request_status[cleared] == KVPoll.Failed)
    # What failure_exception() leaves on the prefill once the scheduler saw the failure.
    prefill.request_status.pop(cleared)
    prefill.failure_records.pop(cleared)
    t0 = time.monotonic()
    sender.send(peer.transfer_info(kept))
    sender.send(peer.transfer_info(cleared))
    assert decode_failed(decode, kept) and decode_failed(decode, cleared)
    print(f"\ndecode rooms failed {(time.monotonic() - t0) * 1000:.0f} ms after their info")
    for room in (kept, cleared):
        assert "prefill_bootstrap thread on engine_rank=0 died" in decode.failure_records[room]
        assert room not in prefill.transfer_infos, "a failed room's info was stored"


def test_a_prefill_side_failure_tells_the_decode_with_its_reason(pd):
    prefill, decode, peer, sender, _ = pd
    room = open_pd_room(prefill, decode)
    sender.send(peer.transfer_info(room))
    assert wait_until(lambda: prefill.request_status[room] == KVPoll.WaitingForInput)
    # As CommonKVSender.abort fails it (an AbortReq on the prefill, a client that went away).
    prefill.record_failure(room, "Aborted by AbortReq.")
    prefill.update_status(room, KVPoll.Failed)
    assert decode_failed_by_now(prefill, decode, room)
    assert decode.failure_records[room] == "Aborted by AbortReq."


def test_a_decode_abort_is_not_echoed_back(pd):
    prefill, decode, peer, sender, _ = pd
    room = open_pd_room(prefill, decode)
    sender.send(peer.transfer_info(room))
    assert wait_until(lambda: prefill.request_status[room] == KVPoll.WaitingForInput)
    decode.record_failure(room, "Aborted by AbortReq.")
    decode.update_status(room, KVPoll.Failed)
    sender.send(peer.abort(room))
    assert wait_until(lambda: prefill.failure_records.get(room) == ABORTED)
    # A later status from the prefill would land before this one; there is none.
    later = open_pd_room(prefill, decode)
    sender.send(peer.transfer_info(later))
    assert wait_until(lambda: prefill.request_status[later] == KVPoll.WaitingForInput)
    prefill.record_failure(later, "marker")
    prefill.update_status(later, KVPoll.Failed)
    assert decode_failed_by_now(prefill, decode, later)
    assert decode.failure_records[room] == "Aborted by AbortReq."


def test_the_decode_behind_a_malformed_message_is_told(pd):
    """A transfer info whose agent name does not decode: the decode that sent it fails its room
    at once; for a room the prefill has not opened yet, the prefill fails it when it opens."""
    prefill, decode, peer, sender, _ = pd
    live = open_pd_room(prefill, decode)
    not_yet = new_room()
    open_room_on(decode, not_yet, KVPoll.WaitingForInput)
    for room in (live, not_yet):
        bad = peer.transfer_info(room)
        bad[4] = b"\xff\xfe"
        sender.send(bad)
    assert decode_failed(decode, live) and decode_failed(decode, not_yet)
    assert "could not handle a transfer_info message" in decode.failure_records[live]
    assert prefill.request_status[live] == KVPoll.Failed
    prefill.update_status(not_yet, KVPoll.Bootstrapping)  # the prefill's sender opens it
    assert prefill.request_status[not_yet] == KVPoll.Failed
    assert "could not handle" in prefill.failure_records[not_yet]


def test_failed_registration_fails_the_peers_rooms_until_it_registers(pd, nixl_logs):
    prefill, decode, peer, sender, _ = pd
    # The prefill has two KV regions and the decode registers none: upstream's
    # _prepare_payload_xfer refuses the peer ("decode registered fewer KV regions").
    prefill.kv_args.kv_item_lens = [64, 64]
    sender.send(peer.registration())
    sender.send(peer.registration())
    rooms = [open_pd_room(prefill, decode) for _ in range(2)]
    for room in rooms:
        sender.send(peer.transfer_info(room))
    for room in rooms:
        assert decode_failed(decode, room)
        assert "fewer KV regions" in decode.failure_records[room]
        assert prefill.request_status[room] == KVPoll.Failed  # never ready, no forward pass
        assert "fewer KV regions" in prefill.failure_records[room]
        assert room not in prefill.transfer_infos
    errors = [
        r.getMessage()
        for r in nixl_logs.records
        if r.levelno == logging.ERROR and "could not register" in r.getMessage()
    ]
    assert len(errors) == 1, errors
    assert peer.name in errors[0] and "fewer KV regions" in errors[0]
    # Geometry agrees again (here on the prefill's side): the next registration clears it.
    prefill.kv_args.kv_item_lens = []
    sender.send(peer.registration())
    good = open_pd_room(prefill, decode)
    sender.send(peer.transfer_info(good))
    assert wait_until(lambda: prefill.request_status[good] == KVPoll.WaitingForInput)
    assert decode.request_status[good] == KVPoll.WaitingForInput


class RaisingCounter:
    """A counter whose every write fails, as with a vanished multiprocess directory."""

    def labels(self, **labels):
        return self

    def inc(self, amount=1):
        raise FileNotFoundError(2, "No such file or directory", "/tmp/prometheus/counter.db")


def test_a_metric_that_raises_stops_no_failure_path(agents, monkeypatch, nixl_logs):
    monkeypatch.setattr(NixlKVManager, "_control_thread_events_total", RaisingCounter())
    prefill = bare_manager(DisaggregationMode.PREFILL, agents["prefill"], engine_rank=0)
    failing = FailingSocket(prefill.server_socket)
    prefill.server_socket = failing
    thread = prefill._start_bootstrap_thread()
    peer = Peer(agents["peer"], engine_rank=1, port=40001)
    sender = Sender(prefill.rank_port)
    try:
        named = open_room(prefill)
        sender.send(peer.transfer_info(named)[:5])  # dropped, and its room failed
        assert wait_until(lambda: prefill.request_status[named] == KVPoll.Failed)
        waiting = [open_room(prefill) for _ in range(3)]
        failing.fail.set()  # a death: its waiting rooms fail at once
        assert wait_until(
            lambda: all(prefill.request_status[r] == KVPoll.Failed for r in waiting), 1.0
        )
        after = open_room(prefill)
        sender.send(peer.abort(after))
        assert wait_until(lambda: prefill.request_status[after] == KVPoll.Failed, 2.0)
        assert thread.is_alive()
        assert prefill.control_thread_events[("prefill_bootstrap", "death")] == 1
        lines = [
            r.getMessage() for r in nixl_logs.records if "metric not updated" in r.getMessage()
        ]
        assert len(lines) == 1 and "FileNotFoundError" in lines[0]
    finally:
        sender.close()
        peer.close()
        stop(prefill, thread)


def test_a_socket_that_stays_broken_is_closed_and_rebound(pd):
    prefill, decode, peer, sender, failing = pd
    port = prefill.rank_port
    failing.broken.set()
    assert wait_until(
        lambda: prefill.control_thread_events.get(("prefill_bootstrap", "socket_rebound")), 3.0
    )
    assert failing.closed and prefill.server_socket is not failing
    assert prefill.rank_port == port  # the port the decode ranks know
    room = open_pd_room(prefill, decode)
    sender.send(peer.transfer_info(room))
    assert wait_until(lambda: prefill.request_status[room] == KVPoll.WaitingForInput, 3.0)


def test_control_thread_health_reports_liveness_and_the_last_death(pd):
    prefill, decode, peer, sender, failing = pd
    health = prefill.control_thread_health()
    assert health["healthy"] and health["threads"]["prefill_bootstrap"]["alive"]
    assert health["threads"]["prefill_bootstrap"]["last_death"] is None
    before = time.time()
    failing.fail.set()
    assert wait_until(
        lambda: prefill.control_thread_health()["threads"]["prefill_bootstrap"]["deaths"]
    )
    bootstrap = prefill.control_thread_health()["threads"]["prefill_bootstrap"]
    assert "ZMQError: injected socket failure" in bootstrap["last_death"]
    assert before <= bootstrap["last_death_at"] <= time.time()  # a wall-clock stamp of the death
    assert wait_until(lambda: prefill.control_thread_health()["healthy"])  # it restarted
    # A thread that stops for good leaves the rank unhealthy, and says why.
    other = bare_manager(DisaggregationMode.DECODE, decode.agent, engine_rank=2)
    stop(other, other._start_decode_listener_thread())
    health = other.control_thread_health()
    listener = health["threads"]["decode_listener"]
    assert not health["healthy"] and not listener["alive"]
    assert listener["stopped"] == "its ZMQ context was terminated"
