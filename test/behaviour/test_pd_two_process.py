"""Prefill and decode in separate OS processes on loopback: kill -9 one, the other fails fast.

Each rank is test/support/pd_rank.py in its own process group: real NIXL agents (UCX), upstream's
real bootstrap server (in the prefill's process, as in a prefill server), the decode's real
heartbeat checker, receiver and listener, the prefill's real bootstrap thread; what stands in
there, and why, is in that script's docstring. Bounded: every wait has a deadline, and every
process is killed with its group in `finally`.
"""

from __future__ import annotations

import socket
import time

import pytest
from sglang.srt.disaggregation.base.conn import KVPoll
from support.nixl import HOST
from support.pd_process import START_S, Rank

# How long a failure may take to reach the other process before the test calls it lost. A liveness
# bound, not a speed target: without the fixes the room waits for upstream's waiting timeout
# (SGLANG_DISAGGREGATION_WAITING_TIMEOUT, 300 s); the time it took is printed, never asserted.
FAILURE_ARRIVES_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_kill_prefill_mid_room_decode_fails_fast_and_a_restarted_prefill_serves(tmp_path):
    port = free_port()
    bootstrap_addr = f"{HOST}:{port}"
    # All three start at once: the restarted prefill is held configured until the first is killed.
    first, decode, restarted = (
        Rank(role, port, tmp_path / f"{i}-{role}.log")
        for i, role in enumerate(("prefill", "decode", "prefill"))
    )
    ranks = [first, decode, restarted]
    try:
        first.expect(lambda e: e.get("held"), START_S)
        first.send("start")
        first.expect(lambda e: e.get("ready"), 10)
        decode_agent = decode.expect(lambda e: e.get("ready"), START_S)["agent"]
        restarted.expect(lambda e: e.get("held"), START_S)

        # A room in flight: the decode registered and sent its metadata, the prefill is ready.
        first.send("open 101")
        decode.send("open 101")
        first.room(101, KVPoll.WaitingForInput, 10)
        decode.room(101, KVPoll.WaitingForInput, 10)

        t0 = time.monotonic()
        first.kill()
        failed = decode.room(101, KVPoll.Failed, FAILURE_ARRIVES_S)
        print(f"\nkill -9 prefill -> decode room failed in {time.monotonic() - t0:.2f} s")
        assert (
            f"Lost connection with prefill instance (bootstrap_addr: {bootstrap_addr})"
            in (failed["reason"])
        )
        assert failed["freed"], "the decode room was not released"

        # The restarted prefill: same bootstrap port, a new rank port and agent.
        restarted.send("start")
        restarted.expect(lambda e: e.get("ready"), 10)
        restarted.send("open 102")
        decode.send("open 102")
        restarted.room(102, KVPoll.WaitingForInput, 10)
        restarted.send("peers")
        assert restarted.expect(lambda e: "peers" in e, 5)["peers"] == [decode_agent]
        restarted.send("finish 102")
        served = decode.room(102, KVPoll.Success, 5)
        assert served["freed"]

        # A failure on the prefill's side reaches the decode process (in well under a second, unloaded).
        # Room 104 is the marker sent after it: once the decode has failed 104, it has all that
        # the prefill sent about 103 (on a tree whose prefill sends nothing, the test fails then).
        for room in (103, 104):
            restarted.send(f"open {room}")
            decode.send(f"open {room}")
            restarted.room(room, KVPoll.WaitingForInput, 10)
        t0 = time.monotonic()
        restarted.send("abort 103")
        restarted.send("flush 104")
        decode.room(104, KVPoll.Failed, FAILURE_ARRIVES_S)
        decode.send("report 103")
        failed = decode.expect(lambda e: e.get("report") == 103, 10)
        assert failed["status"] == KVPoll.Failed, f"the prefill's failure did not reach: {failed}"
        print(f"prefill abort -> decode room failed within {time.monotonic() - t0:.2f} s")
        assert "Aborted by AbortReq." in failed["reason"] and failed["freed"]
    finally:
        for rank in ranks:
            rank.kill()
