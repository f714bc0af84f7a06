"""The checks, host side: allocator and request-row ledgers, index-K writes, sampled reads, the
shadow reference, start-up pricing. Hooks (hooks.py) call these; tests call them on real upstream
pools and allocators."""

from __future__ import annotations

import logging
import random
import weakref
from collections import Counter

import torch

from sglang_dsv4.sanitizer.digest import c4_layers, poison_buffers
from sglang_dsv4.sanitizer.hicache import HostMirrorChecks
from sglang_dsv4.sanitizer.ledger import (
    _KEEP_VIOLATIONS,
    INDEX_HEAD_DIM,
    KINDS,
    POISON_BYTE,
    SHADOW_MIN_AGREEMENT,
    PageLedger,
    Violation,
    _pages,
    _violation_counter,
)
from sglang_dsv4.sanitizer.owners import OwnershipChecks
from sglang_dsv4.sanitizer.pd import TransferChecks
from sglang_dsv4.sanitizer.sampler import Sampler

logger = logging.getLogger("sglang_dsv4.sanitizer")


class Sanitizer(OwnershipChecks, TransferChecks, HostMirrorChecks):
    """The checks. Hooks call these; tests call them on real upstream pools and allocators."""

    def __init__(self, sample: float = 0.01, action: str = "log", seed: int | None = None):
        self.action = action
        self.rng = random.Random(seed)
        self.violations: list[Violation] = []
        self.counts: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.checked: Counter = Counter()  # what was checked: row reads, shadows, forwards, ...
        self.ledgers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # allocator ->
        self.pool_ledgers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # kvcache ->
        self.row_pages: dict[int, set[int]] = {}  # req_to_token row -> pages written to it
        self.row_request: dict[int, object] = {}  # row -> weakref to its Req (or its rid)
        self.row_extent: dict[int, int] = {}  # row -> positions of its table written so far
        self.priced_index_bytes: int | None = None
        self.sampler = Sampler(sample, self.rng)
        self._query: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (q, weights)
        self._init_transfer()
        self._init_ownership()
        self._init_host_mirror()

    @property
    def sample(self) -> float:
        return self.sampler.rate

    @sample.setter
    def sample(self, rate: float) -> None:
        self.sampler.rate = rate

    def begin_forward(self, batch) -> bool:
        """The batch's sampling decision (the sampler draws once per batch); a new batch drops
        the previous one's cached queries."""
        sampled, new = self.sampler.decide(batch)
        if new:
            self._query.clear()
            self.on_forward(batch)  # every forward: ownership and writes, sampled or not
        return sampled

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

    def _fake_transfer(self, row: int) -> bool:
        """Whether the row's request is one upstream decodes with no KV sent (PD warm-up)."""
        from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

        return getattr(self._req(row), "bootstrap_host", None) == FAKE_BOOTSTRAP_HOST

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
        self.tainted.clear()
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
        if ledger.kvcache is not None:
            self.check_late_writes(ledger.kvcache, new)
        if not new:
            return
        ledger.grow_to(max(new))
        for page in torch.tensor(new)[ledger.live[new]].tolist():
            # Who received it is known once a row is given or writes it (see owners.py).
            self.pending_double[page] = self.holders(page)
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
        if ledger.kvcache is not None:  # the DeepSeek-V4 full pages requests hold
            self.check_free([p for p in pages if ledger.live[p]])
        ledger.live[pages] = False
        for page in pages:
            self.pending_double.pop(page, None)
        self.untaint(pages)
        for held in self.row_pages.values():
            held.difference_update(pages)
        self.poison(ledger, pages)
        if ledger.kvcache is not None and self.failed_rooms:
            self.watch_freed(pages)

    @staticmethod
    def poison(ledger: PageLedger, pages: list[int]) -> None:
        for buffer in poison_buffers(ledger.kvcache):
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
            self.row_extent[row] = 0

    def on_row_write(self, indices, values, page_size: int) -> None:
        row = indices[0] if isinstance(indices, tuple) else indices
        where = indices[1] if isinstance(indices, tuple) and len(indices) > 1 else None
        if torch.is_tensor(row) and row.numel() == torch.as_tensor(values).numel() > 0:
            # a decode step's write: one new slot per row, at its position
            positions = (
                torch.as_tensor(where).reshape(-1).tolist()
                if where is not None and torch.as_tensor(where).numel() == row.numel()
                else [None] * row.numel()
            )
            for r, position, value in zip(
                row.reshape(-1).tolist(), positions, torch.as_tensor(values).reshape(-1),
                strict=True,
            ):
                self.on_row_write(int(r) if position is None else (int(r), int(position)),
                                  value, page_size)
            return
        if not isinstance(row, int):
            return
        # How far the row's table was written: where check_free reads what it holds now.
        if isinstance(where, slice) and where.stop is not None:
            self.row_extent[row] = max(self.row_extent.get(row, 0), int(where.stop))
        elif isinstance(where, int):
            self.row_extent[row] = max(self.row_extent.get(row, 0), where + 1)
        pages = [p for p in _pages(values, page_size) if p > 0]
        held = self.row_pages.setdefault(row, set())
        for page in pages:
            if self.attribute_double(row, page):
                continue
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
        self.attribute_load(row, pages)

    def on_rows_freed(self, rows) -> None:
        for row in rows:
            self.row_pages.pop(row, None)
            self.row_request.pop(row, None)
            self.row_extent.pop(row, None)

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
        self.checked["row_reads"] += min(len(rows), len(lens))
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
            if len(picked) and self._fake_transfer(row):
                # Upstream's PD warm-up: a decode request whose KV no prefill sends, by design
                # (FAKE_BOOTSTRAP_HOST), its output discarded. Its reads are unwritten; not a fault.
                self.checked["fake_transfer_rows"] += 1
                picked = picked[:0]
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
        self.checked["shadows"] += 1
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
