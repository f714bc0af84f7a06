"""bf16 paged MQA logits for the DeepSeek-V4 c4 lightning indexer.

For each query row b and cached key position t (t < max_seq_len):

    logits[b, t] = sum_h weights[b, h] * relu(q[b, 0, h, :] . k[t, :])     if t < seq_lens[b]
    logits[b, t] = -inf                                                    otherwise

where k[t] is slot t % 64 of page page_table[b, t // 64] of `kv_cache`. A position whose page-table
entry is negative (unused, -1) or lies past the page table's width is -inf too. -inf is what
upstream's sm_120 fp8 path (`fp8_paged_mqa_logits_torch_sm120`) leaves beyond the sequence, so
the top-k step after it never selects those positions and nothing downstream changes.

Shapes and dtypes (the c4 indexer of DeepSeek-V4: 64 heads, head_dim 128, pages of 64 keys):

    q           bf16     [B, 1, H, 128]
    kv_cache    bf16     [num_pages, 64, 1, 128]  (a view of the index-K pool's bytes)
    weights     float32  [B, H]                   (already scaled; no per-key or per-query scale)
    seq_lens    int32    [B] (or [B, 1])
    page_table  int32    [B, max_pages], -1 for unused entries
    returns     float32  [B, max_seq_len]

Both implementations take the same arguments. `bf16_paged_mqa_logits` picks the Triton kernel on
CUDA and the torch path elsewhere.
"""

from __future__ import annotations

import torch

PAGE_TOKENS = 64
HEAD_DIM = 128

# Bytes of fp32 intermediates (keys upcast to fp32 plus per-head scores) the torch path keeps
# alive per step; bounds its memory whatever the batch and context.
_TORCH_STEP_BYTES = 128 << 20


class IndexLogitsInputError(ValueError):
    """The arguments do not have the shapes, dtypes or devices the kernel contract states."""


def _fail(message: str):
    raise IndexLogitsInputError(f"bf16_paged_mqa_logits: {message}")


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} on {t.device}"


def check_inputs(q, kv_cache, weights, seq_lens, page_table, max_seq_len) -> torch.Tensor:
    """Validate the arguments (shapes and dtypes only: no device sync); returns seq_lens as [B]."""
    if q.dtype != torch.bfloat16 or q.dim() != 4 or q.shape[1] != 1 or q.shape[3] != HEAD_DIM:
        _fail(f"q must be bfloat16 [B, 1, H, {HEAD_DIM}], got {_describe(q)}")
    if q.stride(3) != 1:
        _fail(f"q must be dense along head_dim, strides {q.stride()}")
    batch, _, heads, _ = q.shape
    if kv_cache.dtype != torch.bfloat16 or tuple(kv_cache.shape[1:]) != (PAGE_TOKENS, 1, HEAD_DIM):
        _fail(
            f"kv_cache must be bfloat16 [num_pages, {PAGE_TOKENS}, 1, {HEAD_DIM}], "
            f"got {_describe(kv_cache)}"
        )
    if kv_cache.stride(3) != 1 or kv_cache.stride(1) != HEAD_DIM:
        _fail(f"kv_cache keys must be dense rows of {HEAD_DIM} inside a page, strides {kv_cache.stride()}")
    if weights.dtype != torch.float32 or tuple(weights.shape) != (batch, heads):
        _fail(f"weights must be float32 [{batch}, {heads}], got {_describe(weights)}")
    if seq_lens.dim() == 2 and seq_lens.shape[1] == 1:
        seq_lens = seq_lens[:, 0]
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (batch,):
        _fail(f"seq_lens must be int32 [{batch}], got {_describe(seq_lens)}")
    if page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.shape[0] != batch:
        _fail(f"page_table must be int32 [{batch}, max_pages], got {_describe(page_table)}")
    if not isinstance(max_seq_len, int) or max_seq_len < 0:
        _fail(f"max_seq_len must be a non-negative int, got {max_seq_len!r}")
    devices = {t.device for t in (q, kv_cache, weights, seq_lens, page_table)}
    if len(devices) != 1:
        _fail(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return seq_lens


def _pages_per_step(batch: int, heads: int, pages: int) -> int:
    per_page = batch * PAGE_TOKENS * (HEAD_DIM + heads) * 4
    return max(1, min(pages, _TORCH_STEP_BYTES // per_page))


def bf16_paged_mqa_logits_torch(q, kv_cache, weights, seq_lens, page_table, max_seq_len):
    """Torch path (any device). CUDA-graph safe: no host sync, every shape follows from the
    arguments' shapes, never from their values. Accumulates in fp32."""
    seq_lens = check_inputs(q, kv_cache, weights, seq_lens, page_table, max_seq_len)
    batch, _, heads, _ = q.shape
    logits = torch.full((batch, max_seq_len), float("-inf"), dtype=torch.float32, device=q.device)
    pages = min(page_table.shape[1], -(-max_seq_len // PAGE_TOKENS))
    if batch == 0 or pages == 0:
        return logits

    keys_by_page = kv_cache[:, :, 0, :]  # [num_pages, 64, 128]
    query = q[:, 0].float().transpose(1, 2)  # [B, 128, H]
    head_weights = weights.unsqueeze(1)  # [B, 1, H]
    lengths = seq_lens.unsqueeze(1)
    step = _pages_per_step(batch, heads, pages)
    offsets = torch.arange(step * PAGE_TOKENS, device=q.device, dtype=torch.int32)

    for first in range(0, pages, step):
        last = min(first + step, pages)
        table = page_table[:, first:last]
        keys = keys_by_page[table.clamp(min=0).long()].reshape(batch, -1, HEAD_DIM).float()
        scores = torch.bmm(keys, query).relu_()  # [B, tokens, H]
        chunk = (scores * head_weights).sum(dim=2)  # [B, tokens]
        positions = first * PAGE_TOKENS + offsets[: chunk.shape[1]]
        valid = (positions.unsqueeze(0) < lengths) & (table >= 0).repeat_interleave(PAGE_TOKENS, 1)
        chunk = chunk.masked_fill(~valid, float("-inf"))
        start = first * PAGE_TOKENS
        end = min(last * PAGE_TOKENS, max_seq_len)
        logits[:, start:end] = chunk[:, : end - start]
    return logits


def bf16_paged_mqa_logits_triton(q, kv_cache, weights, seq_lens, page_table, max_seq_len):
    """Triton kernel written for sm_120 (mma.sync through `tl.dot`, no wgmma/TMA, under 100 KB of
    shared memory per program). Same contract as the torch path."""
    seq_lens = check_inputs(q, kv_cache, weights, seq_lens, page_table, max_seq_len)
    # Imported here so that importing this package never imports Triton, and so that
    # TRITON_INTERPRET set before the first call is honoured.
    from sgl_kernel_dsv4.index_logits_triton import launch

    return launch(q, kv_cache, weights, seq_lens, page_table, max_seq_len)


def bf16_paged_mqa_logits(q, kv_cache, weights, seq_lens, page_table, max_seq_len):
    """The kernel to use: Triton on CUDA, the torch path elsewhere."""
    if q.is_cuda:
        return bf16_paged_mqa_logits_triton(q, kv_cache, weights, seq_lens, page_table, max_seq_len)
    return bf16_paged_mqa_logits_torch(q, kv_cache, weights, seq_lens, page_table, max_seq_len)
