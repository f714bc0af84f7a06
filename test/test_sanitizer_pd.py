"""The sanitizer's PD transfer check end to end: page digests ride the room's Success status.

Real upstream code: DeepSeek-V4 bf16 pools (device="cpu") from upstream's sizing chain; NIXL
agents (UCX, host memory) registering their buffers through NixlKVManager; the decode's
registration and room messages from its own builders; the prefill's add_transfer_request (the
TransferKVChunk it queues), send_kvcache and conclude_transfer, which sends the room's status over
a real ZMQ socket on loopback; the decode's parse_kv_status_message and apply_prefill_status.

The sanitizer's hooks are applied to those upstream methods for one test at a time (monkeypatch,
wrapping them as upstream's HookRegistry AFTER wrapper does), so the rest of the session runs
unhooked. Stand-ins, and why: NixlKVManager.__init__ needs a GPU, a bootstrap server and the
scheduler's runtime context, so managers are made with object.__new__ and given the attributes
__init__ sets; the decode manager stands in for the remote peer. The prefill's transfer worker
thread is not run: the test calls send_kvcache with the chunk that worker would dequeue.
"""

from __future__ import annotations

import functools
import logging
import time

import numpy as np
import pytest
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.nixl.conn import (
    KVArgsRegisterInfo,
    NixlKVManager,
    TransferInfo,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang_dsv4 import sanitizer
from sglang_dsv4.hooks import resolve
from sglang_dsv4.sanitizer import PD_DIGEST_TAG, Sanitizer, c4_layers
from support.dsv4 import small_pool
from support.nixl import (
    close_pool_managers,  # noqa: F401 (autouse: closes the managers' zmq contexts)
    new_room,
    pool_manager,
)
from support.sanitizer import make_server

PAGE = 256


@pytest.fixture(scope="module")
def pools():
    return {"prefill": small_pool("bf16")[1], "decode": small_pool("bf16")[1]}


def manager(mode: DisaggregationMode, pool) -> NixlKVManager:
    return pool_manager(mode, pool, PAGE)


def hook_after(monkeypatch, san: Sanitizer, *targets: str) -> None:
    """Wrap each upstream method with the sanitizer's AFTER hook, as HookRegistry does."""
    hooks = {target: hook for target, hook, _ in sanitizer.bind(san)}
    for target in targets:
        owner, name, original = resolve(target)
        hook = hooks[target]

        def wrapper(*args, _original=original, _hook=hook, **kwargs):
            result = _original(*args, **kwargs)
            modified = _hook(result, *args, **kwargs)
            return modified if modified is not None else result

        monkeypatch.setattr(owner, name, functools.wraps(original)(wrapper))


PREFILL_HOOKS = (
    f"{sanitizer.hooks._CHUNK}.__init__",
    f"{sanitizer.hooks._COMMON_MANAGER}._encode_kv_status_message",
)
DECODE_HOOKS = (
    f"{sanitizer.hooks._NIXL_MANAGER}.build_receiver_metadata_message",
    f"{sanitizer.hooks._COMMON_MANAGER}.parse_kv_status_message",
)


def fill_random(pool, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for rows in sanitizer.page_buffers(pool):
        rows.copy_(torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=generator))


def transfer(prefill, decode, src_pages, dst_pages, after_arrival=None):
    """One room from registration to the decode's parsed status; returns (room, parsed)."""
    info_msg = decode.build_receiver_registration_message()
    peer = KVArgsRegisterInfo.from_zmq(info_msg[1:])
    prefill._add_remote_peer(peer)
    room = new_room()
    for mgr in (prefill, decode):
        mgr.update_status(room, KVPoll.Bootstrapping)
        mgr.update_status(room, KVPoll.WaitingForInput)
    decode.prefill_response_tracker[room] = set()
    decode.required_prefill_response_num_table[room] = 1
    message = decode.build_receiver_metadata_message(
        bootstrap_room=room,
        required_dst_info_num=1,
        kv_indices=np.asarray(dst_pages, dtype=np.int32),
        aux_index=0,
        state_indices=None,
        decode_prefix_len=0,
        is_dummy=False,
    )
    info = TransferInfo.from_zmq(message[1:])
    prefill.transfer_infos[room] = {info.agent_name: info}
    # Two chunks, as a chunked prefill queues them.
    half = len(src_pages) // 2
    for part, is_last in ((slice(0, half), False), (slice(half, len(src_pages)), True)):
        prefill.add_transfer_request(
            room, np.asarray(src_pages[part], np.int32), part, is_last, aux_index=0
        )
        chunk = prefill.transfer_queues[0].get_nowait()
        handle = prefill.send_kvcache(
            info.agent_name,
            chunk.prefill_kv_indices,
            peer.dst_kv_ptrs,
            info.dst_kv_indices[chunk.index_slice],
            peer.gpu_id,
            dst_mem_kind=peer.dst_homogeneous_mem_kind,
        )
        deadline = time.monotonic() + 20
        while (state := prefill.agent.check_xfer_state(handle)) == "PROC":
            assert time.monotonic() < deadline, "NIXL transfer did not finish"
            time.sleep(0.001)
        assert state == "DONE", state
    if after_arrival is not None:
        after_arrival()
    prefill.conclude_transfer(bootstrap_room=room, status=KVPoll.Success)
    assert decode.server_socket.poll(5000), "no status message reached the decode"
    frames = decode.server_socket.recv_multipart()
    return room, frames, decode.parse_kv_status_message(frames)


def sides(monkeypatch, pools, action="log", decode_sanitized=True, prefill_sanitized=True):
    prefill_san, decode_san = Sanitizer(action=action), Sanitizer(action=action)
    prefill_san.watch_pool(pools["prefill"])
    decode_san.watch_pool(pools["decode"])
    if prefill_sanitized:
        hook_after(monkeypatch, prefill_san, *PREFILL_HOOKS)
    if decode_sanitized:
        hook_after(monkeypatch, decode_san, *DECODE_HOOKS)
    fill_random(pools["prefill"], seed=21)
    fill_random(pools["decode"], seed=22)
    prefill = manager(DisaggregationMode.PREFILL, pools["prefill"])
    decode = manager(DisaggregationMode.DECODE, pools["decode"])
    return prefill_san, decode_san, prefill, decode


def test_clean_transfer_passes_the_digest_check(monkeypatch, pools):
    prefill_san, decode_san, prefill, decode = sides(monkeypatch, pools)
    room, frames, parsed = transfer(prefill, decode, [1, 2, 3, 4], [5, 7, 8, 9])
    assert PD_DIGEST_TAG in frames  # the digests travelled with the status
    assert parsed == (room, KVPoll.Success, 0, None)
    assert decode_san.violations == []
    assert decode_san.counts["pd_checksum"] == 0
    assert room not in prefill_san.sent_digests  # dropped once sent


def test_byte_changed_after_arrival_is_pd_checksum_naming_room_layer_page(
    monkeypatch, pools, caplog
):
    _, decode_san, prefill, decode = sides(monkeypatch, pools)
    index_rows = pools["decode"].index_pools[4].index_k_with_scale_buffer[3]

    def corrupt():
        index_rows[8, 777] ^= 0x04  # one bit of decode page 8, fourth c4 layer

    with caplog.at_level(logging.ERROR, logger="sglang_dsv4.sanitizer"):
        room, _, parsed = transfer(prefill, decode, [1, 2, 3, 4], [5, 7, 8, 9], corrupt)
    (v,) = decode_san.violations
    layer = c4_layers(pools["decode"])[3]
    assert (v.kind, v.request, v.layer, v.page) == ("pd_checksum", f"room {room}", layer, 8)
    assert decode_san.counts["pd_checksum"] == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "sglang_dsv4.sanitizer"]
    assert lines == [v.line()]
    assert parsed == (room, KVPoll.Success, 0, None)  # ACTION=log: counted, served


def test_abort_fails_the_room_through_upstreams_status_path(monkeypatch, pools):
    _, decode_san, prefill, decode = sides(monkeypatch, pools, action="abort")
    kv_rows = pools["decode"].kv_pools[4].kv_buffer[0]

    def corrupt():
        kv_rows[5, 10] ^= 0x80  # decode page 5, c4 KV of the first c4 layer

    room, _, parsed = transfer(prefill, decode, [1, 2, 3, 4], [5, 7, 8, 9], corrupt)
    (v,) = decode_san.violations
    assert (v.kind, v.page, v.layer) == ("pd_checksum", 5, c4_layers(pools["decode"])[0])
    reason = f"DeepSeek-V4 sanitizer: {v.line()}"
    assert parsed == (room, KVPoll.Failed, 0, reason)
    decode.apply_prefill_status(
        bootstrap_room=room, status=parsed[1], prefill_rank=parsed[2], failure_reason=parsed[3]
    )
    assert decode.check_status(room) == KVPoll.Failed
    assert decode.failure_records[room] == reason


def test_an_unsanitized_decode_ignores_the_digests(monkeypatch, pools):
    prefill_san, _, prefill, decode = sides(monkeypatch, pools, decode_sanitized=False)
    room, frames, parsed = transfer(prefill, decode, [1, 2], [3, 4])
    assert PD_DIGEST_TAG in frames
    assert parsed == (room, KVPoll.Success, 0, None)  # upstream's own parser, unhooked
    assert prefill_san.violations == []


def test_a_sanitized_decode_of_an_unsanitized_prefill_checks_nothing(monkeypatch, pools):
    _, decode_san, prefill, decode = sides(monkeypatch, pools, prefill_sanitized=False)
    room, frames, parsed = transfer(prefill, decode, [1, 2], [3, 4])
    assert PD_DIGEST_TAG not in frames
    assert parsed == (room, KVPoll.Success, 0, None)
    assert decode_san.violations == []


@pytest.mark.parametrize("late", [False, True], ids=["nothing-writes", "late-transfer"])
def test_a_write_into_the_freed_pages_of_a_failed_room_is_late_write(monkeypatch, pools, late):
    """The slots a decode gave up, written by a prefill that did not hear of it: the room fails
    on the decode (its prefill declared dead, say), its pages are freed (poisoned), and the
    prefill's transfer lands anyway. The write is real (send_kvcache over UCX into the decode's
    registered pages); a prefill transferring after the failure is the fault played here (the
    nixl-bootstrap-cascade fix is what keeps a real one from doing it). The decode's next
    allocation finds the bytes and names the room; with nothing written it reports nothing."""
    fill_random(pools["prefill"], seed=23)
    prefill = manager(DisaggregationMode.PREFILL, pools["prefill"])
    decode = manager(DisaggregationMode.DECODE, pools["decode"])
    srv = make_server(pools["decode"], monkeypatch)  # poisons every decode page
    san = srv.san
    san.watch_pool(pools["decode"])
    hook_after(monkeypatch, san, *DECODE_HOOKS, f"{sanitizer.hooks._COMMON_MANAGER}.update_status")

    slots = srv.alloc.alloc(2 * PAGE)
    san.on_alloc(srv.alloc, slots)
    pages = sorted(set((slots // PAGE).tolist()))
    peer = KVArgsRegisterInfo.from_zmq(decode.build_receiver_registration_message()[1:])
    prefill._add_remote_peer(peer)
    room = new_room()
    for mgr in (prefill, decode):
        mgr.update_status(room, KVPoll.Bootstrapping)
        mgr.update_status(room, KVPoll.WaitingForInput)
    message = decode.build_receiver_metadata_message(
        bootstrap_room=room, required_dst_info_num=1, kv_indices=np.asarray(pages, np.int32),
        aux_index=0, state_indices=None, decode_prefix_len=0, is_dummy=False,
    )
    info = TransferInfo.from_zmq(message[1:])
    decode.record_failure(room, "Lost connection with prefill instance")
    decode.update_status(room, KVPoll.Failed)
    srv.alloc.free(slots)  # the quarantine is over: the slots go back to the free list
    assert set(san.late_watch) == set(pages)

    if late:
        handle = prefill.send_kvcache(
            info.agent_name, np.asarray([1, 2], np.int32), peer.dst_kv_ptrs,
            info.dst_kv_indices, peer.gpu_id, dst_mem_kind=peer.dst_homogeneous_mem_kind,
        )
        deadline = time.monotonic() + 20
        while (state := prefill.agent.check_xfer_state(handle)) == "PROC":
            assert time.monotonic() < deadline, "NIXL transfer did not finish"
            time.sleep(0.001)
        assert state == "DONE", state

    again = srv.alloc.alloc(PAGE)
    san.on_alloc(srv.alloc, again)
    if not late:
        assert san.violations == []
        assert set(san.late_watch) == set(pages) - set((again // PAGE).tolist())
        return
    assert [(v.kind, v.request, v.page) for v in san.violations] == [
        ("late_write", f"room {room}", page) for page in pages
    ]
    assert san.counts["late_write"] == len(pages) and not san.late_watch
