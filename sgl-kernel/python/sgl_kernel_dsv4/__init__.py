"""Kernels the distribution adds for DeepSeek-V4 on sm_120 (bf16 index-K logits).

Each kernel comes as a torch reference and a Triton kernel with the same arguments; importing
the package does not import Triton (the Triton module loads on first use).
"""

from sgl_kernel_dsv4.index_logits import (
    HEAD_DIM,
    PAGE_TOKENS,
    IndexLogitsInputError,
    bf16_paged_mqa_logits,
    bf16_paged_mqa_logits_torch,
    bf16_paged_mqa_logits_triton,
)
from sgl_kernel_dsv4.index_rotation import apply_rope_tail, hadamard_rotate

__all__ = [
    "HEAD_DIM",
    "PAGE_TOKENS",
    "IndexLogitsInputError",
    "apply_rope_tail",
    "bf16_paged_mqa_logits",
    "bf16_paged_mqa_logits_torch",
    "bf16_paged_mqa_logits_triton",
    "hadamard_rotate",
]
