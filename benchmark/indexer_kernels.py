"""bf16 index-logits kernels on a GPU: correctness against the torch path, and speed against
upstream's fp8 sm_120 torch path, as ratios measured in the same run; with --interpret, the
table-width check on any CPU.

For each batch size and context (default 8k and 32k index keys) it builds one random paged index
cache in both layouts (bf16: 256 B/key; fp8 as upstream packs it: 132 B/key), with pages in
shuffled order, then:

- checks `bf16_paged_mqa_logits_triton` against `bf16_paged_mqa_logits_torch` (same -inf pattern,
  max relative error, top-512 overlap);
- times the Triton kernel, the bf16 torch path and upstream's `fp8_paged_mqa_logits_torch_sm120`
  (plus upstream's TileLang fp8 kernel, its sm_120 default, when it is importable and runs), and
  reports each as a ratio to the Triton kernel;
- times the Triton kernel again with page tables `--table-width` times wider than the keys (as
  a decode CUDA graph passes them: the width of the longest allowed context, zero-padded) and
  reports the ratio to the exact width: the kernel's work must follow the keys (ratio <= 1.2);
- times the fused query and key-store kernels against their torch references.

    python benchmark/indexer_kernels.py                       # about a minute on one GPU
    python benchmark/indexer_kernels.py --batch 1 64 --keys 8192 32768 --json out/kernels.json
    python benchmark/indexer_kernels.py --interpret           # any CPU: the table-width ratio
                                                              # under TRITON_INTERPRET=1

Under --interpret only the table-width check runs (small defaults: 4 rows of 1,024 keys), with
the launch config of the CPU device (or --sm-count N to launch as on an N-SM GPU; there every
extra program costs the interpreter a Python call, where a GPU retires it in about a microsecond).

Exit status: 0 when every check passes, 1 when a check fails or a width ratio exceeds
--max-ratio, 2 without a CUDA GPU (and without --interpret).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from sgl_kernel_dsv4 import (
    PAGE_TOKENS,
    bf16_paged_mqa_logits_torch,
    bf16_paged_mqa_logits_triton,
    hadamard_rotate,
)
from sgl_kernel_dsv4.fp8_reference import pack_fp8_index_pages, quantize_index_fp8

TOPK = 512


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64],
                        help="query rows per call (default: %(default)s)")
    parser.add_argument("--keys", type=int, nargs="+", default=[8192, 32768],
                        help="index keys per row (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=64, help="default: %(default)s")
    parser.add_argument("--iters", type=int, default=30, help="timed calls each (default: %(default)s)")
    parser.add_argument("--no-tilelang", action="store_true", help="skip upstream's TileLang kernel")
    parser.add_argument("--table-width", type=int, nargs="+", default=[1, 16],
                        help="page-table widths as multiples of the keys (default: %(default)s)")
    parser.add_argument("--max-ratio", type=float, default=1.2,
                        help="largest time ratio of a wide table to the exact one (default: %(default)s)")
    parser.add_argument("--interpret", action="store_true",
                        help="CPU only: the table-width check under TRITON_INTERPRET=1")
    parser.add_argument("--sm-count", type=int,
                        help="with --interpret: launch as on a GPU with this many SMs")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.interpret:  # small shapes: the interpreter runs every program in Python
        args.batch = args.batch if args.batch != [1, 8, 64] else [4]
        args.keys = args.keys if args.keys != [8192, 32768] else [1024]
        args.iters = min(args.iters, 3)
    if 1 not in args.table_width:
        args.table_width = [1, *args.table_width]
    return args


def build(batch, keys, heads, gen, device="cuda"):
    """One shared pool of random rotated keys; each row reads its own shuffled pages."""
    pages_per_row = -(-keys // PAGE_TOKENS)
    num_pages = batch * pages_per_row + 1
    values = hadamard_rotate(torch.randn(num_pages * PAGE_TOKENS, 128, device=device, generator=gen))
    bf16_cache = values.to(torch.bfloat16).view(num_pages, PAGE_TOKENS, 1, 128)
    k8, k_scale = quantize_index_fp8(values)
    fp8_cache = pack_fp8_index_pages(k8, k_scale)
    page_table = torch.randperm(num_pages, device=device, generator=gen)[: batch * pages_per_row]
    page_table = page_table.view(batch, pages_per_row).to(torch.int32)
    query = hadamard_rotate(torch.randn(batch, heads, 128, device=device, generator=gen))
    weights = torch.randn(batch, heads, device=device, generator=gen) * (128 * heads) ** -0.5
    # rows of slightly different lengths, as in a decode batch
    seq_lens = (keys - torch.arange(batch, device=device) % 97).clamp(min=1).to(torch.int32)
    q8, q_scale = quantize_index_fp8(query)
    bf16_args = (query.to(torch.bfloat16).unsqueeze(1), bf16_cache, weights, seq_lens, page_table, keys)
    fp8_args = (q8.unsqueeze(1), fp8_cache, weights * q_scale, seq_lens, page_table, None, keys, False)
    return bf16_args, fp8_args


def time_ms(fn, iters) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def time_cpu_ms(fn, iters) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) * 1000 / iters


def widened(bf16_args, width):
    """The same call with a page table `width` times wider, zero-padded as upstream pads its
    decode page table, and logits as wide as the table."""
    q, cache, weights, seq_lens, page_table, _ = bf16_args
    cols = page_table.shape[1] * width
    wide = torch.zeros(page_table.shape[0], cols, dtype=page_table.dtype, device=page_table.device)
    wide[:, : page_table.shape[1]] = page_table
    return q, cache, weights, seq_lens, wide, cols * PAGE_TOKENS


def table_width_case(batch, keys, args, gen, device, config) -> dict:
    """Triton time at each table width, as a ratio to the exact width; each wide result must
    equal the exact one on every row's first seq_len positions."""
    from sgl_kernel_dsv4.index_logits_triton import launch

    bf16_args, _ = build(batch, keys, args.heads, gen, device)
    timer = time_ms if device == "cuda" else time_cpu_ms
    seq_lens = bf16_args[3]
    exact = launch(*bf16_args, config=config)
    row = {"keys": keys, "batch": batch, "ms": {}, "same": True}
    for width in args.table_width:
        call = widened(bf16_args, width)
        out = launch(*call, config=config)[:, : exact.shape[1]]
        inside = torch.arange(exact.shape[1], device=device).unsqueeze(0) < seq_lens.unsqueeze(1)
        row["same"] &= bool(torch.equal(out[inside], exact[inside]))
        row["ms"][width] = timer(lambda call=call: launch(*call, config=config), args.iters)
    row["ratio"] = {w: ms / row["ms"][1] for w, ms in row["ms"].items()}
    row["ok"] = row["same"] and max(row["ratio"].values()) <= args.max_ratio
    return row


def print_width_table(rows, title):
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in ("keys", "batch", "same logits", *[f"{w}x width ms (ratio)" for w in rows[0]["ms"]]):
        table.add_column(column, justify="right")
    for row in rows:
        cells = [f"{ms:.3f} ({row['ratio'][w]:.2f}x)" for w, ms in row["ms"].items()]
        table.add_row(f"{row['keys']:,}", str(row["batch"]), "yes" if row["same"] else "NO", *cells)
    Console(width=160).print(table)


def rotation_timings(batch, args, gen) -> dict:
    """Fused query and key-store kernels against their torch references (ms, one batch)."""
    from sgl_kernel_dsv4.index_rotation import (
        index_query_bf16_torch,
        store_index_keys_bf16_torch,
    )
    from sgl_kernel_dsv4.index_rotation_triton import (
        index_query_bf16_triton,
        store_index_keys_bf16_triton,
    )

    angles = torch.rand(65536, 32, device="cuda", generator=gen)
    freqs = torch.polar(torch.ones_like(angles), angles)
    q = torch.randn(batch, args.heads, 128, device="cuda", generator=gen).to(torch.bfloat16)
    positions = torch.randint(0, 65536, (batch,), device="cuda", generator=gen)
    kv = torch.randn(batch, 128, device="cuda", generator=gen)
    weight = torch.rand(128, device="cuda", generator=gen) + 0.5
    plan = torch.zeros(batch, 4, dtype=torch.int32, device="cuda")
    plan[:, 0] = torch.arange(1, batch + 1, device="cuda") * 4
    out_loc = torch.randperm(batch * 4, device="cuda", generator=gen)[:batch] + 1
    pool = torch.zeros(batch * 4 + 1, 128, dtype=torch.bfloat16, device="cuda")
    store = (kv, weight, 1e-6, freqs, plan, out_loc, 4, True)
    query_gap = (index_query_bf16_triton(q, freqs, positions).float()
                 - index_query_bf16_torch(q, freqs, positions).float()).abs().max().item()
    return {
        "batch": batch,
        "query_max_abs_diff": query_gap,
        "ms": {
            "query torch": time_ms(lambda: index_query_bf16_torch(q, freqs, positions), args.iters),
            "query triton": time_ms(lambda: index_query_bf16_triton(q, freqs, positions), args.iters),
            "key store torch": time_ms(lambda: store_index_keys_bf16_torch(pool, *store), args.iters),
            "key store triton": time_ms(lambda: store_index_keys_bf16_triton(pool, *store), args.iters),
        },
    }


def interpret_main(args) -> int:
    """The table-width check on the CPU under Triton's interpreter."""
    from sgl_kernel_dsv4.index_logits_triton import launch_config_for

    config = launch_config_for("cpu")
    if args.sm_count:
        config["sm_count"] = args.sm_count
    gen = torch.Generator().manual_seed(0)
    rows = [table_width_case(b, k, args, gen, "cpu", config) for k in args.keys for b in args.batch]
    print_width_table(rows, f"bf16 logits under TRITON_INTERPRET=1 (launch config {config}); "
                            "ratio = time / exact-width time")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": "cpu (interpreter)", "config": config,
                                         "table_width": rows}, indent=2) + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


def check(bf16_args) -> dict:
    triton_out = bf16_paged_mqa_logits_triton(*bf16_args)
    torch_out = bf16_paged_mqa_logits_torch(*bf16_args)
    # positions past seq_len are unspecified: compare each row's first seq_len scores
    seq_lens = bf16_args[3]
    inside = torch.arange(torch_out.shape[1], device=torch_out.device).unsqueeze(0) < seq_lens.unsqueeze(1)
    triton_out = torch.where(inside, triton_out, float("-inf"))
    same_mask = torch.equal(torch.isneginf(triton_out), torch.isneginf(torch_out))
    finite = torch.isfinite(torch_out)
    scale = torch_out[finite].abs().max().clamp(min=1e-30)
    rel_err = ((triton_out[finite] - torch_out[finite]).abs().max() / scale).item()
    k = min(TOPK, triton_out.shape[1])
    picked = triton_out.topk(k, dim=1).indices
    truth = torch_out.topk(k, dim=1).indices
    chosen = torch.zeros_like(triton_out, dtype=torch.bool).scatter_(1, picked, True)
    overlap = chosen.gather(1, truth).float().mean().item()
    return {"same_inf_mask": same_mask, "max_rel_err": rel_err, "topk_overlap": overlap,
            "ok": same_mask and rel_err < 1e-4 and overlap > 0.999}


def upstream_paths(use_tilelang):
    from sglang.srt.layers.attention.dsv4.indexer import fp8_paged_mqa_logits_torch_sm120

    paths = {"fp8 torch sm120 (upstream)": fp8_paged_mqa_logits_torch_sm120}
    if use_tilelang:
        try:
            from sglang.kernels.ops.attention.dsa.tilelang_kernel import (
                tilelang_fp8_paged_mqa_logits,
            )

            paths["fp8 tilelang (upstream)"] = tilelang_fp8_paged_mqa_logits
        except Exception as exc:  # optional comparison: report why it is absent
            print(f"upstream TileLang kernel not importable: {exc}", file=sys.stderr)
    return paths


def measure_case(batch, keys, args, gen, upstream) -> dict:
    bf16_args, fp8_args = build(batch, keys, args.heads, gen)
    row = {"keys": keys, "batch": batch, **check(bf16_args)}
    timings = {
        "bf16 triton": time_ms(lambda: bf16_paged_mqa_logits_triton(*bf16_args), args.iters),
        "bf16 torch": time_ms(lambda: bf16_paged_mqa_logits_torch(*bf16_args), args.iters),
    }
    for name, fn in upstream.items():
        try:
            timings[name] = time_ms(lambda fn=fn: fn(*fp8_args), args.iters)
        except Exception as exc:  # e.g. TileLang without sm_120 support: say so, go on
            timings[name] = None
            row.setdefault("errors", {})[name] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:200]
    row["ms"] = timings
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.interpret:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("indexer_kernels: --interpret must start before Triton is imported", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are first decorated
        return interpret_main(args)
    if not torch.cuda.is_available():
        print("indexer_kernels: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from rich.console import Console
    from rich.table import Table

    gen = torch.Generator(device="cuda").manual_seed(0)
    device = torch.cuda.get_device_name()
    capability = ".".join(map(str, torch.cuda.get_device_capability()))
    upstream = upstream_paths(not args.no_tilelang)
    results = [
        measure_case(batch, keys, args, gen, upstream) for keys in args.keys for batch in args.batch
    ]

    names = list(results[0]["ms"])
    table = Table(title=f"c4 indexer logits on {device} (sm_{capability.replace('.', '')}), "
                        f"{args.heads} heads; ratio = time / bf16 triton time")
    for column in ("keys", "batch", "check", "max rel err", *[f"{n} ms (ratio)" for n in names]):
        table.add_column(column, justify="right")
    for row in results:
        base = row["ms"]["bf16 triton"]
        cells = [f"{ms:.3f} ({ms / base:.2f}x)" if ms is not None else "failed" for ms in row["ms"].values()]
        table.add_row(f"{row['keys']:,}", str(row["batch"]), "ok" if row["ok"] else "FAILED",
                      f"{row['max_rel_err']:.1e}", *cells)
    Console(width=160).print(table)
    for row in results:
        for name, error in row.get("errors", {}).items():
            print(f"{name} at {row['keys']} keys, batch {row['batch']}: {error}", file=sys.stderr)

    from sgl_kernel_dsv4.index_logits_triton import launch_config_for

    config = launch_config_for("cuda")
    widths = [table_width_case(b, k, args, gen, "cuda", config) for k in args.keys for b in args.batch]
    print_width_table(widths, f"bf16 triton logits by page-table width (launch config {config}); "
                              "ratio = time / exact-width time")
    rotations = [rotation_timings(b, args, gen) for b in args.batch]
    rot_table = Table(title="fused rotations vs torch references (ms)")
    for column in ("batch", "query max |diff|", *rotations[0]["ms"]):
        rot_table.add_column(column, justify="right")
    for row in rotations:
        rot_table.add_row(str(row["batch"]), f"{row['query_max_abs_diff']:.1e}",
                          *[f"{ms:.4f}" for ms in row["ms"].values()])
    Console(width=160).print(rot_table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": device, "capability": capability,
                                         "launch_config": config, "results": results,
                                         "table_width": widths, "rotations": rotations},
                                        indent=2) + "\n")
    return 0 if all(r["ok"] for r in results + widths) else 1


if __name__ == "__main__":
    sys.exit(main())
