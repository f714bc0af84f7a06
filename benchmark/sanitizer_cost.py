"""What the KV sanitizer (SGLANG_DSV4_SANITIZE=1) costs per check, on the CPU, as ratios.

Each check is timed next to the operation it guards, in the same run, on upstream's real objects
(DeepSeek-V4-Flash DeepSeekV4TokenToKVPool at TP 4 / page 256 with bf16 index keys, upstream's
PagedTokenToKVPoolAllocator, device "cpu"), for requests of a few sizes:

    alloc         alloc_extend of one request            vs + the ledger (on_alloc)
    free          free of that request                   vs + ledger and poison (on_release)
    index-K write set_index_k_bf16 of its c4 keys, 1 layer vs + the write marks
    read check    one decode row's indexer (bf16 logits + top-512), 1 layer
                                                         vs check_read of that row
    shadow        the same indexer read                  vs the sampled reference re-scoring
    pd digest     copying the request's pages (the transfer's bytes, 42 buffers)
                                                         vs page_checksums of them

A sampled read check and shadow run on SGLANG_DSV4_SANITIZE_SAMPLE of decode steps (default 1 %),
once per c4 layer of the step; the other checks run on every call.

    python -m benchmark.sanitizer_cost                    # about a minute on 2 cores
    python -m benchmark.sanitizer_cost --tokens 4096 16384 --json out/sanitizer_cost.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from sglang_dsv4.acceptance.arg_types import positive_int

TOPK = 512


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokens",
        type=positive_int,
        nargs="+",
        default=[2048, 8192, 32768],
        help="tokens of the request each check guards (default: %(default)s)",
    )
    parser.add_argument(
        "--repeat",
        type=positive_int,
        default=5,
        help="timed runs each, the median is kept (default: %(default)s)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args(argv)


def median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def build(max_tokens: int):
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang_dsv4.plan.chain import build_chain, build_pool, size_for_tokens

    chain = build_chain("bf16")
    full_tokens = -(-(max_tokens + 256) // 2560) * 2560  # page-aligned for the SWA share too
    pool = build_pool(chain, size_for_tokens(chain, full_tokens, 4))
    alloc = PagedTokenToKVPoolAllocator(
        pool.full_size,
        page_size=256,
        dtype=torch.float8_e4m3fn,
        device="cpu",
        kvcache=pool,
        need_sort=False,
    )
    return pool, alloc


def measure(pool, alloc, tokens: int, repeat: int) -> list[dict]:
    from sgl_kernel_dsv4.index_logits import bf16_paged_mqa_logits
    from sglang_dsv4.sanitizer import Sanitizer, c4_layers, page_buffers, page_checksums

    san = Sanitizer(sample=1.0)
    layer = c4_layers(pool)[0]
    zero, lens, none = torch.tensor([0]), torch.tensor([tokens]), torch.tensor([-1])
    rows = []

    def row(check, plain_s, checked_s):
        rows.append(
            {
                "tokens": tokens,
                "check": check,
                "plain_s": plain_s,
                "check_s": checked_s,
                "ratio": checked_s / plain_s,
            }
        )

    # alloc / free: each timed alone, the rest of the cycle untimed
    def new_slots():
        return alloc.alloc_extend(zero, zero, lens, lens, none, tokens)

    def release(slots, checked: bool):
        if checked:
            san.on_release(alloc, torch.unique(slots // 256))
        alloc.free(slots)

    def timed_cycle(checked: bool, part: str) -> float:
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            slots = new_slots()
            if checked:
                san.on_alloc(alloc, slots, none)
            allocated = time.perf_counter()
            release(slots, checked)
            times.append(
                (allocated - start) if part == "alloc" else (time.perf_counter() - allocated)
            )
        return sorted(times)[repeat // 2]

    for part in ("alloc", "free"):
        row(part, timed_cycle(False, part), timed_cycle(True, part))

    # a live request for the rest
    slots = new_slots()
    san.on_alloc(alloc, slots, none)
    pages = torch.unique(slots // 256)
    san.row_pages[1] = set(pages.tolist())
    c4 = tokens // 4
    c4_slots = (pages.repeat_interleave(64) * 64 + torch.arange(64).repeat(len(pages)))[:c4]
    keys = torch.randn(c4, 128).to(torch.bfloat16)
    write_s = median_s(lambda: pool.set_index_k_bf16(layer, c4_slots.to(torch.int32), keys), repeat)
    write_check_s = median_s(
        lambda: (
            pool.set_index_k_bf16(layer, c4_slots.to(torch.int32), keys),
            san.on_index_k_write(pool, layer, c4_slots),
        ),
        repeat,
    )
    row("index-K write", write_s, write_check_s)

    q = torch.randn(1, 1, 64, 128).to(torch.bfloat16)
    weights = torch.rand(1, 64)
    table = pages.reshape(1, -1).to(torch.int32)
    c4_lens = torch.tensor([c4], dtype=torch.int32)
    kv = pool.get_index_k_bf16_buffer(layer)
    k = min(TOPK, c4)

    def indexer():
        logits = bf16_paged_mqa_logits(q, kv, weights, c4_lens, table, c4)
        return torch.topk(logits[0], k).indices

    read_s = median_s(indexer, repeat)
    positions = indexer()
    selected = c4_slots[positions].reshape(1, -1)
    read_check_s = median_s(
        lambda: san.check_read(pool, layer, torch.tensor([1]), table, c4_lens, selected), repeat
    )
    row("read check", read_s, read_check_s)
    shadow_s = median_s(
        lambda: san.shadow_check("bf16", layer, 1, q, kv, weights, c4, table[0], positions, topk=k),
        repeat,
    )
    row("shadow", read_s, shadow_s)
    assert not san.violations, san.violations[0].line()

    buffers = page_buffers(pool)
    copies = [torch.empty((len(pages), b.shape[1]), dtype=b.dtype) for b in buffers]
    copy_s = median_s(
        lambda: [
            torch.index_select(b, 0, pages, out=c) for b, c in zip(buffers, copies, strict=True)
        ],
        repeat,
    )
    row("pd digest", copy_s, median_s(lambda: page_checksums(pool, pages), repeat))
    alloc.free(slots)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # one core: comparable runs on a shared machine
    pool, alloc = build(max(args.tokens))
    results = [r for tokens in args.tokens for r in measure(pool, alloc, tokens, args.repeat)]
    print(f"{'tokens':>7}  {'check':<14} {'plain':>10} {'with check':>11} {'ratio':>7}")
    for r in results:
        print(
            f"{r['tokens']:>7}  {r['check']:<14} {r['plain_s'] * 1e3:>8.3f}ms "
            f"{r['check_s'] * 1e3:>9.3f}ms {r['ratio']:>7.2f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
