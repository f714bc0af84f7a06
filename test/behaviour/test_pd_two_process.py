"""Prefill and decode in separate OS processes on loopback: kill -9 one, the other fails fast.

Each rank is test/support/pd_rank.py in its own process group: real NIXL agents (UCX), upstream's
real bootstrap server (in the prefill's process, as in a prefill server), the decode's real
heartbeat checker, receiver and listener, the prefill's real bootstrap thread; what stands in
there, and why, is in that script's docstring. Bounded: every wait has a deadline, and every
process is killed with its group in `finally`.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sglang.srt.disaggregation.base.conn import KVPoll
from support.nixl import HOST

RANK_SCRIPT = Path(__file__).resolve().parents[1] / "support" / "pd_rank.py"
# Deadline for a process to import and configure itself: about 12 s of CPU each (importing
# sglang and torch), far longer in wall time on a shared, loaded machine. The fault timings
# below do not depend on it.
START_S = 150


class Rank:
    """One pd_rank.py process: commands in, JSON events out, killed with its process group."""

    def __init__(self, role: str, bootstrap_port: int, log: Path):
        self.role, self.log = role, log
        self.proc = subprocess.Popen(
            [sys.executable, str(RANK_SCRIPT), role, str(bootstrap_port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
            start_new_session=True,  # its own process group, so kill -9 takes all of it
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))
        self.events.put({"exited": self.proc.poll()})

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def expect(self, match, timeout_s: float) -> dict:
        """The first event `match` accepts; fails the test at the deadline or if the process ends."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                event = self.events.get(timeout=max(left, 0.001))
            except queue.Empty:
                pytest.fail(
                    f"{self.role}: no matching event within {timeout_s} s; its log ends: "
                    f"{self.log.read_text()[-3000:]}"
                )
            assert "exited" not in event, f"{self.role} ended: {self.log.read_text()[-3000:]}"
            if match(event):
                return event

    def room(self, room: int, status: int, timeout_s: float) -> dict:
        return self.expect(lambda e: e.get("room") == room and e["status"] == status, timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)


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
        failed = decode.room(101, KVPoll.Failed, 2.0)
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

        # A failure on the prefill's side reaches the decode process within a second.
        restarted.send("open 103")
        decode.send("open 103")
        restarted.room(103, KVPoll.WaitingForInput, 10)
        t0 = time.monotonic()
        restarted.send("abort 103")
        failed = decode.room(103, KVPoll.Failed, 1.0)
        print(f"prefill abort -> decode room failed in {time.monotonic() - t0:.2f} s")
        assert "Aborted by AbortReq." in failed["reason"] and failed["freed"]
    finally:
        for rank in ranks:
            rank.kill()
