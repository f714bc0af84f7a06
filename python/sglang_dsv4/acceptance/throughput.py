"""Throughput matrix: upstream's serving benchmark at concurrency 1 and 32, one table, a baseline.

    sglang-dsv4 throughput --base-url http://router:8000 --tokenizer /models/DeepSeek-V4-Flash \\
        --json tp.json --chart tp.png --baseline tp-previous.json

For each concurrency it runs `python -m sglang.benchmark.serving` (what `sglang.bench_serving`
forwards to in 0.5.23) as a child process: chat completions, random dataset, fixed lengths
(--random-range-ratio 1), fixed seed, 64 requests. It reads that run's JSONL result and prints one
table: output tokens/s in aggregate and per request (1000 / median TPOT, the decode speed one user
sees), TTFT and ITL p50/p99, end-to-end p50 and failed requests. It writes JSON and a PNG chart,
and compares output tokens/s with a saved JSON of an earlier run.

Exit status: 0 clean; 1 could not measure; 2 bad usage; 3 a request failed or output tokens/s
dropped beyond --max-drop-percent against the baseline.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sglang_dsv4.acceptance.arg_types import DefaultsHelpFormatter, positive_int

BENCH_MODULE = "sglang.benchmark.serving"

# (result key, column title); the result keys are bench_serving's, per_request_tok_s is ours.
COLUMNS = (
    ("output_throughput", "out tok/s"),
    ("per_request_tok_s", "tok/s/req"),
    ("median_ttft_ms", "TTFT p50"),
    ("p99_ttft_ms", "TTFT p99"),
    ("median_itl_ms", "ITL p50"),
    ("p99_itl_ms", "ITL p99"),
    ("median_e2e_latency_ms", "E2E p50"),
)
# Compared with the baseline; higher is better for both.
COMPARED = ("output_throughput", "per_request_tok_s")


class Failure(Exception):
    """The measurement could not be made; the message is the one line to print."""


def bench_command(args: argparse.Namespace, concurrency: int, result_file: Path) -> list[str]:
    options = {
        "--backend": args.backend,
        "--base-url": args.base_url,
        "--model": args.model,
        "--tokenizer": args.tokenizer,
        "--dataset-name": args.dataset,
        "--dataset-path": args.dataset_path,
        "--random-input-len": args.input_len,
        "--random-output-len": args.output_len,
        "--random-range-ratio": 1.0,  # every request exactly input-len in, output-len out
        "--num-prompts": args.num_prompts,
        "--max-concurrency": concurrency,
        "--seed": args.seed,
        "--warmup-requests": 1,
        "--output-file": result_file,
    }
    command = [sys.executable, "-m", BENCH_MODULE]
    for flag, value in options.items():
        if value is not None:
            command += [flag, str(value)]
    return command + ["--output-details", "--disable-tqdm"]


def summarise(result: dict, num_prompts: int, concurrency: int) -> dict:
    """One row of the matrix from one bench_serving JSONL record."""
    errors = [error for error in result.get("errors", []) if error]
    tpot = result.get("median_tpot_ms") or 0.0
    row = {
        "concurrency": concurrency,
        "requests": num_prompts,
        "completed": result["completed"],
        "errors": num_prompts - result["completed"],
        "first_error": errors[0].strip().splitlines()[-1][:200] if errors else None,
        "per_request_tok_s": 1000.0 / tpot if tpot > 0 else None,
        "duration_s": result["duration"],
    }
    for key, _ in COLUMNS:
        row.setdefault(key, result.get(key))
    for key in (
        "request_throughput",
        "mean_e2e_latency_ms",
        "p99_e2e_latency_ms",
        "median_tpot_ms",
        "total_output_tokens",
    ):
        row[key] = result.get(key)
    return row


def run_one(args: argparse.Namespace, concurrency: int, console: Console) -> dict:
    result_file = args.out_dir / f"bench_c{concurrency}.jsonl"
    log_file = args.out_dir / f"bench_c{concurrency}.log"
    result_file.unlink(missing_ok=True)  # bench_serving appends
    command = bench_command(args, concurrency, result_file)
    console.print(f"concurrency {concurrency}: {args.num_prompts} requests (log: {log_file})")
    with open(log_file, "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        try:
            finished = subprocess.run(
                command, stdout=log, stderr=subprocess.STDOUT, timeout=args.run_timeout
            )
        except subprocess.TimeoutExpired:
            raise Failure(
                f"bench_serving at concurrency {concurrency} ran past {args.run_timeout:.0f} s; see {log_file}"
            ) from None
    if finished.returncode != 0 or not result_file.exists():
        tail = log_file.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise Failure(
            f"bench_serving at concurrency {concurrency} failed (exit {finished.returncode}): "
            f"{tail[0][:200]}; see {log_file}"
        )
    try:
        last = result_file.read_text().strip().splitlines()[-1]
        return summarise(json.loads(last), args.num_prompts, concurrency)
    except (IndexError, KeyError, ValueError) as exc:
        raise Failure(f"cannot read bench_serving's result {result_file}: {exc!r}") from None


def compare(rows: list[dict], baseline: dict, max_drop_percent: float) -> list[dict]:
    """Each compared metric against the baseline run at the same concurrency."""
    old_rows = {row["concurrency"]: row for row in baseline["runs"]}
    changes = []
    for row in rows:
        old = old_rows.get(row["concurrency"])
        if old is None:
            continue
        for key in COMPARED:
            before, now = old.get(key), row.get(key)
            if not before or now is None:
                continue
            change = 100.0 * (now - before) / before
            changes.append(
                {
                    "concurrency": row["concurrency"],
                    "metric": key,
                    "baseline": before,
                    "current": now,
                    "change_percent": change,
                    "regression": change < -max_drop_percent,
                }
            )
    return changes


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def print_table(report: dict, console: Console) -> None:
    table = Table(
        title="throughput (sglang.benchmark.serving; latencies in ms)", title_justify="left"
    )
    table.add_column("conc", justify="right")
    for _, title in COLUMNS:
        table.add_column(title, justify="right")
    table.add_column("errors", justify="right")
    for row in report["runs"]:
        cells = [_fmt(row[key]) for key, _ in COLUMNS]
        errors = f"[red]{row['errors']}[/]" if row["errors"] else "0"
        table.add_row(str(row["concurrency"]), *cells, f"{errors}/{row['requests']}")
    console.print(table)
    for row in report["runs"]:
        if row["first_error"]:
            console.print(
                f"concurrency {row['concurrency']}: first error: {row['first_error']}", markup=False
            )
    for change in report.get("comparison") or []:
        flag = "[red]REGRESSION[/]" if change["regression"] else "ok"
        console.print(
            f"{flag} concurrency {change['concurrency']} {change['metric']}: "
            f"{change['baseline']:.1f} -> {change['current']:.1f} ({change['change_percent']:+.1f} %)"
        )


def draw_chart(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    labels = [str(row["concurrency"]) for row in runs]
    positions = range(len(runs))
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.38
    baseline = {row["concurrency"]: row for row in (report.get("baseline") or {}).get("runs", [])}
    if baseline:
        old = [baseline.get(row["concurrency"], {}).get("output_throughput") or 0 for row in runs]
        left.bar([p - width / 2 for p in positions], old, width, label="baseline", color="#bbbbbb")
        left.bar(
            [p + width / 2 for p in positions],
            [row["output_throughput"] for row in runs],
            width,
            label="this run",
            color="#1f77b4",
        )
        left.legend()
    else:
        left.bar(
            list(positions), [row["output_throughput"] for row in runs], width, color="#1f77b4"
        )
    left.set_xticks(list(positions), labels)
    left.set_xlabel("concurrency")
    left.set_ylabel("output tokens/s (aggregate)")
    for key, title in (("median_ttft_ms", "TTFT p50"), ("median_e2e_latency_ms", "end-to-end p50")):
        right.plot(labels, [(row[key] or 0) / 1000 for row in runs], marker="o", label=title)
    right.set_xlabel("concurrency")
    right.set_ylabel("seconds")
    right.legend()
    figure.suptitle(
        f"{report['config']['input_len']} in / {report['config']['output_len']} out tokens"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def load_report(path: str, what: str) -> dict:
    try:
        with open(path) as handle:
            report = json.load(handle)
        if not isinstance(report.get("runs"), list):
            raise ValueError("no 'runs' list")
        return report
    except (OSError, ValueError) as exc:
        raise Failure(f"cannot use {path} as {what}: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-dsv4 throughput",
        formatter_class=DefaultsHelpFormatter,
        description="Throughput at concurrency 1 and 32 through sglang.benchmark.serving.",
    )
    parser.add_argument("--base-url", help="server or router, e.g. http://router:8000")
    parser.add_argument("--model", help="model id (default: the first of /v1/models)")
    parser.add_argument(
        "--tokenizer", help="tokenizer path or id (default: the server's /model_info)"
    )
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        nargs="+",
        default=[1, 32],
        help="concurrent requests, one run each",
    )
    parser.add_argument(
        "--num-prompts", type=positive_int, default=64, help="requests per concurrency"
    )
    parser.add_argument(
        "--input-len", type=positive_int, default=1024, help="prompt tokens per request"
    )
    parser.add_argument(
        "--output-len", type=positive_int, default=256, help="output tokens per request"
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the random prompts")
    parser.add_argument(
        "--dataset",
        choices=("random", "random-ids"),
        default="random",
        help="random: ShareGPT text cut to length; random-ids: random token ids",
    )
    parser.add_argument("--dataset-path", help="local ShareGPT JSON for --dataset random")
    parser.add_argument(
        "--backend",
        default="sglang-oai-chat",
        help="bench_serving backend (default sglang-oai-chat: /v1/chat/completions)",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("out/throughput"),
        help="bench_serving logs and JSONL results (default out/throughput)",
    )
    parser.add_argument("--json", type=Path, metavar="OUT", help="write the matrix as JSON")
    parser.add_argument("--chart", type=Path, metavar="OUT.png", help="write a PNG chart")
    parser.add_argument("--baseline", metavar="OLD.json", help="a JSON written by an earlier run")
    parser.add_argument(
        "--max-drop-percent",
        type=float,
        default=5.0,
        help="flag a drop in output tok/s larger than this against --baseline (default: %(default)s)",
    )
    parser.add_argument(
        "--run-timeout", type=float, default=3600.0, help="seconds one bench_serving run may take"
    )
    parser.add_argument(
        "--report",
        metavar="RUN.json",
        help="do not measure: print and compare a JSON written earlier",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.report and not args.base_url:
        parser.error("--base-url is required (or --report to re-read a saved run)")
    if args.max_drop_percent < 0:
        parser.error("--max-drop-percent cannot be negative")
    if args.base_url and not args.base_url.startswith(("http://", "https://")):
        parser.error(f"--base-url must start with http:// or https://, not {args.base_url!r}")
    # Logs and CI are not terminals: wide enough for the tables, and no wrapped lines.
    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 120)
    try:
        baseline = load_report(args.baseline, "a baseline") if args.baseline else None
        if args.report:
            report = load_report(args.report, "a saved run")
        else:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            report = {
                "config": {
                    "base_url": args.base_url,
                    "model": args.model,
                    "tokenizer": args.tokenizer,
                    "backend": args.backend,
                    "dataset": args.dataset,
                    "input_len": args.input_len,
                    "output_len": args.output_len,
                    "num_prompts": args.num_prompts,
                    "seed": args.seed,
                },
                "runs": [run_one(args, c, console) for c in args.concurrency],
            }
    except Failure as failure:
        console.print(f"throughput: {failure}", markup=False, highlight=False)
        return 1
    if baseline is not None:
        report["baseline"] = {"config": baseline.get("config"), "runs": baseline["runs"]}
        report["comparison"] = compare(report["runs"], baseline, args.max_drop_percent)
        report["max_drop_percent"] = args.max_drop_percent
    print_table(report, console)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.chart:
        draw_chart(report, args.chart)
    failed = sum(row["errors"] for row in report["runs"])
    regressions = [c for c in report.get("comparison") or [] if c["regression"]]
    if failed or regressions:
        console.print(
            f"throughput: {failed} failed requests, {len(regressions)} drops beyond "
            f"{args.max_drop_percent:g} %"
        )
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
