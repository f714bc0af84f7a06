"""`sglang-dsv4 plan`: arguments, validation, and the run."""

from __future__ import annotations

import json
import sys

from sglang_dsv4.cli import upstream_quiet

# Not from sglang_dsv4.fixes: these builders also serve the run on upstream patched by the
# exported series, which imports no fix module (sglang_dsv4.index_k_dtype imports nothing).
from sglang_dsv4.index_k_dtype import (
    INDEX_K_DTYPE_ENV,
    INDEX_K_DTYPES,
)
from sglang_dsv4.plan.budget import DEFAULT_GPU, GPUS_MIB, compare, parse_gpu, plan
from sglang_dsv4.plan.chain import (
    DISAGGREGATION_MODES,
    DSV4_PAGE_SIZE,
    PlanError,
    check_model_dir,
    resolve_index_k_dtype,
)
from sglang_dsv4.plan.render import render_compare, render_plan, render_sweep
from sglang_dsv4.plan.sweep import sweep

# --- command line -----------------------------------------------------------------------------


def add_arguments(parser) -> None:
    parser.add_argument(
        "--model",
        metavar="PATH",
        help="local folder with a DeepSeek-V4 config.json (default: the embedded "
        "DeepSeek-V4-Flash config; no weights needed)",
    )
    parser.add_argument(
        "--index-k-dtype",
        default=None,
        metavar="{fp8,bf16,fp4}",
        help=f"c4 indexer key storage; overrides what the server would use ({INDEX_K_DTYPE_ENV}, "
        "--enable-deepseek-v4-fp4-indexer, else fp8)",
    )
    parser.add_argument(
        "--enable-deepseek-v4-fp4-indexer",
        action="store_true",
        help="as the server flag: fp4 index keys",
    )
    parser.add_argument("--tp", type=int, default=4, help="tensor-parallel size (default: 4)")
    parser.add_argument(
        "--disaggregation-mode",
        default="decode",
        metavar="{prefill,decode,null}",
        help="PD role of the server (default: decode)",
    )
    parser.add_argument(
        "--page-size",
        type=int,
        default=DSV4_PAGE_SIZE,
        help=f"KV page size; upstream runs DeepSeek-V4 only with {DSV4_PAGE_SIZE} on CUDA",
    )
    parser.add_argument(
        "--gpu",
        default=DEFAULT_GPU,
        help=f"{' | '.join(GPUS_MIB)} | a memory size such as 96GiB (default: {DEFAULT_GPU})",
    )
    parser.add_argument(
        "--mem-fraction-static",
        type=float,
        metavar="F",
        help="as the server flag (default: upstream's for the GPU, TP and role)",
    )
    parser.add_argument(
        "--weights-gib",
        type=float,
        metavar="G",
        help="the whole checkpoint's size, GiB (default: the checkpoint index's total_size; "
        "DeepSeek-V4-Flash embedded: 160 GB)",
    )
    parser.add_argument(
        "--kv-memory-gib",
        type=float,
        metavar="G",
        help="KV memory per rank, GiB: overrides the budget derived from the GPU (a server logs "
        "its own as available_bytes on its 'DSV4 memory calculation' line)",
    )
    parser.add_argument(
        "--max-running-requests", type=int, metavar="N", help="as the server flag (default: 256)"
    )
    parser.add_argument(
        "--mtp", action="store_true", help="speculative decoding over the MTP layer (EAGLE)"
    )
    parser.add_argument(
        "--context",
        type=int,
        metavar="N",
        help="tokens per session: how many concurrent sessions fit, per index-K dtype",
    )
    parser.add_argument(
        "--gpus", type=int, metavar="N", help="GPUs of this role in the deployment (default: TP)"
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="fp8 / bf16 / fp4 side by side, plus what unfixed sizing over-commits for bf16",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="size and build the pools over a grid of TP, role, dtype, budget, requests and "
        "MTP; report allocated - budget in each cell",
    )
    parser.add_argument(
        "--sweep-sample",
        type=int,
        default=160,
        metavar="N",
        help="cells drawn besides the grid's corners (default: 160; 0: corners only)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _validated(args) -> dict:
    if args.disaggregation_mode not in DISAGGREGATION_MODES:
        raise PlanError(
            f"--disaggregation-mode {args.disaggregation_mode!r}: choose one of "
            f"{', '.join(DISAGGREGATION_MODES)}"
        )
    if args.tp < 1:
        raise PlanError(f"--tp {args.tp}: must be at least 1")
    if args.page_size != DSV4_PAGE_SIZE:
        raise PlanError(
            f"--page-size {args.page_size}: upstream runs DeepSeek-V4 with page size "
            f"{DSV4_PAGE_SIZE} on CUDA whatever the flag says; plan with {DSV4_PAGE_SIZE}"
        )
    if args.kv_memory_gib is not None and not args.kv_memory_gib > 0:
        raise PlanError(f"--kv-memory-gib {args.kv_memory_gib:g}: must be positive")
    fraction = args.mem_fraction_static
    if fraction is not None and not 0 < fraction <= 1:
        raise PlanError(f"--mem-fraction-static {fraction:g}: must be in (0, 1]")
    if args.weights_gib is not None and not args.weights_gib > 0:
        raise PlanError(f"--weights-gib {args.weights_gib:g}: must be positive")
    for name in ("max_running_requests", "context", "gpus"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise PlanError(f"--{name.replace('_', '-')} {value}: must be at least 1")
    if args.gpus is not None and args.gpus % args.tp:
        raise PlanError(f"--gpus {args.gpus}: not a multiple of --tp {args.tp}")
    parse_gpu(args.gpu)
    dtype, source = resolve_index_k_dtype(args.index_k_dtype, args.enable_deepseek_v4_fp4_indexer)
    if args.enable_deepseek_v4_fp4_indexer and dtype != "fp4":
        raise PlanError(
            f"--index-k-dtype {dtype} contradicts --enable-deepseek-v4-fp4-indexer; drop one"
        )
    return {
        "index_k_dtype": dtype,
        "index_k_source": source,
        "model_path": check_model_dir(args.model) if args.model else None,
        "tp": args.tp,
        "disaggregation_mode": args.disaggregation_mode,
        "page_size": args.page_size,
        "kv_memory_gib": args.kv_memory_gib,
        "gpu": args.gpu,
        "mem_fraction_static": fraction,
        "weights_gib": args.weights_gib,
        "max_running_requests": args.max_running_requests,
        "mtp": args.mtp,
        "context": args.context,
        "gpus": args.gpus,
    }


def run(args) -> int:
    try:
        kwargs = _validated(args)
        with upstream_quiet():
            from sglang.srt.plugins import load_plugins

            load_plugins()
            if args.sweep:
                report = sweep(sample=args.sweep_sample, model_path=kwargs["model_path"])
            elif args.compare:
                kwargs.pop("index_k_dtype")
                report = compare(**kwargs)
            else:
                report = plan(**kwargs)
                if args.context:
                    report["sessions_by_index_k_dtype"] = _sessions_by_dtype(kwargs, report)
    except PlanError as exc:
        print(f"sglang-dsv4 plan: {exc}", file=sys.stderr)
        return 2
    except (AssertionError, ValueError, RuntimeError) as exc:
        # Upstream refused the configuration.
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"sglang-dsv4 plan: upstream refused this configuration: {line}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    elif args.sweep:
        render_sweep(report)
    elif args.compare:
        render_compare(report)
    else:
        render_plan(report)
    return 0


def _sessions_by_dtype(kwargs: dict, report: dict) -> dict:
    """Sessions per rank for each index-K dtype at the same budget, and bf16's cost."""
    others = {k: v for k, v in kwargs.items() if k not in ("index_k_dtype", "index_k_source")}
    found = {report["index_k_dtype"]: report["sessions"]["per_rank"]}
    for dtype in INDEX_K_DTYPES:
        if dtype not in found:
            found[dtype] = plan(dtype, **others)["sessions"]["per_rank"]
    by_dtype = {dtype: found[dtype] for dtype in INDEX_K_DTYPES}
    return {**by_dtype, "bf16_cost_vs_fp8": by_dtype["fp8"] - by_dtype["bf16"]}


