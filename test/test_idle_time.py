"""support.idle_time, the idle-wait report every run's log carries, on a real inner pytest run:
a test that sleeps is reported idle; one that computes in its own process, or waits for a child
process that computes, is not (on a busy machine too: a thread ready to run is not idle)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_sleeping_test_is_idle_and_a_computing_one_is_not(pytester, workers):
    # With workers (pytest-xdist, as the test command runs) each is a process of its own that
    # measures; the controller prints the summary from their reports.
    pytester.makeconftest(
        f"""
        import sys

        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from support.idle_time import IdleTime

        def pytest_configure(config):
            config.pluginmanager.register(IdleTime(report_s=0.5, sample_s=0.05), "inner")
        """
    )
    pytester.makepyfile(
        """
        import subprocess, sys, time

        def busy(seconds):
            end = time.process_time() + seconds
            while time.process_time() < end:
                pass

        def test_sleeps():
            time.sleep(1.5)

        def test_computes():
            busy(1.5)

        def test_waits_for_a_computing_child():
            subprocess.run([sys.executable, "-c",
                            "import time\\nend = time.process_time() + 1.5\\n"
                            "while time.process_time() < end: pass"], check=True)
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-n", workers)
    result.assert_outcomes(passed=3)
    report = [line for line in result.outlines if line.startswith(("idle waits", "  idle"))]
    assert report[0].startswith("idle waits: 1 tests idle for more than 0.5 s"), report
    assert len(report) == 2 and report[1].endswith("::test_sleeps"), report
