"""The CPU backend's opt-in Triton path: the distribution's own bf16 index-logits kernel in the
forward, under the Triton interpreter (SGLANG_DSV4_CPU_TRITON=1 with SGLANG_DSV4_INDEX_K_DTYPE=bf16).

`sgl_kernel_dsv4.index_logits.bf16_paged_mqa_logits` takes the torch path on a CPU tensor; here
it takes `bf16_paged_mqa_logits_triton` instead, the kernel a GPU serves with, so that a CPU run
exercises it inside upstream's model code. Slow (interpreted); for tests, never the default.
"""

from __future__ import annotations

import logging

from sgl_kernel_dsv4 import index_logits

from sglang_dsv4.fix import Fix, Replace

logger = logging.getLogger("sglang_dsv4")
ID = "cpu-backend-triton"
MODULE = "sgl_kernel_dsv4.index_logits"
CALLS = {"triton": 0}


def bf16_paged_mqa_logits(q, kv_cache, weights, seq_lens, page_table, max_seq_len):
    """Always the Triton kernel (TRITON_INTERPRET=1 on the CPU); counts its calls."""
    if not CALLS["triton"]:
        logger.info("sglang-dsv4 cpu backend: bf16 index logits through the Triton kernel")
    CALLS["triton"] += 1
    return index_logits.bf16_paged_mqa_logits_triton(
        q, kv_cache, weights, seq_lens, page_table, max_seq_len
    )


FIX = Fix(
    id=ID,
    title="CPU backend: the bf16 index logits through the project's Triton kernel (interpreter)",
    area="cpu",
    why="A CPU run otherwise proves only the torch path of the kernels a GPU serves with.",
    how="bf16_paged_mqa_logits calls bf16_paged_mqa_logits_triton whatever the device.",
    upstream="not for upstream: development and tests only",
    remove_when="never: it is how the Triton kernel runs inside a forward without a GPU",
    targets=(f"{MODULE}.bf16_paged_mqa_logits",),
    replaces=(
        Replace(
            f"{MODULE}.bf16_paged_mqa_logits",
            bf16_paged_mqa_logits,
            "(q, kv_cache, weights, seq_lens, page_table, max_seq_len)",
        ),
    ),
)
