"""KV / index-K sanitizer for DeepSeek-V4 pools (SGLANG_DSV4_SANITIZE=1): a diagnostic, not a fix.

It catches the silent corruption class (a page read by the wrong request, after it was freed, or
before it was written; a wrong kernel result; a page changed in a PD transfer) as it happens, on a
live server. Off by default; when off the plugin installs nothing (status: "off (0 hooks)").

What is checked, where, and what it costs (hooks through upstream's HookRegistry, one process):

  Allocator (PagedTokenToKVPoolAllocator, the DeepSeek-V4 full-page allocator; the c4 KV,
  index-K and c4 state pages share its page ids). Every call, host side, outside any CUDA graph.
  - alloc / alloc_extend / alloc_decode (after): the pages handed out must be free in the
    ledger; a page handed out while live is `double_owner` (two live owners of one page). Each
    handed-out page gets a new generation. Cost: one device->host copy of the new indices.
  - _release_page_ids (before, every free funnels into it): a page freed while already free is
    `use_after_free`; freed pages are poisoned with 0xFF bytes in every pool buffer paged by the
    full page id (c4 index-K rows, c4 KV rows). 0xFF is NaN in bf16, fp8 e4m3, fp32 scales and
    ue8m0 scales alike. Cost: one index_fill per buffer per free (21 + 21 for V4-Flash).
  - clear (after): a flush takes every page back; the ledger follows. SWATokenToKVPoolAllocator
    (after __init__): its full-page allocator is tied to the DeepSeek-V4 pool it serves.
  - ReqToTokenPool.alloc / write / free_rows and a PD decode's DecodeReqToTokenPool.alloc / write
    / free: which rows (requests) hold which pages; a row given a page that is not live is
    `use_after_free`. Prefix sharing is allowed: holding is
    what the row was written, not who allocated.
  Start-up: when the allocator is tied to its DeepSeek-V4 pool, every page but the padding page 0
    is poisoned once, so a slot nothing ever wrote is poison too.
  Index-K writes (set_index_k_bf16, set_index_k_fused, set_index_k_fp4 of the token pool, after):
    each written c4 slot records its page's generation; a violation line quotes it. The verdict
    itself rests on poison, which every writer (these setters, a PD transfer, a HiCache load)
    overwrites: generation marks alone would call every transferred page unwritten.
  Indexer read (C4IndexerBackendMixin.forward_c4_indexer[_bf16], after), on sampled decode steps
  only (SGLANG_DSV4_SANITIZE_SAMPLE, default 0.01); a sampled step runs eagerly (the decode CUDA
  graph runner's can_run_graph says no for it), so nothing runs inside a captured region:
  - each row's page-table pages must be live (`use_after_free`) and held by the row's request
    (`foreign_page`);
  - each top-k selected slot must lie in the row's pages (`foreign_page`) and hold no poison:
    poison in a freed page is `use_after_free`, in a live one `unwritten_read` (not written since
    its page was allocated);
  - shadow check (bf16 pools): one request's indexer logits recomputed with the torch reference
    (sgl_kernel_dsv4.bf16_paged_mqa_logits_torch) from the pool's bytes; the kernel's top-k must
    share at least SHADOW_MIN_AGREEMENT of the reference top-k (`shadow_mismatch`). The fp8
    reference (upstream's fp8_paged_mqa_logits_torch_sm120) is available through shadow_check()
    but not hooked: upstream's fp8 query never leaves forward_c4_indexer.
  Cost of a sampled step: a few host syncs and one reference scoring of one request (see
  benchmark/sanitizer_cost.py for measured ratios).
  Start-up (DeepSeekV4TokenToKVPool.__init__, after): the c4 index-K bytes per token the pool
  stores must not exceed what DSV4PoolConfigurator priced (`over_commit`).
  PD transfer (NIXL): page_checksums() digests the c4 index-K and c4 KV pages per (buffer,
  page), Fletcher-like over 32-bit words.
  - Prefill, TransferKVChunk.__init__ (after; the scheduler thread queues a room's chunk once
    its forward is done; an early-send chunk's wait_event is synchronized first): the chunk's
    pages are digested, keyed by their position in the room's page list.
  - Prefill, CommonKVManager._encode_kv_status_message (after): a room's Success status gets
    four frames after the reason frame: PD_DIGEST_TAG, "buffers,pages", int32 positions, int64
    digests. Upstream's parser reads no frame past the reason, so a decode without the
    sanitizer ignores them; nothing in the transfer or the metadata buffers changes.
  - Decode, NixlKVManager.build_receiver_metadata_message (after): the room's own pages, in the
    order the prefill addresses them (its dst_kv_indices).
  - Decode, CommonKVManager.parse_kv_status_message (after; the listener thread, once the
    prefill's NIXL handles for the room are DONE and before the room can read Success): the
    pages are digested again and compared (verify_page_checksums); each changed page is
    `pd_checksum` naming the room, layer and page. With ACTION=abort the parsed status becomes
    Failed with the violation as its reason, so upstream's apply_prefill_status fails the room
    and the request is aborted with that line before it decodes.
  A prefill without the sanitizer sends no digests: nothing is checked. A prefill whose pool
  has other buffers (a pipeline stage) is not checked (one warning line). Cost: one digest pass
  over the room's pages on each side (benchmark/sanitizer_cost.py: about 10x copying them) and
  42 x 8 B per page on the status message. Upstream's own checksum
  (--disaggregation-enable-kv-checksum, disaggregation/checksum.py) is not used: one adler32
  digest per request in an 8-wide metadata row, CUDA-only, and on this pool it fails its own
  `state_indices_gpu is not None` assertion (kv_args lists 85 compressed-state buffers while
  state_indices_for_request returns None for DeepSeekV4TokenToKVPool).
  Metrics: every kind of sglang:dsv4_sanitizer_violations_total is created at 0 when the
  sanitizer installs, so a reader sees it is on before any violation.

A violation: one ERROR line "sanitizer violation kind=... request=... layer=... page=... slot=...
expected=... found=...", sglang:dsv4_sanitizer_violations_total{kind} += 1, and with
SGLANG_DSV4_SANITIZE_ACTION=abort the request is failed through upstream's
Req.set_finish_with_abort (the scheduler aborts it at its next step with that message).
"""

from __future__ import annotations

import logging
import random
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger("sglang_dsv4.sanitizer")

KINDS = (
    "use_after_free",
    "foreign_page",
    "double_owner",
    "over_commit",
    "unwritten_read",
    "shadow_mismatch",
    "pd_checksum",
)
METRIC_NAME = "sglang:dsv4_sanitizer_violations_total"
POISON_BYTE = 0xFF
# Share of the reference top-k the kernel's top-k must contain. bf16: the kernel and the reference
# score the same bf16 bytes in fp32, so only near-ties may differ. fp8: the reference dequantizes
# the same e4m3 bytes; accumulation order differs more.
SHADOW_MIN_AGREEMENT = {"bf16": 0.98, "fp8": 0.95}
INDEX_HEAD_DIM = 128
_KEEP_VIOLATIONS = 1000  # the most recent ones, for tests and `status`
# Marks the digest frames a sanitized prefill appends to a room's KV_STATUS Success message.
PD_DIGEST_TAG = b"dsv4-sanitizer-page-digests/1"
_KEEP_ROOMS = 1024  # rooms whose digests / pages are kept (a room cleared unconcluded ages out)


@dataclass(frozen=True)
class Violation:
    kind: str
    request: str | None = None
    layer: int | None = None
    page: int | None = None
    slot: int | None = None
    expected: str = ""
    found: str = ""

    def line(self) -> str:
        return (
            f"sanitizer violation kind={self.kind} request={self.request} layer={self.layer} "
            f"page={self.page} slot={self.slot} expected={self.expected} found={self.found}"
        )


_COUNTER = None  # the process's Prometheus counter, created on first use


def _violation_counter():
    """sglang:dsv4_sanitizer_violations_total{kind}, created on first use (in every scheduler
    process, so upstream's multiprocess collector adds them up)."""
    global _COUNTER
    if _COUNTER is None:
        from prometheus_client import Counter

        _COUNTER = Counter(
            METRIC_NAME,
            "DeepSeek-V4 KV / index-K sanitizer violations (SGLANG_DSV4_SANITIZE=1), by kind.",
            labelnames=["kind"],
        )
    return _COUNTER


def _pages(indices, page_size: int) -> list[int]:
    """Distinct page ids of token slots (a tensor or a sequence), negative slots dropped."""
    flat = torch.as_tensor(indices).reshape(-1).to("cpu", torch.int64)
    flat = flat[flat >= 0]
    return torch.unique(flat // page_size).tolist()


class PageLedger:
    """Per allocator: which pages are live, their generation, and the pool buffers to poison."""

    def __init__(self, num_pages: int, page_size: int, kvcache=None):
        self.page_size = page_size
        self.live = torch.zeros(num_pages + 1, dtype=torch.bool)
        self.generation = torch.zeros(num_pages + 1, dtype=torch.int64)
        self.kvcache = kvcache
        # model layer id -> generation of the page when each c4 slot was last written
        self.written: dict[int, torch.Tensor] = {}

    def grow_to(self, page: int) -> None:
        if page >= len(self.live):
            extra = page + 1 - len(self.live)
            self.live = torch.cat((self.live, torch.zeros(extra, dtype=torch.bool)))
            self.generation = torch.cat((self.generation, torch.zeros(extra, dtype=torch.int64)))


def page_buffers(kvcache) -> list[torch.Tensor]:
    """Buffers of a DeepSeekV4TokenToKVPool paged by the full page id: [pages, bytes per page]."""
    if kvcache is None:
        return []
    index_pool = getattr(kvcache, "index_pools", {}).get(4)
    kv_pool = getattr(kvcache, "kv_pools", {}).get(4)
    buffers = list(index_pool.index_k_with_scale_buffer) if index_pool is not None else []
    if kv_pool is not None:
        buffers += list(kv_pool.kv_buffer)
    return [b for b in buffers if b.dim() == 2 and b.dtype == torch.uint8]


def c4_layers(kvcache) -> list[int]:
    return [
        layer_id
        for layer_id, item in enumerate(getattr(kvcache, "layer_mapping", ()))
        if item is not None and item.compress_ratio == 4
    ]


class Sanitizer:
    """The checks. Hooks call these; tests call them on real upstream pools and allocators."""

    def __init__(self, sample: float = 0.01, action: str = "log", seed: int | None = None):
        self.sample = sample
        self.action = action
        self.rng = random.Random(seed)
        self.violations: list[Violation] = []
        self.counts: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.ledgers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # allocator ->
        self.pool_ledgers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # kvcache ->
        self.row_pages: dict[int, set[int]] = {}  # req_to_token row -> pages written to it
        self.row_request: dict[int, object] = {}  # row -> weakref to its Req (or its rid)
        self.priced_index_bytes: int | None = None
        self._sampled_batch: int | None = None  # id() of the forward batch being sampled
        self._query: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (q, weights)
        self.pd_pool = None  # weakref to this process's DeepSeekV4TokenToKVPool
        self.sent_digests: OrderedDict[int, dict[int, torch.Tensor]] = OrderedDict()  # prefill
        self.room_pages: OrderedDict[int, np.ndarray] = OrderedDict()  # decode: room -> pages

    # --- reporting -------------------------------------------------------------------------------

    def report(self, violation: Violation, row: int | None = None) -> None:
        if row is not None and violation.request is None:
            violation = Violation(**{**violation.__dict__, "request": self.request_name(row)})
        self.counts[violation.kind] += 1
        self.violations.append(violation)
        del self.violations[:-_KEEP_VIOLATIONS]
        logger.error(violation.line())
        try:
            _violation_counter().labels(kind=violation.kind).inc()
        except Exception:  # a broken metric never breaks serving
            logger.debug("sanitizer: counter increment failed", exc_info=True)
        if self.action == "abort" and row is not None:
            self.abort(row, violation)

    def request_name(self, row: int) -> str:
        req = self._req(row)
        rid = getattr(req, "rid", None)
        return f"{rid} (row {row})" if rid is not None else f"row {row}"

    def _req(self, row: int):
        ref = self.row_request.get(row)
        return ref() if callable(ref) else None

    def abort(self, row: int, violation: Violation) -> None:
        req = self._req(row)
        if req is None:
            logger.error("sanitizer: cannot abort row %d: no live request is known for it", row)
            return
        if getattr(req, "to_finish", None) is not None:
            return  # already on its way out
        req.set_finish_with_abort(
            f"DeepSeek-V4 sanitizer: {violation.kind} at layer {violation.layer} page "
            f"{violation.page}; the request's KV cannot be trusted",
            status_code=500,
            err_type="InternalServerError",
        )

    # --- allocator -------------------------------------------------------------------------------

    def track(self, allocator, kvcache=None) -> PageLedger:
        """The allocator's ledger; `kvcache` names its DeepSeek-V4 pool when the allocator does
        not (the full-pool allocator inside SWATokenToKVPoolAllocator has no pool of its own)."""
        ledger = self.ledgers.get(allocator)
        if ledger is None:
            ledger = PageLedger(allocator.num_pages, allocator.page_size, None)
            self.ledgers[allocator] = ledger
        kvcache = kvcache if kvcache is not None else getattr(allocator, "_kvcache", None)
        if ledger.kvcache is None and hasattr(kvcache, "index_pools"):
            ledger.kvcache = kvcache
            self.pool_ledgers[kvcache] = ledger
            # Every page starts poisoned (page 0, the padding page dummy rows use, excepted), so
            # a slot read before anything wrote it is seen even on a page never used before.
            self.poison(ledger, list(range(1, allocator.num_pages + 1)))
        return ledger

    def on_clear(self, allocator) -> None:
        """The allocator took every page back at once (flush): all free, nothing held."""
        ledger = self.track(allocator)
        ledger.live.zero_()
        ledger.generation += 1
        for held in self.row_pages.values():
            held.clear()

    def on_alloc(self, allocator, out_indices, continuing=None) -> None:
        """Pages of `out_indices` become live; `continuing` slots name pages already held (the
        last page of each request's prefix, which alloc_extend / alloc_decode keep filling)."""
        if out_indices is None:
            return
        ledger = self.track(allocator)
        keep = set(_pages(continuing, ledger.page_size)) if continuing is not None else set()
        new = [p for p in _pages(out_indices, ledger.page_size) if p not in keep]
        if not new:
            return
        ledger.grow_to(max(new))
        for page in torch.tensor(new)[ledger.live[new]].tolist():
            rows = sorted(r for r, pages in self.row_pages.items() if page in pages)
            self.report(
                Violation(
                    "double_owner",
                    page=page,
                    expected="a free page",
                    found=f"page still live (held by rows {rows})",
                ),
                row=rows[0] if rows else None,
            )
        ledger.live[new] = True
        ledger.generation[new] += 1

    def on_release(self, allocator, page_ids) -> None:
        ledger = self.track(allocator)
        pages = [p for p in torch.as_tensor(page_ids).reshape(-1).tolist() if p > 0]
        if not pages:
            return
        ledger.grow_to(max(pages))
        for page in torch.tensor(pages)[~ledger.live[pages]].tolist():
            self.report(
                Violation(
                    "use_after_free",
                    page=page,
                    expected="a live page",
                    found="page freed again (already free)",
                )
            )
        ledger.live[pages] = False
        for held in self.row_pages.values():
            held.difference_update(pages)
        self.poison(ledger, pages)

    @staticmethod
    def poison(ledger: PageLedger, pages: list[int]) -> None:
        for buffer in page_buffers(ledger.kvcache):
            if buffer.is_cuda:  # one kernel per buffer
                index = torch.tensor(pages, dtype=torch.int64, device=buffer.device)
                buffer.index_fill_(0, index, POISON_BYTE)
            else:  # contiguous page rows: a fill each is the cheapest on the host
                for page in pages:
                    buffer[page].fill_(POISON_BYTE)

    # --- request rows ----------------------------------------------------------------------------

    def on_rows(self, reqs, rows) -> None:
        for req, row in zip(reqs, rows or (), strict=False):
            known = self.row_request.get(row)
            if req is not None and known is not None and known() is req:
                continue  # a chunked prefill keeps its row and what it holds
            self.row_request[row] = weakref.ref(req) if req is not None else None
            self.row_pages[row] = set()

    def on_row_write(self, indices, values, page_size: int) -> None:
        row = indices[0] if isinstance(indices, tuple) else indices
        if torch.is_tensor(row) and row.numel() == torch.as_tensor(values).numel() > 0:
            # a decode step's write: one new slot per row
            for r, value in zip(
                row.reshape(-1).tolist(), torch.as_tensor(values).reshape(-1), strict=True
            ):
                self.on_row_write(int(r), value, page_size)
            return
        if not isinstance(row, int):
            return
        pages = [p for p in _pages(values, page_size) if p > 0]
        held = self.row_pages.setdefault(row, set())
        for page in pages:
            ledger = self._ledger_with(page)
            if ledger is not None and not ledger.live[page]:
                self.report(
                    Violation(
                        "use_after_free",
                        page=page,
                        expected="a live page",
                        found="row given a freed page",
                    ),
                    row=row,
                )
        held.update(pages)

    def on_rows_freed(self, rows) -> None:
        for row in rows:
            self.row_pages.pop(row, None)
            self.row_request.pop(row, None)

    def _ledger_with(self, page: int) -> PageLedger | None:
        """The ledger of the DeepSeek-V4 full pool (the page ids request rows hold)."""
        for ledger in self.ledgers.values():
            if ledger.kvcache is not None and page < len(ledger.live):
                return ledger
        return None

    # --- index-K writes --------------------------------------------------------------------------

    def on_index_k_write(self, pool, layer: int, loc) -> None:
        ledger = self.pool_ledgers.get(pool)
        if ledger is None:
            return
        slots_per_page = pool.get_index_k_page_size(4)
        slots = torch.as_tensor(loc).reshape(-1).to("cpu", torch.int64)
        slots = slots[slots >= 0]
        marks = ledger.written.get(layer)
        need = (len(ledger.live)) * slots_per_page
        if marks is None or len(marks) < need:
            grown = torch.zeros(need, dtype=torch.int64)
            if marks is not None:
                grown[: len(marks)] = marks
            marks = ledger.written[layer] = grown
        pages = slots // slots_per_page
        marks[slots] = ledger.generation[pages.clamp(max=len(ledger.generation) - 1)]

    # --- reads -----------------------------------------------------------------------------------

    def sample_step(self, batch) -> bool:
        """Decide once per forward batch whether it is checked; remembers the decision."""
        if self._sampled_batch == id(batch):
            return True
        if self.rng.random() < self.sample:
            self._sampled_batch = id(batch)
            return True
        return False

    def check_read(
        self, pool, layer: int, rows, page_table, compressed_seq_lens, selected, held=None
    ) -> int:
        """Check one decode batch's c4 indexer read; returns the violations found.

        rows: the request rows (req_pool_indices), page_table: [rows, pages] full page ids,
        compressed_seq_lens: c4 tokens per row, selected: [rows, topk] c4 slots (-1 unused),
        held: the pages each row's request holds (default: what its row was written).
        """
        ledger = self.pool_ledgers.get(pool)
        if ledger is None:
            return 0
        before = len(self.violations)
        slots_per_page = pool.get_index_k_page_size(4)
        rows = torch.as_tensor(rows).reshape(-1).tolist()
        table = torch.as_tensor(page_table).to("cpu", torch.int64)
        lens = torch.as_tensor(compressed_seq_lens).reshape(-1).to("cpu", torch.int64).tolist()
        chosen = torch.as_tensor(selected).to("cpu", torch.int64)
        tokens = self._token_rows(pool, layer)
        marks = ledger.written.get(layer)
        for i, row in enumerate(rows[: len(lens)]):
            # One line per (row, kind, finding): the first place, and how many more there were.
            found: dict[tuple[str, str], list] = {}

            def note(kind, page, expected, what, slot=None, found=found):
                entry = found.setdefault((kind, what), [page, slot, expected, 0])
                entry[3] += 1

            held_here = self.row_pages.get(row, set()) if held is None else held[i]
            n_pages = -(-lens[i] // slots_per_page)
            row_pages = table[i, :n_pages].tolist()
            for page in row_pages:
                if page <= 0 or page >= len(ledger.live):
                    continue
                if not ledger.live[page]:
                    note("use_after_free", page, "a live page", "page table names a freed page")
                elif page not in held_here:
                    owners = sorted(r for r, p in self.row_pages.items() if page in p)
                    note("foreign_page", page, f"a page of row {row}", f"page of rows {owners}")
            allowed = set(row_pages)
            picked = chosen[i][chosen[i] >= 0]
            inside = torch.isin(picked // slots_per_page, torch.tensor(row_pages or [-1]))
            for slot in picked[~inside].tolist():
                note(
                    "foreign_page",
                    slot // slots_per_page,
                    f"a slot in pages {sorted(allowed)[:8]}",
                    "top-k picked a slot outside the row",
                    slot,
                )
            picked = picked[inside]
            if tokens is not None and len(picked):
                # Poison marks bytes nothing wrote since the page was freed (or since start-up),
                # whoever the writer would be (setter, PD transfer, HiCache load).
                poisoned = (tokens[picked.to(tokens.device)] == POISON_BYTE).all(dim=1).cpu()
                for slot in picked[poisoned].tolist():
                    page = slot // slots_per_page
                    if not ledger.live[page]:
                        note(
                            "use_after_free", page, "written key bytes", "poison (freed page)", slot
                        )
                        continue
                    now = int(ledger.generation[page])
                    wrote = int(marks[slot]) if marks is not None and slot < len(marks) else 0
                    history = f", last stored in page generation {wrote}" if wrote else ""
                    note(
                        "unwritten_read",
                        page,
                        f"a key written since the page was allocated (generation {now})",
                        f"poison (never written{history})",
                        slot,
                    )
            for (kind, what), (page, slot, expected, count) in found.items():
                more = f" (and {count - 1} more)" if count > 1 else ""
                self.report(
                    Violation(
                        kind,
                        layer=layer,
                        page=page,
                        slot=slot,
                        expected=expected,
                        found=what + more,
                    ),
                    row=row,
                )
        return len(self.violations) - before

    @staticmethod
    def _token_rows(pool, layer: int) -> torch.Tensor | None:
        """The c4 index-K bytes of `layer` as [slots, bytes per token], or None."""
        ratio, pool_layer, _ = pool.layer_mapping[layer]
        index_pool = pool.index_pools.get(ratio)
        if index_pool is None:
            return None
        rows = index_pool.index_k_with_scale_buffer[pool_layer - index_pool.start_layer]
        per_page = index_pool.page_size
        if index_pool.index_k_dtype == "fp8":
            # fp8 rows keep the page's values first, then its scales: check the values
            return rows[:, : per_page * INDEX_HEAD_DIM].reshape(-1, INDEX_HEAD_DIM)
        return rows.reshape(rows.shape[0] * per_page, -1)

    def shadow_check(
        self,
        index_k_dtype: str,
        layer: int,
        row: int,
        q,
        keys,
        weights,
        seq_len: int,
        page_table_row,
        kernel_topk_positions,
        topk: int = 512,
    ) -> float:
        """Recompute one row's indexer logits with the torch reference, compare top-k sets.

        q: [1, 1, H, D] (bf16, or e4m3 for fp8), keys: the pool's paged view ([pages, 64, 1, 128]
        bf16, or [pages, 64, 1, 132] uint8 for fp8), weights: [1, H], page_table_row: [pages],
        kernel_topk_positions: the kernel's selected positions (token indices < seq_len, -1 unused).
        Returns the agreement (share of the reference top-k the kernel also picked).
        """
        lens = torch.tensor([seq_len], dtype=torch.int32, device=q.device)
        table = torch.as_tensor(page_table_row).reshape(1, -1).to(q.device, torch.int32)
        if index_k_dtype == "bf16":
            from sgl_kernel_dsv4.index_logits import bf16_paged_mqa_logits_torch

            logits = bf16_paged_mqa_logits_torch(q, keys, weights, lens, table, seq_len)
        else:
            from sglang.srt.layers.attention.dsv4.indexer import (
                fp8_paged_mqa_logits_torch_sm120,
            )

            logits = fp8_paged_mqa_logits_torch_sm120(
                q, keys, weights, lens, table, None, seq_len, clean_logits=False
            )
        k = min(topk, seq_len)
        reference = set(torch.topk(logits[0, :seq_len], k).indices.tolist())
        kernel = torch.as_tensor(kernel_topk_positions).reshape(-1).tolist()
        kernel = {p for p in kernel if 0 <= p < seq_len}
        agreement = len(reference & kernel) / max(k, 1)
        threshold = SHADOW_MIN_AGREEMENT[index_k_dtype]
        if agreement < threshold:
            missing = sorted(reference - kernel)[:4]
            self.report(
                Violation(
                    "shadow_mismatch",
                    layer=layer,
                    expected=f"top-{k} agreement >= {threshold:.2f} with the reference",
                    found=f"{agreement:.3f} (reference picks {missing} missed)",
                ),
                row=row,
            )
        return agreement

    # --- start-up --------------------------------------------------------------------------------

    def check_over_commit(self, pool, priced_bytes_per_token: int | None) -> None:
        """The c4 index-K bytes per token stored must not exceed the configurator's price."""
        index_pool = getattr(pool, "index_pools", {}).get(4)
        if index_pool is None or priced_bytes_per_token is None:
            return
        stored = index_pool.get_bytes_per_token()
        if stored > priced_bytes_per_token:
            tokens = index_pool.index_k_with_scale_buffer[0].shape[0] * index_pool.page_size
            over = (stored - priced_bytes_per_token) * tokens * len(c4_layers(pool))
            self.report(
                Violation(
                    "over_commit",
                    expected=f"<= {priced_bytes_per_token} B per c4 token "
                    "(the configurator's price)",
                    found=f"{stored} B stored ({index_pool.index_k_dtype}), "
                    f"{over / 1e9:.3f} GB past the budget",
                ),
            )

    # --- PD transfer -----------------------------------------------------------------------------

    def verify_page_checksums(
        self, pool, pages, expected: torch.Tensor, request: str | None = None
    ) -> int:
        """Compare decode-side digests with the prefill side's; one violation per changed page."""
        actual = page_checksums(pool, pages)
        before = len(self.violations)
        layers = c4_layers(pool)
        names = [f"index-K {layer}" for layer in layers] + [f"c4 kv {layer}" for layer in layers]
        bad = (actual != expected.to(actual.device)).nonzero().tolist()
        pages = torch.as_tensor(pages).reshape(-1).tolist()
        for buffer_i, page_i in bad:
            self.report(
                Violation(
                    "pd_checksum",
                    request=request,
                    layer=layers[buffer_i % len(layers)],
                    page=pages[page_i],
                    expected=f"{names[buffer_i]} digest {int(expected[buffer_i, page_i]):#x}",
                    found=f"{int(actual[buffer_i, page_i]):#x}",
                ),
            )
        return len(self.violations) - before

    def watch_pool(self, pool) -> None:
        self.pd_pool = weakref.ref(pool)

    def _pd_pool(self):
        return self.pd_pool() if self.pd_pool is not None else None

    @staticmethod
    def _remember(table: OrderedDict, key, value) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > _KEEP_ROOMS:
            table.popitem(last=False)

    def on_chunk_queued(self, room: int, pages, index_slice: slice) -> None:
        """Prefill: digest a chunk's pages as it is queued for transfer, keyed by their position
        in the room's page list (the decode's pages at the same positions receive them)."""
        pool = self._pd_pool()
        if pool is None or pages is None or len(pages) == 0:
            return
        start = index_slice.start or 0
        chunks = {} if start == 0 else self.sent_digests.get(room, {})
        chunks[start] = page_checksums(pool, np.asarray(pages, dtype=np.int64))
        self._remember(self.sent_digests, room, chunks)

    def digest_frames(self, room: int) -> list[bytes]:
        """Prefill: the frames appended to the room's Success status (none when nothing was
        digested): tag, "buffers,pages", int32 positions, int64 digests [buffers, pages]. The
        room's digests are dropped once framed."""
        chunks = self.sent_digests.pop(room, None)
        if not chunks:
            return []
        starts = sorted(chunks)
        digests = torch.cat([chunks[s] for s in starts], dim=1)
        positions = np.concatenate(
            [np.arange(s, s + chunks[s].shape[1], dtype=np.int32) for s in starts]
        )
        return [
            PD_DIGEST_TAG,
            f"{digests.shape[0]},{digests.shape[1]}".encode("ascii"),
            positions.tobytes(),
            digests.numpy().astype("<i8").tobytes(),
        ]

    def on_receiver_pages(self, room: int, pages) -> None:
        """Decode: the pages a room's KV lands in, in the order the prefill addresses them."""
        if pages is not None:
            self._remember(self.room_pages, room, np.asarray(pages, dtype=np.int64).copy())

    def check_arrival(self, room: int, frames: list[bytes]) -> str | None:
        """Decode, on the room's Success status: the digest frames (from PD_DIGEST_TAG on) against
        the pages as they are now. Returns the first violation's line, or None when clean."""
        pool = self._pd_pool()
        # Kept (bounded) rather than popped: each prefill rank that sends pages sends digests.
        pages = self.room_pages.get(room)
        if pool is None or pages is None:
            return None  # no DeepSeek-V4 pool here, or a room this decode did not open
        try:
            buffers, count = (int(x) for x in frames[1].decode("ascii").split(","))
            if buffers != len(page_buffers(pool)):
                # A prefill pool of other layers (a pipeline stage): not comparable page for page.
                logger.warning(
                    "sanitizer: room %s not digest-checked: the prefill digested %d page "
                    "buffers, this decode has %d",
                    room,
                    buffers,
                    len(page_buffers(pool)),
                )
                return None
            positions = np.frombuffer(frames[2], dtype=np.int32).astype(np.int64)
            expected = torch.from_numpy(
                np.frombuffer(frames[3], dtype="<i8").reshape(buffers, count).copy()
            )
            dst_pages = pages[positions]
        except (IndexError, ValueError) as exc:
            violation = Violation(
                "pd_checksum",
                request=f"room {room}",
                expected="page digests this decode can check",
                found=f"unreadable digest frames ({exc})",
            )
            self.report(violation)
            return violation.line()
        found = self.verify_page_checksums(pool, dst_pages, expected, request=f"room {room}")
        return self.violations[-found].line() if found else None


def page_checksums(pool, pages) -> torch.Tensor:
    """int64 digests [buffers, pages] of the c4 index-K and c4 KV pages (page_buffers order).

    Fletcher-like over 32-bit words: a position-weighted sum plus a plain sum, so a changed byte
    or two swapped words change it; computed where the pool lives (int64 cannot overflow: words
    < 2^32, weights and counts < 2^14 for a page row of up to 64 KiB).
    """
    buffers = page_buffers(pool)
    index = torch.as_tensor(pages).reshape(-1).to(torch.int64)
    out = torch.empty((len(buffers), len(index)), dtype=torch.int64)
    for i, buffer in enumerate(buffers):
        rows = buffer.index_select(0, index.to(buffer.device))
        words = rows.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        weights = torch.arange(1, words.shape[1] + 1, dtype=torch.int64, device=words.device)
        out[i] = ((words * weights).sum(dim=1) ^ (words.sum(dim=1) << 20)).cpu()
    return out


# --- hooks: installed by the plugin when SGLANG_DSV4_SANITIZE=1 --------------------------------

_ALLOCATOR = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator"
_SWA_ALLOCATOR = "sglang.srt.mem_cache.allocator.swa.SWATokenToKVPoolAllocator"
_REQ_POOL = "sglang.srt.mem_cache.memory_pool.ReqToTokenPool"
# A PD decode server's request table: its own class, not a ReqToTokenPool.
_DECODE_REQ_POOL = "sglang.srt.disaggregation.decode.DecodeReqToTokenPool"
_TOKEN_POOL = "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool"
_INDEXER_BACKEND = "sglang.srt.layers.attention.dsv4.indexer.C4IndexerBackendMixin"
_C4_INDEXER = "sglang.srt.layers.attention.dsv4.indexer.C4Indexer"
_BACKEND = "sglang.srt.layers.attention.deepseek_v4_backend.DeepseekV4AttnBackend"
_DECODE_GRAPH_RUNNER = (
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
)
_CONFIGURATOR = "sglang.srt.model_executor.pool_configurator.DSV4PoolConfigurator"
_CHUNK = "sglang.srt.disaggregation.common.utils.TransferKVChunk"
_NIXL_MANAGER = "sglang.srt.disaggregation.nixl.conn.NixlKVManager"
# The status messages' builder and parser, which NixlKVManager inherits.
_COMMON_MANAGER = "sglang.srt.disaggregation.common.conn.CommonKVManager"

SANITIZER: Sanitizer | None = None  # this process's sanitizer, when installed
INSTALLED: list[str] = []  # the targets hooked in this process


def _bound(func):
    """A binder giving a call's arguments by parameter name, whatever way they were passed."""
    import inspect

    signature = inspect.signature(func)

    def bind(args, kwargs) -> dict:
        bound = signature.bind_partial(*args, **kwargs)
        return bound.arguments

    return bind


def _guarded(check):
    """Run a check; an error in the sanitizer itself is logged, never raised into serving."""

    def run(*args, **kwargs):
        try:
            check(*args, **kwargs)
        except Exception:
            logger.exception("sanitizer: a check failed internally (serving continues)")

    return run


def _hooks(san: Sanitizer) -> list[tuple[str, object, str]]:
    """(target, hook, hook type name) for every check; the bindings resolve upstream's names."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_dsv4.plugin import resolve

    def original(target):
        return resolve(target)[2]

    alloc_extend = _bound(original(f"{_ALLOCATOR}.alloc_extend"))
    alloc_decode = _bound(original(f"{_ALLOCATOR}.alloc_decode"))

    def after_alloc(result, self, *args, **kwargs):
        _guarded(san.on_alloc)(self, result)

    def after_alloc_extend(result, self, *args, **kwargs):
        a = alloc_extend((self, *args), kwargs)
        _guarded(san.on_alloc)(self, result, a.get("last_loc"))

    def after_alloc_decode(result, self, *args, **kwargs):
        a = alloc_decode((self, *args), kwargs)
        _guarded(san.on_alloc)(self, result, a.get("last_loc"))

    def before_release(self, *page_ids):
        for ids in page_ids:
            _guarded(san.on_release)(self, ids)

    def after_req_alloc(result, self, reqs):
        _guarded(san.on_rows)(reqs, result)

    def after_clear(result, self):
        _guarded(san.on_clear)(self)

    def after_swa_allocator(result, self, *args, **kwargs):
        full = getattr(self, "full_attn_allocator", None)
        if hasattr(full, "num_pages"):  # paged: DeepSeek-V4's full pages live here
            _guarded(san.track)(full, self._kvcache)

    def after_req_write(result, self, indices, values):
        ledger = next(iter(san.ledgers.values()), None)
        if ledger is not None:
            _guarded(san.on_row_write)(indices, values, ledger.page_size)

    def after_req_free_rows(result, self, indices):
        _guarded(san.on_rows_freed)(indices)

    def before_decode_req_free(self, req):
        _guarded(san.on_rows_freed)([req.kv.req_pool_idx])

    def after_index_k_write(result, self, layer_id, loc, *args, **kwargs):
        _guarded(san.on_index_k_write)(self, layer_id, loc)

    def after_q_bf16(result, self, *args, **kwargs):
        if san._sampled_batch is not None:
            san._query[self.layer_id] = result  # (q [T, H, D] bf16, weights [T, H])
        return result

    read = _bound(original(f"{_INDEXER_BACKEND}.forward_c4_indexer"))

    def after_indexer(result, self, *args, **kwargs):
        a = read((self, *args), kwargs)
        _guarded(_check_indexer_read)(san, self, a["c4_indexer"], a["forward_batch"])

    def after_metadata(result, self, forward_batch):
        # One sampling decision per forward; only decode batches are read-checked.
        mode = forward_batch.forward_mode
        if san._sampled_batch != id(forward_batch):
            san._sampled_batch = None
            san._query.clear()
            if mode.is_decode() and san.rng.random() < san.sample:
                san._sampled_batch = id(forward_batch)

    def around_can_run_graph(run, self, forward_batch):
        # A sampled step runs eagerly, so the checks never run inside a captured region.
        if not run(self, forward_batch):
            return False
        if san.rng.random() < san.sample:
            san._sampled_batch = id(forward_batch)
            return False
        return True

    def after_configurator(result, self, *args, **kwargs):
        san.priced_index_bytes = getattr(self, "indexer_bytes_per_token", None)

    def after_token_pool(result, self, *args, **kwargs):
        san.watch_pool(self)
        _guarded(san.check_over_commit)(self, san.priced_index_bytes)

    def digest_chunk(chunk):
        if chunk.wait_event is not None:  # early send: the KV is final once this event is
            chunk.wait_event.synchronize()
        san.on_chunk_queued(chunk.room, chunk.prefill_kv_indices, chunk.index_slice)

    def after_chunk(result, self, *args, **kwargs):
        _guarded(digest_chunk)(self)

    def after_encode_status(result, self, *, bootstrap_room, status, failure_reason):
        # After the reason frame, which upstream's parser reads as the last one it knows: a
        # decode without the sanitizer ignores the extra frames.
        frames = []
        _guarded(lambda: frames.extend(san.digest_frames(bootstrap_room)))()
        if int(status) != int(KVPoll.Success) or not self.kv_status_msg_carries_reason:
            return None
        return result + frames if frames else None

    def after_metadata_message(result, self, **kwargs):
        if not kwargs.get("is_dummy"):
            san.on_receiver_pages(kwargs["bootstrap_room"], kwargs["kv_indices"])

    def after_parse_status(result, self, msg):
        if result is None or int(result[1]) != int(KVPoll.Success) or PD_DIGEST_TAG not in msg:
            return None
        room, _, prefill_rank, _ = result
        line = None

        def check():
            nonlocal line
            line = san.check_arrival(room, msg[msg.index(PD_DIGEST_TAG) :])

        _guarded(check)()
        if line is not None and san.action == "abort":
            # The room fails through upstream's status path, with the violation as its reason.
            return room, KVPoll.Failed, prefill_rank, f"DeepSeek-V4 sanitizer: {line}"
        return None

    hooks = [
        (f"{_ALLOCATOR}.alloc", after_alloc, "AFTER"),
        (f"{_ALLOCATOR}.alloc_extend", after_alloc_extend, "AFTER"),
        (f"{_ALLOCATOR}.alloc_decode", after_alloc_decode, "AFTER"),
        (f"{_ALLOCATOR}._release_page_ids", before_release, "BEFORE"),
        (f"{_ALLOCATOR}.clear", after_clear, "AFTER"),
        (f"{_SWA_ALLOCATOR}.__init__", after_swa_allocator, "AFTER"),
        (f"{_REQ_POOL}.alloc", after_req_alloc, "AFTER"),
        (f"{_REQ_POOL}.write", after_req_write, "AFTER"),
        (f"{_REQ_POOL}.free_rows", after_req_free_rows, "AFTER"),
        (f"{_DECODE_REQ_POOL}.alloc", after_req_alloc, "AFTER"),
        (f"{_DECODE_REQ_POOL}.write", after_req_write, "AFTER"),
        (f"{_DECODE_REQ_POOL}.free", before_decode_req_free, "BEFORE"),
        (f"{_TOKEN_POOL}.set_index_k_fused", after_index_k_write, "AFTER"),
        (f"{_TOKEN_POOL}.set_index_k_fp4", after_index_k_write, "AFTER"),
        (f"{_INDEXER_BACKEND}.forward_c4_indexer", after_indexer, "AFTER"),
        (f"{_BACKEND}.init_forward_metadata", after_metadata, "AFTER"),
        (f"{_DECODE_GRAPH_RUNNER}.can_run_graph", around_can_run_graph, "AROUND"),
        (f"{_CONFIGURATOR}.__init__", after_configurator, "AFTER"),
        (f"{_TOKEN_POOL}.__init__", after_token_pool, "AFTER"),
        (f"{_CHUNK}.__init__", after_chunk, "AFTER"),
        (f"{_COMMON_MANAGER}._encode_kv_status_message", after_encode_status, "AFTER"),
        (f"{_NIXL_MANAGER}.build_receiver_metadata_message", after_metadata_message, "AFTER"),
        (f"{_COMMON_MANAGER}.parse_kv_status_message", after_parse_status, "AFTER"),
    ]
    # Present when the index-k-bf16 fix is applied (it adds them).
    if original(f"{_TOKEN_POOL}.set_index_k_bf16") is not None:
        hooks.append((f"{_TOKEN_POOL}.set_index_k_bf16", after_index_k_write, "AFTER"))
    if original(f"{_INDEXER_BACKEND}.forward_c4_indexer_bf16") is not None:
        hooks.append((f"{_INDEXER_BACKEND}.forward_c4_indexer_bf16", after_indexer, "AFTER"))
    if original(f"{_C4_INDEXER}.compute_q_bf16") is not None:
        hooks.append((f"{_C4_INDEXER}.compute_q_bf16", after_q_bf16, "AFTER"))
    return hooks


def _check_indexer_read(san: Sanitizer, backend, c4_indexer, forward_batch) -> None:
    """The sampled decode step's read check for one c4 layer (see the module docstring)."""
    if san._sampled_batch != id(forward_batch) or not forward_batch.forward_mode.is_decode():
        return
    pool = backend.token_to_kv_pool
    layer = c4_indexer.layer_id
    paged = backend.forward_metadata.indexer_metadata
    core = backend.forward_metadata.core_metadata
    rows = forward_batch.req_pool_indices
    n = len(rows)
    selected = core.c4_sparse_page_indices[:n]
    # What each request holds is what its req_to_token row names (the extend path fills rows in
    # a Triton kernel, past ReqToTokenPool.write); the batch's page table must agree with it.
    page_size = backend.page_size
    row_tokens = forward_batch.req_to_token_pool.req_to_token
    held = [
        set((row_tokens[int(r), : int(length)].to(torch.int64) // page_size).tolist())
        for r, length in zip(rows.tolist(), forward_batch.seq_lens.tolist(), strict=False)
    ]
    san.check_read(
        pool, layer, rows, paged.page_table[:n], paged.compressed_seq_lens[:n], selected, held
    )
    query = san._query.pop(layer, None)
    if query is None or pool.index_k_dtype_of(layer) != "bf16" or n == 0:
        return
    # Shadow one request: the kernel's selection as positions, against the reference's.
    i = san.rng.randrange(n)
    seq_len = int(paged.compressed_seq_lens[i])
    if seq_len <= 0:
        return
    per_page = paged.compressed_page_size
    table = paged.page_table[i].to(torch.int64)
    slots = selected[i][selected[i] >= 0].to(torch.int64)
    where = {int(p): k for k, p in enumerate(table.tolist()) if p > 0}
    positions = [where.get(int(s) // per_page, -1) * per_page + int(s) % per_page for s in slots]
    q, weights = query
    san.shadow_check(
        "bf16",
        layer,
        int(rows[i]),
        q[i : i + 1].unsqueeze(1),
        pool.get_index_k_bf16_buffer(layer),
        weights[i : i + 1],
        seq_len,
        table,
        positions,
    )


def install(sample: float, action: str) -> list[str]:
    """Register every sanitizer hook with upstream's HookRegistry and apply them.

    Returns the targets in force; raises RuntimeError naming the first hook that did not take.
    """
    global SANITIZER
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_dsv4.plugin import resolve

    if SANITIZER is not None:
        return list(INSTALLED)
    san = Sanitizer(sample=sample, action=action)
    hooks = _hooks(san)
    before = {}
    for target, hook, kind in hooks:
        try:
            before[target] = resolve(target)[2]
        except (ImportError, AttributeError, ValueError) as exc:
            raise RuntimeError(
                f"sanitizer hook {target}: cannot import its owner ({exc})"
            ) from None
        if before[target] is None:
            raise RuntimeError(f"sanitizer hook {target}: not found upstream")
        if target in HookRegistry._patched:
            raise RuntimeError(f"sanitizer hook {target}: already patched by another hook")
        HookRegistry.register(target, hook, HookType[kind])
    HookRegistry.apply_hooks()
    for target, _, _ in hooks:
        if target not in HookRegistry._patched or resolve(target)[2] is before[target]:
            raise RuntimeError(f"sanitizer hook {target}: did not take (see upstream's log)")
    SANITIZER = san
    INSTALLED[:] = [target for target, _, _ in hooks]
    try:  # every kind at 0 from the start: a dashboard or gate sees the sanitizer is on
        for kind in KINDS:
            _violation_counter().labels(kind=kind)
    except Exception:
        logger.warning("sanitizer: violation counter unavailable", exc_info=True)
    logger.warning(
        "sglang-dsv4: KV sanitizer on (%d hooks, sample %s, action %s)",
        len(INSTALLED),
        sample,
        action,
    )
    return list(INSTALLED)


def install_from_settings(conf) -> None:
    """The plugin's call, after the fixes: nothing unless SGLANG_DSV4_SANITIZE=1; a hook that did
    not take stops the process with one line, as a fix that did not apply does."""
    if not conf.sanitize:
        return
    from sglang_dsv4.plugin import Refusal

    try:
        install(conf.sanitize_sample, conf.sanitize_action)
    except RuntimeError as exc:
        raise Refusal(str(exc)) from None


def describe() -> dict:
    """For `sglang-dsv4 status`: on/off, hooks, sample, action, violations so far."""
    if SANITIZER is None:
        return {"on": False, "hooks": 0, "summary": "off (0 hooks)"}
    return {
        "on": True,
        "hooks": len(INSTALLED),
        "sample": SANITIZER.sample,
        "action": SANITIZER.action,
        "violations": dict(SANITIZER.counts),
        "summary": f"on ({len(INSTALLED)} hooks, sample {SANITIZER.sample}, "
        f"action {SANITIZER.action})",
    }
