"""Upstream's fp8 index numerics in plain torch, and dense logits: the references tests and
benchmarks hold the bf16 kernels against (nothing in serving imports this module).

- `quantize_index_fp8`: upstream 0.5.23's fp8 index quantization, per row of 128 values:
  scale = max(amax, 1e-4) / 448 in fp32, values = e4m3(x * (1 / scale)). Keys keep the scale
  beside the row (132 B/token); the query's scale is folded into the head weights.
- `pack_fp8_index_pages`: keys laid out as upstream's indexer pool pages (64 slots: 64 x 128 fp8
  values, then 64 fp32 scales), the input of upstream's fp8 paged logits paths.
- `index_logits_dense`: logits of one query against dense keys, in fp64 (the exact reference) or
  from fp8 / bf16 operands.
"""

from __future__ import annotations

import torch

from sgl_kernel_dsv4.index_contract import PAGE_TOKENS

FP8_E4M3_MAX = 448.0
FP8_SCALE_FLOOR = 1e-4
FP8_INDEX_BYTES_PER_KEY = 128 + 4
BF16_INDEX_BYTES_PER_KEY = 128 * 2


def quantize_index_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization as upstream's fused index kernels do it: (values, fp32 scale)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=FP8_SCALE_FLOOR) / FP8_E4M3_MAX
    values = (x * (1.0 / scale)).to(torch.float8_e4m3fn)
    return values, scale.squeeze(-1)


def pack_fp8_index_pages(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[n, 128] e4m3 keys + [n] fp32 scales -> uint8 [pages, 64, 1, 132], upstream's page layout
    (the 64 x 128 value bytes of a page first, then its 64 scales). n is padded to whole pages."""
    n = values.shape[0]
    pages = -(-n // PAGE_TOKENS)
    pad = pages * PAGE_TOKENS - n
    value_bytes = torch.nn.functional.pad(values.view(torch.uint8), (0, 0, 0, pad))
    scale_bytes = torch.nn.functional.pad(scale.float(), (0, pad)).view(torch.uint8)
    page_bytes = torch.cat(
        (value_bytes.reshape(pages, -1), scale_bytes.reshape(pages, -1)), dim=1
    )
    return page_bytes.view(pages, PAGE_TOKENS, 1, 132)


def index_logits_dense(query: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                       dtype: str) -> torch.Tensor:
    """Logits [Q, n] of queries [Q, H, 128] against keys [n, 128] with head weights [Q, H].

    dtype "exact": fp64 from the given values; "bf16": both rounded to bf16, fp32 accumulation;
    "fp8": both quantized as upstream does (query scale folded into the weights, key scale
    applied after the head sum), fp32 accumulation."""
    if dtype == "exact":
        q, k, w = query.double(), keys.double(), weights.double()
        return torch.einsum("qhd,nd->qhn", q, k).relu_().mul_(w.unsqueeze(-1)).sum(1)
    if dtype == "bf16":
        q = query.to(torch.bfloat16).float()
        k = keys.to(torch.bfloat16).float()
        return torch.einsum("qhd,nd->qhn", q, k).relu_().mul_(weights.float().unsqueeze(-1)).sum(1)
    if dtype == "fp8":
        q8, q_scale = quantize_index_fp8(query)
        k8, k_scale = quantize_index_fp8(keys)
        w = weights.float() * q_scale
        scores = torch.einsum("qhd,nd->qhn", q8.float(), k8.float()).relu_()
        return scores.mul_(w.unsqueeze(-1)).sum(1) * k_scale.unsqueeze(0)
    raise ValueError(f"index_logits_dense: dtype must be exact, bf16 or fp8, got {dtype!r}")
