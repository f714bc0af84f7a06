"""One plain CPU server of the tiny DeepSeek-V4: it serves, deterministically, with every fix in.

Upstream's own model code end to end (DeepseekV4ForCausalLM, DeepseekV4AttnBackend, the real
DeepSeek-V4 pools) in `python -m sglang.launch_server --device cpu`, no other flag.
"""

from __future__ import annotations

import json
import os
import sys
import time

from sglang_dsv4 import warm_python
from support.live import first_divergence, generate, prompt_ids

# Logprob agreement between a prefill and a decode step of the same position. Both paths read the
# same cached keys (fp8 e4m3 in the KV pool, written once by the prefill) but compute the query
# side differently (the prefill's extend kernels on n+1 rows, the decode kernels on one): bf16
# rounding of activations (8 mantissa bits, relative 2^-8 = 0.0039 per rounding) through 4 layers
# and the 1024-way log-softmax. 0.05 nats is about ten such roundings on an O(1) logit; corruption
# (a wrong page, a missed write) moves logprobs by whole nats.
LOGPROB_TOLERANCE = 0.05


def test_two_identical_greedy_completions_give_identical_non_empty_text(plain):
    client = plain.openai()
    answers = [
        client.completions.create(model="default", prompt="The server reads the page", max_tokens=24,
                                  temperature=0, seed=0).choices[0].text
        for _ in range(2)
    ]
    assert answers[0], "empty completion"
    assert answers[0] == answers[1]


def test_two_identical_greedy_chats_give_identical_non_empty_text(plain):
    client = plain.openai()
    messages = [{"role": "user", "content": "Which file holds the index keys?"}]
    answers = []
    for _ in range(2):
        reply = client.chat.completions.create(model="default", messages=messages, max_tokens=24,
                                               temperature=0, seed=0)
        message = reply.choices[0].message
        answers.append((message.content or "") + (getattr(message, "reasoning_content", None) or ""))
    assert answers[0], "empty chat answer"
    assert answers[0] == answers[1]


def test_an_idle_cpu_server_rests_while_a_busy_one_works(plain):
    """The plugin gives a CPU server --sleep-on-idle (the suite's servers do not pass it): its
    processes then wait on their sockets when there is no work. Compared in CPU seconds, not
    time: over an idle interval the whole server (launcher, scheduler, detokenizer) takes less
    than a tenth of what one busy-polling scheduler takes (a core: as many CPU seconds as the
    interval lasts; measured with SGLANG_DSV4_CPU_SLEEP_ON_IDLE=0: 3.1 CPU s over 3 s idle), and
    less than the work of one short generation."""
    client = plain.openai()
    before = plain.cpu_seconds()
    client.completions.create(model="default", prompt="The server reads the page", max_tokens=32,
                              temperature=0, seed=0)
    busy = plain.cpu_seconds() - before
    interval_s = 3.0
    before = plain.cpu_seconds()
    time.sleep(interval_s)  # the interval measured, not a bound
    idle = plain.cpu_seconds() - before
    assert idle < 0.1 * interval_s, f"{idle:.2f} CPU s in {interval_s} s idle (busy: {busy:.2f})"
    assert idle < busy, f"idle {idle:.2f} CPU s, a 32-token generation {busy:.2f}"


def test_status_in_the_servers_environment_shows_every_fix_applied(plain):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               SGLANG_DSV4_INDEX_K_DTYPE="fp8")
    proc = warm_python.run(["-m", "sglang_dsv4", "status", "--json", "--strict"], env=env,
                           timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    fixes = [f for f in report["fixes"] if f["implemented"]]
    assert fixes and all(f["status"] == "applied" for f in fixes), fixes


def test_prefill_of_n_plus_one_agrees_with_prefill_of_n_and_one_decode_step(plain):
    """The distribution after n+1 prompt tokens, computed by a decode step (prefill n, decode the
    first output token) and by a prefill of all n+1: the same next token, logprobs within
    LOGPROB_TOLERANCE. 300 tokens cross the window (128), a c4 page (64 slots = 256 tokens) and
    two c128 blocks."""
    worst = 0.0
    for n in (37, 300):
        prompt = prompt_ids(seed=n, length=n)
        plain.post("/flush_cache", {})
        decoded = generate(plain, prompt, max_new_tokens=2, top_logprobs=5)
        plain.post("/flush_cache", {})
        prefilled = generate(plain, prompt + decoded["ids"][:1], max_new_tokens=1, top_logprobs=5)
        assert prefilled["cached"] == 0, "the n+1 prefill must not reuse the first run's cache"
        by_decode = dict(decoded["top"][1])
        by_prefill = dict(prefilled["top"][0])
        assert decoded["ids"][1] == prefilled["ids"][0], (n, by_decode, by_prefill)
        shared = set(by_decode) & set(by_prefill)
        assert decoded["ids"][1] in shared
        for token in shared:
            worst = max(worst, abs(by_decode[token] - by_prefill[token]))
    print(f"prefill n+1 vs prefill n + decode: worst |d logprob| {worst:.4f}")
    assert worst <= LOGPROB_TOLERANCE


def test_a_long_prompt_selects_with_the_indexer_and_still_repeats_itself(plain):
    """Past 2048 tokens the c4 top-k (512 of the compressed keys) actually selects: the same
    greedy tokens twice, once computed and once from the radix cache."""
    prompt = prompt_ids(seed=2048, length=2300)
    plain.post("/flush_cache", {})
    first = generate(plain, prompt, max_new_tokens=8)
    again = generate(plain, prompt, max_new_tokens=8)
    assert again["cached"] > 0
    assert first_divergence(first["ids"], again["ids"]) is None, (first["ids"], again["ids"])
