"""`sglang-dsv4 kernels`: the Triton kernels compiled ahead of time for GPUs this host lacks.

Real compiles throughout (Triton's compiler, the ptxas and cuobjdump of the triton wheel); only the
residency arithmetic is also checked on its own against CUDA's occupancy rules.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from sgl_kernel_dsv4 import compile_check as check
from sglang_dsv4 import warm_python

REPO = Path(__file__).resolve().parents[1]
SM120 = check.TARGETS["sm_120"]

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="the check compiles: not under the interpreter"
)


def cli(*args, env_extra=None):
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'python'}:{REPO / 'sgl-kernel' / 'python'}"}
    env.pop("TRITON_INTERPRET", None)
    env.update(env_extra or {})
    return warm_python.run(["-m", "sglang_dsv4.cli", "kernels", *args], env=env, cwd=REPO,
                           timeout=900)


@pytest.fixture(scope="module")
def sm120():
    proc = cli("--target", "sm_120", "--json")
    return proc, json.loads(proc.stdout)


def test_residency_follows_cudas_occupancy_rules():
    # 49 KB + the 1 KB the system reserves per block: two programs fill sm_120's 100 KB
    assert check.residency(SM120, 50_176, 0, 128, 4) == (2, "shared memory")
    assert check.residency(SM120, 50_177, 0, 128, 4) == (1, "shared memory")
    # 254 registers x 128 threads round to 32,768 of the 65,536 per SM; 8 warps of 162: one
    assert check.residency(SM120, 1024, 0, 254, 4) == (2, "registers")
    assert check.residency(SM120, 1024, 0, 162, 8) == (1, "registers")
    # past the per-block opt-in limit nothing launches
    fits, why = check.residency(SM120, 101_377, 0, 64, 4)
    assert fits == 0 and "101376" in why
    assert check.residency(check.TARGETS["sm_90"], 98_304, 0, 128, 4)[0] == 2


def test_the_kit_shapes_are_the_gpu_kits(monkeypatch):
    from benchmark.gpu_check.harness import GPU_SIZES

    assert check.KIT_DECODE_BATCHES == GPU_SIZES.decode_batches
    assert check.KIT_DECODE_KEYS == GPU_SIZES.decode_keys
    assert check.KIT_ROTATION_ROWS == GPU_SIZES.rotation_rows
    assert check.INDEX_HEADS == GPU_SIZES.heads


def test_sm120_every_config_compiles_fits_and_does_not_spill(sm120):
    from sgl_kernel_dsv4 import index_logits_triton as logits

    proc, report = sm120
    assert proc.returncode == 0, proc.stderr[-3000:] + json.dumps(report["failures"])
    assert report["ok"] and report["failures"] == []
    results = report["results"]
    swept = check.logits_configs(SM120)
    assert {json.dumps({**c, "heads": h}, sort_keys=True) for c in swept for h in (64, 128)} == {
        json.dumps(r["params"], sort_keys=True)
        for r in results
        if r["kernel"] == "bf16_paged_mqa_logits"
    }
    assert {r["kernel"] for r in results} == {
        "bf16_paged_mqa_logits", "index_query_bf16", "store_index_keys_bf16"
    }
    for r in results:
        assert r["passed"] and r["fits"] and not r["spills"] and r["error"] == "", r
        assert r["resident_per_sm"] >= 1 and r["registers"] > 0
        assert r["shared_bytes"] + r["static_shared_bytes"] <= 101_376
    # the waves follow from the launch rule and the compiled residency
    default = next(
        r for r in results
        if r["kernel"] == "bf16_paged_mqa_logits" and r["params"]["heads"] == 64
        and r["default"]
    )
    assert default["config"] == check.config_label(check.default_logits_config(SM120))
    config = {**default["params"], "sm_count": 188}
    programs = 32 * logits.workers_per_row(32, 81920, 81920 // 64 + 2, config)
    expected = round(programs / (default["resident_per_sm"] * 188), 2)
    assert default["waves"]["B=32 keys=81920"] == expected


def test_sm120_keeps_two_key_tiles_in_flight_in_one_wave(sm120):
    """TTGIR evidence on sm_120 for every logits config: a multi-buffered key memdesc (>= 2
    tiles) and an async_wait that leaves copies in flight; each asks for no more programs per SM
    than fit, so batch 32 x 80k keys is at most one wave."""
    _, report = sm120
    logits = [r for r in report["results"] if r["kernel"] == "bf16_paged_mqa_logits"]
    for r in logits:
        assert r["pipelined"] and r["key_buffers"] >= 2 and max(r["async_waits"]) >= 1, r
        if r["params"]["heads"] == check.INDEX_HEADS:
            assert r["params"]["programs_per_sm"] <= r["resident_per_sm"], r
            assert r["waves"]["B=32 keys=81920"] <= 1.0, r
    [default] = [r for r in logits if r["default"] and r["params"]["heads"] == 64]
    assert default["resident_per_sm"] == 2 and default["shared_bytes"] <= 101_376 // 2


def test_a_default_without_pipelining_fails_the_check():
    from sglang_dsv4 import kernels

    result = check.Result("bf16_paged_mqa_logits", "pps2 ppsm4 w4 s2",
                          {"pages_per_step": 2, "programs_per_sm": 4, "num_warps": 4,
                           "num_stages": 2, "heads": 64}, "sm_120", shared_bytes=50_176,
                          registers=128, num_warps=4, resident_per_sm=2, fits=True,
                          key_buffers=1, async_waits=[0, 0], default=True)
    lines = kernels.problems([result], {}, ["sm_120"], check)
    assert any("asks for 4 programs per SM, 2 fit" in line for line in lines)
    assert any("keeps 1 key tile(s) in flight" in line for line in lines)


def test_the_committed_record_is_what_the_check_finds(sm120):
    _, report = sm120
    assert check.load_record()["sm_120"]["logits_source"] == check.logits_source_digest()
    passed = [json.loads(s) for s in sorted({
        json.dumps({k: v for k, v in r["params"].items() if k != "heads"}, sort_keys=True)
        for r in report["results"] if r["kernel"] == "bf16_paged_mqa_logits"
    })]
    assert sorted(map(json.dumps, check.passed_configs("sm_120"))) == sorted(map(json.dumps, passed))


def test_a_config_that_does_not_fit_fails_the_check(monkeypatch):
    """The same compile held against a GPU with a quarter of sm_120's shared memory."""
    small = replace(SM120, name="small", smem_per_sm=25_600, smem_per_block=24_576)
    monkeypatch.setitem(check.TARGETS, "small", small)
    case = next(c for c in check.cases(small) if c.kernel == "bf16_paged_mqa_logits")
    result = check.check_case(case, small)
    assert not result.fits and not result.passed and result.resident_per_sm == 0
    assert "per block" in result.limited_by
    from sglang_dsv4 import kernels

    lines = kernels.problems([result], {}, ["small"], check)
    assert len(lines) == 1 and "does not fit" in lines[0]


def test_a_spilling_config_fails_the_check():
    """sm_100 at 128 heads, two pages per dot on 4 warps: ptxas spills there (255 registers)."""
    case = next(
        c for c in check.cases(check.TARGETS["sm_100"])
        if c.kernel == "bf16_paged_mqa_logits" and c.params["heads"] == 128
        and c.config == "pps2 ppsm1 w4 s3"
    )
    result = check.check_case(case, check.TARGETS["sm_100"])
    assert result.fits and result.spills and not result.passed
    assert result.spill_store_bytes > 0
    from sglang_dsv4 import kernels

    assert "spills" in kernels.problems([result], {}, ["sm_100"], check)[0]


def test_a_stale_record_fails_the_check(sm120):
    from sglang_dsv4 import kernels

    _, report = sm120
    results = [check.Result(**{k: v for k, v in r.items() if k not in ("spills", "passed", "pipelined")})
               for r in report["results"]]
    record = {"sm_120": {"logits_source": "0" * 16, "passed": []}}
    [line] = kernels.problems(results, record, ["sm_120"], check)
    assert "stale" in line and "--record" in line


def test_the_check_refuses_the_interpreter():
    proc = cli("--target", "sm_120", env_extra={"TRITON_INTERPRET": "1"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "sglang-dsv4 kernels: TRITON_INTERPRET=1 is set: the kernels would only be interpreted"
    )


def test_an_unknown_target_is_one_line():
    proc = cli("--target", "sm_75")
    assert proc.returncode != 0 and "unknown target(s) ['sm_75']" in proc.stderr


# --- the tuned-launch loader takes only what the check passed -----------------------------------


@pytest.fixture
def loader(monkeypatch, tmp_path):
    from types import SimpleNamespace

    import torch
    from sgl_kernel_dsv4 import index_logits_triton as module

    # torch.cuda stands in for a GPU this host does not have
    props = SimpleNamespace(multi_processor_count=188, major=12, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU X")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(module, "TUNED_LAUNCH_FILE", tmp_path / "tuned_launch.json")
    module.load_tuned_launch.cache_clear()
    module._config_for.cache_clear()

    def tuned(config, record):
        module.TUNED_LAUNCH_FILE.write_text(
            json.dumps({"GPU X": {"capability": "12.0", "config": config}})
        )
        record_file = tmp_path / "launch_checked.json"
        record_file.write_text(json.dumps(record))
        monkeypatch.setattr(module, "RECORD_FILE", record_file)
        module.load_tuned_launch.cache_clear()
        module._config_for.cache_clear()
        return module

    yield tuned
    module.load_tuned_launch.cache_clear()
    module._config_for.cache_clear()


CONFIG = {"pages_per_step": 4, "programs_per_sm": 2, "num_warps": 8, "num_stages": 1}


def test_loader_takes_a_checked_config(loader):
    record = {"sm_120": {"logits_source": check.logits_source_digest(), "passed": [CONFIG]}}
    assert loader(CONFIG, record).launch_config_for("cuda") == {**CONFIG, "sm_count": 188}


@pytest.mark.parametrize(
    "record, message",
    [
        ({}, "no ahead-of-time check of this kernel for sm_120"),
        ({"sm_120": {"logits_source": "0" * 16, "passed": [CONFIG]}},
         "no ahead-of-time check of this kernel for sm_120"),
        ({"sm_90": {"logits_source": check.logits_source_digest(), "passed": [CONFIG]}},
         "no ahead-of-time check of this kernel for sm_120"),
        ({"sm_120": {"logits_source": check.logits_source_digest(), "passed": []}},
         "has not passed the ahead-of-time check for sm_120"),
    ],
)
def test_loader_refuses_a_config_the_check_has_not_passed(loader, record, message):
    module = loader(CONFIG, record)
    with pytest.raises(ValueError, match=message):
        module.launch_config_for("cuda")
