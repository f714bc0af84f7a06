"""HiCache's host mirror of the c4 index-K pages keeps the device row geometry (host-mirror-geometry).

Real upstream code: the DeepSeek-V4 pools (device="cpu", built by upstream's sizing chain),
hybrid_pool_assembler._dsv4_indexer_regions, and DeepSeekV4PagedHostPool built from a region
exactly as the HiCache stack builds it, with pinned memory off.

Stand-ins, and why: the host pool's page copy and token-granular copy are sgl_kernel / JIT CUDA
ops this machine cannot load. `row_copy` stands in for sgl_kernel's transfer_kv_direct (per layer,
row dst_indices[i] <- row src_indices[i]); `Recorder` replaces transfer_cache_dsv4_mla to show
whether a transfer reached it. The FP4-split and NPU pools exist only on ROCm / Ascend; for those
layouts small objects carry buffers of their shapes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache import memory_pool_host
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _dsv4_indexer_regions
from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from support.dsv4 import small_pool

PAGE = 256  # tokens per page; a c4 index page holds PAGE // 4 = 64 slots
NUM_HOST_PAGES = 4


@pytest.fixture(scope="module")
def pools():
    return {dtype: small_pool(dtype)[1] for dtype in ("fp8", "bf16")}


def host_pool(region) -> DeepSeekV4PagedHostPool:
    # The arguments hybrid_pool_assembler passes for an indexer region, on the CPU. The pool is
    # booked against upstream's own budget scope (a fixed 1 GiB; it needs a few KiB): outside
    # one, upstream checks the machine's free memory less a 10 GiB reserve, which a busy 24 GiB
    # machine (servers of the end-to-end suite alive) does not always have.
    with host_memory_budget_scope(1 << 30):
        return _host_pool(region)


def _host_pool(region) -> DeepSeekV4PagedHostPool:
    return DeepSeekV4PagedHostPool(
        pool_name=str(region.name),
        device_buffers=region.device_buffers,
        item_bytes=region.item_bytes,
        num_host_pages=NUM_HOST_PAGES,
        slot_page_size=region.slot_page_size,
        layout="layer_first",
        device="cpu",
        pin_memory=False,
        page_aligned_only=region.page_aligned_only,
    )


def row_copy(src_layers, dst_layers, src_indices, dst_indices, page_size):
    assert page_size == 1
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices] = src[src_indices]


class Recorder:
    def __init__(self):
        self.calls = 0

    def __call__(self, **kwargs):
        self.calls += 1


@pytest.mark.parametrize(
    "dtype, row_bytes, whole_pages",
    [
        ("bf16", 64 * 256, True),  # bf16: 256 B per slot, no scale
        ("fp8", 64 * 132, True),  # upstream's fused fp8 row: 64 x 128 B keys, then 64 x 4 B scales
    ],
)
def test_regions_take_row_bytes_from_the_live_buffers(pools, dtype, row_bytes, whole_pages):
    pool = pools[dtype]
    (region,) = _dsv4_indexer_regions(pool, PAGE)
    live = pool.c4_indexer_kv_pool.contiguous_page_row_buffers()
    assert region.name == PoolName.DEEPSEEK_V4_C4_INDEXER
    assert [b.data_ptr() for b in region.device_buffers] == [b.data_ptr() for b in live]
    assert region.item_bytes == live[0][0].numel() * live[0].element_size() == row_bytes
    assert region.slot_page_size == PAGE
    assert region.page_aligned_only is whole_pages

    mirror = host_pool(region)
    assert [tuple(b.shape) for b in mirror.kv_buffer] == [(NUM_HOST_PAGES, row_bytes)] * len(live)
    assert mirror.get_size_per_token() == row_bytes


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_pages_round_trip_device_host_device_byte_exact(pools, monkeypatch, dtype):
    monkeypatch.setattr(memory_pool_host, "transfer_kv_direct", row_copy, raising=False)
    device_pool = pools[dtype].c4_indexer_kv_pool
    (region,) = _dsv4_indexer_regions(pools[dtype], PAGE)
    mirror = host_pool(region)
    layers = region.device_buffers
    generator = torch.Generator().manual_seed(5)
    for rows in layers:
        rows.copy_(torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=generator))
    before = [rows.clone() for rows in layers]

    device_indices = torch.arange(2 * PAGE, 4 * PAGE)  # device pages 2 and 3
    host_indices = mirror.alloc(2 * PAGE)
    mirror.backup_from_device_all_layer(device_pool, host_indices, device_indices, "direct")
    for rows in layers:
        rows[2:4].zero_()
    for layer in range(len(layers)):
        mirror.load_to_device_per_layer(device_pool, host_indices, device_indices, layer, "direct")

    for rows, original in zip(layers, before, strict=True):
        assert torch.equal(rows, original)
    if dtype != "bf16":
        return
    # The keys read back through index-k-bf16's reader are the ones written.
    keys = device_pool.get_index_k_bf16(0, torch.arange(2 * 64, 4 * 64))
    assert torch.equal(keys.view(torch.uint8).flatten(), before[0][2:4].flatten())


@pytest.mark.parametrize("dtype, row_bytes", [("bf16", 64 * 256), ("fp8", 64 * 132)])
def test_index_rows_never_reach_the_token_granular_copy(pools, monkeypatch, dtype, row_bytes):
    """transfer_cache_dsv4_mla's constants (584-B tokens, 37,440-B pages) fit neither index row,
    so a transfer that does not end on a page boundary stops, and nothing moves."""
    copy = Recorder()
    monkeypatch.setattr(memory_pool_host, "transfer_cache_dsv4_mla", copy)
    monkeypatch.setattr(memory_pool_host, "transfer_kv_direct", row_copy, raising=False)
    device_pool = pools[dtype].c4_indexer_kv_pool
    (region,) = _dsv4_indexer_regions(pools[dtype], PAGE)
    mirror = host_pool(region)
    layers = region.device_buffers
    generator = torch.Generator().manual_seed(7)
    for rows in layers:
        rows.copy_(torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=generator))
    device_before = [rows.clone() for rows in layers]
    host_before = [rows.clone() for rows in mirror.kv_buffer]
    # One and a half pages: tokens 256..639, a boundary inside device page 2.
    device_indices = torch.arange(PAGE, PAGE + PAGE * 3 // 2)
    host_indices = mirror.alloc(device_indices.numel())[: device_indices.numel()]

    with pytest.raises(ValueError) as backup:
        mirror.backup_from_device_all_layer(device_pool, host_indices, device_indices, "direct")
    with pytest.raises(ValueError) as load:
        mirror.load_to_device_per_layer(device_pool, host_indices, device_indices, 0, "direct")
    with pytest.raises(ValueError):
        mirror.backup_tokens_from_device_all_layer(host_indices, device_indices)
    assert copy.calls == 0
    assert all(torch.equal(r, b) for r, b in zip(layers, device_before, strict=True))
    assert all(torch.equal(r, b) for r, b in zip(mirror.kv_buffer, host_before, strict=True))
    for error in (backup.value, load.value):
        message = str(error)
        assert "token-granular" in message and f"{row_bytes} B per page" in message
        assert "transfer_cache_dsv4_mla" in message and "584-B" in message
        assert "37,440-B pages" in message


def test_split_fp4_and_npu_layouts_keep_their_regions():
    # ROCm fp4: payload [pages, 1, 4, slots, 16] fp4x2 bytes, scales [pages, 1, 4, slots].
    payload = [torch.zeros(3, 1, 4, 64, 16, dtype=torch.uint8) for _ in range(2)]
    scale = [torch.zeros(3, 1, 4, 64, dtype=torch.uint8) for _ in range(2)]
    split = SimpleNamespace(
        uses_aiter_fp4_layout=True,
        index_k_with_scale_buffer=None,
        index_k_payload_buffer=payload,
        index_k_scale_buffer=scale,
    )
    regions = _dsv4_indexer_regions(SimpleNamespace(c4_indexer_kv_pool=split), PAGE)
    assert [(r.name, r.item_bytes, r.page_aligned_only) for r in regions] == [
        (PoolName.DEEPSEEK_V4_C4_INDEXER, 4 * 64 * 16, True),
        (PoolName.DEEPSEEK_V4_C4_INDEXER_SCALE, 4 * 64, True),
    ]
    assert regions[0].device_buffers[1].data_ptr() == payload[1].data_ptr()

    split.index_k_scale_buffer = [torch.zeros(3, 1, 4, 32, dtype=torch.uint8)] * 2
    with pytest.raises(ValueError, match="slots per page"):
        _dsv4_indexer_regions(SimpleNamespace(c4_indexer_kv_pool=split), PAGE)

    # Ascend: int8 K and fp16 scale in separate PA_ND buffers, token-granular capable.
    k = [torch.zeros(3, 64, 1, 128, dtype=torch.int8)]
    s = [torch.zeros(3, 64, 1, 1, dtype=torch.float16)]
    npu = SimpleNamespace(has_npu_storage=True, index_k_buffer=k, index_scale_buffer=s)
    regions = _dsv4_indexer_regions(SimpleNamespace(c4_indexer_kv_pool=npu), PAGE)
    assert [(r.name, r.item_bytes, r.page_aligned_only) for r in regions] == [
        (PoolName.DEEPSEEK_V4_C4_INDEXER, 64 * 128, False),
        (PoolName.DEEPSEEK_V4_C4_INDEXER_SCALE, 64 * 2, False),
    ]
