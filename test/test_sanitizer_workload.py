"""A clean mixed workload gives no violation at sample 1.0 (every decode step read-checked).

The workload runs on upstream's own scheduling objects with the sanitizer's hooks in force
(test/support/workload.py says what is upstream's and what stands in for the model): prefix hits
from the radix tree, chunked prefill, evictions, and many decode steps whose c4 indexer page
tables come from upstream's builder, stale row tails included. A read check that mapped slots to
positions over the whole page-table row (past the row's length) gave 265 shadow_mismatch on this
workload.
"""

import random

import pytest
import torch
from sglang_dsv4.sanitizer import Sanitizer
from support.dsv4 import activated, small_pool
from support.workload import Workload, hook_into


def mixed_requests(workload: Workload, count: int, seed: int = 0) -> None:
    """`count` requests: most share one of three 512-token system prompts (prefix hits), prompt
    lengths up to about 1,400 tokens (chunked at 512), 8 to 40 new tokens each."""
    rng = random.Random(seed)
    systems = [[rng.randrange(50000) for _ in range(512)] for _ in range(3)]
    for i in range(count):
        base = systems[rng.randrange(3)] if rng.random() < 0.7 else []
        tokens = base + [rng.randrange(50000) for _ in range(rng.randrange(50, 900))]
        workload.submit(f"req-{i}", tokens, rng.randrange(8, 40))


@pytest.fixture
def bf16_chain_pool():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small host ops: threads only contend on a shared machine
    chain, pool = small_pool("bf16")
    with activated(chain):
        yield chain, pool
    torch.set_num_threads(threads)


@pytest.mark.slow  # about 10 s: 160 requests, some 900 decode steps, each one checked
def test_clean_mixed_workload_gives_no_violation_at_sample_one(bf16_chain_pool, monkeypatch):
    chain, pool = bf16_chain_pool
    san = Sanitizer(sample=1.0, seed=0)
    workload = Workload(chain, pool, hook_into(monkeypatch, san), seed=0)
    mixed_requests(workload, 160)
    stats = workload.run()
    assert [v.line() for v in san.violations] == []
    # The workload is the mixed one it claims to be, and the checks ran on it.
    assert stats["finished"] == 160
    assert stats["prefix_hits"] >= 50 and stats["prefill_chunks"] >= 200
    assert stats["evictions"] >= 50 and stats["decode_steps"] >= 500
    assert san.checked["row_reads"] == stats["row_reads"] >= 2000
    assert san.checked["shadows"] == stats["decode_steps"]
