"""A stand-in `sglang-dsv4` sub-command for test/test_cli.py: slow enough for a spinner to draw,
names a step, prints its result (and JSON with --json)."""

import json
import time


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true")


def run(args) -> int:
    from sglang_dsv4.cli import step

    step("stand-in: second step")
    time.sleep(0.5)
    print(json.dumps({"done": True}) if args.json else "RESULT")
    return 0
