"""HiCache with host offload forced against HiCache off (bf16 index keys), and bf16 against fp8.

The HiCache server's device pool holds the two running requests and little more (3072 tokens,
pages of 256); the workload cycles through four shared prefixes of 1024 tokens, two requests at a
time, so every prefix is evicted to the host and loaded back while another request decodes
(the CPU backend's host pools: cpu_backend/hicache_hooks.py). It is compared with its twin: the
same server without HiCache (same pool, same running limit, same prefill chunks).

What is compared, and the tolerance:
- Bytes: every page a load brings back is digested against the digest taken at its backup by the
  sanitizer (`hicache_checksum`, on for the whole suite): 0 mismatches, and loads happened
  (upstream's `host_hit` prefill tokens > 0).
- The first token of every request (or, at a near tie, the runner-up within one bf16 step:
  1/32 at these magnitudes, 4 to 8) and its top-5 logprobs within one bf16 step. Both servers cut
  every prefill into chunks of one page (--chunked-prefill-size 256), so the last chunk of a
  prompt (its 40 own tokens) is computed the same way whether its 1024-token prefix was just
  computed, found on the device or loaded from the host. (Without fixed chunks the scheduler cuts
  a chunk to the free pool at that moment, and a prefill cut otherwise sums in another order.)
  Not to the bit: even then the first round, where neither server has anything cached, differed
  by one bf16 step in two of the top-5 (0.0151 at -4.78), so something besides the prefix's bytes
  (where the pages lie, and the order the CPU kernels sum them in with it) moves the last bit. A
  prefix page loaded wrong or stale changes what the prefill attends to, not the last bit of a
  logit; the bytes themselves are checked above.
- Later tokens are reported, not asserted: a decode batch pairs requests as they happen to meet,
  and on this CPU that alone changes a greedy token after the first in some requests (the plain
  server against itself, two requests at a time: 3 of 12).

bf16 against fp8 index keys is not an equality: fp8 keys (e4m3 values with one scale per 128)
rank the c4 candidates differently once the top-k selects (past 2048 tokens). The overlap of
the next-token top-5 and the greedy token agreement are reported, not asserted equal.
"""

from __future__ import annotations

import concurrent.futures

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.live import (
    POOL_ARGS,
    SERVER_ARGS,
    env_for,
    generate,
    prompt_ids,
    sanitizer_counts,
)

PREFIX = 1024  # tokens of each shared prefix (4 pages of 256)
PREFIXES = 4
RUNNING = 2
# Device pool: the two running requests (1064 + 10 tokens: 5 pages each) and two pages more.
DEVICE_TOKENS = 3072
# The HiCache server and its twin without HiCache: one pool, one running limit, one chunk size.
SMALL_POOL_ARGS = ("--max-total-tokens", str(DEVICE_TOKENS), "--swa-full-tokens-ratio", "0.5",
                   "--max-running-requests", str(RUNNING), "--chunked-prefill-size", "256")


def _bf16_server(fleet, tiny_model_dir, name: str, *args: str):
    """A module's server with bf16 index keys: launched, retired (checked clean) at the end."""
    server = fleet.server(tiny_model_dir, *SERVER_ARGS, *args, name=name, env=env_for("bf16"),
                          wait=False)
    yield server
    fleet.retire(server)


@pytest.fixture(scope="module")
def hicache_launched(fleet, tiny_model_dir):
    yield from _bf16_server(fleet, tiny_model_dir, "hicache-bf16", *SMALL_POOL_ARGS,
                            "--enable-hierarchical-cache", "--hicache-ratio", "4")


@pytest.fixture(scope="module")
def hicache(hicache_launched):
    return hicache_launched.ready()


@pytest.fixture(scope="module")
def hicache_off_launched(fleet, tiny_model_dir):
    yield from _bf16_server(fleet, tiny_model_dir, "hicache-off-bf16", *SMALL_POOL_ARGS)


@pytest.fixture(scope="module")
def hicache_off(hicache_off_launched):
    return hicache_off_launched.ready()


@pytest.fixture(scope="module")
def plain_bf16_launched(fleet, tiny_model_dir):
    """The plain server with bf16 index keys (conftest's `plain` has fp8)."""
    yield from _bf16_server(fleet, tiny_model_dir, "plain-bf16", *POOL_ARGS)


@pytest.fixture(scope="module")
def plain_bf16(plain_bf16_launched):
    return plain_bf16_launched.ready()


BF16_STEP = 1 / 32  # one bf16 step for values in [4, 8)


def top_distance(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> float:
    """How far apart two top-k lists of (token, logprob) are: the largest logprob difference of a
    token in both, and for a token in one only (a near-tie at the k-th place), how far it lies
    above the other list's k-th logprob."""
    la, lb = dict(a), dict(b)
    gaps = [abs(la[t] - lb[t]) for t in la.keys() & lb.keys()]
    gaps += [max(0.0, la[t] - min(lb.values())) for t in la.keys() - lb.keys()]
    gaps += [max(0.0, lb[t] - min(la.values())) for t in lb.keys() - la.keys()]
    return max(gaps)


def test_top_distance_reads_a_tie_at_the_boundary_as_close():
    a = [(1, -1.0), (2, -2.0), (3, -3.0)]
    assert top_distance(a, [(1, -1.01), (2, -2.0), (4, -3.0)]) == pytest.approx(0.01)
    assert top_distance(a, [(1, -1.0), (2, -2.0), (4, -2.5)]) == pytest.approx(0.5)
    assert top_distance(a, [(5, -0.5), (2, -2.0), (3, -3.0)]) == pytest.approx(2.5)


def _workload():
    prefixes = [prompt_ids(seed=300 + p, length=PREFIX) for p in range(PREFIXES)]
    rounds = []
    for r in range(3):
        rounds.append([prefixes[p] + prompt_ids(seed=1000 * r + p, length=40)
                       for p in range(PREFIXES)])
    return rounds


def _run(target, rounds) -> list[dict]:
    out = []
    with concurrent.futures.ThreadPoolExecutor(RUNNING) as pool:
        for prompts in rounds:
            # Two at a time: a prefix comes back from the host while another request decodes.
            out += list(pool.map(
                lambda p: generate(target, p, max_new_tokens=10, top_logprobs=5), prompts))
    return out


def host_hit_tokens(target) -> float:
    """Prompt tokens upstream served from the HiCache host pool (its `host_hit` prefill mode)."""
    status, text = target.get("/metrics")
    assert status == 200, f"/metrics answered HTTP {status}"
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "sglang:prefill_effective_tokens_total"
        and sample.labels.get("mode") == "host_hit"
    )


def test_hicache_with_host_offload_gives_the_tokens_of_hicache_off(hicache, hicache_off):
    rounds = _workload()
    want = _run(hicache_off, rounds)
    hits_before = host_hit_tokens(hicache)
    got = _run(hicache, rounds)

    loaded = host_hit_tokens(hicache) - hits_before
    later = [r["cached"] for r in got[PREFIXES:]]
    print(f"\nHiCache: {loaded:.0f} prompt tokens loaded from the host; cached per later "
          f"request {later}")
    assert loaded >= PREFIX, "no prefix came back from the host: the test proves nothing"
    counts = sanitizer_counts(hicache)
    assert counts is not None and counts.get("hicache_checksum", 0) == 0, counts

    worst, agreeing, total, flips = 0.0, 0, 0, 0
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        if a["ids"][0] != b["ids"][0]:  # only a near tie may flip it
            top_a = dict(a["top"][0])
            gap = abs(top_a[a["ids"][0]] - top_a.get(b["ids"][0], float("-inf")))
            assert gap <= BF16_STEP, f"request {i}: first token {a['top'][0]} vs {b['top'][0]}"
            flips += 1
        worst = max(worst, top_distance(a["top"][0], b["top"][0]))
        agreeing += sum(x == y for x, y in zip(a["ids"], b["ids"], strict=False))
        total += len(a["ids"])
    print(f"HiCache vs off: first tokens {len(got) - flips}/{len(got)} equal (the rest near "
          f"ties), top-5 within {worst:.4f} (logprob); greedy tokens agreeing {agreeing}/{total}")
    assert worst <= BF16_STEP, worst


def test_bf16_against_fp8_index_keys_is_reported(plain, plain_bf16):
    overlap, agree, total = [], 0, 0
    for i, n in enumerate((300, 2200, 3000)):
        prompt = prompt_ids(seed=500 + i, length=n)
        a = generate(plain, prompt, max_new_tokens=8, top_logprobs=5)
        b = generate(plain_bf16, prompt, max_new_tokens=8, top_logprobs=5)
        for sa, sb in zip(a["top"], b["top"], strict=False):
            overlap.append(len({t for t, _ in sa} & {t for t, _ in sb}) / 5)
        agree += sum(x == y for x, y in zip(a["ids"], b["ids"], strict=False))
        total += len(a["ids"])
    mean = sum(overlap) / len(overlap)
    print(f"bf16 vs fp8 index keys: next-token top-5 overlap {mean:.3f}, "
          f"greedy tokens agreeing {agree}/{total}")
    assert total and 0.0 <= mean <= 1.0
