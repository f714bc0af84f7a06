"""The CPU backend's bf16 index logits: `sgl_kernel_dsv4.index_logits.bf16_paged_mqa_logits` on
the CPU takes `sparse_attention.bf16_paged_mqa_logits` (the same contract, each distinct page read once when
the rows share their pages) instead of the kernel package's torch path, which gathers every
row's pages for each query row: most of a bf16-keys prefill. Not installed when
SGLANG_DSV4_CPU_TRITON=1, where `triton_hooks` routes the same function to the Triton kernel.
"""

from __future__ import annotations

from sglang_dsv4.cpu_backend import sparse_attention
from sglang_dsv4.fix import Fix, Replace

ID = "cpu-backend-index"
MODULE = "sgl_kernel_dsv4.index_logits"


def bf16_paged_mqa_logits(q, kv_cache, weights, seq_lens, page_table, max_seq_len):
    """On a CUDA tensor the kernel package's own choice (its Triton kernel); elsewhere
    `sparse_attention.bf16_paged_mqa_logits`."""
    if q.is_cuda:
        from sgl_kernel_dsv4 import index_logits

        return index_logits.bf16_paged_mqa_logits_triton(q, kv_cache, weights, seq_lens,
                                                         page_table, max_seq_len)
    return sparse_attention.bf16_paged_mqa_logits(q, kv_cache, weights, seq_lens, page_table, max_seq_len)


FIX = Fix(
    id=ID,
    title="CPU backend: the bf16 index logits with each distinct page read once",
    area="cpu",
    why="The kernel package's torch path gathers every row's pages per query row: slow on a CPU.",
    how="bf16_paged_mqa_logits calls sparse_attention.bf16_paged_mqa_logits for CPU tensors.",
    upstream="not for upstream: development and tests only",
    remove_when="never: it is how a bf16-keys forward runs at speed without a GPU",
    targets=(f"{MODULE}.bf16_paged_mqa_logits",),
    replaces=(
        Replace(
            f"{MODULE}.bf16_paged_mqa_logits",
            bf16_paged_mqa_logits,
            "(q, kv_cache, weights, seq_lens, page_table, max_seq_len)",
        ),
    ),
)
