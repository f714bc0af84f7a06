"""A decode that fails a room keeps the room's KV slots out of its free list until the prefill
acknowledges the abort or is declared dead (nixl-bootstrap-cascade).

Prefill and decode are test/support/pd_rank.py processes on loopback: real NIXL agents (UCX),
upstream's bootstrap server, the decode's heartbeat checker, receiver and listener, the prefill's
bootstrap thread and its abort-ack path; on the decode, upstream's KV allocator, request rows,
Req and DecodeTransferQueue's deferred release. What stands in there, and why, is in that
script's docstring (the prefill's transfer worker is played: `inflight` / `drain` count a chunk
in flight as it does).

Upstream holds such slots too, but frees them once SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_
RELEASE_TIMEOUT passes without an ack (30 s by default; 0.5 s here, so that rule shows within the
test): a prefill still writing, hung or cut off could then write into slots another request owns.
"""

from __future__ import annotations

import socket
import time

import pytest
from sglang.srt.disaggregation.base.conn import KVPoll
from support.nixl import HOST
from support.pd_process import START_S, Rank

RELEASE_TIMEOUT_S = 0.5
# How long a failed room is watched while its prefill has not acked: upstream's rule would have
# freed its slots four times over. A hang guard, not a bound on the fix.
WATCH_S = 4 * RELEASE_TIMEOUT_S
SLOTS = 2 * 256  # what pd_rank's decode allocates for a room opened with open_kv: two pages


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_pair(tmp_path) -> tuple[Rank, Rank]:
    port = free_port()
    env = {
        "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": str(RELEASE_TIMEOUT_S),
        "PD_RANK_KV": "1",
    }
    prefill = Rank("prefill", port, tmp_path / "prefill.log", env=env)
    decode = Rank("decode", port, tmp_path / "decode.log", env=env)
    prefill.expect(lambda e: e.get("held"), START_S)
    prefill.send("start")
    prefill.expect(lambda e: e.get("ready"), 10)
    decode.expect(lambda e: e.get("ready"), START_S)
    return prefill, decode


def tables(decode: Rank) -> dict:
    decode.send("tables")
    return decode.expect(lambda e: "tables" in e, 5)["tables"]


def fail_a_room_mid_transfer(prefill: Rank, decode: Rank, room: int) -> None:
    """The decode aborts a room while a chunk of it is in flight on the prefill; its slots must
    stay held, out of the free list, however long the prefill takes."""
    prefill.send(f"open {room}")
    decode.send(f"open_kv {room}")
    prefill.room(room, KVPoll.WaitingForInput, 10)
    prefill.send(f"inflight {room}")
    # Counted before the abort is sent: an abort that reached the prefill first would find
    # nothing in flight and be acked at once (what a prefill with no chunk queued does).
    prefill.expect(lambda e: e.get("inflight") == room, 5)
    decode.send(f"abort {room}")
    decode.expect(lambda e: e.get("room") == room and e.get("held"), 5)
    prefill.room(room, KVPoll.Failed, 5)  # it read the decode's failure; its chunk still runs
    time.sleep(WATCH_S)
    decode.send(f"kv {room}")
    state = decode.expect(lambda e: e.get("kv") == room, 5)
    assert state["held"] and not state["pages_free"], (
        f"room {room}: the decode freed its KV slots before the prefill acked the abort ({state})"
    )
    held = tables(decode)
    assert (held["quarantined_rooms"], held["quarantined_slots"]) == (1, SLOTS), held


@pytest.mark.slow
def test_failed_rooms_slots_are_freed_only_when_the_prefill_acks(tmp_path):
    prefill, decode = start_pair(tmp_path)
    try:
        fail_a_room_mid_transfer(prefill, decode, 201)
        # The chunk's writes are done: the prefill acks, and only then the slots are freed.
        t0 = time.monotonic()
        prefill.send("drain 201")
        released = decode.expect(lambda e: e.get("room") == 201 and e.get("released"), 10)
        print(f"\nprefill drained -> quarantined slots freed in {time.monotonic() - t0:.2f} s")
        assert released["pages_free"], f"room 201 released, its pages not free: {released}"
        after = tables(decode)
        assert (after["quarantined_rooms"], after["quarantined_slots"]) == (0, 0), after
    finally:
        for rank in (prefill, decode):
            rank.kill()


@pytest.mark.slow
def test_failed_rooms_slots_are_freed_when_the_prefill_is_declared_dead(tmp_path):
    prefill, decode = start_pair(tmp_path)
    try:
        fail_a_room_mid_transfer(prefill, decode, 202)
        t0 = time.monotonic()
        prefill.kill()  # kill -9: it never acks; the decode's heartbeat declares it dead
        released = decode.expect(lambda e: e.get("room") == 202 and e.get("released"), 10)
        print(f"\nkill -9 prefill -> quarantined slots freed in {time.monotonic() - t0:.2f} s")
        assert released["pages_free"], f"room 202 released, its pages not free: {released}"
        after = tables(decode)
        assert (after["quarantined_rooms"], after["quarantined_slots"]) == (0, 0), after
    finally:
        for rank in (prefill, decode):
            rank.kill()
