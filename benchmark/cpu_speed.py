"""How fast the tiny DeepSeek-V4 serves on this machine's CPU: server start, a 512-token prefill,
a decode step, and (with --suite) the whole end-to-end suite.

It writes the tiny checkpoint (`sglang-dsv4 tiny-model`), starts `python -m sglang.launch_server
--model-path DIR --device cpu` on a free loopback port and measures, in this one run:

- start: from the launch to the first answer of /health, and to the first generation
  (/health_generate);
- prefill: one greedy /generate of a 512-token prompt and 1 output token, the cache flushed
  first (median of --runs);
- decode step: (time of 1 + N output tokens - time of 1 output token) / N on a 16-token prompt,
  N = --decode-tokens (median of --runs);
- suite (--suite): `python -m pytest -q -m e2e test/e2e`, wall time and its outcome.

Figures are wall seconds on whatever else the machine is doing; the targets (issue #22, one core
of the 2-core CI machine) are printed beside them. Exit 0 within the targets, 3 beyond, 1 when a
run fails.

    python -m benchmark.cpu_speed --runs 3 --json cpu-speed.json [--suite]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from sglang_dsv4.acceptance.arg_types import DefaultsHelpFormatter, positive_float, positive_int

REPO_ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"start_s": 60.0, "prefill_512_s": 2.0, "decode_step_s": 0.2, "suite_s": 12 * 60.0}


class HelpFormatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body = response.read().decode("utf-8", "replace")
    try:
        return json.loads(body)
    except ValueError:  # /flush_cache answers plain text
        return {"text": body}


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def start_server(model: Path, log: Path, timeout: float) -> tuple[subprocess.Popen, str, dict]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    begin = time.perf_counter()
    with open(log, "wb") as handle:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
             "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--sleep-on-idle"],
            stdout=handle, stderr=subprocess.STDOUT, env=_env(), start_new_session=True,
        )
    times = {}
    for path, key in (("/health", "start_health_s"), ("/health_generate", "start_s")):
        while not _ok(url + path):
            if proc.poll() is not None:
                tail = log.read_text(errors="replace").splitlines()[-20:]
                raise RuntimeError(f"the server exited ({proc.returncode}):\n" + "\n".join(tail))
            if time.perf_counter() - begin > timeout:
                stop(proc)
                raise RuntimeError(f"the server did not answer {path} within {timeout:.0f} s")
            time.sleep(0.25)
        times[key] = time.perf_counter() - begin
    return proc, url, times


def stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def timed_generate(url: str, ids: list[int], new_tokens: int, timeout: float) -> float:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens,
                                                  "ignore_eos": True}}
    begin = time.perf_counter()
    _post(url + "/generate", body, timeout)
    return time.perf_counter() - begin


def measure(url: str, runs: int, decode_tokens: int, timeout: float) -> dict:
    import random

    rng = random.Random(0)
    prefill, decode = [], []
    for _ in range(runs):
        prompt = [rng.randrange(40, 1000) for _ in range(512)]
        _post(url + "/flush_cache", {}, timeout)
        prefill.append(timed_generate(url, prompt, 1, timeout))
        short = [rng.randrange(40, 1000) for _ in range(16)]
        one = timed_generate(url, short, 1, timeout)
        short2 = [rng.randrange(40, 1000) for _ in range(16)]
        many = timed_generate(url, short2, 1 + decode_tokens, timeout)
        decode.append(max(many - one, 0.0) / decode_tokens)
    return {"prefill_512_s": statistics.median(prefill), "decode_step_s": statistics.median(decode),
            "prefill_runs_s": prefill, "decode_runs_s": decode}


def run_suite(timeout: float) -> dict:
    begin = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "e2e", "test/e2e"],
                          cwd=REPO_ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    last = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    return {"suite_s": time.perf_counter() - begin, "suite_rc": proc.returncode,
            "suite_summary": last}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmark.cpu_speed", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--model", type=Path, default=None,
                        help="tiny checkpoint to serve (default: write one with seed 0)")
    parser.add_argument("--runs", type=positive_int, default=3, help="runs of each request")
    parser.add_argument("--decode-tokens", type=positive_int, default=32,
                        help="decode steps timed per run")
    parser.add_argument("--start-timeout", type=positive_float, default=900.0,
                        help="seconds the server may take to start")
    parser.add_argument("--request-timeout", type=positive_float, default=900.0,
                        help="seconds per request")
    parser.add_argument("--suite", action="store_true", help="time the e2e suite too")
    parser.add_argument("--suite-timeout", type=positive_float, default=3600.0,
                        help="seconds the suite may take")
    parser.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    return parser


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="tiny DeepSeek-V4 on the CPU")
    for column in ("measure", "seconds", "target", "within"):
        table.add_column(column, justify="left" if column == "measure" else "right")
    for key, target in TARGETS.items():
        if key in report:
            table.add_row(key, f"{report[key]:.3f}", f"{target:g}",
                          "yes" if report[key] <= target else "NO")
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cpu-speed-") as tmp:
        model = args.model
        if model is None:
            from sglang_dsv4.tiny_model import write

            model = write(Path(tmp) / "tiny", seed=0)
        log = Path(tmp) / "server.log"
        try:
            proc, url, report = start_server(model, log, args.start_timeout)
        except RuntimeError as exc:
            print(f"benchmark.cpu_speed: {exc}", file=sys.stderr)
            return 1
        try:
            report.update(measure(url, args.runs, args.decode_tokens, args.request_timeout))
        except (OSError, urllib.error.URLError) as exc:
            print(f"benchmark.cpu_speed: a request failed: {exc}", file=sys.stderr)
            return 1
        finally:
            stop(proc)
    if args.suite:
        report.update(run_suite(args.suite_timeout))
    report["cpus"] = os.cpu_count()
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if report.get("suite_rc", 0) != 0:
        return 1
    beyond = [k for k, t in TARGETS.items() if k in report and report[k] > t]
    return 3 if beyond else 0


if __name__ == "__main__":
    sys.exit(main())
