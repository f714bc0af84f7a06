"""The GPU proof kit (benchmark/gpu_check.py) on the CPU.

The smoke run is the kit's own CPU mode (TRITON_INTERPRET=1, tiny shapes) in a child process, as
CI and a person run it; TRITON_INTERPRET must be set before Triton loads, and this session has long
loaded it. The CUDA-only parts are checked here with stand-ins for what needs a GPU, and the tests
say which: a CUDA graph stand-in that replays by calling the function again, and measured figures
written into a report by hand for the target lines.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from benchmark import gpu_check

REPO = Path(__file__).resolve().parents[1]


def run_kit(*args, wrapper: str | None = None, timeout=240):
    """The kit in a child process from the repository root, as on a GPU host. `wrapper`: Python
    run first in the child (to break a kernel on purpose), then the kit."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TRITON_INTERPRET"] = "1"  # a wrapper may import the kernel before the kit sets it
    if wrapper is None:
        command = [sys.executable, "-m", "benchmark.gpu_check", *args]
    else:
        launcher = (
            f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(gpu_check.KERNEL_PATH)!r}]\n"
            f"{wrapper}\n"
            "from benchmark import gpu_check\n"
            f"sys.exit(gpu_check.main({list(args)!r}))\n"
        )
        command = [sys.executable, "-c", launcher]
    return subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-smoke")
    started = time.perf_counter()
    proc = run_kit("--smoke", "--quiet", "--out", str(out))
    return proc, out, time.perf_counter() - started


def test_plan_budgets_sum_under_eight_minutes(capsys):
    assert gpu_check.main(["--plan"]) == 0
    plan = capsys.readouterr().out
    total = sum(stage.budget_s for stage in gpu_check.STAGES)
    assert total + gpu_check.WATCHDOG_MARGIN_S < 8 * 60 == gpu_check.LIMIT_S
    last = plan.strip().splitlines()[-1].split()
    assert last[:3] == ["total", str(total), "s"]
    for stage in gpu_check.STAGES:
        assert stage.name in plan and f"{stage.budget_s} s" in plan


def test_smoke_run_writes_the_reports(smoke):
    proc, out, _ = smoke
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    stages = report["stages"]
    assert report["mode"].startswith("smoke") and report["exit_status"] == 0
    assert report["budget_total_s"] == sum(report["budgets"].values()) < report["limit_s"] == 480
    for name in ("environment", "correctness", "speed", "launch_sweep"):
        assert stages[name]["status"] == "passed", (name, stages[name])
        assert stages[name]["seconds"] <= stages[name]["budget_s"]
    # CUDA-only stages are reported as skipped, never as passed
    assert stages["cuda_graphs"]["status"] == "skipped (no CUDA)"
    assert stages["sglang"]["status"] == (
        "skipped (sglang not used (smoke run without --with-sglang))"
    )
    assert report["sglang_imported"] is False  # the kit works without sglang
    assert all(t["status"] == "skipped (no CUDA)" for t in report["targets"])

    env = report["environment"]
    for key in (
        "gpu",
        "capability",
        "sm_count",
        "torch",
        "triton",
        "python",
        "copy_bandwidth_gbps",
    ):
        assert env.get(key) not in (None, ""), key
    assert env["kernel_package"] == str(gpu_check.KERNEL_PATH / "sgl_kernel_dsv4")  # this tree's
    cases = stages["correctness"]["cases"]
    assert len(cases) == stages["correctness"]["planned"] == 6
    assert {c["case"].split()[0] for c in cases} == {"decode", "prefill"}
    for case in cases:
        assert case["ok"] and case["same_inf"], case
        assert case["triton_rel_err"] < 1e-4 and case["triton_top512"] == 1.0
    assert all(c["chunks_equal_whole"] for c in cases if c["case"].startswith("prefill"))
    speed = stages["speed"]["cases"][0]
    assert speed["triton_us"] > 0 and speed["roofline_fraction"] > 0
    assert list(speed["fp8_us"]) == ["fp8 torch emulation (project reference)"]

    tuned = json.loads((out / "tuned_launch.json").read_text())
    [(device, entry)] = tuned.items()
    assert device == env["gpu"] and entry["capability"] == env["capability"]
    assert entry["config"] == stages["launch_sweep"]["best"]["config"]
    assert entry["measured"]["us"] > 0 and entry["measured"]["shape"].startswith("B=")

    table = (out / "gpu_check.md").read_text()
    assert "| cuda_graphs | skipped (no CUDA) |" in table
    assert "| decode B=3 keys=520 |" in table and "## Launch sweep" in table
    assert "smoke run passed" in proc.stdout


def test_smoke_run_is_quick(smoke):
    _, _, seconds = smoke
    assert seconds < 60


def test_a_wrong_kernel_result_exits_non_zero(tmp_path):
    """The Triton kernel's logits off by 0.1 %: the kit must call correctness failed."""
    wrapper = (
        "import sgl_kernel_dsv4.index_logits as m\n"
        "real = m.bf16_paged_mqa_logits_triton\n"
        "m.bf16_paged_mqa_logits_triton = lambda *a: real(*a) * 1.001\n"
    )
    proc = run_kit(
        "--smoke", "--quiet", "--only", "correctness", "--out", str(tmp_path), wrapper=wrapper
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["stages"]["correctness"]["status"] == "FAILED"
    assert report["correctness_failures"] == ["correctness: FAILED"]
    assert all(not c["ok"] for c in report["stages"]["correctness"]["cases"])
    assert "correctness not proven: correctness: FAILED" in proc.stderr
    assert "correctness FAILED" in (tmp_path / "gpu_check.md").read_text()


def test_without_cuda_the_gpu_run_refuses_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    proc = run_kit("--out", str(tmp_path))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no CUDA device" in proc.stderr


def test_record_with_smoke_is_refused():
    proc = run_kit("--smoke", "--record")
    assert proc.returncode == 2 and "--record" in proc.stderr


# --- the CUDA-only parts, with stand-ins for the GPU --------------------------------------------


def cpu_kit(tmp_path):
    args = Namespace(smoke=True, out=tmp_path, quiet=True, with_sglang=False, without_sglang=True)
    kit = gpu_check.Kit(args)
    # The compiled Triton kernel needs a GPU (this session's Triton is not the interpreter):
    # the torch path stands in for it here; the smoke run covers the kernel itself.
    kit.kernels.triton = kit.kernels.torch_path
    kit.kernels.rotation_triton = None  # fused rotations: stand-ins where a test needs them
    return kit


def replay_by_calling(kit, fn, args):
    """Stand-in for a CUDA graph: 'replay' runs fn again into the captured output tensor."""
    output = fn(*args)
    return (lambda: output.copy_(fn(*args))), output


def test_graph_stage_compares_replay_with_eager(tmp_path, monkeypatch):
    kit = cpu_kit(tmp_path)
    monkeypatch.setattr(gpu_check, "capture", replay_by_calling)
    rec = {"cases": [], "notes": []}
    gpu_check.stage_cuda_graphs(kit, rec)
    assert rec["ok"]
    batches = gpu_check.SMOKE_SIZES.decode_batches
    logits = [c for c in rec["cases"] if c["case"].startswith("logits")]
    rotations = [c for c in rec["cases"] if "rotation (torch)" in c["case"]]
    assert len(logits) == 2 * len(batches) and len(rotations) == 2 * len(batches)
    assert all(c["bit_equal"] and c["replay_saw_new_inputs"] for c in logits + rotations)


def test_graph_stage_fails_a_replay_that_ignores_new_inputs(tmp_path, monkeypatch):
    """A graph that keeps returning what it computed at capture must not pass."""
    kit = cpu_kit(tmp_path)
    monkeypatch.setattr(gpu_check, "capture", lambda kit, fn, args: (lambda: None, fn(*args)))
    rec = {"cases": [], "notes": []}
    gpu_check.stage_cuda_graphs(kit, rec)
    assert not rec["ok"]
    assert not any(c["ok"] for c in rec["cases"] if "status" not in c)


def measured_kit(tmp_path, roofline, fp8_us, graphs_equal=True):
    """A report as a GPU run writes it (figures by hand: no GPU here)."""
    kit = cpu_kit(tmp_path)
    kit.cuda = True
    kit.sizes = gpu_check.GPU_SIZES
    kit.report["environment"].update(gpu="NVIDIA RTX PRO 6000", capability="12.0")
    kit.report["stages"] = {
        "speed": {
            "cases": [
                {
                    "batch": 32,
                    "keys": 81920,
                    "triton_us": 100.0,
                    "roofline_fraction": roofline,
                    "fp8_us": fp8_us,
                    "bf16_over_fp8": {k: 100.0 / v for k, v in fp8_us.items()},
                }
            ]
        },
        "cuda_graphs": {"status": "passed", "cases": [{"bit_equal": graphs_equal, "ok": True}]},
    }
    return kit


def test_targets_pass_and_fail_lines(tmp_path):
    kit = measured_kit(tmp_path, 0.75, {"fp8 torch sm120 (upstream)": 400.0, "fp8 DeepGEMM": 50.0})
    lines = {line["target"]: line for line in gpu_check.targets(kit)}
    assert [line["status"] for line in lines.values()] == ["PASS", "PASS", "PASS", "PASS"]
    assert lines["bf16 step <= 2.1x fp8 step"]["detail"] == "vs fp8 DeepGEMM"

    kit = measured_kit(
        tmp_path,
        0.5,
        {"fp8 torch sm120 (upstream)": 120.0, "fp8 DeepGEMM": 40.0},
        graphs_equal=False,
    )
    assert [line["status"] for line in gpu_check.targets(kit)] == ["FAIL"] * 4


def test_an_fp8_torch_emulation_is_no_kernel_target(tmp_path):
    kit = measured_kit(tmp_path, 0.8, {"fp8 torch emulation (project reference)": 900.0})
    lines = {line["target"]: line for line in gpu_check.targets(kit)}
    fp8 = lines["bf16 step <= 2.1x fp8 step"]
    assert fp8["status"] == "n/a" and "not an fp8 kernel" in fp8["detail"]
    upstream = lines["bf16 >= 1.5x faster than upstream's fp8 torch path (sm_120)"]
    assert upstream["status"] == "n/a" and upstream["detail"].startswith(
        "upstream's path did not run: sglang not used"
    )


def test_targets_never_change_the_exit_status(tmp_path):
    kit = measured_kit(tmp_path, 0.1, {"fp8 DeepGEMM": 1.0})
    kit.report["stages"]["correctness"] = {"status": "passed", "cases": []}
    assert "FAIL" in {line["status"] for line in gpu_check.targets(kit)}
    assert gpu_check.correctness_failures(kit) == []


def test_a_stage_is_stopped_at_its_budget(tmp_path, monkeypatch):
    kit = cpu_kit(tmp_path)
    stage = gpu_check.Stage("correctness", 1, "sleeps past its budget", proves_correctness=True)
    monkeypatch.setitem(gpu_check.STAGE_FUNCTIONS, "correctness", lambda kit, rec: time.sleep(20))
    previous = signal.signal(signal.SIGALRM, gpu_check.on_alarm)
    try:
        started = time.perf_counter()
        rec = gpu_check.run_stage(kit, stage)
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert time.perf_counter() - started < 5
    assert rec["status"] == "over budget (stopped)"
    monkeypatch.setattr(gpu_check, "STAGES", (stage,))
    assert gpu_check.correctness_failures(kit) == ["correctness: over budget (stopped)"]


def test_record_merges_the_best_config_per_gpu(tmp_path, monkeypatch):
    table = tmp_path / "tuned_launch.json"
    table.write_text(
        json.dumps(
            {
                "NVIDIA H100": {
                    "capability": "9.0",
                    "config": {"x": 1},
                    "measured": {"shape": "s", "us": 1.0},
                }
            }
        )
    )
    monkeypatch.setattr(gpu_check, "TUNED_FILE", table)
    monkeypatch.setattr(gpu_check, "REPO", tmp_path)
    kit = cpu_kit(tmp_path)
    kit.tuned = {
        "NVIDIA RTX PRO 6000": {
            "capability": "12.0",
            "config": {"x": 2},
            "measured": {"shape": "s", "us": 2.0},
        }
    }
    gpu_check.record_tuned(kit)
    merged = json.loads(table.read_text())
    assert list(merged) == ["NVIDIA H100", "NVIDIA RTX PRO 6000"]
    assert merged["NVIDIA RTX PRO 6000"]["config"] == {"x": 2}


def test_project_table_is_a_json_object():
    assert isinstance(json.loads(gpu_check.TUNED_FILE.read_text()), dict)


def test_the_script_lints_clean():
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not Path(shellcheck).exists():
        pytest.skip("shellcheck not installed")
    result = subprocess.run(
        [shellcheck, str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


@pytest.mark.slow
def test_sglang_stage_steps_agree_on_the_cpu():
    """The sglang stage's decode step through the real pool and the patched indexer (plugin
    loaded by conftest), twice on the CPU: the same inputs agree; changed keys are caught."""
    from benchmark.gpu_check_sglang import compare_steps, run_decode_step_on

    first = run_decode_step_on("cpu")
    assert compare_steps(first, run_decode_step_on("cpu"))["ok"]
    assert (first["positions"] >= 0).sum() == 512 + 300  # top-512 of 700 keys, all 300
    off = dict(first, keys=first["keys"] * 1.05)
    assert not compare_steps(first, off)["ok"]


def torch_query_rotation(q, freqs, positions):
    rot = gpu_check.import_module("sgl_kernel_dsv4.index_rotation")
    return rot.hadamard_rotate(rot.apply_rope_tail(q, freqs[positions])).to(torch.bfloat16)


def torch_key_store(pool, kv, weight, eps, freqs, plan, out_loc, ratio, is_decode):
    rot = gpu_check.import_module("sgl_kernel_dsv4.index_rotation")
    x = kv * torch.rsqrt(kv.square().mean(-1, keepdim=True) + eps) * weight
    keys = rot.hadamard_rotate(rot.apply_rope_tail(x, freqs[(plan[:, 0] - ratio).long()]))
    write = plan[:, 0] % ratio == 0
    pool[out_loc[write]] = keys[write].to(torch.bfloat16)


def stand_in_rotations(fused_query, fused_store):
    """Fused rotations as the kernel package offers them, here torch functions (no GPU)."""
    return lambda kit: {
        "query rotation": gpu_check.FusedRotation(
            fused_query, torch_query_rotation, gpu_check.query_rotation_inputs, True
        ),
        "key write": gpu_check.FusedRotation(
            fused_store, torch_key_store, gpu_check.key_store_inputs, False
        ),
    }


def test_fused_rotations_are_checked_and_replayed(tmp_path, monkeypatch):
    kit = cpu_kit(tmp_path)
    monkeypatch.setattr(gpu_check, "capture", replay_by_calling)
    monkeypatch.setattr(
        gpu_check, "rotation_kernels", stand_in_rotations(torch_query_rotation, torch_key_store)
    )
    checks = gpu_check.rotation_correctness_cases(kit)
    assert len(checks) == 2 * len(gpu_check.SMOKE_SIZES.rotation_rows)
    assert all(c["ok"] and c["bit_equal_share"] == 1.0 for c in checks)
    replays = gpu_check.graph_fused_rotation_cases(kit)
    assert len(replays) == 2 * len(gpu_check.SMOKE_SIZES.decode_batches)
    assert all(c["ok"] for c in replays), replays


def test_a_fused_rotation_off_by_more_than_a_rounding_fails(tmp_path, monkeypatch):
    kit = cpu_kit(tmp_path)

    def query_off(q, freqs, positions):
        return (torch_query_rotation(q, freqs, positions).float() * 1.02).to(torch.bfloat16)

    def store_skipping_nothing(pool, kv, weight, eps, freqs, plan, out_loc, ratio, is_decode):
        every_row = plan.clone()
        every_row[:, 0] = every_row[:, 0] // ratio * ratio  # writes rows that complete no key
        torch_key_store(pool, kv, weight, eps, freqs, every_row, out_loc, ratio, is_decode)

    monkeypatch.setattr(
        gpu_check, "rotation_kernels", stand_in_rotations(query_off, store_skipping_nothing)
    )
    assert not any(c["ok"] for c in gpu_check.rotation_correctness_cases(kit))
