"""V4 FlashMLA page caches for the CPU sparse-attention tests, written by the CPU backend's own
store (`ops.store_v4_rows`): the byte layout upstream's sm_120 torch path reads."""

from __future__ import annotations

import torch
from sglang_dsv4.cpu_backend import ops


def v4_cache(pages, page_size, rows, seed):
    """A V4 page cache holding `rows` random rows at slots 0.., in upstream's 4-d fp8 view."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.zeros(pages, ops.v4_page_bytes(page_size), dtype=torch.uint8)
    kv = torch.randn(rows, 512, generator=gen) * 2
    values, exponent = ops.quantize_tiles_ue8m0(kv[:, :448], 64)
    ops.store_v4_rows(cache, torch.arange(rows), values, exponent, kv[:, 448:].bfloat16(),
                      page_size)
    return cache.view(torch.float8_e4m3fn).as_strided(
        (pages, page_size, 1, 576), (cache.stride(0), 576, 576, 1))
