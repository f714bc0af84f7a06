"""index-k-bf16: bf16 index keys for the DeepSeek-V4 c4 sparse-attention indexer.

Register entry
  Target:      sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4IndexerPool
               sglang.srt.layers.attention.dsv4.indexer.forward_c4_indexer
  Why:         The lightning indexer keeps one 128-value key per compressed token of each c4 layer
               (21 in DeepSeek-V4-Flash) and picks the top 512 for sparse attention. Upstream 0.5.23
               stores keys as fp8 e4m3 with one fp32 scale per 128 values (132 B/token; fp4: 68) and
               quantizes the query to fp8 too; the lost precision costs long-context recall.
  How:         SGLANG_DSV4_INDEX_K_DTYPE=fp8|bf16|fp4 (default fp8, upstream's numerics). Under
               bf16 the c4 pool stores the keys as they are: 256 B/token, no scale, same pages.
  Upstream:    not upstream
  Remove when: upstream ships a bf16 (or otherwise lossless) index-K option for DeepSeek-V4.
"""

from __future__ import annotations

from typing import Optional

from sglang_dsv4.register import Fix

INDEX_K_DTYPE_ENV = "SGLANG_DSV4_INDEX_K_DTYPE"
INDEX_K_DTYPES = ("fp8", "bf16", "fp4")


def parse_dsv4_index_k_dtype(value: Optional[str]) -> str:
    """Normalise a SGLANG_DSV4_INDEX_K_DTYPE value; unset or empty means fp8 (upstream's)."""
    name = (value or "").strip().lower() or "fp8"
    if name not in ("fp8", "bf16", "fp4"):
        raise ValueError(
            f"SGLANG_DSV4_INDEX_K_DTYPE={value!r} is not supported; allowed: fp8, bf16, fp4"
        )
    return name


FIX = Fix(
    id="index-k-bf16",
    title="bf16 index keys for the DeepSeek-V4 c4 indexer",
    area="dsv4",
    why=(
        "The c4 lightning indexer scores every cached index key (128 values per compressed token, "
        "21 c4 layers in DeepSeek-V4-Flash) and keeps the top 512 for sparse attention. Upstream "
        "0.5.23 stores keys as fp8 e4m3 plus one fp32 scale per 128 values (132 B/token; fp4: 68) "
        "and quantizes the query to fp8; the precision lost there costs long-context recall."
    ),
    how=(
        "SGLANG_DSV4_INDEX_K_DTYPE=fp8|bf16|fp4, default fp8 (upstream's numerics, so installing "
        "the distribution changes nothing silently). Under bf16 the c4 indexer pool stores keys "
        "as they are: 256 B/token, no scale, the same page count and page registration."
    ),
    upstream="not upstream",
    remove_when="upstream ships a bf16 (or otherwise lossless) index-K option for DeepSeek-V4.",
    targets=(
        "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4IndexerPool",
        "sglang.srt.layers.attention.dsv4.indexer.forward_c4_indexer",
    ),
)
