"""The rotations upstream applies to c4 index keys and queries before storing or scoring them.

Upstream 0.5.23 fuses them into its fp8 store and query kernels (`fused_norm_rope_indexer`,
`fused_q_indexer_rope_hadamard_quant`): RoPE on the trailing rope dims, then the normalized
128-point Walsh-Hadamard rotation (Sylvester order), in fp32, then fp8 quantization. The bf16 path
runs the same two steps here in plain torch and rounds to bf16 instead. Both functions are
CUDA-graph safe: no host sync and no shape that depends on data.
"""

from __future__ import annotations

import torch


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
