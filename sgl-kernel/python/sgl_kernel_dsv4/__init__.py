"""Kernels the distribution adds for DeepSeek-V4 on sm_120: the bf16 indexer's logits, query
rotation and key store.

Each kernel comes as a torch reference and a Triton kernel with the same arguments, and a
dispatcher that picks Triton on CUDA; importing the package does not import Triton (the Triton
modules load on first use).
"""

from sgl_kernel_dsv4.index_contract import HEAD_DIM, PAGE_TOKENS, IndexLogitsInputError
from sgl_kernel_dsv4.index_logits import (
    bf16_paged_mqa_logits,
    bf16_paged_mqa_logits_torch,
    bf16_paged_mqa_logits_triton,
    indexer_rows_per_chunk,
)
from sgl_kernel_dsv4.index_rotation import (
    apply_rope_tail,
    hadamard_rotate,
    index_query_bf16,
    store_index_keys_bf16,
)

__all__ = [
    "HEAD_DIM",
    "PAGE_TOKENS",
    "IndexLogitsInputError",
    "apply_rope_tail",
    "bf16_paged_mqa_logits",
    "bf16_paged_mqa_logits_torch",
    "bf16_paged_mqa_logits_triton",
    "hadamard_rotate",
    "index_query_bf16",
    "indexer_rows_per_chunk",
    "store_index_keys_bf16",
]
