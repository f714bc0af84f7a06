"""The GPU proof kit (the benchmark/gpu_check package) on the CPU.

The smoke run is the kit's own CPU mode (TRITON_INTERPRET=1, tiny shapes) in a child process, as
CI and a person run it; TRITON_INTERPRET must be set before Triton loads, and this session has long
loaded it. The CUDA-only parts are checked here with stand-ins for what needs a GPU, and the tests
say which: a CUDA graph stand-in that replays by calling the function again (and one that, as a
real capture, computes nothing until replayed), the torch references standing in for the fused
Triton rotations and for the logits kernel in-process (this session's Triton is not the
interpreter), and measured figures written into a report by hand for the target lines.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from sglang_dsv4 import warm_python

from benchmark.gpu_check import correctness, harness, report, sglang_stage, tuner

REPO = Path(__file__).resolve().parents[1]


def run_kit(*args, wrapper: str | None = None, timeout=240, interpret=True):
    """The kit in a child process from the repository root, as on a GPU host. `wrapper`: Python
    run first in the child (to break a kernel on purpose), then the kit."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    if interpret:
        env["TRITON_INTERPRET"] = "1"  # a wrapper may import the kernel before the kit sets it
    if wrapper is None:
        command = ["-m", "benchmark.gpu_check", *args]
    else:
        launcher = (
            f"import sys; sys.path[:0] = [{str(REPO)!r}, {str(harness.KERNEL_PATH)!r}]\n"
            f"{wrapper}\n"
            "from benchmark.gpu_check import harness\n"
            f"sys.exit(harness.main({list(args)!r}))\n"
        )
        command = ["-c", launcher]
    return warm_python.run(command, env=env, cwd=REPO, timeout=timeout)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-smoke")
    proc = run_kit("--smoke", "--quiet", "--out", str(out))
    return proc, out


def test_plan_budgets_sum_under_eight_minutes(capsys):
    assert harness.main(["--plan"]) == 0
    plan = capsys.readouterr().out
    stages = harness.stages()
    assert [s.name for s in stages] == [
        "environment", "correctness", "cuda_graphs", "speed", "launch_sweep", "sglang"
    ]
    total = sum(stage.budget_s for stage in stages)
    assert total + harness.WATCHDOG_MARGIN_S < 8 * 60 == harness.LIMIT_S
    last = plan.strip().splitlines()[-1].split()
    assert last[:3] == ["total", str(total), "s"]
    for stage in stages:
        assert stage.name in plan and f"{stage.budget_s} s" in plan


def test_smoke_run_writes_the_reports(smoke):
    proc, out = smoke
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    stages = report["stages"]
    assert report["mode"].startswith("smoke") and report["exit_status"] == 0
    assert report["budget_total_s"] == sum(report["budgets"].values()) < report["limit_s"] == 480
    for name in ("environment", "correctness", "speed", "launch_sweep"):
        assert stages[name]["status"] == "passed", (name, stages[name])
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
    assert env["kernel_package"] == str(harness.KERNEL_PATH / "sgl_kernel_dsv4")  # this tree's
    cases = stages["correctness"]["cases"]
    assert len(cases) == stages["correctness"]["planned"] == 8
    assert {c["case"].split()[0] for c in cases} == {"decode", "prefill"}
    # CUDA-graph padding: rows with seq_len 0 run, one padded batch per decode width
    assert sum("padded (seq_len 0 rows)" in c["case"] for c in cases) == 2
    for case in cases:
        assert case["ok"] and case["same_inf"] and case["tail_neg_inf"], case
        assert case["triton_rel_err"] < 1e-4 and case["triton_top512"] == 1.0
    rotations = {c["case"].split(" rows=")[0] for c in stages["correctness"]["rotation_cases"]}
    assert rotations == {"query rotation", "key write (decode)", "key write (prefill)"}
    assert all(c["ok"] for c in stages["correctness"]["rotation_cases"])
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
    proc = run_kit("--out", str(tmp_path), interpret=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no CUDA device" in proc.stderr


def test_a_gpu_run_refuses_the_interpreter_in_one_line(tmp_path):
    """With TRITON_INTERPRET=1 a GPU run would interpret the kernels on the CPU."""
    proc = run_kit("--out", str(tmp_path), interpret=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "TRITON_INTERPRET=1 is set" in proc.stderr and "--smoke" in proc.stderr


def test_record_with_smoke_is_refused():
    proc = run_kit("--smoke", "--record")
    assert proc.returncode == 2 and "--record" in proc.stderr


# --- the CUDA-only parts, with stand-ins for the GPU --------------------------------------------


def cpu_kit(tmp_path):
    args = Namespace(smoke=True, out=tmp_path, quiet=True, with_sglang=False, without_sglang=True)
    kit = harness.Kit(args)
    # The compiled Triton kernels need a GPU (this session's Triton is not the interpreter): the
    # torch paths stand in for them here; the smoke run covers the kernels themselves.
    kit.kernels.triton = kit.kernels.torch_path
    rot = kit.kernels.rotation
    kit.kernels.rotation_triton = SimpleNamespace(
        index_query_bf16_triton=rot.index_query_bf16_torch,
        store_index_keys_bf16_triton=rot.store_index_keys_bf16_torch,
    )
    return kit


def replay_by_calling(kit, fn, args):
    """Stand-in for a CUDA graph: 'replay' runs fn again into the captured output tensor."""
    output = fn(*args)
    return (lambda: output.copy_(fn(*args))), output


def replay_of_the_capture_inputs(kit, fn, args):
    """Stand-in for a CUDA graph that did not see its inputs change: as a real capture, the
    output holds nothing computed until the first replay, and every replay recomputes from the
    inputs as they were at capture."""
    frozen = correctness.clone_args(args)
    output = torch.full_like(fn(*correctness.clone_args(args)), float("nan"))
    return (lambda: output.copy_(fn(*correctness.clone_args(frozen)))), output


def test_graph_stage_compares_replay_with_eager(tmp_path, monkeypatch):
    kit = cpu_kit(tmp_path)
    monkeypatch.setattr(correctness, "capture", replay_by_calling)
    rec = {"cases": [], "notes": []}
    correctness.stage_cuda_graphs(kit, rec)
    assert rec["ok"], [c for c in rec["cases"] if not c["ok"]]
    batches = harness.SMOKE_SIZES.decode_batches
    logits = [c for c in rec["cases"] if c["case"].startswith("logits")]
    rotations = [c for c in rec["cases"] if "rotation (torch)" in c["case"]]
    fused = [c for c in rec["cases"] if "(fused)" in c["case"]]
    assert len(logits) == 2 * len(batches) and len(rotations) == 2 * len(batches)
    assert len(fused) == 3 * len(batches)  # query, decode key write, prefill key write
    assert all(c["bit_equal"] and c["replay_saw_new_inputs"] for c in logits + rotations + fused)


def test_graph_stage_fails_a_replay_that_ignores_new_inputs(tmp_path, monkeypatch):
    """A graph that keeps returning what it computed at capture must not pass."""
    kit = cpu_kit(tmp_path)
    monkeypatch.setattr(correctness, "capture", lambda kit, fn, args: (lambda: None, fn(*args)))
    rec = {"cases": [], "notes": []}
    correctness.stage_cuda_graphs(kit, rec)
    assert not rec["ok"]
    assert not any(c["ok"] for c in rec["cases"])


def test_fused_graph_check_sees_a_replay_of_the_capture_inputs(tmp_path, monkeypatch):
    """The fused rotations' "replay saw new inputs" check compares two replays, never a
    capture-time output that never ran: a graph replaying its capture inputs fails it."""
    kit = cpu_kit(tmp_path)
    monkeypatch.setattr(correctness, "capture", replay_of_the_capture_inputs)
    cases = correctness.graph_fused_rotation_cases(kit)
    assert len(cases) == 3 * len(harness.SMOKE_SIZES.decode_batches)
    assert not any(c["replay_saw_new_inputs"] for c in cases), cases
    assert not any(c["ok"] for c in cases)


def measured_kit(tmp_path, roofline, fp8_us, graphs_equal=True):
    """A report as a GPU run writes it (figures by hand: no GPU here)."""
    kit = cpu_kit(tmp_path)
    kit.cuda = True
    kit.sizes = harness.GPU_SIZES
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
    lines = {line["target"]: line for line in report.targets(kit)}
    assert [line["status"] for line in lines.values()] == ["PASS", "PASS", "PASS", "PASS"]
    assert lines["bf16 step <= 2.1x fp8 step"]["detail"] == "vs fp8 DeepGEMM"

    kit = measured_kit(
        tmp_path,
        0.5,
        {"fp8 torch sm120 (upstream)": 120.0, "fp8 DeepGEMM": 40.0},
        graphs_equal=False,
    )
    assert [line["status"] for line in report.targets(kit)] == ["FAIL"] * 4


def test_an_fp8_torch_emulation_is_no_kernel_target(tmp_path):
    kit = measured_kit(tmp_path, 0.8, {"fp8 torch emulation (project reference)": 900.0})
    lines = {line["target"]: line for line in report.targets(kit)}
    fp8 = lines["bf16 step <= 2.1x fp8 step"]
    assert fp8["status"] == "n/a" and "not an fp8 kernel" in fp8["detail"]
    upstream = lines["bf16 >= 1.5x faster than upstream's fp8 torch path (sm_120)"]
    assert upstream["status"] == "n/a" and upstream["detail"].startswith(
        "upstream's path did not run: sglang not used"
    )


def test_targets_never_change_the_exit_status(tmp_path):
    kit = measured_kit(tmp_path, 0.1, {"fp8 DeepGEMM": 1.0})
    kit.report["stages"]["correctness"] = {"status": "passed", "cases": []}
    assert "FAIL" in {line["status"] for line in report.targets(kit)}
    assert harness.correctness_failures(kit) == []


def never_done(kit, rec):
    threading.Event().wait()  # returns only if interrupted


def run_with_alarm(kit, stage):
    previous = signal.signal(signal.SIGALRM, harness.on_alarm)
    try:
        return harness.run_stage(kit, stage)
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_a_stage_is_stopped_at_its_budget(tmp_path):
    kit = cpu_kit(tmp_path)
    stage = harness.Stage("correctness", 1, "waits past its budget", never_done,
                          proves_correctness=True)
    rec = run_with_alarm(kit, stage)
    assert rec["status"] == "over budget (stopped)"
    kit.stages = (stage,)
    assert harness.correctness_failures(kit) == ["correctness: over budget (stopped)"]


def test_a_stage_budget_is_not_swallowed_by_a_per_config_handler(tmp_path):
    """The sweep keeps an `except Exception` around each config (a config this GPU cannot run is
    reported and the sweep goes on): the budget's stop must still end the stage there."""
    kit = cpu_kit(tmp_path)
    launched = []

    def launch(args, config):
        launched.append(config)
        if len(launched) == 1:
            # The first config hangs and the budget runs out during it: the stage's timer is
            # re-armed to fire now, whatever the preparation before it took on this machine.
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            threading.Event().wait()
        return kit.kernels.torch_path(*args)

    kit.kernels.launch = launch
    kit.kernels.launch_candidates = lambda: [{"pages_per_step": p} for p in (1, 2, 4)]
    # A budget no preparation reaches; `launch` ends it at the first config.
    stage = harness.Stage("launch_sweep", 600, "first config hangs", tuner.stage_launch_sweep)
    rec = run_with_alarm(kit, stage)
    assert rec["status"] == "over budget (stopped)", rec
    assert len(launched) <= 1  # no config after the budget ran out
    assert any("budget ran out" in note for note in rec["notes"])


def test_a_nan_result_is_strict_json_and_fails(tmp_path):
    """A kernel returning NaN: the report is valid JSON (no bare NaN / Infinity), says so, and
    correctness fails."""
    wrapper = (
        "import sgl_kernel_dsv4.index_logits as m\n"
        "real = m.bf16_paged_mqa_logits_triton\n"
        "m.bf16_paged_mqa_logits_triton = lambda *a: real(*a) * float('nan')\n"
    )
    proc = run_kit(
        "--smoke", "--quiet", "--only", "correctness", "--out", str(tmp_path), wrapper=wrapper
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]

    def refuse(name):
        raise ValueError(f"bare {name} in gpu_check.json")

    text = (tmp_path / "gpu_check.json").read_text()
    written = json.loads(text, parse_constant=refuse)
    cases = written["stages"]["correctness"]["cases"]
    assert cases and not any(c["ok"] for c in cases)
    assert {c["triton_rel_err"] for c in cases} == {"inf"}


def tuned_table(tmp_path, monkeypatch):
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
    monkeypatch.setattr(harness, "TUNED_FILE", table)
    monkeypatch.setattr(harness, "REPO", tmp_path)
    kit = cpu_kit(tmp_path)
    kit.tuned = {
        "NVIDIA RTX PRO 6000": {
            "capability": "12.0",
            "config": {"x": 2},
            "measured": {"shape": "s", "us": 2.0},
        }
    }
    kit.report["stages"]["launch_sweep"] = {"status": "passed", "cases": []}
    return table, kit


def test_record_merges_the_best_config_per_gpu(tmp_path, monkeypatch):
    table, kit = tuned_table(tmp_path, monkeypatch)
    assert harness.record_tuned(kit, []).startswith("recorded NVIDIA RTX PRO 6000")
    merged = json.loads(table.read_text())
    assert list(merged) == ["NVIDIA H100", "NVIDIA RTX PRO 6000"]
    assert merged["NVIDIA RTX PRO 6000"]["config"] == {"x": 2}


def test_record_refuses_a_run_that_did_not_prove_correctness(tmp_path, monkeypatch):
    table, kit = tuned_table(tmp_path, monkeypatch)
    before = table.read_text()
    line = harness.record_tuned(kit, ["correctness: FAILED"])
    assert line.startswith("not recorded: correctness not proven") and table.read_text() == before
    kit.report["stages"]["launch_sweep"]["status"] = "over budget (stopped)"
    assert harness.record_tuned(kit, []).startswith("not recorded: the launch sweep over budget")
    assert table.read_text() == before


def test_record_never_leaves_a_half_written_table(tmp_path, monkeypatch):
    """The write breaks half-way (a full disk, a killed process): the table stays as it was."""
    table, kit = tuned_table(tmp_path, monkeypatch)
    before = table.read_text()
    real_write = Path.write_text

    def breaks_half_way(self, text, *args, **kwargs):
        real_write(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError("No space left on device")

    monkeypatch.setattr(Path, "write_text", breaks_half_way)
    with pytest.raises(OSError):
        harness.record_tuned(kit, [])
    monkeypatch.undo()
    assert table.read_text() == before and json.loads(table.read_text())


def test_project_table_is_a_json_object():
    assert isinstance(json.loads(harness.TUNED_FILE.read_text()), dict)


def test_the_script_lints_clean():
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not Path(shellcheck).exists():
        pytest.skip("shellcheck not installed")
    result = subprocess.run(
        [shellcheck, str(REPO / "scripts" / "gpu_check.sh")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


def test_no_module_of_the_kit_is_over_900_lines():
    for path in (REPO / "benchmark" / "gpu_check").glob("*.py"):
        assert len(path.read_text().splitlines()) <= 900, path.name


def test_the_sglang_stage_runs_each_top_k_step_of_the_device(tmp_path, monkeypatch):
    """On CUDA the stage runs upstream's torch top-k and its CUDA top-k v1 and v2 (what sm_120
    serving runs), each against the CPU's torch step; on the CPU the torch one only. The decode
    step itself is a stand-in here (no GPU); the slow test below runs the real one."""
    calls = []

    def step(device, seed=0, topk="torch"):
        calls.append((device, topk))
        return {"device": device}

    monkeypatch.setattr(sglang_stage, "run_decode_step_on", step)
    monkeypatch.setattr(sglang_stage, "compare_steps", lambda cpu, other: {"ok": True})
    kit = cpu_kit(tmp_path)
    kit.device = "cuda"
    rec = {"cases": [], "notes": []}
    sglang_stage.stage_sglang(kit, rec)
    assert calls == [("cpu", "torch"), ("cuda", "torch"), ("cuda", "v1"), ("cuda", "v2")]
    assert rec["ok"] and len(rec["cases"]) == 3
    calls.clear()
    kit.device = "cpu"
    sglang_stage.stage_sglang(kit, {"cases": [], "notes": []})
    assert calls == [("cpu", "torch"), ("cpu", "torch")]


@pytest.mark.slow
def test_sglang_stage_steps_agree_on_the_cpu():
    """The sglang stage's decode step through the real pool and the patched indexer (plugin
    loaded by conftest), twice on the CPU: the same inputs agree; changed keys are caught."""
    from benchmark.gpu_check.sglang_stage import compare_steps, run_decode_step_on

    first = run_decode_step_on("cpu")
    assert compare_steps(first, run_decode_step_on("cpu"))["ok"]
    assert (first["positions"] >= 0).sum() == 512 + 300  # top-512 of 700 keys, all 300
    off = dict(first, keys=first["keys"] * 1.05)
    assert not compare_steps(first, off)["ok"]


def torch_query_rotation(q, freqs, positions):
    rot = importlib.import_module("sgl_kernel_dsv4.index_rotation")
    return rot.hadamard_rotate(rot.apply_rope_tail(q, freqs[positions])).to(torch.bfloat16)


def torch_key_store(pool, kv, weight, eps, freqs, plan, out_loc, ratio, is_decode):
    """The key store written out here from its contract (decode and prefill plans)."""
    rot = importlib.import_module("sgl_kernel_dsv4.index_rotation")
    x = kv * torch.rsqrt(kv.square().mean(-1, keepdim=True) + eps) * weight
    positions = (plan[:, 0] - ratio).clamp(min=0).long()
    keys = rot.hadamard_rotate(rot.apply_rope_tail(x, freqs[positions]))
    if is_decode:
        write, slots = plan[:, 0] % ratio == 0, out_loc
    else:
        write, slots = plan[:, 0] != -1, out_loc[(plan[:, 1] & 0xFFFF).long()]
    pool[slots[write]] = keys[write].to(torch.bfloat16)


def stand_in_rotations(fused_query, fused_store):
    """Fused rotations as the kernel package offers them, here torch functions (no GPU)."""
    return lambda kit: {
        "query rotation": correctness.FusedRotation(
            fused_query, torch_query_rotation, correctness.query_rotation_inputs, True
        ),
        "key write (decode)": correctness.FusedRotation(
            fused_store, torch_key_store, correctness.key_store_inputs, False
        ),
        "key write (prefill)": correctness.FusedRotation(
            fused_store, torch_key_store, correctness.prefill_key_store_inputs, False
        ),
    }


def test_fused_rotations_are_checked_and_replayed(tmp_path, monkeypatch):
    kit = cpu_kit(tmp_path)
    monkeypatch.setattr(correctness, "capture", replay_by_calling)
    monkeypatch.setattr(
        correctness, "rotation_kernels", stand_in_rotations(torch_query_rotation, torch_key_store)
    )
    checks = correctness.rotation_correctness_cases(kit)
    assert len(checks) == 3 * len(harness.SMOKE_SIZES.rotation_rows)
    assert all(c["ok"] and c["bit_equal_share"] == 1.0 for c in checks)
    replays = correctness.graph_fused_rotation_cases(kit)
    assert len(replays) == 3 * len(harness.SMOKE_SIZES.decode_batches)
    assert all(c["ok"] for c in replays), replays


def test_a_fused_rotation_off_by_more_than_a_rounding_fails(tmp_path, monkeypatch):
    kit = cpu_kit(tmp_path)

    def query_off(q, freqs, positions):
        return (torch_query_rotation(q, freqs, positions).float() * 1.02).to(torch.bfloat16)

    def store_skipping_nothing(pool, kv, weight, eps, freqs, plan, out_loc, ratio, is_decode):
        every_row = plan.clone()
        every_row[:, 0] = every_row[:, 0] // ratio * ratio  # writes rows that complete no key
        every_row[every_row[:, 0] < 0, 0] = ratio  # and the prefill's invalid rows
        torch_key_store(pool, kv, weight, eps, freqs, every_row, out_loc, ratio, is_decode)

    monkeypatch.setattr(
        correctness, "rotation_kernels", stand_in_rotations(query_off, store_skipping_nothing)
    )
    assert not any(c["ok"] for c in correctness.rotation_correctness_cases(kit))


def test_a_prefill_store_that_reads_the_plan_as_decode_fails(tmp_path, monkeypatch):
    """The prefill plan's rows name their slot through a ragged token id: a store that takes
    the row's own index (the decode layout) must fail the prefill case, not the decode one."""
    kit = cpu_kit(tmp_path)

    def decode_layout(pool, kv, weight, eps, freqs, plan, out_loc, ratio, is_decode):
        rows = plan.clone()
        if not is_decode:
            rows[:, 1] = torch.arange(rows.shape[0], dtype=rows.dtype)
        torch_key_store(pool, kv, weight, eps, freqs, rows, out_loc, ratio, is_decode)

    monkeypatch.setattr(
        correctness, "rotation_kernels", stand_in_rotations(torch_query_rotation, decode_layout)
    )
    cases = correctness.rotation_correctness_cases(kit)
    verdict = {c["case"].split(" rows=")[0]: c["ok"] for c in cases}
    assert verdict == {"query rotation": True, "key write (decode)": True,
                       "key write (prefill)": False}


@pytest.mark.parametrize("broken", ["padding rows not -inf", "tail past seq_len not -inf"])
def test_a_kernel_that_breaks_the_minus_inf_contract_fails(tmp_path, broken):
    """seq_len 0 rows (CUDA-graph padding) must be all -inf, as every position past seq_len."""
    kit = cpu_kit(tmp_path)
    torch_path = kit.kernels.torch_path

    def kernel(*args):
        out = torch_path(*args)
        lengths = args[3].view(-1)
        if broken == "padding rows not -inf":
            out[lengths == 0] = 0.0
        else:
            out[:, -1] = 0.0  # the last position lies past every row's seq_len here
        return out

    kit.kernels.triton = kernel
    width = 300
    lengths = correctness.padded_lengths(4, width)
    args = correctness.build_case(kit, lengths, width, seed=3)
    case = correctness.check_case(kit, "padded", args, chunk_rows=None)
    assert not case["ok"] and not case["tail_neg_inf"]
