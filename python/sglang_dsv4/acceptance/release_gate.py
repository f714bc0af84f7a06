"""Release gate: a build is called good only when a running deployment passes every criterion.

    sglang-dsv4 release-gate --router http://router:8000 \\
        --prefill http://prefill-0:30000 --decode http://decode-0:30001 \\
        --tokenizer deepseek-ai/DeepSeek-V4-Flash --baseline tp-release.json --rounds 5

Each round runs the DSML soak (sglang_dsv4.acceptance.dsml_soak; default the production shape: 64 sessions
growing to 80k tokens with tool calls) through the router, then the throughput matrix
(sglang_dsv4.acceptance.throughput, on upstream's bench_serving), and reads every server's /metrics before the
first round and after each. The gate passes only when, over all rounds:

- corruption: the soak's detector found 0 corrupt responses, and enough were checked to rule out
  --rule-out RATE (default 1/2000) at 95 %: a server corrupting that share of its responses shows
  at least one corrupt response in n checked with probability 1 - (1 - RATE)^n, so the gate needs
  n = ceil(ln 0.05 / ln(1 - RATE)) (5,990 for 1/2000) and refuses to pass on fewer (and on fewer
  than --min-responses); every verdict prints the rate its responses rule out,
  1 - 0.05^(1/n), and the 95 % Wilson upper bound;
- sanitizer: sglang:dsv4_sanitizer_violations_total did not grow on any server ("not enabled"
  when no server exposes it);
- failed requests: no soak or throughput request failed;
- NIXL control threads: sglang:nixl_control_thread_events_total{event="death"} did not grow;
- throughput: the median over rounds of out tok/s and tok/s/req at each concurrency is within
  --max-drop-percent (5) of the baseline.

It prints a verdict table (one line per criterion, with the evidence), writes JSON and a PNG plot,
and exits 0 when every criterion is met, 3 when one is not, 1 when it cannot start (router,
baseline or metrics unreadable) and 2 on bad usage. `--combine` judges the rounds of earlier runs
together (one run per cold launch) without measuring.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from sglang_dsv4 import metrics
from sglang_dsv4.acceptance import throughput
from sglang_dsv4.acceptance.arg_types import positive_float, positive_int
from sglang_dsv4.acceptance.dsml_soak import wilson

SANITIZER_METRIC = metrics.SANITIZER_VIOLATIONS
NIXL_METRIC = metrics.NIXL_CONTROL_THREAD_EVENTS
CRITERIA = ("corruption", "sanitizer", "failed requests", "NIXL control threads", "throughput")


class Failure(Exception):
    """The gate cannot start; the message is the one line to print."""


# --- the servers' metrics ----------------------------------------------------------------------


def parse_metrics(text: str) -> dict:
    """The gate's counters in one /metrics page: {"sanitizer": {kind: n} or None when the counter
    is absent (sanitizer off), "nixl": {"thread/event": n}}. Samples of one label set from several
    processes are summed."""
    sanitizer = None
    nixl: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in metrics.family_names(SANITIZER_METRIC):
            sanitizer = sanitizer or {}
        for sample in family.samples:
            if sample.name == SANITIZER_METRIC:
                kind = sample.labels.get("kind", "?")
                sanitizer[kind] = sanitizer.get(kind, 0.0) + sample.value
            elif sample.name == NIXL_METRIC:
                key = f"{sample.labels.get('thread', '?')}/{sample.labels.get('event', '?')}"
                nixl[key] = nixl.get(key, 0.0) + sample.value
    return {"sanitizer": sanitizer, "nixl": nixl}


def read_metrics(url: str, timeout: float) -> dict:
    """parse_metrics of GET url/metrics, or {"error": one line} when it cannot be read."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as response:
            text = response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as error:
        hint = " (start the server with --enable-metrics)" if error.code == 404 else ""
        return {"error": f"GET {url}/metrics answered HTTP {error.code}{hint}"}
    except OSError as exc:
        reason = getattr(exc, "reason", exc)
        return {"error": f"GET {url}/metrics: no answer ({reason})"}
    try:
        return parse_metrics(text)
    except ValueError as exc:
        return {"error": f"GET {url}/metrics: not Prometheus text ({exc})"}


def increase(before: dict[str, float], after: dict[str, float]) -> tuple[dict[str, float], bool]:
    """How much each counter grew, and whether one went back (the server restarted; then what it
    counts now all happened since)."""
    reset = any(after.get(key, 0.0) < value for key, value in before.items())
    base = {} if reset else before
    grown = {key: value - base.get(key, 0.0) for key, value in after.items()}
    return {key: value for key, value in grown.items() if value > 0}, reset


def server_round(server: dict, before: dict, after: dict) -> dict:
    """One server's record for one round, from its last readable snapshot and the one after."""
    record = {**server, "error": after.get("error"), "sanitizer_on": False}
    if record["error"]:
        return record
    nixl, reset = increase(before["nixl"], after["nixl"])
    sanitizer = {}
    if after["sanitizer"] is not None:
        record["sanitizer_on"] = True
        sanitizer, sanitizer_reset = increase(before["sanitizer"] or {}, after["sanitizer"])
        reset = reset or sanitizer_reset
    return {**record, "sanitizer": sanitizer, "nixl": nixl, "restarted": reset}


# --- one round ---------------------------------------------------------------------------------


def _tail(log: Path) -> str:
    lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
    return (lines[-1] if lines else "(no output)")[:200]


def run_soak(args: argparse.Namespace, number: int, out: Path) -> dict:
    """The DSML soak as a child process; its JSON summary, or Failure."""
    report, log = out / "soak.json", out / "soak.log"
    options = {
        "--base-url": args.router,
        "--model": args.model,
        "--sessions": args.sessions,
        "--turns": args.turns,
        "--target-context": args.target_context,
        "--concurrency": args.soak_concurrency,
        "--stream": args.stream,
        "--max-tokens": args.max_tokens,
        "--temperature": args.temperature,
        "--seed": args.seed + number - 1,  # each round its own conversations
        "--timeout": args.request_timeout,
        "--max-duration": args.soak_max_duration,
        "--json": report,
        "--examples": out / "soak-bad.jsonl",
    }
    command = [sys.executable, "-m", "sglang_dsv4.acceptance.dsml_soak"]
    for flag, value in options.items():
        if value is not None:
            command += [flag, str(value)]
    report.unlink(missing_ok=True)
    with open(log, "w") as handle:
        try:
            done = subprocess.run(
                command,
                stdout=handle,
                stderr=subprocess.STDOUT,
                timeout=args.soak_max_duration + args.request_timeout + 120,
            )
        except subprocess.TimeoutExpired:
            raise Failure(f"the soak ran past its deadline; see {log}") from None
    if not report.exists():
        raise Failure(f"the soak stopped (exit {done.returncode}): {_tail(log)}; see {log}")
    return json.loads(report.read_text())


def run_throughput(args: argparse.Namespace, out: Path, console: Console) -> list[dict]:
    """The throughput matrix, one bench_serving child per concurrency; rows, or Failure."""
    options = {
        "--base-url": args.router,
        "--model": args.model,
        "--tokenizer": args.tokenizer,
        "--num-prompts": args.num_prompts,
        "--input-len": args.input_len,
        "--output-len": args.output_len,
        "--dataset": args.dataset,
        "--dataset-path": args.dataset_path,
        "--run-timeout": args.run_timeout,
        "--out-dir": out,
    }
    argv = [
        str(item) for flag, value in options.items() if value is not None for item in (flag, value)
    ]
    argv += ["--concurrency", *(str(c) for c in args.concurrency)]
    bench = throughput.build_parser().parse_args(argv)
    try:
        return [throughput.run_one(bench, c, console) for c in bench.concurrency]
    except throughput.Failure as failure:
        raise Failure(str(failure)) from None


def run_round(args, number: int, servers: list[dict], last: dict, console: Console) -> dict:
    """Soak, throughput matrix, then every server's metrics; `last` holds each server's last
    readable snapshot and is brought up to date."""
    out = args.out_dir / f"round-{number}"
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    record: dict = {"round": number, "soak": None, "throughput": None}
    try:
        record["soak"] = run_soak(args, number, out)
        soak = record["soak"]
        console.print(
            f"round {number}: soak {soak['corrupt']} corrupt of {soak['responses']} responses, "
            f"{soak['errors']} errors, largest prompt {soak['max_context_tokens']} tokens"
        )
    except Failure as failure:
        record["soak_error"] = str(failure)
        console.print(f"round {number}: soak: {failure}", markup=False)
    try:
        record["throughput"] = run_throughput(args, out, console)
        speeds = ", ".join(
            f"c{row['concurrency']} {row['output_throughput']:.1f}" for row in record["throughput"]
        )
        console.print(f"round {number}: throughput {speeds} out tok/s")
    except Failure as failure:
        record["throughput_error"] = str(failure)
        console.print(f"round {number}: throughput: {failure}", markup=False)
    record["servers"] = []
    for server in servers:
        after = read_metrics(server["url"], args.metrics_timeout)
        record["servers"].append(server_round(server, last[server["url"]], after))
        if "error" not in after:
            last[server["url"]] = after
    record["duration_s"] = round(time.monotonic() - started, 1)
    return record


# --- the verdict -------------------------------------------------------------------------------


def _line(criterion: str, passed: bool | None, evidence: str) -> dict:
    status = "NOT ENABLED" if passed is None else ("PASS" if passed else "FAIL")
    return {"criterion": criterion, "status": status, "evidence": evidence}


def _round_errors(rounds: list[dict], key: str) -> list[str]:
    return [f"round {r['round']}: {r[key]}" for r in rounds if r.get(key)]


CONFIDENCE = 0.95


def responses_to_rule_out(rate: float, confidence: float = CONFIDENCE) -> int:
    """Responses to check so that a server corrupting `rate` of them shows at least one corrupt
    response with probability `confidence`: the least n with (1 - rate)^n <= 1 - confidence."""
    return math.ceil(math.log(1 - confidence) / math.log1p(-rate))


def rate_ruled_out(responses: int, confidence: float = CONFIDENCE) -> float | None:
    """The corruption rate that `responses` clean responses rule out at `confidence` (a server at
    that rate would have shown a corrupt one with that probability); None for no responses."""
    if responses <= 0:
        return None
    return 1 - (1 - confidence) ** (1 / responses)


def one_in(rate: float | None) -> str:
    return "nothing" if rate is None else f"1 in {1 / rate:,.0f}"


def parse_rate(text: str) -> float:
    """A rate as 1/2000 or 0.0005, strictly between 0 and 1."""
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            rate = float(num) / float(den)
        else:
            rate = float(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate (1/2000 or 0.0005)") from None
    if not 0 < rate < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a rate is between 0 and 1")
    return rate


def ruled_out_line(corrupt: int, responses: int) -> str:
    """What a verdict rules out: the rate, or nothing when corruption was seen."""
    if corrupt:
        return "rules out no rate (corruption seen)"
    return f"rules out a corruption rate of {one_in(rate_ruled_out(responses))} at 95 %"


def judge_corruption(rounds: list[dict], min_responses: int, rule_out: float = 1 / 2000) -> dict:
    soaks = [r["soak"] for r in rounds if r.get("soak")]
    responses = sum(s["responses"] for s in soaks)
    corrupt = sum(s["corrupt"] for s in soaks)
    upper = wilson(corrupt, responses)[1]
    evidence = (
        f"{corrupt} corrupt of {responses:,} checked responses ({len(rounds)} round(s) x "
        f"~{responses / max(1, len(rounds)):,.0f}); 95 % upper bound on the rate {upper:.2g}"
    )
    kinds: dict[str, int] = {}
    for soak in soaks:
        for kind, share in soak["by_kind"].items():
            kinds[kind] = kinds.get(kind, 0) + share["count"]
    if corrupt:
        evidence += " (" + ", ".join(f"{k} {n}" for k, n in kinds.items() if n) + ")"
    evidence += f"; {ruled_out_line(corrupt, responses)}"
    problems = _round_errors(rounds, "soak_error")
    needed = responses_to_rule_out(rule_out)
    if responses < needed:
        per_round = responses / max(1, len(rounds))
        more = f", about {math.ceil(needed / per_round)} round(s) of these" if per_round else ""
        problems.append(
            f"ruling out {one_in(rule_out)} at 95 % needs at least {needed:,} checked "
            f"responses{more}"
        )
    if responses < min_responses:
        problems.append(f"the bar asks for at least {min_responses:,} checked responses")
    evidence = "; ".join([evidence, *problems])
    return _line("corruption", corrupt == 0 and responses > 0 and not problems, evidence)


def judge_failed_requests(rounds: list[dict]) -> dict:
    soaks = [r["soak"] for r in rounds if r.get("soak")]
    rows = [row for r in rounds for row in r.get("throughput") or []]
    soak_failed = sum(s["errors"] for s in soaks)
    soak_sent = sum(s["requests"] for s in soaks)
    bench_failed = sum(row["errors"] for row in rows)
    bench_sent = sum(row["requests"] for row in rows)
    types: dict[str, int] = {}
    for soak in soaks:
        for kind, count in soak["errors_by_type"].items():
            types[kind] = types.get(kind, 0) + count
    detail = f": {', '.join(f'{k} {n}' for k, n in sorted(types.items()))}" if types else ""
    first = next((row["first_error"] for row in rows if row.get("first_error")), None)
    evidence = (
        f"{soak_failed + bench_failed} of {soak_sent + bench_sent:,} requests failed "
        f"(soak {soak_failed} of {soak_sent:,}{detail}; throughput {bench_failed} of {bench_sent:,}"
        + (f", first: {first[:80]}" if first else "")
        + ")"
    )
    return _line("failed requests", soak_failed + bench_failed == 0, evidence)


def _server_name(server: dict) -> str:
    return f"{server['role']} {server['url']}"


def _unreadable(rounds: list[dict]) -> list[str]:
    return [
        f"metrics of {_server_name(s)} unreadable after round {r['round']}: {s['error']}"
        for r in rounds
        for s in r["servers"]
        if s["error"]
    ]


def judge_sanitizer(rounds: list[dict], required: bool) -> dict:
    servers = {s["url"] for r in rounds for s in r["servers"]}
    on = {s["url"] for r in rounds for s in r["servers"] if s["sanitizer_on"]}
    if not on:
        evidence = f"not enabled: no server exposes {SANITIZER_METRIC}"
        if required:
            return _line("sanitizer", False, f"{evidence} (--require-sanitizer)")
        return _line("sanitizer", None, evidence)
    grown: dict[tuple[str, str], float] = {}
    for r in rounds:
        for s in r["servers"]:
            for kind, count in (s.get("sanitizer") or {}).items():
                key = (kind, _server_name(s))
                grown[key] = grown.get(key, 0) + count
    evidence = (
        f"{sum(grown.values()):g} violations on the {len(on)} of {len(servers)} servers with it on"
    )
    if grown:
        evidence += ": " + ", ".join(
            f"{kind} +{n:g} on {where}" for (kind, where), n in grown.items()
        )
    off = sorted(servers - on)
    problems = _unreadable(rounds)
    if off:
        problems.append(f"off on {', '.join(off)}" + (" (--require-sanitizer)" if required else ""))
    passed = not grown and not _unreadable(rounds) and not (required and off)
    return _line("sanitizer", passed, "; ".join([evidence, *problems]))


def judge_nixl(rounds: list[dict]) -> dict:
    deaths, dropped, restarted = [], 0.0, []
    for r in rounds:
        for s in r["servers"]:
            for key, count in (s.get("nixl") or {}).items():
                thread, _, event = key.rpartition("/")
                if event == "death":
                    deaths.append(f"{thread} x{count:g} on {_server_name(s)} (round {r['round']})")
                elif event == "dropped_message":
                    dropped += count
            if s.get("restarted"):
                restarted.append(f"{_server_name(s)} restarted in round {r['round']}")
    servers = {s["url"] for r in rounds for s in r["servers"]}
    evidence = (
        f"{len(deaths)} thread deaths on {len(servers)} servers; "
        f"{dropped:g} bad messages dropped and survived"
    )
    if deaths:
        evidence = f"deaths: {', '.join(deaths)}; {dropped:g} bad messages dropped"
    problems = _unreadable(rounds) + restarted
    return _line(
        "NIXL control threads", not deaths and not problems, "; ".join([evidence, *problems])
    )


def median_rows(rounds: list[dict]) -> list[dict]:
    """Per concurrency, the median over rounds of each compared metric."""
    by_concurrency: dict[int, list[dict]] = {}
    for r in rounds:
        for row in r.get("throughput") or []:
            by_concurrency.setdefault(row["concurrency"], []).append(row)
    medians = []
    for concurrency, rows in by_concurrency.items():
        median = {"concurrency": concurrency, "rounds": len(rows)}
        for key, _ in throughput.COLUMNS:
            values = [row[key] for row in rows if row.get(key) is not None]
            median[key] = statistics.median(values) if values else None
        medians.append(median)
    return medians


def judge_throughput(rounds: list[dict], baseline: dict, max_drop: float) -> tuple[dict, list]:
    problems = _round_errors(rounds, "throughput_error")
    medians = median_rows(rounds)
    changes = throughput.compare(medians, baseline, max_drop)
    if not changes:
        have = sorted(row["concurrency"] for row in baseline["runs"])
        measured = sorted(row["concurrency"] for row in medians)
        problems.append(f"nothing to compare: baseline concurrency {have}, measured {measured}")
        return _line("throughput", False, "; ".join(problems)), changes
    worst = min(changes, key=lambda c: c["change_percent"])
    outputs = ", ".join(
        f"c{c['concurrency']} {c['current']:.1f} ({c['change_percent']:+.1f} %)"
        for c in changes
        if c["metric"] == "output_throughput"
    )
    evidence = (
        f"out tok/s {outputs} against the baseline; worst {worst['change_percent']:+.1f} % "
        f"(c{worst['concurrency']} {worst['metric']}), limit -{max_drop:g} %"
    )
    passed = not problems and not any(c["regression"] for c in changes)
    return _line("throughput", passed, "; ".join([evidence, *problems])), changes


def judge(rounds: list[dict], baseline: dict, args: argparse.Namespace) -> tuple[list[dict], list]:
    tp_line, changes = judge_throughput(rounds, baseline, args.max_drop_percent)
    lines = [
        judge_corruption(rounds, args.min_responses, args.rule_out),
        judge_sanitizer(rounds, args.require_sanitizer),
        judge_failed_requests(rounds),
        judge_nixl(rounds),
        tp_line,
    ]
    return lines, changes


# --- output ------------------------------------------------------------------------------------


def print_verdict(report: dict, console: Console) -> None:
    table = Table(title="release gate", title_justify="left")
    table.add_column("criterion")
    table.add_column("verdict")
    table.add_column("evidence", overflow="fold")
    colour = {"PASS": "green", "FAIL": "red", "NOT ENABLED": "yellow"}
    for line in report["criteria"]:
        status = f"[{colour[line['status']]}]{line['status']}[/]"
        table.add_row(line["criterion"], status, line["evidence"], end_section=False)
    console.print(table)
    failed = [line["criterion"] for line in report["criteria"] if line["status"] == "FAIL"]
    rounds = len(report["rounds"])
    c = report["corruption"]
    ruled = f"{c['responses']:,} checked responses {ruled_out_line(c['corrupt'], c['responses'])}"
    if failed:
        console.print(f"release gate: FAIL ({', '.join(failed)}) over {rounds} round(s)")
    else:
        console.print(f"release gate: PASS over {rounds} round(s)")
    console.print(
        f"release gate: {ruled} (the bar: {one_in(c['rule_out'])}, "
        f"{c['responses_needed']:,} responses)",
        markup=False,
        highlight=False,
    )


def draw_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = report["rounds"]
    labels = [str(r["round"]) for r in rounds]
    figure, (evidence, speed, faults) = plt.subplots(1, 3, figsize=(15, 4.2))

    # How far the soak's evidence bounds the corruption rate, round after round.
    checked, corrupt, bounds = 0, 0, [(0, 1.0, 0)]
    for r in rounds:
        checked += (r.get("soak") or {}).get("responses", 0)
        corrupt += (r.get("soak") or {}).get("corrupt", 0)
        bounds.append((checked, wilson(corrupt, checked)[1], corrupt))
    evidence.plot([b[0] for b in bounds], [b[1] for b in bounds], marker="o", color="#1f77b4")
    for n, bound, bad in bounds:
        if bad:
            evidence.annotate(f"{bad} corrupt", (n, bound), color="#d62728")
    evidence.axvline(report["corruption"]["responses_needed"], color="#999999", linestyle="--")
    evidence.set_yscale("log")
    evidence.set_xlabel("checked responses (cumulative)")
    evidence.set_ylabel("95 % upper bound on corruption rate")

    # Each round's output tok/s against the baseline, per concurrency.
    base = {row["concurrency"]: row.get("output_throughput") for row in report["baseline"]["runs"]}
    series: dict[int, list] = {}
    for index, r in enumerate(rounds):
        for row in r.get("throughput") or []:
            old = base.get(row["concurrency"])
            if old and row.get("output_throughput") is not None:
                change = 100.0 * (row["output_throughput"] - old) / old
                series.setdefault(row["concurrency"], []).append((index, change))
    for concurrency, points in series.items():
        speed.plot(
            [p[0] for p in points], [p[1] for p in points], marker="o", label=f"c{concurrency}"
        )
    speed.axhline(-report["config"]["max_drop_percent"], color="#d62728", linestyle="--")
    speed.axhline(0, color="#999999", linewidth=0.8)
    speed.set_xticks(range(len(rounds)), labels)
    speed.set_xlabel("round")
    speed.set_ylabel("out tok/s change against baseline, %")
    if series:
        speed.legend()

    # What must stay at zero.
    counts = {
        "failed requests": [
            (r.get("soak") or {}).get("errors", 0)
            + sum(row["errors"] for row in r.get("throughput") or [])
            for r in rounds
        ],
        "sanitizer violations": [
            sum(sum((s.get("sanitizer") or {}).values()) for s in r["servers"]) for r in rounds
        ],
        "NIXL deaths": [
            sum(
                n
                for s in r["servers"]
                for k, n in (s.get("nixl") or {}).items()
                if k.endswith("/death")
            )
            for r in rounds
        ],
    }
    width = 0.8 / len(counts)
    for offset, (name, values) in enumerate(counts.items()):
        faults.bar(
            [i + (offset - 1) * width for i in range(len(rounds))], values, width, label=name
        )
    faults.set_xticks(range(len(rounds)), labels)
    faults.set_ylim(0, max(1, *(max(values) for values in counts.values())) * 1.15)
    faults.set_xlabel("round")
    faults.set_ylabel("count (must be 0)")
    faults.legend()

    figure.suptitle(f"release gate: {report['verdict'].upper()}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# --- command line ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-dsv4 release-gate",
        description="Soak, throughput matrix and the servers' metrics, round after round; one "
        "verdict: PASS only when every criterion is met.",
    )
    where = parser.add_argument_group("the deployment")
    where.add_argument("--router", help="the router (or a server) the requests go to")
    for role in ("prefill", "decode"):
        where.add_argument(
            f"--{role}",
            action="append",
            default=[],
            metavar="URL",
            help=f"a {role} server whose /metrics is read (repeat for several)",
        )
    where.add_argument("--model", help="model id (default: the first of the router's /v1/models)")
    where.add_argument("--metrics-timeout", type=positive_float, default=30.0)

    bar = parser.add_argument_group("the bar")
    bar.add_argument("--rounds", type=positive_int, default=1)
    bar.add_argument(
        "--rule-out",
        type=parse_rate,
        default=1 / 2000,
        metavar="RATE",
        help="the corruption rate the gate must rule out at 95 %% (1/2000 or 0.0005): it needs "
        "ceil(ln 0.05 / ln(1 - RATE)) checked responses, 5,990 for 1/2000, and fails on fewer",
    )
    bar.add_argument(
        "--min-responses",
        type=int,
        default=0,
        help="fail unless the soaks checked at least this many responses in all "
        "(the field's bar: 11187)",
    )
    bar.add_argument(
        "--baseline",
        help="throughput JSON of the build to compare with "
        "(sglang-dsv4 throughput --json, or an earlier gate's JSON)",
    )
    bar.add_argument("--max-drop-percent", type=float, default=5.0)
    bar.add_argument(
        "--require-sanitizer",
        action="store_true",
        help="fail when a server does not expose the sanitizer's counter",
    )

    soak = parser.add_argument_group("the soak (sglang_dsv4.acceptance.dsml_soak)")
    soak.add_argument("--sessions", type=positive_int, default=64)
    soak.add_argument("--turns", type=positive_int, default=40)
    soak.add_argument("--target-context", type=positive_int, default=80_000)
    soak.add_argument("--soak-concurrency", type=positive_int, default=None)
    soak.add_argument("--stream", choices=("mixed", "on", "off"), default="mixed")
    soak.add_argument("--max-tokens", type=positive_int, default=1024)
    soak.add_argument("--temperature", type=float, default=None)
    soak.add_argument("--seed", type=int, default=0, help="round r uses seed + r - 1")
    soak.add_argument("--request-timeout", type=positive_float, default=600.0)
    soak.add_argument("--soak-max-duration", type=positive_float, default=4 * 3600.0)

    matrix = parser.add_argument_group("the throughput matrix (sglang-dsv4 throughput)")
    matrix.add_argument("--tokenizer")
    matrix.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 32])
    matrix.add_argument("--num-prompts", type=positive_int, default=64)
    matrix.add_argument("--input-len", type=positive_int, default=1024)
    matrix.add_argument("--output-len", type=positive_int, default=256)
    matrix.add_argument("--dataset", choices=("random", "random-ids"), default="random")
    matrix.add_argument("--dataset-path")
    matrix.add_argument("--run-timeout", type=positive_float, default=3600.0)

    out = parser.add_argument_group("output")
    out.add_argument("--out-dir", type=Path, default=Path("out/release-gate"))
    out.add_argument("--json", type=Path, help="default: OUT_DIR/release_gate.json")
    out.add_argument("--plot", type=Path, help="default: OUT_DIR/release_gate.png")
    out.add_argument(
        "--combine",
        nargs="+",
        metavar="GATE.json",
        help="do not measure: judge the rounds of these earlier gate runs together",
    )
    return parser


def load_baseline(path: str) -> dict:
    """A throughput JSON, or an earlier gate's JSON (its median matrix)."""
    try:
        with open(path) as handle:
            data = json.load(handle)
        runs = data.get("runs") if "runs" in data else (data.get("throughput") or {}).get("runs")
        if not isinstance(runs, list) or not runs:
            raise ValueError("no throughput 'runs' in it")
    except (OSError, ValueError, AttributeError) as exc:
        raise Failure(f"cannot use {path} as a baseline: {exc}") from None
    return {"path": path, "runs": runs}


def first_model(url: str, timeout: float) -> str:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=timeout) as response:
            models = json.load(response).get("data") or []
    except urllib.error.HTTPError as error:
        raise Failure(f"{url}/v1/models answered HTTP {error.code}") from None
    except (OSError, ValueError) as exc:
        raise Failure(f"cannot list models at {url}: {getattr(exc, 'reason', exc)}") from None
    if not models:
        raise Failure(f"{url} serves no model; pass --model")
    return models[0]["id"]


def load_runs(paths: list[str]) -> list[dict]:
    rounds = []
    for path in paths:
        try:
            with open(path) as handle:
                data = json.load(handle)
            if not isinstance(data.get("rounds"), list):
                raise ValueError("no 'rounds' list: not a release gate JSON")
        except (OSError, ValueError, AttributeError) as exc:
            raise Failure(f"cannot combine {path}: {exc}") from None
        rounds += [
            {**r, "round": len(rounds) + i + 1, "from": path} for i, r in enumerate(data["rounds"])
        ]
    return rounds


def measure(args, servers: list[dict], console: Console) -> list[dict]:
    last = {}
    for server in servers:
        snapshot = read_metrics(server["url"], args.metrics_timeout)
        if "error" in snapshot:
            raise Failure(snapshot["error"])
        last[server["url"]] = snapshot
    on = sum(snapshot["sanitizer"] is not None for snapshot in last.values())
    console.print(
        f"release gate: {args.rounds} round(s) against {args.router} ({args.model}); "
        f"{len(servers)} servers' metrics read, sanitizer on {on} of them"
    )
    return [run_round(args, n, servers, last, console) for n in range(1, args.rounds + 1)]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    servers = [
        {"role": role, "url": url.rstrip("/")}
        for role in ("prefill", "decode")
        for url in getattr(args, role)
    ]
    if not args.baseline:
        parser.error(
            "--baseline is required (make one with: python -m sglang-dsv4 throughput --json)"
        )
    if not args.combine:
        if not args.router:
            parser.error("--router is required (or --combine to judge earlier runs)")
        if not servers:
            parser.error("name the servers whose metrics are read: --prefill and/or --decode URL")
        for url in [args.router] + [s["url"] for s in servers]:
            if not url.startswith(("http://", "https://")):
                parser.error(f"a URL starts with http:// or https://, not {url!r}")
        args.router = args.router.rstrip("/")
    if args.min_responses < 0:
        parser.error("--min-responses cannot be negative")
    if args.max_drop_percent < 0:
        parser.error("--max-drop-percent cannot be negative")
    args.json = args.json or args.out_dir / "release_gate.json"
    args.plot = args.plot or args.out_dir / "release_gate.png"
    # Logs and CI are not terminals: wide enough for the evidence, no wrapped lines.
    console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)
    started = time.monotonic()
    try:
        baseline = load_baseline(args.baseline)
        if args.combine:
            rounds = load_runs(args.combine)
        else:
            args.model = args.model or first_model(args.router, args.metrics_timeout)
            args.out_dir.mkdir(parents=True, exist_ok=True)
            rounds = measure(args, servers, console)
    except Failure as failure:
        console.print(f"release gate: {failure}", markup=False, highlight=False)
        return 1
    criteria, changes = judge(rounds, baseline, args)
    failed = any(line["status"] == "FAIL" for line in criteria)
    soaks = [r["soak"] for r in rounds if r.get("soak")]
    checked = sum(s["responses"] for s in soaks)
    corrupt = sum(s["corrupt"] for s in soaks)
    report = {
        "verdict": "fail" if failed else "pass",
        "criteria": criteria,
        "corruption": {
            "rounds": len(rounds),
            "responses": checked,
            "corrupt": corrupt,
            "upper_bound_95": wilson(corrupt, checked)[1],
            "rule_out": args.rule_out,
            "responses_needed": max(args.min_responses, responses_to_rule_out(args.rule_out)),
            "rate_ruled_out_95": None if corrupt else rate_ruled_out(checked),
        },
        "throughput": {"runs": median_rows(rounds), "comparison": changes},
        "baseline": baseline,
        "rounds": rounds,
        "duration_s": round(time.monotonic() - started, 1),
        "config": {
            key: str(value) if isinstance(value, Path) else value
            for key, value in vars(args).items()
        },
    }
    print_verdict(report, console)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    draw_plot(report, args.plot)
    console.print(f"release gate: wrote {args.json} and {args.plot}", markup=False, highlight=False)
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
