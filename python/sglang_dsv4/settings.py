"""The distribution's own environment variables, read once per process and validated.

- SGLANG_DSV4_INDEX_K_DTYPE   fp8 (default, upstream's numerics) | bf16 | fp4
- SGLANG_DSV4_ALLOW_UNPINNED  1: run on an upstream version other than the pin, with a warning
- SGLANG_DSV4_SKIP_FIXES      comma-separated fix ids not to apply (reported as "skipped")
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from sglang_dsv4.fixes.index_k_bf16 import (
    INDEX_K_DTYPE_ENV,
    parse_dsv4_index_k_dtype,
)

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
    try:
        return parse_dsv4_index_k_dtype(value)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def from_environ(environ: os._Environ | dict) -> Settings:
    skip = frozenset(s.strip() for s in environ.get(SKIP_FIXES_ENV, "").split(",") if s.strip())
    return Settings(
        index_k_dtype=parse_index_k_dtype(environ.get(INDEX_K_DTYPE_ENV)),
        allow_unpinned=environ.get(ALLOW_UNPINNED_ENV, "").strip().lower() in _TRUE,
        skip_fixes=skip,
    )


@functools.cache
def current() -> Settings:
    """This process's settings: read on first use, then fixed for its lifetime."""
    return from_environ(os.environ)
