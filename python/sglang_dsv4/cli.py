"""`sglang-dsv4`: the distribution's command line.

Each sub-command lives in its own module with `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from sglang_dsv4 import UPSTREAM_PIN, __version__

# name -> (module, one-line help); the module is imported only when its command runs.
COMMANDS = {
    "status": ("sglang_dsv4.status", "upstream pin, each fix and whether it is in force"),
    "export-patches": ("sglang_dsv4.export", "write the carried changes as a git patch series"),
    "plan": ("sglang_dsv4.plan", "per-rank KV memory plan of a DeepSeek-V4 model (no GPU needed)"),
    "rebase-check": (
        "sglang_dsv4.rebase_check",
        "fix by fix on another upstream tree: needed, already upstream, or broken",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-dsv4",
        description=f"sglang-dsv4-sm120 {__version__}: DeepSeek-V4 on sm_120, on SGLang {UPSTREAM_PIN}",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(cmd)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return importlib.import_module(args._module).run(args)


if __name__ == "__main__":
    sys.exit(main())
