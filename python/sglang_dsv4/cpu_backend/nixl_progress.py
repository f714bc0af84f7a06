"""NIXL's UCX progress thread waits when idle, in a process where the CPU backend is on.

nixl 1.5's Python agent (`nixl._api.nixl_agent.__init__`) builds every agent with a progress
thread delay of 0 (`pthrDelay = 0`), and the UCX plugin's shared progress thread then polls its
workers' event fds with a zero timeout: one core busy for as long as the agent lives, moving
bytes or not. A GPU server gives that core away for the lowest transfer latency. On a 2-core
host running a CPU prefill and decode, two such threads took as much CPU as both forwards; a
1 MiB loopback write took 4.3 ms with them and 0.28 ms without (median of 20, same machine).

Here each agent is built with a delay of IDLE_WAIT_US instead: the thread still wakes at once on
a worker event (poll() returns on the fd), and otherwise sleeps up to that long between passes.
Nothing else of the agent changes. `install` is idempotent; it runs when the CPU backend's NIXL
hooks load (a CPU PD server) and in the test process, whose in-process agents
(test/support/nixl.py) would otherwise each take a core for the rest of the run.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sglang_dsv4")

# The UCX plugin rounds the delay up to whole milliseconds for poll(): 1 ms, the least it waits.
IDLE_WAIT_US = 1000


class IdleWaitBindings:
    """nixl's binding module as `nixl._api` sees it, except that an agent built through it gets
    a progress thread that waits IDLE_WAIT_US when idle."""

    def __init__(self, bindings):
        self._bindings = bindings

    def __getattr__(self, name):
        return getattr(self._bindings, name)

    def nixlAgent(self, name, config):  # noqa: N802 (the binding's own name)
        if config.useProgThread and config.pthrDelay < IDLE_WAIT_US:
            config.pthrDelay = IDLE_WAIT_US
        return self._bindings.nixlAgent(name, config)


def install() -> bool:
    """Route `nixl._api`'s agent construction through IdleWaitBindings. False if it already was.
    Raises RuntimeError when nixl's API no longer builds agents the way this relies on."""
    import nixl._api as api

    bindings = getattr(api, "nixlBind", None)
    if isinstance(bindings, IdleWaitBindings):
        return False
    if bindings is None or not hasattr(bindings, "nixlAgent"):
        raise RuntimeError(
            f"sglang-dsv4 cpu backend: {api.__name__} builds agents without nixlBind.nixlAgent;"
            " the idle-waiting progress thread cannot be applied to this nixl version"
        )
    api.nixlBind = IdleWaitBindings(bindings)
    logger.info("sglang-dsv4 cpu backend: NIXL progress threads wait %d us when idle",
                IDLE_WAIT_US)
    return True
