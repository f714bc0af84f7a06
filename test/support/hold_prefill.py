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

With `"at": "transfer"` the forward goes on at once and the hold falls later, in the prefill's
NIXL transfer worker, on the chunk that forward queued: after the worker has read the room as
live and taken its transfer infos, before it writes (its Transferring step). The hook logs one
WARNING line naming the room and holds until `seconds` pass or the process is continued after a
stop: a worker stopped between reading a live room and writing its chunk, and first to run when
the process is continued (the hook makes that instant wide enough for a test to hit it). The
control thread reads the decode's failure of that room (upstream's ABORT, PD_ROOM_FAILED) only
once the worker has reached its write, and CONTROL_LAG_S later: an order a woken process may
take, and one a plain re-read of the room's status before writing would not survive.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time

from support.corrupt_index_k import _step

logger = logging.getLogger(__name__)

HELD_LINE = "test hook: prefill forward held"
HELD_TRANSFER_LINE = "test hook: prefill transfer held"
TRANSFER_OUTCOME = "test hook: the held transfer of room"
# How long the prefill's control thread stays behind its woken worker before it reads the
# decode's failure of the held room.
CONTROL_LAG_S = 0.5
# What a decode logs once a room's slots are given up for good (nixl-bootstrap-cascade's
# quarantine, after the prefill was declared dead) and watched (the sanitizer's late_write).
RELEASED_DEAD = "was declared dead after"
WATCHED = "watched for a late write"


def forward_hooks(tokens: int, seconds: float, transfer_tokens: int | None = None) -> str:
    """The `--forward-hooks` value that holds a prefill forward of `tokens` for `seconds` and,
    given `transfer_tokens`, the transfer of a prompt of that many tokens for as long."""
    holds = [(tokens, "forward")] + ([(transfer_tokens, "transfer")] if transfer_tokens else [])
    return json.dumps([{"name": f"hold-prefill-{at}",
                        "target_modules": ["model.layers.0.self_attn"],
                        "hook_factory": "support.hold_prefill:factory",
                        "config": {"tokens": n, "seconds": seconds, "at": at}}
                       for n, at in holds])


def factory(config: dict):
    tokens = int(config["tokens"])
    seconds = float(config.get("seconds", 20))
    at = config.get("at", "forward")
    if at == "transfer":
        armed = _hold_next_transfer(seconds)
    elif at != "forward":
        raise ValueError(f"hold_prefill: 'at' must be 'forward' or 'transfer', not {at!r}")

    def hook(module, inputs, output):
        if _step()[0] != tokens:
            return None
        if at == "transfer":
            armed.set()  # the chunk this forward queues is held in the transfer worker
            return None
        logger.warning("%s: %d tokens, %.0f s", HELD_LINE, tokens, seconds)
        time.sleep(seconds)  # after a SIGSTOP / SIGCONT the rest of it has passed already
        return None

    return hook


def _hold_next_transfer(seconds: float) -> threading.Event:
    """Wrap the NIXL manager's update_status and check_status once in this process. When armed,
    the transfer worker's next Transferring step (taken once it has read the room's status and
    transfer infos, before the chunk's first write) is held: for `seconds`, or until the process
    was stopped and continued, so the worker goes on the moment a SIGCONT lands. Then the real
    step runs (the distribution's lease is in it). How the chunk ends is logged, one line
    starting TRANSFER_OUTCOME: "refused: <why>" when the step raised (nothing was posted),
    "settled" at the worker's next read of the room (its writes have landed)."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager

    armed, at_write = threading.Event(), threading.Event()
    held_rooms: set[int] = set()
    read, update = NixlKVManager.check_status, NixlKVManager.update_status
    handle = NixlKVManager._handle_prefill_control_message

    def handle_late(self, frames):
        # The worst order of threads on waking: the control thread reads the decode's failure
        # of the held room (upstream's ABORT or PD_ROOM_FAILED) only once the worker has reached
        # its Transferring step, and CONTROL_LAG_S after (the replies it sent queue behind).
        if frames[0] in (b"ABORT", b"PD_ROOM_FAILED") and _room(frames) in held_rooms:
            at_write.wait(seconds + 60)
            time.sleep(CONTROL_LAG_S)
        return handle(self, frames)

    def from_worker() -> bool:
        return sys._getframe(2).f_code.co_name == "transfer_worker"

    def check_status(self, bootstrap_room: int):
        status = read(self, bootstrap_room)
        if bootstrap_room in held_rooms and from_worker():
            held_rooms.discard(bootstrap_room)
            logger.warning("%s %s settled", TRANSFER_OUTCOME, bootstrap_room)
        return status

    def update_status(self, bootstrap_room: int, status):
        if status != KVPoll.Transferring or not armed.is_set() or not from_worker():
            return update(self, bootstrap_room, status)
        armed.clear()
        held_rooms.add(bootstrap_room)
        logger.warning("%s: room %s, %.0f s", HELD_TRANSFER_LINE, bootstrap_room, seconds)
        _sleep_until_continued(seconds)
        at_write.set()
        try:
            return update(self, bootstrap_room, status)
        except Exception as e:
            held_rooms.discard(bootstrap_room)
            logger.warning("%s %s refused: %s", TRANSFER_OUTCOME, bootstrap_room, e)
            raise

    NixlKVManager.check_status = check_status
    NixlKVManager.update_status = update_status
    NixlKVManager._handle_prefill_control_message = handle_late
    return armed


def _sleep_until_continued(seconds: float) -> None:
    """Sleep `seconds`, or less: return as soon as the clock jumped, i.e. the process was
    stopped and has just been continued."""
    end = last = time.monotonic()
    end += seconds
    while (now := time.monotonic()) < end:
        if now - last > 1.0:
            return
        last = now
        time.sleep(0.05)


def _room(frames) -> int | None:
    try:
        return int(bytes(frames[1]).decode("ascii"))
    except (IndexError, ValueError, UnicodeDecodeError):
        return None
