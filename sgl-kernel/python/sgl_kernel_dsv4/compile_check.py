"""Every Triton kernel of this package compiled ahead of time for a GPU that is not here.

Triton compiles for any target without a device (`triton.compile(ASTSource(...),
target=GPUTarget("cuda", 120, 32))`, with the ptxas and cuobjdump inside the triton wheel). This
module does that for each kernel at every launch configuration the dispatcher or the launch sweep
can choose, at DeepSeek-V4-Flash's indexer shapes (index_n_heads 64, head_dim 128, pages of 64
keys; and 128 heads, the widest the logits kernel takes), with the arguments the real launch
passes (`launch_args`, `query_launch_args`, `store_launch_args` build both), specialized as
Triton's runtime specializes them (alignment, multiples of 16, strides of 1).

Per kernel and config it reports shared memory, registers, spills, programs resident per SM from
the target's limits, the waves the GPU kit's shapes launch, and whether it fits (at least one
program resident, no spill). `sglang-dsv4 kernels` prints it; `record` / `passed_configs` keep
the logits configs that passed per target, and the tuned-launch loader
(`index_logits_triton.launch_config_for`) refuses a tuned config this check has not passed.

Residency follows CUDA's occupancy rules: per block 1 KB of shared memory reserved by the system
(compute capability >= 8.0) on top of what the kernel uses, shared memory in units of 128 B,
registers in units of 256 per warp, and the SM's caps on warps and blocks. It assumes the full
shared-memory carveout (Triton opts in above 48 KB).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sgl_kernel_dsv4.index_logits_triton import (  # noqa: F401  (the record's readers)
    RECORD_FILE,
    load_record,
    logits_source_digest,
    passed_configs,
)

INDEX_HEADS = 64  # DeepSeek-V4-Flash index_n_heads
HEAD_COUNTS = (64, 128)  # logits: the indexer's heads, and the most the kernel takes
# The GPU kit's shapes (benchmark/gpu_check, GPU sizes): decode batches x keys, rotation rows.
KIT_DECODE_BATCHES = (1, 8, 32, 64)
KIT_DECODE_KEYS = (8192, 32768, 81920)
KIT_ROTATION_ROWS = (64, 4096)
ROPE_POSITIONS = 4096
ROPE_PAIRS = 32


@dataclass(frozen=True)
class Target:
    """One GPU's limits (CUDA programming guide, compute capability tables) and SM count."""

    name: str
    capability: int
    gpu: str
    sm_count: int
    smem_per_sm: int  # shared memory per SM at the largest carveout
    smem_per_block: int  # the most one block may use (opt-in)
    regs_per_sm: int = 65536
    max_regs_per_thread: int = 255
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    reserved_smem_per_block: int = 1024
    smem_unit: int = 128
    regs_unit_per_warp: int = 256


TARGETS = {
    t.name: t
    for t in (
        Target("sm_120", 120, "RTX PRO 6000 Blackwell", 188, 102_400, 101_376,
               max_warps_per_sm=48),
        Target("sm_90", 90, "H100 SXM", 132, 233_472, 232_448),
        Target("sm_100", 100, "B200", 148, 233_472, 232_448),
    )
}


class CompileCheckError(RuntimeError):
    """The check cannot run here (interpreter mode, a Triton without the APIs it uses)."""


@dataclass
class Result:
    kernel: str
    config: str
    params: dict
    target: str
    shared_bytes: int = 0
    static_shared_bytes: int = 0
    registers: int = 0
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0
    local_bytes: int = 0
    num_warps: int = 0
    resident_per_sm: int = 0
    limited_by: str = ""
    waves: dict = field(default_factory=dict)
    fits: bool = False
    key_buffers: int | None = None  # logits: key tiles the TTGIR allocates (multi-buffering)
    async_waits: list = field(default_factory=list)  # the `num` of each ttg.async_wait
    default: bool = False  # the dispatcher's config on this target
    error: str = ""

    @property
    def pipelined(self) -> bool:
        """At least two key tiles in flight: a multi-buffered key memdesc and an async_wait
        that leaves copies in flight (num > 0)."""
        return bool(self.key_buffers and self.key_buffers >= 2 and any(self.async_waits))

    @property
    def spills(self) -> bool:
        return bool(self.spill_store_bytes or self.spill_load_bytes or self.local_bytes)

    @property
    def passed(self) -> bool:
        return self.fits and not self.spills and not self.error

    def as_dict(self) -> dict:
        return {**asdict(self), "spills": self.spills, "passed": self.passed,
                "pipelined": self.pipelined}


def residency(target: Target, shared: int, static_shared: int, registers: int, warps: int):
    """(programs resident per SM, the limit that binds) by CUDA's occupancy rules; 0 when one
    program does not fit at all."""
    block_smem = shared + static_shared
    if block_smem > target.smem_per_block:
        return 0, f"shared memory {block_smem} B > {target.smem_per_block} B per block"
    if registers > target.max_regs_per_thread:
        return 0, f"{registers} registers > {target.max_regs_per_thread}"
    if warps > target.max_warps_per_sm:
        return 0, f"{warps} warps > {target.max_warps_per_sm}"
    unit = target.regs_unit_per_warp
    regs_per_warp = -(-max(registers, 1) * 32 // unit) * unit
    allocated = -(-(block_smem + target.reserved_smem_per_block) // target.smem_unit)
    limits = {
        "warps": target.max_warps_per_sm // warps,
        "registers": (target.regs_per_sm // regs_per_warp) // warps,
        "shared memory": target.smem_per_sm // (allocated * target.smem_unit),
        "blocks": target.max_blocks_per_sm,
    }
    binding = min(limits, key=limits.get)
    return limits[binding], binding


# --- the cases: kernels x configs at the real shapes -------------------------------------------


def default_logits_config(target: Target) -> dict:
    """The dispatcher's config without a measurement on `target` (no sm_count)."""
    from sgl_kernel_dsv4 import index_logits_triton as logits

    capability = divmod(target.capability, 10)
    config = logits.heuristic_config(1, capability)
    return {k: v for k, v in config.items() if k != "sm_count"}


def logits_configs(target: Target) -> list[dict]:
    """Every launch config the dispatcher (heuristic) or the sweep can choose on `target`."""
    from sgl_kernel_dsv4 import index_logits_triton as logits

    found = []
    for config in [default_logits_config(target), *logits.LAUNCH_SWEEP]:
        config = {k: v for k, v in config.items() if k != "sm_count"}
        if config not in found:
            found.append(config)
    return found


def config_label(config: dict) -> str:
    return (
        f"pps{config['pages_per_step']} ppsm{config['programs_per_sm']} "
        f"w{config['num_warps']} s{config['num_stages']}"
    )


def _logits_case(config: dict, heads: int, target: Target, batch: int, keys: int):
    import torch

    from sgl_kernel_dsv4 import index_logits_triton as logits

    cols = -(-keys // 64) + 2  # the kit's tables: wider than the longest row
    q = torch.empty(batch, 1, heads, 128, dtype=torch.bfloat16)
    kv = torch.empty(4, 64, 1, 128, dtype=torch.bfloat16)  # only its strides matter
    weights = torch.empty(batch, heads)
    seq_lens = torch.empty(batch, dtype=torch.int32)
    table = torch.empty(batch, cols, dtype=torch.int32)
    out = torch.empty(batch, keys)
    full = {**config, "sm_count": target.sm_count}
    return logits.launch_args(q, kv, weights, seq_lens, table, keys, out, full)


def _query_case(heads: int, tokens: int):
    import torch

    from sgl_kernel_dsv4 import index_rotation_triton as rotation

    q = torch.empty(tokens, heads, 128, dtype=torch.bfloat16)
    freqs = torch.empty(ROPE_POSITIONS, ROPE_PAIRS, 2)
    positions = torch.empty(tokens, dtype=torch.int64)
    out = torch.empty(tokens, heads, 128, dtype=torch.bfloat16)
    return rotation.query_launch_args(q, freqs, positions, out)


def _store_case(is_decode: bool, rows: int):
    import torch

    from sgl_kernel_dsv4 import index_rotation_triton as rotation

    pool = torch.empty(4 * rows + 64, 128, dtype=torch.bfloat16)
    kv = torch.empty(rows, 128)
    weight = torch.empty(128)
    freqs = torch.empty(ROPE_POSITIONS, ROPE_PAIRS, 2)
    plan = torch.empty(rows, 4, dtype=torch.int32)
    out_loc = torch.empty(rows, dtype=torch.int64)
    return rotation.store_launch_args(pool, kv, weight, 1e-6, freqs, plan, out_loc, 4, is_decode)


@dataclass(frozen=True)
class Case:
    kernel: str
    config: str
    params: dict
    build: object  # (target, shape) -> (grid, args, kwargs)
    shapes: tuple  # (label, shape) of the kit's launches; the first is compiled
    jit: str  # attribute of the module holding the kernel
    module: str


def cases(target: Target) -> list[Case]:
    found = []
    shapes = tuple(
        (f"B={b} keys={k}", (b, k)) for k in reversed(KIT_DECODE_KEYS) for b in KIT_DECODE_BATCHES
    )
    for heads in HEAD_COUNTS:
        for config in logits_configs(target):
            found.append(
                Case(
                    "bf16_paged_mqa_logits",
                    config_label(config),
                    {**config, "heads": heads},
                    lambda target, shape, c=config, h=heads: _logits_case(c, h, target, *shape),
                    shapes,
                    "_bf16_paged_mqa_logits_kernel",
                    "sgl_kernel_dsv4.index_logits_triton",
                )
            )
    rows = tuple((f"rows={r}", r) for r in KIT_ROTATION_ROWS)
    # the fused query serves the indexer's own heads only
    found.append(
        Case("index_query_bf16", "w4", {"heads": INDEX_HEADS, "num_warps": 4},
             lambda target, shape: _query_case(INDEX_HEADS, shape), rows,
             "_index_query_kernel", "sgl_kernel_dsv4.index_rotation_triton")
    )
    for is_decode in (True, False):
        found.append(
            Case("store_index_keys_bf16", "decode" if is_decode else "prefill",
                 {"is_decode": is_decode, "num_warps": 4},
                 lambda target, shape, d=is_decode: _store_case(d, shape), rows,
                 "_store_index_keys_kernel", "sgl_kernel_dsv4.index_rotation_triton")
        )
    return found


# --- compiling -----------------------------------------------------------------------------


def _nvidia_tools():
    from triton.backends.nvidia import compiler as nvidia

    return nvidia


def compile_for(kernel, args, kwargs, target: Target):
    """Triton's own compile of `kernel` for `target`, specialized as its runtime would for these
    arguments. Returns the CompiledKernel (asm: ttgir, ptx, cubin; metadata.shared)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    try:
        from triton.runtime.jit import create_function_from_signature
    except ImportError as exc:
        raise CompileCheckError(f"this Triton ({triton.__version__}) lacks {exc.name}") from None
    if not hasattr(kernel, "_pack_args"):
        raise CompileCheckError(
            "the kernels are interpreted functions (TRITON_INTERPRET=1): nothing to compile"
        )
    gpu = GPUTarget("cuda", target.capability, 32)
    backend = make_backend(gpu)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {**kwargs, "debug": False}
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound, specialization, options
    )
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=gpu, options=options.__dict__)


def assemble_report(ptx: str, capability: int) -> dict:
    """ptxas -v on the PTX Triton produced (the same ptxas and flags Triton uses): registers,
    spill stores and loads, static shared memory."""
    nvidia = _nvidia_tools()
    ptxas = nvidia.get_ptxas(capability).path
    arch = nvidia.sm_arch_from_capability(capability)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        proc = subprocess.run(
            [ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", str(src),
             "-o", str(Path(tmp) / "kernel.o")],
            capture_output=True, text=True, check=True,
        )
    log = proc.stdout + proc.stderr
    number = lambda pattern: sum(int(m) for m in re.findall(pattern, log))  # noqa: E731
    return {
        "registers": number(r"Used (\d+) registers"),
        "spill_store_bytes": number(r"(\d+) bytes spill stores"),
        "spill_load_bytes": number(r"(\d+) bytes spill loads"),
        "static_shared_bytes": number(r"(\d+) bytes smem"),
    }


def cubin_resources(cubin: bytes) -> dict:
    """cuobjdump --dump-resource-usage of Triton's own cubin: registers and local memory."""
    cuobjdump = _nvidia_tools().knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run(
            [cuobjdump, "--dump-resource-usage", handle.name],
            capture_output=True, text=True, check=True,
        ).stdout
    found = dict(re.findall(r"\b(REG|LOCAL|STACK):(\d+)", text))
    return {
        "registers": int(found.get("REG", 0)),
        "local_bytes": int(found.get("LOCAL", 0)) + int(found.get("STACK", 0)),
    }


def check_case(case: Case, target: Target, keep_ttgir: bool = False) -> Result:
    from importlib import import_module

    kernel = getattr(import_module(case.module), case.jit)
    result = Result(case.kernel, case.config, case.params, target.name)
    try:
        grid, args, kwargs = case.build(target, case.shapes[0][1])
        compiled = compile_for(kernel, args, kwargs, target)
        report = assemble_report(compiled.asm["ptx"], target.capability)
        cubin = cubin_resources(compiled.asm["cubin"])
    except CompileCheckError:
        raise
    except Exception as exc:  # a config that does not compile for this target: reported as such
        result.error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
        return result
    result.shared_bytes = int(compiled.metadata.shared)
    result.static_shared_bytes = report["static_shared_bytes"]
    result.registers = cubin["registers"] or report["registers"]
    result.spill_store_bytes = report["spill_store_bytes"]
    result.spill_load_bytes = report["spill_load_bytes"]
    result.local_bytes = cubin["local_bytes"]
    result.num_warps = int(kwargs["num_warps"])
    result.resident_per_sm, result.limited_by = residency(
        target, result.shared_bytes, result.static_shared_bytes, result.registers,
        result.num_warps,
    )
    result.fits = result.resident_per_sm >= 1
    slots = result.resident_per_sm * target.sm_count
    for label, shape in case.shapes:
        grid, _, _ = case.build(target, shape)
        programs = math.prod(grid)
        result.waves[label] = round(programs / slots, 2) if slots else None
    ttgir = compiled.asm["ttgir"]
    result.async_waits = [int(n) for n in re.findall(r"ttg\.async_wait[^{\n]*\{num = (\d+)", ttgir)]
    if case.kernel == "bf16_paged_mqa_logits":
        step = 64 * case.params["pages_per_step"]
        tiles = [int(n) for n in re.findall(rf"memdesc<(\d+)x{step}x128xbf16", ttgir)]
        result.key_buffers = max(tiles, default=0)
        result.default = (
            {k: v for k, v in case.params.items() if k != "heads"} == default_logits_config(target)
        )
    if keep_ttgir:
        result.ttgir = ttgir
    return result


def run(targets, progress=None) -> list[Result]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise CompileCheckError("TRITON_INTERPRET=1 is set: the kernels would only be interpreted")
    results = []
    for name in targets:
        target = TARGETS[name]
        for case in cases(target):
            if progress:
                progress(f"{target.name}: {case.kernel} {case.config} {case.params}")
            results.append(check_case(case, target))
    return results


# --- the record the tuned-launch loader reads ------------------------------------------------


def passed_logits_configs(results, target: str) -> list[dict]:
    """Logits configs that passed on `target` at every head count checked."""
    by_config = {}
    for r in results:
        if r.kernel == "bf16_paged_mqa_logits" and r.target == target:
            config = {k: v for k, v in r.params.items() if k != "heads"}
            key = json.dumps(config, sort_keys=True)
            by_config[key] = by_config.get(key, True) and r.passed
    return [json.loads(k) for k, ok in by_config.items() if ok]


def record_entry(results, target: str) -> dict:
    return {"logits_source": logits_source_digest(),
            "passed": passed_logits_configs(results, target)}


def write_record(record: dict) -> None:
    """Atomically: a reader never sees a half-written file."""
    import sgl_kernel_dsv4.index_logits_triton as logits

    text = json.dumps(dict(sorted(record.items())), indent=2, sort_keys=True) + "\n"
    tmp = logits.RECORD_FILE.with_suffix(".json.tmp")
    tmp.write_text(text)
    os.replace(tmp, logits.RECORD_FILE)
