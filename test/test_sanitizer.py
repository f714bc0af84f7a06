"""The KV / index-K sanitizer (SGLANG_DSV4_SANITIZE=1): each fault injected, each caught by kind.

Real upstream objects on the CPU: DeepSeekV4TokenToKVPool built by upstream's configurator chain
(test/support/dsv4.py), upstream's PagedTokenToKVPoolAllocator (the allocator a DeepSeek-V4
scheduler uses) and ReqToTokenPool. In this process the Sanitizer's checks are called where its
hooks call them (the plugin in this test session runs with the sanitizer off); one child process
turns it on and drives the hooked upstream methods themselves.
"""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sgl_kernel_dsv4.index_logits import bf16_paged_mqa_logits
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang_dsv4 import sanitizer, settings
from sglang_dsv4.sanitizer import Sanitizer, c4_layers, page_checksums
from support.dsv4 import small_pool

ROOT = Path(__file__).resolve().parents[1]
PAGE = 256  # full tokens per page
C4_PER_PAGE = PAGE // 4  # c4 slots per page
HEADS, DIM = 64, 128


@pytest.fixture(scope="module")
def pool():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small host ops: threads only contend on a shared machine
    yield small_pool("bf16")[1]
    torch.set_num_threads(threads)


class Server:
    """One scheduler's memory objects and the sanitizer fed as its hooks feed it."""

    def __init__(self, pool, sample=1.0, action="log"):
        self.pool = pool
        self.alloc = PagedTokenToKVPoolAllocator(
            pool.full_size,
            page_size=PAGE,
            dtype=torch.float8_e4m3fn,
            device="cpu",
            kvcache=pool,
            need_sort=False,
        )
        self.rows = ReqToTokenPool(
            size=4, max_context_len=4096, device="cpu", enable_memory_saver=False
        )
        self.san = Sanitizer(sample=sample, action=action, seed=0)
        self.san.track(self.alloc)
        self.layer = c4_layers(pool)[0]
        self.lens: dict[int, int] = {}

    def start(self, tokens: int, written: int | None = None, req=None) -> int:
        """A request of `tokens` tokens: a row, pages, its row written, and keys for its first
        `written` c4 positions (all by default)."""
        (row,) = self.rows.alloc_rows(1)
        self.san.on_rows([req], [row])
        zero = torch.tensor([0])
        slots = self.alloc.alloc_extend(
            zero, zero, torch.tensor([tokens]), torch.tensor([tokens]), torch.tensor([-1]), tokens
        )
        self.san.on_alloc(self.alloc, slots, torch.tensor([-1]))
        self.rows.write((row, slice(0, tokens)), slots.to(torch.int32))
        self.san.on_row_write((row, slice(0, tokens)), slots, PAGE)
        self.lens[row] = tokens
        self.write_keys(row, range(tokens // 4 if written is None else written))
        return row

    def c4_slots(self, row: int, positions) -> torch.Tensor:
        pages = self.rows.req_to_token[row, ::PAGE].to(torch.int64) // PAGE
        positions = torch.as_tensor(list(positions), dtype=torch.int64)
        return pages[positions // C4_PER_PAGE] * C4_PER_PAGE + positions % C4_PER_PAGE

    def write_keys(self, row: int, positions, seed: int = 0) -> None:
        slots = self.c4_slots(row, positions)
        gen = torch.Generator().manual_seed(seed + row)
        keys = torch.randn(len(slots), DIM, generator=gen).to(torch.bfloat16)
        self.pool.set_index_k_bf16(self.layer, slots.to(torch.int32), keys)
        self.san.on_index_k_write(self.pool, self.layer, slots)

    def finish(self, row: int) -> None:
        tokens = self.lens.pop(row)
        self.alloc.free(self.rows.req_to_token[row, :tokens].to(torch.int64))
        self.rows.free_rows([row])
        self.san.on_rows_freed([row])

    def page_table(self, rows) -> torch.Tensor:
        width = max(-(-self.lens.get(r, PAGE) // PAGE) for r in rows)
        return torch.stack([self.rows.req_to_token[r, ::PAGE][:width] // PAGE for r in rows])

    def read(self, rows, picks=None, page_table=None) -> int:
        """One decode step's indexer read of `rows`; picks: c4 positions top-k selected per row."""
        table = self.page_table(rows) if page_table is None else page_table
        lens = torch.tensor([self.lens.get(r, PAGE) // 4 for r in rows])
        if picks is None:
            picks = [range(0, int(n), 3) for n in lens]
        width = max(len(p) for p in picks)
        selected = torch.full((len(rows), width), -1, dtype=torch.int64)
        for i, p in enumerate(picks):
            pages = table[i].to(torch.int64)
            pos = torch.as_tensor(list(p), dtype=torch.int64)
            selected[i, : len(pos)] = pages[pos // C4_PER_PAGE] * C4_PER_PAGE + pos % C4_PER_PAGE
        return self.san.check_read(self.pool, self.layer, torch.tensor(rows), table, lens, selected)


def kinds(san: Sanitizer) -> dict:
    return {k: n for k, n in san.counts.items() if n}


# Hooks are wired in the plugin process through the same (self, result) calls as in Server.
# The allocator's own free path is hooked at _release_page_ids; mirror it here.
@pytest.fixture
def server(pool, monkeypatch):
    srv = Server(pool)
    release = PagedTokenToKVPoolAllocator._release_page_ids

    def released(alloc_self, *page_ids):
        for ids in page_ids:
            srv.san.on_release(alloc_self, ids)
        return release(alloc_self, *page_ids)

    monkeypatch.setattr(srv.alloc, "_release_page_ids", released.__get__(srv.alloc))
    return srv


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
    server.start(200)
    (v,) = server.san.violations
    assert (v.kind, v.page) == ("double_owner", live_page)
    assert v.request == f"row {a}" and "held by rows" in v.found


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
    from sgl_kernel_dsv4.index_reference import pack_fp8_index_pages, quantize_index_fp8
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


def test_sampled_decode_step_hook_checks_the_read_and_shadows_one_request(server):
    """The indexer hook's adapter on one decode step. Stand-ins only for the attention backend and
    forward batch (built on a GPU); their fields are the ones upstream's metadata holds."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    row = server.start(4096)  # 1024 c4 positions: the kernel keeps 512
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, HEADS, DIM, generator=gen).to(torch.bfloat16)  # compute_q_bf16's output
    weights = torch.rand(1, HEADS, generator=gen)
    keys = server.pool.get_index_k_bf16_buffer(server.layer)
    table = server.page_table([row]).to(torch.int32)
    lens = torch.tensor([1024], dtype=torch.int32)
    logits = bf16_paged_mqa_logits(q.unsqueeze(1), keys, weights, lens, table, 1024)

    def step(positions):
        slots = table[0].to(torch.int64)[positions // C4_PER_PAGE] * C4_PER_PAGE
        selected = (slots + positions % C4_PER_PAGE).reshape(1, -1)
        metadata = SimpleNamespace(
            indexer_metadata=SimpleNamespace(
                page_table=table, compressed_seq_lens=lens, compressed_page_size=C4_PER_PAGE
            ),
            core_metadata=SimpleNamespace(c4_sparse_page_indices=selected),
        )
        backend = SimpleNamespace(
            token_to_kv_pool=server.pool, page_size=PAGE, forward_metadata=metadata
        )
        batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE,
            req_pool_indices=torch.tensor([row]),
            seq_lens=torch.tensor([4096]),
            req_to_token_pool=server.rows,
        )
        server.san._sampled_batch = id(batch)
        server.san._query[server.layer] = (q, weights)
        indexer = SimpleNamespace(layer_id=server.layer)
        sanitizer._check_indexer_read(server.san, backend, indexer, batch)

    step(torch.topk(logits[0], 512).indices)
    assert kinds(server.san) == {}
    step(torch.topk(logits[0], 1024).indices[256:768])  # a kernel that kept the wrong half
    assert kinds(server.san) == {"shadow_mismatch": 1}
    assert server.san.violations[0].found.startswith("0.500")


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


@pytest.mark.parametrize(
    "env,line",
    [
        ({"SGLANG_DSV4_SANITIZE": "2"}, "SGLANG_DSV4_SANITIZE='2' is not supported; allowed: 0, 1"),
        (
            {"SGLANG_DSV4_SANITIZE_SAMPLE": "1.5"},
            "SGLANG_DSV4_SANITIZE_SAMPLE='1.5' is not supported; allowed: a number from 0 to 1",
        ),
        (
            {"SGLANG_DSV4_SANITIZE_ACTION": "crash"},
            "SGLANG_DSV4_SANITIZE_ACTION='crash' is not supported; allowed: log, abort",
        ),
    ],
)
def test_bad_settings_are_one_line(env, line):
    with pytest.raises(settings.SettingsError) as err:
        settings.from_environ(env)
    assert str(err.value) == line


def test_off_installs_nothing():
    from sglang.srt.plugins.hook_registry import HookRegistry

    conf = settings.from_environ({})
    assert (conf.sanitize, conf.sanitize_sample, conf.sanitize_action) == (False, 0.01, "log")
    # This session loaded the plugin with the variable unset.
    assert sanitizer.SANITIZER is None and sanitizer.INSTALLED == []
    assert not any("PagedTokenToKVPoolAllocator" in t for t in HookRegistry._hooks)
    assert sanitizer.describe()["summary"] == "off (0 hooks)"


def test_a_hook_that_does_not_take_stops_the_process_with_one_line(monkeypatch):
    from sglang_dsv4.plugin import Refusal

    target = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_gone"
    monkeypatch.setattr(sanitizer, "_hooks", lambda san: [(target, lambda *a: None, "AFTER")])
    conf = settings.from_environ({"SGLANG_DSV4_SANITIZE": "1"})
    with pytest.raises(Refusal) as err:
        sanitizer.install_from_settings(conf)
    assert (
        err.value.code
        == f"sglang-dsv4: refusing to run: sanitizer hook {target}: not found upstream"
    )
    assert sanitizer.SANITIZER is None and sanitizer.INSTALLED == []


CHILD = r"""
import json, sys, torch
sys.path.insert(0, "test")
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from support.dsv4 import small_pool
from sglang_dsv4 import sanitizer, status
san = sanitizer.SANITIZER
pool = small_pool("bf16")[1]  # built through the hooked __init__s: over-commit checked
alloc = PagedTokenToKVPoolAllocator(pool.full_size, page_size=256, dtype=torch.float8_e4m3fn,
                                    device="cpu", kvcache=pool, need_sort=False)
rows = ReqToTokenPool(size=4, max_context_len=4096, device="cpu", enable_memory_saver=False)
out = {"status": status.collect()["sanitizer"]}
from prometheus_client import REGISTRY
out["counters_at_start"] = {k: REGISTRY.get_sample_value(
    "sglang:dsv4_sanitizer_violations_total", {"kind": k}) for k in sanitizer.KINDS}
for _ in range(20):  # clean cycles through the hooked methods
    (row,) = rows.alloc_rows(1)
    slots = alloc.alloc(512)
    rows.write((row, slice(0, 512)), slots.to(torch.int32))
    alloc.free(slots)
    rows.free_rows([row])
held = alloc.alloc(512)
alloc.clear()  # a flush takes every page back: handing them out again is no violation
alloc.alloc(512)
alloc.clear()
out["clean"] = {k: n for k, n in san.counts.items() if n}
slots = alloc.alloc(256)
alloc.free(slots)
alloc.free(slots)  # double free
(row,) = rows.alloc_rows(1)
rows.write((row, slice(0, 256)), slots.to(torch.int32))  # a row given a freed page
from sglang.srt.disaggregation.decode import DecodeReqToTokenPool
decode_rows = DecodeReqToTokenPool(4, 4096, "cpu", False, pre_alloc_size=0)
decode_rows.write((1, slice(0, 256)), slots.to(torch.int32))  # the same on a PD decode
live = alloc.alloc(256)
alloc.free_pages = torch.cat((live[:1] // 256, alloc.free_pages))
alloc.alloc(256)  # the live page handed out again
out["faults"] = {k: n for k, n in san.counts.items() if n}
out["poisoned"] = bool((pool.index_pools[4].index_k_with_scale_buffer[0][int(slots[0]) // 256]
                        == 0xFF).all())
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow  # a fresh process loads upstream and the plugin: about 15 s
def test_hooks_in_a_server_process_catch_faults():
    env = {
        **os.environ,
        "SGLANG_DSV4_SANITIZE": "1",
        "SGLANG_DSV4_SANITIZE_SAMPLE": "0.5",
        "SGLANG_DSV4_SANITIZE_ACTION": "abort",
        "SGLANG_DSV4_INDEX_K_DTYPE": "bf16",
        "PYTHONPATH": f"{ROOT / 'python'}:{ROOT / 'sgl-kernel' / 'python'}",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT ") :])
    assert out["status"]["on"] and out["status"]["hooks"] == 26
    assert out["counters_at_start"] == dict.fromkeys(sanitizer.KINDS, 0.0)
    assert out["status"]["summary"].endswith("sample 0.5, action abort)")
    assert out["clean"] == {}
    assert out["faults"] == {"use_after_free": 3, "double_owner": 1}
    assert out["poisoned"]
    assert "sanitizer violation kind=double_owner" in proc.stderr
