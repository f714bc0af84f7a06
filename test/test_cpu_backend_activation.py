"""When the CPU backend turns itself on, and that it hooks nothing anywhere else.

The plugin runs through upstream's own `load_plugins()` in a fresh interpreter whose command line
is the server's (`sys.argv` as `python -m sglang.launch_server ...` leaves it).
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import sglang
from sglang_dsv4 import cpu_backend, warm_python
from sglang_dsv4.fixes import REGISTER
from sglang_dsv4.maintain.export import __name__ as _export_module  # noqa: F401  (imports cleanly)


@pytest.fixture
def dsv4_dir(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"})
    )
    return tmp_path


def test_decision_needs_device_cpu_and_a_deepseek_v4_model(dsv4_dir, tmp_path_factory):
    other = tmp_path_factory.mktemp("llama")
    (other / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    launch = ["sglang.launch_server", "--model-path"]
    assert cpu_backend.decide([*launch, str(dsv4_dir), "--device", "cpu"], {})[0]
    assert cpu_backend.decide([*launch, str(dsv4_dir), "--device=cpu"], {})[0]
    assert not cpu_backend.decide([*launch, str(dsv4_dir), "--device", "cuda"], {})[0]
    assert not cpu_backend.decide([*launch, str(dsv4_dir)], {})[0]
    assert not cpu_backend.decide([*launch, str(other), "--device", "cpu"], {})[0]
    # the launching process's decision, inherited by its schedulers, wins over their argv
    assert cpu_backend.decide([], {cpu_backend.ENV: "1"})[0]
    assert not cpu_backend.decide([*launch, str(dsv4_dir), "--device", "cpu"],
                                  {cpu_backend.ENV: "0"})[0]
    with pytest.raises(ValueError, match=cpu_backend.ENV):
        cpu_backend.decide([], {cpu_backend.ENV: "maybe"})


def test_entries_set_upstream_switches_and_record_the_decision(dsv4_dir):
    environ = {"SGLANG_SM120_FLASHMLA_BACKEND": "flashinfer"}
    argv = ["x", "--model-path", str(dsv4_dir), "--device", "cpu"]
    entry, index, nixl, hicache, invariant = cpu_backend.entries(argv, environ)
    assert index.id == "cpu-backend-index"
    assert nixl.id == "cpu-backend-nixl"
    assert nixl.upstream_modules == (
        "sglang.srt.disaggregation.nixl.conn", "sglang.srt.disaggregation.prefill"
    )
    assert hicache.id == "cpu-backend-hicache"
    assert hicache.upstream_modules == (
        "sglang.srt.mem_cache.pool_host.base", "sglang.srt.mem_cache.pool_host.common",
        "sglang.srt.mem_cache.memory_pool_host")
    assert invariant.id == "cpu-backend-batch-invariant"
    assert invariant.upstream_modules == ("sglang.srt.batch_invariant_ops",
                                          "sglang.srt.layers.layernorm")
    assert entry.id == cpu_backend.ID and entry.upstream_modules == cpu_backend.UPSTREAM_MODULES
    assert environ[cpu_backend.ENV] == "1"
    for name, value in cpu_backend.SWITCHES.items():
        assert environ[name] == value
    environ = {}
    assert cpu_backend.entries(["x", "--model-path", str(dsv4_dir)], environ) == ()
    assert environ == {cpu_backend.ENV: "0"}


def test_not_in_the_register_so_never_exported_nor_rebase_checked():
    assert cpu_backend.ID not in {e.id for e in REGISTER}
    from sglang_dsv4.cpu_backend.hooks import FIX

    assert FIX.upstream.startswith("not for upstream")
    assert set(FIX.targets) == {r.target for r in FIX.replaces}
    assert {t.rsplit(".", 1)[0] for t in FIX.targets} <= {
        m for m in cpu_backend.UPSTREAM_MODULES
    } | {f"{m}.{c}" for m in cpu_backend.UPSTREAM_MODULES for c in (
        "CompressorPrefillPlan", "CompressorDecodePlan", "DSATopKBackend")}


PROBE = """
import json, sys
sys.argv = {argv!r}
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang_dsv4 import cpu_backend, plugin
state = {{k: v.status for k, v in plugin.STATE.items()}}
if state.get(cpu_backend.ID) is not None:
    plugin.settle()
    state = {{k: v.status for k, v in plugin.STATE.items()}}
from sglang.srt.plugins.hook_registry import HookRegistry
ours = sorted(t for t in HookRegistry._patched if t.startswith(("sglang.kernels", "sglang.srt.layers.rotary", "sglang.srt.layers.attention.dsa")) or t.endswith("_torch_sm120"))
import os, torch
print(json.dumps({{"state": state, "ours": ours, "describe": cpu_backend.describe(plugin.STATE),
                   "switch": os.environ.get("SGLANG_SM120_FLASHMLA_BACKEND"),
                   "threads": torch.get_num_threads()}}))
"""


def run_probe(argv):
    env = {k: v for k, v in os.environ.items() if k != cpu_backend.ENV}
    proc = warm_python.run(["-c", textwrap.dedent(PROBE.format(argv=argv))], env=env,
                           timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_gpu_run_gets_no_hook_and_no_switch(dsv4_dir):
    out = run_probe(["sglang.launch_server", "--model-path", str(dsv4_dir), "--device", "cuda"])
    assert cpu_backend.ID not in out["state"]
    assert out["ours"] == [] and out["switch"] is None
    assert out["describe"]["hooks"] == 0 and out["describe"]["summary"].startswith("off, 0 hooks")


def test_cpu_run_applies_every_target(dsv4_dir):
    from sglang_dsv4.cpu_backend.hooks import FIX

    out = run_probe(["sglang.launch_server", "--model-path", str(dsv4_dir), "--device", "cpu"])
    assert out["state"][cpu_backend.ID] == "applied"
    assert sorted(out["ours"]) == sorted(FIX.targets)
    assert out["switch"] == "torch"
    assert out["describe"]["on"] and out["describe"]["hooks"] == len(FIX.replaces)
    assert out["threads"] == 1  # one intra-op thread unless SGLANG_DSV4_CPU_THREADS says more


def test_torch_threads_default_to_one_and_follow_the_variable():
    assert cpu_backend.torch_threads({}) == 1
    assert cpu_backend.torch_threads({cpu_backend.THREADS_ENV: "3"}) == 3
    for bad in ("0", "two", "-1"):
        with pytest.raises(ValueError, match=cpu_backend.THREADS_ENV):
            cpu_backend.torch_threads({cpu_backend.THREADS_ENV: bad})


def test_triton_path_is_opt_in(dsv4_dir):
    argv = ["x", "--model-path", str(dsv4_dir), "--device", "cpu"]
    # by default the bf16 index logits take the torch op; opting in, the Triton kernel instead
    assert [e.id for e in cpu_backend.entries(argv, {})] == [
        cpu_backend.ID, "cpu-backend-index", "cpu-backend-nixl", "cpu-backend-hicache",
        "cpu-backend-batch-invariant"]
    both = cpu_backend.entries(argv, {cpu_backend.TRITON_ENV: "1"})
    assert [e.id for e in both] == [
        cpu_backend.ID, "cpu-backend-triton", "cpu-backend-nixl", "cpu-backend-hicache",
        "cpu-backend-batch-invariant"]
    from sglang_dsv4.cpu_backend import index_hooks

    assert [r.target for r in index_hooks.FIX.replaces] == [
        "sgl_kernel_dsv4.index_logits.bf16_paged_mqa_logits"]
    from sglang_dsv4.cpu_backend import triton_hooks

    assert [r.target for r in triton_hooks.FIX.replaces] == list(both[1].upstream_modules and (
        "sgl_kernel_dsv4.index_logits.bf16_paged_mqa_logits",))


def test_a_cpu_server_command_line_without_a_pool_size_gets_the_default_pool(dsv4_dir):
    """Upstream sizes a CPU server's KV pool from the host's free memory (15 GB here, most of a
    start spent zero-filling it); a launch_server command line that sizes none gets
    DEFAULT_POOL_TOKENS, read by upstream's own argument parsing. One that sizes it is kept."""
    from sglang.srt.server_args import prepare_server_args

    launcher = os.path.join(os.path.dirname(sglang.__file__), "launch_server.py")
    argv = [launcher, "--model-path", str(dsv4_dir), "--device", "cpu"]
    cpu_backend._default_pool(argv)
    assert prepare_server_args(argv[1:]).max_total_tokens == cpu_backend.DEFAULT_POOL_TOKENS
    for sized in (["--max-total-tokens", "5000"], ["--mem-fraction-static=0.5"]):
        argv = [launcher, "--model-path", str(dsv4_dir), "--device", "cpu", *sized]
        cpu_backend._default_pool(argv)
        assert argv[5:] == sized
    other = ["/usr/bin/pytest", "-q"]
    cpu_backend._default_pool(other)
    assert other == ["/usr/bin/pytest", "-q"]


def test_a_cpu_server_command_line_gets_sleep_on_idle_unless_it_says_otherwise(dsv4_dir):
    """Upstream's idle scheduler polls its sockets without pause unless given --sleep-on-idle; a
    CPU server gets the flag, read by upstream's own parser. SGLANG_DSV4_CPU_SLEEP_ON_IDLE=0 and a
    --config file (upstream's only way to say false for a store_true flag) keep upstream's
    default; a bad value is refused."""
    from sglang.srt.server_args import prepare_server_args

    launcher = os.path.join(os.path.dirname(sglang.__file__), "launch_server.py")
    base = [launcher, "--model-path", str(dsv4_dir), "--device", "cpu"]
    argv = list(base)
    cpu_backend._default_sleep_on_idle(argv, {})
    assert prepare_server_args(argv[1:]).sleep_on_idle is True
    assert prepare_server_args(base[1:]).sleep_on_idle is False  # upstream's default
    given = [*base, "--sleep-on-idle"]
    cpu_backend._default_sleep_on_idle(given, {})
    assert given.count("--sleep-on-idle") == 1
    for environ in ({cpu_backend.SLEEP_ENV: "0"}, {cpu_backend.SLEEP_ENV: "off"}):
        kept = list(base)
        cpu_backend._default_sleep_on_idle(kept, environ)
        assert kept == base
    configured = [*base, "--config", "server.yaml"]
    cpu_backend._default_sleep_on_idle(configured, {})
    assert configured == [*base, "--config", "server.yaml"]
    with pytest.raises(ValueError, match=cpu_backend.SLEEP_ENV):
        cpu_backend._default_sleep_on_idle(list(base), {cpu_backend.SLEEP_ENV: "maybe"})
    other = ["/usr/bin/pytest", "-q"]
    cpu_backend._default_sleep_on_idle(other, {})
    assert other == ["/usr/bin/pytest", "-q"]
