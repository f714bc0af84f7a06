"""bf16 index-logits kernels on a GPU: correctness against the torch path, and speed against
upstream's fp8 sm_120 torch path, as ratios measured in the same run.

For each batch size and context (default 8k and 32k index keys) it builds one random paged index
cache in both layouts (bf16: 256 B/key; fp8 as upstream packs it: 132 B/key), with pages in
shuffled order, then:

- checks `bf16_paged_mqa_logits_triton` against `bf16_paged_mqa_logits_torch` (same -inf pattern,
  max relative error, top-512 overlap);
- times the Triton kernel, the bf16 torch path and upstream's `fp8_paged_mqa_logits_torch_sm120`
  (plus upstream's TileLang fp8 kernel, its sm_120 default, when it is importable and runs), and
  reports each as a ratio to the Triton kernel.

    python benchmark/indexer_kernels.py                       # about a minute on one GPU
    python benchmark/indexer_kernels.py --batch 1 64 --keys 8192 32768 --json out/kernels.json

Exit status: 0 when every check passes, 1 when a check fails, 2 without a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from sgl_kernel_dsv4 import (
    PAGE_TOKENS,
    bf16_paged_mqa_logits_torch,
    bf16_paged_mqa_logits_triton,
    hadamard_rotate,
)
from sgl_kernel_dsv4.index_reference import pack_fp8_index_pages, quantize_index_fp8

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
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args(argv)


def build(batch, keys, heads, gen):
    """One shared pool of random rotated keys; each row reads its own shuffled pages."""
    pages_per_row = -(-keys // PAGE_TOKENS)
    num_pages = batch * pages_per_row + 1
    values = hadamard_rotate(torch.randn(num_pages * PAGE_TOKENS, 128, device="cuda", generator=gen))
    bf16_cache = values.to(torch.bfloat16).view(num_pages, PAGE_TOKENS, 1, 128)
    k8, k_scale = quantize_index_fp8(values)
    fp8_cache = pack_fp8_index_pages(k8, k_scale)
    page_table = torch.randperm(num_pages, device="cuda", generator=gen)[: batch * pages_per_row]
    page_table = page_table.view(batch, pages_per_row).to(torch.int32)
    query = hadamard_rotate(torch.randn(batch, heads, 128, device="cuda", generator=gen))
    weights = torch.randn(batch, heads, device="cuda", generator=gen) * (128 * heads) ** -0.5
    # rows of slightly different lengths, as in a decode batch
    seq_lens = (keys - torch.arange(batch, device="cuda") % 97).clamp(min=1).to(torch.int32)
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


def check(bf16_args) -> dict:
    triton_out = bf16_paged_mqa_logits_triton(*bf16_args)
    torch_out = bf16_paged_mqa_logits_torch(*bf16_args)
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
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": device, "capability": capability,
                                         "results": results}, indent=2) + "\n")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
