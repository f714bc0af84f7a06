"""How well fp8 and bf16 index keys recover the c4 indexer's exact top-512 (runs on the CPU).

The DeepSeek-V4 lightning indexer scores every cached index key of a c4 layer,
logits[t] = sum_h w[h] * relu(q[h] . k[t]), and keeps the top 512 for sparse attention. This
script measures recall@512 of those selections against the exact ones (fp64 logits from fp32
keys and queries), for compressed contexts of 0.5k to 20k keys (2k to 80k tokens at ratio 4):

- fp8: keys and query quantized exactly as upstream sglang 0.5.23 does it (per row of 128 values,
  e4m3 with an fp32 scale max(amax, 1e-4) / 448; the query's scale folded into its head weight,
  the key's applied after the head sum), fp32 accumulation;
- bf16: keys and query rounded to bf16, fp32 accumulation (what `sgl_kernel_dsv4` computes).

Keys and queries are synthetic, shaped like the real ones: per-token RMS-normalized activations
with a shared component and a few outlier channels, then the 128-point Hadamard rotation that
upstream applies to both before quantizing. Absolute recall on a real model will differ; the
comparison is like for like. It also reports the bytes each dtype reads per decode step per c4
layer (fp8: 132 B/key, bf16: 256 B/key).

    python benchmark/indexer_recall.py                      # defaults: a few minutes on 2 cores
    python benchmark/indexer_recall.py --contexts 512 2048 --queries 32 --out-dir /tmp/recall

Writes indexer_recall.json and indexer_recall.png to --out-dir and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from sgl_kernel_dsv4.fp8_reference import (
    BF16_INDEX_BYTES_PER_KEY,
    FP8_INDEX_BYTES_PER_KEY,
    index_logits_dense,
)
from sgl_kernel_dsv4.index_rotation import hadamard_rotate

HEAD_DIM = 128
DTYPES = {"fp8": FP8_INDEX_BYTES_PER_KEY, "bf16": BF16_INDEX_BYTES_PER_KEY}
COMPRESS_RATIO = 4


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="recall@topk of fp8 vs bf16 index keys for the DeepSeek-V4 c4 indexer (CPU)"
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 20480],
                        help="compressed context lengths, in index keys (default: %(default)s)")
    parser.add_argument("--queries", type=int, default=256,
                        help="random queries per context (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=64, help="indexer heads (default: %(default)s)")
    parser.add_argument("--topk", type=int, default=512, help="keys selected (default: %(default)s)")
    parser.add_argument("--outlier-channels", type=int, default=4,
                        help="channels with a large gain before the rotation (default: %(default)s)")
    parser.add_argument("--outlier-gain", type=float, default=16.0,
                        help="gain of those channels (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument("--out-dir", type=Path, default=Path("out/indexer_recall"),
                        help="where the JSON and PNG go (default: %(default)s)")
    args = parser.parse_args(argv)
    for name in ("queries", "heads", "topk"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if min(args.contexts) < 1:
        parser.error("--contexts must all be at least 1")
    if not 0 <= args.outlier_channels <= HEAD_DIM:
        parser.error(f"--outlier-channels must be between 0 and {HEAD_DIM}")
    return args


class ActivationModel:
    """Synthetic index keys and queries with the structure that matters for quantization."""

    def __init__(self, outlier_channels: int, outlier_gain: float, generator: torch.Generator):
        self.generator = generator
        self.gain = torch.ones(HEAD_DIM)
        picked = torch.randperm(HEAD_DIM, generator=generator)[:outlier_channels]
        self.gain[picked] = outlier_gain
        # Keys of one sequence share a direction (as real keys do), which crowds their logits.
        self.shared = torch.randn(HEAD_DIM, generator=generator)

    def keys(self, n: int) -> torch.Tensor:
        raw = (torch.randn(n, HEAD_DIM, generator=self.generator) + 0.5 * self.shared) * self.gain
        normed = raw * torch.rsqrt(raw.pow(2).mean(-1, keepdim=True) + 1e-6)
        return hadamard_rotate(normed)

    def queries(self, count: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        raw = torch.randn(count, heads, HEAD_DIM, generator=self.generator) * self.gain
        weights = torch.randn(count, heads, generator=self.generator) * (HEAD_DIM * heads) ** -0.5
        return hadamard_rotate(raw), weights


def recall_per_query(exact: torch.Tensor, approx: torch.Tensor, topk: int) -> torch.Tensor:
    """Fraction of the exact top-k (per row) that the approximate logits also select."""
    k = min(topk, exact.shape[1])
    truth = exact.topk(k, dim=1).indices
    picked = approx.topk(k, dim=1).indices
    chosen = torch.zeros_like(exact, dtype=torch.bool).scatter_(1, picked, True)
    return chosen.gather(1, truth).float().mean(dim=1)


def measure(args) -> list[dict]:
    generator = torch.Generator().manual_seed(args.seed)
    model = ActivationModel(args.outlier_channels, args.outlier_gain, generator)
    rows = []
    for n in args.contexts:
        keys = model.keys(n)
        queries, weights = model.queries(args.queries, args.heads)
        # Bounded intermediates: [chunk, heads, n] per einsum.
        chunk = max(1, (1 << 24) // (args.heads * n))
        recalls = {name: [] for name in DTYPES}
        for start in range(0, args.queries, chunk):
            q, w = queries[start : start + chunk], weights[start : start + chunk]
            exact = index_logits_dense(q, keys, w, "exact")
            for name in DTYPES:
                approx = index_logits_dense(q, keys, w, name)
                recalls[name].append(recall_per_query(exact, approx, args.topk))
        worst = max(1, math.ceil(args.queries / 10))
        for name, bytes_per_key in DTYPES.items():
            per_query = torch.cat(recalls[name]).sort().values
            rows.append({
                "context_keys": n,
                "context_tokens": n * COMPRESS_RATIO,
                "dtype": name,
                "recall_mean": per_query.mean().item(),
                "recall_worst_decile": per_query[:worst].mean().item(),
                "recall_min": per_query[0].item(),
                "bytes_per_key": bytes_per_key,
                "bytes_per_decode_step_per_layer": n * bytes_per_key,
            })
    return rows


def print_table(rows, args) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"c4 indexer recall@{args.topk} vs exact (fp64) selection, "
                        f"{args.queries} queries per context, {args.heads} heads")
    for column in ("keys", "tokens", "dtype", f"recall@{args.topk} mean",
                   "worst decile", "KiB read / step / c4 layer"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            f"{row['context_keys']:,}", f"{row['context_tokens']:,}", row["dtype"],
            f"{row['recall_mean']:.4f}", f"{row['recall_worst_decile']:.4f}",
            f"{row['bytes_per_decode_step_per_layer'] / 1024:,.1f}",
        )
    Console(width=110).print(table)


def plot(rows, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (recall_ax, bytes_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, color in (("fp8", "tab:red"), ("bf16", "tab:blue")):
        mine = [r for r in rows if r["dtype"] == name]
        keys = [r["context_keys"] for r in mine]
        recall_ax.plot(keys, [r["recall_mean"] for r in mine], "o-", color=color, label=f"{name} mean")
        recall_ax.plot(keys, [r["recall_worst_decile"] for r in mine], "s--", color=color,
                       label=f"{name} worst decile")
        bytes_ax.plot(keys, [r["bytes_per_decode_step_per_layer"] / 2**20 for r in mine], "o-",
                      color=color, label=name)
    recall_ax.set(xscale="log", xlabel="compressed context (index keys)",
                  ylabel=f"recall@{args.topk}", title="top-k recall vs exact selection")
    bytes_ax.set(xscale="log", xlabel="compressed context (index keys)",
                 ylabel="MiB read per decode step per c4 layer", title="index-K bytes read")
    for ax in (recall_ax, bytes_ax):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    rows = measure(args)
    elapsed = time.perf_counter() - started
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / "indexer_recall.json"
    png_path = args.out_dir / "indexer_recall.png"
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report = {
        "command": " ".join(["python", "benchmark/indexer_recall.py", *(argv or sys.argv[1:])]),
        "config": config,
        "torch": torch.__version__,
        "seconds": round(elapsed, 1),
        "results": rows,
    }
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    plot(rows, args, png_path)
    print_table(rows, args)
    print(f"wrote {json_path} and {png_path} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
