"""host-mirror-geometry: HiCache host rows sized from the live buffers; no fp8-only copy on bf16.

Register entry
  Target:      sglang.srt.mem_cache.memory_pool_host.DeepSeekV4PagedHostPool
               sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler._dsv4_indexer_regions
  Why:         HiCache mirrors the c4 indexer pages in host memory. Host rows written for the fp8
               row (132 B/token), or the token-granular copy (transfer_cache_dsv4_mla) that
               hard-codes the fp8 data/scale split, corrupt bf16 rows (256 B/token).
  How:         Host row bytes come from the device buffers (row width x element_size()); bf16
               pages move whole (page-aligned only); a bf16 row reaching the fp8 token-granular copy
               stops with a clear error instead of copying.
  Upstream:    upstream 0.5.23 sizes host rows from the live buffers; the token-granular copy still
               assumes the fp8 split.
  Remove when: upstream's DSV4 host mirror handles non-fp8 index-K rows.
"""

from __future__ import annotations

from sglang_dsv4.register import Fix

FIX = Fix(
    id="host-mirror-geometry",
    title="HiCache host mirror sized from live index-K buffers",
    area="mem_cache",
    why=(
        "HiCache mirrors the c4 indexer pages in host memory (DeepSeekV4PagedHostPool). Host rows "
        "written for the fp8 row (132 B/token), or the token-granular copy transfer_cache_dsv4_mla, "
        "which hard-codes the fp8 data/scale split, corrupt bf16 rows (256 B/token)."
    ),
    how=(
        "Host row bytes come from the live device buffers (row width x element_size()); bf16 "
        "index-K pages move as whole pages only; a bf16 row that would reach the fp8 token-granular "
        "copy stops with a clear error instead of being copied."
    ),
    upstream=(
        "upstream 0.5.23 sizes host rows from the live buffers; the token-granular copy still "
        "assumes the fp8 split"
    ),
    remove_when="upstream's DSV4 host mirror handles non-fp8 index-K rows.",
    targets=(
        "sglang.srt.mem_cache.memory_pool_host.DeepSeekV4PagedHostPool",
        "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler._dsv4_indexer_regions",
    ),
)
