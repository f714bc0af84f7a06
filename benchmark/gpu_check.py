"""GPU proof kit: one command that proves the bf16 indexer kernels on a CUDA host in minutes.

    PYTHONPATH=sgl-kernel/python python -m benchmark.gpu_check --out out/gpu-check
    scripts/gpu_check.sh --out out/gpu-check          # the same, path set up for you
    python -m benchmark.gpu_check --plan               # stages and their time budgets, runs nothing
    python -m benchmark.gpu_check --smoke --out build/gpu-smoke   # CPU dry run, seconds

Needs only torch and triton (a bare CUDA image: PyTorch 2.11, Triton 3.6, Python 3.12); it imports
nothing of the project that needs sglang and installs nothing. Stages, each under a time budget
the kit enforces (a stage past its budget is stopped and reported as such):

- environment: GPU name, capability, SMs, versions, measured device copy bandwidth;
- correctness: DeepSeek-V4 indexer shapes (64 heads, head_dim 128, 64-key pages, shuffled page
  tables with -1 entries, lengths not a multiple of a page): the Triton kernel, the torch path and
  an independent fp32 reference, decode B = 1, 8, 32, 64 at 8k / 32k / 80k keys and the prefill
  row-chunked call; max relative error and top-512 agreement per case;
- cuda_graphs: the logits call (Triton and torch) and the query / key rotations captured at the
  decode batch sizes, replayed with new seq_lens, page tables and queries, bit-equal to eager;
- speed: ratios from one run: Triton vs torch path, achieved bytes/s over the measured copy
  bandwidth (roofline fraction), the bf16 step vs an fp8 paged-logits step at the same shape;
- launch_sweep: every candidate launch config checked and timed; the best per GPU is written to
  DIR/tuned_launch.json (`--record` merges it into sgl_kernel_dsv4/tuned_launch.json);
- sglang (when sglang is importable): the real DeepSeekV4TokenToKVPool on CUDA, bf16 keys written
  and read through the patched indexer for one decode step, against the same step on the CPU.

Writes DIR/gpu_check.json (every figure) and DIR/gpu_check.md (the table a person reads).
Exit status: 0 every correctness check passed; 1 a correctness check failed or could not finish
(the performance targets are reported as pass / fail lines and never change the exit status);
2 the kit could not run (bad arguments, no CUDA without --smoke).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import platform
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import import_module, util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNEL_PATH = REPO / "sgl-kernel" / "python"
TUNED_FILE = KERNEL_PATH / "sgl_kernel_dsv4" / "tuned_launch.json"

PAGE = 64
HEAD_DIM = 128
TOPK = 512
LIMIT_S = 480  # the whole run must fit the 8 minutes a borrowed GPU host gives
WATCHDOG_MARGIN_S = 30  # past every budget by this much, the run is ended
MAX_REL_ERR = 1e-4  # fp32 accumulation of exact bf16 products: only the summation order differs
BF16_KEY_BYTES = 256
FP8_KEY_BYTES = 132

EXIT_OK, EXIT_CORRECTNESS, EXIT_CANNOT_RUN = 0, 1, 2


@dataclass(frozen=True)
class Stage:
    name: str
    budget_s: int
    what: str
    needs_cuda: bool = False
    needs_sglang: bool = False
    # a correctness stage that fails, errs or runs out of time makes the exit status 1
    proves_correctness: bool = False


STAGES = (
    Stage("environment", 20, "GPU, versions, measured copy bandwidth"),
    Stage(
        "correctness",
        120,
        "Triton vs torch vs fp32 reference, decode + prefill",
        proves_correctness=True,
    ),
    Stage(
        "cuda_graphs",
        40,
        "capture at decode batch sizes, replay == eager bit for bit",
        needs_cuda=True,
        proves_correctness=True,
    ),
    Stage("speed", 90, "Triton vs torch, roofline fraction, bf16 vs fp8 step"),
    Stage("launch_sweep", 90, "launch configs checked and timed, best per GPU"),
    Stage(
        "sglang",
        60,
        "real DeepSeekV4TokenToKVPool on CUDA vs CPU, one decode step",
        needs_sglang=True,
        proves_correctness=True,
    ),
)


@dataclass(frozen=True)
class Sizes:
    """Shapes of one run: the real ones on a GPU, tiny ones for the CPU smoke run."""

    heads: int
    decode_batches: tuple
    decode_keys: tuple
    prefill: tuple  # ((rows, context before the chunk), ...) one request each
    prefill_chunk_rows: int
    graph_keys: int
    speed_cases: tuple  # (batch, keys)
    target_case: tuple  # the shape of the issue's targets
    sweep_case: tuple
    rotation_rows: tuple  # tokens (query) and compressed rows (key write)
    rotation_speed_rows: tuple
    copy_bytes: int
    min_timing_s: float
    min_iters: int


GPU_SIZES = Sizes(
    heads=64,
    decode_batches=(1, 8, 32, 64),
    decode_keys=(8192, 32768, 81920),
    prefill=((3072, 20000), (1024, 1000)),
    prefill_chunk_rows=1024,
    graph_keys=32768,
    speed_cases=((1, 81920), (8, 32768), (32, 81920), (64, 81920)),
    target_case=(32, 81920),
    sweep_case=(32, 81920),
    rotation_rows=(64, 4096),
    rotation_speed_rows=(64, 4096),
    copy_bytes=1 << 30,
    min_timing_s=0.15,
    min_iters=5,
)
SMOKE_SIZES = Sizes(
    heads=64,
    decode_batches=(1, 3),
    decode_keys=(200, 520),
    prefill=((7, 150), (3, 20)),
    prefill_chunk_rows=4,
    graph_keys=300,
    speed_cases=((2, 300),),
    target_case=(2, 300),
    sweep_case=(2, 300),
    rotation_rows=(2, 5),  # the interpreter runs the fused query at ~0.1 s per token
    rotation_speed_rows=(2,),
    copy_bytes=8 << 20,
    min_timing_s=0.0,
    min_iters=1,
)


class StageTimeout(Exception):
    """The stage's time budget ran out."""


class KitError(Exception):
    """The kit cannot run as asked; the message is the one line the user reads."""


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]


# --- the kernels, looked up at call time (the kernel package may be newer or older) ---------


class Kernels:
    """sgl_kernel_dsv4's entry points. Attributes are read at each call, never bound once, so a
    replaced function (a newer kernel module, or a test that breaks it on purpose) is the one run."""

    def __init__(self):
        self.logits = import_module("sgl_kernel_dsv4.index_logits")
        self.reference = import_module("sgl_kernel_dsv4.index_reference")
        self.rotation = import_module("sgl_kernel_dsv4.index_rotation")
        self._launcher = None
        self._rotation_triton = False  # not looked up yet

    def triton(self, *args):
        return self.logits.bf16_paged_mqa_logits_triton(*args)

    def torch_path(self, *args):
        return self.logits.bf16_paged_mqa_logits_torch(*args)

    @property
    def launcher(self):
        """sgl_kernel_dsv4.index_logits_triton (imports Triton: only once the mode is set)."""
        if self._launcher is None:
            self._launcher = import_module("sgl_kernel_dsv4.index_logits_triton")
        return self._launcher

    @property
    def rotation_triton(self):
        """sgl_kernel_dsv4.index_rotation_triton, or None where the package has no fused
        rotations (an older kernel package). Any other import error is raised: it is a failure."""
        if self._rotation_triton is False:
            try:
                self._rotation_triton = import_module("sgl_kernel_dsv4.index_rotation_triton")
            except ModuleNotFoundError as exc:
                if exc.name != "sgl_kernel_dsv4.index_rotation_triton":
                    raise
                self._rotation_triton = None
        return self._rotation_triton

    @rotation_triton.setter
    def rotation_triton(self, module):
        self._rotation_triton = module

    def launch_api(self) -> str:
        params = inspect.signature(self.launcher.launch).parameters
        return "config" if "config" in params else "pages_per_program"

    def launch_candidates(self) -> list:
        """The kernel's own LAUNCH_SWEEP, or pages per program through the older launch()."""
        if self.launch_api() == "config":
            return [dict(c) for c in getattr(self.launcher, "LAUNCH_SWEEP", None) or [{}]]
        return [{"pages_per_program": p} for p in (1, 2, 4, 8)]

    def launch(self, args, config):
        q, kv, weights, seq_lens, table, width = args
        seq_lens = seq_lens.view(-1)
        if self.launch_api() == "config":
            return self.launcher.launch(q, kv, weights, seq_lens, table, width, config=config)
        return self.launcher.launch(
            q,
            kv,
            weights,
            seq_lens,
            table,
            width,
            pages_per_program=config.get("pages_per_program"),
        )

    def default_config(self, device):
        fn = getattr(self.launcher, "launch_config_for", None)
        return None if fn is None else fn(device)


# --- inputs ----------------------------------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def build_case(kit, lengths, width, *, rows_share_pages=False, hole=True, seed=0):
    """Decode / prefill inputs as the indexer passes them.

    Keys live in one pool of bf16 pages (a uint8 buffer viewed as bf16, like the pool's); every
    row's pages come in shuffled order; the page table is wider than any row needs (-1 past each
    row's pages) and, with `hole`, one row has a -1 inside its pages. `rows_share_pages`: every
    row reads the same pages (the rows of one prefill request)."""
    torch = kit.torch
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    needed = [cdiv(n, PAGE) for n in lengths]
    cols = cdiv(width, PAGE) + 2
    distinct = [max(needed)] if rows_share_pages else needed
    num_pages = sum(distinct) + 3
    order = torch.randperm(num_pages, generator=gen).to(torch.int32)
    table = torch.full((batch, cols), -1, dtype=torch.int32)
    taken = 0
    for row, count in enumerate(needed):
        if rows_share_pages:
            table[row, :count] = order[:count]
        else:
            table[row, :count] = order[taken : taken + count]
            taken += count
    if hole:
        row = max(range(batch), key=lambda r: needed[r]) if batch > 1 else 0
        if needed[row] > 2:
            table[row, 1] = -1
    device_gen = torch.Generator(device=kit.device).manual_seed(seed + 1)
    pool = torch.empty(num_pages, PAGE * HEAD_DIM * 2, dtype=torch.uint8, device=kit.device)
    pool.view(torch.bfloat16).normal_(generator=device_gen)
    q = torch.randn(batch, 1, kit.sizes.heads, HEAD_DIM, generator=device_gen, device=kit.device)
    weights = torch.randn(batch, kit.sizes.heads, generator=device_gen, device=kit.device)
    return (
        q.to(torch.bfloat16),
        pool.view(torch.bfloat16).view(num_pages, PAGE, 1, HEAD_DIM),
        weights * (HEAD_DIM * kit.sizes.heads) ** -0.5,
        torch.tensor(lengths, dtype=torch.int32).to(kit.device),
        table.to(kit.device),
        width,
    )


def decode_lengths(batch: int, keys: int) -> list:
    """Rows of a decode batch: near the full context, none a multiple of a page, and every
    fourth row much shorter (its table ends in -1 entries long before the others')."""
    lengths = []
    for row in range(batch):
        n = keys - 13 - (row * 61) % 200 if row % 4 != 3 else keys // 3 + 7
        lengths.append(max(1, n - (n % PAGE == 0)))
    return lengths


def prefill_lengths(rows: int, context: int) -> list:
    """One request's prefill chunk at compress ratio 4: a new key every 4 query tokens."""
    return [context + (t + 1) // 4 for t in range(rows)]


def release(kit):
    if kit.cuda:
        kit.torch.cuda.empty_cache()


# --- references and comparisons ---------------------------------------------------------------


def reference_logits(kit, args):
    """fp32, written independently of the kernels: row by row, the row's keys gathered densely
    through its page table, scores by one matmul, the head sum by another (TF32 off)."""
    torch = kit.torch
    q, kv, weights, seq_lens, table, width = args
    out = torch.full((q.shape[0], width), float("-inf"), dtype=torch.float32, device=q.device)
    keys_by_page = kv[:, :, 0, :]
    lengths = seq_lens.view(-1).tolist()
    for row, n in enumerate(lengths):
        n = min(n, width, table.shape[1] * PAGE)
        if n <= 0:
            continue
        pages = table[row, : cdiv(n, PAGE)].long()
        keys = keys_by_page[pages.clamp(min=0)].reshape(-1, HEAD_DIM)[:n].float()
        scores = torch.relu(keys @ q[row, 0].float().t())
        logits = scores @ weights[row].float()
        present = (pages >= 0).repeat_interleave(PAGE)[:n]
        out[row, :n] = torch.where(present, logits, torch.full_like(logits, float("-inf")))
    return out


def within_lengths(kit, logits, seq_lens):
    """Positions at or past a row's length are -inf in the result: the contract covers only
    t < seq_len there (the top-k step reads no further), so a kernel may leave them unwritten."""
    torch = kit.torch
    positions = torch.arange(logits.shape[1], device=logits.device)
    inside = positions.unsqueeze(0) < seq_lens.view(-1, 1)
    return torch.where(inside, logits, torch.full_like(logits, float("-inf")))


def compare(kit, got, ref, seq_lens) -> dict:
    """Max relative error (max |got - ref| over max |ref|, finite reference positions), the same
    -inf positions, and top-512 agreement per row (share of the reference's top 512 the result
    also picks; a miss counts only if the reference does not tie it with the 512th key)."""
    torch = kit.torch
    got = within_lengths(kit, got.float(), seq_lens)
    ref = within_lengths(kit, ref.float(), seq_lens)
    same_inf = bool(torch.equal(torch.isneginf(got), torch.isneginf(ref)))
    finite = torch.isfinite(ref)
    if not bool(finite.any()):
        return {
            "max_rel_err": 0.0,
            "top512": 1.0,
            "strict_misses": 0,
            "same_inf": same_inf,
            "ok": same_inf,
        }
    scale = ref[finite].abs().max().clamp(min=1e-30)
    diff = (got[finite] - ref[finite]).abs()
    abs_err = diff.max() if bool(torch.isfinite(diff).all()) else torch.tensor(float("inf"))
    rel_err = float(abs_err / scale)
    k = min(TOPK, ref.shape[1])
    ref_top = ref.topk(k, dim=1)
    picked = torch.zeros_like(got, dtype=torch.bool).scatter_(1, got.topk(k, dim=1).indices, True)
    counted = torch.arange(k, device=ref.device).unsqueeze(0) < finite.sum(1, keepdim=True).clamp(
        max=k
    )
    hits = picked.gather(1, ref_top.indices) & counted
    kth_index = (counted.sum(1, keepdim=True) - 1).clamp(min=0)
    kth = ref_top.values.gather(1, kth_index)
    tie = 2 * float(abs_err) + 1e-6 * float(scale)
    strict = counted & ~hits & (ref_top.values - kth > tie)
    agreement = float(hits.sum()) / max(1, int(counted.sum()))
    strict_misses = int(strict.sum())
    ok = same_inf and rel_err <= MAX_REL_ERR and strict_misses == 0
    return {
        "max_rel_err": rel_err,
        "top512": agreement,
        "strict_misses": strict_misses,
        "same_inf": same_inf,
        "ok": ok,
    }


# --- timing ----------------------------------------------------------------------------------


def time_us(kit, fn) -> float:
    """Mean microseconds per call: CUDA events on a GPU (warm-up first, then enough calls to
    fill the minimum timing window), wall clock on the CPU."""
    torch = kit.torch
    sizes = kit.sizes
    if not kit.cuda:
        fn()
        start = time.perf_counter()
        for _ in range(sizes.min_iters):
            fn()
        return (time.perf_counter() - start) / sizes.min_iters * 1e6
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once_s = max(start.elapsed_time(end) / 1e3, 1e-6)
    iters = max(sizes.min_iters, min(500, int(sizes.min_timing_s / once_s)))
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


# --- stages ----------------------------------------------------------------------------------


def stage_environment(kit, rec):
    torch = kit.torch
    env = kit.report["environment"]
    env.update(
        python=platform.python_version(),
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        platform=platform.platform(),
        triton_interpret=os.environ.get("TRITON_INTERPRET", ""),
    )
    try:
        env["triton"] = import_module("triton").__version__
    except ImportError as exc:
        env["triton"] = f"not importable ({one_line(exc)})"
    env["sglang"] = kit.sglang_version or kit.sglang_absent
    env["deep_gemm"] = "importable" if util.find_spec("deep_gemm") else "absent"
    if kit.cuda:
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=torch.cuda.get_device_name(0),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            sm_count=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
        )
    else:
        env.update(gpu="cpu", capability="cpu", sm_count=os.cpu_count(), memory_gib=None)
    env["kernel_package"] = str(Path(kit.kernels.logits.__file__).parent)
    env["launch_api"] = kit.kernels.launch_api()
    env["launch_candidates"] = len(kit.kernels.launch_candidates())
    try:
        default = kit.kernels.default_config(kit.device)
        env["launch_config_for_this_device"] = "not present" if default is None else default
    except Exception as exc:  # report it; the sweep stage still measures
        env["launch_config_for_this_device"] = f"error: {one_line(exc)}"
    env["fused_rotations"] = rotation_kernels(kit) and "present" or "not present"

    # Device copy bandwidth: read + write bytes of a large copy over its time (as bandwidthTest).
    n = kit.sizes.copy_bytes
    src = torch.empty(n, dtype=torch.uint8, device=kit.device).fill_(1)
    dst = torch.empty_like(src)
    us = time_us(kit, functools.partial(dst.copy_, src))
    env["copy_bandwidth_gbps"] = round(2 * n / (us * 1e-6) / 1e9, 1)
    env["copy_bytes"] = n
    del src, dst
    release(kit)
    rec["ok"] = True


def stage_correctness(kit, rec):
    sizes = kit.sizes
    cases = [
        (f"decode B={b} keys={k}", decode_lengths(b, k), k, False)
        for k in sizes.decode_keys
        for b in sizes.decode_batches
    ]
    prefill = []
    for rows, context in sizes.prefill:
        prefill.append(prefill_lengths(rows, context))
    prefill_width = max(max(p) for p in prefill)
    rec["planned"] = len(cases) + len(prefill)
    for name, lengths, width, _ in cases:
        args = build_case(kit, lengths, width, seed=len(rec["cases"]))
        rec["cases"].append(check_case(kit, name, args, chunk_rows=None))
        del args
        release(kit)
    for index, lengths in enumerate(prefill):
        args = build_case(kit, lengths, prefill_width, rows_share_pages=True, seed=100 + index)
        name = f"prefill rows={len(lengths)} keys={lengths[0]}..{lengths[-1]}"
        rec["cases"].append(check_case(kit, name, args, chunk_rows=sizes.prefill_chunk_rows))
        del args
        release(kit)
    rec["rotation_cases"] = rotation_correctness_cases(kit)
    if not rec["rotation_cases"]:
        rec["notes"].append("fused rotations (Triton): not present in this kernel package")
    rec["ok"] = (
        all(c["ok"] for c in rec["cases"] + rec["rotation_cases"])
        and len(rec["cases"]) == rec["planned"]
    )


def check_case(kit, name, args, chunk_rows):
    """Triton and the torch path against the fp32 reference (and each other). With chunk_rows,
    the Triton kernel is called in row chunks, as the prefill indexer calls it, and the chunks
    together must equal one whole call bit for bit."""
    torch = kit.torch
    started = time.perf_counter()
    seq_lens = args[3]
    if chunk_rows:
        parts = []
        for start in range(0, args[0].shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            parts.append(
                kit.kernels.triton(
                    args[0][rows], args[1], args[2][rows], seq_lens[rows], args[4][rows], args[5]
                )
            )
        triton_out = torch.cat(parts)
    else:
        triton_out = kit.kernels.triton(*args)
    torch_out = kit.kernels.torch_path(*args)
    ref = reference_logits(kit, args)
    vs_ref = compare(kit, triton_out, ref, seq_lens)
    torch_vs_ref = compare(kit, torch_out, ref, seq_lens)
    vs_torch = compare(kit, triton_out, torch_out, seq_lens)
    case = {
        "case": name,
        "rows": int(args[0].shape[0]),
        "keys": int(args[5]),
        "triton_rel_err": vs_ref["max_rel_err"],
        "torch_rel_err": torch_vs_ref["max_rel_err"],
        "triton_vs_torch_rel_err": vs_torch["max_rel_err"],
        "triton_top512": vs_ref["top512"],
        "torch_top512": torch_vs_ref["top512"],
        "triton_strict_misses": vs_ref["strict_misses"],
        "same_inf": vs_ref["same_inf"] and torch_vs_ref["same_inf"],
        "ok": vs_ref["ok"] and torch_vs_ref["ok"] and vs_torch["ok"],
    }
    if chunk_rows:
        whole = kit.kernels.triton(*args)
        same = torch.equal(
            within_lengths(kit, whole, seq_lens), within_lengths(kit, triton_out, seq_lens)
        )
        case["chunk_rows"] = chunk_rows
        case["chunks_equal_whole"] = bool(same)
        case["ok"] = case["ok"] and bool(same)
    case["seconds"] = round(time.perf_counter() - started, 2)
    kit.progress(
        f"  {name}: {'ok' if case['ok'] else 'FAILED'} "
        f"(rel err {case['triton_rel_err']:.1e}, top-512 {case['triton_top512']:.4f})"
    )
    return case


def mutate_decode_inputs(kit, args, seed):
    """New lengths, a reshuffled page table (other -1 places) and new queries and weights, in the
    captured tensors' own storage."""
    torch = kit.torch
    q, kv, weights, seq_lens, table, width = args
    gen = torch.Generator().manual_seed(seed)
    batch = q.shape[0]
    num_pages = kv.shape[0]
    lengths = torch.randint(1, width + 1, (batch,), generator=gen, dtype=torch.int32)
    new_table = torch.full(tuple(table.shape), -1, dtype=torch.int32)
    for row in range(batch):
        count = cdiv(int(lengths[row]), PAGE)
        new_table[row, :count] = torch.randperm(num_pages, generator=gen)[:count].to(torch.int32)
        if count > 3:
            new_table[row, count // 2] = -1
    seq_lens.copy_(lengths.to(seq_lens.device))
    table.copy_(new_table.to(table.device))
    q.copy_(torch.randn(tuple(q.shape), generator=gen).to(q.dtype).to(q.device))
    weights.copy_(torch.randn(tuple(weights.shape), generator=gen).to(weights.device))


def capture(kit, fn, args):
    """Capture fn(*args) in a CUDA graph: (replay, the graph's output tensor)."""
    torch = kit.torch
    fn(*args)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn(*args)

    def replay():
        graph.replay()
        torch.cuda.synchronize()

    return replay, output


def stage_cuda_graphs(kit, rec):
    width = kit.sizes.graph_keys
    kernels = (("triton", kit.kernels.triton), ("torch path", kit.kernels.torch_path))
    for batch in kit.sizes.decode_batches:
        for name, fn in kernels:
            args = build_case(kit, decode_lengths(batch, width), width, seed=200 + batch)
            replay, captured = capture(kit, fn, args)
            replay()
            before = captured.clone()
            mutate_decode_inputs(kit, args, seed=batch)
            replay()
            eager = fn(*args)
            lengths = args[3]
            same = kit.torch.equal(
                within_lengths(kit, captured, lengths), within_lengths(kit, eager, lengths)
            )
            changed = not kit.torch.equal(
                within_lengths(kit, before, lengths), within_lengths(kit, captured, lengths)
            )
            rec["cases"].append(
                {
                    "case": f"logits {name} B={batch} keys={width}",
                    "bit_equal": bool(same),
                    "replay_saw_new_inputs": changed,
                    "ok": bool(same) and changed,
                }
            )
            del replay, captured, eager, before, args
            release(kit)
    rec["cases"].extend(graph_rotation_cases(kit))
    rec["ok"] = all(c["ok"] for c in rec["cases"])


def rotation_inputs(kit, tokens, heads, seed):
    torch = kit.torch
    gen = torch.Generator(device=kit.device).manual_seed(seed)
    x = torch.randn(tokens, heads, HEAD_DIM, generator=gen, device=kit.device).to(torch.bfloat16)
    angles = torch.rand(tokens, 32, generator=gen, device=kit.device) * 6.28
    freqs = torch.polar(torch.ones_like(angles), angles)
    return x, freqs


def torch_rotations(kit):
    """The bf16 path's query and key rotations as the torch reference runs them."""
    rot = kit.kernels.rotation

    def query(x, freqs):
        return rot.hadamard_rotate(rot.apply_rope_tail(x, freqs)).to(kit.torch.bfloat16)

    def key(x, freqs):
        return rot.hadamard_rotate(rot.apply_rope_tail(x[:, 0], freqs)).to(kit.torch.bfloat16)

    return {"query rotation (torch)": query, "key rotation (torch)": key}


@dataclass(frozen=True)
class FusedRotation:
    """A fused Triton rotation and its torch reference, with how to build inputs and run it."""

    fused: object
    reference: object
    inputs: object  # (kit, rows, seed) -> argument list; the first one receives a store
    returns_output: bool  # False: the function stores into its first argument

    def run(self, fn, args):
        out = fn(*args)
        return out if self.returns_output else args[0]


ROPE_POSITIONS = 4096


def query_rotation_inputs(kit, tokens, seed):
    """The indexer query: q [T, H, 128] bf16, the RoPE table, each token's position."""
    torch = kit.torch
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, kit.sizes.heads, HEAD_DIM, generator=gen).to(torch.bfloat16)
    angles = torch.rand(ROPE_POSITIONS, 32, generator=gen) * 6.28
    freqs = torch.polar(torch.ones_like(angles), angles)
    positions = torch.randint(0, ROPE_POSITIONS, (tokens,), generator=gen)
    return [t.to(kit.device) for t in (q, freqs, positions)]


def key_store_inputs(kit, rows, seed):
    """A decode step's key write: compressed rows kv [N, 128], one per request; rows whose
    seq_len is not a multiple of 4 complete no key and must not be written."""
    torch = kit.torch
    gen = torch.Generator().manual_seed(seed)
    slots = 4 * rows + 16
    pool = torch.randn(slots, HEAD_DIM, generator=gen).to(torch.bfloat16)
    kv = torch.randn(rows, HEAD_DIM, generator=gen) * 3
    norm_weight = torch.rand(HEAD_DIM, generator=gen) + 0.5
    angles = torch.rand(ROPE_POSITIONS, 32, generator=gen) * 6.28
    freqs = torch.polar(torch.ones_like(angles), angles)
    plan = torch.zeros(rows, 4, dtype=torch.int32)
    plan[:, 0] = torch.randint(4, ROPE_POSITIONS, (rows,), generator=gen, dtype=torch.int32)
    plan[::3, 0] = plan[::3, 0] // 4 * 4
    plan[1::3, 0] = plan[1::3, 0] // 4 * 4 + 1  # every third row completes no key this step
    out_loc = torch.randperm(slots, generator=gen)[:rows]
    tensors = [t.to(kit.device) for t in (pool, kv, norm_weight)]
    return [
        *tensors,
        1e-6,
        freqs.to(kit.device),
        plan.to(kit.device),
        out_loc.to(kit.device),
        4,
        True,
    ]


def rotation_kernels(kit) -> dict:
    """The fused Triton rotations the kernel package has: {label: FusedRotation}."""
    fused_module = kit.kernels.rotation_triton
    if fused_module is None:
        return {}
    reference_module = kit.kernels.rotation
    candidates = (
        (
            "query rotation",
            "index_query_bf16_triton",
            "index_query_bf16_torch",
            query_rotation_inputs,
            True,
        ),
        (
            "key write",
            "store_index_keys_bf16_triton",
            "store_index_keys_bf16_torch",
            key_store_inputs,
            False,
        ),
    )
    found = {}
    for label, fused_name, reference_name, inputs, returns_output in candidates:
        fused = getattr(fused_module, fused_name, None)
        reference = getattr(reference_module, reference_name, None)
        if fused is not None and reference is not None:
            found[label] = FusedRotation(fused, reference, inputs, returns_output)
    return found


def clone_args(args):
    return [a.clone() if hasattr(a, "clone") else a for a in args]


def rotation_correctness_cases(kit) -> list:
    """Each fused rotation against its torch reference: bf16 results within one rounding of
    each other (both compute in fp32 and round once: at most one bf16 ulp apart, beside fp32
    noise), the share of bit-equal values reported."""
    torch = kit.torch
    cases = []
    for label, op in rotation_kernels(kit).items():
        for rows in kit.sizes.rotation_rows:
            args = op.inputs(kit, rows, seed=700 + rows)
            fused = op.run(op.fused, clone_args(args)).float()
            ref = op.run(op.reference, clone_args(args)).float()
            # one bf16 ulp of the value, plus the rotation's own noise, 2^-14 of the row's largest
            # value (fp32 sums in another order, or a fused kernel's fp32 operand split into two
            # bf16 parts: about 2^-17 of |x|): values that nearly cancel may round either way
            # at a bf16 scale of their own. A wrong rotation is off by far more.
            row_scale = ref.abs().amax(dim=-1, keepdim=True)
            ulp = (ref.abs() * 2.0**-7 + row_scale * 2.0**-14).clamp(min=2.0**-126)
            worst = float(((fused - ref).abs() / ulp).max())
            cases.append(
                {
                    "case": f"{label} rows={rows}",
                    "max_err_in_bf16_ulps": worst,
                    "bit_equal_share": float((fused == ref).float().mean()),
                    "ok": worst <= 1.0 and bool(torch.isfinite(fused).all()),
                }
            )
            kit.progress(f"  {label} rows={rows}: {'ok' if cases[-1]['ok'] else 'FAILED'}")
    return cases


def graph_fused_rotation_cases(kit) -> list:
    """Each fused rotation captured at the decode batch sizes, replayed on new inputs (a store
    from a fresh pool), bit-equal to an eager call on copies of the same inputs."""
    torch = kit.torch
    cases = []
    for label, op in rotation_kernels(kit).items():
        for batch in kit.sizes.decode_batches:
            args = op.inputs(kit, batch, seed=800 + batch)

            def fn(*a, op=op):
                return op.run(op.fused, a)

            replay, captured = capture(kit, fn, args)
            for old, new in zip(args, op.inputs(kit, batch, seed=900 + batch), strict=True):
                if hasattr(old, "copy_"):
                    old.copy_(new)
            eager = fn(*clone_args(args))
            before = captured.clone()
            replay()
            same = torch.equal(captured, eager)
            changed = not torch.equal(before, captured)
            cases.append(
                {
                    "case": f"{label} (fused) B={batch}",
                    "bit_equal": bool(same),
                    "replay_saw_new_inputs": changed,
                    "ok": bool(same) and changed,
                }
            )
    return cases


def rotation_speed_cases(kit) -> list:
    cases = []
    for label, op in rotation_kernels(kit).items():
        for rows in kit.sizes.rotation_speed_rows:
            args = op.inputs(kit, rows, seed=1000 + rows)
            fused_us = time_us(kit, functools.partial(op.run, op.fused, args))
            torch_us = time_us(kit, functools.partial(op.run, op.reference, args))
            cases.append(
                {
                    "case": f"{label} rows={rows}",
                    "fused_us": fused_us,
                    "torch_us": torch_us,
                    "torch_over_fused": torch_us / fused_us,
                }
            )
    return cases


def graph_rotation_cases(kit):
    cases = []
    for batch in kit.sizes.decode_batches:
        for name, fn in torch_rotations(kit).items():
            x, freqs = rotation_inputs(kit, batch, kit.sizes.heads, seed=300 + batch)
            replay, captured = capture(kit, fn, (x, freqs))
            replay()
            before = captured.clone()
            new_x, new_freqs = rotation_inputs(kit, batch, kit.sizes.heads, seed=400 + batch)
            x.copy_(new_x)
            freqs.copy_(new_freqs)
            replay()
            same = kit.torch.equal(captured, fn(x, freqs))
            changed = not kit.torch.equal(before, captured)
            cases.append(
                {
                    "case": f"{name} B={batch}",
                    "bit_equal": bool(same),
                    "replay_saw_new_inputs": changed,
                    "ok": bool(same) and changed,
                }
            )
    if rotation_kernels(kit):
        cases.extend(graph_fused_rotation_cases(kit))
    else:
        cases.append({"case": "fused rotations (Triton)", "status": "not present", "ok": True})
    return cases


def fp8_steps(kit, args):
    """fp8 paged-logits steps at the same shape as `args`: upstream's (sglang importable: the
    sm_120 torch path, TileLang, DeepGEMM when they run here), else the project's fp8-emulating
    torch step, labelled as such. Returns {label: zero-argument callable}."""
    ref = kit.kernels.reference
    q, kv, weights, seq_lens, table, width = args
    keys = kv.reshape(-1, HEAD_DIM).float()
    k8, k_scale = ref.quantize_index_fp8(keys)
    del keys
    pages = ref.pack_fp8_index_pages(k8, k_scale)
    del k8, k_scale
    q8, q_scale = ref.quantize_index_fp8(q[:, 0].float())
    q8 = q8.unsqueeze(1)
    fp8_weights = (weights * q_scale).contiguous()
    steps = {}
    if kit.sglang_version:
        indexer = import_module("sglang.srt.layers.attention.dsv4.indexer")
        fn = indexer.fp8_paged_mqa_logits_torch_sm120
        steps["fp8 torch sm120 (upstream)"] = lambda: fn(
            q8, pages, fp8_weights, seq_lens, table, None, width, False
        )
        if kit.cuda:
            steps.update(upstream_fp8_kernels(q8, pages, fp8_weights, seq_lens, table, width))
    if not steps:
        steps["fp8 torch emulation (project reference)"] = lambda: fp8_emulated_logits(
            kit, q8, pages, fp8_weights, seq_lens, table, width
        )
    return steps


def upstream_fp8_kernels(q8, pages, weights, seq_lens, table, width) -> dict:
    """Upstream's fp8 kernels that are installed. One that is installed but cannot be set up on
    this GPU becomes a step that raises, so the speed table says why it did not run."""
    steps = {}
    try:
        from sglang.kernels.ops.attention.dsa.tilelang_kernel import tilelang_fp8_paged_mqa_logits

        steps["fp8 tilelang (upstream)"] = functools.partial(
            tilelang_fp8_paged_mqa_logits, q8, pages, weights, seq_lens, table, None, width, False
        )
    except ModuleNotFoundError:  # TileLang not installed
        pass
    except Exception as exc:
        steps["fp8 tilelang (upstream)"] = functools.partial(raise_again, exc)
    try:
        import deep_gemm

        lens = seq_lens.view(-1, 1)
        meta = deep_gemm.get_paged_mqa_logits_metadata(lens, PAGE, deep_gemm.get_num_sms())
        steps["fp8 DeepGEMM"] = functools.partial(
            deep_gemm.fp8_paged_mqa_logits, q8, pages, weights, lens, table, meta, width, False
        )
    except ModuleNotFoundError:  # DeepGEMM not installed
        pass
    except Exception as exc:  # e.g. no kernels for this architecture
        steps["fp8 DeepGEMM"] = functools.partial(raise_again, exc)
    return steps


def raise_again(exc):
    raise exc


def fp8_emulated_logits(kit, q8, pages, weights, seq_lens, table, width):
    """An fp8 paged-logits step in plain torch, as the fp8 pool is read: 132-byte keys (128 e4m3
    values + an fp32 scale per key, upstream's page layout), e4m3 query, fp32 accumulation, in
    bounded page steps. Not a kernel: a stand-in for the fp8 side where upstream is absent."""
    torch = kit.torch
    batch, heads = q8.shape[0], q8.shape[2]
    flat = pages.view(pages.shape[0], -1)
    values = flat[:, : PAGE * HEAD_DIM].view(torch.float8_e4m3fn).view(-1, PAGE, HEAD_DIM)
    scales = flat[:, PAGE * HEAD_DIM :].contiguous().view(torch.float32)
    query = q8[:, 0].float().transpose(1, 2)
    out = torch.full((batch, width), float("-inf"), dtype=torch.float32, device=q8.device)
    cols = min(table.shape[1], cdiv(width, PAGE))
    step = max(1, (256 << 20) // max(1, batch * PAGE * (HEAD_DIM + heads) * 4))
    lengths = seq_lens.view(-1, 1)
    for first in range(0, cols, step):
        part = table[:, first : first + step]
        index = part.clamp(min=0).long()
        keys = values[index].float().reshape(batch, -1, HEAD_DIM)
        scores = torch.bmm(keys, query).relu_().mul_(weights.unsqueeze(1)).sum(2)
        scores = scores * scales[index].reshape(batch, -1)
        positions = first * PAGE + torch.arange(scores.shape[1], device=q8.device)
        valid = (positions.unsqueeze(0) < lengths) & (part >= 0).repeat_interleave(PAGE, 1)
        end = min(width, (first + part.shape[1]) * PAGE)
        out[:, first * PAGE : end] = scores.masked_fill(~valid, float("-inf"))[
            :, : end - first * PAGE
        ]
    return out


def step_bytes(args) -> int:
    """Index-K bytes a decode step reads (each row's keys, up to its length) plus the query."""
    q, _, _, seq_lens, _, width = args
    keys = int(seq_lens.view(-1).clamp(max=width).sum())
    return keys * BF16_KEY_BYTES + q.numel() * q.element_size()


def stage_speed(kit, rec):
    bandwidth = kit.report["environment"].get("copy_bandwidth_gbps")
    for batch, keys in kit.sizes.speed_cases:
        args = build_case(kit, decode_lengths(batch, keys), keys, seed=500 + batch)
        row = {"case": f"decode B={batch} keys={keys}", "batch": batch, "keys": keys}
        row["triton_us"] = time_us(kit, functools.partial(kit.kernels.triton, *args))
        row["torch_us"] = time_us(kit, functools.partial(kit.kernels.torch_path, *args))
        row["torch_over_triton"] = row["torch_us"] / row["triton_us"]
        achieved = step_bytes(args) / (row["triton_us"] * 1e-6) / 1e9
        row["achieved_gbps"] = achieved
        row["roofline_fraction"] = achieved / bandwidth if bandwidth else None
        row["fp8_us"] = {}
        row["fp8_errors"] = {}
        for label, fn in fp8_steps(kit, args).items():
            try:
                row["fp8_us"][label] = time_us(kit, fn)
            except Exception as exc:  # an optional fp8 kernel that does not run here: say why
                row["fp8_errors"][label] = one_line(exc)
        row["bf16_over_fp8"] = {k: row["triton_us"] / v for k, v in row["fp8_us"].items()}
        rec["cases"].append(row)
        kit.progress(
            f"  {row['case']}: triton {row['triton_us']:.1f} us, torch {row['torch_us']:.1f} us"
        )
        del args
        release(kit)
    rec["rotation_cases"] = rotation_speed_cases(kit)
    rec["ok"] = True


def stage_launch_sweep(kit, rec):
    batch, keys = kit.sizes.sweep_case
    args = build_case(kit, decode_lengths(batch, keys), keys, seed=600)
    expected = kit.kernels.torch_path(*args)
    rec["shape"] = f"B={batch} keys={keys} heads={kit.sizes.heads}"
    candidates = kit.kernels.launch_candidates()
    rec["planned"] = len(candidates)
    try:
        default = kit.kernels.default_config(kit.device)
    except Exception:
        default = None
    rec["default_config"] = default
    try:
        rec["default_us"] = time_us(kit, functools.partial(kit.kernels.triton, *args))
        for config in candidates:
            row = {"config": config}
            try:
                check = compare(kit, kit.kernels.launch(args, config), expected, args[3])
                row["ok"] = check["ok"]
                row["max_rel_err"] = check["max_rel_err"]
                if row["ok"]:
                    row["us"] = time_us(kit, functools.partial(kit.kernels.launch, args, config))
            except Exception as exc:  # a config this GPU cannot run (e.g. shared memory)
                row["ok"] = None
                row["error"] = one_line(exc)
            rec["cases"].append(row)
    except StageTimeout:
        rec["notes"].append(
            f"budget ran out after {len(rec['cases'])} of {len(candidates)} configs"
        )
        finish_sweep(kit, rec)
        raise
    finally:
        del args, expected
        release(kit)
    finish_sweep(kit, rec)


def finish_sweep(kit, rec):
    """Pick the fastest correct config and write it, keyed by this device's name."""
    wrong = [c for c in rec["cases"] if c.get("ok") is False]
    timed = [c for c in rec["cases"] if c.get("ok") and "us" in c]
    rec["ok"] = not wrong
    if wrong:
        rec["notes"].append(f"{len(wrong)} launch config(s) gave wrong logits")
    if not timed:
        rec["notes"].append("no config ran correctly: nothing to record")
        return
    best = min(timed, key=lambda c: c["us"])
    env = kit.report["environment"]
    rec["best"] = best
    if rec.get("default_us"):
        rec["default_over_best"] = rec["default_us"] / best["us"]
    entry = {
        "capability": env.get("capability"),
        "config": best["config"],
        "measured": {
            "shape": rec["shape"],
            "us": round(best["us"], 2),
            "configs_timed": len(timed),
            "date": kit.report["started"][:10],
        },
    }
    kit.tuned = {env.get("gpu"): entry}
    (kit.out / "tuned_launch.json").write_text(json.dumps(kit.tuned, indent=2) + "\n")


def stage_sglang(kit, rec):
    """The real pool and the patched indexer, one decode step on this device vs the CPU (the
    smoke run has only the CPU: there it checks that the stage itself still runs)."""
    from benchmark.gpu_check_sglang import compare_steps, run_decode_step_on

    cpu = run_decode_step_on("cpu")
    other = run_decode_step_on(kit.device)
    result = compare_steps(cpu, other)
    rec["cases"].append({"case": f"decode step, pool on {kit.device} vs cpu", **result})
    rec["ok"] = result["ok"]


STAGE_FUNCTIONS = {
    "environment": stage_environment,
    "correctness": stage_correctness,
    "cuda_graphs": stage_cuda_graphs,
    "speed": stage_speed,
    "launch_sweep": stage_launch_sweep,
    "sglang": stage_sglang,
}


# --- targets ---------------------------------------------------------------------------------


def targets(kit) -> list:
    """The issue's performance targets as pass / fail lines (never the exit status)."""
    stages = kit.report["stages"]
    lines = []
    if not kit.cuda:
        for name in (
            "roofline >= 70 % at B=32, 80k keys",
            "bf16 step <= 2.1x fp8 step",
            "bf16 >= 1.5x faster than upstream's fp8 torch path (sm_120)",
            "graph replay == eager, bit for bit",
        ):
            lines.append({"target": name, "status": "skipped (no CUDA)"})
        return lines
    target = next(
        (
            c
            for c in stages.get("speed", {}).get("cases", [])
            if (c["batch"], c["keys"]) == tuple(kit.sizes.target_case)
        ),
        None,
    )

    def line(name, value, passed, detail=""):
        status = "n/a" if passed is None else ("PASS" if passed else "FAIL")
        lines.append({"target": name, "status": status, "value": value, "detail": detail})

    if target is None:
        line("roofline >= 70 % at B=32, 80k keys", None, None, "speed stage did not measure it")
        line("bf16 step <= 2.1x fp8 step", None, None, "speed stage did not measure it")
        line(
            "bf16 >= 1.5x faster than upstream's fp8 torch path (sm_120)",
            None,
            None,
            "speed stage did not measure it",
        )
    else:
        fraction = target.get("roofline_fraction")
        line(
            "roofline >= 70 % at B=32, 80k keys",
            fraction,
            None if fraction is None else fraction >= 0.70,
        )
        kernels = {k: v for k, v in target["fp8_us"].items() if "torch" not in k}
        if kernels:
            label = min(kernels, key=kernels.get)
            ratio = target["bf16_over_fp8"][label]
            line("bf16 step <= 2.1x fp8 step", ratio, ratio <= 2.1, f"vs {label}")
        elif target["fp8_us"]:
            label = next(iter(target["fp8_us"]))
            ratio = target["bf16_over_fp8"][label]
            line(
                "bf16 step <= 2.1x fp8 step",
                ratio,
                None,
                f"only {label} here: a torch step, not an fp8 kernel; indicative only",
            )
        else:
            line("bf16 step <= 2.1x fp8 step", None, None, "no fp8 step ran")
        upstream = target["fp8_us"].get("fp8 torch sm120 (upstream)")
        capability = kit.report["environment"].get("capability")
        if upstream is None:
            line(
                "bf16 >= 1.5x faster than upstream's fp8 torch path (sm_120)",
                None,
                None,
                f"upstream's path did not run: sglang {kit.sglang_absent or 'present'}",
            )
        else:
            speedup = upstream / target["triton_us"]
            line(
                "bf16 >= 1.5x faster than upstream's fp8 torch path (sm_120)",
                speedup,
                speedup >= 1.5,
                "" if capability == "12.0" else f"measured on sm {capability}",
            )
    graphs = stages.get("cuda_graphs", {})
    if graphs.get("cases"):
        equal = all(c.get("bit_equal", True) for c in graphs["cases"])
        line("graph replay == eager, bit for bit", equal, equal)
    else:
        line("graph replay == eager, bit for bit", None, None, graphs.get("status", "not run"))
    return lines


# --- running, budgets, reports ---------------------------------------------------------------


class Kit:
    def __init__(self, args):
        import torch

        self.torch = torch
        self.smoke = args.smoke
        self.cuda = not args.smoke
        self.device = "cuda" if self.cuda else "cpu"
        self.sizes = SMOKE_SIZES if args.smoke else GPU_SIZES
        self.out = args.out
        self.quiet = args.quiet
        self.kernels = Kernels()
        self.sglang_version, self.sglang_absent = sglang_version(args)
        self.tuned = None
        self.report = {
            "kit": "gpu_check",
            "mode": "smoke (CPU, TRITON_INTERPRET=1)" if args.smoke else "gpu",
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "environment": {},
            "budgets": {s.name: s.budget_s for s in STAGES},
            "budget_total_s": sum(s.budget_s for s in STAGES),
            "limit_s": LIMIT_S,
            "stages": {},
        }

    def progress(self, text):
        if not self.quiet:
            print(text, flush=True)


def sglang_version(args) -> tuple:
    """(sglang's version, None) when it is importable and wanted, else (None, why not). A GPU
    run uses it when present; the smoke run only with --with-sglang (its import takes seconds)."""
    if args.without_sglang:
        return None, "not used (--without-sglang)"
    if args.smoke and not args.with_sglang:
        return None, "not used (smoke run without --with-sglang)"
    if util.find_spec("sglang") is None:
        return None, "not importable"
    try:
        return import_module("sglang").__version__, None
    except Exception as exc:
        return None, f"not importable ({one_line(exc)})"


def on_alarm(signum, frame):
    raise StageTimeout()


def run_stage(kit, stage) -> dict:
    rec = {"status": "running", "budget_s": stage.budget_s, "cases": [], "notes": []}
    kit.report["stages"][stage.name] = rec
    if stage.needs_cuda and not kit.cuda:
        rec["status"] = "skipped (no CUDA)"
        return rec
    if stage.needs_sglang and not kit.sglang_version:
        rec["status"] = f"skipped (sglang {kit.sglang_absent})"
        return rec
    kit.progress(f"[{stage.name}] budget {stage.budget_s} s: {stage.what}")
    started = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, stage.budget_s)
    try:
        STAGE_FUNCTIONS[stage.name](kit, rec)
        rec["status"] = "passed" if rec.get("ok") else "FAILED"
    except StageTimeout:
        rec["status"] = "over budget (stopped)"
        rec["notes"].append(f"stopped at its {stage.budget_s} s budget")
    except Exception as exc:
        rec["status"] = "error"
        rec["error"] = one_line(exc)
        traceback.print_exc(file=sys.stderr)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        rec["seconds"] = round(time.perf_counter() - started, 2)
        if kit.cuda:
            kit.torch.cuda.synchronize()
            kit.torch.cuda.empty_cache()
    kit.progress(f"[{stage.name}] {rec['status']} in {rec['seconds']} s")
    return rec


def correctness_failures(kit) -> list:
    """Stages whose correctness is not proven: failed, erred, or stopped before the end."""
    failures = []
    for stage in STAGES:
        rec = kit.report["stages"].get(stage.name)
        status = "not run" if rec is None else rec.get("status", "not run")
        if rec is None or status.startswith("skipped"):
            continue
        if stage.proves_correctness and status != "passed":
            failures.append(f"{stage.name}: {status}")
        elif stage.name == "launch_sweep" and any(c.get("ok") is False for c in rec["cases"]):
            failures.append("launch_sweep: a launch config gave wrong logits")
    return failures


def result_line(kit, failures) -> str:
    if failures:
        return "correctness FAILED"
    if kit.smoke:
        return "smoke run passed (CPU interpreter; CUDA stages skipped, nothing proven on a GPU)"
    unproven = [
        s.name
        for s in STAGES
        if s.proves_correctness
        and s.name != "sglang"
        and kit.report["stages"].get(s.name, {}).get("status") != "passed"
    ]
    if unproven:
        return f"no correctness failure, but not run: {', '.join(unproven)}"
    return f"correctness proven on {kit.report['environment'].get('gpu')}"


def fmt(value, spec=".3g"):
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def markdown(kit) -> str:
    report = kit.report
    env = report["environment"]
    out = [
        f"# GPU proof kit: {env.get('gpu', '?')} (capability {env.get('capability', '?')})",
        "",
        f"Mode: {report['mode']}; started {report['started']}; "
        f"{report.get('seconds', 0):.0f} s of a {report['limit_s']} s limit. "
        f"Result: **{report.get('result', '?')}**.",
        "",
        f"torch {env.get('torch')}, triton {env.get('triton')}, Python {env.get('python')}, "
        f"CUDA {env.get('torch_cuda')}, sglang {env.get('sglang')}, DeepGEMM {env.get('deep_gemm')}; "
        f"{env.get('sm_count')} SMs; copy bandwidth {fmt(env.get('copy_bandwidth_gbps'))} GB/s; "
        f"launch API {env.get('launch_api')}; fused rotations {env.get('fused_rotations')}.",
        "",
        "| stage | status | seconds | budget s |",
        "| --- | --- | ---: | ---: |",
    ]
    for stage in STAGES:
        rec = report["stages"].get(stage.name, {"status": "not run"})
        status = rec["status"] + (f": {rec['error']}" if rec.get("error") else "")
        out.append(f"| {stage.name} | {status} | {fmt(rec.get('seconds'))} | {stage.budget_s} |")
    out += ["", "## Performance targets (reported only; they do not change the exit status)", ""]
    for line in report.get("targets", []):
        detail = f" ({line['detail']})" if line.get("detail") else ""
        out.append(f"- {line['status']}: {line['target']}: {fmt(line.get('value'))}{detail}")
    stages = report["stages"]
    if stages.get("correctness", {}).get("cases"):
        out += [
            "",
            "## Correctness (relative to the fp32 reference)",
            "",
            "| case | triton rel err | torch rel err | triton vs torch | triton top-512 "
            "| torch top-512 | -inf same | ok |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
        ]
        for c in stages["correctness"]["cases"]:
            out.append(
                f"| {c['case']} | {c['triton_rel_err']:.1e} | {c['torch_rel_err']:.1e} | "
                f"{c['triton_vs_torch_rel_err']:.1e} | {c['triton_top512']:.4f} | "
                f"{c['torch_top512']:.4f} | {fmt(c['same_inf'])} | {fmt(c['ok'])} |"
            )
    rotations = stages.get("correctness", {}).get("rotation_cases")
    if rotations:
        out += [
            "",
            "## Fused rotations vs their torch reference",
            "",
            "| case | max error (bf16 ulps) | bit-equal share | ok |",
            "| --- | ---: | ---: | --- |",
        ]
        for c in rotations:
            out.append(
                f"| {c['case']} | {c['max_err_in_bf16_ulps']:.2f} | "
                f"{c['bit_equal_share']:.4f} | {fmt(c['ok'])} |"
            )
    if stages.get("cuda_graphs", {}).get("cases"):
        out += [
            "",
            "## CUDA graphs (replay with new inputs vs eager)",
            "",
            "| case | bit-equal | replay saw new inputs | ok |",
            "| --- | --- | --- | --- |",
        ]
        for c in stages["cuda_graphs"]["cases"]:
            if "status" in c:
                out.append(f"| {c['case']} | {c['status']} | | |")
            else:
                out.append(
                    f"| {c['case']} | {fmt(c['bit_equal'])} | "
                    f"{fmt(c['replay_saw_new_inputs'])} | {fmt(c['ok'])} |"
                )
    if stages.get("speed", {}).get("cases"):
        timing = "us" if kit.cuda else "us (CPU interpreter: not a measurement)"
        out += [
            "",
            f"## Speed, ratios from this run ({timing})",
            "",
            "| case | triton | torch path | torch / triton | GB/s | roofline | fp8 step "
            "| bf16 / fp8 |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
        ]
        for c in stages["speed"]["cases"]:
            fp8 = "; ".join(f"{k} {v:.1f}" for k, v in c["fp8_us"].items()) or "-"
            ratios = "; ".join(f"{v:.2f}x" for v in c["bf16_over_fp8"].values()) or "-"
            out.append(
                f"| {c['case']} | {c['triton_us']:.1f} | {c['torch_us']:.1f} | "
                f"{c['torch_over_triton']:.1f}x | {c['achieved_gbps']:.0f} | "
                f"{fmt(c['roofline_fraction'], '.1%')} | {fp8} | {ratios} |"
            )
            for label, error in c.get("fp8_errors", {}).items():
                out.append(f"|  | {label} did not run: {error} | | | | | | |")
    for c in stages.get("speed", {}).get("rotation_cases", []):
        out.append(
            f"- {c['case']}: fused {c['fused_us']:.1f} us, torch {c['torch_us']:.1f} us "
            f"({c['torch_over_fused']:.1f}x)"
        )
    sweep = stages.get("launch_sweep", {})
    if sweep.get("cases"):
        out += [
            "",
            f"## Launch sweep at {sweep.get('shape')} (dispatcher default: "
            f"{fmt(sweep.get('default_us'), '.1f')} us)",
            "",
            "| config | ok | us |",
            "| --- | --- | ---: |",
        ]
        for c in sweep["cases"]:
            ok = c.get("error") or fmt(c.get("ok"))
            out.append(
                f"| `{json.dumps(c['config'], sort_keys=True)}` | {ok} | "
                f"{fmt(c.get('us'), '.1f')} |"
            )
        if sweep.get("best"):
            out.append(
                f"\nBest: `{json.dumps(sweep['best']['config'], sort_keys=True)}`, "
                f"written to tuned_launch.json."
            )
    if stages.get("sglang", {}).get("cases"):
        c = stages["sglang"]["cases"][0]
        out += [
            "",
            f"## sglang: {c['case']}: stored keys max rel diff "
            f"{c['keys_max_rel_diff']:.1e}, top-512 agreement {c['top512_agreement']:.4f}, "
            f"slots follow the page table {fmt(c['slots_follow_table'])}, ok {fmt(c['ok'])}",
        ]
    for stage in STAGES:
        for note in report["stages"].get(stage.name, {}).get("notes", []):
            out.append(f"\nNote ({stage.name}): {note}")
    return "\n".join(out) + "\n"


def write_reports(kit):
    kit.out.mkdir(parents=True, exist_ok=True)
    (kit.out / "gpu_check.json").write_text(json.dumps(kit.report, indent=2, default=str) + "\n")
    (kit.out / "gpu_check.md").write_text(markdown(kit))


def record_tuned(kit) -> str:
    """Merge this run's best launch config into the project's table (other GPUs kept)."""
    table = json.loads(TUNED_FILE.read_text()) if TUNED_FILE.exists() else {}
    table.update(kit.tuned)
    TUNED_FILE.write_text(json.dumps(dict(sorted(table.items())), indent=2) + "\n")
    return f"recorded {', '.join(kit.tuned)} in {TUNED_FILE.relative_to(REPO)}"


def plan_text() -> str:
    lines = ["stage          budget  needs        what"]
    for s in STAGES:
        needs = "+".join(n for n, f in (("CUDA", s.needs_cuda), ("sglang", s.needs_sglang)) if f)
        lines.append(f"{s.name:<14} {s.budget_s:>4} s  {needs or '-':<12} {s.what}")
    total = sum(s.budget_s for s in STAGES)
    lines.append(
        f"{'total':<14} {total:>4} s  (limit {LIMIT_S} s; a stage past its budget is stopped; "
        f"the watchdog ends the run at {total + WATCHDOG_MARGIN_S} s)"
    )
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmark.gpu_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "out" / "gpu-check",
        help="folder for gpu_check.json, gpu_check.md, tuned_launch.json (default: %(default)s)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the same stages on the CPU: TRITON_INTERPRET=1, tiny shapes, seconds",
    )
    parser.add_argument(
        "--plan", action="store_true", help="print the stages and budgets; run nothing"
    )
    parser.add_argument(
        "--only",
        type=lambda s: [x for x in s.split(",") if x],
        help="comma-separated stages to run (environment always runs)",
    )
    parser.add_argument(
        "--record",
        action="store_true",
        help="merge the sweep's best config into sgl_kernel_dsv4/tuned_launch.json",
    )
    parser.add_argument(
        "--with-sglang",
        action="store_true",
        help="smoke run: use sglang too when importable (slow to import)",
    )
    parser.add_argument(
        "--without-sglang",
        action="store_true",
        help="act as on a host without sglang even when it is importable",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    names = {s.name for s in STAGES}
    if args.only and not set(args.only) <= names:
        parser.error(
            f"--only: unknown stage(s) {sorted(set(args.only) - names)}; "
            f"stages: {', '.join(s.name for s in STAGES)}"
        )
    if args.record and args.smoke:
        parser.error("--record keeps GPU measurements only; it cannot go with --smoke")
    if args.with_sglang and args.without_sglang:
        parser.error("--with-sglang and --without-sglang contradict each other")
    return args


def prepare_imports(smoke: bool):
    """The kernel package from this tree, and the interpreter chosen before Triton loads."""
    if smoke:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise KitError("--smoke needs TRITON_INTERPRET=1 before Triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    for path in (str(KERNEL_PATH), str(REPO)):
        if path not in sys.path:
            sys.path.insert(0, path)
    if util.find_spec("sgl_kernel_dsv4") is None:
        raise KitError(f"sgl_kernel_dsv4 not importable (looked in {KERNEL_PATH})")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plan:
        print(plan_text())
        return EXIT_OK
    try:
        prepare_imports(args.smoke)
        import torch

        if not args.smoke and not torch.cuda.is_available():
            raise KitError(
                "no CUDA device (torch.cuda.is_available() is False); --smoke runs the CPU dry run"
            )
        kit = Kit(args)
    except KitError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    kit.out.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    # Past every budget plus a margin, something hangs on the device: write what there is, stop.
    watchdog = threading.Timer(
        kit.report["budget_total_s"] + WATCHDOG_MARGIN_S, hard_stop, args=(kit,)
    )
    watchdog.daemon = True
    watchdog.start()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        for stage in STAGES:
            if args.only and stage.name != "environment" and stage.name not in args.only:
                continue
            run_stage(kit, stage)
    finally:
        signal.signal(signal.SIGALRM, previous)
        watchdog.cancel()
    kit.report["seconds"] = round(time.perf_counter() - started, 1)
    kit.report["targets"] = targets(kit)
    failures = correctness_failures(kit)
    kit.report["correctness_failures"] = failures
    kit.report["result"] = result_line(kit, failures)
    kit.report["sglang_imported"] = "sglang" in sys.modules
    code = EXIT_CORRECTNESS if failures else EXIT_OK
    kit.report["exit_status"] = code
    write_reports(kit)
    if args.record:
        if kit.kernels.launch_api() != "config":
            # that launch() reads no table: a pages_per_program entry would only mislead
            print(
                "gpu_check: --record: this kernel package's launch() takes no config; "
                "nothing recorded",
                file=sys.stderr,
            )
        elif kit.tuned:
            print(f"gpu_check: {record_tuned(kit)}")
        else:
            print("gpu_check: --record: the sweep found no config to record", file=sys.stderr)
    for line in kit.report["targets"]:
        print(f"target {line['status']}: {line['target']}: {fmt(line.get('value'))}")
    print(
        f"gpu_check: {kit.report['result']} ({kit.report['seconds']} s); "
        f"report in {kit.out / 'gpu_check.md'}"
    )
    for failure in failures:
        print(f"gpu_check: correctness not proven: {failure}", file=sys.stderr)
    return code


def hard_stop(kit):
    kit.report["result"] = "stopped by the watchdog: the run outlived every budget"
    kit.report["exit_status"] = EXIT_CORRECTNESS
    try:
        write_reports(kit)
    finally:
        print(
            "gpu_check: stopped by the watchdog (a stage hung past every budget)", file=sys.stderr
        )
        os._exit(EXIT_CORRECTNESS)


if __name__ == "__main__":
    sys.exit(main())
