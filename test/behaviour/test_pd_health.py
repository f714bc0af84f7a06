"""`/health` of a PD server fails while a NIXL control thread is down (nixl-bootstrap-cascade).

Real upstream code: the HTTP application of sglang.srt.entrypoints.http_server with its
`/health`, `/health_generate` and `/ready` routes and upstream's health_generate probe, served
through Starlette's TestClient; SchedulerInternalStateController.get_internal_state, the whole
readback a scheduler answers a GetInternalStateReq with; NixlKVManager's control threads on
loopback ZMQ with real NIXL agents (UCX); the runtime config published from a real ServerArgs.

Stand-ins, and why: the tokenizer manager (a real one needs a model and running schedulers)
answers get_internal_state with that real readback, and generate_request with one output at
once; the scheduler (a real one needs a GPU) holds the attributes the readback reads and the
real manager in its bootstrap or prealloc queue; a TP group of two ranks returns this rank's
health and a second real manager's, as the gloo all-gather between two scheduler processes
would; FailingSocket (support/nixl.py) stands in for a socket that fails on every receive and
whose port another process holds.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import zmq
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.entrypoints import http_server
from sglang.srt.managers.io_struct import GetInternalStateReq
from sglang.srt.managers.scheduler_components.internal_state import (
    SchedulerInternalStateController,
)
from sglang.srt.managers.tokenizer_manager import ServerStatus
from sglang.srt.runtime_context import get_server_args, publish, publish_role, reset_context
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang_dsv4.plan import default_model_dir
from starlette.testclient import TestClient
from support.nixl import HOST, FailingSocket, bare_manager, stop, ucx_agent, wait_until

HTTP_LOGGER = "sglang.srt.entrypoints.http_server"


@contextmanager
def published(disaggregation_mode: str):
    """A scheduler's runtime config for this PD role ("null": no PD), the previous one after."""
    try:
        before = get_server_args(), publish_role()
    except ValueError:  # nothing published yet
        before = None
    args = ServerArgs(model_path=str(default_model_dir()), page_size=256, device="cpu")
    if disaggregation_mode != "null":
        args = ServerArgs(
            model_path=str(default_model_dir()),
            page_size=256,
            device="cpu",
            disaggregation_mode=disaggregation_mode,
            disaggregation_transfer_backend="nixl",
        )
    publish(args, role="scheduler")
    try:
        yield
    finally:
        if before is None:
            reset_context()
        else:
            publish(before[0], role=before[1])


class TwoRanks:
    """The scheduler's TP group of two ranks: the gather returns rank 1's own health too."""

    world_size = 2

    def __init__(self, rank1):
        self.rank1 = rank1

    def all_gather_object(self, mine):
        return [mine, self.rank1.control_thread_health()]


def scheduler_with(mode: DisaggregationMode, manager, tp_group=None):
    """What SchedulerInternalStateController reads of a scheduler, with the manager in place."""
    queue = SimpleNamespace(kv_manager=manager)
    prefill = mode == DisaggregationMode.PREFILL
    return SimpleNamespace(
        disaggregation_mode=mode,
        disagg_prefill_bootstrap_queue=queue if prefill else None,
        disagg_decode_prealloc_queue=None if prefill else queue,
        tp_group=tp_group or SimpleNamespace(world_size=1),
        startup_time=0.0,
        max_running_requests=4,
        metrics_reporter=SimpleNamespace(last_gen_throughput=0.0),
        tp_worker=SimpleNamespace(
            model_runner=SimpleNamespace(weight_load_mem_usage=0.0),
            graph_memory_usage=None,
            get_decode_cuda_graph_bs=lambda: [],
        ),
        token_to_kv_pool_allocator=SimpleNamespace(
            get_kvcache=lambda: SimpleNamespace(mem_usage=0.0)
        ),
        startup_available_gpu_memory_gb=0.0,
        max_total_num_tokens=0,
        swa_tokens_per_layer=None,
        draft_worker=None,
        spec_algorithm=SpeculativeAlgorithm.NONE,
        rust_server=None,
    )


class TokenizerManager:
    """The HTTP process's view of the schedulers: their real readback, and one output at once
    for every request (as a live scheduler gives the health probe)."""

    def __init__(self, scheduler):
        self.controller = SchedulerInternalStateController(scheduler, record_step_time=False)
        self.server_args, self.startup_time = get_server_args(), 0.0  # for /server_info
        self.server_status = ServerStatus.Up
        self.gracefully_exit = False
        self.is_generation = True
        self.is_pause = False
        self.last_receive_tstamp = 0.0
        self.rid_to_state = {}
        self.state_reads = self.probes = 0
        self.answers = True

    async def get_internal_state(self):
        self.state_reads += 1
        if not self.answers:
            await asyncio.sleep(3600)  # a scheduler that never answers
        reply = self.controller.get_internal_state(GetInternalStateReq())
        return [reply.internal_state]

    async def generate_request(self, obj, request=None):
        self.probes += 1
        self.last_receive_tstamp = time.time()
        yield {"text": "", "meta_info": {"id": obj.rid}}

    def is_healthy(self):
        return not self.gracefully_exit and self.server_status == ServerStatus.Up

    def is_ready(self):
        return not self.is_pause and self.is_healthy()


@pytest.fixture(scope="module")
def agents():
    return [ucx_agent("health") for _ in range(3)]


@pytest.fixture
def serve(agents):
    """serve(mode, manager, tp_group=None) -> (HTTP client, tokenizer manager) of upstream's app."""
    saved = getattr(http_server, "_global_state", None)
    stack = []

    def start(mode, manager, tp_group=None):
        tokenizer = TokenizerManager(scheduler_with(mode, manager, tp_group))
        http_server.set_global_state(
            http_server._GlobalState(
                tokenizer_manager=tokenizer, template_manager=None, scheduler_info={}
            )
        )
        client = TestClient(http_server.app)
        stack.append(client)
        return client, tokenizer

    yield start
    for client in stack:
        client.close()
    http_server.set_global_state(saved)


@pytest.fixture
def prefill(agents):
    managers = []

    def make(engine_rank=0, failing=False):
        mgr = bare_manager(DisaggregationMode.PREFILL, agents[engine_rank], engine_rank)
        if failing:  # before the thread starts: it reads the socket once per (re)start
            mgr.server_socket = FailingSocket(mgr.server_socket)
        mgr.thread = mgr._start_bootstrap_thread()
        managers.append(mgr)
        return mgr

    yield make
    for mgr in managers:
        if isinstance(mgr.server_socket, FailingSocket):
            mgr.server_socket.broken.clear()
            mgr.server_socket.keep_port.clear()
        if not mgr._zmq_ctx.closed:
            stop(mgr, mgr.thread)


@pytest.fixture
def http_logs(caplog):
    caplog.set_level(logging.INFO, logger=HTTP_LOGGER)
    return caplog


def test_health_runs_upstreams_probe_while_the_threads_serve(serve, prefill):
    with published("prefill"):
        client, tokenizer = serve(DisaggregationMode.PREFILL, prefill())
        answer = client.get("/health_generate")
    assert answer.status_code == 200
    assert tokenizer.state_reads == 1 and tokenizer.probes == 1


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_stopped_control_thread_makes_the_server_unhealthy(serve, agents, role, http_logs):
    mode = DisaggregationMode(role)
    mgr = bare_manager(mode, agents[0], engine_rank=0)
    if mode == DisaggregationMode.PREFILL:
        thread = mgr._start_bootstrap_thread()
    else:
        thread = mgr._start_decode_listener_thread()
    stop(mgr, thread)  # its context terminated: the thread stops for good
    with published(role):
        client, tokenizer = serve(mode, mgr)
        health = client.get("/health")
        ready = client.get("/ready")
    thread_name = "prefill_bootstrap" if role == "prefill" else "decode_listener"
    assert health.status_code == 503
    assert health.text == (
        f"NIXL {thread_name} thread on engine_rank=0 is stopped: its ZMQ context was terminated"
    )
    assert tokenizer.probes == 0  # refused before upstream's probe
    assert tokenizer.server_status == ServerStatus.UnHealthy
    assert ready.status_code == 503  # upstream's /ready follows the server status
    errors = [
        r.getMessage()
        for r in http_logs.records
        if r.name == HTTP_LOGGER and r.levelno == logging.ERROR
    ]
    assert errors == [f"Health check failed: {health.text}"]


def test_a_thread_restarting_in_vain_is_down_until_it_serves_again(serve, prefill, http_logs):
    mgr = prefill(failing=True)
    failing = mgr.server_socket
    failing.keep_port.set()  # the re-bind finds the port held
    failing.broken.set()
    with published("prefill"):
        client, tokenizer = serve(DisaggregationMode.PREFILL, mgr)
        # Deaths at once, 0.1 s later, then after each failed re-bind (1 s of retries).
        assert wait_until(lambda: not mgr.control_thread_health()["healthy"], 10.0)
        health = client.get("/health")
        assert health.status_code == 503
        assert re.fullmatch(
            r"NIXL prefill_bootstrap thread on engine_rank=0 is restarting in vain: died "
            r"[3-9] times in a row without serving a message \(last death: NIXL "
            r"prefill_bootstrap thread on engine_rank=0 died \(ZMQError: injected socket "
            r"failure, for good\)\)",
            health.text,
        ), health.text
        assert tokenizer.server_status == ServerStatus.UnHealthy
        # The socket works again: the next message it serves makes the thread healthy.
        failing.broken.clear()
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(f"tcp://{HOST}:{mgr.rank_port}")
        push.send_multipart([b"not a NIXL message"])
        received = mgr.pd_control.threads["prefill_bootstrap"]
        assert wait_until(lambda: received.received > received.received_at_last_death, 15)
        push.close()
        health = client.get("/health")
    assert health.status_code == 200, health.text
    assert tokenizer.server_status == ServerStatus.Up
    assert "Health check: the NIXL control threads serve again" in http_logs.messages


def test_a_down_thread_on_another_tp_rank_fails_the_server(serve, prefill):
    rank0, rank1 = prefill(0), prefill(1)
    stop(rank1, rank1.thread)
    with published("prefill"):
        client, _ = serve(DisaggregationMode.PREFILL, rank0, TwoRanks(rank1))
        health = client.get("/health")
        info = client.get("/server_info")
    assert health.status_code == 503
    assert health.text.startswith("NIXL prefill_bootstrap thread on engine_rank=1 is stopped")
    # Every rank's threads are in the scheduler's readback, which /server_info shows too.
    ranks = info.json()["internal_states"][0]["nixl_control_threads"]
    assert [(r["engine_rank"], r["healthy"]) for r in ranks] == [(0, True), (1, False)]
    assert ranks[1]["threads"]["prefill_bootstrap"]["stopped"] == "its ZMQ context was terminated"


def test_a_scheduler_that_does_not_answer_is_left_to_upstreams_probe(serve, prefill):
    with published("prefill"):
        client, tokenizer = serve(DisaggregationMode.PREFILL, prefill())
        tokenizer.answers = False
        health = client.get("/health_generate")
    assert health.status_code == 200 and tokenizer.probes == 1


def test_a_server_without_pd_does_not_ask_the_schedulers(serve, prefill):
    with published("null"):
        client, tokenizer = serve(DisaggregationMode.NULL, None)
        health = client.get("/health_generate")
    assert health.status_code == 200
    assert tokenizer.state_reads == 0 and tokenizer.probes == 1
