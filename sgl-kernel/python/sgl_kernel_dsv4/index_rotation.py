"""The rotations upstream applies to c4 index keys and queries before storing or scoring them.

Upstream 0.5.23 fuses them into its fp8 store and query kernels (`fused_norm_rope_indexer`,
`fused_q_indexer_rope_hadamard_quant`): RoPE on the trailing rope dims, then the normalized
128-point Walsh-Hadamard rotation (Sylvester order), in fp32, then fp8 quantization. The bf16 path
runs the same steps and rounds to bf16 instead.

This module is the torch reference and CPU fallback; `index_rotation_triton` holds one fused
Triton kernel for each of the two public operations, and the dispatchers pick it on CUDA:

- `index_query_bf16(q, freqs_cis, positions)`: the indexer query [T, H, D] -> bf16 [T, H, D]:
  RoPE on the tail at each token's position, Hadamard rotation, bf16.
  (`index_query_bf16_torch`, `index_query_bf16_triton`)
- `store_index_keys_bf16(pool_rows, kv, norm_weight, eps, freqs_cis, plan_rows, out_loc,
  compress_ratio, is_decode)`: the compressor's rows kv [N, D] -> RMSNorm (weight), RoPE at the
  compressed token's position (seq_len - ratio), Hadamard rotation, bf16, stored into
  pool_rows [slots, D] at each row's slot. `plan_rows` is upstream's compress plan viewed as
  int32 [N, 4] (seq_len first; prefill: ragged token id in the low 16 bits of the second).
  Rows that complete no compressed token (decode: seq_len not a multiple of the ratio; prefill:
  invalid rows, seq_len 0xffffffff) are skipped, as upstream's fused store skips them.
  (`store_index_keys_bf16_torch`, `store_index_keys_bf16_triton`)
- `apply_rope_tail`, `hadamard_rotate`: the two steps on their own (fp32).

The torch functions other than the store are CUDA-graph safe (no host sync, no shape from data);
the torch store selects the rows to write by value, which is fine on the CPU it serves.
"""

from __future__ import annotations

import torch

from sgl_kernel_dsv4.index_contract import check_store_inputs


def apply_rope_tail(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * F values of x [T, ..., D] as F interleaved (real, imag) pairs by
    the complex freqs [T, F] of each row (broadcast over the middle dims). Returns fp32."""
    x = x.float()
    pairs = freqs.shape[-1]
    if x.shape[0] != freqs.shape[0] or x.shape[-1] < 2 * pairs:
        raise ValueError(
            f"apply_rope_tail: x {list(x.shape)} and freqs {list(freqs.shape)} do not fit"
        )
    freqs = freqs.reshape(freqs.shape[0], *([1] * (x.dim() - 2)), pairs)
    tail = torch.view_as_complex(x[..., -2 * pairs :].reshape(*x.shape[:-1], pairs, 2).contiguous())
    rotated = torch.view_as_real(tail * freqs).flatten(-2)
    return torch.cat((x[..., : -2 * pairs], rotated), dim=-1)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ H / sqrt(n) along the last dim (n a power of two, H in Sylvester order), in fp32."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"hadamard_rotate: last dim must be a power of two, got {n}")
    out = x.float().reshape(-1, n)
    half = 1
    while half < n:
        pairs = out.view(-1, n // (2 * half), 2, half)
        low, high = pairs[:, :, 0], pairs[:, :, 1]
        out = torch.stack((low + high, low - high), dim=2)
        half *= 2
    return out.reshape(x.shape) * n**-0.5


def index_query_bf16_torch(q: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor):
    """Reference of `index_query_bf16`: q [T, H, D] (any float dtype), freqs_cis complex [P, F],
    positions int [T] -> bf16 [T, H, D]."""
    rotated = apply_rope_tail(q, freqs_cis[positions.long()])
    return hadamard_rotate(rotated).to(torch.bfloat16)


def index_key_targets(plan_rows, out_loc, compress_ratio: int, is_decode: bool):
    """From a compress plan (int32 [N, 4]) and the step's out_loc: (positions int64 [N], slots
    int64 [N], valid bool [N]). Positions of invalid rows are clamped to 0 and their slots are
    meaningless: they must not be written."""
    seq_lens = plan_rows[:, 0]
    if is_decode:
        valid = seq_lens % compress_ratio == 0
        slots = out_loc.long()
    else:
        valid = seq_lens != -1  # 0xffffffff marks an invalid row
        slots = out_loc.long()[(plan_rows[:, 1] & 0xFFFF).long()]
    positions = (seq_lens.long() - compress_ratio).clamp(min=0)
    return positions, slots, valid


def index_keys_bf16_torch(kv, norm_weight, eps: float, freqs_cis, positions):
    """RMSNorm (weight), RoPE at `positions`, Hadamard rotation, bf16: the keys of kv [N, D]."""
    x = kv.float()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    x = apply_rope_tail(x * norm_weight.float(), freqs_cis[positions])
    return hadamard_rotate(x).to(torch.bfloat16)


def store_index_keys_bf16_torch(pool_rows, kv, norm_weight, eps, freqs_cis, plan_rows, out_loc,
                                compress_ratio, is_decode) -> None:
    """Reference of `store_index_keys_bf16` (see the module docstring)."""
    check_store_inputs(pool_rows, kv, plan_rows)
    positions, slots, valid = index_key_targets(plan_rows, out_loc, compress_ratio, is_decode)
    keys = index_keys_bf16_torch(kv, norm_weight, eps, freqs_cis, positions)
    pool_rows.index_copy_(0, slots[valid], keys[valid])


def index_query_bf16(q, freqs_cis, positions):
    """The fused Triton kernel on CUDA, the torch reference elsewhere."""
    if q.is_cuda:
        from sgl_kernel_dsv4.index_rotation_triton import index_query_bf16_triton

        return index_query_bf16_triton(q, freqs_cis, positions)
    return index_query_bf16_torch(q, freqs_cis, positions)


def store_index_keys_bf16(pool_rows, kv, norm_weight, eps, freqs_cis, plan_rows, out_loc,
                          compress_ratio, is_decode) -> None:
    """The fused Triton kernel on CUDA, the torch reference elsewhere."""
    if kv.is_cuda:
        from sgl_kernel_dsv4.index_rotation_triton import store_index_keys_bf16_triton

        store = store_index_keys_bf16_triton
    else:
        store = store_index_keys_bf16_torch
    store(pool_rows, kv, norm_weight, eps, freqs_cis, plan_rows, out_loc, compress_ratio,
          is_decode)
