"""Triton kernel behind `bf16_paged_mqa_logits_triton` (contract: see `index_logits`).

Written for sm_120 (RTX PRO 6000): one program scores whole 64-key pages of one query row with
`tl.dot` (bf16 x bf16 -> fp32 on mma.sync; sm_120 has no wgmma or TMA). Per program the query
[128, H] and one page of keys [64, 128] are 16 KB each in bf16, so two pipeline stages stay far
below the ~100 KB of shared memory an sm_120 SM has. Launch shapes follow from the arguments'
shapes only, so the launch is CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from sgl_kernel_dsv4.index_logits import HEAD_DIM, PAGE_TOKENS

MAX_HEADS = 128


@triton.jit
def _bf16_paged_mqa_logits_kernel(
    q_ptr,
    kv_ptr,
    weights_ptr,
    seq_lens_ptr,
    page_table_ptr,
    out_ptr,
    q_row_stride,
    q_head_stride,
    kv_page_stride,
    kv_token_stride,
    weights_row_stride,
    weights_head_stride,
    seq_lens_stride,
    page_table_row_stride,
    page_table_col_stride,
    out_row_stride,
    num_heads,
    table_cols,
    max_seq_len,
    PAGE: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGES_PER_PROGRAM: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    first_page = tl.program_id(1) * PAGES_PER_PROGRAM
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, DIM)
    slots = tl.arange(0, PAGE)
    head_ok = heads < num_heads

    # The query is loaded transposed, [DIM, BLOCK_H], so one dot gives [PAGE, BLOCK_H] scores;
    # padded heads are zero and carry zero weight.
    query = tl.load(
        q_ptr + row * q_row_stride + heads[None, :] * q_head_stride + dims[:, None],
        mask=head_ok[None, :],
        other=0.0,
    )
    head_weights = tl.load(
        weights_ptr + row * weights_row_stride + heads * weights_head_stride, mask=head_ok, other=0.0
    )
    seq_len = tl.load(seq_lens_ptr + row * seq_lens_stride)

    for i in tl.static_range(PAGES_PER_PROGRAM):
        col = first_page + i
        positions = col * PAGE + slots
        page = tl.load(
            page_table_ptr + row * page_table_row_stride + col * page_table_col_stride,
            mask=col < table_cols,
            other=-1,
        )
        valid = (positions < seq_len) & (page >= 0)
        # Masked-off keys are never read from memory: pages past the sequence cost nothing.
        keys = tl.load(
            kv_ptr + page.to(tl.int64) * kv_page_stride + slots[:, None] * kv_token_stride + dims[None, :],
            mask=valid[:, None],
            other=0.0,
        )
        if DOT_IN_FP32:
            # Only under TRITON_INTERPRET: the interpreter keeps bf16 as raw uint16 and its tl.dot
            # multiplies those bits (triton-lang/triton#11584). bf16 values are exact in fp32.
            scores = tl.dot(keys.to(tl.float32), query.to(tl.float32))
        else:
            scores = tl.dot(keys, query)
        logits = tl.sum(tl.maximum(scores, 0.0) * head_weights[None, :], axis=1)
        logits = tl.where(valid, logits, float("-inf"))
        tl.store(out_ptr + row * out_row_stride + positions, logits, mask=positions < max_seq_len)


def choose_pages_per_program(batch: int, pages: int) -> int:
    """More pages per program amortize the query load once there are enough programs to fill
    the GPU (RTX PRO 6000: 188 SMs); few rows with long contexts keep one page each."""
    programs = batch * pages
    if programs >= 64 * 188:
        return 4
    if programs >= 8 * 188:
        return 2
    return 1


def launch(q, kv_cache, weights, seq_lens, page_table, max_seq_len, pages_per_program=None):
    """Run the kernel on arguments `bf16_paged_mqa_logits_triton` has checked (seq_lens [B]).
    `pages_per_program` overrides the heuristic (tests, tuning)."""
    batch, _, heads, _ = q.shape
    if heads > MAX_HEADS:
        raise ValueError(
            f"bf16_paged_mqa_logits_triton: at most {MAX_HEADS} heads per query, got {heads}"
        )
    logits = torch.empty((batch, max_seq_len), dtype=torch.float32, device=q.device)
    pages = triton.cdiv(max_seq_len, PAGE_TOKENS)
    if batch == 0 or pages == 0:
        return logits
    per_program = pages_per_program or choose_pages_per_program(batch, pages)
    grid = (batch, triton.cdiv(pages, per_program))
    _bf16_paged_mqa_logits_kernel[grid](
        q,
        kv_cache,
        weights,
        seq_lens,
        page_table,
        logits,
        q.stride(0),
        q.stride(2),
        kv_cache.stride(0),
        kv_cache.stride(1),
        weights.stride(0),
        weights.stride(1),
        seq_lens.stride(0),
        page_table.stride(0),
        page_table.stride(1),
        logits.stride(0),
        heads,
        page_table.shape[1],
        max_seq_len,
        PAGE=PAGE_TOKENS,
        DIM=HEAD_DIM,
        BLOCK_H=max(16, triton.next_power_of_2(heads)),
        PAGES_PER_PROGRAM=per_program,
        DOT_IN_FP32=isinstance(_bf16_paged_mqa_logits_kernel, InterpretedFunction),
        num_warps=4,
        num_stages=2,
    )
    return logits
