"""Upstream source trees and git, for the maintainer's commands.

A released upstream as its wheel unpacked into the cache (`fetch_upstream`), a checkout's `python/`
directory, the version a tree holds; and git run with a fixed identity and date and no global
configuration, so what it writes is the same bytes every time.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from sglang_dsv4 import UPSTREAM_PIN

AUTHOR_NAME = "sglang-dsv4-sm120"
AUTHOR_EMAIL = "maintainers@sglang-dsv4-sm120.invalid"
# Fixed so that the same code always exports the same bytes.
PATCH_DATE = "2026-12-01T00:00:00+00:00"


class ExportError(Exception):
    """The series cannot be exported as asked; the message is one line."""


# --- upstream source ----------------------------------------------------------------------------


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "sglang-dsv4"


def fetch_pinned_upstream() -> Path:
    """The `python/` directory of the pinned release, unpacked from its wheel (downloaded once)."""
    return fetch_upstream(UPSTREAM_PIN)


def fetch_upstream(release: str) -> Path:
    """The `python/` directory of an upstream release, unpacked from its wheel (downloaded once)."""
    root = cache_root() / f"sglang-{release}"
    if (root / "python" / "sglang").is_dir():
        return root / "python"
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["--dest", tmp, f"sglang=={release}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("sglang-*.whl"))
        if proc.returncode or not wheels:
            reason = last_line(proc.stderr or proc.stdout) or "no wheel"
            raise ExportError(
                f"cannot download sglang=={release} with pip ({reason}); "
                "pass --upstream-src DIR with upstream's source instead"
            )
        staging = Path(tmp) / "tree"
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [name for name in wheel.namelist() if name.startswith("sglang/")]
            wheel.extractall(staging / "python", members)
        try:
            staging.rename(root)  # atomic: a present cache is a complete one
        except OSError:
            if not (root / "python" / "sglang").is_dir():
                raise
    return root / "python"


def python_dir_of(src: Path) -> Path:
    """The directory holding the `sglang` package: `src/python` (a repository) or `src`."""
    if not src.is_dir():
        raise ExportError(f"upstream source {src} is not a directory")
    for candidate in (src / "python", src):
        if (candidate / "sglang" / "__init__.py").is_file():
            return candidate
    raise ExportError(f"{src} holds no upstream sglang source (no python/sglang/ or sglang/ in it)")


def tree_version(python_dir: Path) -> str:
    """The sglang version of a source tree: `_version.py`, else pyproject.toml, else its git tag."""
    version_file = python_dir / "sglang" / "_version.py"
    if version_file.is_file():
        for node in ast.parse(version_file.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                names = {t.id for t in node.targets if isinstance(t, ast.Name)}
                if "__version__" in names and isinstance(node.value.value, str):
                    return node.value.value
    pyproject = python_dir / "pyproject.toml"
    if pyproject.is_file() and sys.version_info >= (3, 11):
        import tomllib

        version = tomllib.loads(pyproject.read_text()).get("project", {}).get("version")
        if version:
            return version
    proc = subprocess.run(
        ["git", "describe", "--tags", "--exact-match"],
        cwd=python_dir,
        capture_output=True,
        text=True,
    )
    if proc.returncode == 0 and proc.stdout.strip():
        return proc.stdout.strip().removeprefix("v")
    raise ExportError(
        f"cannot tell which sglang version {python_dir} holds "
        "(no sglang/_version.py, no version in pyproject.toml, no release tag)"
    )


def upstream_python_dir(src: Path | None) -> Path:
    """The pinned upstream's `python/` directory: `src`, or the pinned wheel when None."""
    python_dir = fetch_pinned_upstream() if src is None else python_dir_of(src)
    found = tree_version(python_dir)
    if found != UPSTREAM_PIN:
        raise ExportError(
            f"upstream tree {src or python_dir} is sglang {found}, "
            f"the distribution is pinned to {UPSTREAM_PIN}"
        )
    return python_dir


# --- git ----------------------------------------------------------------------------------------


def git_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_CONFIG_NOSYSTEM="1",
        GIT_AUTHOR_NAME=AUTHOR_NAME,
        GIT_AUTHOR_EMAIL=AUTHOR_EMAIL,
        GIT_AUTHOR_DATE=PATCH_DATE,
        GIT_COMMITTER_NAME=AUTHOR_NAME,
        GIT_COMMITTER_EMAIL=AUTHOR_EMAIL,
        GIT_COMMITTER_DATE=PATCH_DATE,
        TZ="UTC",
        LC_ALL="C",
        # A whole upstream tree is more loose objects than gc.auto allows: git would start a
        # detached gc that still writes into .git while the caller removes the directory.
        GIT_CONFIG_COUNT="1",
        GIT_CONFIG_KEY_0="gc.auto",
        GIT_CONFIG_VALUE_0="0",
    )
    return env


def git(args: list[str], cwd: Path) -> str:
    try:
        proc = subprocess.run(
            ["git", *args], cwd=cwd, env=git_env(), capture_output=True, text=True
        )
    except OSError as exc:
        raise ExportError(f"cannot run git ({exc})") from None
    if proc.returncode:
        raise ExportError(
            f"git {args[0]} failed in {cwd}: {last_line(proc.stderr or proc.stdout)}"
        )
    return proc.stdout


def init_repo(root: Path) -> None:
    git(["init", "--quiet", "--initial-branch=main"], root)
    git(["add", "--all"], root)
    git(["commit", "--quiet", "--allow-empty", "--message=upstream sglang " + UPSTREAM_PIN], root)


def last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


