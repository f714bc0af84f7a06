"""Sizing equals allocation: what DSV4PoolConfigurator charges per full token is what the real
DeepSeekV4TokenToKVPool allocates per full token, for every index-K dtype; and for a byte budget the
pools it sizes take at most the budget and leave less than one more page of every pool unused.

Real upstream chain and pools on the CPU (test/support/dsv4.py); the marginal bytes per full token
are measured from the storages of the pools' tensors at two capacities the configurator itself
sized (calculate_pool_sizes_from_max_tokens / finalize_with_max_running_requests).
"""

import pytest
from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
from sglang.srt.runtime_context import get_context
from support.dsv4 import (
    SMALL_FULL_TOKENS,
    SMALL_MAX_RUNNING_REQUESTS,
    activated,
    build_chain,
    build_pool,
    build_pools,
    index_k_dtype_in_force,
    one_more_page_bytes,
    size_for_budget,
    size_for_tokens,
    storage_bytes,
)

# DESIGN.md: DeepSeek-V4-Flash at TP 4, decode, page 256, fp8 KV, as upstream 0.5.23 prices it
# with fp8 index keys, and with bf16 keys (21 c4 layers x (256 - 132) B / 4 more).
FLASH_FP8_BYTES_PER_FULL_TOKEN = 7086.75
FLASH_BF16_BYTES_PER_FULL_TOKEN = 7737.75


@pytest.fixture(scope="module")
def chains():
    return {dtype: build_chain(dtype) for dtype in ("fp8", "bf16", "fp4")}


def marginal_bytes_per_full_token(chain) -> float:
    """Allocated bytes per full token between two capacities the configurator sized."""
    allocated = []
    capacities = (SMALL_FULL_TOKENS, 2 * SMALL_FULL_TOKENS)
    for full_tokens in capacities:
        config = size_for_tokens(chain, full_tokens, SMALL_MAX_RUNNING_REQUESTS)
        assert config.max_total_num_tokens == full_tokens
        pool = build_pool(chain, config, device="cpu")
        allocated.append(storage_bytes(pool))
        del pool
    return (allocated[1] - allocated[0]) / (capacities[1] - capacities[0])


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp4"])
def test_configurator_price_equals_pool_allocation(chains, dtype):
    chain = chains[dtype]
    assert marginal_bytes_per_full_token(chain) == chain.configurator.bytes_per_full_token


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp4"])
def test_configurator_prices_the_c4_indexer_as_the_pool_stores_it(chains, dtype):
    chain = chains[dtype]
    config = size_for_tokens(chain, SMALL_FULL_TOKENS, SMALL_MAX_RUNNING_REQUESTS)
    indexer = build_pool(chain, config, device="meta").index_pools[4]
    assert indexer.index_k_dtype == dtype
    # Bytes per token read off the allocated page rows, not from any formula.
    first_layer = indexer.index_k_with_scale_buffer[0]
    stored_per_token = first_layer.shape[1] * first_layer.element_size() // indexer.page_size
    assert chain.configurator.indexer_bytes_per_token == stored_per_token


def test_deepseek_v4_flash_figures(chains):
    fp8, bf16 = chains["fp8"].configurator, chains["bf16"].configurator
    assert fp8.bytes_per_full_token == FLASH_FP8_BYTES_PER_FULL_TOKEN
    assert bf16.bytes_per_full_token == FLASH_BF16_BYTES_PER_FULL_TOKEN
    c4_layers = chains["bf16"].model_config.compress_ratios[:43].count(4)
    key_growth = bf16.indexer_bytes_per_token - fp8.indexer_bytes_per_token
    assert (c4_layers, key_growth) == (21, 124)
    assert bf16.bytes_per_full_token - fp8.bytes_per_full_token == c4_layers * key_growth / 4 == 651


def test_fp4_flag_with_another_dtype_stops_sizing():
    chain = build_chain("bf16")
    with activated(chain):
        # Upstream's fp4 indexer switch, set on the published config: ServerArgs refuses it
        # without an sm_100 / sm_120 GPU (stand-in for that check).
        get_context().override("test", enable_deepseek_v4_fp4_indexer=True)
        with pytest.raises(ValueError, match="contradicts --enable-deepseek-v4-fp4-indexer"):
            create_memory_pool_configurator(chain.kvc)


def test_fp4_variable_without_the_flag_stops_sizing():
    chain = build_chain("fp8")
    with activated(chain), index_k_dtype_in_force("fp4"):
        with pytest.raises(ValueError, match="pass --enable-deepseek-v4-fp4-indexer"):
            create_memory_pool_configurator(chain.kvc)


GIB = 1 << 30


@pytest.mark.parametrize(
    "dtype, kv_gib, chain_kwargs",
    [
        ("fp8", 40, {}),  # the default plan: upstream allocated 11,416,128 B more than this
        ("bf16", 40, {}),
        ("fp4", 8, {}),
        ("bf16", 13, {"disaggregation_mode": "prefill", "tp": 8}),
        # Few requests on a decode server: upstream adds 2 x requests of pre-allocation slots.
        ("fp8", 20, {"max_running_requests": 16}),
        # MTP: the draft worker's own pool comes out of the same budget.
        ("bf16", 30, {"mtp": True}),
    ],
)
def test_pools_take_at_most_the_budget_and_leave_less_than_one_page(dtype, kv_gib, chain_kwargs):
    chain = build_chain(dtype, **chain_kwargs)
    budget = kv_gib * GIB
    config = size_for_budget(chain, budget)
    target, draft, _ = build_pools(chain, config, device="meta")
    assert (draft is not None) == bool(chain_kwargs.get("mtp"))
    allocated = storage_bytes(target, draft)
    assert allocated <= budget, f"{allocated - budget:,} B over the budget"
    assert budget - allocated < one_more_page_bytes(chain, config)
