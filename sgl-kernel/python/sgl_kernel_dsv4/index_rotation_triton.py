"""Fused Triton kernels for the bf16 indexer's query and key write (torch reference and
contracts: `index_rotation`, `index_contract`). One launch each, where the torch path runs about 30 (query) and 41
(key write) small kernels.

- `index_query_bf16_triton(q, freqs_cis, positions)`: one program per token, all heads: RoPE on
  the tail at the token's position, Hadamard rotation, bf16 out.
- `store_index_keys_bf16_triton(pool_rows, kv, norm_weight, eps, freqs_cis, plan_rows, out_loc,
  compress_ratio, is_decode)`: one program per block of compressed rows: reads the plan, skips
  rows that complete no compressed token (no load, no store), RMSNorm with the weight, RoPE at
  seq_len - ratio, Hadamard rotation, bf16 store into the pool slots.

Both work in fp32 and round once to bf16. The Hadamard rotation is a dot with the Sylvester
matrix, built in registers from the parity of (i & j) (see `_hadamard` for its precision); RoPE
pairs each value with its neighbour (d ^ 1), read a second time from memory rather than shuffled
in registers. ROUND_BY_HAND marks a run under TRITON_INTERPRET (see `_to_bf16`, `_hadamard`). Launch
shapes follow from argument shapes only (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from sgl_kernel_dsv4.index_contract import check_store_inputs, freqs_table, rotation_dims

KEY_ROWS_PER_PROGRAM = 16


@triton.jit
def _hadamard(x, DIM: tl.constexpr, LOG_DIM: tl.constexpr, INTERPRETED: tl.constexpr):
    """x [R, DIM] fp32 @ Sylvester Hadamard / sqrt(DIM), in fp32.

    On a GPU the +-1 matrix is bf16 (exact) and x goes in as two bf16 parts, x = hi + lo, each
    multiplied on the tensor cores with fp32 accumulation: the product is exact to about 2^-17
    of |x|, far below the bf16 rounding of the result, and the operands take 32 + 16 KB of
    shared memory where an fp32 matrix alone would take 64 KB (sm_120 has about 100 KB).
    Under the interpreter (whose bf16 dot multiplies raw bits) it is one fp32 dot.
    """
    i = tl.arange(0, DIM)[:, None]
    j = tl.arange(0, DIM)[None, :]
    bits = i & j
    parity = tl.zeros((DIM, DIM), dtype=tl.int32)
    for b in tl.static_range(LOG_DIM):
        parity = parity ^ ((bits >> b) & 1)
    signs = (1 - 2 * parity).to(tl.float32)
    if INTERPRETED:
        out = tl.dot(x, signs)
    else:
        signs = signs.to(tl.bfloat16)
        hi = x.to(tl.bfloat16)
        lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
        out = tl.dot(hi, signs)
        out = tl.dot(lo, signs, out)
    return out * (DIM**-0.5)


@triton.jit
def _to_bf16(x, ROUND_BY_HAND: tl.constexpr):
    """fp32 -> bf16, rounding to nearest even. ROUND_BY_HAND only under TRITON_INTERPRET, whose
    cast truncates where GPUs round: the rounding is done on the bits first, then the cast is exact."""
    if ROUND_BY_HAND:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _rope_tail(x, partner, dims, freqs_row_ptr, DIM: tl.constexpr, ROPE_DIM: tl.constexpr):
    """RoPE on the last ROPE_DIM values of x [R, DIM]: interleaved (real, imag) pairs, `partner`
    holds x[..., d ^ 1], freqs_row_ptr points at one position's [ROPE_DIM // 2, 2] fp32 table
    (a [R] block of pointers, or a scalar pointer shared by all rows)."""
    in_tail = dims >= DIM - ROPE_DIM
    pair = tl.where(in_tail, (dims - (DIM - ROPE_DIM)) // 2, 0)
    cos = tl.load(freqs_row_ptr + pair * 2, mask=in_tail, other=1.0)
    sin = tl.load(freqs_row_ptr + pair * 2 + 1, mask=in_tail, other=0.0)
    # even d: a c - b s; odd d: b c + a s (a, b the pair's real and imaginary parts)
    signed_sin = tl.where(dims % 2 == 0, -sin, sin)
    return x * cos + partner * signed_sin


@triton.jit
def _index_query_kernel(
    q_ptr,
    freqs_ptr,
    positions_ptr,
    out_ptr,
    q_token_stride,
    q_head_stride,
    out_token_stride,
    out_head_stride,
    freqs_pos_stride,
    num_heads,
    DIM: tl.constexpr,
    LOG_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROUND_BY_HAND: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, DIM)
    head_ok = (heads < num_heads)[:, None]
    base = q_ptr + token * q_token_stride + heads[:, None] * q_head_stride
    x = tl.load(base + dims[None, :], mask=head_ok, other=0.0).to(tl.float32)
    partner = tl.load(base + (dims ^ 1)[None, :], mask=head_ok, other=0.0).to(tl.float32)
    position = tl.load(positions_ptr + token).to(tl.int64)
    freqs_row = freqs_ptr + position * freqs_pos_stride
    x = _rope_tail(x, partner, dims[None, :], freqs_row, DIM, ROPE_DIM)
    out = _hadamard(x, DIM, LOG_DIM, ROUND_BY_HAND)
    tl.store(
        out_ptr + token * out_token_stride + heads[:, None] * out_head_stride + dims[None, :],
        _to_bf16(out, ROUND_BY_HAND),
        mask=head_ok,
    )


@triton.jit
def _store_index_keys_kernel(
    kv_ptr,
    weight_ptr,
    freqs_ptr,
    plan_ptr,
    out_loc_ptr,
    pool_ptr,
    num_rows,
    kv_row_stride,
    plan_row_stride,
    pool_row_stride,
    freqs_pos_stride,
    eps,
    compress_ratio,
    IS_DECODE: tl.constexpr,
    DIM: tl.constexpr,
    LOG_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    ROUND_BY_HAND: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    dims = tl.arange(0, DIM)
    in_range = rows < num_rows
    seq_len = tl.load(plan_ptr + rows * plan_row_stride, mask=in_range, other=-1)
    if IS_DECODE:
        valid = in_range & (seq_len % compress_ratio == 0)
        loc_index = rows
    else:
        valid = in_range & (seq_len != -1)  # 0xffffffff marks an invalid row
        loc_index = tl.load(plan_ptr + rows * plan_row_stride + 1, mask=valid, other=0) & 0xFFFF
    slot = tl.load(out_loc_ptr + loc_index, mask=valid, other=0).to(tl.int64)
    position = tl.maximum(seq_len - compress_ratio, 0).to(tl.int64)

    row_ptr = kv_ptr + rows.to(tl.int64)[:, None] * kv_row_stride
    x = tl.load(row_ptr + dims[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    partner = tl.load(row_ptr + (dims ^ 1)[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + dims).to(tl.float32)
    partner_weight = tl.load(weight_ptr + (dims ^ 1)).to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(x * x, axis=1) / DIM + eps)[:, None]
    x = x * inv_rms * weight[None, :]
    partner = partner * inv_rms * partner_weight[None, :]
    freqs_row = freqs_ptr + position[:, None] * freqs_pos_stride
    x = _rope_tail(x, partner, dims[None, :], freqs_row, DIM, ROPE_DIM)
    keys = _hadamard(x, DIM, LOG_DIM, ROUND_BY_HAND)
    tl.store(
        pool_ptr + slot[:, None] * pool_row_stride + dims[None, :],
        _to_bf16(keys, ROUND_BY_HAND),
        mask=valid[:, None],
    )


def _interpreted(kernel) -> bool:
    return isinstance(kernel, InterpretedFunction)


def index_query_bf16_triton(q: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor):
    """Fused `index_query_bf16`: q [T, H, D] -> bf16 [T, H, D] in one launch."""
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"index_query_bf16: q must be [T, H, D] dense along D, got {list(q.shape)}")
    tokens, heads, dim = q.shape
    freqs = freqs_table(freqs_cis)
    rotation_dims(dim, freqs.shape[1])
    out = torch.empty((tokens, heads, dim), dtype=torch.bfloat16, device=q.device)
    if tokens == 0:
        return out
    grid, args, kwargs = query_launch_args(q, freqs, positions, out)
    _index_query_kernel[grid](*args, **kwargs)
    return out


def query_launch_args(q, freqs, positions, out):
    """(grid, arguments, keyword arguments) of the fused query's launch (shared with the
    ahead-of-time check, `compile_check`). `freqs`: the fp32 [P, F, 2] table."""
    tokens, heads, dim = q.shape
    log_dim, rope_dim = rotation_dims(dim, freqs.shape[1])
    args = (
        q, freqs, positions, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), freqs.stride(0),
        heads,
    )
    kwargs = dict(
        DIM=dim, LOG_DIM=log_dim, ROPE_DIM=rope_dim,
        BLOCK_H=max(16, triton.next_power_of_2(heads)),
        ROUND_BY_HAND=_interpreted(_index_query_kernel),
        num_warps=4,
    )
    return (tokens,), args, kwargs


def store_index_keys_bf16_triton(pool_rows, kv, norm_weight, eps, freqs_cis, plan_rows, out_loc,
                                 compress_ratio, is_decode) -> None:
    """Fused `store_index_keys_bf16` in one launch (see the module docstring)."""
    check_store_inputs(pool_rows, kv, plan_rows)
    if kv.stride(1) != 1 or plan_rows.stride(1) != 1:
        raise ValueError("store_index_keys_bf16: kv and plan_rows must be dense along their rows")
    rows, dim = kv.shape
    freqs = freqs_table(freqs_cis)
    rotation_dims(dim, freqs.shape[1])
    if rows == 0:
        return
    grid, args, kwargs = store_launch_args(
        pool_rows, kv, norm_weight, eps, freqs, plan_rows, out_loc, compress_ratio, is_decode
    )
    _store_index_keys_kernel[grid](*args, **kwargs)


def store_launch_args(pool_rows, kv, norm_weight, eps, freqs, plan_rows, out_loc,
                      compress_ratio, is_decode):
    """(grid, arguments, keyword arguments) of the fused key store's launch (shared with the
    ahead-of-time check, `compile_check`). `freqs`: the fp32 [P, F, 2] table."""
    rows, dim = kv.shape
    log_dim, rope_dim = rotation_dims(dim, freqs.shape[1])
    args = (
        kv, norm_weight, freqs, plan_rows, out_loc, pool_rows,
        rows, kv.stride(0), plan_rows.stride(0), pool_rows.stride(0), freqs.stride(0),
        float(eps), int(compress_ratio),
    )
    kwargs = dict(
        IS_DECODE=bool(is_decode), DIM=dim, LOG_DIM=log_dim, ROPE_DIM=rope_dim,
        BLOCK_ROWS=KEY_ROWS_PER_PROGRAM,
        ROUND_BY_HAND=_interpreted(_store_index_keys_kernel),
        num_warps=4,
    )
    return (triton.cdiv(rows, KEY_ROWS_PER_PROGRAM),), args, kwargs
