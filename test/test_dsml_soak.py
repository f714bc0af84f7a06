"""The DSML corruption checker, and the soak end to end against the project's mock server.

The mock server (test/support/mock_server.py, 127.0.0.1 only) stands in for a DeepSeek-V4
deployment, which this machine cannot run; it counts what it injects, and the soak's measurement
is compared with those counts.
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
from sglang_dsv4 import warm_python
from sglang_dsv4.acceptance import corruption, dsml, dsml_soak
from sglang_dsv4.acceptance.corruption import KINDS, ToolCall, check_response, repetition_loop
from sglang_dsv4.acceptance.dsml_soak import TOOL_SCHEMAS, TOOLS, wilson
from support.mock_server import RATE_FLAGS, read_stats, running

REPO_ROOT = Path(__file__).resolve().parent.parent
CALL = ("read_file", {"path": "src/cache/page.py", "max_lines": 40})


def kinds(content, calls=()):
    return {finding.kind for finding in check_response(content, list(calls), TOOL_SCHEMAS)}


def soak(*options: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return warm_python.run(["-m", "sglang_dsv4.acceptance.dsml_soak", *options], cwd=REPO_ROOT,
                           timeout=timeout)


def outputs(directory: Path) -> list[str]:
    return ["--json", str(directory / "r.json"), "--examples", str(directory / "bad.jsonl")]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- the checker -------------------------------------------------------------------------------


def test_clean_answers_pass():
    call = ToolCall("read_file", json.dumps(CALL[1]), "call_1")
    assert kinds("I will read the page module first.", [call]) == set()
    assert kinds(None, [call]) == set()
    for prose in (corruption.__doc__, dsml_soak.__doc__):
        assert kinds(prose) == set(), prose
    table = "| a | b |\n| --- | --- |\n" + "".join(f"| {i} | {i * i} |\n" for i in range(30))
    assert kinds(table) == set()


def test_complete_markup_in_text_is_a_leak():
    block = dsml.render_tool_calls([CALL])
    assert kinds(f"Let me look.\n\n{block}") == {"dsml_leak"}
    leaked_args = ToolCall("write_file", json.dumps({"path": "a.py", "content": block}))
    assert kinds(None, [leaked_args]) == {"dsml_leak"}


def test_every_cut_of_the_markup_is_truncated():
    block = dsml.render_tool_calls([CALL, ("run_command", {"command": "pytest -q"})])
    for end in range(2, len(block)):
        assert kinds("Checking.\n\n" + block[:end]) == {"truncated_markup"}, block[:end]
    garbled = block.replace("<" + dsml.MARKER + "invoke", dsml.MARKER + "invoke", 1)
    assert kinds(garbled) == {"truncated_markup"}


def test_malformed_tool_calls():
    good = json.dumps(CALL[1])
    assert kinds(None, [ToolCall("read_files", good)]) == {"malformed_tool_call"}
    assert kinds(None, [ToolCall("read_file", good[:-1])]) == {"malformed_tool_call"}
    assert kinds(None, [ToolCall("read_file", "[1, 2]")]) == {"malformed_tool_call"}
    assert kinds(None, [ToolCall("read_file", json.dumps({"max_lines": 3}))]) == {
        "malformed_tool_call"
    }
    both = [ToolCall("write_file", json.dumps({"path": "a.py"})), ToolCall("read_file", good)]
    assert kinds(None, both) == {"malformed_tool_call"}


def test_repetition_loops():
    loop = "and then the cache is flushed " * 8
    assert kinds("The scheduler retries. " + loop) == {"repetition"}
    assert repetition_loop("x" + ")" * 200) == ")"
    assert kinds("A short echo echo echo is fine, and so is a list: 1, 2, 3, 4.") == set()


def test_upstream_parses_the_markup_the_mock_writes():
    """Ties the format to upstream's DeepSeek-V4 parser: what the mock leaks is exactly what that
    parser would have turned into tool calls."""
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.deepseekv4_detector import DeepSeekV4Detector

    detector = DeepSeekV4Detector()
    tools = [Tool(**tool) for tool in TOOLS]
    calls = [CALL, ("search_code", {"query": "flush_cache", "max_results": 5})]
    text = dsml.render_tool_calls(calls)
    assert text.startswith(detector.bot_token) and text.endswith(detector.eot_token)
    parsed = detector.detect_and_parse(text, tools)
    assert [(c.name, json.loads(c.parameters)) for c in parsed.calls] == calls


def test_wilson_interval_matches_published_values():
    # Newcombe, Statistics in Medicine 17 (1998) 857-872, table I, method 3.
    published = [
        (81, 263, 0.2553, 0.3662),
        (15, 148, 0.0624, 0.1605),
        (0, 20, 0.0, 0.1611),
        (1, 29, 0.0061, 0.1718),
    ]
    for k, n, low, high in published:
        got = wilson(k, n)
        assert got == pytest.approx((low, high), abs=1e-4), (k, n)


# --- the soak against the mock server -----------------------------------------------------------


def test_soak_measures_the_injected_rates(tmp_path):
    rate = 0.08
    flags = [item for flag in RATE_FLAGS.values() for item in (flag, str(rate))]
    with running("--seed", "4", *flags) as url:
        options = "--sessions 20 --turns 15 --target-context 12000 --concurrency 10".split()
        done = soak("--base-url", url, *options, *outputs(tmp_path))
        truth = read_stats(url)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["errors"] == 0 and report["requests"] == report["responses"] == truth["responses"]
    assert report["responses"] >= 280
    for kind in KINDS:
        share = report["by_kind"][kind]
        assert share["count"] == truth["injected"][kind], kind
        low, high = share["interval"]
        assert low <= rate <= high, (kind, share)
    assert report["corrupt"] == sum(truth["injected"].values())
    assert report["corruption_rate"] == pytest.approx(report["corrupt"] / report["responses"])
    assert set(report["by_mode"]) == {"stream", "plain"}
    assert sum(share["of"] for share in report["by_context"].values()) == report["responses"]
    assert report["max_context_tokens"] >= 12000 * 0.9
    examples = [json.loads(line) for line in (tmp_path / "bad.jsonl").read_text().splitlines()]
    assert len(examples) == report["corrupt"]
    assert {kind for example in examples for kind in example["kinds"]} == set(KINDS)
    assert "corruption by kind" in done.stdout and "corruption by prompt tokens" in done.stdout


def test_soak_reports_zero_over_500_clean_responses(tmp_path):
    with running("--seed", "5") as url:
        options = "--sessions 48 --turns 11 --target-context 6000 --fail-above 0".split()
        done = soak("--base-url", url, *options, *outputs(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["responses"] >= 500
    assert report["corrupt"] == 0 and report["corruption_rate"] == 0.0 and report["errors"] == 0
    assert all(share["count"] == 0 for share in report["by_kind"].values())
    # Zero of n puts the upper end of the interval at z^2 / (n + z^2).
    assert report["corruption_interval"][1] == pytest.approx(
        3.8415 / (report["responses"] + 3.8415), rel=1e-3
    )
    assert (tmp_path / "bad.jsonl").read_text() == ""


def test_soak_counts_http_errors_and_timeouts_as_errors(tmp_path):
    # A stall outlasts the whole test, so a stalled request ends only by the client's timeout;
    # that timeout is far above any answer of the mock, so no other request reaches it however
    # loaded the machine. The faults are drawn from a seeded sequence in arrival order: which
    # request gets one varies, how many of the 96 do does not.
    faults = "--seed 1 --http-error-rate 0.2 --stall-rate 0.04 --stall-seconds 3600".split()
    with running(*faults) as url:
        # A target out of reach keeps every session going for all its turns.
        options = "--model mock-dsv4 --sessions 8 --turns 12 --target-context 100000 --timeout 10"
        done = soak("--base-url", url, *options.split(), *outputs(tmp_path))
        truth = read_stats(url)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert truth["http_errors"] > 0 and truth["stalls"] > 0
    assert report["requests"] == 8 * 12 == truth["requests"]
    assert report["errors"] == truth["http_errors"] + truth["stalls"]
    assert report["errors_by_type"].get("timeout") == truth["stalls"]
    http = sum(n for kind, n in report["errors_by_type"].items() if kind.startswith("HTTP "))
    assert http == truth["http_errors"]
    assert report["responses"] == report["requests"] - report["errors"]
    assert report["corrupt"] == 0


def test_soak_refuses_bad_input_with_one_line():
    for options, expected in (
        (["--base-url", "http://127.0.0.1:1", "--sessions", "0"], "--sessions"),
        (["--base-url", "ftp://127.0.0.1:1"], "--base-url must start with http"),
    ):
        done = soak(*options)
        assert done.returncode == 2
        assert expected in done.stderr.strip().splitlines()[-1]
        assert "Traceback" not in done.stderr
    dead = f"http://127.0.0.1:{closed_port()}"
    done = soak("--base-url", dead)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert (
        done.stderr.strip().splitlines()[-1]
        == f"dsml_soak: cannot list models at {dead}: connection"
    )
    done = soak("--base-url", dead, "--model", "m", "--sessions", "2", "--turns", "2")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "no response to check: all 4 requests failed" in done.stdout
