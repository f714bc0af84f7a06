"""python/sglang_dsv4/acceptance/liveness.py against the project's mock server (127.0.0.1), which stands in for the
prefill, decode and router servers of a PD deployment this machine cannot run."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from sglang_dsv4 import warm_python
from support.mock_server import read_stats, running

REPO_ROOT = Path(__file__).resolve().parent.parent


def liveness(*options: str) -> subprocess.CompletedProcess:
    return warm_python.run(["-m", "sglang_dsv4.acceptance.liveness", "--timeout", "10", *options],
                           cwd=REPO_ROOT, timeout=120)


def test_all_alive_exits_zero_with_one_line_each():
    with running() as url:
        done = liveness("--prefill", url, "--decode", url, "--router", url)
        served = read_stats(url)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert [line.split()[:3] for line in lines[:3]] == [
        ["OK", "prefill", url],
        ["OK", "decode", url],
        ["OK", "router", url],
    ]
    assert "one-token generation" in lines[0] and "chat completion, " in lines[2]
    assert lines[3] == "3 of 3 servers alive"
    assert served["responses"] == 1  # the router's chat completion really reached the server


def test_any_dead_server_fails_the_check():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with running() as good, running("--unhealthy") as sick:
        done = liveness("--prefill", good, "--decode", sick, "--router", dead)
    assert done.returncode == 1
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith(f"OK   prefill {good}")
    assert lines[1] == f"FAIL decode  {sick}  health: HTTP 503"
    assert lines[2].startswith(f"FAIL router  {dead}  health: no answer (")
    assert lines[3] == "1 of 3 servers alive"
    assert "Traceback" not in done.stderr


def test_router_that_cannot_generate_fails():
    with running("--http-error-rate", "1") as url:
        done = liveness("--router", url, "--model", "mock-dsv4")
    assert done.returncode == 1
    assert "generation: /v1/chat/completions answered" in done.stdout


def test_needs_a_server():
    done = liveness()
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith("error: name at least one server: --prefill, --decode or --router URL")
    )
