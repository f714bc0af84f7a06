"""The c4 indexer's logits step as a memory-bound kernel: bytes one call moves and its roofline
time, bf16 keys (this distribution) against upstream's fp8 ones, at the GPU kit's shapes.

    python -m benchmark.bandwidth_model                    # the kit's decode shapes, 1.8 TB/s
    python -m benchmark.bandwidth_model --batch 32 --keys 20000 --tbps 1.8

Per call, B rows of `keys` index keys each (the page table exactly as wide), H heads:
- keys read: B * keys * 256 B (bf16) or 132 B (fp8: 128 e4m3 values + an fp32 scale);
- query read: B * H * 128 * 2 B (bf16) or 1 B (fp8), head weights B * H * 4 B;
- page table read: B * ceil(keys / 64) * 4 B;
- logits written: B * keys * 4 B (every position, -inf past seq_len included).
Roofline time = bytes / bandwidth (1.8 TB/s: RTX PRO 6000's GDDR7). A model, not a measurement:
the GPU kit (`speed` stage) measures the achieved fraction of the copy bandwidth.
"""

from __future__ import annotations

import argparse

PAGE = 64
HEAD_DIM = 128
KEY_BYTES = {"bf16": 256, "fp8": 132}
QUERY_BYTES = {"bf16": 2, "fp8": 1}
KIT_BATCHES = (1, 8, 32, 64)
KIT_KEYS = (8192, 32768, 81920)


def bytes_per_call(batch: int, keys: int, heads: int = 64, dtype: str = "bf16") -> dict:
    parts = {
        "keys": batch * keys * KEY_BYTES[dtype],
        "query": batch * heads * HEAD_DIM * QUERY_BYTES[dtype],
        "weights": batch * heads * 4,
        "page_table": batch * -(-keys // PAGE) * 4,
        "logits": batch * keys * 4,
    }
    parts["total"] = sum(parts.values())
    return parts


def roofline_us(total_bytes: int, tbps: float = 1.8) -> float:
    return total_bytes / (tbps * 1e12) * 1e6


def rows(batches, keys_list, heads=64, tbps=1.8) -> list[dict]:
    out = []
    for keys in keys_list:
        for batch in batches:
            bf16 = bytes_per_call(batch, keys, heads, "bf16")["total"]
            fp8 = bytes_per_call(batch, keys, heads, "fp8")["total"]
            out.append({
                "batch": batch, "keys": keys,
                "bf16_mb": bf16 / 1e6, "bf16_us": roofline_us(bf16, tbps),
                "fp8_mb": fp8 / 1e6, "fp8_us": roofline_us(fp8, tbps),
            })
    return out


def markdown(table, tbps) -> str:
    lines = [
        f"| B | keys | bf16 MB | bf16 us at {tbps} TB/s | fp8 MB | fp8 us | bf16 / fp8 |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in table:
        lines.append(
            f"| {r['batch']} | {r['keys']:,} | {r['bf16_mb']:.1f} | {r['bf16_us']:.1f} | "
            f"{r['fp8_mb']:.1f} | {r['fp8_us']:.1f} | {r['bf16_us'] / r['fp8_us']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=list(KIT_BATCHES))
    parser.add_argument("--keys", type=int, nargs="+", default=list(KIT_KEYS))
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--tbps", type=float, default=1.8, help="bandwidth, TB/s (default 1.8)")
    args = parser.parse_args(argv)
    print(markdown(rows(args.batch, args.keys, args.heads, args.tbps), args.tbps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
