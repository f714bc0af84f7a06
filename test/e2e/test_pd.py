"""PD over NIXL on loopback against one plain server: the same greedy tokens for every prompt.

A prefill server and a decode server (`--disaggregation-mode prefill|decode`, NIXL over UCX on
this host) behind `sglang_router --pd-disaggregation`, against the session's plain server. Same
checkpoint, same kernels, same index-K dtype (fp8), requests one at a time so every batch holds
one request on both sides: the tokens must be equal, no tolerance. Anything else means the KV,
index-K or compress state that crossed NIXL differs from what the plain server computed.
On the CPU, NIXL moves the servers' host buffers (the CPU backend's nixl_hooks says why).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time

import pytest
from support.hold_prefill import (
    HELD_LINE,
    HELD_TRANSFER_LINE,
    RELEASED_DEAD,
    TRANSFER_OUTCOME,
    WATCHED,
    forward_hooks,
)
from support.live import (
    POOL_ARGS,
    SERVER_ARGS,
    env_for,
    first_divergence,
    generate,
    prompt_ids,
    serves_like_plain_and_clean,
)

# Lengths: inside the window, past it, past a c128 block and a c4 page, past the c4 top-k reach.
LENGTHS = (9, 150, 600, 2200)


# A prompt of HELD_TOKENS is held in its prefill forward, one of HELD_TRANSFER_TOKENS in the
# prefill's transfer worker (support/hold_prefill.py): the canary tests below stop the prefill
# there. No other prompt here has those lengths.
HELD_TOKENS = 2222
HELD_TRANSFER_TOKENS = 2224


@pytest.fixture(scope="module")
def pd_launched(fleet, tiny_model_dir):
    pair = fleet.pd(tiny_model_dir, *SERVER_ARGS, *POOL_ARGS, "--forward-hooks",
                    forward_hooks(HELD_TOKENS, 20, transfer_tokens=HELD_TRANSFER_TOKENS),
                    env=env_for("fp8"), wait=False)
    yield pair
    fleet.retire(pair.router, clean=False)  # a router has no sanitizer
    fleet.retire(pair.decode, pair.prefill)


@pytest.fixture(scope="module")
def pd(pd_launched):
    return pd_launched.ready()


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


def stop_prefill_until_its_room_is_given_up(pd, tokens: int, held_line: str, seed: int):
    """Send a prompt of `tokens`, SIGSTOP the whole prefill server once the hook logs
    `held_line`, SIGCONT once the decode has released the room's slots (the prefill declared
    dead) and the sanitizer watches them. Returns (room, the decode's and the prefill's lines
    about the room, seconds until the release, the request's outcome)."""
    prefill, decode = pd.prefill, pd.decode
    p_mark, d_mark = prefill.log.stat().st_size, decode.log.stat().st_size
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        doomed = pool.submit(generate, pd, prompt_ids(seed=seed, length=tokens), 8)
        prefill.wait_log(p_mark, held_line, 300)  # held for 20 s from here
        os.killpg(prefill.popen.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            text = decode.wait_log(d_mark, RELEASED_DEAD, 120)
            t_released = time.monotonic() - t0
            text = decode.wait_log(d_mark, WATCHED, 30)
        finally:
            os.killpg(prefill.popen.pid, signal.SIGCONT)
        try:
            outcome = doomed.result(timeout=600)
        except Exception as e:  # the router answers the failed request with an error
            outcome = f"{type(e).__name__}: {e}"
    (room,) = set(re.findall(r"KV slots of failed room (\d+)", text))
    lines = [line for line in text.splitlines() if RELEASED_DEAD in line or WATCHED in line]
    lines += [line for line in prefill.log_since(p_mark).splitlines() if room in line]
    return room, lines, t_released, outcome


def test_a_stopped_prefill_never_writes_into_the_slots_its_decode_gave_up(pd, plain):
    """Issue #23's canary, through real servers. The prefill server (every process of it) is
    stopped with SIGSTOP in a request's prefill forward (held there by a test hook, so the stop
    lands after the decode sent the room's slots and before any KV was written). The decode's
    heartbeat declares it dead, fails the room and, the prefill being dead, lets the room's KV
    slots out of the quarantine; the sanitizer poisons them as they are freed and watches them.
    SIGCONT: the prefill finishes that forward and must not transfer into the slots (it reads
    the decode's failure first). The next request's allocation checks every watched page still
    holds its poison (`late_write`), and the pair serves it with the plain server's tokens. (The
    router retries the failed request: the retry, its prompt now cached on the prefill, is
    served, and its allocation on the decode is the first check.)

    The pair it leaves must serve again (asserted here)."""
    room, lines, t_released, outcome = stop_prefill_until_its_room_is_given_up(
        pd, HELD_TOKENS, HELD_LINE, seed=160)
    print(f"\nSIGSTOP prefill mid-prefill: the decode released room {room}'s slots after "
          f"{t_released:.1f} s\n  " + "\n  ".join(lines)
          + f"\n  the request (the router retries it): {outcome}")
    # The prefill, woken, failed that room rather than transferring into the slots.
    assert any("Prefill transfer failed" in line and f"bootstrap_room={room}" in line
               for line in lines), lines
    serves_like_plain_and_clean(pd, plain, seed=161)


def test_a_prefill_stopped_with_a_chunk_queued_never_writes_it_into_given_up_slots(pd, plain):
    """Issue #23's last race, through real servers: the prefill's transfer worker has read the
    room as live and is about to write its chunk (held there by a test hook) when the whole
    prefill server gets SIGSTOP. The decode declares it dead and releases the room's slots (its
    lease on them long out); SIGCONT, and the worker goes on with the status it read before the
    stop, first to run: the hook keeps the control thread from reading the decode's failure of
    the room until the worker has reached its write. Without the lease it writes the chunk into
    the released slots (9 pages: the sanitizer's late_write at the decode's next allocation).
    With it, the worker finds no lease left, pings the decode, and the reply comes behind the
    decode's failure of the room: the room is refused with nothing written ("... failed before
    its KV was written ...; its lease ran out ...; nothing written").

    Runs last in this module: the pair it leaves must serve again (asserted here)."""
    room, lines, t_released, outcome = stop_prefill_until_its_room_is_given_up(
        pd, HELD_TRANSFER_TOKENS, HELD_TRANSFER_LINE, seed=162)
    held = [line for line in lines if HELD_TRANSFER_LINE in line]
    assert held and f"room {room}," in held[0], lines  # the stop fell on this room's chunk
    # The held chunk ends one way or the other: refused, or written (then the decode's next
    # allocation, below, finds its pages changed).
    ended = pd.prefill.wait_log(0, f"{TRANSFER_OUTCOME} {room} ", 120)
    ending = [line for line in ended.splitlines() if f"{TRANSFER_OUTCOME} {room} " in line]
    print(f"\nSIGSTOP prefill with a chunk queued: the decode released room {room}'s slots "
          f"after {t_released:.1f} s\n  " + "\n  ".join(dict.fromkeys(lines + ending))
          + f"\n  the request (the router retries it): {outcome}")
    serves_like_plain_and_clean(pd, plain, seed=163)
    # Refused by the lease: the room was still live when the chunk was ready (the control
    # thread had not read the decode's failure), and the reply that renewed it came after.
    assert "refused" in ending[0] and "failed before its KV was written" in ending[0], ending
    assert "its lease ran out" in ending[0], ending
