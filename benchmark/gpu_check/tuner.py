"""The kit's measuring stages: speed (Triton vs the torch path, roofline fraction, bf16 vs an fp8
step, the fused rotations) and launch_sweep (every candidate launch config checked and timed; the
fastest correct one becomes DIR/tuned_launch.json). Figures are ratios from one run; they never
change the exit status, except a sweep config giving wrong logits."""

from __future__ import annotations

import functools
import json
from importlib import import_module

from benchmark.gpu_check.correctness import (
    build_case,
    compare,
    decode_lengths,
    rotation_kernels,
)
from benchmark.gpu_check.harness import (
    HEAD_DIM,
    PAGE,
    Stage,
    StageTimeout,
    cdiv,
    one_line,
    release,
    time_us,
)

BF16_KEY_BYTES = 256


def rotation_speed_cases(kit) -> list:
    cases = []
    for label, op in rotation_kernels(kit).items():
        for rows in kit.sizes.rotation_speed_rows:
            args = op.inputs(kit, rows, seed=1000 + rows)
            fused_us = time_us(kit, functools.partial(op.run, op.fused, args))
            torch_us = time_us(kit, functools.partial(op.run, op.reference, args))
            cases.append(
                {
                    "case": f"{label} rows={rows}",
                    "fused_us": fused_us,
                    "torch_us": torch_us,
                    "torch_over_fused": torch_us / fused_us,
                }
            )
    return cases


def fp8_steps(kit, args):
    """fp8 paged-logits steps at the same shape as `args`: upstream's (sglang importable: the
    sm_120 torch path, TileLang, DeepGEMM when they run here), else the project's fp8-emulating
    torch step, labelled as such. Returns {label: zero-argument callable}."""
    ref = kit.kernels.reference
    q, kv, weights, seq_lens, table, width = args
    keys = kv.reshape(-1, HEAD_DIM).float()
    k8, k_scale = ref.quantize_index_fp8(keys)
    del keys
    pages = ref.pack_fp8_index_pages(k8, k_scale)
    del k8, k_scale
    q8, q_scale = ref.quantize_index_fp8(q[:, 0].float())
    q8 = q8.unsqueeze(1)
    fp8_weights = (weights * q_scale).contiguous()
    steps = {}
    if kit.sglang_version:
        indexer = import_module("sglang.srt.layers.attention.dsv4.indexer")
        fn = indexer.fp8_paged_mqa_logits_torch_sm120
        steps["fp8 torch sm120 (upstream)"] = lambda: fn(
            q8, pages, fp8_weights, seq_lens, table, None, width, False
        )
        if kit.cuda:
            steps.update(upstream_fp8_kernels(q8, pages, fp8_weights, seq_lens, table, width))
    if not steps:
        steps["fp8 torch emulation (project reference)"] = lambda: fp8_emulated_logits(
            kit, q8, pages, fp8_weights, seq_lens, table, width
        )
    return steps


def upstream_fp8_kernels(q8, pages, weights, seq_lens, table, width) -> dict:
    """Upstream's fp8 kernels that are installed. One that is installed but cannot be set up on
    this GPU becomes a step that raises, so the speed table says why it did not run."""
    steps = {}
    try:
        from sglang.kernels.ops.attention.dsa.tilelang_kernel import tilelang_fp8_paged_mqa_logits

        steps["fp8 tilelang (upstream)"] = functools.partial(
            tilelang_fp8_paged_mqa_logits, q8, pages, weights, seq_lens, table, None, width, False
        )
    except ModuleNotFoundError:  # TileLang not installed
        pass
    except Exception as exc:
        steps["fp8 tilelang (upstream)"] = functools.partial(raise_again, exc)
    try:
        import deep_gemm

        lens = seq_lens.view(-1, 1)
        meta = deep_gemm.get_paged_mqa_logits_metadata(lens, PAGE, deep_gemm.get_num_sms())
        steps["fp8 DeepGEMM"] = functools.partial(
            deep_gemm.fp8_paged_mqa_logits, q8, pages, weights, lens, table, meta, width, False
        )
    except ModuleNotFoundError:  # DeepGEMM not installed
        pass
    except Exception as exc:  # e.g. no kernels for this architecture
        steps["fp8 DeepGEMM"] = functools.partial(raise_again, exc)
    return steps


def raise_again(exc):
    raise exc


def fp8_emulated_logits(kit, q8, pages, weights, seq_lens, table, width):
    """An fp8 paged-logits step in plain torch, as the fp8 pool is read: 132-byte keys (128 e4m3
    values + an fp32 scale per key, upstream's page layout), e4m3 query, fp32 accumulation, in
    bounded page steps. Not a kernel: a stand-in for the fp8 side where upstream is absent."""
    torch = kit.torch
    batch, heads = q8.shape[0], q8.shape[2]
    flat = pages.view(pages.shape[0], -1)
    values = flat[:, : PAGE * HEAD_DIM].view(torch.float8_e4m3fn).view(-1, PAGE, HEAD_DIM)
    scales = flat[:, PAGE * HEAD_DIM :].contiguous().view(torch.float32)
    query = q8[:, 0].float().transpose(1, 2)
    out = torch.full((batch, width), float("-inf"), dtype=torch.float32, device=q8.device)
    cols = min(table.shape[1], cdiv(width, PAGE))
    step = max(1, (256 << 20) // max(1, batch * PAGE * (HEAD_DIM + heads) * 4))
    lengths = seq_lens.view(-1, 1)
    for first in range(0, cols, step):
        part = table[:, first : first + step]
        index = part.clamp(min=0).long()
        keys = values[index].float().reshape(batch, -1, HEAD_DIM)
        scores = torch.bmm(keys, query).relu_().mul_(weights.unsqueeze(1)).sum(2)
        scores = scores * scales[index].reshape(batch, -1)
        positions = first * PAGE + torch.arange(scores.shape[1], device=q8.device)
        valid = (positions.unsqueeze(0) < lengths) & (part >= 0).repeat_interleave(PAGE, 1)
        end = min(width, (first + part.shape[1]) * PAGE)
        out[:, first * PAGE : end] = scores.masked_fill(~valid, float("-inf"))[
            :, : end - first * PAGE
        ]
    return out


def step_bytes(args) -> int:
    """Index-K bytes a decode step reads (each row's keys, up to its length) plus the query."""
    q, _, _, seq_lens, _, width = args
    keys = int(seq_lens.view(-1).clamp(max=width).sum())
    return keys * BF16_KEY_BYTES + q.numel() * q.element_size()


def stage_speed(kit, rec):
    bandwidth = kit.report["environment"].get("copy_bandwidth_gbps")
    for batch, keys in kit.sizes.speed_cases:
        args = build_case(kit, decode_lengths(batch, keys), keys, seed=500 + batch)
        row = {"case": f"decode B={batch} keys={keys}", "batch": batch, "keys": keys}
        row["triton_us"] = time_us(kit, functools.partial(kit.kernels.triton, *args))
        row["torch_us"] = time_us(kit, functools.partial(kit.kernels.torch_path, *args))
        row["torch_over_triton"] = row["torch_us"] / row["triton_us"]
        achieved = step_bytes(args) / (row["triton_us"] * 1e-6) / 1e9
        row["achieved_gbps"] = achieved
        row["roofline_fraction"] = achieved / bandwidth if bandwidth else None
        row["fp8_us"] = {}
        row["fp8_errors"] = {}
        for label, fn in fp8_steps(kit, args).items():
            try:
                row["fp8_us"][label] = time_us(kit, fn)
            except Exception as exc:  # an optional fp8 kernel that does not run here: say why
                row["fp8_errors"][label] = one_line(exc)
        row["bf16_over_fp8"] = {k: row["triton_us"] / v for k, v in row["fp8_us"].items()}
        rec["cases"].append(row)
        kit.progress(
            f"  {row['case']}: triton {row['triton_us']:.1f} us, torch {row['torch_us']:.1f} us"
        )
        del args
        release(kit)
    rec["rotation_cases"] = rotation_speed_cases(kit)
    rec["ok"] = True


def stage_launch_sweep(kit, rec):
    batch, keys = kit.sizes.sweep_case
    args = build_case(kit, decode_lengths(batch, keys), keys, seed=600)
    expected = kit.kernels.torch_path(*args)
    rec["shape"] = f"B={batch} keys={keys} heads={kit.sizes.heads}"
    candidates = kit.kernels.launch_candidates()
    rec["planned"] = len(candidates)
    try:
        default = kit.kernels.default_config(kit.device)
    except Exception:
        default = None
    rec["default_config"] = default
    try:
        rec["default_us"] = time_us(kit, functools.partial(kit.kernels.triton, *args))
        for config in candidates:
            row = {"config": config}
            try:
                check = compare(kit, kit.kernels.launch(args, config), expected, args[3])
                row["ok"] = check["ok"]
                row["max_rel_err"] = check["max_rel_err"]
                if row["ok"]:
                    row["us"] = time_us(kit, functools.partial(kit.kernels.launch, args, config))
            except Exception as exc:  # a config this GPU cannot run (e.g. shared memory)
                row["ok"] = None
                row["error"] = one_line(exc)
            rec["cases"].append(row)
    except StageTimeout:
        rec["notes"].append(
            f"budget ran out after {len(rec['cases'])} of {len(candidates)} configs"
        )
        finish_sweep(kit, rec)
        raise
    finally:
        del args, expected
        release(kit)
    finish_sweep(kit, rec)


def finish_sweep(kit, rec):
    """Pick the fastest correct config and write it, keyed by this device's name."""
    wrong = [c for c in rec["cases"] if c.get("ok") is False]
    timed = [c for c in rec["cases"] if c.get("ok") and "us" in c]
    rec["ok"] = not wrong
    if wrong:
        rec["notes"].append(f"{len(wrong)} launch config(s) gave wrong logits")
    if not timed:
        rec["notes"].append("no config ran correctly: nothing to record")
        return
    best = min(timed, key=lambda c: c["us"])
    env = kit.report["environment"]
    rec["best"] = best
    if rec.get("default_us"):
        rec["default_over_best"] = rec["default_us"] / best["us"]
    entry = {
        "capability": env.get("capability"),
        "config": best["config"],
        "measured": {
            "shape": rec["shape"],
            "us": round(best["us"], 2),
            "configs_timed": len(timed),
            "date": kit.report["started"][:10],
        },
    }
    kit.tuned = {env.get("gpu"): entry}
    (kit.out / "tuned_launch.json").write_text(json.dumps(kit.tuned, indent=2) + "\n")


STAGES = (
    Stage("speed", 90, "Triton vs torch, roofline fraction, bf16 vs fp8 step", stage_speed),
    Stage("launch_sweep", 90, "launch configs checked and timed, best per GPU", stage_launch_sweep),
)
