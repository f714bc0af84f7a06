"""The distribution's own environment variables, read once per process and validated.

- SGLANG_DSV4_INDEX_K_DTYPE   fp8 (default, upstream's numerics) | bf16 | fp4
- SGLANG_DSV4_ALLOW_UNPINNED  1: run on an upstream version other than the pin, with a warning
- SGLANG_DSV4_SKIP_FIXES      comma-separated fix ids not to apply (reported as "skipped")
- SGLANG_DSV4_SANITIZE        1: install the KV / index-K sanitizer (default 0: nothing installed)
- SGLANG_DSV4_SANITIZE_SAMPLE share of decode steps read-checked, 0..1 (default 0.01)
- SGLANG_DSV4_SANITIZE_ACTION log (default) | abort: also fail the request a violation names

The index-K dtype's names and rules are `sglang_dsv4.index_k_dtype`'s (the same functions fix
index-k-bf16 adds upstream); a server reads that variable once, through the cached
`requested_dsv4_index_k_dtype`, for the settings and for its pools alike.

This module imports no fix and nothing upstream: the plugin reads it in every SGLang process at
start-up, and `python -m sglang_dsv4.envcheck` checks them before a container's role starts.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from sglang_dsv4 import index_k_dtype
from sglang_dsv4.index_k_dtype import INDEX_K_DTYPE_ENV

ALLOW_UNPINNED_ENV = "SGLANG_DSV4_ALLOW_UNPINNED"
SKIP_FIXES_ENV = "SGLANG_DSV4_SKIP_FIXES"
SANITIZE_ENV = "SGLANG_DSV4_SANITIZE"
SANITIZE_SAMPLE_ENV = "SGLANG_DSV4_SANITIZE_SAMPLE"
SANITIZE_ACTION_ENV = "SGLANG_DSV4_SANITIZE_ACTION"
SANITIZE_ACTIONS = ("log", "abort")

_TRUE = {"1", "true", "yes", "on"}


class SettingsError(ValueError):
    """An environment variable of the distribution holds a value it cannot use."""


@dataclass(frozen=True)
class Settings:
    # What a server started consistently stores (fp8 when not set; fp4 goes with upstream's
    # --enable-deepseek-v4-fp4-indexer, which the settings do not see).
    index_k_dtype: str
    allow_unpinned: bool
    skip_fixes: frozenset[str]
    sanitize: bool = False
    sanitize_sample: float = 0.01
    sanitize_action: str = "log"


def parse_index_k_dtype(value: str | None) -> str:
    """The index-K dtype a SGLANG_DSV4_INDEX_K_DTYPE value asks for (not set: fp8)."""
    try:
        requested = index_k_dtype.parse_dsv4_index_k_dtype(value)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    return _stored(requested)


def _stored(requested: str | None) -> str:
    return index_k_dtype.dsv4_index_k_dtype_for(requested, use_fp4_indexer=requested == "fp4")


def parse_skip_fixes(value: str | None) -> frozenset[str]:
    """Fix ids to leave out; an id the register does not know is a typo, not a no-op."""
    from sglang_dsv4.fixes import ids

    skip = frozenset(s.strip() for s in (value or "").split(",") if s.strip())
    unknown = sorted(skip - set(ids()))
    if unknown:
        raise SettingsError(
            f"{SKIP_FIXES_ENV} names no fix {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(ids())}"
        )
    return skip


def parse_sanitize(environ) -> tuple[bool, float, str]:
    """(on, sample, action) of the sanitizer variables; one clear line on a bad value."""
    raw = environ.get(SANITIZE_ENV, "").strip().lower()
    if raw not in ("", "0", "1", "false", "true", "no", "yes", "off", "on"):
        raise SettingsError(f"{SANITIZE_ENV}={raw!r} is not supported; allowed: 0, 1")
    sample_raw = environ.get(SANITIZE_SAMPLE_ENV, "").strip() or "0.01"
    try:
        sample = float(sample_raw)
    except ValueError:
        sample = -1.0
    if not 0.0 <= sample <= 1.0:
        raise SettingsError(
            f"{SANITIZE_SAMPLE_ENV}={sample_raw!r} is not supported; allowed: a number from 0 to 1"
        )
    action = environ.get(SANITIZE_ACTION_ENV, "").strip().lower() or "log"
    if action not in SANITIZE_ACTIONS:
        raise SettingsError(
            f"{SANITIZE_ACTION_ENV}={action!r} is not supported; allowed: log, abort"
        )
    return raw in _TRUE, sample, action


def from_environ(environ: os._Environ | dict) -> Settings:
    sanitize, sample, action = parse_sanitize(environ)
    if environ is os.environ:  # the process's own read, shared with the pools (cached)
        try:
            dtype = _stored(index_k_dtype.requested_dsv4_index_k_dtype())
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
    else:
        dtype = parse_index_k_dtype(environ.get(INDEX_K_DTYPE_ENV))
    return Settings(
        index_k_dtype=dtype,
        allow_unpinned=environ.get(ALLOW_UNPINNED_ENV, "").strip().lower() in _TRUE,
        skip_fixes=parse_skip_fixes(environ.get(SKIP_FIXES_ENV)),
        sanitize=sanitize,
        sanitize_sample=sample,
        sanitize_action=action,
    )


@functools.cache
def current() -> Settings:
    """This process's settings: read on first use, then fixed for its lifetime."""
    return from_environ(os.environ)
