"""Every benchmark command's --help states the defaults it will use."""

from __future__ import annotations

import argparse
import importlib

import pytest

# tool -> its module: the acceptance tools ship with the package, the mock server is a test
# double, the rest are benchmarks of this repository.
TOOLS = {
    "liveness": "sglang_dsv4.acceptance.liveness",
    "throughput": "sglang_dsv4.acceptance.throughput",
    "dsml_soak": "sglang_dsv4.acceptance.dsml_soak",
    "mock_server": "support.mock_server",
    "startup_cost": "benchmark.startup_cost",
    "cpu_speed": "benchmark.cpu_speed",
}


@pytest.mark.parametrize("tool", TOOLS)
def test_help_shows_every_default(tool):
    parser = importlib.import_module(TOOLS[tool]).build_parser()
    missing = []
    for action in parser._actions:
        default = action.default
        if default in (None, False, [], argparse.SUPPRESS) or not action.option_strings:
            continue
        formatter = parser._get_formatter()
        formatter.add_argument(action)
        # argparse wraps long values at hyphens too (a path like /tmp/ci-clone/...): compare
        # without whitespace.
        text = "".join(formatter.format_help().split())
        if "".join(str(default).split()) not in text or "default" not in text:
            missing.append(f"{action.option_strings[0]} (default {default!r})")
    assert not missing, f"{parser.prog} --help omits: {', '.join(missing)}"


def test_the_readme_throughput_dry_run_names_a_local_tokenizer_and_no_download():
    import re
    import shlex
    from pathlib import Path

    from sglang_dsv4.acceptance.throughput import build_parser

    text = (Path(__file__).resolve().parents[1] / "benchmark" / "README.md").read_text()
    section = text[text.index("## Dry run against the mock server") :]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    lines = re.sub(r"\\\n\s*", " ", block).splitlines()
    (mock,) = [shlex.split(ln) for ln in lines if "support.mock_server" in ln]
    (command,) = [shlex.split(ln) for ln in lines if "benchmark.throughput" in ln]
    args = build_parser().parse_args(command[3:])
    assert args.base_url == f"http://127.0.0.1:{mock[mock.index('--port') + 1]}"
    assert args.tokenizer and args.tokenizer.startswith("/")  # a folder, not a hub id
    assert args.dataset == "random-ids"  # no ShareGPT download
    assert "--tokenizer" in section[section.index("```\n", 10) :]  # and the text says why
