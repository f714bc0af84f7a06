"""The c4 indexer pool's storage per index-K dtype: layout, registration, and the bf16 contract.

Real DeepSeekV4TokenToKVPool(device="cpu") built by upstream's own configurator chain
(test/support/dsv4.py) for DeepSeek-V4-Flash at TP 4, decode, page 256.
"""

import pytest
import torch
from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4IndexerPool
from support.dsv4 import index_k_dtype_in_force, small_pool

INDEX_HEAD_DIM = 128
# Upstream 0.5.23's fp8 row: 128 e4m3 values and one fp32 scale per 128 of them.
FP8_ROW_BYTES = INDEX_HEAD_DIM + 4


@pytest.fixture(scope="module")
def pools():
    return {dtype: small_pool(dtype)[1] for dtype in ("fp8", "bf16")}


def c4_layer_ids(pool):
    return [i for i, item in enumerate(pool.layer_mapping) if item and item.compress_ratio == 4]


def indexer_regions(pool):
    """(data_len, item_len) of the c4 indexer regions PD and HiCache register."""
    index_ptrs = {rows.data_ptr() for rows in pool.index_pools[4].contiguous_page_row_buffers()}
    ptrs, data_lens, item_lens = pool.get_contiguous_buf_infos()
    return [
        (n, item)
        for ptr, n, item in zip(ptrs, data_lens, item_lens, strict=True)
        if ptr in index_ptrs
    ]


def test_bf16_pool_stores_256_bytes_per_token_in_the_same_pages(pools):
    fp8, bf16 = pools["fp8"].index_pools[4], pools["bf16"].index_pools[4]
    assert (fp8.index_k_dtype, bf16.index_k_dtype) == ("fp8", "bf16")
    assert len(bf16.index_k_with_scale_buffer) == len(fp8.index_k_with_scale_buffer) == 21
    for fp8_rows, bf16_rows in zip(
        fp8.index_k_with_scale_buffer, bf16.index_k_with_scale_buffer, strict=True
    ):
        assert bf16_rows.dtype == torch.uint8
        assert bf16_rows.shape == (fp8_rows.shape[0], bf16.page_size * 2 * INDEX_HEAD_DIM)
    # Same page registration for PD / HiCache: one region per layer, one item per page.
    fp8_regions, bf16_regions = indexer_regions(pools["fp8"]), indexer_regions(pools["bf16"])
    assert len(bf16_regions) == len(fp8_regions) == 21
    pages = fp8.index_k_with_scale_buffer[0].shape[0]
    assert set(bf16_regions) == {(pages * 64 * 256, 64 * 256)}
    assert set(fp8_regions) == {(pages * 64 * FP8_ROW_BYTES, 64 * FP8_ROW_BYTES)}


def test_fp8_pool_is_upstreams(pools):
    fp8 = pools["fp8"].index_pools[4]
    assert fp8.get_bytes_per_token() == FP8_ROW_BYTES
    # Same page count as the c4 KV pool of the same ratio (PD registers both by page).
    kv_pages = pools["fp8"].kv_pools[4].kv_buffer[0].shape[0]
    assert {tuple(rows.shape) for rows in fp8.index_k_with_scale_buffer} == {
        (kv_pages, fp8.page_size * FP8_ROW_BYTES)
    }
    with pytest.raises(ValueError, match="stores fp8 index keys, not bf16"):
        pools["fp8"].get_index_k_bf16_buffer(c4_layer_ids(pools["fp8"])[0])


def bf16_keys(n: int, seed: int) -> torch.Tensor:
    """Random bf16 keys with outliers, signed zeros, infinities and a NaN: every bit must survive."""
    gen = torch.Generator().manual_seed(seed)
    keys = (torch.randn(n, INDEX_HEAD_DIM, generator=gen) * 3).to(torch.bfloat16)
    keys[0, :4] = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan")])
    keys[1, 5] = 3.0e38
    return keys


def test_bf16_keys_round_trip_bit_exact(pools):
    pool = pools["bf16"]
    layer_a, layer_b = c4_layer_ids(pool)[:2]
    indexer = pool.index_pools[4]
    slots_total = indexer.index_k_with_scale_buffer[0].shape[0] * indexer.page_size
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(slots_total, generator=gen)[:300]  # across pages, out of order
    keys = bf16_keys(len(slots), seed=2)
    pool.set_index_k_bf16(layer_a, slots.to(torch.int32), keys)

    read = pool.get_index_k_bf16(layer_a, slots)
    assert torch.equal(read.view(torch.int16), keys.view(torch.int16))
    # The kernel's view: slot s is token s % page_size of page s // page_size.
    view = pool.get_index_k_bf16_buffer(layer_a)
    assert view.shape == (slots_total // indexer.page_size, indexer.page_size, 1, INDEX_HEAD_DIM)
    by_page = view[slots // indexer.page_size, slots % indexer.page_size, 0]
    assert torch.equal(by_page.view(torch.int16), keys.view(torch.int16))
    # Nothing else written: other slots of the layer, and the other layer, stay zero.
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slots] = False
    assert not view.view(-1, INDEX_HEAD_DIM)[untouched].view(torch.int16).any()
    assert not pool.get_index_k_bf16_buffer(layer_b).view(torch.int16).any()


def test_bf16_setter_refuses_other_dtypes(pools):
    pool = pools["bf16"]
    layer = c4_layer_ids(pool)[0]
    with pytest.raises(ValueError, match="bfloat16"):
        pool.set_index_k_bf16(layer, torch.arange(2), torch.zeros(2, INDEX_HEAD_DIM))
    assert pool.index_k_dtype_of(layer) == "bf16"


def test_low_ratio_pools_stay_fp4_under_bf16():
    # Upstream builds the ratio-1/2 index pools with use_fp4_indexer=True whatever c4 uses.
    with index_k_dtype_in_force("bf16"):
        pool = DeepSeekV4IndexerPool(
            size=256,
            page_size=64,
            dtype=torch.float8_e4m3fn,
            index_head_dim=INDEX_HEAD_DIM,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
            use_fp4_indexer=True,
        )
    assert pool.index_k_dtype == "fp4"
    assert pool.get_bytes_per_token() == INDEX_HEAD_DIM // 2 + INDEX_HEAD_DIM // 32
