"""How long each test waited with nothing to do: the time during which no thread of this
process, nor of any process it started, was running or ready to run.

A sampler thread reads the state of every such thread (/proc/PID/task/TID/stat) every
SAMPLE_S; a sample in which none is running (R) counts SAMPLE_S of idle time for the test in
progress. A test that sleeps out a hang guard, or waits for a thread or a peer that is gone,
shows as idle; one waiting on a server that computes for it does not (the server is a child),
and neither does one held up by a busy machine (its threads are ready to run). The terminal
summary lists each test idle for more than `report_s`, so each run's log (each of
rebase-check's deliveries too) says whether any wait outlasted what it waited for. Reported,
never asserted: the figures are the machine's.
"""

from __future__ import annotations

import os
import threading

import psutil
import pytest

SAMPLE_S = 0.5
REPORT_S = 10.0


def _running(pid: int, skip_tid: int) -> bool:
    """Whether any thread of `pid` (other than `skip_tid`) is running or runnable."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        if int(tid) == skip_tid:
            continue
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.rfind(b")") + 2:][:1] == b"R":
            return True
    return False


class IdleTime:
    def __init__(self, report_s: float = REPORT_S, sample_s: float = SAMPLE_S):
        self.report_s, self.sample_s = report_s, sample_s
        self.idle: list[tuple[float, str]] = []  # (idle seconds, node id) over report_s
        self._current: str | None = None
        self._seconds = 0.0
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="idle-time", daemon=True)

    def _sample(self) -> None:
        me, sampler = os.getpid(), threading.get_native_id()
        while not self._stop.wait(self.sample_s):
            if self._current is None:
                continue
            pids = [me]
            try:
                pids += [p.pid for p in psutil.Process(me).children(recursive=True)]
            except psutil.Error:
                pass
            if not any(_running(pid, sampler) for pid in pids):
                self._seconds += self.sample_s

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if not self._sampler.is_alive():
            self._sampler.start()
        self._seconds, self._current = 0.0, item.nodeid
        yield
        self._current = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        # The teardown report carries the test's idle seconds: it reaches the process that
        # prints the summary (with pytest-xdist, the controller, not the worker that measured).
        report = (yield).get_result()
        if report.when == "teardown":
            report.user_properties.append(("idle_seconds", round(self._seconds, 1)))

    def pytest_runtest_logreport(self, report):
        if report.when == "teardown":
            idle = dict(report.user_properties).get("idle_seconds", 0.0)
            if idle > self.report_s:
                self.idle.append((idle, report.nodeid))

    def pytest_unconfigure(self, config):
        self._stop.set()

    def pytest_terminal_summary(self, terminalreporter):
        write = terminalreporter.write_line
        if not self.idle:
            write(f"idle waits: no test was idle for more than {self.report_s:g} s")
            return
        write(f"idle waits: {len(self.idle)} tests idle for more than {self.report_s:g} s "
              "(no thread of the test's processes running or ready to run)")
        for idle, node in sorted(self.idle, reverse=True):
            write(f"  idle {idle:6.1f} s  {node}")
