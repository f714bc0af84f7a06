"""What the plugin adds to SGLang's start-up: `python -m sglang.launch_server --help`, with and without.

Every SGLang process (launcher, each scheduler, detokenizer) loads plugins first, so what the
plugin imports at load it costs each of them. Both variants run in this one invocation,
interleaved, with the same other plugins (upstream's SGLANG_PLUGINS whitelist lists every other
installed plugin, plus dsv4_sm120 or not): wall time, CPU time (user + system) and the child's
peak RSS (wait4) per run, medians compared as a ratio and a difference. On a busy machine wall
time swings by seconds between runs; CPU time much less. Exit 0 within the targets (default: at
most 0.5 s wall and 50 MiB more), 3 beyond them, 1 when a run fails.

    python -m benchmark.startup_cost --runs 5 --json startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from importlib.metadata import entry_points

from sglang_dsv4.acceptance.arg_types import DefaultsHelpFormatter, positive_float, positive_int

PLUGIN = "dsv4_sm120"
GROUP = "sglang.srt.plugins"


class HelpFormatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def plugin_whitelists() -> dict[str, str]:
    """SGLANG_PLUGINS for each variant; the other installed plugins load in both."""
    others = sorted(ep.name for ep in entry_points(group=GROUP) if ep.name != PLUGIN)
    # A whitelist naming no installed plugin loads none (an empty one would load all).
    return {
        "without": ",".join(others) or "no-such-plugin",
        "with": ",".join([*others, PLUGIN]),
    }


def run_once(python: str, whitelist: str) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS MiB) of one `launch_server --help`."""
    env = {**os.environ, "SGLANG_PLUGINS": whitelist}
    start = time.perf_counter()
    proc = subprocess.Popen(
        [python, "-m", "sglang.launch_server", "--help"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        last = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"launch_server --help exited {proc.returncode}: {last[0]}")
    cpu = usage.ru_utime + usage.ru_stime
    return wall, cpu, usage.ru_maxrss / 1024  # ru_maxrss is KiB on Linux


def measure(python: str, runs: int) -> dict:
    whitelists = plugin_whitelists()
    samples: dict[str, dict[str, list[float]]] = {
        name: {"wall_s": [], "cpu_s": [], "peak_rss_mib": []} for name in whitelists
    }
    run_once(python, whitelists["without"])  # warm the file cache; not counted
    for _ in range(runs):
        for name, whitelist in whitelists.items():  # interleaved: drift hits both alike
            wall, cpu, rss = run_once(python, whitelist)
            samples[name]["wall_s"].append(round(wall, 3))
            samples[name]["cpu_s"].append(round(cpu, 3))
            samples[name]["peak_rss_mib"].append(round(rss, 1))
    median = {
        name: {key: statistics.median(values) for key, values in series.items()}
        for name, series in samples.items()
    }
    base, plugged = median["without"], median["with"]
    return {
        "command": "python -m sglang.launch_server --help",
        "runs": runs,
        "sglang_plugins": whitelists,
        "samples": samples,
        "median": median,
        "wall_ratio": round(plugged["wall_s"] / base["wall_s"], 3),
        "wall_added_s": round(plugged["wall_s"] - base["wall_s"], 3),
        "cpu_added_s": round(plugged["cpu_s"] - base["cpu_s"], 3),
        "rss_ratio": round(plugged["peak_rss_mib"] / base["peak_rss_mib"], 3),
        "rss_added_mib": round(plugged["peak_rss_mib"] - base["peak_rss_mib"], 1),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmark.startup_cost",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--runs", type=positive_int, default=3, help="runs of each variant")
    parser.add_argument(
        "--max-added-s", type=positive_float, default=0.5, help="target: wall time added"
    )
    parser.add_argument(
        "--max-added-mib", type=positive_float, default=50.0, help="target: peak RSS added"
    )
    parser.add_argument("--python", default=sys.executable, help="interpreter to run")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = measure(args.python, args.runs)
    except (RuntimeError, OSError) as exc:
        print(f"startup_cost: {exc}", file=sys.stderr)
        return 1
    base, plugged = result["median"]["without"], result["median"]["with"]
    print(f"{result['command']}, median of {args.runs} run(s) each")
    print(f"{'':20}  {'wall':>8}  {'CPU':>8}  {'peak RSS':>10}")
    for label, row in (("without the plugin", base), ("with the plugin", plugged)):
        print(
            f"{label:20}  {row['wall_s']:7.2f}s  {row['cpu_s']:7.2f}s  {row['peak_rss_mib']:7.1f} MiB"
        )
    print(
        f"{'added':20}  {result['wall_added_s']:+7.2f}s  {result['cpu_added_s']:+7.2f}s"
        f"  {result['rss_added_mib']:+7.1f} MiB"
        f"   (ratio {result['wall_ratio']:.2f} wall, {result['rss_ratio']:.2f} RSS)"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    over = []
    if result["wall_added_s"] > args.max_added_s:
        over.append(f"wall +{result['wall_added_s']:.2f} s > {args.max_added_s} s")
    if result["rss_added_mib"] > args.max_added_mib:
        over.append(f"RSS +{result['rss_added_mib']:.1f} MiB > {args.max_added_mib} MiB")
    if over:
        print(f"startup_cost: beyond target: {'; '.join(over)}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
