"""The fix register: every change the distribution carries, in the order patches are exported.

Each module defines `FIX`, a `sglang_dsv4.fix.Fix` naming what it replaces or adds upstream and
why, and its docstring opens with that register entry rendered (Target / Why / How / Upstream /
Remove when; `sglang_dsv4.fix.register_text`).

`REGISTER` below is what the plugin reads at start-up: each fix module and the upstream modules
that hold its targets, all as names; a fix's id is its module's name with dashes
(`index_k_bf16` is `index-k-bf16`), and `FIX.id` must say the same. Nothing here imports a fix module (each imports the
upstream modules it hooks, which costs seconds), so the plugin applies a fix only once upstream
itself imports one of those modules. `FIXES`, the `Fix` objects, imports every fix module on
first use (status, export, tests).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

_POOL = "sglang.srt.mem_cache.deepseek_v4_memory_pool"
_NIXL = "sglang.srt.disaggregation.nixl.conn"


@dataclass(frozen=True)
class Entry:
    """A fix as the plugin sees it before importing anything upstream."""

    module: str  # the module that defines FIX
    # Upstream modules holding its targets: importing one applies the targets it holds.
    # Empty for a change declared but not implemented. test/test_plugin.py checks this list
    # against the targets FIX names.
    upstream_modules: tuple[str, ...]

    @property
    def id(self) -> str:
        return self.module.rsplit(".", 1)[-1].replace("_", "-")

    @property
    def implemented(self) -> bool:
        return bool(self.upstream_modules)

    def load(self):
        """The module's `Fix` (imports the fix module, hence the upstream modules it uses)."""
        return importlib.import_module(self.module).FIX


REGISTER: tuple[Entry, ...] = (
    Entry(
        "sglang_dsv4.fixes.index_k_bf16",
        (
            _POOL,
            "sglang.srt.layers.attention.dsv4.indexer",
            "sglang.srt.layers.attention.dsv4.compressor_v2",
            "sglang.srt.layers.attention.deepseek_v4_backend",
        ),
    ),
    Entry(
        "sglang_dsv4.fixes.pool_sizing_bf16",
        (_POOL, "sglang.srt.model_executor.pool_configurator"),
    ),
    Entry("sglang_dsv4.fixes.index_k_transfer_gate", (_POOL,)),
    Entry(
        "sglang_dsv4.fixes.host_mirror_geometry",
        (
            _POOL,
            "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler",
            "sglang.srt.mem_cache.memory_pool_host",
            _NIXL,
        ),
    ),
    Entry(
        "sglang_dsv4.fixes.nixl_bootstrap_cascade", (_NIXL, "sglang.srt.disaggregation.decode")
    ),
    Entry(
        "sglang_dsv4.fixes.nixl_control_health",
        (
            "sglang.srt.managers.scheduler_components.internal_state",
            "sglang.srt.entrypoints.http_server",
        ),
    ),
)


def ids() -> tuple[str, ...]:
    return tuple(entry.id for entry in REGISTER)


def __getattr__(name: str):
    # FIXES on first use only: building it imports every fix module and its upstream modules.
    if name == "FIXES":
        fixes = tuple(entry.load() for entry in REGISTER)
        globals()["FIXES"] = fixes
        return fixes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def by_id(fix_id: str):
    for entry in REGISTER:
        if entry.id == fix_id:
            return entry.load()
    raise KeyError(f"no fix with id {fix_id!r}; known: {', '.join(ids())}")
