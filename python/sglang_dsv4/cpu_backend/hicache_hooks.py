"""The CPU backend's HiCache: a `--device cpu` server with `--enable-hierarchical-cache` keeps its
host mirror in plain host memory and moves pages between the pools with torch copies.

Upstream 0.5.23 cannot build or use a host pool without a GPU: `alloc_with_host_register`
(sglang/srt/mem_cache/pool_host/common.py) pins every host buffer with cudaHostRegister, and
memory_pool_host.py imports its page movers (`transfer_kv_*`) from sgl_kernel.kvcacheio on CUDA
and ROCm only, so on a CPU the first backup is a NameError. Here the allocation skips the
registration (there is no driver, and a CPU server's "device" pool is host memory already), and
the seven movers the DeepSeek-V4 host pools call are added to memory_pool_host as torch copies,
each written from the sgl-kernel op it stands for (sgl-kernel/csrc/kvcacheio/transfer.cu). They
move the same bytes to the same places: `item_size` bytes per index, per layer, with the page-
first host layout (`[page][layer][item]`) addressed as the kernels address it. Upstream also keeps
10 GiB of host memory back from every host pool (HICACHE_HOST_MEMORY_RESERVE_BYTES), sized for a
GPU server; a CPU server's KV pools and model already live in host memory, and on a 24 GiB
development machine running a few servers that reserve left less than nothing for a pool of a
few MiB. The CPU backend keeps CPU_RESERVE_BYTES back instead.

Only page-granular moves are covered: the token-granular DeepSeek-V4 C4 copy
(`transfer_cache_dsv4_mla`) stays upstream's, and the host-mirror-geometry fix refuses it for
bf16 index rows anyway.
"""

from __future__ import annotations

import ctypes

import torch
from sglang.srt.mem_cache.pool_host import base

from sglang_dsv4.fix import Add, Fix, Replace

ID = "cpu-backend-hicache"
_BASE = "sglang.srt.mem_cache.pool_host.base"
_COMMON = "sglang.srt.mem_cache.pool_host.common"
_HOST = "sglang.srt.mem_cache.memory_pool_host"
UPSTREAM_MODULES = (_BASE, _COMMON, _HOST)
CPU_RESERVE_BYTES = 1 << 30

# Upstream's function, kept before the hook replaces it (in a dict: upstream's HookRegistry
# rebinds module attributes that still name a replaced function).
_UPSTREAM = {"host_memory_budget_bytes": base.host_memory_budget_bytes}


def host_memory_budget_bytes(requested_bytes=0, *, auto_size=False):
    """Upstream's host budget for a HiCache pool, with CPU_RESERVE_BYTES kept back from the
    machine's free memory instead of upstream's 10 GiB. Inside upstream's booking scope no
    reserve is involved and upstream's answer stands."""
    budget = _UPSTREAM["host_memory_budget_bytes"](requested_bytes, auto_size=auto_size)
    if base._host_memory_budget.get() is not None:
        return budget
    returned = base.HICACHE_HOST_MEMORY_RESERVE_BYTES - CPU_RESERVE_BYTES
    return budget + max(returned, 0) // base.ranks_per_host()


def alloc_with_host_register(dims, dtype, device, pin_memory, allocator,
                             registration_granularity_bytes=None):
    """Upstream's host-pool allocation without cudaHostRegister (no driver to register with)."""
    return allocator.allocate(dims, dtype=dtype, device=device)


# --- the movers -------------------------------------------------------------------------------


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as bytes, a view: a copy would take the writes meant for the pool."""
    if not tensor.is_contiguous():
        raise ValueError(f"transfer: a pool buffer of shape {tuple(tensor.shape)} is not contiguous")
    return tensor.view(torch.uint8)


def _byte_rows(tensor: torch.Tensor, item_size: int) -> torch.Tensor:
    """`tensor`'s bytes as rows of `item_size` (a view: writes land in `tensor`)."""
    flat = _bytes(tensor).reshape(-1)
    return flat[: flat.numel() // item_size * item_size].view(-1, item_size)


def _rows_at(address: int, rows: int, item_size: int) -> torch.Tensor:
    """The `rows` x `item_size` bytes at `address`, as a writable view. The kernels take their
    layers as a table of raw pointers; on the CPU those are host addresses. As in the kernels,
    the indices are trusted to lie inside the buffer the pointer names."""
    if rows <= 0:
        return torch.empty((0, item_size), dtype=torch.uint8)
    buffer = (ctypes.c_uint8 * (rows * item_size)).from_address(int(address))
    return torch.frombuffer(buffer, dtype=torch.uint8).view(rows, item_size)


def _long(indices: torch.Tensor) -> torch.Tensor:
    return indices.to(device="cpu", dtype=torch.int64).reshape(-1)


def _copy_rows(src: torch.Tensor, dst: torch.Tensor, src_indices, dst_indices) -> None:
    """dst[dst_indices[i]] = src[src_indices[i]] for every i (rows of equal size)."""
    s, d = _long(src_indices), _long(dst_indices)
    if s.numel() != d.numel():
        raise ValueError(f"transfer: {s.numel()} source and {d.numel()} destination indices")
    if s.numel():
        dst.index_copy_(0, d, src.index_select(0, s))


def _table_rows(table: torch.Tensor, layer: int, indices: torch.Tensor, item_size: int):
    """The rows of layer `layer` of a pointer table, enough to reach every index."""
    return _rows_at(int(table[layer]), int(_long(indices).max()) + 1, item_size)


def transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size, block_quota=None,
                              num_warps_per_block=32):
    """sgl_kernel.kvcacheio.transfer_kv_per_layer_mla (transfer_kv_per_layer_mla in
    transfer.cu): one layer, `item_size` bytes per index, both sides layer-first."""
    _copy_rows(_byte_rows(src, item_size), _byte_rows(dst, item_size), src_indices, dst_indices)


def transfer_kv_all_layer_mla(src_layers, dst_layers, src_indices, dst_indices, item_size,
                              num_layers, block_quota=2, num_warps_per_block=32):
    """transfer_kv_all_layer_mla: every layer, both sides tables of per-layer pointers."""
    if not _long(src_indices).numel():
        return
    for layer in range(num_layers):
        _copy_rows(
            _table_rows(src_layers, layer, src_indices, item_size),
            _table_rows(dst_layers, layer, dst_indices, item_size),
            src_indices, dst_indices,
        )


def transfer_kv_all_layer_mla_lf_pf(src_layers, dst, src_indices, dst_indices, item_size,
                                    dst_layout_dim, num_layers, block_quota=2,
                                    num_warps_per_block=32):
    """transfer_kv_all_layer_mla_lf_pf: device layers (pointer table) into a page-first host
    buffer, where index i of layer l starts at byte i * dst_layout_dim + l * item_size."""
    if not _long(src_indices).numel():
        return
    host = _byte_rows(dst, dst_layout_dim)
    for layer in range(num_layers):
        columns = host[:, layer * item_size : (layer + 1) * item_size]
        _copy_rows(_table_rows(src_layers, layer, src_indices, item_size), columns,
                   src_indices, dst_indices)


def transfer_kv_per_layer_mla_pf_lf(src, dst, src_indices, dst_indices, layer_id, item_size,
                                    src_layout_dim, block_quota=None, num_warps_per_block=32):
    """transfer_kv_per_layer_mla_pf_lf: layer `layer_id` of a page-first host buffer into a
    layer-first device layer."""
    host = _byte_rows(src, src_layout_dim)[:, layer_id * item_size : (layer_id + 1) * item_size]
    _copy_rows(host, _byte_rows(dst, item_size), src_indices, dst_indices)


def _page_rows(tensor: torch.Tensor, page_size: int) -> torch.Tensor:
    """A layer's first dimension grouped `page_size` at a time, as bytes."""
    return _bytes(tensor).reshape(tensor.shape[0] // page_size, -1)


def _direct_pages(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """The direct ops take slot indices, `page_size` consecutive ones a page: the page numbers."""
    slots = _long(indices)
    return slots.reshape(-1, page_size)[:, 0] // page_size if page_size > 1 else slots


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    """transfer_kv_direct: for each layer pair, the pages at the given slots, copied whole."""
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"transfer_kv_direct: {len(src_layers)} vs {len(dst_layers)} layers")
    s, d = _direct_pages(src_indices, page_size), _direct_pages(dst_indices, page_size)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        _copy_rows(_page_rows(src, page_size), _page_rows(dst, page_size), s, d)


def _page_first(buffer: torch.Tensor) -> torch.Tensor:
    """A page-first-direct host buffer `[pages, layers, page_size, ...]` as `[pages, layers,
    bytes]` (a view)."""
    return _bytes(buffer).reshape(buffer.shape[0], buffer.shape[1], -1)


def transfer_kv_all_layer_direct_lf_pf(src_ptrs, dst_ptrs, src_indices, dst_indices, page_size):
    """transfer_kv_all_layer_direct_lf_pf: every device layer into the page-first-direct host
    buffer `dst_ptrs[0]`, a page at a time."""
    host = _page_first(dst_ptrs[0])
    s, d = _direct_pages(src_indices, page_size), _direct_pages(dst_indices, page_size)
    for layer, src in enumerate(src_ptrs):
        _copy_rows(_page_rows(src, page_size), host[:, layer], s, d)


def transfer_kv_per_layer_direct_pf_lf(src_ptrs, dst_ptrs, src_indices, dst_indices, layer_id,
                                       page_size):
    """transfer_kv_per_layer_direct_pf_lf: layer `layer_id` of the page-first-direct host buffer
    `src_ptrs[0]` into the device layer `dst_ptrs[0]`, a page at a time."""
    s, d = _direct_pages(src_indices, page_size), _direct_pages(dst_indices, page_size)
    _copy_rows(_page_first(src_ptrs[0])[:, layer_id], _page_rows(dst_ptrs[0], page_size), s, d)


MOVERS = (
    transfer_kv_per_layer_mla,
    transfer_kv_all_layer_mla,
    transfer_kv_all_layer_mla_lf_pf,
    transfer_kv_per_layer_mla_pf_lf,
    transfer_kv_direct,
    transfer_kv_all_layer_direct_lf_pf,
    transfer_kv_per_layer_direct_pf_lf,
)

FIX = Fix(
    id=ID,
    title="CPU backend: HiCache host pools without cudaHostRegister, pages moved by torch",
    area="cpu",
    why=(
        "Upstream pins host pools with cudaHostRegister and imports its page movers from "
        "sgl_kernel on CUDA and ROCm only: a --device cpu server cannot build or use HiCache."
    ),
    how=(
        "The allocation skips the registration; the seven transfer_kv_* movers the DeepSeek-V4 "
        "host pools call are added to memory_pool_host as torch copies of the same bytes; the "
        "host reserve is 1 GiB, not a GPU server's 10 GiB."
    ),
    upstream="not for upstream: development and tests only",
    remove_when="never: it is how HiCache runs without a GPU",
    targets=(
        f"{_BASE}.host_memory_budget_bytes",
        f"{_COMMON}.alloc_with_host_register",
        *(f"{_HOST}.{m.__name__}" for m in MOVERS),
    ),
    replaces=(
        Replace(
            f"{_BASE}.host_memory_budget_bytes",
            host_memory_budget_bytes,
            "(requested_bytes=0, *, auto_size=False)",
        ),
        Replace(
            f"{_COMMON}.alloc_with_host_register",
            alloc_with_host_register,
            "(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None)",
        ),
    ),
    adds=tuple(Add(owner=_HOST, func=m) for m in MOVERS),
)
