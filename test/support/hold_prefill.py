"""A test hook that holds one prefill forward inside a running server, so a test can stop the
process while a room waits for its KV (between the decode's slots being sent and the transfer).

Attached with upstream's own `--forward-hooks` (as support/corrupt_index_k.py is):

    --forward-hooks '[{"name": "hold", "target_modules": ["model.layers.0.self_attn"],
                       "hook_factory": "support.hold_prefill:factory",
                       "config": {"tokens": 2222, "seconds": 20}}]'

On a forward of exactly `tokens` query tokens (a prompt length no other request uses; the
server's health checks are one token) it logs one WARNING line, then sleeps `seconds` before the
forward goes on. A PD prefill forwards a request only once its decode has sent the room's KV
slots, and transfers the KV after the forward: a SIGSTOP while the line is fresh stops the
prefill with the slots given and nothing written. Every other forward passes untouched.
"""

from __future__ import annotations

import json
import logging
import time

from support.corrupt_index_k import _step

logger = logging.getLogger(__name__)

HELD_LINE = "test hook: prefill forward held"
# What a decode logs once a room's slots are given up for good (nixl-bootstrap-cascade's
# quarantine, after the prefill was declared dead) and watched (the sanitizer's late_write).
RELEASED_DEAD = "was declared dead after"
WATCHED = "watched for a late write"


def forward_hooks(tokens: int, seconds: float) -> str:
    """The `--forward-hooks` value that holds a prefill forward of `tokens` for `seconds`."""
    return json.dumps([{"name": "hold-prefill", "target_modules": ["model.layers.0.self_attn"],
                        "hook_factory": "support.hold_prefill:factory",
                        "config": {"tokens": tokens, "seconds": seconds}}])


def factory(config: dict):
    tokens = int(config["tokens"])
    seconds = float(config.get("seconds", 20))

    def hook(module, inputs, output):
        if _step()[0] == tokens:
            logger.warning("%s: %d tokens, %.0f s", HELD_LINE, tokens, seconds)
            time.sleep(seconds)  # after a SIGSTOP / SIGCONT the rest of it has passed already
        return None

    return hook
