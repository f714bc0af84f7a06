"""The fix register: every change the distribution carries, in the order patches are exported.

Each module opens with its register entry (Target / Why / How / Upstream / Remove when) and
defines `FIX`, a `sglang_dsv4.register.Fix` naming what it replaces or adds upstream.
"""

from sglang_dsv4.fixes import (
    host_mirror_geometry,
    index_k_bf16,
    index_k_transfer_gate,
    nixl_bootstrap_cascade,
    pool_sizing_bf16,
)

FIXES = (
    index_k_bf16.FIX,
    pool_sizing_bf16.FIX,
    index_k_transfer_gate.FIX,
    host_mirror_geometry.FIX,
    nixl_bootstrap_cascade.FIX,
)


def by_id(fix_id: str):
    for fix in FIXES:
        if fix.id == fix_id:
            return fix
    raise KeyError(f"no fix with id {fix_id!r}; known: {', '.join(f.id for f in FIXES)}")
