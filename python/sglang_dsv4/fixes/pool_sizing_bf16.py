"""pool-sizing-bf16: price the DeepSeek-V4 indexer as it is stored, with one byte-size rule.

Register entry
  Target:      sglang.srt.mem_cache.deepseek_v4_memory_pool.get_dsv4_indexer_bytes_per_token
               sglang.srt.model_executor.pool_configurator.DSV4PoolConfigurator
  Why:         DSV4PoolConfigurator prices the c4 indexer with the fp8 estimate (132 B/token; fp4
               only on HIP) whatever the pool stores. A bf16 pool (256 B/token) is under-budgeted
               by 124 B per c4 token: about 1.1 GB per rank over-committed in production, and output
               corrupted under 60+ concurrent sessions. DeepSeek-V4-Flash, TP 4, decode, page 256:
               7086.75 B per full token priced, 7737.75 stored (21 x 124 / 4 = 651 more).
  How:         One function decides bytes per indexer token for fp4, fp8 and bf16; the pool's
               allocation and the configurator both call it.
  Upstream:    not upstream
  Remove when: upstream's configurator takes the indexer's bytes from the pool's own rule.
"""

from __future__ import annotations

from sglang_dsv4.register import Fix

FIX = Fix(
    id="pool-sizing-bf16",
    title="price the DeepSeek-V4 indexer as it is stored",
    area="model_executor",
    why=(
        "DSV4PoolConfigurator prices the c4 indexer with the fp8 estimate (132 B/token; fp4 only "
        "on HIP) whatever the pool stores. A bf16 pool (256 B/token) is under-budgeted by 124 B "
        "per c4 token: about 1.1 GB per rank over-committed in production, and output corrupted "
        "under 60+ concurrent sessions. DeepSeek-V4-Flash at TP 4, decode, page 256: 7086.75 B "
        "per full token priced, 7737.75 stored (21 x 124 / 4 = 651 more)."
    ),
    how=(
        "One function decides the bytes per indexer token for fp4, fp8 and bf16; the pool's "
        "allocation and DSV4PoolConfigurator both call it, so sizing equals allocation."
    ),
    upstream="not upstream",
    remove_when="upstream's configurator takes the indexer's bytes from the pool's own rule.",
    targets=(
        "sglang.srt.mem_cache.deepseek_v4_memory_pool.get_dsv4_indexer_bytes_per_token",
        "sglang.srt.model_executor.pool_configurator.DSV4PoolConfigurator",
    ),
)
