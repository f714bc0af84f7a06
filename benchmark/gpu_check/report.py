"""The kit's reports: the performance targets as pass / fail lines, DIR/gpu_check.json (strict
JSON: a non-finite figure is written as the string "nan", "inf" or "-inf", never as the bare
NaN / Infinity no JSON parser accepts) and DIR/gpu_check.md."""

from __future__ import annotations

import json
import math
import os


def targets(kit) -> list:
    """The issue's performance targets as pass / fail lines (never the exit status)."""
    stages = kit.report["stages"]
    lines = []
    if not kit.cuda:
        for name in (
            "roofline >= 70 % at B=32, 80k keys",
            "bf16 step <= 2.1x fp8 step",
            "bf16 >= 1.5x faster than upstream's fp8 torch path (sm_120)",
            "graph replay == eager, bit for bit",
        ):
            lines.append({"target": name, "status": "skipped (no CUDA)"})
        return lines
    target = next(
        (
            c
            for c in stages.get("speed", {}).get("cases", [])
            if (c["batch"], c["keys"]) == tuple(kit.sizes.target_case)
        ),
        None,
    )

    def line(name, value, passed, detail=""):
        status = "n/a" if passed is None else ("PASS" if passed else "FAIL")
        lines.append({"target": name, "status": status, "value": value, "detail": detail})

    if target is None:
        line("roofline >= 70 % at B=32, 80k keys", None, None, "speed stage did not measure it")
        line("bf16 step <= 2.1x fp8 step", None, None, "speed stage did not measure it")
        line(
            "bf16 >= 1.5x faster than upstream's fp8 torch path (sm_120)",
            None,
            None,
            "speed stage did not measure it",
        )
    else:
        fraction = target.get("roofline_fraction")
        line(
            "roofline >= 70 % at B=32, 80k keys",
            fraction,
            None if fraction is None else fraction >= 0.70,
        )
        kernels = {k: v for k, v in target["fp8_us"].items() if "torch" not in k}
        if kernels:
            label = min(kernels, key=kernels.get)
            ratio = target["bf16_over_fp8"][label]
            line("bf16 step <= 2.1x fp8 step", ratio, ratio <= 2.1, f"vs {label}")
        elif target["fp8_us"]:
            label = next(iter(target["fp8_us"]))
            ratio = target["bf16_over_fp8"][label]
            line(
                "bf16 step <= 2.1x fp8 step",
                ratio,
                None,
                f"only {label} here: a torch step, not an fp8 kernel; indicative only",
            )
        else:
            line("bf16 step <= 2.1x fp8 step", None, None, "no fp8 step ran")
        upstream = target["fp8_us"].get("fp8 torch sm120 (upstream)")
        capability = kit.report["environment"].get("capability")
        if upstream is None:
            line(
                "bf16 >= 1.5x faster than upstream's fp8 torch path (sm_120)",
                None,
                None,
                f"upstream's path did not run: sglang {kit.sglang_absent or 'present'}",
            )
        else:
            speedup = upstream / target["triton_us"]
            line(
                "bf16 >= 1.5x faster than upstream's fp8 torch path (sm_120)",
                speedup,
                speedup >= 1.5,
                "" if capability == "12.0" else f"measured on sm {capability}",
            )
    graphs = stages.get("cuda_graphs", {})
    if graphs.get("cases"):
        equal = all(c.get("bit_equal", True) for c in graphs["cases"])
        line("graph replay == eager, bit for bit", equal, equal)
    else:
        line("graph replay == eager, bit for bit", None, None, graphs.get("status", "not run"))
    return lines


def fmt(value, spec=".3g"):
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def markdown(kit) -> str:
    report = kit.report
    env = report["environment"]
    out = [
        f"# GPU proof kit: {env.get('gpu', '?')} (capability {env.get('capability', '?')})",
        "",
        f"Mode: {report['mode']}; started {report['started']}; "
        f"{report.get('seconds', 0):.0f} s of a {report['limit_s']} s limit. "
        f"Result: **{report.get('result', '?')}**.",
        "",
        f"torch {env.get('torch')}, triton {env.get('triton')}, Python {env.get('python')}, "
        f"CUDA {env.get('torch_cuda')}, sglang {env.get('sglang')}, DeepGEMM {env.get('deep_gemm')}; "
        f"{env.get('sm_count')} SMs; copy bandwidth {fmt(env.get('copy_bandwidth_gbps'))} GB/s; "
        f"default launch config {env.get('launch_config_for_this_device')}.",
        "",
        "| stage | status | seconds | budget s |",
        "| --- | --- | ---: | ---: |",
    ]
    for stage in kit.stages:
        rec = report["stages"].get(stage.name, {"status": "not run"})
        status = rec["status"] + (f": {rec['error']}" if rec.get("error") else "")
        out.append(f"| {stage.name} | {status} | {fmt(rec.get('seconds'))} | {stage.budget_s} |")
    out += ["", "## Performance targets (reported only; they do not change the exit status)", ""]
    for line in report.get("targets", []):
        detail = f" ({line['detail']})" if line.get("detail") else ""
        out.append(f"- {line['status']}: {line['target']}: {fmt(line.get('value'))}{detail}")
    stages = report["stages"]
    if stages.get("correctness", {}).get("cases"):
        out += [
            "",
            "## Correctness (relative to the fp32 reference)",
            "",
            "| case | triton rel err | torch rel err | triton vs torch | triton top-512 "
            "| torch top-512 | -inf same | ok |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
        ]
        for c in stages["correctness"]["cases"]:
            out.append(
                f"| {c['case']} | {c['triton_rel_err']:.1e} | {c['torch_rel_err']:.1e} | "
                f"{c['triton_vs_torch_rel_err']:.1e} | {c['triton_top512']:.4f} | "
                f"{c['torch_top512']:.4f} | {fmt(c['same_inf'])} | {fmt(c['ok'])} |"
            )
    rotations = stages.get("correctness", {}).get("rotation_cases")
    if rotations:
        out += [
            "",
            "## Fused rotations vs their torch reference",
            "",
            "| case | max error (bf16 ulps) | bit-equal share | ok |",
            "| --- | ---: | ---: | --- |",
        ]
        for c in rotations:
            out.append(
                f"| {c['case']} | {c['max_err_in_bf16_ulps']:.2f} | "
                f"{c['bit_equal_share']:.4f} | {fmt(c['ok'])} |"
            )
    if stages.get("cuda_graphs", {}).get("cases"):
        out += [
            "",
            "## CUDA graphs (replay with new inputs vs eager)",
            "",
            "| case | bit-equal | replay saw new inputs | ok |",
            "| --- | --- | --- | --- |",
        ]
        for c in stages["cuda_graphs"]["cases"]:
            if "status" in c:
                out.append(f"| {c['case']} | {c['status']} | | |")
            else:
                out.append(
                    f"| {c['case']} | {fmt(c['bit_equal'])} | "
                    f"{fmt(c['replay_saw_new_inputs'])} | {fmt(c['ok'])} |"
                )
    if stages.get("speed", {}).get("cases"):
        timing = "us" if kit.cuda else "us (CPU interpreter: not a measurement)"
        out += [
            "",
            f"## Speed, ratios from this run ({timing})",
            "",
            "| case | triton | torch path | torch / triton | GB/s | roofline | fp8 step "
            "| bf16 / fp8 |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
        ]
        for c in stages["speed"]["cases"]:
            fp8 = "; ".join(f"{k} {v:.1f}" for k, v in c["fp8_us"].items()) or "-"
            ratios = "; ".join(f"{v:.2f}x" for v in c["bf16_over_fp8"].values()) or "-"
            out.append(
                f"| {c['case']} | {c['triton_us']:.1f} | {c['torch_us']:.1f} | "
                f"{c['torch_over_triton']:.1f}x | {c['achieved_gbps']:.0f} | "
                f"{fmt(c['roofline_fraction'], '.1%')} | {fp8} | {ratios} |"
            )
            for label, error in c.get("fp8_errors", {}).items():
                out.append(f"|  | {label} did not run: {error} | | | | | | |")
    for c in stages.get("speed", {}).get("rotation_cases", []):
        out.append(
            f"- {c['case']}: fused {c['fused_us']:.1f} us, torch {c['torch_us']:.1f} us "
            f"({c['torch_over_fused']:.1f}x)"
        )
    sweep = stages.get("launch_sweep", {})
    if sweep.get("cases"):
        out += [
            "",
            f"## Launch sweep at {sweep.get('shape')} (dispatcher default: "
            f"{fmt(sweep.get('default_us'), '.1f')} us)",
            "",
            "| config | ok | us |",
            "| --- | --- | ---: |",
        ]
        for c in sweep["cases"]:
            ok = c.get("error") or fmt(c.get("ok"))
            out.append(
                f"| `{json.dumps(c['config'], sort_keys=True)}` | {ok} | "
                f"{fmt(c.get('us'), '.1f')} |"
            )
        if sweep.get("best"):
            out.append(
                f"\nBest: `{json.dumps(sweep['best']['config'], sort_keys=True)}`, "
                f"written to tuned_launch.json."
            )
    for c in stages.get("sglang", {}).get("cases", []):
        out += [
            "",
            f"## sglang: {c['case']}: stored keys max rel diff "
            f"{c['keys_max_rel_diff']:.1e}, top-512 agreement {c['top512_agreement']:.4f}, "
            f"slots follow the page table {fmt(c['slots_follow_table'])}, ok {fmt(c['ok'])}",
        ]
    for stage in kit.stages:
        for note in report["stages"].get(stage.name, {}).get("notes", []):
            out.append(f"\nNote ({stage.name}): {note}")
    return "\n".join(out) + "\n"


def finite_json(value):
    """`value` with every non-finite float replaced by its name ("nan", "inf", "-inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def write_text_atomically(path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def write_reports(kit):
    kit.out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(finite_json(kit.report), indent=2, default=str, allow_nan=False) + "\n"
    write_text_atomically(kit.out / "gpu_check.json", text)
    write_text_atomically(kit.out / "gpu_check.md", markdown(kit))
