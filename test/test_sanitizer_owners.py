"""Per-request page ownership: each fault injected into a workload on upstream's own scheduling
objects (test/support/workload.py), each caught as a violation naming both requests, and `abort`
failing the request that did the wrong thing through upstream's Req.set_finish_with_abort.

Ownership comes from what each forward uses (the batch's req_pool_indices, seq_lens and
out_cache_loc, and the rows' page tables), so the write checks also hold where the extend path
fills rows in a kernel past ReqToTokenPool.write (a GPU server): the double-owner case runs both
with that write hooked and without it.
"""

import dataclasses
import random

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang_dsv4 import sanitizer
from sglang_dsv4.sanitizer import Sanitizer
from support.dsv4 import activated, small_pool
from support.workload import PAGE, Workload, hook_into

REQ_WRITE = f"{sanitizer.hooks._REQ_POOL}.write"


@pytest.fixture
def chain_pool():
    from sglang.srt.runtime_context import get_parallel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    chain, pool = small_pool("bf16")
    # A one-rank scheduler: its process writes tp_rank when it builds its groups, which
    # upstream's Req.set_finish_with_abort reads (to log on rank 0 only).
    with activated(chain), get_parallel().override(tp_rank=0):
        yield chain, pool
    torch.set_num_threads(threads)


def workload(chain_pool, monkeypatch, action="abort", skip=()):
    chain, pool = chain_pool
    san = Sanitizer(sample=1.0, action=action, seed=0)
    targets = {t for t, _, _ in sanitizer.bind(san)} - set(skip)
    w = Workload(chain, pool, hook_into(monkeypatch, san, only=targets), seed=1)
    return san, w


def submit(w, count, shared=0, new_tokens=30, seed=3, name="req"):
    rng = random.Random(seed)
    system = [rng.randrange(50000) for _ in range(shared)]
    for i in range(count):
        tokens = system + [rng.randrange(50000) for _ in range(rng.randrange(300, 600))]
        w.submit(f"{name}-{i}", tokens, new_tokens)


def run_until(w, condition, limit=500):
    for _ in range(limit):
        if condition():
            return
        assert w.step(), "workload ended before the condition held"
    raise AssertionError("condition never held")


def running(w):
    return list(w.running.reqs) if w.running is not None else []


def slot(w, req, position):
    return int(w.rows.req_to_token[req.kv.req_pool_idx, position])


def kinds(san):
    return {k: n for k, n in san.counts.items() if n}


def test_clean_run_of_these_workloads_is_clean(chain_pool, monkeypatch):
    san, w = workload(chain_pool, monkeypatch)
    submit(w, 8, shared=512)
    w.run()
    assert kinds(san) == {} and san.checked["forwards"] > 50


def test_a_write_into_another_requests_page_is_foreign_write_and_aborts_the_writer(
    chain_pool, monkeypatch
):
    san, w = workload(chain_pool, monkeypatch)
    submit(w, 3)
    run_until(w, lambda: len(running(w)) >= 2 and w.stats["decode_steps"] >= 3)
    writer, victim = running(w)[:2]

    def stale_location(w, fb):
        if fb.forward_mode.is_decode():
            fb.out_cache_loc = fb.out_cache_loc.clone()
            fb.out_cache_loc[0] = slot(w, victim, 5)  # the writer's key lands in the victim's
            w.before_forward = None

    w.before_forward = stale_location
    w.step()
    v = san.violations[0]  # then the writer's own slot, never written, is read: unwritten_read
    assert v.kind == "foreign_write" and v.page == slot(w, victim, 5) // PAGE
    assert v.request == f"{writer.rid} (row {writer.kv.req_pool_idx})"
    assert f"held by {victim.rid} (row {victim.kv.req_pool_idx})" in v.found
    assert writer.to_finish is not None and victim.to_finish is None
    assert writer.to_finish.status_code == 500


def test_a_shared_prefix_freed_by_one_sharer_is_early_free_naming_both(chain_pool, monkeypatch):
    san, w = workload(chain_pool, monkeypatch)
    submit(w, 2, shared=512)  # the second request hits the first one's 512-token prefix...
    run_until(w, lambda: w.stats["finished"] == 0 and len(running(w)) == 2)
    first, second = running(w)
    assert second.prefix_len == 512  # ... and holds its two pages through the radix tree
    shared = slot(w, second, 0) // PAGE
    first_row = first.kv.req_pool_idx

    def forget_the_prefix(w, req):
        if req is first:  # the fault: released as if nothing of its row were the tree's
            req.kv.cache_protected_len = 0

    w.before_release = forget_the_prefix
    run_until(w, lambda: w.stats["finished"] >= 1)
    found = [v for v in san.violations if v.kind == "early_free"]
    assert found and {v.page for v in found} >= {shared}
    v = next(v for v in found if v.page == shared)
    assert v.request == f"{first.rid} (row {first_row})"
    assert f"while held by {second.rid}" in v.found and "refcount 1" in v.found
    assert second.to_finish is None  # the holder keeps running; the releaser did the wrong thing


def test_a_page_freed_while_its_request_runs_is_early_free_and_aborts_the_holder(
    chain_pool, monkeypatch
):
    san, w = workload(chain_pool, monkeypatch)
    submit(w, 2)
    run_until(w, lambda: len(running(w)) == 2 and w.stats["decode_steps"] >= 2)
    holder = running(w)[0]
    page_slots = w.rows.req_to_token[holder.kv.req_pool_idx, :PAGE].to(torch.int64)
    w.alloc.free(page_slots)  # freed early, outside any release
    (v,) = san.violations
    assert (v.kind, v.page, v.request) == (
        "early_free",
        int(page_slots[0]) // PAGE,
        "an unattributed free",
    )
    assert f"held by {holder.rid}" in v.found
    assert holder.to_finish is not None


def test_a_padding_row_writing_a_live_slot_is_padded_write(chain_pool, monkeypatch):
    san, w = workload(chain_pool, monkeypatch)
    submit(w, 2)
    run_until(w, lambda: len(running(w)) == 2 and w.stats["decode_steps"] >= 2)
    victim = running(w)[1]

    def padded(w, fb):
        if not fb.forward_mode.is_decode():
            return None
        w.before_forward = None
        # One padding row (row 0, bound to no request) with a stale location: a live slot.
        pad = torch.tensor([0])
        return dataclasses.replace(
            fb,
            batch_size=fb.batch_size + 1,
            req_pool_indices=torch.cat((fb.req_pool_indices, pad)),
            seq_lens=torch.cat((fb.seq_lens, torch.tensor([1]))),
            seq_lens_cpu=torch.cat((fb.seq_lens_cpu, torch.tensor([1]))),
            out_cache_loc=torch.cat((fb.out_cache_loc, torch.tensor([slot(w, victim, 7)]))),
            forward_mode=ForwardMode.DECODE,
        )

    w.before_forward = padded
    w.step()
    (v,) = san.violations
    assert (v.kind, v.request, v.page) == (
        "padded_write",
        "padding row 0",
        slot(w, victim, 7) // PAGE,
    )
    assert f"held by {victim.rid}" in v.found
    assert victim.to_finish is not None  # its key was overwritten


@pytest.mark.parametrize("req_write_hooked", [True, False], ids=["row-write", "kernel-fill"])
def test_a_live_page_handed_out_again_is_double_owner_naming_the_receiver(
    chain_pool, monkeypatch, req_write_hooked
):
    skip = () if req_write_hooked else (REQ_WRITE,)
    san, w = workload(chain_pool, monkeypatch, skip=skip)
    submit(w, 1)
    run_until(w, lambda: w.stats["decode_steps"] >= 1)
    (earlier,) = running(w)
    submit(w, 1, seed=4, name="next")
    admitted = len(w.admitted)
    live_page = slot(w, earlier, 0) // PAGE
    # The fault: the allocator's free list gets a page that is still in use.
    w.alloc.free_pages = torch.cat((torch.tensor([live_page]), w.alloc.free_pages))
    run_until(w, lambda: len(w.admitted) > admitted)
    receiver = w.admitted[-1]
    v = next(v for v in san.violations if v.kind == "double_owner")
    assert v.page == live_page
    assert v.request == f"{receiver.rid} (row {receiver.kv.req_pool_idx})"
    assert f"held by {earlier.rid}" in v.found
    assert receiver.to_finish is not None and earlier.to_finish is None
