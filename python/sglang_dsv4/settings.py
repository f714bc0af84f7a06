"""The distribution's own environment variables, read once per process and validated.

- SGLANG_DSV4_INDEX_K_DTYPE   fp8 (default, upstream's numerics) | bf16 | fp4
- SGLANG_DSV4_ALLOW_UNPINNED  1: run on an upstream version other than the pin, with a warning
- SGLANG_DSV4_SKIP_FIXES      comma-separated fix ids not to apply (reported as "skipped")

This module imports no fix and nothing upstream: the plugin reads it in every SGLang process at
start-up, and `python -m sglang_dsv4.envcheck` checks them before a container's role starts.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

INDEX_K_DTYPE_ENV = "SGLANG_DSV4_INDEX_K_DTYPE"
# The same names index-k-bf16's parse_dsv4_index_k_dtype accepts (a test holds the two together;
# that function is written into upstream's module, so it cannot import this one).
INDEX_K_DTYPES = ("fp8", "bf16", "fp4")
ALLOW_UNPINNED_ENV = "SGLANG_DSV4_ALLOW_UNPINNED"
SKIP_FIXES_ENV = "SGLANG_DSV4_SKIP_FIXES"

_TRUE = {"1", "true", "yes", "on"}


class SettingsError(ValueError):
    """An environment variable of the distribution holds a value it cannot use."""


@dataclass(frozen=True)
class Settings:
    index_k_dtype: str
    allow_unpinned: bool
    skip_fixes: frozenset[str]


def parse_index_k_dtype(value: str | None) -> str:
    """Normalise an index-K dtype name; unset or empty means fp8 (upstream's behaviour)."""
    name = (value or "").strip().lower() or "fp8"
    if name not in INDEX_K_DTYPES:
        raise SettingsError(
            f"{INDEX_K_DTYPE_ENV}={value!r} is not supported; allowed: {', '.join(INDEX_K_DTYPES)}"
        )
    return name


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


def from_environ(environ: os._Environ | dict) -> Settings:
    return Settings(
        index_k_dtype=parse_index_k_dtype(environ.get(INDEX_K_DTYPE_ENV)),
        allow_unpinned=environ.get(ALLOW_UNPINNED_ENV, "").strip().lower() in _TRUE,
        skip_fixes=parse_skip_fixes(environ.get(SKIP_FIXES_ENV)),
    )


@functools.cache
def current() -> Settings:
    """This process's settings: read on first use, then fixed for its lifetime."""
    return from_environ(os.environ)
