"""nixl-control-health: /health of a PD server fails while a NIXL control thread is down or stalled.

Register entry
  Target:      sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController._add_disaggregation
               sglang.srt.entrypoints.http_server.health_generate
  Why:         Upstream's /health probe answers 200 once any scheduler output arrives, over a fake
               bootstrap that bypasses NIXL, so it cannot see the connector's control threads: a
               prefill whose bootstrap thread stopped or hangs serves 200 while its requests wait
               out the 300 s bootstrap timeout.
  How:         The scheduler's state readback carries every TP rank's NIXL control-thread health
               (nixl_control_threads, also in /server_info), and /health and /health_generate of a
               PD server answer 503 with one line naming the thread, rank and cause (stopped,
               restarting in vain, or stalled: loop heartbeat older than its bound) while one is
               down (server marked UnHealthy, ERROR logged once, Up again when they serve), then run
               upstream's health_generate unchanged.
  Upstream:    not upstream
  Remove when: upstream's health probe of a PD server covers the transfer backend's control threads.

How, in detail
  The scheduler's state readback (_add_disaggregation) carries
  `nixl_control_threads`, the control_thread_health() of every TP rank's NIXL
  manager (nixl-bootstrap-cascade: liveness, deaths, the loop heartbeat's age and
  `down`), gathered over the TP group, which every rank handles the request on (with
  DP attention each DP leader reports itself); /server_info shows it. /health and
  /health_generate of a PD server read it first (get_internal_state, 5 s bound; no
  answer leaves it to upstream's probe) and answer 503 with one line naming thread,
  engine rank, why (stopped, restarting in vain, or stalled: its loop heartbeat older
  than the bound) and the last death while a thread is down, mark the server
  UnHealthy (so /ready fails too, as for a failed probe) and log it at ERROR once;
  when the threads serve again it logs so and marks the server Up. Otherwise
  upstream's health_generate runs unchanged. FastAPI keeps the function a route was
  declared with, so the new endpoint takes the routes over (register.Routes: the
  hook re-points them, the patch moves the decorators). Not covered: with
  --tokenizer-worker-num > 1, uvicorn's workers import the app without loading
  plugins (the patched delivery covers them).
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request
from fastapi.responses import Response
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.entrypoints.http_server import get_global_state, health_generate
from sglang.srt.environ import envs
from sglang.srt.managers.scheduler_components.internal_state import _DECODE_GRAPH_PHASES
from sglang.srt.managers.tokenizer_manager import ServerStatus
from sglang.srt.runtime_context import get_disagg, get_parallel

from sglang_dsv4.fix import Add, Fix, Replace, Routes

_HTTP = "sglang.srt.entrypoints.http_server"
_STATE = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"


# --- written as they would stand in .../managers/scheduler_components/internal_state.py --------


def _add_disaggregation(self, state) -> None:
    # The PD role, the decode CUDA-graph batch sizes and their memory (what a router feeds back
    # on a role switch), and the health of the NIXL control threads behind this scheduler.
    scheduler = self.scheduler
    mode = getattr(scheduler, "disaggregation_mode", None)
    if mode is None:
        return  # init_disaggregation has not run yet
    graph_gb = state["memory_usage"]["graph"]
    state["disaggregation_mode"] = mode.value
    state["decode_cuda_graph_bs"] = scheduler.tp_worker.get_decode_cuda_graph_bs()
    decode_graphs_gb = sum(graph_gb[phase] for phase in _DECODE_GRAPH_PHASES)
    state["decode_cuda_graph_memory_gb"] = round(decode_graphs_gb, 3)
    nixl_control_threads = self._nixl_control_threads()
    if nixl_control_threads is not None:
        state["nixl_control_threads"] = nixl_control_threads


def _nixl_control_threads(self) -> list | None:
    """control_thread_health() of this scheduler's NIXL manager, one entry per rank that handles
    this request, or None without a NIXL manager (another transfer backend, no PD).

    Each TP rank runs its own control threads, and only rank 0 answers the tokenizer: without DP
    attention every TP rank handles each control request in the same order (it is broadcast over
    the TP group), so they all reach this gather. With DP attention each DP leader reports
    itself."""
    scheduler = self.scheduler
    queue = scheduler.disagg_prefill_bootstrap_queue
    if queue is None:
        queue = scheduler.disagg_decode_prealloc_queue
    health = getattr(getattr(queue, "kv_manager", None), "control_thread_health", None)
    if health is None:
        return None
    mine = health()
    group = scheduler.tp_group
    if get_parallel().attn_dp_enabled or group.world_size == 1:
        return [mine]
    return group.all_gather_object(mine)


# --- written as they would stand in sglang/srt/entrypoints/http_server.py ----------------------


async def health_with_nixl_control_threads(request: Request) -> Response:
    """`/health` and `/health_generate` of a PD server: 503, naming the thread, while a NIXL
    control thread of a scheduler rank is down (stopped, or restarting in vain); otherwise
    upstream's probe, health_generate."""
    manager = get_global_state().tokenizer_manager
    if (
        get_disagg().disaggregation_mode != DisaggregationMode.NULL.value
        and manager.server_status != ServerStatus.Starting
        and not manager.gracefully_exit
        and not envs.SGLANG_DIAG_BYPASS_HEALTH_GENERATE.get()
    ):
        down = await _nixl_control_threads_down(manager)
        if down:
            manager.server_status = ServerStatus.UnHealthy
            return Response(content=down, status_code=503, media_type="text/plain")
    return await health_generate(request)


async def _nixl_control_threads_down(manager, timeout_s: float = 5.0) -> str | None:
    """Why a NIXL control thread of a scheduler rank cannot serve (one line), or None.

    Read through get_internal_state, bounded by `timeout_s`: a scheduler that does not answer
    is left to health_generate's probe. A change is logged once; the server is marked Up again
    when the threads it was marked UnHealthy for serve again."""
    # The http server's logger under either delivery (this function's module differs).
    log = logging.getLogger(health_generate.__module__)
    try:
        states = await asyncio.wait_for(manager.get_internal_state(), timeout_s)
    except asyncio.TimeoutError:
        log.warning("Health check: no NIXL control-thread state within %.0f s", timeout_s)
        return None
    down = [
        f"NIXL {role} thread on engine_rank={rank['engine_rank']} is {thread['down']}"
        + (f" (last death: {thread['last_death']})" if thread["last_death"] else "")
        for state in states
        for rank in state.get("nixl_control_threads") or ()
        for role, thread in rank["threads"].items()
        if thread["down"]
    ]
    cause = "; ".join(down) or None
    if cause != getattr(manager, "nixl_control_threads_down", None):
        if cause:
            log.error("Health check failed: %s", cause)
        else:
            log.info("Health check: the NIXL control threads serve again")
            if manager.server_status == ServerStatus.UnHealthy:
                manager.server_status = ServerStatus.Up
        manager.nixl_control_threads_down = cause
    return cause

# --- the register entry ------------------------------------------------------------------------

FIX = Fix(
    id="nixl-control-health",
    title="/health of a PD server fails while a NIXL control thread is down or stalled",
    area="disaggregation",
    why=(
        "Upstream's /health probe answers 200 once any scheduler output arrives, over a fake "
        "bootstrap that bypasses NIXL, so it cannot see the connector's control threads: a "
        "prefill whose bootstrap thread stopped or hangs serves 200 while its requests wait out "
        "the 300 s bootstrap timeout."
    ),
    how=(
        "The scheduler's state readback carries every TP rank's NIXL control-thread health "
        "(nixl_control_threads, also in /server_info), and /health and /health_generate of a "
        "PD server answer 503 with one line naming the thread, rank and cause (stopped, "
        "restarting in vain, or stalled: loop heartbeat older than its bound) while one is "
        "down (server marked UnHealthy, ERROR logged once, Up again when they serve), then run "
        "upstream's health_generate unchanged."
    ),
    upstream="not upstream",
    remove_when=(
        "upstream's health probe of a PD server covers the transfer backend's control threads."
    ),
    tests=("test/behaviour/test_pd_health.py",),
    targets=(f"{_STATE}._add_disaggregation", f"{_HTTP}.health_generate"),
    replaces=(Replace(f"{_STATE}._add_disaggregation", _add_disaggregation, "(self, state)"),),
    adds=(
        Add(_STATE, _nixl_control_threads),
        Add(
            _HTTP,
            health_with_nixl_control_threads,
            takes_routes=Routes("health_generate", "(request)"),
        ),
        Add(_HTTP, _nixl_control_threads_down),
    ),
)
