"""Prefill and decode agree on the index-K row before any KV moves (host-mirror-geometry, PD part).

Real upstream code: DeepSeek-V4 pools (device="cpu") of both index-K dtypes from upstream's sizing
chain and their get_contiguous_buf_infos; NIXL agents (UCX, host memory) registering those
buffers through NixlKVManager.register_buffer_to_engine; the decode's registration and room
messages from its own builders (build_receiver_registration_message /
build_receiver_metadata_message) parsed by KVArgsRegisterInfo / TransferInfo.from_zmq;
the prefill's _add_remote_peer (upstream's _prepare_payload_xfer prepares the NIXL lists),
add_transfer_request, send_kvcache and conclude_failure, and a real ZMQ socket on loopback for the
decode's status endpoint, read with the decode's own parse_kv_status_message.

Stand-ins, and why: NixlKVManager.__init__ needs a GPU (NIXL backend creation sets the CUDA
device), a bootstrap server and the scheduler's runtime context; the managers here are made with
object.__new__ and given the attributes __init__ sets for a prefill or decode rank with these KV
buffers in host memory. The decode manager stands in for the remote peer. The prefill's transfer
worker thread is not run: the test calls send_kvcache, what that worker calls for this pool, with
the chunk it would dequeue.
"""

from __future__ import annotations

import logging
import socket
import time
from types import SimpleNamespace

import numpy as np
import pytest
import requests
import torch
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer
from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeRequest
from sglang.srt.disaggregation.nixl.conn import (
    KVArgsRegisterInfo,
    NixlKVManager,
    TransferInfo,
)
from sglang.srt.disaggregation.utils import DisaggregationMode, get_pd_kv_layout
from support.dsv4 import small_pool
from support.nixl import (
    HOST,
    close_pool_managers,  # noqa: F401 (autouse: closes the managers' zmq contexts)
    kv_args_of,
    pool_manager,
)

PAGE = 256
INDEX_PAGE_SLOTS = PAGE // 4  # c4 index slots per page


@pytest.fixture(scope="module")
def pools():
    # Two bf16 pools (prefill, decode) and an fp8 decode pool.
    return {
        "bf16 prefill": small_pool("bf16")[1],
        "bf16 decode": small_pool("bf16")[1],
        "fp8 decode": small_pool("fp8")[1],
    }


def index_k_entries(pool) -> list[int]:
    """Positions of the c4 index-K page rows in the pool's PD registration."""
    ptrs, _, _ = pool.get_contiguous_buf_infos()
    rows = pool.c4_indexer_kv_pool.contiguous_page_row_buffers()
    return [ptrs.index(r.data_ptr()) for r in rows]


def manager(mode: DisaggregationMode, pool) -> NixlKVManager:
    return pool_manager(mode, pool, PAGE)


def register(prefill: NixlKVManager, decode: NixlKVManager) -> KVArgsRegisterInfo:
    """The decode's registration message, as the prefill's bootstrap thread handles it."""
    message = decode.build_receiver_registration_message()
    info = KVArgsRegisterInfo.from_zmq(message[1:])  # the thread strips the guard frame
    prefill._add_remote_peer(info)
    return info


def open_room(prefill: NixlKVManager, decode: NixlKVManager, room: int, pages) -> TransferInfo:
    message = decode.build_receiver_metadata_message(
        bootstrap_room=room,
        required_dst_info_num=1,
        kv_indices=np.asarray(pages, dtype=np.int32),
        aux_index=0,
        state_indices=None,
        decode_prefix_len=0,
        is_dummy=False,
    )
    info = TransferInfo.from_zmq(message[1:])
    prefill.transfer_infos[room] = {info.agent_name: info}
    prefill.request_status[room] = KVPoll.WaitingForInput
    return info


def fill_random(pool, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for rows in pool.c4_indexer_kv_pool.contiguous_page_row_buffers():
        rows.copy_(torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=generator))


def wait_done(mgr: NixlKVManager, handle) -> None:
    deadline = time.monotonic() + 20
    while (state := mgr.agent.check_xfer_state(handle)) == "PROC":
        assert time.monotonic() < deadline, "NIXL transfer did not finish"
        time.sleep(0.001)
    assert state == "DONE", state


@pytest.mark.parametrize("dtype, row_bytes", [("bf16", 256 * 64), ("fp8", 132 * 64)])
def test_registration_reports_index_k_rows_of_the_stored_dtype(pools, dtype, row_bytes):
    pool = pools[f"{dtype} decode"]
    ptrs, data_lens, item_lens = pool.get_contiguous_buf_infos()
    entries = index_k_entries(pool)
    assert len(entries) == 21  # DeepSeek-V4-Flash's c4 layers
    rows = pool.c4_indexer_kv_pool.contiguous_page_row_buffers()
    for position, buf in zip(entries, rows, strict=True):
        assert item_lens[position] == row_bytes  # 64 index slots per 256-token page
        assert data_lens[position] == buf.shape[0] * row_bytes
    assert all(entries[0] <= p <= entries[-1] for p in entries)


def test_bf16_index_k_pages_move_byte_exact_between_nixl_agents(pools):
    prefill = manager(DisaggregationMode.PREFILL, pools["bf16 prefill"])
    decode = manager(DisaggregationMode.DECODE, pools["bf16 decode"])
    fill_random(pools["bf16 prefill"], seed=11)
    fill_random(pools["bf16 decode"], seed=12)
    src_rows = pools["bf16 prefill"].c4_indexer_kv_pool.contiguous_page_row_buffers()
    dst_rows = pools["bf16 decode"].c4_indexer_kv_pool.contiguous_page_row_buffers()
    dst_before = [rows.clone() for rows in dst_rows]

    peer = register(prefill, decode)
    assert peer.agent_name in prefill.prep_handles  # upstream prepared the NIXL lists
    src_pages, dst_pages = [1, 2, 3], [4, 6, 7]
    info = open_room(prefill, decode, room=7001, pages=dst_pages)
    prefill.add_transfer_request(7001, np.asarray(src_pages, np.int32), slice(0, 3), False)
    chunk = prefill.transfer_queues[0].get_nowait()
    assert prefill.request_status[7001] == KVPoll.WaitingForInput

    handle = prefill.send_kvcache(
        info.agent_name,
        chunk.prefill_kv_indices,
        peer.dst_kv_ptrs,
        info.dst_kv_indices[chunk.index_slice],
        peer.gpu_id,
        dst_mem_kind=peer.dst_homogeneous_mem_kind,
    )
    wait_done(prefill, handle)

    for src, dst, before in zip(src_rows, dst_rows, dst_before, strict=True):
        assert torch.equal(dst[dst_pages], src[src_pages])
        untouched = [p for p in range(dst.shape[0]) if p not in dst_pages]
        assert torch.equal(dst[untouched], before[untouched])
    keys = pools["bf16 decode"].c4_indexer_kv_pool.get_index_k_bf16(0, torch.arange(4 * 64, 5 * 64))
    assert torch.equal(keys.view(torch.uint8).flatten(), src_rows[0][1])


@pytest.mark.parametrize(
    "prefill_pool, decode_pool, ours, theirs",
    [
        # Upstream's lists would raise inside the bootstrap thread (stride 8448 < 16384).
        (
            "bf16 prefill",
            "fp8 decode",
            "bf16 index keys (16384 B per 64-slot page)",
            "fp8 (8448 B)",
        ),
        # Upstream would accept this one and write 8448-B rows into 16384-B pages.
        ("fp8 decode", "bf16 decode", "fp8 index keys (8448 B per 64-slot page)", "bf16 (16384 B)"),
    ],
)
def test_mismatched_index_k_pairing_is_refused_and_its_rooms_fail_on_both_sides(
    pools, caplog, prefill_pool, decode_pool, ours, theirs
):
    prefill = manager(DisaggregationMode.PREFILL, pools[prefill_pool])
    decode = manager(DisaggregationMode.DECODE, pools[decode_pool])
    caplog.set_level(logging.ERROR, logger="sglang.srt.disaggregation.nixl.conn")

    peer = register(prefill, decode)
    (prefill_line,) = [
        r.getMessage()
        for r in caplog.records
        if r.name == "sglang.srt.disaggregation.nixl.conn" and r.levelno == logging.ERROR
    ]
    assert f"prefill stores {ours}" in prefill_line
    assert f"decode {peer.agent_name} stores {theirs}" in prefill_line
    assert peer.agent_name not in prefill.prep_handles  # no NIXL list to this peer

    open_room(prefill, decode, room=7002, pages=[4, 5])
    prefill.add_transfer_request(7002, np.asarray([1, 2], np.int32), slice(0, 2), False)
    assert prefill.transfer_queues[0].empty()  # nothing queued for a transfer worker
    assert prefill.request_status[7002] == KVPoll.Failed
    assert prefill.failure_records[7002] == prefill_line

    # What the decode's listener receives on its status endpoint; its scheduler logs the reason.
    assert decode.server_socket.poll(5000), "no status message reached the decode"
    room, status, _, reason = decode.parse_kv_status_message(decode.server_socket.recv_multipart())
    assert (room, status, reason) == (7002, KVPoll.Failed, prefill_line)


# --- The decode refuses a prefill of another index-K dtype before any KV exists -----------------


def layout_manager(mode: DisaggregationMode, pool, bootstrap_port: int) -> NixlKVManager:
    """What the disaggregation layer of a scheduler gives its manager for the layout check:
    kv_layout from upstream's get_pd_kv_layout, as prefill.py / decode.py set it."""
    mgr = object.__new__(NixlKVManager)
    mgr.disaggregation_mode = mode
    mgr.kv_args = kv_args_of(pool, PAGE)
    mgr.kv_args.kv_layout = get_pd_kv_layout(pool)
    mgr.kv_args.kv_cache_dtype_str = "fp8_e4m3"
    mgr.kv_args.state_types = []
    mgr.kv_cache_dtype_str = mgr.kv_args.kv_cache_dtype_str
    mgr.kv_layout = mgr.kv_args.kv_layout
    mgr.dsv41_spec_layout = None
    mgr.is_mla_backend, mgr.is_hybrid_mla_backend = False, True
    # One rank of a one-rank deployment; no control socket: these tests send no KV messages.
    mgr.attn_tp_size, mgr.attn_tp_rank, mgr.attn_cp_size, mgr.attn_cp_rank = 1, 0, 1, 0
    mgr.pp_size, mgr.pp_rank, mgr.dcp_size, mgr.dcp_rank = 1, 0, 1, 0
    mgr.local_ip, mgr.rank_port = HOST, 1  # what the prefill publishes; nothing dials it here
    mgr.attn_dp_size, mgr.attn_dp_rank = 1, 0
    mgr.system_dp_size, mgr.system_dp_rank = 1, 0
    mgr.dist_init_addr, mgr.bootstrap_host, mgr.bootstrap_port = None, HOST, bootstrap_port
    mgr.prefill_info_table = {}
    return mgr


@pytest.fixture
def bootstrap_server():
    """Upstream's bootstrap server on loopback, stopped after the test."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    server = CommonKVBootstrapServer(HOST, port)
    deadline = time.monotonic() + 30  # a busy machine can take a while to start its thread
    while True:
        try:
            requests.get(f"http://{HOST}:{port}/health", timeout=1).raise_for_status()
            break
        except requests.RequestException:
            assert time.monotonic() < deadline, "bootstrap server did not start"
            time.sleep(0.05)
    yield port
    server.close()


def test_pd_layout_names_the_index_k_dtype_and_row_bytes(pools):
    assert get_pd_kv_layout(pools["bf16 prefill"]).endswith(",c4_index_k=bf16/16384B")
    assert get_pd_kv_layout(pools["fp8 decode"]).endswith(",c4_index_k=fp8/8448B")


@pytest.mark.parametrize(
    "prefill_pool, decode_pool",
    [("bf16 prefill", "fp8 decode"), ("fp8 decode", "bf16 decode")],
)
def test_decode_refuses_a_prefill_of_another_index_k_dtype_before_allocating(
    pools, bootstrap_server, prefill_pool, decode_pool
):
    """The prefill registers its layout with the bootstrap server; the decode's first request for
    that prefill fetches it (upstream's try_ensure_parallel_info, the first step of
    DecodePreallocQueue.pop_preallocated) and refuses the pair, before that step creates a
    receiver (no registration reaches the prefill, so it runs no forward pass for this decode)
    and before the queue allocates KV for any request."""
    prefill = layout_manager(DisaggregationMode.PREFILL, pools[prefill_pool], bootstrap_server)
    decode = layout_manager(DisaggregationMode.DECODE, pools[decode_pool], bootstrap_server)
    prefill.register_to_bootstrap()

    # Stand-in: the request a client sent, with only the fields the queue reads before the
    # receiver exists (a real Req needs a tokenizer and sampling set-up).
    req = SimpleNamespace(bootstrap_host=HOST, bootstrap_port=bootstrap_server, bootstrap_room=9)
    waiting = DecodeRequest(req=req, kv_receiver=None)
    queue = object.__new__(DecodePreallocQueue)
    queue.kv_manager, queue.pp_size, queue.pending_reqs = decode, 1, [waiting]
    queue._prefill_dp_rank_queries, queue._ensure_retry_count = {}, {}
    queue._ensure_last_attempt_time, queue._ensure_retry_interval = {}, 1.0
    queue._max_ensure_retries = 15

    with pytest.raises(RuntimeError) as refused:
        queue.pop_preallocated()
    line = str(refused.value)
    assert "\n" not in line
    ours = pools[prefill_pool].c4_indexer_kv_pool.index_k_dtype
    theirs = pools[decode_pool].c4_indexer_kv_pool.index_k_dtype
    rows = {"bf16": 16384, "fp8": 8448}
    assert f"prefill server has kv_layout=v4,c4:v4,c128:v4,c4_index_k={ours}/{rows[ours]}B" in line
    assert f"decode server has kv_layout=v4,c4:v4,c128:v4,c4_index_k={theirs}/" in line
    assert waiting.kv_receiver is None  # no receiver: nothing registered with the prefill
    assert decode.prefill_info_table == {}  # the pair is not remembered as usable


def test_decode_accepts_a_prefill_of_the_same_index_k_dtype(pools, bootstrap_server):
    prefill = layout_manager(DisaggregationMode.PREFILL, pools["bf16 prefill"], bootstrap_server)
    decode = layout_manager(DisaggregationMode.DECODE, pools["bf16 decode"], bootstrap_server)
    prefill.register_to_bootstrap()
    address = f"{HOST}:{bootstrap_server}"
    assert decode.try_ensure_parallel_info(address)
    assert decode.prefill_info_table[address].kv_layout == decode.kv_layout
