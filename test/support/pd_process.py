"""Drive test/support/pd_rank.py processes: commands in, JSON events out, killed with their group.

Used by the loopback test (test_pd_two_process.py) and the two-host one (test_pd_two_hosts.py),
where a rank runs inside a network namespace (support/netns.py).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

RANK_SCRIPT = Path(__file__).resolve().parent / "pd_rank.py"
# Deadline for a process to import and configure itself: about 12 s of CPU each (importing
# sglang and torch), far longer in wall time on a shared, loaded machine. The fault timings
# do not depend on it.
START_S = 150


class Rank:
    """One pd_rank.py process. With `hosts` (a netns.TwoHosts) it runs on host `side`."""

    def __init__(
        self,
        role: str,
        bootstrap_port: int,
        log: Path,
        hosts=None,
        side: str | None = None,
        env: dict | None = None,
    ):
        self.role, self.log = role, log
        argv = [sys.executable, str(RANK_SCRIPT), role, str(bootstrap_port)]
        kwargs = dict(
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.open("w"),
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        if hosts is None:
            # its own process group, so kill -9 takes all of it
            self.proc = subprocess.Popen(argv, start_new_session=True, **kwargs)
        else:
            self.proc = hosts.popen(side, argv, **kwargs)
        self.events: queue.Queue = queue.Queue()
        self.seen: list[tuple[float, dict]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                event = json.loads(line)
                self.seen.append((time.monotonic(), event))
                self.events.put(event)
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

    def statuses(self, room: int) -> list[int]:
        """Every status this rank reported for `room` so far, in order."""
        return [e["status"] for _, e in self.seen if e.get("room") == room and "status" in e]

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
        self.proc.wait(10)
