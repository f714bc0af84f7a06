"""PD across a real link, cut while a room waits for its KV: no byte of the slots the decode gave
up changes (issue #23's canary, the network's half; test_pd.py stops the prefill process).

The decode server runs on a second host (support.netns.GuestHost: a network namespace whose
only way out is a veth pair to this host); the prefill, the router and the plain server run
here. A request's prefill forward is held by the test hook (support/hold_prefill.py); while it
is held, this host's end of the link goes down (packets lost, no connection reset). Both
heartbeats see it: the decode declares the prefill dead, fails the room and frees its slots
(poisoned, and watched by the sanitizer); the prefill declares the decode lost and fails the
room too. The link comes back, the held forward ends, and nothing may be written: the decode's
next allocation finds every watched page as it was freed (`late_write` 0), and the pair serves
the next prompt with the plain server's tokens.
"""

from __future__ import annotations

import concurrent.futures
import re
import time

import pytest
from support import netns
from support.hold_prefill import HELD_LINE, RELEASED_DEAD, WATCHED, forward_hooks
from support.live import (
    POOL_ARGS,
    SERVER_ARGS,
    env_for,
    generate,
    prompt_ids,
    serves_like_plain_and_clean,
)

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))

HELD_TOKENS = 2223  # a prompt length no other request here uses
HOLD_S = 30  # the held forward: longer than either side needs to see the cut
LOST_DECODE = "Lost connection with decode instance"  # prefill: its heartbeat


@pytest.fixture(scope="module")
def guest():
    with netns.GuestHost() as host:
        yield host
    assert not host.exists(), "the namespace was left behind"


@pytest.fixture(scope="module")
def split_launched(fleet, tiny_model_dir, guest):
    pair = fleet.pd(tiny_model_dir, *SERVER_ARGS, *POOL_ARGS, "--forward-hooks",
                    forward_hooks(HELD_TOKENS, HOLD_S),
                    env=env_for("fp8"), name="pd-guest", decode_guest=guest, wait=False)
    yield pair
    fleet.retire(pair.router, clean=False, wait=True)  # all before the namespace goes; a
    fleet.retire(pair.decode, pair.prefill, wait=True)  # router has no sanitizer


@pytest.fixture(scope="module")
def split(split_launched):
    return split_launched.ready()


def test_a_link_cut_mid_room_writes_nothing_into_the_slots_the_decode_gave_up(split, plain, guest):
    prefill, decode = split.prefill, split.decode
    p_mark, d_mark = prefill.log.stat().st_size, decode.log.stat().st_size
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        doomed = pool.submit(generate, split, prompt_ids(seed=170, length=HELD_TOKENS), 8)
        prefill.wait_log(p_mark, HELD_LINE, 300)
        guest.cut()
        t0 = time.monotonic()
        try:
            text = decode.wait_log(d_mark, RELEASED_DEAD, 120)
            t_decode = time.monotonic() - t0
            text = decode.wait_log(d_mark, WATCHED, 30)
            lost = prefill.wait_log(p_mark, LOST_DECODE, 120)
            t_prefill = time.monotonic() - t0
        finally:
            guest.restore()
        try:
            outcome = doomed.result(timeout=600)
        except Exception as e:  # the router answers the failed request with an error
            outcome = f"{type(e).__name__}: {e}"
    (room,) = set(re.findall(r"KV slots of failed room (\d+)", text))
    lines = [line for line in text.splitlines() if RELEASED_DEAD in line or WATCHED in line]
    lines += [line for line in lost.splitlines() if LOST_DECODE in line][:1]
    print(f"\nlink cut mid-room {room}: the decode freed its slots after {t_decode:.1f} s, the "
          f"prefill lost the decode after {t_prefill:.1f} s\n  " + "\n  ".join(lines)
          + f"\n  the request (the router retries it): {outcome}")

    # The held forward ended after the cut: the prefill failed the room it had lost rather than
    # transferring.
    refused = [line for line in prefill.log_since(p_mark).splitlines()
               if f"bootstrap_room={room}" in line]
    print("  " + "\n  ".join(refused))
    assert any("Prefill transfer failed" in line for line in refused), refused
    serves_like_plain_and_clean(split, plain, seed=171)
