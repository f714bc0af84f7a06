"""PD across a real network: a prefill and a decode on two hosts (network namespaces joined by a
veth pair), broken the ways a network and its processes break. Whichever side fails a room
first, the other side's room fails too, with the reason (nixl-bootstrap-cascade).

Each rank is test/support/pd_rank.py in its own namespace: real NIXL agents (UCX over TCP),
upstream's bootstrap server in the prefill's process, the decode's real heartbeat checker,
receiver and listener, the prefill's real bootstrap thread; what stands in there, and why, is in
that script's docstring. The faults are real: `ip link set down/up` on both ends of the veth pair,
SIGSTOP/SIGCONT of a whole process, kill -9.

The tests share one prefill and two decodes (three processes take minutes to start on a loaded
machine) and run in file order; each leaves the pair serving, except the kills at the end. Waits
are bounded and generous; no assertion reads the clock: the seconds each side took are printed.
Every process and both namespaces are removed at the end (support/netns.py).
"""

from __future__ import annotations

import signal
import time

import pytest
from sglang.srt.disaggregation.base.conn import KVPoll
from support import netns
from support.pd_process import START_S, Rank

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(netns.available() is not None, reason=str(netns.available())),
]

BOOTSTRAP_PORT = 18998
FAULT_S = 60  # bound for a side to see a fault: far above the few seconds either needs
LOST_PREFILL = "Lost connection with prefill instance"
LOST_DECODE = "Lost connection with decode instance"

_rooms = iter(range(7001, 8000))


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("two-hosts")
    with netns.TwoHosts() as hosts:
        prefill = Rank(
            "prefill", BOOTSTRAP_PORT, logs / "prefill.log", hosts, "a", {"PD_RANK_HOST": hosts.a}
        )
        decodes = [
            Rank(
                "decode",
                BOOTSTRAP_PORT,
                logs / f"decode{i}.log",
                hosts,
                "b",
                {"PD_RANK_HOST": hosts.b, "PD_RANK_PREFILL_HOST": hosts.a},
            )
            for i in range(2)
        ]
        prefill.expect(lambda e: e.get("held"), START_S)
        prefill.send("start")
        prefill.expect(lambda e: e.get("ready"), 30)
        for decode in decodes:
            decode.expect(lambda e: e.get("ready"), START_S)
        yield hosts, prefill, decodes
        for rank in (prefill, *decodes):
            rank.kill()
    assert not hosts.exists(), "a namespace was left behind"


def open_room(prefill: Rank, decode: Rank) -> int:
    """A request in flight: the decode registered and sent its metadata, both sides wait."""
    room = next(_rooms)
    prefill.send(f"open {room}")
    decode.send(f"open {room}")
    prefill.room(room, KVPoll.WaitingForInput, 30)
    decode.room(room, KVPoll.WaitingForInput, 30)
    return room


def serves(prefill: Rank, decode: Rank) -> None:
    """A new request goes through end to end (the pair recovered)."""
    room = open_room(prefill, decode)
    prefill.send(f"finish {room}")
    assert decode.room(room, KVPoll.Success, 30)["freed"]


def test_link_cut_fails_the_room_on_both_sides_and_the_pair_serves_after_restore(pd):
    hosts, prefill, (decode, _) = pd
    room = open_room(prefill, decode)
    t0 = time.monotonic()
    hosts.cut()
    try:
        on_decode = decode.room(room, KVPoll.Failed, FAULT_S)
        t_decode = time.monotonic() - t0
        on_prefill = prefill.room(room, KVPoll.Failed, FAULT_S)
        t_prefill = time.monotonic() - t0
    finally:
        hosts.restore()
    print(f"\nlink cut: decode room failed in {t_decode:.2f} s, prefill room in {t_prefill:.2f} s")
    print(f"  decode: {on_decode['reason']}\n  prefill: {on_prefill['reason']}")
    assert LOST_PREFILL in on_decode["reason"] and on_decode["freed"]
    assert LOST_DECODE in on_prefill["reason"] or LOST_PREFILL in on_prefill["reason"]
    serves(prefill, decode)


def test_a_stopped_prefill_learns_on_waking_that_the_decode_gave_the_room_up(pd):
    """The decode fails the room while the prefill is stopped; after SIGCONT the prefill fails
    it too, before the transfer could finish into slots the decode gave up: `finish` then
    concludes nothing (issue item 1: it concluded Success)."""
    _, prefill, (decode, _) = pd
    room = open_room(prefill, decode)
    t0 = time.monotonic()
    prefill.signal(signal.SIGSTOP)
    try:
        on_decode = decode.room(room, KVPoll.Failed, FAULT_S)
        t_decode = time.monotonic() - t0
    finally:
        prefill.signal(signal.SIGCONT)
    t1 = time.monotonic()
    on_prefill = prefill.room(room, KVPoll.Failed, FAULT_S)
    t_prefill = time.monotonic() - t1
    print(
        f"\nSIGSTOP prefill: decode room failed in {t_decode:.2f} s; after SIGCONT the prefill "
        f"room failed in {t_prefill:.2f} s\n  prefill: {on_prefill['reason']}"
    )
    assert LOST_PREFILL in on_decode["reason"]
    assert f"Decode failed the room: {LOST_PREFILL}" in on_prefill["reason"]
    prefill.send(f"finish {room}")
    serves(prefill, decode)  # served after the finish above
    assert KVPoll.Success not in prefill.statuses(room), prefill.statuses(room)


def test_a_stopped_decode_is_declared_dead_by_the_prefill(pd):
    """Heartbeat both ways: the prefill learns a hung decode as the decode learns a hung
    prefill; once the decode runs again it hears the prefill's failure."""
    _, prefill, (decode, _) = pd
    room = open_room(prefill, decode)
    t0 = time.monotonic()
    decode.signal(signal.SIGSTOP)
    try:
        on_prefill = prefill.room(room, KVPoll.Failed, FAULT_S)
        t_prefill = time.monotonic() - t0
    finally:
        decode.signal(signal.SIGCONT)
    t1 = time.monotonic()
    on_decode = decode.room(room, KVPoll.Failed, FAULT_S)
    t_decode = time.monotonic() - t1
    print(
        f"\nSIGSTOP decode: prefill room failed in {t_prefill:.2f} s; after SIGCONT the decode "
        f"room failed in {t_decode:.2f} s\n  prefill: {on_prefill['reason']}"
    )
    assert LOST_DECODE in on_prefill["reason"]
    assert LOST_DECODE in on_decode["reason"] and on_decode["freed"]
    serves(prefill, decode)


def test_a_killed_decode_fails_its_rooms_on_the_prefill(pd):
    """Issue item 2: the prefill's rooms of a killed decode stayed WaitingForInput."""
    _, prefill, (decode, _) = pd
    room = open_room(prefill, decode)
    t0 = time.monotonic()
    decode.kill()
    on_prefill = prefill.room(room, KVPoll.Failed, FAULT_S)
    print(f"\nkill -9 decode: prefill room failed in {time.monotonic() - t0:.2f} s")
    assert LOST_DECODE in on_prefill["reason"]


def test_a_killed_prefill_fails_its_rooms_on_the_decode(pd):
    _, prefill, (_, decode) = pd
    room = open_room(prefill, decode)
    t0 = time.monotonic()
    prefill.kill()
    on_decode = decode.room(room, KVPoll.Failed, FAULT_S)
    print(f"\nkill -9 prefill: decode room failed in {time.monotonic() - t0:.2f} s")
    assert LOST_PREFILL in on_decode["reason"] and on_decode["freed"]
