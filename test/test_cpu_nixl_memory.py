"""The CPU backend's NIXL memory (cpu_backend/nixl_hooks.py): upstream's NixlKVManager registers a
CPU server's buffers and writes between them as host memory, on real NIXL agents with UCX.

The managers are built without their constructor (test/support/nixl.py says why); what runs is
upstream's `register_buffer_to_engine` through the hook and NIXL's own agents. The PD end-to-end
test (test/e2e/test_pd.py) runs the same hook inside real prefill and decode servers.
"""

from __future__ import annotations

import contextlib
import json
import os
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from nixl._bindings import nixlBackendError
from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.nixl.conn import NixlKVManager
from sglang_dsv4 import cpu_backend, warm_python
from sglang_dsv4.cpu_backend import nixl_hooks, nixl_progress
from support.nixl import HANG_GUARD_S, ucx_agent

PAGE = 4096


def host_manager(role: str, fill: int) -> tuple[NixlKVManager, dict[str, torch.Tensor]]:
    """A manager whose KV, aux and state buffers are host tensors, as on a --device cpu server,
    with upstream's default memory kinds (VRAM) and a GPU id that is not 0."""
    buffers = {
        "kv": torch.full((4 * PAGE,), fill, dtype=torch.uint8),
        "aux": torch.zeros(PAGE, dtype=torch.uint8),
        "state": torch.full((2 * PAGE,), fill, dtype=torch.uint8),
    }
    mgr = object.__new__(NixlKVManager)
    mgr.agent = ucx_agent(role)
    args = KVArgs()
    args.gpu_id, args.engine_rank = 3, 0
    args.kv_data_ptrs, args.kv_data_lens = [buffers["kv"].data_ptr()], [buffers["kv"].numel()]
    args.kv_data_mem_kinds = ["VRAM"]
    args.aux_data_ptrs, args.aux_data_lens = [buffers["aux"].data_ptr()], [PAGE]
    args.state_data_ptrs = [[buffers["state"].data_ptr()]]
    args.state_data_lens = [[buffers["state"].numel()]]
    mgr.kv_args = args
    return mgr, buffers


def test_upstream_registration_of_host_buffers_as_vram_is_refused():
    """Why the hook exists: UCX without CUDA refuses a host buffer named VRAM."""
    mgr, _ = host_manager("plain", 0)
    with pytest.raises(nixlBackendError):
        mgr.register_buffer_to_engine()


def test_host_buffers_register_and_a_vram_write_lands_byte_for_byte():
    prefill, src = host_manager("prefill", 0)
    decode, dst = host_manager("decode", 0)
    for mgr in (prefill, decode):
        nixl_hooks.register_buffer_to_engine(mgr)
        assert isinstance(mgr.agent, nixl_hooks.HostMemoryAgent)
        assert mgr.kv_descs and mgr.aux_descs and mgr.state_descs
    nixl_hooks.register_buffer_to_engine(prefill)  # a second call does not wrap twice
    assert not isinstance(prefill.agent._agent, nixl_hooks.HostMemoryAgent)

    src["kv"][PAGE : 2 * PAGE] = torch.randint(0, 256, (PAGE,), dtype=torch.uint8)
    dst["kv"][:] = 0xAB
    peer = prefill.agent.add_remote_agent(decode.agent.get_agent_metadata())
    # Descriptors as upstream's send path builds them: VRAM, the GPU's id.
    src_reqs = np.array([[src["kv"].data_ptr() + PAGE, PAGE, 3]], dtype=np.uint64)
    dst_reqs = np.array([[dst["kv"].data_ptr() + 2 * PAGE, PAGE, 3]], dtype=np.uint64)
    handle = prefill.agent.initialize_xfer(
        "WRITE",
        prefill.agent.get_xfer_descs(src_reqs, "VRAM"),
        prefill.agent.get_xfer_descs(dst_reqs, "VRAM"),
        peer,
    )
    state = prefill.agent.transfer(handle)
    deadline = time.monotonic() + HANG_GUARD_S  # a hang guard, not a speed bound
    while state not in ("DONE", "ERR") and time.monotonic() < deadline:
        state = prefill.agent.check_xfer_state(handle)
    assert state == "DONE"
    assert torch.equal(dst["kv"][2 * PAGE : 3 * PAGE], src["kv"][PAGE : 2 * PAGE])
    # Nothing else of the destination was written.
    assert bool((dst["kv"][: 2 * PAGE] == 0xAB).all() and (dst["kv"][3 * PAGE :] == 0xAB).all())
    prefill.agent.release_xfer_handle(handle)


def test_descriptors_that_name_no_gpu_pass_unchanged():
    arr = np.array([[1, 2, 7]], dtype=np.uint64)
    assert nixl_hooks.host_descs(arr)[0, 2] == 0 and arr[0, 2] == 7  # a copy, device 0
    assert nixl_hooks.host_descs([(1, 2, 7, "x")]) == [(1, 2, 0, "x")]
    tensor = torch.zeros(4)
    assert nixl_hooks.host_descs(tensor) is tensor


def _thread_cpu_ticks() -> dict[str, int]:
    """{thread id: user + system clock ticks} of this process's threads."""
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            ticks[tid] = int(fields[11]) + int(fields[12])
    return ticks


def test_an_idle_agents_progress_thread_sleeps():
    """nixl's default progress thread polls with a zero timeout, a core per agent for its whole
    life; through nixl_progress the threads an agent starts take next to no CPU while nothing
    moves (at most a quarter of a core over a second of idling: a poll pass a millisecond costs
    well under 1%)."""
    before = _thread_cpu_ticks()
    agent = ucx_agent("idle")
    start = {tid: t for tid, t in _thread_cpu_ticks().items() if tid not in before}
    assert start, "the agent started no thread"
    time.sleep(1.0)
    now = _thread_cpu_ticks()
    used_s = sum(now.get(tid, t) - t for tid, t in start.items()) / os.sysconf("SC_CLK_TCK")
    assert used_s < 0.25, f"the agent's threads used {used_s:.2f} s of CPU in 1 s of idling"
    del agent


def test_the_idle_wait_raises_the_delay_of_every_agent_with_a_progress_thread(monkeypatch):
    import nixl._api as api

    nixl_progress.install()
    assert nixl_progress.install() is False  # once per process
    bindings = api.nixlBind
    assert isinstance(bindings, nixl_progress.IdleWaitBindings)
    config = bindings.nixlAgentConfig()
    config.useProgThread, config.pthrDelay = True, 0  # what nixl_agent.__init__ sets
    assert bindings.nixlAgent("delay-check", config) is not None
    assert config.pthrDelay == nixl_progress.IDLE_WAIT_US
    quiet = bindings.nixlAgentConfig()
    quiet.useProgThread, quiet.pthrDelay = False, 0  # no thread: nothing to change
    bindings.nixlAgent("no-thread-check", quiet)
    assert quiet.pthrDelay == 0

    monkeypatch.setattr(api, "nixlBind", object())  # a nixl that builds agents otherwise
    with pytest.raises(RuntimeError, match="idle-waiting progress thread cannot be applied"):
        nixl_progress.install()


# A --device cpu server's scheduler, as far as the hook goes: the plugin loaded the way upstream's
# server loads it, the NIXL module imported (which installs the hook), a manager registered.
SERVER_PROCESS = """
import json, sys
sys.argv = ["sglang.launch_server", "--model-path", {model!r}, "--device", "cpu"]
sys.path.insert(0, {test_dir!r})
from sglang.srt.plugins import load_plugins
load_plugins()
import sglang.srt.disaggregation.nixl.conn
from sglang_dsv4 import plugin
plugin.settle()
import nixl._api
from sglang_dsv4.cpu_backend.nixl_progress import IdleWaitBindings
idle_wait = isinstance(nixl._api.nixlBind, IdleWaitBindings)  # before any test agent exists
from test_cpu_nixl_memory import host_manager
from sglang_dsv4.cpu_backend.nixl_hooks import HostMemoryAgent
mgr, _ = host_manager("server", 0)
mgr.register_buffer_to_engine()
print(json.dumps({{"status": plugin.STATE["cpu-backend-nixl"].status,
                   "wrapped": isinstance(mgr.agent, HostMemoryAgent),
                   "kv_descs": len(mgr.kv_descs), "idle_wait": idle_wait}}))
"""


def test_a_cpu_server_installs_the_hook_through_upstreams_registry(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV4ForCausalLM"]}))
    script = SERVER_PROCESS.format(model=str(tmp_path), test_dir=str(Path(__file__).parent))
    env = {k: v for k, v in os.environ.items() if k != cpu_backend.ENV}
    proc = warm_python.run(["-c", textwrap.dedent(script)], env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"status": "applied", "wrapped": True, "kv_descs": 1, "idle_wait": True}


def _early_send_case():
    """A CPU prefill scheduler with overlap on and a request whose first 512 tokens (two pages)
    were found in its radix cache. Stand-ins, and why: the scheduler and the request carry only
    what the mixin's method reads (a real scheduler needs a model and its processes); the
    forward stream is the one upstream's ModelRunner makes on this device."""
    from types import SimpleNamespace

    sent = []
    scheduler = SimpleNamespace(
        enable_overlap=True,
        enable_staging=False,
        forward_stream=torch.get_device_module("cpu").Stream(),
        token_to_kv_pool_allocator=SimpleNamespace(page_size=256),
        send_kv_chunk=lambda req, last_chunk=False, end_idx=None: sent.append((last_chunk, end_idx)),
    )
    req = SimpleNamespace(
        pending_bootstrap=False, prefix_len=512, host_hit_length=0, start_send_idx=0,
        early_send_prefix_end=None, disagg_kv_sender=SimpleNamespace(_early_send_wait_event=None),
    )
    return scheduler, req, sent


def test_a_cpu_prefill_sends_a_cached_prefix_early_without_a_cuda_event():
    """Upstream records a torch.cuda.Event on the forward stream before the early send; on the
    CPU that raises (a PD prefill server's scheduler died of it on a retried prompt). Through
    the CPU backend the prefix is sent (up to the cached end, not as the last chunk), with no
    event to wait for, and the scheduler's overlap setting is as it was."""
    from sglang.srt.environ import envs

    assert envs.SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX.get()  # upstream's default: on
    scheduler, req, sent = _early_send_case()
    upstream = nixl_hooks._UPSTREAM["maybe_send_cached_prefix_chunk"]
    with pytest.raises(RuntimeError, match="stream"):
        upstream(scheduler, req)
    assert sent == []

    scheduler, req, sent = _early_send_case()
    nixl_hooks.maybe_send_cached_prefix_chunk(scheduler, req)
    assert sent == [(False, 512)]
    assert req.disagg_kv_sender._early_send_wait_event is None
    assert scheduler.enable_overlap is True
