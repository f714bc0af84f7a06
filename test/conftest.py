"""Shared test set-up.

Plugins load through upstream's own `load_plugins()`, as in a server process. With the plugin
installed that applies every fix; with SGLANG_PLUGINS excluding it and a patched upstream tree first
on the path (the exported-patch run of .ci/run), the same behaviour tests run on patched upstream.
"""

import os

os.environ.setdefault("SGLANG_DSV4_INDEX_K_DTYPE", "fp8")


def pytest_sessionstart(session):
    from sglang.srt.plugins import load_plugins

    load_plugins()
