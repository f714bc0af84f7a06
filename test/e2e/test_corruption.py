"""The sanitizer on a live server reports a corruption injected mid-run, with its kind.

A server with the sanitizer on (sample 1.0) and upstream's `--forward-hooks` attaching the test
hook test/support/corrupt_index_k.py to the c4 layer 1: on the 4th decode step of the test's
300-token request the hook fills the first index-K page that request's indexer reads with poison
bytes. The next decode step's indexer
reads that page: the sanitizer must report it (kind `unwritten_read`), by its ERROR line and by
sglang:dsv4_sanitizer_violations_total{kind="unwritten_read"}.
"""

from __future__ import annotations

import json

import pytest
from support.corrupt_index_k import CORRUPTED_LINE
from support.live import (
    POOL_ARGS,
    SERVER_ARGS,
    env_for,
    generate,
    prompt_ids,
    sanitizer_counts,
)

HOOK = [{"name": "corrupt-index-k", "target_modules": ["model.layers.1.self_attn"],
         "hook_factory": "support.corrupt_index_k:factory", "config": {"arm_at_tokens": 256, "after_decode_steps": 4}}]


@pytest.fixture(scope="module")
def corrupted_launched(fleet, tiny_model_dir):
    server = fleet.server(tiny_model_dir, *SERVER_ARGS, *POOL_ARGS, "--forward-hooks",
                          json.dumps(HOOK), name="corrupted-fp8", env=env_for("fp8"), wait=False)
    yield server
    fleet.retire(server, clean=False)  # its violations are the test's own


@pytest.fixture(scope="module")
def corrupted(corrupted_launched):
    return corrupted_launched.ready()


def test_an_overwritten_index_k_page_is_reported_with_its_kind(corrupted):
    before = sanitizer_counts(corrupted)
    assert before is not None and sum(before.values()) == 0, before
    generate(corrupted, prompt_ids(seed=9, length=300), max_new_tokens=12)
    log = corrupted.log.read_text(errors="replace")
    assert CORRUPTED_LINE in log, "the test hook did not fire"
    after = sanitizer_counts(corrupted)
    assert after.get("unwritten_read", 0) >= 1, after
    lines = [line for line in log.splitlines() if "sanitizer violation" in line]
    assert any("kind=unwritten_read" in line and "layer=1" in line for line in lines), lines[-5:]
