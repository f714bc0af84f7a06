"""The CPU backend's NIXL memory: a `--device cpu` prefill or decode registers and moves its KV,
state and aux buffers as host memory (NIXL "DRAM") where upstream names them "VRAM".

Upstream 0.5.23's NixlKVManager registers the KV buffers with the memory kinds the decode
announces (VRAM by default), the compress/SWA state buffers and every transfer descriptor as
VRAM with the GPU's id. On a CPU those buffers are host memory: UCX refuses to register them as
VRAM (NIXL_ERR_BACKEND at register_memory), so a CPU prefill server stops at start-up. Here the
manager's agent is wrapped, once, before upstream registers anything: each call that names a
memory kind (register_memory, get_reg_descs, get_xfer_descs, get_remote_descs,
prep_xfer_dlist) has VRAM read as DRAM, device 0. The bytes moved, the descriptors' addresses
and lengths, and upstream's transfer logic are untouched.

A CPU prefill also sends a radix-cached prefix early (SchedulerDisaggregationPrefillMixin.
maybe_send_cached_prefix_chunk) without the CUDA event upstream records for it under overlap
scheduling: torch.cuda.Event cannot record a CPU stream, and the scheduler died of it on the
first prompt a PD prefill found in its cache (a request the router retried). The event makes the
transfer wait for the previous forward's writes on the GPU stream; a CPU forward has written
them when it returns, so there is nothing to wait for.

Loading these hooks also makes the process's NIXL progress threads wait when idle instead of
polling a core flat out (`nixl_progress`).
"""

from __future__ import annotations

import numpy as np
from sglang.srt.disaggregation.nixl.conn import NixlKVManager
from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

from sglang_dsv4.cpu_backend import nixl_progress
from sglang_dsv4.fix import Fix, Replace

# Before upstream's NixlKVManager builds its agent (this module loads when upstream imports
# nixl.conn, ahead of any manager).
nixl_progress.install()

ID = "cpu-backend-nixl"
MODULE = "sglang.srt.disaggregation.nixl.conn"
_MANAGER = f"{MODULE}.NixlKVManager"
_PREFILL = "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin"

# Upstream's own method, kept before the hook replaces it: the hook adds the wrapping and runs it.
# In a dict, not a module attribute: upstream's HookRegistry rebinds every module attribute that
# still names a replaced function (`_propagate_patch`), which would make the hook call itself.
_UPSTREAM = {
    "register_buffer_to_engine": NixlKVManager.register_buffer_to_engine,
    "maybe_send_cached_prefix_chunk": (
        SchedulerDisaggregationPrefillMixin.maybe_send_cached_prefix_chunk
    ),
}


def host_descs(descs):
    """Descriptors that named a GPU (device id in the third field) as host descriptors: device 0.
    Lists of tuples and N x 3 arrays are rewritten; anything else (tensors, descriptor lists
    already built) passes unchanged."""
    if isinstance(descs, np.ndarray) and descs.ndim == 2 and descs.shape[1] >= 3:
        out = descs.copy()
        out[:, 2] = 0
        return out
    if isinstance(descs, list) and descs and isinstance(descs[0], tuple):
        return [(d[0], d[1], 0, *d[3:]) for d in descs]
    return descs


class HostMemoryAgent:
    """A NIXL agent whose VRAM is host memory: every other attribute is the agent's own."""

    def __init__(self, agent):
        self._agent = agent

    def __getattr__(self, name):
        return getattr(self._agent, name)

    def _host(self, descs, mem_type):
        if mem_type == "VRAM":
            return host_descs(descs), "DRAM"
        return descs, mem_type

    def register_memory(self, reg_list, mem_type=None, backends=()):
        reg_list, mem_type = self._host(reg_list, mem_type)
        return self._agent.register_memory(reg_list, mem_type, list(backends))

    def get_reg_descs(self, descs, mem_type=None):
        return self._agent.get_reg_descs(*self._host(descs, mem_type))

    def get_xfer_descs(self, descs, mem_type=None):
        return self._agent.get_xfer_descs(*self._host(descs, mem_type))

    def get_remote_descs(self, descs, mem_type=None):
        return self._agent.get_remote_descs(*self._host(descs, mem_type))

    def prep_xfer_dlist(self, agent_name, xfer_list, mem_type=None, backends=()):
        xfer_list, mem_type = self._host(xfer_list, mem_type)
        return self._agent.prep_xfer_dlist(agent_name, xfer_list, mem_type, list(backends))


def register_buffer_to_engine(self):
    """Upstream's registration, on an agent that reads VRAM as host memory."""
    if not isinstance(self.agent, HostMemoryAgent):
        self.agent = HostMemoryAgent(self.agent)
    return _UPSTREAM["register_buffer_to_engine"](self)


def maybe_send_cached_prefix_chunk(self, req, allow_send=True):
    """Upstream's early send of a cached prefix, without its CUDA completion event: the
    scheduler runs it as a non-overlap one would (see the module's docstring)."""
    overlap = self.enable_overlap
    self.enable_overlap = False  # read by that call alone, on this (the scheduler's) thread
    try:
        return _UPSTREAM["maybe_send_cached_prefix_chunk"](self, req, allow_send)
    finally:
        self.enable_overlap = overlap


FIX = Fix(
    id=ID,
    title="CPU backend: NIXL registers and moves a CPU server's buffers as host memory; a CPU "
    "prefill sends a cached prefix early without a CUDA event",
    area="cpu",
    why=(
        "Upstream registers KV, state and transfer descriptors as VRAM; UCX refuses host "
        "buffers as VRAM, so a --device cpu prefill or decode cannot start. A PD prefill "
        "records a CUDA event to send a cached prefix early: on the CPU its scheduler dies."
    ),
    how="The manager's agent reads VRAM as DRAM (device 0) in every call that names a kind; "
    "the early send runs as without overlap scheduling (a CPU forward is done when it returns).",
    upstream="not for upstream: development and tests only",
    remove_when="never: it is how PD runs without a GPU",
    targets=(f"{_MANAGER}.register_buffer_to_engine", f"{_PREFILL}.maybe_send_cached_prefix_chunk"),
    replaces=(
        Replace(f"{_MANAGER}.register_buffer_to_engine", register_buffer_to_engine, "(self)"),
        Replace(
            f"{_PREFILL}.maybe_send_cached_prefix_chunk",
            maybe_send_cached_prefix_chunk,
            "(self, req, allow_send=True)",
        ),
    ),
)
