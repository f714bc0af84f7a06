"""The plan over a grid of configurations: every cell's pools must fit its budget."""

from __future__ import annotations

import itertools
import random

# Not from sglang_dsv4.fixes: these builders also serve the run on upstream patched by the
# exported series, which imports no fix module (sglang_dsv4.index_k_dtype imports nothing).
from sglang_dsv4.index_k_dtype import (
    INDEX_K_DTYPES,
)
from sglang_dsv4.plan.chain import (
    DSV4_PAGE_SIZE,
    GIB,
    build_chain,
    build_pools,
    one_more_page_bytes,
    size_for_budget,
    storage_bytes,
)

# --- sweep --------------------------------------------------------------------------------------

SWEEP_AXES = {
    "tp": (1, 2, 4, 8),
    "disaggregation_mode": ("prefill", "decode", "null"),
    "page_size": (DSV4_PAGE_SIZE,),  # the only page size upstream runs DeepSeek-V4 with on CUDA
    "index_k_dtype": INDEX_K_DTYPES,
    "kv_gib": (8, 12, 20, 40, 64, 90),
    "max_running_requests": (None, 16, 64, 512, 1024),  # None: upstream's default (256)
    "mtp": (False, True),
}
SWEEP_CATEGORICAL = ("disaggregation_mode", "index_k_dtype")


def sweep_cells(sample: int | None = 160, seed: int = 0) -> list[dict]:
    """The grid's corners (every combination of each numeric axis's ends, with every role and
    dtype), plus `sample` cells drawn from the rest (all of it when `sample` is None)."""
    names = list(SWEEP_AXES)
    every = [
        dict(zip(names, values, strict=True)) for values in itertools.product(*SWEEP_AXES.values())
    ]

    def is_corner(cell):
        # Numeric axes at their ends; the categorical ones (role, dtype) at every value.
        return all(
            cell[n] in (SWEEP_AXES[n][0], SWEEP_AXES[n][-1]) or n in SWEEP_CATEGORICAL
            for n in names
        )

    corners = [cell for cell in every if is_corner(cell)]
    rest = [cell for cell in every if not is_corner(cell)]
    if sample is not None and sample < len(rest):
        rest = random.Random(seed).sample(rest, sample)
    return corners + rest


def sweep(sample: int | None = 160, seed: int = 0, model_path=None) -> dict:
    """Every cell: upstream's chain sized for the budget, its real pools built on meta,
    allocated - budget. Cells whose budget cannot hold the pools are refused by upstream."""
    chains: dict = {}
    results = []
    for cell in sweep_cells(sample, seed):
        key = tuple((k, v) for k, v in cell.items() if k != "kv_gib")
        if key not in chains:
            fields = {}
            if cell["max_running_requests"] is not None:
                fields["max_running_requests"] = cell["max_running_requests"]
            chains[key] = build_chain(
                cell["index_k_dtype"],
                model_path=model_path,
                tp=cell["tp"],
                disaggregation_mode=cell["disaggregation_mode"],
                page_size=cell["page_size"],
                mtp=cell["mtp"],
                **fields,
            )
        chain = chains[key]
        budget = cell["kv_gib"] * GIB
        row = dict(cell)
        try:
            config = size_for_budget(chain, budget)
        except (RuntimeError, ValueError) as exc:
            row["refused"] = str(exc).strip().splitlines()[0]
            results.append(row)
            continue
        pool, draft, _ = build_pools(chain, config, device="meta")
        allocated = storage_bytes(pool, draft)
        row.update(
            refused=None,
            max_total_num_tokens=config.max_total_num_tokens,
            resolved_max_running_requests=config.max_running_requests,
            allocated_bytes=allocated,
            over_bytes=allocated - budget,
            one_more_page_bytes=one_more_page_bytes(chain, config),
        )
        results.append(row)
    sized = [r for r in results if r["refused"] is None]
    worst = max(sized, key=lambda r: r["over_bytes"]) if sized else None
    return {
        "cells": results,
        "sized": len(sized),
        "refused": len(results) - len(sized),
        "worst_over_bytes": worst["over_bytes"] if worst else None,
        "worst_cell": worst,
        "max_unused_bytes": max((-r["over_bytes"] for r in sized), default=None),
    }


