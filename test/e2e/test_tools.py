"""The DSML soak and the release gate, once each, against the live CPU server (plumbing: real
HTTP, the real scheduler, upstream's DeepSeek-V4 tool-call parser on a random model's output).
What they measure is reported; a random model writes no valid tool calls, so the figures are not
a bar, but both tools must run to their end, read the server's metrics and count its replies."""

from __future__ import annotations

import json
import subprocess

from sglang_dsv4 import warm_python
from support.live import _env


def _run(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    return warm_python.run(["-m", *args], env=_env(None), timeout=timeout)


def test_dsml_soak_runs_against_the_cpu_server(plain, tmp_path):
    out = tmp_path / "soak.json"
    proc = _run(["sglang_dsv4.acceptance.dsml_soak", "--base-url", plain.url, "--sessions", "2", "--turns", "2",
                 "--max-tokens", "24", "--temperature", "0", "--target-context", "1500", "--json", str(out)])
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    report = json.loads(out.read_text())
    print("dsml soak:", json.dumps({k: report[k] for k in list(report)[:8]}))
    # --turns is an upper bound: a session ends once its context reaches --target-context.
    # Every request made got a reply, and each session made at least one.
    assert report["requests"] >= 2 and report["responses"] == report["requests"], report


def test_release_gate_runs_against_the_cpu_server(plain, tiny_model_dir, tmp_path):
    # The gate compares throughput with a baseline of the build before: here the same server,
    # measured by the throughput benchmark the gate names for it. Random token ids: the "random"
    # dataset cuts ShareGPT text, which bench_serving downloads (no network here).
    load = ["--concurrency", "2", "--num-prompts", "4", "--input-len", "64", "--output-len", "8",
            "--dataset", "random-ids", "--tokenizer", str(tiny_model_dir)]
    baseline = tmp_path / "baseline.json"
    proc = _run(["sglang_dsv4.acceptance.throughput", "--base-url", plain.url, *load,
                 "--out-dir", str(tmp_path / "throughput"), "--json", str(baseline)])
    assert baseline.exists(), proc.stderr[-3000:]
    out = tmp_path / "gate.json"
    proc = _run(["sglang_dsv4.acceptance.release_gate", "--router", plain.url, "--decode", plain.url,
                 "--baseline", str(baseline),
                 "--rounds", "1", "--sessions", "2", "--turns", "2", "--max-tokens", "16",
                 # inside the tiny model's 4096 positions (the default grows past them: HTTP 400)
                 "--target-context", "1500",
                 *load, "--require-sanitizer",
                 "--out-dir", str(tmp_path / "gate"), "--json", str(out)])
    assert out.exists(), proc.stderr[-3000:]
    report = json.loads(out.read_text())
    print("release gate:", report["verdict"], json.dumps(report["criteria"])[:2000])
    criteria = {c["criterion"]: c for c in report["criteria"]}
    sanitizer = [c for name, c in criteria.items() if "sanitizer" in name.lower()]
    # It read the server's counter (not "NOT ENABLED"): the sanitizer is on, with 0 violations.
    assert sanitizer and sanitizer[0]["status"] == "PASS", criteria
    # Every request the gate made was answered (the corruption criterion needs thousands of
    # replies to pass and is only reported here).
    assert criteria["failed requests"]["status"] == "PASS", criteria
