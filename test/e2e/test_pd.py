"""PD over NIXL on loopback against one plain server: the same greedy tokens for every prompt.

A prefill server and a decode server (`--disaggregation-mode prefill|decode`, NIXL over UCX on
this host) behind `sglang_router --pd-disaggregation`, against the session's plain server. Same
checkpoint, same kernels, same index-K dtype (fp8), requests one at a time so every batch holds
one request on both sides: the tokens must be equal, no tolerance. Anything else means the KV,
index-K or compress state that crossed NIXL differs from what the plain server computed.
On the CPU, NIXL moves the servers' host buffers (the CPU backend's nixl_hooks says why).
"""

from __future__ import annotations

import pytest
from support.live import (
    POOL_ARGS,
    SERVER_ARGS,
    env_for,
    first_divergence,
    generate,
    prompt_ids,
)

# Lengths: inside the window, past it, past a c128 block and a c4 page, past the c4 top-k reach.
LENGTHS = (9, 150, 600, 2200)


@pytest.fixture(scope="module")
def pd(fleet, tiny_model_dir):
    return fleet.pd(tiny_model_dir, *SERVER_ARGS, *POOL_ARGS, env=env_for("fp8"))


def test_pd_gives_the_plain_servers_tokens(pd, plain):
    for i, n in enumerate(LENGTHS):
        prompt = prompt_ids(seed=100 + i, length=n)
        plain.post("/flush_cache", {})
        alone = generate(plain, prompt, max_new_tokens=12)
        split = generate(pd, prompt, max_new_tokens=12)
        assert len(split["ids"]) == 12
        where = first_divergence(alone["ids"], split["ids"])
        assert where is None, f"prompt of {n}: PD differs from plain at output {where}"


def test_pd_chat_through_the_router(pd, plain):
    messages = [{"role": "user", "content": "Read the file and list the keys."}]
    answers = [
        target.openai().chat.completions.create(model="default", messages=messages, max_tokens=16,
                                                temperature=0).choices[0].message.content
        for target in (plain, pd)
    ]
    assert answers[0] == answers[1]
