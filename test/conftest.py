"""Shared test set-up.

Plugins load through upstream's own `load_plugins()`, as in a server process. With the plugin
installed that applies every fix; with SGLANG_PLUGINS excluding it and a patched upstream tree first
on the path (the exported-patch run of .ci/run), the same behaviour tests run on patched upstream.
"""

import os

os.environ.setdefault("SGLANG_DSV4_INDEX_K_DTYPE", "fp8")


def pytest_configure(config):
    from support.idle_time import IdleTime

    config.pluginmanager.register(IdleTime(), "idle-time")  # each run's log lists idle waits


def pytest_xdist_make_scheduler(config, log):
    """Two workers (pyproject's addopts): test/e2e is one unit of work, run by one worker in
    file order, so its session servers are started once and shared, and a module's next servers
    start while it runs, as in a serial run; every other test is a unit of its own."""
    from xdist.scheduler import LoadScopeScheduling

    class E2EOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return "test/e2e" if nodeid.startswith("test/e2e/") else nodeid

    return E2EOnOneWorker(config, log)


def pytest_sessionstart(session):
    from sglang.srt.plugins import load_plugins

    load_plugins()
