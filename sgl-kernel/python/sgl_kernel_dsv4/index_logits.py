"""bf16 paged MQA logits for the DeepSeek-V4 c4 lightning indexer.

For each query row b and cached key position t < min(seq_lens[b], max_seq_len):

    logits[b, t] = sum_h weights[b, h] * relu(q[b, 0, h, :] . k[t, :])

where k[t] is slot t % 64 of page page_table[b, t // 64] of `kv_cache`; a position whose page-table
entry is negative (unused, -1) or lies past the page table's width is -inf.

Positions t in [seq_lens[b], max_seq_len) are -inf, as upstream's own paths write them (its fp8
torch sm_120 path fills -inf): upstream's torch / flashinfer-unfused top-k masks positions past
seq_len for its selection but then gathers the unmasked scores, so a row with fewer finite scores
than the top-k width (page-table holes inside seq_len) would pass stale values past seq_len as
selected keys. The Triton kernel's work still follows the keys a row has: it visits no page past a
row's last one and fills the rest of the row with plain 4-byte stores, no loads.

Shapes and dtypes (the c4 indexer of DeepSeek-V4: 64 heads, head_dim 128, pages of 64 keys):

    q           bf16     [B, 1, H, 128]
    kv_cache    bf16     [num_pages, 64, 1, 128]  (a view of the index-K pool's bytes)
    weights     float32  [B, H]                   (already scaled; no per-key or per-query scale)
    seq_lens    int32    [B] (or [B, 1])
    page_table  int32    [B, max_pages], -1 for unused entries
    returns     float32  [B, max_seq_len]

Both implementations take the same arguments. `bf16_paged_mqa_logits` picks the Triton kernel on
CUDA and the torch path elsewhere. `indexer_rows_per_chunk` sizes row chunks of the bf16 indexer
(query, logits, top-k) so that its temporaries stay under a memory budget at any row count.
"""

from __future__ import annotations

import os

import torch

from sgl_kernel_dsv4.index_contract import (  # noqa: F401  (the contract, re-exported here)
    HEAD_DIM,
    PAGE_TOKENS,
    IndexLogitsInputError,
    check_logits_inputs,
)


def _page_step_bytes(heads: int) -> int:
    """Bytes the torch path's step keeps alive per query row and page: the gathered bf16 keys,
    their fp32 copy, the per-head scores and their weighted copy, the row's logits."""
    return PAGE_TOKENS * (HEAD_DIM * (2 + 4) + heads * 4 * 2 + 4 * 2)


def torch_step_bytes() -> int:
    """What the torch path's page steps may keep alive: a quarter of the indexer's budget."""
    return indexer_budget_bytes() // 4


def _pages_per_step(batch: int, heads: int, pages: int) -> int:
    return max(1, min(pages, torch_step_bytes() // (batch * _page_step_bytes(heads))))


def bf16_paged_mqa_logits_torch(q, kv_cache, weights, seq_lens, page_table, max_seq_len):
    """Torch path (any device). CUDA-graph safe: no host sync, every shape follows from the
    arguments' shapes, never from their values. Accumulates in fp32."""
    seq_lens = check_logits_inputs(q, kv_cache, weights, seq_lens, page_table, max_seq_len)
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
    shared memory per program). Same contract as the torch path; launch rule and config in
    `index_logits_triton`."""
    seq_lens = check_logits_inputs(q, kv_cache, weights, seq_lens, page_table, max_seq_len)
    # Imported here so that importing this package never imports Triton, and so that
    # TRITON_INTERPRET set before the first call is honoured.
    from sgl_kernel_dsv4.index_logits_triton import launch

    return launch(q, kv_cache, weights, seq_lens, page_table, max_seq_len)


def bf16_paged_mqa_logits(q, kv_cache, weights, seq_lens, page_table, max_seq_len):
    """The kernel to use: Triton on CUDA, the torch path elsewhere."""
    if q.is_cuda:
        return bf16_paged_mqa_logits_triton(q, kv_cache, weights, seq_lens, page_table, max_seq_len)
    return bf16_paged_mqa_logits_torch(q, kv_cache, weights, seq_lens, page_table, max_seq_len)


# --- memory of the bf16 indexer per row chunk -----------------------------------------------

INDEXER_BUDGET_ENV = "SGLANG_DSV4_INDEXER_BUDGET_MIB"
INDEXER_BUDGET_MIB = 512
# Per query row and logits column: the fp32 logits (4 B), the torch top-k step's masked fp32
# copy (4 B) and its position mask (1 B), rounded up.
LOGIT_BYTES_PER_COL = 12
# Per query row and query value (H x 128): the projection's bf16 output, the torch rotation's
# fp32 temporaries (at most four alive) and the bf16 result, rounded up.
QUERY_BYTES_PER_VALUE = 24


def indexer_budget_bytes() -> int:
    """The bf16 indexer's temporary-memory budget per rank: SGLANG_DSV4_INDEXER_BUDGET_MIB
    (default 512), read at each call."""
    value = os.environ.get(INDEXER_BUDGET_ENV, "").strip()
    if not value:
        return INDEXER_BUDGET_MIB << 20
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{INDEXER_BUDGET_ENV}={value!r} must be a positive number of MiB")
    return int(value) << 20


def indexer_rows_per_chunk(num_rows: int, num_cols: int, heads: int, budget_bytes=None) -> int:
    """Query rows the bf16 indexer handles at once so its temporaries fit `budget_bytes`
    (default: `indexer_budget_bytes()`); at least 1, at most num_rows. From shapes only.

    peak <= budget / 4 + rows * (12 * num_cols + 24 * heads * 128): the torch logits path's page
    steps keep at most a quarter of the budget (`torch_step_bytes`) once the rows fit one page
    step in it; the rest holds each row's logits, top-k and query temporaries.
    """
    budget = indexer_budget_bytes() if budget_bytes is None else budget_bytes
    per_row = LOGIT_BYTES_PER_COL * num_cols + QUERY_BYTES_PER_VALUE * heads * HEAD_DIM
    rows = (budget - budget // 4) // per_row
    # the torch path's smallest step (one page for every row) must fit its quarter
    rows = min(rows, (budget // 4) // _page_step_bytes(heads))
    return max(1, min(num_rows, rows))
