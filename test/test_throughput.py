"""python/sglang_dsv4/acceptance/throughput.py end to end: upstream's sglang.benchmark.serving, run as a child process
per concurrency, against the project's mock server (127.0.0.1; it stands in for a DeepSeek-V4
deployment), with the word-level tokenizer of support.tokenizer so nothing comes from the hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_dsv4.acceptance.throughput import compare
from support.mock_server import read_stats, running
from support.tokenizer import word_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
ITL_SECONDS = 0.002


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return word_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def throughput(*options: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "sglang_dsv4.acceptance.throughput", *options],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def tiny_run(url: str, tokenizer: Path, out: Path, *extra: str) -> list[str]:
    options = (
        f"--base-url {url} --model mock-dsv4 --dataset random-ids --num-prompts 8 "
        "--input-len 16 --output-len 8"
    )
    return [*options.split(), "--tokenizer", str(tokenizer), "--out-dir", str(out), *extra]


@pytest.fixture(scope="module")
def matrix(tokenizer_dir, tmp_path_factory):
    """The preset (concurrency 1 and 32) run once; the mock's counts taken right after."""
    out = tmp_path_factory.mktemp("throughput")
    with running("--itl", str(ITL_SECONDS)) as url:
        outputs = ["--json", str(out / "tp.json"), "--chart", str(out / "tp.png")]
        done = throughput(*tiny_run(url, tokenizer_dir, out, *outputs))
        served = read_stats(url)
    return done, out, served


def test_preset_runs_through_bench_serving(matrix):
    done, out, served = matrix
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "tp.json").read_text())
    assert [row["concurrency"] for row in report["runs"]] == [1, 32]
    # Each run is 8 requests plus bench_serving's one warm-up, all answered by the mock.
    assert served["responses"] == served["requests"] == 2 * (8 + 1)
    for row in report["runs"]:
        raw = json.loads((out / f"bench_c{row['concurrency']}.jsonl").read_text().splitlines()[-1])
        assert raw["max_concurrency"] == row["concurrency"]
        assert row["completed"] == raw["completed"] == 8 and row["errors"] == 0
        assert row["output_throughput"] == raw["output_throughput"] > 0
        assert row["per_request_tok_s"] == pytest.approx(1000 / raw["median_tpot_ms"])
        # The mock sleeps ITL_SECONDS between tokens; no measurement can come in under that.
        assert row["median_itl_ms"] >= 1000 * ITL_SECONDS * 0.9
        assert row["median_e2e_latency_ms"] >= 7 * 1000 * ITL_SECONDS * 0.9
    lines = done.stdout.splitlines()
    assert any("throughput (sglang.benchmark.serving" in line for line in lines)
    assert any(line.split("│")[1:2] == ["    1 "] for line in lines)
    assert any(line.split("│")[1:2] == ["   32 "] for line in lines)
    assert (out / "tp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_drop_against_a_baseline_is_flagged(matrix, tmp_path):
    _, out, _ = matrix
    saved = out / "tp.json"
    baseline = json.loads(saved.read_text())
    # The same run, but 10 % faster at concurrency 32: now reads as a 9.1 % drop there.
    baseline["runs"][1]["output_throughput"] *= 1.10
    (tmp_path / "old.json").write_text(json.dumps(baseline))
    compared = ["--report", str(saved), "--baseline", str(tmp_path / "old.json")]
    done = throughput(*compared)
    assert done.returncode == 3, done.stdout
    assert "REGRESSION concurrency 32 output_throughput" in done.stdout
    assert "REGRESSION concurrency 1 " not in done.stdout
    done = throughput(*compared, "--max-drop-percent", "10")
    assert done.returncode == 0, done.stdout


def test_compare_reports_change_per_metric():
    base = {"runs": [{"concurrency": 1, "output_throughput": 50.0, "per_request_tok_s": 50.0}]}
    now = [
        {"concurrency": 1, "output_throughput": 54.3, "per_request_tok_s": 40.0},
        {"concurrency": 32, "output_throughput": 529.6, "per_request_tok_s": 17.0},
    ]
    changes = {c["metric"]: c for c in compare(now, base, max_drop_percent=5)}
    assert changes["output_throughput"]["change_percent"] == pytest.approx(8.6)
    assert not changes["output_throughput"]["regression"]
    assert changes["per_request_tok_s"]["change_percent"] == pytest.approx(-20.0)
    assert changes["per_request_tok_s"]["regression"]
    assert len(changes) == 2  # concurrency 32 has nothing to compare with


def test_failed_requests_are_counted(tokenizer_dir, tmp_path):
    with running("--seed", "3", "--http-error-rate", "0.3") as url:
        options = tiny_run(url, tokenizer_dir, tmp_path, "--concurrency", "4")
        done = throughput(*options, "--json", str(tmp_path / "tp.json"))
        served = read_stats(url)
    assert done.returncode == 3, done.stdout[-3000:]
    (row,) = json.loads((tmp_path / "tp.json").read_text())["runs"]
    assert served["http_errors"] > 0
    assert row["errors"] == served["http_errors"]  # the warm-up succeeded, or the run would stop
    assert row["completed"] == 8 - served["http_errors"]
    assert "injected HTTP" in row["first_error"]


def test_bad_baseline_stops_before_measuring(tmp_path):
    missing = tmp_path / "none.json"
    done = throughput(
        "--base-url", "http://127.0.0.1:1", "--baseline", str(missing), "--out-dir", str(tmp_path)
    )
    assert done.returncode == 1
    assert done.stdout.strip().splitlines() == [
        f"throughput: cannot use {missing} as a baseline: "
        f"[Errno 2] No such file or directory: '{missing}'"
    ]
    assert not list(tmp_path.glob("bench_*"))
