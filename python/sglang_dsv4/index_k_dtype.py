"""The index-K dtype of DeepSeek-V4's c4 indexer: its names, the one parse, the one resolve rule and
the one bytes-per-token rule.

Everything that needs one of these reads it here: the settings (start-up validation), fix
index-k-bf16 (which adds these functions to upstream's deepseek_v4_memory_pool, so the exported
patch carries them upstream and every upstream caller, pool-sizing-bf16's configurator and
host-mirror-geometry's PD pairing check, finds them there), the plan (`sglang-dsv4 plan`), and
the kernels' tests. The functions are written as they stand in upstream's module: only builtins,
`functools`, `os` and each other. The module imports nothing else, not torch, not upstream.

Rules:
- an unset or blank SGLANG_DSV4_INDEX_K_DTYPE is "not set" (`parse_dsv4_index_k_dtype` gives None);
  anything else must name a dtype (case and surrounding space ignored);
- not set means fp8 (upstream's numerics), or fp4 with --enable-deepseek-v4-fp4-indexer; fp4 is
  upstream's fp4 indexer and needs that flag; fp8 or bf16 with the flag is a contradiction
  (`dsv4_index_k_dtype_for`);
- the variable is read from the environment once per process (`requested_dsv4_index_k_dtype`,
  cached; tests that switch dtypes call its `cache_clear()`).
"""

from __future__ import annotations

import functools
import os

INDEX_K_DTYPE_ENV = "SGLANG_DSV4_INDEX_K_DTYPE"
# The names parse_dsv4_index_k_dtype accepts (it spells them out: it stands in upstream's module).
INDEX_K_DTYPES = ("fp8", "bf16", "fp4")
FP4_INDEXER_FLAG = "--enable-deepseek-v4-fp4-indexer"
# DeepSeek-V4's indexer head dim: values per index key.
INDEX_HEAD_DIM = 128


def parse_dsv4_index_k_dtype(value: str | None) -> str | None:
    """A SGLANG_DSV4_INDEX_K_DTYPE value normalised; None when unset or blank (not set)."""
    name = (value or "").strip().lower()
    if not name:
        return None
    if name not in ("fp8", "bf16", "fp4"):
        raise ValueError(
            f"SGLANG_DSV4_INDEX_K_DTYPE={value!r} is not supported; allowed: fp8, bf16, fp4"
        )
    return name


@functools.lru_cache(maxsize=1)
def requested_dsv4_index_k_dtype() -> str | None:
    """SGLANG_DSV4_INDEX_K_DTYPE as set, None when not set; read once per process.

    Tests that build pools of several dtypes set the variable and call `.cache_clear()`.
    """
    return parse_dsv4_index_k_dtype(os.environ.get("SGLANG_DSV4_INDEX_K_DTYPE"))


def dsv4_index_k_dtype_for(requested: str | None, use_fp4_indexer: bool) -> str:
    """The c4 index-K dtype a server stores for a requested dtype (None: not set) and
    --enable-deepseek-v4-fp4-indexer; refuses the two when they contradict."""
    if requested is None:
        return "fp4" if use_fp4_indexer else "fp8"
    if requested == "fp4" and not use_fp4_indexer:
        raise ValueError(
            "SGLANG_DSV4_INDEX_K_DTYPE=fp4 selects upstream's fp4 indexer: pass "
            "--enable-deepseek-v4-fp4-indexer as well (or leave the variable unset)"
        )
    if requested != "fp4" and use_fp4_indexer:
        raise ValueError(
            f"SGLANG_DSV4_INDEX_K_DTYPE={requested} contradicts --enable-deepseek-v4-fp4-indexer, "
            "which stores fp4 index keys; drop one of the two"
        )
    return requested


def resolve_dsv4_index_k_dtype(use_fp4_indexer: bool) -> str:
    """Dtype of an indexer pool's keys: fp4 when upstream's fp4 indexer builds the pool (the flag,
    or a forced low-ratio pool), otherwise the requested fp8 (the default) or bf16."""
    if use_fp4_indexer:
        return "fp4"
    return dsv4_index_k_dtype_for(requested_dsv4_index_k_dtype(), False)


def dsv4_index_k_bytes_per_token(index_head_dim: int, index_k_dtype: str) -> int:
    """Bytes one compressed token's index key takes in an indexer pool (payload + scales).

    The one rule for allocation and sizing. At index_head_dim 128: bf16 256, fp8 132, fp4 68.
    """
    if index_k_dtype == "bf16":
        return 2 * index_head_dim  # the key as computed, no scale
    if index_k_dtype == "fp8":
        # e4m3 values, then one fp32 scale for every 128 of them
        return index_head_dim + 4 * (index_head_dim // 128)
    if index_k_dtype == "fp4":
        # two e2m1 values per byte, then one ue8m0 scale byte for every 32 of them
        return index_head_dim // 2 + index_head_dim // 32
    raise ValueError(f"unknown DeepSeek-V4 index-K dtype {index_k_dtype!r}")

