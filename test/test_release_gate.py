"""python/sglang_dsv4/acceptance/release_gate.py end to end on loopback: the real soak and upstream's bench_serving
against the project's mock server (127.0.0.1), which stands in for the router, prefill and decode
servers of a DeepSeek-V4 PD deployment, /metrics included; this machine cannot run one. The mock
counts what it injects, and each verdict line is compared with that truth.

The two measured runs (a clean deployment, and one that corrupts, violates, loses a NIXL thread,
fails requests and slows down) run side by side: each spends most of its time importing
bench_serving.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from sglang_dsv4.acceptance import release_gate
from sglang_dsv4.acceptance.dsml_soak import Z95, wilson
from sglang_dsv4.acceptance.release_gate import judge_sanitizer, parse_metrics, server_round
from support import mock_server
from support.mock_server import Metrics, Settings, read_stats, running
from support.tokenizer import word_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
SESSIONS, TURNS = 6, 6
# A target out of reach: every session sends all its turns, so the soak sends exactly 36 requests
# and the mock's 37th is bench_serving's warm-up.
SOAK = f"--sessions {SESSIONS} --turns {TURNS} --target-context 100000 --max-tokens 64"
MATRIX = "--concurrency 4 --num-prompts 8 --input-len 16 --output-len 8 --dataset random-ids"
# An earlier build's figures, set far below what the loopback mock delivers at full speed
# (~1000 out tok/s, ~400 tok/s per request here) and above what it delivers slowed down
# (--slow-itl 0.05 s: at most 20 tok/s per request).
BASELINE = {
    "config": {"what": "an earlier build"},
    "runs": [{"concurrency": 4, "output_throughput": 100.0, "per_request_tok_s": 100.0}],
}
# Seed 5 injects HTTP errors at soak requests 5, 29 and 34 and bench request 39, never at the
# warm-up (37), which would stop bench_serving before it measures.
FAULTS = (
    "--seed 5 --leak-rate 0.1 --repetition-rate 0.05 --http-error-rate 0.08 "
    "--sanitizer-violation shadow_mismatch --nixl-death decode_listener "
    f"--slow-after {SESSIONS * TURNS} --slow-itl 0.05"
)


def gate_command(*options: str) -> list[str]:
    return [sys.executable, "-m", "sglang_dsv4.acceptance.release_gate", *options]


def gate_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def gate(capsys, *options: str) -> subprocess.CompletedProcess:
    """The gate in this process (what does not measure: no bench_serving to import)."""
    try:
        code = release_gate.main(list(options))
    except SystemExit as exit:  # argparse's usage errors
        code = exit.code
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(options, code, captured.out, captured.err)


def verdicts(stdout: str) -> dict[str, tuple[str, str]]:
    """criterion -> (verdict, evidence) from the printed table (folded evidence rejoined)."""
    rows: dict[str, list[str]] = {}
    last = None
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        if len(cells) != 3 or cells[0] == "criterion":
            continue
        if cells[0]:
            last = cells[0]
            rows[last] = [cells[1], cells[2]]
        elif last:
            rows[last][1] += cells[2]
    return {name: (status, evidence) for name, (status, evidence) in rows.items()}


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """The clean and the faulty deployment gated side by side; each mock's counts after."""
    tokenizer = word_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    out = tmp_path_factory.mktemp("gate")
    (out / "baseline.json").write_text(json.dumps(BASELINE))
    common = [*SOAK.split(), *MATRIX.split(), "--tokenizer", str(tokenizer)]
    common += ["--baseline", str(out / "baseline.json"), "--rule-out", "1/10"]
    with (
        running("--sanitizer") as clean_decode,
        running() as clean_prefill,
        running(*FAULTS.split()) as faulty,
    ):
        runs = {
            "clean": gate_command(
                "--router", clean_decode, "--decode", clean_decode, "--prefill", clean_prefill,
                *common, "--out-dir", str(out / "clean"),
            ),
            "faulty": gate_command(
                "--router", faulty, "--decode", faulty, *common, "--out-dir", str(out / "faulty"),
            ),
        }  # fmt: skip
        children = {
            name: subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                env=gate_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name, command in runs.items()
        }
        done = {}
        for name, child in children.items():
            stdout, stderr = child.communicate(timeout=240)
            done[name] = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
        truth = {
            "clean": read_stats(clean_decode),
            "prefill": read_stats(clean_prefill),
            "faulty": read_stats(faulty),
        }
    return done, truth, out


@pytest.mark.slow
def test_clean_deployment_passes(measured):
    done, truth, out = measured
    run = done["clean"]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = verdicts(run.stdout)
    assert list(lines) == list(release_gate.CRITERIA)
    assert {status for status, _ in lines.values()} == {"PASS"}
    report = json.loads((out / "clean" / "release_gate.json").read_text())
    assert report["verdict"] == "pass"
    served = truth["clean"]
    soak = report["rounds"][0]["soak"]
    # The soak's 36 requests and bench_serving's 8 plus its warm-up, all answered.
    assert soak["requests"] == soak["responses"] == SESSIONS * TURNS
    assert served["responses"] == served["requests"] == SESSIONS * TURNS + 8 + 1
    assert truth["prefill"]["requests"] == 0  # the prefill is only read for metrics
    n = soak["responses"]
    assert report["corruption"]["upper_bound_95"] == pytest.approx(Z95**2 / (n + Z95**2))
    assert lines["corruption"][1].startswith(f"0 corrupt of {n} checked responses (1 round(s)")
    assert f"upper bound on the rate {Z95**2 / (n + Z95**2):.2g}" in lines["corruption"][1]
    ruled = f"rules out a corruption rate of 1 in {1 / (1 - 0.05 ** (1 / n)):,.0f} at 95 %"
    assert ruled in lines["corruption"][1]
    assert f"release gate: {n:,} checked responses {ruled} (the bar: 1 in 10, 29 responses)" in (
        run.stdout
    )
    assert lines["sanitizer"][1] == (
        f"0 violations on the 1 of 2 servers with it on; off on {report['config']['prefill'][0]}"
    )
    assert lines["failed requests"][1].startswith(f"0 of {n + 8} requests failed")
    assert lines["NIXL control threads"][1].startswith("0 thread deaths on 2 servers")
    (row,) = report["throughput"]["runs"]
    raw = json.loads((out / "clean" / "round-1" / "bench_c4.jsonl").read_text().splitlines()[-1])
    assert row["output_throughput"] == raw["output_throughput"]
    assert f"c4 {raw['output_throughput']:.1f}" in lines["throughput"][1]
    assert (out / "clean" / "release_gate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_faulty_deployment_fails_each_criterion_with_its_evidence(measured):
    done, truth, out = measured
    run = done["faulty"]
    assert run.returncode == 3, run.stdout[-3000:] + run.stderr[-3000:]
    lines = verdicts(run.stdout)
    assert {name: status for name, (status, _) in lines.items()} == dict.fromkeys(
        release_gate.CRITERIA, "FAIL"
    )
    assert run.stdout.strip().splitlines()[-3] == (
        "release gate: FAIL (corruption, sanitizer, failed requests, NIXL control threads, "
        "throughput) over 1 round(s)"
    )
    report = json.loads((out / "faulty" / "release_gate.json").read_text())
    served = truth["faulty"]
    soak = report["rounds"][0]["soak"]
    # Corruption: exactly what the mock injected into the soak's answers (those offering tools;
    # bench_serving's answers are not checked, and the mock corrupts some of them too).
    corrupt, checked = soak["corrupt"], soak["responses"]
    assert corrupt == served["injected_with_tools"] > 0
    assert lines["corruption"][1].startswith(f"{corrupt} corrupt of {checked} checked responses")
    # Sanitizer: one violation per answer, the soak's and bench_serving's alike.
    violations = served["sanitizer_violations"]["shadow_mismatch"]
    assert violations == served["responses"]
    assert lines["sanitizer"][1] == (
        f"{violations} violations on the 1 of 1 servers with it on: "
        f"shadow_mismatch +{violations} on decode {report['config']['decode'][0]}"
    )
    # Failed requests: the mock's HTTP errors, three in the soak and one in the matrix.
    assert served["http_errors"] == 4
    assert lines["failed requests"][1].startswith(
        f"4 of {SESSIONS * TURNS + 8} requests failed (soak 3 of {SESSIONS * TURNS}: HTTP "
    )
    assert "throughput 1 of 8, first: " in lines["failed requests"][1]
    # NIXL: the one death the mock counted.
    assert served["nixl_deaths"] == 1
    assert lines["NIXL control threads"][1].startswith(
        f"deaths: decode_listener x1 on decode {report['config']['decode'][0]} (round 1)"
    )
    # Throughput: slowed to --slow-itl between tokens, far under the baseline.
    (row,) = report["throughput"]["runs"]
    assert row["per_request_tok_s"] <= 1 / 0.05
    assert "c4 per_request_tok_s), limit -5 %" in lines["throughput"][1]
    drops = {c["metric"]: c for c in report["throughput"]["comparison"]}
    assert drops["per_request_tok_s"]["regression"]
    examples = (out / "faulty" / "round-1" / "soak-bad.jsonl").read_text().splitlines()
    assert len(examples) == corrupt


@pytest.mark.slow
def test_rounds_combine_into_the_fields_bar(measured, tmp_path, capsys):
    """Runs on several cold launches judged as one: rounds x responses, and the bound they give."""
    _, _, out = measured
    clean = out / "clean" / "release_gate.json"
    n = json.loads(clean.read_text())["corruption"]["responses"]
    options = ["--combine", str(clean), str(clean), "--baseline", str(clean)]
    # At the default bar (1 in 2,000 at 95 %: 5,990 responses) these rounds are too few.
    done = gate(capsys, *options, "--out-dir", str(tmp_path))
    assert done.returncode == 3
    status, evidence = verdicts(done.stdout)["corruption"]
    bar = (
        f"ruling out 1 in 2,000 at 95 % needs at least 5,990 checked responses, about "
        f"{-(-5990 // n)} round(s) of these"
    )
    assert status == "FAIL" and evidence.replace(" ", "").endswith(bar.replace(" ", ""))
    options += ["--rule-out", "0.1"]
    done = gate(capsys, *options, "--min-responses", str(2 * n), "--out-dir", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = verdicts(done.stdout)
    status, evidence = lines["corruption"]
    expected = (
        f"0 corrupt of {2 * n} checked responses (2 round(s) x ~{n}); "
        f"95 % upper bound on the rate {wilson(0, 2 * n)[1]:.2g}; rules out a corruption rate "
        f"of 1 in {1 / (1 - 0.05 ** (1 / (2 * n))):,.0f} at 95 %"
    )
    # (the table folds long evidence; a fold may drop the space it falls on)
    assert status == "PASS" and evidence.replace(" ", "") == expected.replace(" ", "")
    # An earlier gate's JSON serves as the baseline: the same matrix, no change.
    assert "c4" in lines["throughput"][1] and "(+0.0 %)" in lines["throughput"][1]
    report = json.loads((tmp_path / "release_gate.json").read_text())
    assert [r["round"] for r in report["rounds"]] == [1, 2]
    # One response short of the bar fails the gate.
    done = gate(capsys, *options, "--min-responses", str(2 * n + 1), "--out-dir", str(tmp_path))
    assert done.returncode == 3
    status, evidence = verdicts(done.stdout)["corruption"]
    short = f"at least {2 * n + 1:,} checked responses"
    assert status == "FAIL" and evidence.replace(" ", "").endswith(short.replace(" ", ""))
    # A faulty launch among clean ones fails the whole.
    faulty = out / "faulty" / "release_gate.json"
    done = gate(
        capsys,
        "--combine",
        str(clean),
        str(faulty),
        "--baseline",
        str(clean),
        "--out-dir",
        str(tmp_path),
    )
    assert done.returncode == 3
    assert verdicts(done.stdout)["corruption"][0] == "FAIL"


def test_field_bar_upper_bound():
    # 0 corrupt in 11,187 requests, the field's release bar: the rate is below ~3.4e-4.
    assert f"{wilson(0, 11_187)[1]:.2g}" == "0.00034"


def test_metrics_contract_matches_the_mock_and_the_servers():
    from sglang_dsv4 import metrics, sanitizer
    from sglang_dsv4.fixes import nixl_bootstrap_cascade

    assert release_gate.SANITIZER_METRIC == mock_server.SANITIZER_METRIC == sanitizer.METRIC_NAME
    assert mock_server.SANITIZER_KINDS == sanitizer.KINDS == metrics.SANITIZER_KINDS
    assert release_gate.NIXL_METRIC == mock_server.NIXL_METRIC == metrics.NIXL_CONTROL_THREAD_EVENTS
    # The fix carries the name into upstream's code, spelled out there.
    carried = "".join(
        p.read_text() for p in Path(nixl_bootstrap_cascade.__file__).parent.glob("*.py")
    )
    assert f'"{metrics.NIXL_CONTROL_THREAD_EVENTS}"' in carried


def test_counter_increases_and_restarts():
    settings = Settings(sanitizer_violations=("pd_checksum",), nixl_death="prefill_bootstrap")
    metrics, stats = Metrics(settings), Counter()
    before = parse_metrics(metrics.exposition().decode())
    assert before == {"sanitizer": dict.fromkeys(mock_server.SANITIZER_KINDS, 0.0), "nixl": {}}
    for _ in range(3):
        metrics.answered(stats)
    after = parse_metrics(metrics.exposition().decode())
    server = {"role": "prefill", "url": "http://p0"}
    record = server_round(server, before, after)
    assert record["sanitizer"] == {"pd_checksum": 3.0}
    assert record["nixl"] == {"prefill_bootstrap/death": 1.0}
    assert not record["restarted"]
    # A restarted server counts from zero again: what it shows all happened since.
    restarted = Metrics(settings)
    restarted.answered(Counter())
    record = server_round(server, after, parse_metrics(restarted.exposition().decode()))
    assert record["restarted"] and record["sanitizer"] == {"pd_checksum": 1.0}


def test_sanitizer_absent_reads_not_enabled():
    plain = parse_metrics(Metrics(Settings()).exposition().decode())
    assert plain["sanitizer"] is None
    record = server_round({"role": "decode", "url": "http://d0"}, plain, plain)
    rounds = [{"round": 1, "servers": [record]}]
    assert judge_sanitizer(rounds, required=False)["status"] == "NOT ENABLED"
    line = judge_sanitizer(rounds, required=True)
    assert line["status"] == "FAIL" and line["evidence"].endswith("(--require-sanitizer)")


def test_bad_input_stops_with_one_line(tmp_path, capsys):
    dead = f"http://127.0.0.1:{closed_port()}"
    done = gate(capsys, "--router", dead, "--decode", dead)
    assert done.returncode == 2 and "--baseline is required" in done.stderr.splitlines()[-1]
    done = gate(capsys, "--router", dead, "--baseline", "x.json")
    assert done.returncode == 2 and "--prefill and/or --decode" in done.stderr.splitlines()[-1]
    missing = tmp_path / "none.json"
    done = gate(capsys, "--router", dead, "--decode", dead, "--baseline", str(missing))
    assert done.returncode == 1 and done.stdout.strip().splitlines() == [
        f"release gate: cannot use {missing} as a baseline: "
        f"[Errno 2] No such file or directory: '{missing}'"
    ]
    baseline = tmp_path / "base.json"
    baseline.write_text(json.dumps(BASELINE))
    done = gate(capsys, "--router", dead, "--decode", dead, "--baseline", str(baseline))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert (
        done.stdout.strip()
        .splitlines()[-1]
        .startswith(f"release gate: cannot list models at {dead}")
    )
    with running() as url:
        options = ["--router", url, "--decode", dead, "--baseline", str(baseline)]
        done = gate(capsys, *options, "--out-dir", str(tmp_path))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert (
        done.stdout.strip()
        .splitlines()[-1]
        .startswith(f"release gate: GET {dead}/metrics: no answer")
    )
    assert not list(tmp_path.glob("round-*"))  # stopped before measuring anything


def test_the_default_bar_rules_out_one_in_two_thousand_at_95_percent():
    """5,990 clean responses: a server corrupting 1 response in 2,000 passes with probability at
    most 0.05; 5,989 would let it pass more often. The soak's defaults (64 x 40 = 2,560) let it
    pass with probability 0.278."""
    rate = 1 / 2000
    assert release_gate.responses_to_rule_out(rate) == 5990
    assert (1 - rate) ** 5990 <= 0.05 < (1 - rate) ** 5989
    assert round((1 - rate) ** 2560, 3) == 0.278
    assert release_gate.rate_ruled_out(5990) <= rate < release_gate.rate_ruled_out(5989)
    assert release_gate.parse_rate("1/2000") == release_gate.parse_rate("0.0005") == rate
    for bad in ("0", "1", "2/1", "x", "1/0"):
        with pytest.raises(argparse.ArgumentTypeError):
            release_gate.parse_rate(bad)


def test_a_verdict_prints_the_rate_it_rules_out(tmp_path):
    rounds = [{"round": 1, "soak": {"responses": 5990, "corrupt": 0, "by_kind": {}}}]
    line = release_gate.judge_corruption(rounds, 0, 1 / 2000)
    assert line["status"] == "PASS"
    assert "rules out a corruption rate of 1 in 2,000 at 95 %" in line["evidence"]
    rounds[0]["soak"]["responses"] = 5989
    line = release_gate.judge_corruption(rounds, 0, 1 / 2000)
    assert line["status"] == "FAIL" and line["evidence"].endswith(
        "needs at least 5,990 checked responses, about 2 round(s) of these"
    )
    rounds[0]["soak"].update(corrupt=1, by_kind={"dsml": {"count": 1}})
    line = release_gate.judge_corruption(rounds, 0, 1 / 2000)
    assert "rules out no rate (corruption seen)" in line["evidence"]
