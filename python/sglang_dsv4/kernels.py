"""`sglang-dsv4 kernels`: every Triton kernel of sgl_kernel_dsv4 compiled ahead of time for the
GPUs it is written for, no GPU needed.

Per kernel and launch config (all the dispatcher and the launch sweep can choose, at the
DeepSeek-V4-Flash indexer shapes): shared memory, registers, spills, programs resident per SM,
waves at the GPU kit's shapes, and whether it fits. Exit 1 when a config does not fit, spills or
does not compile, or when the record the tuned-launch loader reads (launch_checked.json) no
longer says what this run found (`--record` writes it). The work is in
`sgl_kernel_dsv4.compile_check`.
"""

from __future__ import annotations

import json
import sys

WAVES_SHOWN = ("B=1 keys=81920", "B=32 keys=81920", "B=64 keys=81920", "rows=4096")
# Also fails: a logits config asking for more programs per SM than fit (at the model's heads),
# and a default on sm_120 that keeps fewer than two key tiles in flight.


def add_arguments(parser) -> None:
    parser.add_argument(
        "--target",
        default="sm_120,sm_90,sm_100",
        help="comma-separated targets (default: %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--record",
        action="store_true",
        help="write the logits configs that passed into sgl_kernel_dsv4/launch_checked.json",
    )


def parse_targets(text: str, known) -> list[str]:
    targets = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in targets if t not in known]
    if unknown or not targets:
        raise SystemExit(
            f"sglang-dsv4 kernels: unknown target(s) {unknown or [text]}; known: {', '.join(known)}"
        )
    return targets


def problems(results, record: dict, targets, check) -> list[str]:
    """One line per reason to fail: a config that does not fit, spills or fails to compile; a
    record for a checked target that disagrees with this run."""
    lines = []
    for r in results:
        what = f"{r.target} {r.kernel} {r.config} {r.params}"
        if r.error:
            lines.append(f"{what}: does not compile: {r.error}")
        elif not r.fits:
            lines.append(f"{what}: does not fit ({r.limited_by})")
        elif r.spills:
            lines.append(
                f"{what}: spills ({r.spill_store_bytes} B stored, {r.local_bytes} B local)"
            )
        asks = r.params.get("programs_per_sm")
        if r.fits and asks and r.params.get("heads") == check.INDEX_HEADS \
                and asks > r.resident_per_sm:
            lines.append(
                f"{what}: asks for {asks} programs per SM, {r.resident_per_sm} fit "
                "(the grid would launch more than one wave)"
            )
        if r.default and r.target == "sm_120" and r.params.get("heads") == check.INDEX_HEADS \
                and not r.error and not r.pipelined:
            lines.append(
                f"{what}: the default keeps {r.key_buffers} key tile(s) in flight, async_wait "
                f"{r.async_waits}: needs >= 2 (a multi-buffered key memdesc, a wait above 0)"
            )
    for target in targets:
        if target in record and record[target] != check.record_entry(results, target):
            lines.append(
                f"{target}: {check.RECORD_FILE.name} is stale (the kernel or its configs "
                f"changed since it was recorded): run `sglang-dsv4 kernels --target {target} "
                "--record`"
            )
    return lines


def render(results, failures) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="sgl_kernel_dsv4 compiled ahead of time")
    for column in ("target", "kernel", "config", "heads", "smem B", "regs", "spills",
                   "key tiles", "resident/SM", "waves", "fits"):
        table.add_column(column)
    for r in results:
        waves = ", ".join(f"{k}: {v}" for k, v in r.waves.items() if k in WAVES_SHOWN)
        table.add_row(
            r.target, r.kernel, r.config, str(r.params.get("heads", "")),
            str(r.shared_bytes), str(r.registers), "yes" if r.spills else "no",
            "" if r.key_buffers is None else f"{r.key_buffers} (wait {max(r.async_waits or [0])})",
            f"{r.resident_per_sm} ({r.limited_by})", waves,
            "yes" if r.passed else f"NO {r.error[:60]}",
        )
    console = Console(width=200)
    console.print(table)
    for line in failures:
        console.print(f"FAIL: {line}")


def run(args) -> int:
    from sgl_kernel_dsv4 import compile_check as check

    targets = parse_targets(args.target, check.TARGETS)
    try:
        results = check.run(targets)
    except check.CompileCheckError as exc:
        print(f"sglang-dsv4 kernels: {exc}", file=sys.stderr)
        return 2
    record = check.load_record()
    if args.record:
        for target in targets:
            record[target] = check.record_entry(results, target)
        check.write_record(record)
    failures = problems(results, record, targets, check)
    if args.json:
        print(json.dumps({
            "targets": {t: vars(check.TARGETS[t]) for t in targets},
            "results": [r.as_dict() for r in results],
            "failures": failures,
            "ok": not failures,
        }, indent=2))
    else:
        render(results, failures)
    return 1 if failures else 0
