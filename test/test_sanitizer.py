"""The sanitizer's checks: each fault injected on real upstream objects, each caught by kind.

Real upstream objects on the CPU: DeepSeekV4TokenToKVPool built by upstream's configurator chain
(test/support/dsv4.py), upstream's PagedTokenToKVPoolAllocator (the allocator a DeepSeek-V4
scheduler uses) and ReqToTokenPool (test/support/sanitizer.py). The Sanitizer's checks are called
where its hooks call them (the plugin in this test session runs with the sanitizer off);
test_sanitizer_hooks.py drives the hooks themselves.
"""

import logging

import pytest
import torch
from sgl_kernel_dsv4.index_logits import bf16_paged_mqa_logits
from sglang_dsv4 import sanitizer
from sglang_dsv4.sanitizer import Sanitizer, c4_layers, page_checksums
from support.dsv4 import small_pool
from support.sanitizer import DIM, HEADS, PAGE, Server, kinds, make_server


@pytest.fixture(scope="module")
def pool():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small host ops: threads only contend on a shared machine
    yield small_pool("bf16")[1]
    torch.set_num_threads(threads)


@pytest.fixture
def server(pool, monkeypatch):
    return make_server(pool, monkeypatch)


def test_clean_alloc_free_write_read_cycles_report_zero(server):
    gen = torch.Generator().manual_seed(3)
    live = []
    for step in range(40):
        if len(live) < 3 and (not live or torch.rand(1, generator=gen).item() < 0.6):
            live.append(server.start(int(torch.randint(300, 1200, (1,), generator=gen))))
        assert server.read(live) == 0, server.san.violations[-1].line()
        if len(live) == 3 or (live and step % 4 == 3):
            server.finish(live.pop(int(torch.randint(len(live), (1,), generator=gen))))
    assert kinds(server.san) == {}


def test_free_then_read_is_use_after_free_and_reads_poison(server):
    row = server.start(600)
    table = server.page_table([row])
    slots = server.c4_slots(row, range(4))
    server.finish(row)
    # Poison is NaN in the bf16 view the kernel reads (and 0xFF in fp8 / scale bytes alike).
    assert server.pool.get_index_k_bf16(server.layer, slots).isnan().all()
    server.lens[row] = 600  # the stale batch still believes the request is running
    assert server.read([row], page_table=table, picks=[range(0, 150, 3)]) == 2  # one line each
    found = {(v.kind, v.found) for v in server.san.violations}
    assert found == {
        ("use_after_free", "page table names a freed page (and 2 more)"),
        ("use_after_free", "poison (freed page) (and 49 more)"),
    }


def test_double_free_is_caught(server):
    row = server.start(300)
    tokens = server.rows.req_to_token[row, :300].to(torch.int64)
    server.finish(row)
    server.alloc.free(tokens)
    assert kinds(server.san) == {"use_after_free": 2}


def test_double_allocate_is_double_owner(server):
    a = server.start(300)
    live_page = int(server.rows.req_to_token[a, 0]) // PAGE
    # The fault: the allocator's free list gets a page that is still in use.
    server.alloc.free_pages = torch.cat((torch.tensor([live_page]), server.alloc.free_pages))
    b = server.start(200)
    (v,) = server.san.violations
    assert (v.kind, v.page) == ("double_owner", live_page)
    # The receiver is the request named (and aborted); the earlier holder is named as such.
    assert v.request == f"row {b}" and f"held by row {a}" in v.found


def test_row_pointing_at_another_requests_page_is_foreign(server):
    a, b = server.start(600), server.start(600)
    table = server.page_table([a, b])
    table[0, 1] = table[1, 0]  # a's row names b's first page
    assert server.read([a, b], page_table=table, picks=[range(0, 150, 7), range(150)]) > 0
    v = server.san.violations[0]
    assert (v.kind, v.page, v.request) == ("foreign_page", int(table[1, 0]), f"row {a}")
    assert set(kinds(server.san)) == {"foreign_page"}


def test_unwritten_slot_selected_is_unwritten_read(server):
    row = server.start(1000, written=150)  # 250 c4 positions; keys 150.. never written
    assert server.read([row], picks=[range(0, 150)]) == 0
    assert server.read([row], picks=[[10, 200]]) == 1
    (v,) = server.san.violations
    assert (v.kind, v.layer) == ("unwritten_read", server.layer)
    assert v.slot == int(server.c4_slots(row, [200])[0]) and v.found == "poison (never written)"


def test_pd_warmup_request_reads_unwritten_keys_by_design_and_is_not_reported(server):
    """Upstream's PD warm-up decodes a request whose KV no prefill sends (FAKE_BOOTSTRAP_HOST):
    its unwritten reads are by design. A real request reading the same is still reported, and the
    warm-up's page ownership is still checked."""
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    def req(rid, host):
        return Req(rid, "", [1, 2, 3], SamplingParams(max_new_tokens=1), bootstrap_host=host)

    warmup_req, real_req = req("warmup", FAKE_BOOTSTRAP_HOST), req("real", "10.0.0.2")
    warmup = server.start(600, written=0, req=warmup_req)
    real = server.start(600, written=0, req=real_req)
    assert server.read([warmup], picks=[range(0, 40)]) == 0
    assert server.san.checked["fake_transfer_rows"] == 1
    assert server.read([real], picks=[range(0, 40)]) == 1
    assert server.san.violations[0].request == f"real (row {real})"
    table = server.page_table([warmup, real])
    table[0, 0] = table[1, 0]  # the warm-up's row names the real request's page
    assert server.read([warmup, real], page_table=table, picks=[[], []]) == 1
    assert server.san.violations[-1].kind == "foreign_page"


def test_stale_slot_of_a_reused_page_is_unwritten_read(server):
    """A page freed and handed to the next request: the slot the old owner wrote and the new
    one did not is caught, whatever the new owner's writer would have been."""
    old = server.start(300)
    server.finish(old)
    new = server.start(300, written=10)  # the same pages again; only 10 keys written
    assert server.read([new], picks=[[5, 40]]) == 1
    (v,) = server.san.violations
    assert v.kind == "unwritten_read"
    assert v.found == "poison (never written, last stored in page generation 1)"
    assert "generation 2" in v.expected


def test_corrupted_byte_in_transferred_page_is_pd_checksum(pool):
    prefill, decode = Server(pool), Server(small_pool("bf16")[1])
    row = prefill.start(600)
    src = prefill.rows.req_to_token[row, :600:PAGE].to(torch.int64) // PAGE
    dst = torch.tensor([7, 3, 11])  # decode's own pages for the request (poisoned: never used)
    expected = page_checksums(prefill.pool, src)
    for s_buf, d_buf in zip(
        sanitizer.page_buffers(prefill.pool), sanitizer.page_buffers(decode.pool), strict=True
    ):
        d_buf[dst] = s_buf[src]  # the transfer writes the same page bytes
    assert decode.san.verify_page_checksums(decode.pool, dst, expected, "req-7") == 0
    index_rows = decode.pool.index_pools[4].index_k_with_scale_buffer[2]
    index_rows[3, 1000] ^= 0x10  # one bit of one byte of decode page 3, third c4 layer
    assert decode.san.verify_page_checksums(decode.pool, dst, expected, "req-7") == 1
    (v,) = decode.san.violations
    assert (v.kind, v.page, v.layer, v.request) == ("pd_checksum", 3, c4_layers(pool)[2], "req-7")


def _transferred(pool):
    """A prefill with one request and a decode holding its pages as a transfer leaves them."""
    prefill, decode = Server(pool), Server(small_pool("bf16")[1])
    row = prefill.start(600)
    src = prefill.rows.req_to_token[row, :600:PAGE].to(torch.int64) // PAGE
    dst = torch.tensor([7, 3, 11])
    for s_buf, d_buf in zip(
        sanitizer.page_buffers(prefill.pool), sanitizer.page_buffers(decode.pool), strict=True
    ):
        d_buf[dst] = s_buf[src]
    return decode, dst, page_checksums(prefill.pool, src)


def test_every_full_page_buffer_is_digested_c128_included(pool):
    names = {name for name, _, _ in sanitizer.digest.page_buffer_table(pool)}
    assert names == {"c4 kv", "c4 index-K", "c128 kv"}  # DeepSeek-V4-Flash's paged buffers
    decode, dst, expected = _transferred(pool)
    assert decode.san.verify_page_checksums(decode.pool, dst, expected) == 0
    c128 = decode.pool.kv_pools[128].kv_buffer[4]
    c128[11, 100] ^= 0x01  # one bit of a c128 KV page
    assert decode.san.verify_page_checksums(decode.pool, dst, expected) == 1
    (v,) = decode.san.violations
    assert v.page == 11 and v.expected.startswith("c128 kv digest")
    assert v.layer == sanitizer.digest.layers_of_ratio(pool, 128)[4]


def test_plus_one_minus_two_plus_one_on_three_words_is_caught(pool):
    """A linear digest (weighted sums of the words) cannot see +1 / -2 / +1 on three consecutive
    32-bit words: the plain and the position-weighted sums both stay put."""
    decode, dst, expected = _transferred(pool)
    words = decode.pool.index_pools[4].index_k_with_scale_buffer[0][3].view(torch.int32)
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    # Three words where none of the changes wraps around 32 bits.
    k = next(i for i in range(len(words) - 2) if bool((unsigned[i : i + 3] > 2).all()))
    k = next(
        i
        for i in range(k, len(words) - 2)
        if bool(((unsigned[i : i + 3] > 2) & (unsigned[i : i + 3] < 2**32 - 2)).all())
    )
    words[k] += 1
    words[k + 1] -= 2
    words[k + 2] += 1
    assert decode.san.verify_page_checksums(decode.pool, dst, expected) == 1
    (v,) = decode.san.violations
    assert (v.kind, v.page) == ("pd_checksum", 3)


def test_perturbed_kernel_result_is_shadow_mismatch(server):
    row = server.start(1024)  # 256 c4 positions
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, HEADS, DIM, generator=gen).to(torch.bfloat16)
    weights = torch.rand(1, HEADS, generator=gen)
    keys = server.pool.get_index_k_bf16_buffer(server.layer)
    table = server.page_table([row]).to(torch.int32)
    lens = torch.tensor([256], dtype=torch.int32)
    logits = bf16_paged_mqa_logits(q, keys, weights, lens, table, 256)
    kernel = torch.topk(logits[0], 64).indices
    agree = server.san.shadow_check(
        "bf16", server.layer, row, q, keys, weights, 256, table[0], kernel, topk=64
    )
    assert agree == 1.0 and kinds(server.san) == {}
    perturbed = logits.clone()
    perturbed[0, kernel[:8]] -= 1e4  # a wrong kernel result drops 8 of the true top 64
    wrong = torch.topk(perturbed[0], 64).indices
    agree = server.san.shadow_check(
        "bf16", server.layer, row, q, keys, weights, 256, table[0], wrong, topk=64
    )
    assert agree == pytest.approx(56 / 64)
    assert kinds(server.san) == {"shadow_mismatch": 1}


def test_perturbed_fp8_kernel_result_is_shadow_mismatch():
    """fp8 keys in upstream's page layout, scored by upstream's fp8 torch reference."""
    from sgl_kernel_dsv4.fp8_reference import pack_fp8_index_pages, quantize_index_fp8
    from sglang.srt.layers.attention.dsv4.indexer import fp8_paged_mqa_logits_torch_sm120

    gen = torch.Generator().manual_seed(11)
    keys = pack_fp8_index_pages(*quantize_index_fp8(torch.randn(768, DIM, generator=gen)))
    table = torch.randperm(keys.shape[0], generator=gen).to(torch.int32)
    q = torch.randn(1, 1, HEADS, DIM, generator=gen).to(torch.float8_e4m3fn)
    weights = torch.rand(1, HEADS, generator=gen)
    lens = torch.tensor([700], dtype=torch.int32)
    logits = fp8_paged_mqa_logits_torch_sm120(
        q, keys, weights, lens, table.reshape(1, -1), None, 700, clean_logits=False
    )[0, :700]
    san = Sanitizer()
    kernel = torch.topk(logits, 512).indices
    assert san.shadow_check("fp8", 2, 1, q, keys, weights, 700, table, kernel) == 1.0
    wrong = torch.topk(logits, 700).indices[100:612]  # drops 100 of the true top 512
    agree = san.shadow_check("fp8", 2, 1, q, keys, weights, 700, table, wrong)
    assert agree == pytest.approx(412 / 512)
    assert kinds(san) == {"shadow_mismatch": 1}


def test_over_commit_at_start_up(pool):
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import get_dsv4_indexer_bytes_per_token

    san = Sanitizer()
    san.check_over_commit(pool, pool.index_pools[4].get_bytes_per_token())
    assert kinds(san) == {}
    # Upstream's configurator priced the c4 indexer as fp8 whatever the pool stored.
    san.check_over_commit(pool, get_dsv4_indexer_bytes_per_token(DIM, False))
    (v,) = san.violations
    assert v.kind == "over_commit" and v.found.startswith("256 B stored (bf16)")


def test_violation_is_one_error_line_and_a_counter(caplog):
    from prometheus_client import REGISTRY

    def value():
        labels = {"kind": "foreign_page"}
        return REGISTRY.get_sample_value("sglang:dsv4_sanitizer_violations_total", labels) or 0

    before = value()
    san = Sanitizer()
    with caplog.at_level(logging.ERROR, logger="sglang_dsv4.sanitizer"):
        san.report(
            sanitizer.Violation(
                "foreign_page",
                layer=2,
                page=9,
                slot=600,
                expected="a page of row 1",
                found="page of rows [2]",
            ),
            row=1,
        )
    assert [r.getMessage() for r in caplog.records] == [
        "sanitizer violation kind=foreign_page request=row 1 layer=2 page=9 slot=600 "
        "expected=a page of row 1 found=page of rows [2]"
    ]
    assert value() == before + 1


def test_abort_fails_the_request_through_upstream(server):
    class Req:  # stand-in for upstream's Req: only the abort call it receives is checked
        rid, to_finish = "req-1", None

        def set_finish_with_abort(self, error_msg, status_code, err_type):
            self.to_finish = (error_msg, status_code, err_type)

    server.san.action = "abort"
    req = Req()
    a, b = server.start(300, req=req), server.start(300)
    table = server.page_table([a, b])
    table[0, 0] = table[1, 0]  # a's row names b's page
    server.read([a, b], page_table=table, picks=[[], []])
    (v,) = server.san.violations
    assert v.request == f"req-1 (row {a})"
    message, status, _ = req.to_finish
    assert status == 500 and message.startswith("DeepSeek-V4 sanitizer: foreign_page")


def test_swa_and_state_items_of_a_transfer_are_digested(pool):
    """The state components upstream's setup_state_kv_args registers for this pool (SWA with the
    compress states, then request-scoped state): each item sent is digested and a changed byte in
    the decode's copy is named by component, buffer and item."""
    prefill, decode = pool, small_pool("bf16")[1]
    layout = sanitizer.digest.state_layout(prefill)
    assert len(layout) == 2 and all(rows is not None for rows in layout[0])
    src_items, dst_items = [[2, 0], [1]], [[1, 2], [4]]
    gen = torch.Generator().manual_seed(2)
    for c, (src, dst) in enumerate(zip(src_items, dst_items, strict=True)):
        for s_rows, d_rows in zip(layout[c], sanitizer.digest.state_layout(decode)[c], strict=True):
            if s_rows is None:
                continue
            s_rows[src] = torch.randint(0, 256, s_rows[src].shape, generator=gen).to(torch.uint8)
            d_rows[dst] = s_rows[src]  # the transfer copies the items
    sent = sanitizer.digest.state_checksums(prefill, src_items)
    frames = sanitizer.digest.encode_state_frames(sent)
    received = sanitizer.digest.decode_state_frames(frames)
    san = Sanitizer()
    assert san.verify_state_checksums(decode, dst_items, received, "room 9") == 0
    sanitizer.digest.state_layout(decode)[0][0][2, 17] ^= 0x04  # SWA buffer 0, decode item 2
    assert san.verify_state_checksums(decode, dst_items, received, "room 9") == 1
    (v,) = san.violations
    assert (v.kind, v.slot, v.request) == ("pd_checksum", 2, "room 9")
    assert v.expected.startswith("state component 0 buffer 0 digest")


def test_a_page_rewritten_out_of_a_row_is_not_held_when_upstream_frees_it(server):
    """A checkpoint (UnifiedRadixCache.checkpoint) rebinds part of a live request's row to the
    tree's copy of pages the request computed again, then the batch's free group releases the
    request's own copies after the checkpoint returned: an unattributed free of pages the row
    was once written. The row's table no longer names them: no early_free (the 64-session run
    reported 11 of these). A page the table still names, freed, is early_free as before."""
    server.san.watch_req_pool(server.rows)
    row = server.start(2 * PAGE)
    own_copy = server.rows.req_to_token[row, :PAGE].to(torch.int64).clone()
    tree_copy = server.alloc.alloc(PAGE)
    server.san.on_alloc(server.alloc, tree_copy)
    server.rows.write((row, slice(0, PAGE)), tree_copy.to(torch.int32))
    server.san.on_row_write((row, slice(0, PAGE)), tree_copy, PAGE)
    server.alloc.free(own_copy)
    assert kinds(server.san) == {}
    server.alloc.free(server.rows.req_to_token[row, PAGE : 2 * PAGE].to(torch.int64))
    assert kinds(server.san) == {"early_free": 1}
