"""The CPU backend's batch-invariant mode: `--enable-deterministic-inference` on `--device cpu`.

Upstream's mode (`sglang.srt.batch_invariant_ops`) registers Triton matmul, bmm, mean,
log-softmax and RMSNorm kernels for the CUDA, XPU or NPU dispatch key; on a CPU it stops at
`get_dispatch_device_backend` ("No supported accelerator"), and its choice lists do not name the
dsv4 attention backend, so upstream refuses DeepSeek-V4 with the flag on any device.

What breaks invariance on this CPU (measured with one intra-op thread, the backend's default):
an fp32 GEMM's row depends on how many rows the call has (oneDNN/MKL pick a kernel by M: a row
computed with M=1 differs from the same row with M=2 and again with M>=4; bf16 GEMMs were equal at
every M tried, and bmm is equal whatever its batch count but not whatever its row count); with
fewer than 12 output columns (the hyper-connection and routing heads) an fp32 GEMM takes narrow
kernels in which a row's bytes change with its place among the rows, and a column's with the
column count. Row
reductions (sum, mean, softmax, log-softmax, top-k along the last dimension) gave the same row
at every M, but top-k's order is not a function of the row: with `sorted=False` (the DSA top-k
transform's call) the same k positions come back in an order that changes with the row's width,
which for the indexer is the batch's longest sequence, and the sparse attention sums in that
order. In the mode `aten::topk` on a CPU tensor is the head of a stable sort (by value, ties to
the lower index). The mode here makes the GEMMs invariant by construction: every `aten::mm`,
`aten::addmm` and `aten::bmm` on a CPU tensor is computed in blocks of `ROWS` rows, each block
padded to `ROWS` (and the other operand to at least `COLUMNS` columns) and computed by the same kernel call shape (`mm.out` / `bmm.out`, which the
mode leaves as they are), so a row's bytes depend only on that row and the other operand, never
on how many rows were batched or chunked with it. The bias of `addmm` is added after the
product, row by row. RMSNorm's batch-invariant branch takes a torch RMSNorm instead of upstream's
Triton kernel (interpreted on a CPU).

Nothing here changes a server without the flag, or any GPU path: the module is installed only in
a process where the CPU backend is on, and the aten kernels change only once upstream's
ModelRunner turns the mode on (`--enable-deterministic-inference`).
"""

from __future__ import annotations

import torch

from sglang_dsv4.fix import Fix, Replace

ID = "cpu-backend-batch-invariant"
MODULE = "sglang.srt.batch_invariant_ops"
LAYERNORM = "sglang.srt.layers.layernorm"
UPSTREAM_MODULES = (MODULE, LAYERNORM)
# Rows per GEMM call in the mode: a decode step of one request pays for 16 rows (the tiny
# model's GEMMs are small), a 4,096-token prefill makes 256 calls per linear layer.
ROWS = 16
# Columns at least: below 12 an fp32 product takes narrow-N kernels whose column values change
# with the column count, and whose row values change with the row's place in the block.
COLUMNS = 16
ATTENTION_BACKEND = "dsv4"

_library = None  # the torch.library registration, kept alive while the mode is on


def allow_dsv4_deterministic() -> None:
    """Name the dsv4 attention backend in upstream's deterministic-inference choice lists, by
    upstream's own registration functions: without it the launcher refuses the flag, and without
    the radix entry it turns the radix cache off."""
    from sglang.srt.arg_groups import choices

    if ATTENTION_BACKEND not in choices.DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        choices.add_deterministic_attention_backend_choices([ATTENTION_BACKEND])
    if ATTENTION_BACKEND not in choices.RADIX_SUPPORTED_DETERMINISTIC_ATTENTION_BACKEND:
        choices.add_radix_supported_deterministic_attention_backend_choices([ATTENTION_BACKEND])


def _row_blocked(a: torch.Tensor, b: torch.Tensor, multiply) -> torch.Tensor:
    """a @ b over the last two dimensions, each `ROWS`-row block of `a` zero-padded to `ROWS` rows
    and multiplied by one `multiply(block, b, out=...)` call of the same shape (`mm.out` or
    `bmm.out`, which the mode leaves as they are), `b` zero-padded to `COLUMNS` columns when it
    has fewer: a row of the result is a function of that row of `a` and of `b` alone."""
    *lead, rows, inner = a.shape
    columns = b.shape[-1]
    if columns < COLUMNS:
        wide = torch.zeros((*b.shape[:-1], COLUMNS), dtype=b.dtype, device=b.device)
        wide[..., :columns].copy_(b)
        b = wide
    dtype = torch.result_type(a, b)
    result = torch.empty((*lead, rows, columns), dtype=dtype, device=a.device)
    block = torch.zeros((*lead, ROWS, inner), dtype=a.dtype, device=a.device)
    product = torch.empty((*lead, ROWS, b.shape[-1]), dtype=dtype, device=a.device)
    for start in range(0, rows, ROWS):
        count = min(ROWS, rows - start)
        block.zero_()
        block[..., :count, :].copy_(a[..., start:start + count, :])
        multiply(block, b, out=product)
        result[..., start:start + count, :].copy_(product[..., :count, :columns])
    return result


def invariant_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`aten::mm` on the CPU in the mode."""
    return _row_blocked(a, b, torch.mm)


def invariant_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`aten::bmm` on the CPU in the mode: bmm is already independent of the batch count, not
    of the row count."""
    return _row_blocked(a, b, torch.bmm)


def _addmm(bias, a, b, *, beta=1, alpha=1):
    product = invariant_mm(a, b)
    if alpha != 1:
        product = product * alpha
    return product + (bias if beta == 1 else bias * beta)


def invariant_topk(x: torch.Tensor, k: int, dim: int = -1, largest: bool = True,
                   sorted: bool = True):
    """`aten::topk` on the CPU in the mode: the first `k` of a stable sort, so the k chosen and
    their order (by value, ties to the lower index) depend on the row's values alone. torch's
    own top-k returns the same set in an order that changes with the row's width (with
    `sorted=False`, as the DSA top-k transform asks), and the width of an indexer row is the
    longest sequence in the batch."""
    values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
    return values.narrow(dim, 0, k).contiguous(), indices.narrow(dim, 0, k).contiguous()


def enabled() -> bool:
    """Whether this process runs in the batch-invariant mode (the CPU ops with a batch-dependent
    fast path take their invariant one): upstream's own flag, which the switch below sets."""
    from sglang.srt.batch_invariant_ops import is_batch_invariant_mode_enabled

    return is_batch_invariant_mode_enabled()


def enable_batch_invariant_mode(enable_bmm=True):
    """Upstream's switch, for a CPU process: the GEMMs and top-k above on the CPU dispatch key, and
    upstream's mode flag set (its layers consult `is_batch_invariant_mode_enabled`)."""
    global _library
    from sglang.srt.batch_invariant_ops import batch_invariant_ops

    if batch_invariant_ops.is_batch_invariant_mode_enabled():
        return
    library = torch.library.Library("aten", "IMPL")
    library.impl("aten::mm", invariant_mm, "CPU")
    library.impl("aten::addmm", _addmm, "CPU")
    library.impl("aten::topk", invariant_topk, "CPU")
    # (aten::mm.dtype has no CPU kernel in torch: nothing to make invariant there.)
    if enable_bmm:
        library.impl("aten::bmm", invariant_bmm, "CPU")
    _library = library
    batch_invariant_ops._batch_invariant_MODE = True


def rms_norm_batch_invariant(input, weight, eps=1e-6):
    """RMSNorm over the last dimension in fp32, row by row (a row reduction: the same bytes
    whatever the row count), for upstream's batch-invariant RMSNorm branch on a CPU."""
    x = input.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(input.dtype)


FIX = Fix(
    id=ID,
    title="CPU backend: --enable-deterministic-inference for DeepSeek-V4 on --device cpu",
    area="cpu",
    why="Upstream's batch-invariant mode needs CUDA, XPU or NPU kernels and refuses the dsv4 "
        "backend; on a CPU the fp32 GEMMs change a row's bytes with the row count, and top-k's "
        "order changes with the row's width.",
    how="The dsv4 backend named in upstream's deterministic choice lists; the mode's switch "
        "registers row-blocked GEMMs and a stable-sort top-k for the CPU dispatch key; "
        "RMSNorm's invariant branch in torch.",
    upstream="not for upstream: development and tests only",
    remove_when="never: it is how a batch-invariant DeepSeek-V4 is served without a GPU",
    targets=(f"{MODULE}.enable_batch_invariant_mode", f"{LAYERNORM}.rms_norm_batch_invariant"),
    replaces=(
        Replace(f"{MODULE}.enable_batch_invariant_mode", enable_batch_invariant_mode,
                "(enable_bmm=True)"),
        Replace(f"{LAYERNORM}.rms_norm_batch_invariant", rms_norm_batch_invariant,
                "(input, weight, eps=1e-06)"),
    ),
)
