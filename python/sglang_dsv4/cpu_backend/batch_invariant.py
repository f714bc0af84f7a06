"""The CPU backend's batch-invariant mode: `--enable-deterministic-inference` on `--device cpu`.

Upstream's mode (`sglang.srt.batch_invariant_ops`) registers Triton matmul, bmm, mean,
log-softmax and RMSNorm kernels for the CUDA, XPU or NPU dispatch key; on a CPU it stops at
`get_dispatch_device_backend` ("No supported accelerator"), and its choice lists do not name the
dsv4 attention backend, so upstream refuses DeepSeek-V4 with the flag on any device.

What breaks invariance on this CPU (measured with one intra-op thread, the backend's default),
and what the mode does about it:

- fp32 GEMMs: a row's bytes depend on how many rows the call has (oneDNN/MKL pick a kernel by
  M: M=1, M=2-3 and M>=4 differ), and below 12 output columns (the hyper-connection and routing
  heads) on its place among the rows, a column's on the column count. Every `aten::mm`,
  `aten::addmm` and `aten::bmm` on a CPU tensor is computed in blocks of `ROWS` rows, each block
  padded to `ROWS`, the other operand to at least `COLUMNS` columns, by one call shape of
  `mm.out` / `bmm.out` (which the mode leaves as they are); the bias of `addmm` is added after.
- top-k: with `sorted=False` (the DSA top-k transform's call) the same k positions come back in
  an order that changes with the row's width, for the indexer the batch's longest sequence, and
  the sparse attention sums in that order. `aten::topk` is the head of a stable sort (by value,
  ties to the lower index).
- sigmoid, silu, exp2, softplus: torch's vector loop computes its last `numel % width` elements
  in scalar code that rounds these fp32 functions differently, so on a tensor of a few columns
  per token (the router's scores) a token's values change with the batch size. They run over
  the tensor padded to whole vector iterations (`ELEMENTWISE`).
- RMSNorm: upstream's batch-invariant branch calls a Triton kernel (interpreted on a CPU); it
  takes a torch row RMSNorm.

Measured invariant and left alone: bf16 GEMMs, bmm across its batch count, row reductions over
a fixed width (sum, mean, softmax, log-softmax, logsumexp). The CPU attention's own
batch-dependent paths are in `sparse_attention` (each asks `enabled()`).

Nothing here changes a server without the flag, or any GPU path: the module is installed only in
a process where the CPU backend is on, and the aten kernels change only once upstream's
ModelRunner turns the mode on (`--enable-deterministic-inference`).
"""

from __future__ import annotations

import functools

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


# Elements per padded call of an elementwise op: a whole number of vector iterations on every
# x86 width (AVX2 and AVX-512, fp32 and bf16), so no element is left to the scalar tail.
VECTOR_ELEMENTS = 64


def _vectorized(out_op, x: torch.Tensor, *args) -> torch.Tensor:
    """`out_op(x, *args, out=...)` (the op's `.out` kernel, which the mode leaves as it is) over
    x flattened and zero-padded to a multiple of `VECTOR_ELEMENTS`: torch's CPU kernels compute
    the last `numel % vector width` elements with scalar code that rounds some transcendental
    functions differently from the vector code, so an element's bytes would depend on how many
    elements the tensor has (the batch size, for a tensor of a few columns per token)."""
    flat = x.reshape(-1)
    count = flat.numel()
    padded = torch.zeros(-(-count // VECTOR_ELEMENTS) * VECTOR_ELEMENTS, dtype=x.dtype,
                         device=x.device)
    padded[:count].copy_(flat)
    result = torch.empty_like(padded)
    out_op(padded, *args, out=result)
    return result[:count].view(x.shape)


# The elementwise ops measured to round an element by its place (scalar tail or vector body),
# each with the `.out` kernel its padded call runs.
ELEMENTWISE = {
    "aten::sigmoid": torch.ops.aten.sigmoid.out,
    "aten::silu": torch.ops.aten.silu.out,
    "aten::exp2": torch.ops.aten.exp2.out,
    "aten::softplus": torch.ops.aten.softplus.out,  # (x, beta, threshold)
}


def enabled() -> bool:
    """Whether this process runs in the batch-invariant mode (the CPU ops with a batch-dependent
    fast path take their invariant one): upstream's own flag, which the switch below sets."""
    from sglang.srt.batch_invariant_ops import is_batch_invariant_mode_enabled

    return is_batch_invariant_mode_enabled()


def enable_batch_invariant_mode(enable_bmm=True):
    """Upstream's switch, for a CPU process: the GEMMs, top-k and elementwise ops above on the CPU
    dispatch key, and upstream's mode flag set (its layers consult `is_batch_invariant_mode_enabled`)."""
    global _library
    from sglang.srt.batch_invariant_ops import batch_invariant_ops

    if batch_invariant_ops.is_batch_invariant_mode_enabled():
        return
    library = torch.library.Library("aten", "IMPL")
    library.impl("aten::mm", invariant_mm, "CPU")
    library.impl("aten::addmm", _addmm, "CPU")
    library.impl("aten::topk", invariant_topk, "CPU")
    for name, out_op in ELEMENTWISE.items():
        library.impl(name, functools.partial(_vectorized, out_op), "CPU")
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
        "backend; on a CPU the fp32 GEMMs change a row's bytes with the row count, top-k's "
        "order changes with the row's width, and some elementwise ops round the vector loop's "
        "scalar tail differently.",
    how="The dsv4 backend named in upstream's deterministic choice lists; the mode's switch "
        "registers row-blocked GEMMs, a stable-sort top-k and tail-free elementwise ops for "
        "the CPU dispatch key; "
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
