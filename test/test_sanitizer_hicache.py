"""The sanitizer's HiCache check: a digest per page as it is backed up to the host mirror, checked
when the page is loaded back (`hicache_checksum`).

Real upstream code: the DeepSeek-V4 bf16 pool (device="cpu") from upstream's sizing chain, and
upstream's DeepSeekV4PagedHostPool built for the c4 KV region and the c4 index-K region exactly
as build_deepseek_v4_hicache_stack builds them (with pinned memory off), their
backup_from_device_all_layer / load_to_device_per_layer / free / clear wrapped with the
sanitizer's own hooks as upstream's HookRegistry AFTER wrapper does, for one test at a time.

Stand-ins, and why: the host pool's page copy is sgl_kernel's transfer_kv_direct, which this
machine cannot load; `row_copy` does what it does for page_size 1 (per layer, row dst[i] <- row
src[i]). Upstream's host-memory budget reads the machine's free memory (a shared machine's
changes from run to run); it is fixed at 1 GiB for mirrors of a few MB. The request aborted in the attribution test is a stand-in Req (only the abort call it
receives is checked), as in test_sanitizer.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
from sglang.srt.mem_cache import memory_pool_host
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
    _dsv4_compressed_region_buffers,
    _dsv4_indexer_regions,
    _dsv4_page_aligned_only,
)
from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool, LogicalHostPool
from sglang_dsv4 import sanitizer
from sglang_dsv4.hooks import resolve
from sglang_dsv4.sanitizer import c4_layers
from support.dsv4 import small_pool
from support.sanitizer import PAGE, kinds, make_server

NUM_HOST_PAGES = 6
HOST_HOOKS = tuple(
    f"{sanitizer.hooks._HOST_POOL}.{name}"
    for name in ("backup_from_device_all_layer", "load_to_device_per_layer", "free", "clear")
) + (f"{sanitizer.hooks._HOST_ANCHOR}.free",)


@pytest.fixture(scope="module")
def pool():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small host ops: threads only contend on a shared machine
    yield small_pool("bf16")[1]
    torch.set_num_threads(threads)


def row_copy(src_layers, dst_layers, src_indices, dst_indices, page_size):
    assert page_size == 1
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices] = src[src_indices]


@pytest.fixture
def server(pool, monkeypatch):
    """The sanitizer with its host-mirror hooks on upstream's DeepSeekV4PagedHostPool."""
    monkeypatch.setattr(memory_pool_host, "transfer_kv_direct", row_copy, raising=False)
    # The mirrors here take a few MB; upstream's budget reads this shared machine's free memory.
    monkeypatch.setattr(memory_pool_host, "host_memory_budget_bytes", lambda: 1 << 30)
    srv = make_server(pool, monkeypatch)
    srv.san.watch_pool(pool)  # DeepSeekV4TokenToKVPool.__init__'s hook does this in a server
    hooks = {target: hook for target, hook, _ in sanitizer.bind(srv.san)}
    for target in HOST_HOOKS:
        owner, name, original = resolve(target)

        def wrapper(*args, _original=original, _hook=hooks[target], **kwargs):
            result = _original(*args, **kwargs)
            _hook(result, *args, **kwargs)
            return result

        monkeypatch.setattr(owner, name, functools.wraps(original)(wrapper))
    return srv


def mirrors(pool) -> list[DeepSeekV4PagedHostPool]:
    """The c4 KV and c4 index-K host mirrors, with build_deepseek_v4_hicache_stack's arguments."""
    buffers, item_bytes = _dsv4_compressed_region_buffers(pool, 4)
    regions = [
        (
            str(PoolName.DEEPSEEK_V4_C4),
            buffers,
            item_bytes,
            PAGE,
            _dsv4_page_aligned_only(pool.c4_kv_pool),
        )
    ]
    for region in _dsv4_indexer_regions(pool, PAGE):
        regions.append(
            (
                str(region.name),
                region.device_buffers,
                region.item_bytes,
                region.slot_page_size,
                region.page_aligned_only,
            )
        )
    return [
        DeepSeekV4PagedHostPool(
            pool_name=name,
            device_buffers=device_buffers,
            item_bytes=item,
            num_host_pages=NUM_HOST_PAGES,
            slot_page_size=slot_page_size,
            layout="layer_first",
            device="cpu",
            pin_memory=False,
            page_aligned_only=aligned,
        )
        for name, device_buffers, item, slot_page_size, aligned in regions
    ]


def fill(mirror, pages, seed):
    generator = torch.Generator().manual_seed(seed)
    for rows in mirror.device_buffers:
        for page in pages:
            rows[page].copy_(
                torch.randint(0, 256, rows[page].shape, dtype=torch.uint8, generator=generator)
            )


def tokens(pages) -> torch.Tensor:
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def backup(mirror, device_pages) -> torch.Tensor:
    host = mirror.alloc(len(device_pages) * PAGE)
    # (The direct copy does not read its device_pool argument.)
    mirror.backup_from_device_all_layer(None, host, tokens(device_pages), "direct")
    return host


def load(mirror, host, device_pages) -> None:
    # HiCache's load loop: every layer, in order.
    for layer in range(mirror.layer_num):
        mirror.load_to_device_per_layer(None, host, tokens(device_pages), layer, "direct")


def test_clean_backup_and_load_round_trip_is_clean(server, pool):
    for mirror in mirrors(pool):
        fill(mirror, [2, 3, 5], seed=1)
        before = [rows[[2, 3, 5]].clone() for rows in mirror.device_buffers]
        host = backup(mirror, [2, 3, 5])
        load(mirror, host, [7, 8, 9])  # loaded back into other device pages
        for rows, sent in zip(mirror.device_buffers, before, strict=True):
            assert torch.equal(rows[[7, 8, 9]], sent)  # the copy itself is right
    layers = len(c4_layers(pool))
    assert kinds(server.san) == {}
    # two mirrors (c4 KV, c4 index-K), three pages each, every c4 layer checked
    assert server.san.checked["hicache_pages_digested"] == 2 * 3
    assert server.san.checked["hicache_pages_checked"] == 2 * 3 * layers


def test_load_of_the_wrong_host_page_is_hicache_checksum(server, pool, monkeypatch):
    kv, index = mirrors(pool)
    fill(kv, [2, 3], seed=2)
    host = backup(kv, [2, 3])

    def wrong_rows(src_layers, dst_layers, src_indices, dst_indices, page_size):
        # A load copy that reads each host page from the other's row (a row / offset fault).
        row_copy(src_layers, dst_layers, src_indices.flip(0), dst_indices, page_size)

    monkeypatch.setattr(memory_pool_host, "transfer_kv_direct", wrong_rows)
    load(kv, host, [7, 8])
    layers = c4_layers(pool)
    found = server.san.violations
    assert kinds(server.san) == {"hicache_checksum": 2 * len(layers)}
    assert {(v.kind, v.layer, v.page) for v in found} == {
        ("hicache_checksum", layer, page) for layer in layers for page in (7, 8)
    }
    first = found[0]
    assert first.line().startswith(
        f"sanitizer violation kind=hicache_checksum request=None layer={layers[0]} page=7 "
    )
    # device page 7 was to receive host page host[0] (device page 2's copy)
    assert first.expected.startswith("c4 kv (") and f"host page {int(host[0]) // PAGE}:" in (
        first.expected
    )
    assert first.found.startswith("device page 7 after the load: digest ")


def test_a_byte_changed_in_the_host_mirror_is_named_by_layer_and_page(server, pool):
    kv, index = mirrors(pool)
    fill(index, [4, 6], seed=3)
    host = backup(index, [4, 6])
    host_page = int(host[PAGE]) // PAGE  # device page 6's host copy
    index.kv_buffer[1][host_page, 1000] ^= 0x01  # one bit of index-K layer 1 in the mirror
    load(index, host, [10, 11])
    (v,) = server.san.violations
    assert (v.kind, v.layer, v.page) == ("hicache_checksum", c4_layers(pool)[1], 11)
    assert "c4 index-K" in v.expected and f"host page {host_page}:" in v.expected


def test_a_host_page_freed_and_refilled_is_not_compared_with_its_old_digest(server, pool):
    kv, _ = mirrors(pool)
    fill(kv, [2], seed=4)
    host = backup(kv, [2])
    kv.free(host)  # evicted from the mirror
    # A storage prefetch fills the page with bytes this process never backed up.
    kv.set_from_flat_data_page(
        int(host[0]), torch.zeros(kv.layer_num * kv.item_bytes, dtype=torch.uint8)
    )
    load(kv, host, [9])
    assert kinds(server.san) == {}
    assert server.san.checked["hicache_pages_checked"] == 0
    # The table is fixed at the mirror's size: one digest per (layer, host page).
    table = server.san.mirrors[kv]
    assert tuple(table.digests.shape) == (kv.layer_num, NUM_HOST_PAGES)


def test_a_page_freed_through_the_logical_anchor_drops_its_digest(server, pool):
    """The c4 mirrors take their host indices from the group's LogicalHostPool and are freed
    through it, never themselves."""
    anchor = LogicalHostPool(NUM_HOST_PAGES * PAGE, PAGE)
    kv, index = mirrors(pool)
    fill(kv, [2, 3], seed=7)
    host = anchor.alloc(2 * PAGE)
    for mirror in (kv, index):
        mirror.backup_from_device_all_layer(None, host, tokens([2, 3]), "direct")
    anchor.free(host[PAGE:])  # the second page evicted from the host tier
    for mirror in (kv, index):
        mirror.kv_buffer[0][int(host[PAGE]) // PAGE].zero_()  # reused by a storage prefetch
        load(mirror, host, [7, 8])
    assert kinds(server.san) == {}
    assert server.san.checked["hicache_pages_checked"] == 2 * len(c4_layers(pool))  # page 1 only


def test_a_cleared_mirror_drops_every_digest(server, pool):
    kv, _ = mirrors(pool)
    fill(kv, [2], seed=5)
    host = backup(kv, [2])
    kv.clear()  # upstream's HostPoolGroup.clear clears each mirror
    kv.kv_buffer[0][int(host[0]) // PAGE].zero_()
    load(kv, host, [9])
    assert kinds(server.san) == {}
    assert server.san.checked["hicache_pages_checked"] == 0


def test_abort_fails_the_request_that_is_given_the_wrongly_loaded_page(server, pool):
    class Req:  # stand-in for upstream's Req: only the abort call it receives is checked
        rid, to_finish = "req-3", None

        def set_finish_with_abort(self, error_msg, status_code, err_type):
            self.to_finish = (error_msg, status_code, err_type)

    server.san.action = "abort"
    kv, _ = mirrors(pool)
    first = server.start(2 * PAGE)
    pages = (server.rows.req_to_token[first, ::PAGE][:2] // PAGE).tolist()
    fill(kv, pages, seed=6)
    host = backup(kv, pages)
    server.finish(first)  # the request ends; its prefix lives on in the mirror
    # A later request matches that prefix on the host: device pages for it, loaded, then its row.
    slots = server.alloc.alloc(2 * PAGE)
    server.san.on_alloc(server.alloc, slots)
    target = sorted(set((slots // PAGE).tolist()))
    kv.kv_buffer[0][int(host[0]) // PAGE, 123] ^= 0x10  # a bit flipped in the mirror
    load(kv, host, target)
    assert server.san.counts["hicache_checksum"] == 1
    req = Req()
    (row,) = server.rows.alloc_rows(1)
    server.san.on_rows([req], [row])
    server.rows.write((row, slice(0, 2 * PAGE)), slots.to(torch.int32))
    server.san.on_row_write((row, slice(0, 2 * PAGE)), slots, PAGE)
    message, status, _ = req.to_finish
    assert status == 500 and message.startswith("DeepSeek-V4 sanitizer: hicache_checksum")
    # Freed, the page is no longer marked: a request given it later is not failed for it.
    server.alloc.free(slots)
    assert server.san.tainted == {}


def test_off_installs_none_of_the_host_mirror_hooks():
    from sglang.srt.plugins.hook_registry import HookRegistry

    assert set(HOST_HOOKS) <= {hook.target for hook in sanitizer.HOOKS}
    # This session loaded the plugin with the sanitizer off.
    assert sanitizer.SANITIZER is None and sanitizer.INSTALLED == []
    assert sanitizer.describe()["summary"] == "off (0 hooks)"
    assert not set(HOST_HOOKS) & set(HookRegistry._hooks)
