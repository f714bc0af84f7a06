"""The fix register: every change the distribution carries, in the order patches are exported.

Each module opens with its register entry (Target / Why / How / Upstream / Remove when) and
defines `FIX`, a `sglang_dsv4.register.Fix` naming what it replaces or adds upstream.

`REGISTER` below is what the plugin reads at start-up: ids, the fix module and the upstream
modules that hold its targets, all as names. Nothing here imports a fix module (each imports the
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

    id: str
    module: str  # the module that defines FIX
    # Upstream modules holding its targets: importing one applies the targets it holds.
    # Empty for a change declared but not implemented. test/test_plugin.py checks this list
    # against the targets FIX names.
    upstream_modules: tuple[str, ...]

    @property
    def implemented(self) -> bool:
        return bool(self.upstream_modules)

    def load(self):
        """The module's `Fix` (imports the fix module, hence the upstream modules it uses)."""
        return importlib.import_module(self.module).FIX


REGISTER: tuple[Entry, ...] = (
    Entry(
        "index-k-bf16",
        "sglang_dsv4.fixes.index_k_bf16",
        (
            _POOL,
            "sglang.srt.layers.attention.dsv4.indexer",
            "sglang.srt.layers.attention.dsv4.compressor_v2",
            "sglang.srt.layers.attention.deepseek_v4_backend",
        ),
    ),
    Entry(
        "pool-sizing-bf16",
        "sglang_dsv4.fixes.pool_sizing_bf16",
        (_POOL, "sglang.srt.model_executor.pool_configurator"),
    ),
    Entry("index-k-transfer-gate", "sglang_dsv4.fixes.index_k_transfer_gate", (_POOL,)),
    Entry(
        "host-mirror-geometry",
        "sglang_dsv4.fixes.host_mirror_geometry",
        (
            _POOL,
            "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler",
            "sglang.srt.mem_cache.memory_pool_host",
            _NIXL,
        ),
    ),
    Entry(
        "nixl-bootstrap-cascade",
        "sglang_dsv4.fixes.nixl_bootstrap_cascade",
        (
            _NIXL,
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
