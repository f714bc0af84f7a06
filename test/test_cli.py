"""The command line's manners: a spinner on a terminal only, clean --json, no upstream noise.

The progress cases run `sglang_dsv4.cli.main` in-process on a stand-in command
(test/support/cli_command.py) with stderr standing in for a terminal; the noise case runs the
real `sglang-dsv4 status --json` (in test_plugin.py, which runs it anyway).
"""

from __future__ import annotations

import io
import json

import pytest
from sglang_dsv4 import cli


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Redirected(io.StringIO):
    def isatty(self) -> bool:
        return False


@pytest.fixture
def run_cli(monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "stand-in", ("support.cli_command", "a stand-in"))
    monkeypatch.delenv("TERM", raising=False)  # rich draws nothing on a "dumb" terminal

    def run(argv, err):
        # Inside the test body: pytest's own capture takes sys.stdout back between phases.
        out = Redirected()
        with monkeypatch.context() as patch:
            patch.setattr("sys.stdout", out)
            patch.setattr("sys.stderr", err)
            assert cli.main(argv) == 0
        return out.getvalue(), err.getvalue()

    return run


def test_a_slow_command_shows_its_step_on_a_terminal_and_leaves_stdout_alone(run_cli):
    out, err = run_cli(["stand-in"], Terminal())
    assert out == "RESULT\n"
    assert "stand-in: second step" in err


def test_json_output_is_only_json_even_on_a_terminal(run_cli):
    out, err = run_cli(["stand-in", "--json"], Terminal())
    assert json.loads(out) == {"done": True}
    assert err == ""


def test_no_spinner_without_a_terminal(run_cli):
    assert run_cli(["stand-in"], Redirected()) == ("RESULT\n", "")


def test_the_acceptance_tools_run_as_commands_with_their_own_parsers():
    # `sglang-dsv4 liveness ...` is the tool's own parser and main, run from the installed
    # package (the image carries it): bad input is its one usage line, exit 2, as with -m.
    import subprocess
    import sys
    from pathlib import Path

    command = str(Path(sys.executable).parent / "sglang-dsv4")  # the installed console script
    listed = subprocess.run([command, "--help"], capture_output=True, text=True)
    assert listed.returncode == 0
    for name in cli.TOOLS:
        assert name in listed.stdout
        helped = subprocess.run([command, name, "--help"], capture_output=True, text=True)
        assert helped.returncode == 0, helped.stderr
        assert helped.stdout.startswith(f"usage: sglang-dsv4 {name} "), helped.stdout[:80]
    refused = subprocess.run([command, "liveness", "--prefill", "not-a-url"],
                             capture_output=True, text=True)
    assert refused.returncode == 2
    assert refused.stderr.splitlines()[-1].startswith("sglang-dsv4 liveness: error:"), refused.stderr
