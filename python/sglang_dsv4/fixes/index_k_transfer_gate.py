"""index-k-transfer-gate: every index-K and compress-state read waits for its layer's transfer.

Register entry
  Target:      sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool
               (get_index_k_* getters, compress-state getters, wait_layer_transfer)
  Why:         With HiCache on, a layer's index-K pages are loaded host -> device layer by layer.
               A read that does not wait for its layer (wait_layer_transfer) scores stale keys; the
               twice-larger bf16 rows widened the race and corrupted 12-18% of tool-call responses at
               60+ concurrent sessions in production (none with HiCache off or fp8 keys).
  How:         Every getter the distribution adds waits first; a contract check enumerates the
               getters on the real class and fails on any that does not wait.
  Upstream:    upstream 0.5.23 gates its own index-K getters; the distribution's getters are not
               upstream.
  Remove when: index-k-bf16 is upstream and upstream keeps an equivalent contract check.
"""

from __future__ import annotations

from sglang_dsv4.register import Fix

FIX = Fix(
    id="index-k-transfer-gate",
    title="every index-K read waits for its layer's HiCache transfer",
    area="mem_cache",
    why=(
        "With HiCache on, index-K pages are loaded host -> device layer by layer. A read that does "
        "not wait for its layer (wait_layer_transfer) scores stale keys; the twice-larger bf16 rows "
        "widened the race and corrupted 12-18% of tool-call responses at 60+ concurrent sessions "
        "in production (none with HiCache off or with fp8 keys)."
    ),
    how=(
        "Every index-K or compress-state getter of DeepSeekV4TokenToKVPool, upstream's and the "
        "distribution's, waits for its layer's transfer first; a contract check enumerates them "
        "on the real class and names any that does not wait."
    ),
    upstream="upstream 0.5.23 gates its own getters; getters the distribution adds are not upstream",
    remove_when="index-k-bf16 is upstream and upstream keeps an equivalent contract check.",
    targets=(
        "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool.wait_layer_transfer",
        "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool.get_index_k_with_scale_buffer",
    ),
)
