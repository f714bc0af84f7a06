"""`sglang-dsv4`: the distribution's command line.

Each sub-command lives in its own module with `add_arguments(parser)` and `run(args) -> int`.
Commands import upstream, which takes seconds: on a terminal a spinner on stderr says what runs
(a command may name its current step with `step(...)`); with --json, or without a terminal,
nothing but the command's own output is written. Upstream's import-time noise (quantization
UserWarnings about other platforms, "Cannot detect CUDA architecture.") is silenced here, in the
command line only; a server keeps it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import sys
import warnings

from sglang_dsv4 import UPSTREAM_PIN, __version__

# name -> (module, one-line help); the module is imported only when its command runs.
COMMANDS = {
    "status": ("sglang_dsv4.status", "upstream pin, each fix and whether it is in force"),
    "export-patches": ("sglang_dsv4.maintain.export", "write the carried changes as a git patch series"),
    "plan": ("sglang_dsv4.plan.command", "per-rank KV memory plan of a DeepSeek-V4 model (no GPU needed)"),
    "k8s": ("sglang_dsv4.k8s_cli", "Kubernetes manifests for the PD deployment, from the memory plan"),
    "tiny-model": (
        "sglang_dsv4.tiny_model",
        "write a tiny random DeepSeek-V4 checkpoint that `launch_server --device cpu` serves",
    ),
    "rebase-check": (
        "sglang_dsv4.maintain.rebase_check",
        "fix by fix on another upstream tree: needed, already upstream, or broken",
    ),
    "kernels": (
        "sglang_dsv4.kernels",
        "compile every Triton kernel for sm_120 / sm_90 / sm_100: fit, spills, residency, waves",
    ),
}

# The acceptance tools an operator runs against a deployment (sglang_dsv4.acceptance): each keeps
# its own parser and `main(argv)`, so `sglang-dsv4 NAME ARGS` is `python -m MODULE ARGS`.
TOOLS = {
    "liveness": (
        "sglang_dsv4.acceptance.liveness",
        "every server of a PD deployment healthy and able to generate, one line each",
    ),
    "soak": (
        "sglang_dsv4.acceptance.dsml_soak",
        "DSML tool-call corruption soak: concurrent multi-turn sessions, every response checked",
    ),
    "throughput": (
        "sglang_dsv4.acceptance.throughput",
        "upstream's serving benchmark at concurrency 1 and 32, one table, against a baseline",
    ),
    "release-gate": (
        "sglang_dsv4.acceptance.release_gate",
        "rounds of soak and throughput with every server's counters: pass or fail a release",
    ),
}

_progress = None  # (rich Progress, task id) while a command runs on a terminal


def step(text: str) -> None:
    """Name what the running command does now (shown only on a terminal)."""
    if _progress is not None:
        progress, task = _progress
        progress.update(task, description=text)


@contextlib.contextmanager
def progress(command: str, quiet: bool):
    """A transient spinner on stderr while `command` runs, when stderr is a terminal."""
    global _progress
    if quiet or not sys.stderr.isatty():
        yield
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(file=sys.stderr)
    # Output printed meanwhile goes above the spinner only when stdout is that terminal too;
    # redirected, it must reach its file untouched.
    to_terminal = sys.stdout.isatty()
    bar = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        redirect_stdout=to_terminal,
        redirect_stderr=False,
    )
    with bar:
        _progress = (bar, bar.add_task(f"sglang-dsv4 {command}: importing upstream sglang"))
        try:
            yield
        finally:
            _progress = None


def quiet_upstream_imports() -> None:
    """Silence what upstream prints while its modules import on a machine like this one."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"sglang\.")
    # Upstream's GPU-probing modules log warnings (no handler configured: Python's last resort
    # prints them); its errors still show.
    logging.getLogger("sglang").setLevel(logging.ERROR)


@contextlib.contextmanager
def upstream_quiet():
    """`quiet_upstream_imports()` for the duration only, then restored (for code run in-process,
    as tests run commands)."""
    sglang_logger = logging.getLogger("sglang")
    level = sglang_logger.level
    try:
        with warnings.catch_warnings():
            quiet_upstream_imports()
            yield
    finally:
        sglang_logger.setLevel(level)


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
    for name, (module, help_text) in TOOLS.items():
        # Listed for --help; main() hands their arguments to the tool's own parser.
        sub.add_parser(name, help=help_text, description=f"{help_text} (python -m {module})")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in TOOLS:
        tool = importlib.import_module(TOOLS[argv[0]][0])
        return tool.main(argv[1:])
    args = build_parser().parse_args(argv)
    quiet_upstream_imports()
    with progress(args.command, quiet=getattr(args, "json", False)):
        return importlib.import_module(args._module).run(args)


if __name__ == "__main__":
    sys.exit(main())
