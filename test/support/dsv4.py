"""Real upstream DeepSeek-V4 sizing chains and pools on the CPU, for any index-K dtype.

Everything here is upstream's own code path (see `sglang_dsv4.plan.chain`, which these re-export):
ServerArgs -> publish -> ModelConfig -> KVCacheConfigurator -> DSV4PoolConfigurator, and the
DeepSeekV4TokenToKVPool a scheduler builds from the configurator's sizes, on device="cpu" (or
"meta" for shapes only). Stand-ins only for what this machine lacks: device "cpu" in ServerArgs,
a one-stage pipeline group object, and the fp4 indexer switch set on the published config
(ServerArgs refuses it without an sm_100 / sm_120 GPU).

Pools keep the index-K dtype they were built with, so fp8, bf16 and fp4 pools can be built in
one test session. Only upstream modules are imported (no sglang_dsv4.fixes), so these builders
also serve the run on upstream patched by the exported series.

    chain, pool = small_pool("bf16")             # DeepSeek-V4-Flash, TP 4, decode, page 256
    with activated(chain): ...                   # re-publish chain's config + dtype in force
    storage_bytes(pool)                          # bytes of distinct tensor storages
"""

from __future__ import annotations

from sglang_dsv4.plan.chain import (  # noqa: F401  (re-exported API)
    INDEX_K_DTYPES,
    Chain,
    activated,
    build_chain,
    build_pool,
    build_pools,
    default_model_dir,
    index_k_dtype_in_force,
    one_more_page_bytes,
    pool_breakdown,
    size_for_budget,
    size_for_tokens,
    storage_bytes,
)

# A small capacity that keeps every pool page-aligned: the SWA pool takes 10% of the full tokens
# (upstream's default ratio) in pages of 256, so multiples of 2560 full tokens are exact; the
# SWA pool must also hold one request (window 128 + one page), which 5120 is the smallest to do.
SMALL_FULL_TOKENS = 5120
SMALL_MAX_RUNNING_REQUESTS = 4


def small_pool(
    index_k_dtype: str = "bf16",
    *,
    full_tokens: int = SMALL_FULL_TOKENS,
    max_running_requests: int = SMALL_MAX_RUNNING_REQUESTS,
    device: str = "cpu",
    **chain_kwargs,
):
    """(chain, DeepSeekV4TokenToKVPool) sized by upstream's configurator for `full_tokens`."""
    chain = build_chain(index_k_dtype, **chain_kwargs)
    config = size_for_tokens(chain, full_tokens, max_running_requests)
    return chain, build_pool(chain, config, device=device)
