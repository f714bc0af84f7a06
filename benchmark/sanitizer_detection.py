"""How soon the KV sanitizer catches each injected fault, at a sample rate (default 0.01).

    python -m benchmark.sanitizer_detection                 # about a minute on 2 cores
    python -m benchmark.sanitizer_detection --sample 0.01 --seeds 10 --json out/detection.json

Each run is the mixed workload of test/test_sanitizer_workload.py (upstream's ScheduleBatch,
RadixCache, Req, allocator and DeepSeek-V4 pool on the CPU, with the sanitizer's hooks in force;
test/support/workload.py says what stands in for the model), with one fault injected at the 50th
decode step. A one-off fault (a stale write location, a padding row's write, a page freed early,
a live page handed out again) happens once; a persistent one (every request's key for one c4
position lost; a kernel keeping the wrong half of its top-k) stays from then on. The figure is the
decode steps from the injection to the first violation of the expected kind: 0 is the same step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INJECT_AT = 50  # decode steps of clean running before the fault


def _setup():
    sys.path.insert(0, str(ROOT / "test"))
    from sglang.srt.plugins import load_plugins

    load_plugins()


def _requests(workload, count: int, seed: int) -> None:
    rng = random.Random(seed)
    systems = [[rng.randrange(50000) for _ in range(512)] for _ in range(3)]
    for i in range(count):
        base = systems[rng.randrange(3)] if rng.random() < 0.7 else []
        tokens = base + [rng.randrange(50000) for _ in range(rng.randrange(50, 900))]
        workload.submit(f"req-{i}", tokens, rng.randrange(8, 40))


class _Patch:
    """monkeypatch's setattr/undo for a run outside pytest."""

    def __init__(self):
        self.undo = []

    def setattr(self, owner, name, value):
        self.undo.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, value)

    def restore(self):
        for owner, name, value in reversed(self.undo):
            setattr(owner, name, value)


def _slot(w, req, position):
    return int(w.rows.req_to_token[req.kv.req_pool_idx, position])


def _inject(fault: str, w):
    """Arm the fault on the workload now (at the injection step)."""
    import torch

    reqs = list(w.running.reqs)
    if fault == "foreign_write" and len(reqs) >= 2:
        victim = reqs[1]

        def stale(w, fb):
            if fb.forward_mode.is_decode():
                fb.out_cache_loc = fb.out_cache_loc.clone()
                fb.out_cache_loc[0] = _slot(w, victim, 5)
                w.before_forward = None

        w.before_forward = stale
        return True
    if fault == "padded_write" and reqs:
        victim = reqs[-1]

        def padded(w, fb):
            if not fb.forward_mode.is_decode():
                return None
            w.before_forward = None
            return dataclasses.replace(
                fb,
                batch_size=fb.batch_size + 1,
                req_pool_indices=torch.cat((fb.req_pool_indices, torch.tensor([0]))),
                seq_lens=torch.cat((fb.seq_lens, torch.tensor([1]))),
                seq_lens_cpu=torch.cat((fb.seq_lens_cpu, torch.tensor([1]))),
                out_cache_loc=torch.cat((fb.out_cache_loc, torch.tensor([_slot(w, victim, 7)]))),
            )

        w.before_forward = padded
        return True
    if fault == "early_free" and reqs:
        row = reqs[0].kv.req_pool_idx
        w.alloc.free(w.rows.req_to_token[row, : w.alloc.page_size].to(torch.int64))
        return True
    if fault == "double_owner" and reqs:
        page = _slot(w, reqs[0], 0) // w.alloc.page_size
        w.alloc.free_pages = torch.cat((torch.tensor([page]), w.alloc.free_pages))
        return True
    if fault == "unwritten_read":
        w.skip_key = lambda req, pos: pos == 4 * 5 + 3  # every request's c4 key 5 is lost
        # Requests already running keep their written key 5; new ones lose it.
        return True
    if fault == "shadow_mismatch":
        w.wrong_topk = lambda positions, n: positions[: max(1, len(positions) // 2)]
        return True
    return False


def one_run(fault: str, sample: float, seed: int, count: int) -> int | None:
    import torch
    from sglang.srt.runtime_context import get_parallel
    from sglang_dsv4.sanitizer import Sanitizer
    from support.dsv4 import activated, small_pool
    from support.workload import Workload, hook_into

    chain, pool = small_pool("bf16")
    patch = _Patch()
    try:
        with activated(chain), get_parallel().override(tp_rank=0):
            san = Sanitizer(sample=sample, seed=seed)
            w = Workload(chain, pool, hook_into(patch, san), seed=seed)
            _requests(w, count, seed)
            injected_at = None
            while w.step():
                steps = w.stats["decode_steps"]
                if injected_at is None and steps >= INJECT_AT and _inject(fault, w):
                    injected_at = steps
                if injected_at is not None and san.counts[fault]:
                    return steps - injected_at
            return None
    finally:
        patch.restore()
        torch.set_num_threads(torch.get_num_threads())


FAULTS = (
    "foreign_write",
    "padded_write",
    "early_free",
    "double_owner",
    "unwritten_read",
    "shadow_mismatch",
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sample", type=float, default=0.01)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    _setup()
    import torch

    torch.set_num_threads(1)
    results = {}
    for fault in args.faults:
        steps = [one_run(fault, args.sample, seed, args.requests) for seed in range(args.seeds)]
        caught = [s for s in steps if s is not None]
        results[fault] = {
            "runs": len(steps),
            "caught": len(caught),
            "steps": steps,
            "median_steps": statistics.median(caught) if caught else None,
            "max_steps": max(caught) if caught else None,
        }
        print(
            f"{fault:16s} caught {len(caught)}/{len(steps)}; decode steps to detection: "
            f"median {results[fault]['median_steps']}, max {results[fault]['max_steps']} "
            f"(sample {args.sample})",
            flush=True,
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"sample": args.sample, "faults": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
