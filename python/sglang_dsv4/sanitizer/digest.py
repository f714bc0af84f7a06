"""Page digests and their PD wire format.

page_buffers(pool) names the buffers digested per page, page_checksums(pool, pages) digests them
where the pool lives, and encode_frames / decode_frames are the frames a sanitized prefill
appends to a room's Success status (after upstream's reason frame, which upstream's parser reads
as the last frame it knows: a decode without the sanitizer ignores them).
"""

from __future__ import annotations

import json
import weakref

import numpy as np
import torch

# Marks the digest frames a sanitized prefill appends to a room's KV_STATUS Success message.
PD_DIGEST_TAG = b"dsv4-sanitizer-page-digests/1"


def poison_buffers(kvcache) -> list[torch.Tensor]:
    """The c4 index-K and c4 KV buffers ([pages, bytes per page], paged by the full page id):
    what the ledger poisons on free and the read checks look at."""
    if kvcache is None:
        return []
    index_pool = getattr(kvcache, "index_pools", {}).get(4)
    kv_pool = getattr(kvcache, "kv_pools", {}).get(4)
    buffers = list(index_pool.index_k_with_scale_buffer) if index_pool is not None else []
    if kv_pool is not None:
        buffers += list(kv_pool.kv_buffer)
    return [b for b in buffers if b.dim() == 2 and b.dtype == torch.uint8]


def page_buffer_table(kvcache) -> list[tuple[str, int | None, torch.Tensor]]:
    """(name, model layer, buffer) for every buffer the PD transfer addresses by full page id,
    in upstream's wire order (DeepSeekV4TokenToKVPool.get_contiguous_buf_infos): per compress
    ratio, its KV buffers, then its indexer buffers. Each buffer is [pages, bytes per page]."""
    if kvcache is None or not hasattr(kvcache, "kv_pools"):
        return []
    table = []
    for ratio, kv_pool in kvcache.kv_pools.items():
        layers = layers_of_ratio(kvcache, ratio)
        if kv_pool is not None:
            for j, buf in enumerate(kv_pool.kv_buffer):
                table.append((f"c{ratio} kv", _nth(layers, j), buf))
        index_pool = kvcache.index_pools.get(ratio)
        if index_pool is not None:
            for j, buf in enumerate(index_pool.contiguous_page_row_buffers()):
                table.append((f"c{ratio} index-K", _nth(layers, j), buf))
    return [(n, layer, b) for n, layer, b in table if b.dim() == 2]


def page_buffers(kvcache) -> list[torch.Tensor]:
    """The buffers digested per full page for a PD transfer (page_buffer_table's order)."""
    return [buf for _, _, buf in page_buffer_table(kvcache)]


def _nth(items, j):
    return items[j] if j < len(items) else None


def layers_of_ratio(kvcache, ratio: int) -> list[int]:
    return [
        layer_id
        for layer_id, item in enumerate(getattr(kvcache, "layer_mapping", ()))
        if item is not None and item.compress_ratio == ratio
    ]


def c4_layers(kvcache) -> list[int]:
    return layers_of_ratio(kvcache, 4)


# The mixer's odd multipliers (splitmix64's), as signed 64-bit values (torch has no uint64).
_M1 = 0x9E3779B97F4A7C15 - (1 << 64)
_M2 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M3 = 0x94D049BB133111EB - (1 << 64)


def _lsr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch shifts signed values arithmetically)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def row_digests(rows: torch.Tensor) -> torch.Tensor:
    """int64 digest of each row of bytes ([rows, bytes], bytes a multiple of 4).

    Each 32-bit word w at index i becomes the 64-bit value (i << 32) | w, which goes through a
    bijective mixer (splitmix64's finalizer: multiply by an odd constant, xor-shift, twice), and
    the mixed words are summed mod 2^64. A change to any set of words moves the sum by the sum
    of pseudo-random 64-bit deltas, so it goes unseen only if those cancel mod 2^64 (about 2^-64
    for a change not built against the mixer). A linear digest (weighted sums of the words, as
    before) is defeated by +1 / -2 / +1 on three consecutive words: both sums stay put.
    """
    words = rows.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    index = torch.arange(words.shape[1], dtype=torch.int64, device=words.device)
    x = (words | (index << 32)) * _M1
    x = (x ^ _lsr(x, 30)) * _M2
    x = (x ^ _lsr(x, 27)) * _M3
    x = x ^ _lsr(x, 31)
    return x.sum(dim=1)


def page_checksums(pool, pages) -> torch.Tensor:
    """int64 digests [buffers, pages] of the full-page buffers (page_buffers order), computed
    where the pool lives; see row_digests for the construction."""
    buffers = page_buffers(pool)
    index = torch.as_tensor(pages).reshape(-1).to(torch.int64)
    out = torch.empty((len(buffers), len(index)), dtype=torch.int64)
    for i, buffer in enumerate(buffers):
        rows = buffer.index_select(0, index.to(buffer.device))
        out[i] = row_digests(rows.view(torch.uint8).reshape(len(index), -1)).cpu()
    return out


# --- state items (SWA and compress-state pools, request-scoped state) -----------------------------

STATE_TAG = b"dsv4-sanitizer-state-digests/1"
_STATE_LAYOUT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _state_tensors(pool) -> list[torch.Tensor]:
    tensors = list(getattr(getattr(pool, "swa_kv_pool", None), "kv_buffer", None) or [])
    for group in ("compress_state_pools", "indexer_compress_state_pools"):
        for state in getattr(pool, group, None) or []:
            score = getattr(getattr(state, "kv_score_buffer", None), "kv_score", None)
            if score is not None:
                tensors.append(score)
    return tensors


def state_layout(pool) -> list[list[torch.Tensor | None]]:
    """Per state component the PD transfer carries (upstream's setup_state_kv_args, in its
    order: SWA with the compress states, then request-scoped state), each buffer as [items,
    item bytes]; None for a buffer this pool's tensors do not account for."""
    layout = _STATE_LAYOUT.get(pool)
    if layout is not None:
        return layout
    from types import SimpleNamespace

    from sglang.srt.disaggregation.utils import setup_state_kv_args

    args = SimpleNamespace()
    setup_state_kv_args(args, pool)
    by_ptr = {t.data_ptr(): t for t in _state_tensors(pool) if t.is_contiguous()}
    layout = []
    for ptrs, lens, items in zip(
        args.state_data_ptrs, args.state_data_lens, args.state_item_lens, strict=False
    ):
        component = []
        for ptr, length, item in zip(ptrs, lens, items, strict=False):
            t = by_ptr.get(ptr)
            if t is None or t.nbytes != length or item <= 0 or item % 4 or length < item:
                component.append(None)
            else:  # a ring buffer may end in rows no whole item uses
                count = length // item
                flat = t.reshape(-1).view(torch.uint8)[: count * item]
                component.append(flat.reshape(count, item))
        layout.append(component)
    _STATE_LAYOUT[pool] = layout
    return layout


def state_checksums(pool, state_indices) -> list[torch.Tensor | None]:
    """int64 digests [buffers, items] per state component at the items `state_indices` names
    (one list per component, as a PD transfer's state_indices); None where none are named."""
    out = []
    for component, indices in zip(state_layout(pool), state_indices or (), strict=False):
        if indices is None or len(indices) == 0:
            out.append(None)
            continue
        index = torch.as_tensor(list(indices), dtype=torch.int64)
        digests = torch.zeros((len(component), len(index)), dtype=torch.int64)
        for i, rows in enumerate(component):
            if rows is not None:
                digests[i] = row_digests(rows.index_select(0, index.to(rows.device))).cpu()
        out.append(digests)
    return out


def encode_state_frames(digests: list[torch.Tensor | None]) -> list[bytes]:
    shapes = [None if d is None else list(d.shape) for d in digests]
    flat = [d.reshape(-1) for d in digests if d is not None]
    data = torch.cat(flat).numpy().astype("<i8").tobytes() if flat else b""
    return [STATE_TAG, json.dumps(shapes).encode("ascii"), data]


def decode_state_frames(frames: list[bytes]) -> list[torch.Tensor | None]:
    shapes = json.loads(frames[1].decode("ascii"))
    values = torch.from_numpy(np.frombuffer(frames[2], dtype="<i8").copy())
    out, at = [], 0
    for shape in shapes:
        if shape is None:
            out.append(None)
            continue
        n = shape[0] * shape[1]
        out.append(values[at : at + n].reshape(shape))
        at += n
    if at != len(values):
        raise ValueError(f"{len(values)} state digests for {at} named")
    return out


def encode_frames(chunks: dict[int, torch.Tensor]) -> list[bytes]:
    """The frames for a room's digests, keyed by the start of each chunk in the room's page list:
    tag, "buffers,pages", int32 positions, int64 digests [buffers, pages]."""
    starts = sorted(chunks)
    digests = torch.cat([chunks[s] for s in starts], dim=1)
    positions = np.concatenate(
        [np.arange(s, s + chunks[s].shape[1], dtype=np.int32) for s in starts]
    )
    return [
        PD_DIGEST_TAG,
        f"{digests.shape[0]},{digests.shape[1]}".encode("ascii"),
        positions.tobytes(),
        digests.numpy().astype("<i8").tobytes(),
    ]


def decode_frames(frames: list[bytes]) -> tuple[int, np.ndarray, torch.Tensor]:
    """(buffers, positions, digests [buffers, pages]) from the frames (PD_DIGEST_TAG first);
    IndexError or ValueError when they are not readable."""
    buffers, count = (int(x) for x in frames[1].decode("ascii").split(","))
    positions = np.frombuffer(frames[2], dtype=np.int32).astype(np.int64)
    digests = torch.from_numpy(np.frombuffer(frames[3], dtype="<i8").reshape(buffers, count).copy())
    if len(positions) != count:
        raise ValueError(f"{len(positions)} positions for {count} digests")
    return buffers, positions, digests
