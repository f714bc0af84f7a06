"""Formatting what the series writes into upstream's files with ruff (pinned), as upstream's
black and isort would."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from sglang_dsv4.maintain.names import find_ast_def
from sglang_dsv4.maintain.upstream import ExportError, last_line

UPSTREAM_LINE_LENGTH = 88


# --- formatting with ruff -----------------------------------------------------------------------


def _ruff(args: list[str], text: str, cwd: Path) -> str:
    cmd = [sys.executable, "-m", "ruff", *args, "--isolated", "--stdin-filename", "patched.py", "-"]
    try:
        proc = subprocess.run(cmd, input=text, capture_output=True, text=True, cwd=cwd)
    except OSError as exc:
        raise ExportError(f"cannot run ruff ({exc})") from None
    if proc.returncode:
        raise ExportError(f"ruff {args[0]} failed: {last_line(proc.stderr)}")
    return proc.stdout


def format_blocks(text: str, defs: Iterable[tuple[Sequence[str], str]], cwd: Path) -> str:
    """Format the defs (class path, name) of `text` in place, as upstream's black would, and
    nothing else (ruff format --range, bottom-up so that earlier line numbers hold)."""
    module = ast.parse(text)
    spans = []
    for class_path, name in defs:
        _, node = find_ast_def(module, class_path, name)
        spans.append(
            (min([node.lineno] + [d.lineno for d in node.decorator_list]), node.end_lineno)
        )
    for first, last in sorted(set(spans), reverse=True):
        args = [
            "format",
            f"--line-length={UPSTREAM_LINE_LENGTH}",
            f"--range={first}:1-{last + 1}:1",
        ]
        text = _ruff(args, text, cwd)
    return text


def format_written(before: str, text: str, defs: Iterable[tuple[Sequence[str], str]], cwd: Path):
    """`text` (= `before` + the written defs) formatted where the series wrote it: the whole file
    in one pass when `before` was formatted already (nothing else can change), else def by def."""
    whole = ["format", f"--line-length={UPSTREAM_LINE_LENGTH}"]
    if _ruff(whole, before, cwd) == before:
        return _ruff(whole, text, cwd)
    return format_blocks(text, defs, cwd)


def sort_imports(text: str, cwd: Path) -> str:
    args = [
        "check",
        "--select=I",
        "--fix-only",
        "--exit-zero",
        f"--line-length={UPSTREAM_LINE_LENGTH}",
    ]
    return _ruff(args + ["--config=lint.isort.known-first-party=['sglang']"], text, cwd)


def format_file(text: str, cwd: Path) -> str:
    return sort_imports(_ruff(["format", f"--line-length={UPSTREAM_LINE_LENGTH}"], text, cwd), cwd)


