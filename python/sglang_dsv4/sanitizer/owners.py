"""Per-request page ownership, from what upstream really uses in each forward.

Every forward batch (eager or CUDA graph: the two sampling hooks see each one first) gives the
sanitizer its req_pool_indices, seq_lens and out_cache_loc; the request table gives each row's
page table. A row's pages are the pages its table names inside its length; a page's owners are
the live rows holding it (several for a shared radix prefix; the count is its reference count).

  - `foreign_write`: a row writes (out_cache_loc) into a page its own table does not name inside
    its length, or into a page another live row holds too. Names the writer and the holders;
    `abort` fails the writer.
  - `padded_write`: a padding row (bound to no live request) writes into a page a live request
    holds. Names the holders; `abort` fails them (their keys are overwritten; no request did it).
  - `double_owner`: the allocator handed out a page that was still live. Reported when a row
    first writes it or is given it (the extend path fills rows past ReqToTokenPool.write, so the
    allocator alone cannot say who received it), naming the receiver and the earlier holders;
    `abort` fails the receiver.
  - `early_free`: a page is freed while a live request other than the one releasing it still
    holds it (a radix prefix freed by one sharer while another reads it; a page freed early).
    Names the releasing request (upstream's BasePrefixCache.free_kv_row, hooked around) or "an
    unattributed free" (an eviction or flush) and the holders; `abort` fails the releasing
    request, or the holders when no request released it.

Cost, host side, every forward: one gather of each row's page ids ([rows, pages], a device->host
copy) and one copy of out_cache_loc; set work per row.
"""

from __future__ import annotations

import weakref

import torch

from sglang_dsv4.sanitizer.ledger import Violation

_RELEASE = "released by"


class OwnershipChecks:
    """The ownership half of Sanitizer (which provides report(), the ledgers and the rows)."""

    def _init_ownership(self) -> None:
        self.req_pool = None  # weakref to the scheduler's ReqToTokenPool
        self.freeing_row: int | None = None  # the row whose release is freeing pages now
        # page -> rows that held it when the allocator handed it out again (attributed later)
        self.pending_double: dict[int, list[int]] = {}

    def watch_req_pool(self, pool) -> None:
        self.req_pool = weakref.ref(pool)

    # --- who holds what --------------------------------------------------------------------------

    def bound(self, row: int) -> bool:
        """Whether `row` was given to a request (ReqToTokenPool.alloc) and not freed since; a
        padding row never is."""
        if row not in self.row_request:
            return False
        ref = self.row_request[row]
        return ref is None or ref() is not None

    def holders(self, page: int, excluding=()) -> list[int]:
        """Live rows whose pages include `page` (its owners), in row order."""
        return sorted(
            row
            for row, pages in self.row_pages.items()
            if page in pages and row not in excluding and self.bound(row)
        )

    def _names(self, rows) -> str:
        return ", ".join(self.request_name(r) for r in rows)

    def _full_ledger(self):
        for ledger in self.ledgers.values():
            if ledger.kvcache is not None:
                return ledger
        return None

    # --- forwards --------------------------------------------------------------------------------

    def on_forward(self, batch, req_to_token=None) -> int:
        """Ownership from one forward batch: each row's pages from its table, each write checked
        against them. Returns the violations found."""
        ledger = self._full_ledger()
        if req_to_token is None:
            pool = self.req_pool() if self.req_pool is not None else None
            req_to_token = getattr(pool, "req_to_token", None)
        if ledger is None or req_to_token is None or batch.out_cache_loc is None:
            return 0
        before = len(self.violations)
        page_size = ledger.page_size
        rows = batch.req_pool_indices.to("cpu", torch.int64).tolist()
        seq_lens = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens
        seq_lens = torch.as_tensor(seq_lens).to("cpu", torch.int64).tolist()
        out = batch.out_cache_loc.to("cpu", torch.int64)
        if batch.forward_mode.is_extend() and batch.extend_seq_lens_cpu is not None:
            counts = list(batch.extend_seq_lens_cpu)
        elif len(out) == len(rows):
            counts = [1] * len(rows)
        else:  # a mode this check does not split per row (speculative verify)
            return 0
        width = max(seq_lens, default=0)
        pages_per_row = -(-width // page_size)
        index = torch.as_tensor(rows, dtype=torch.int64, device=req_to_token.device)
        table = (req_to_token[index, : pages_per_row * page_size : page_size] // page_size).cpu()
        self.checked["forwards"] += 1
        offset = 0
        for i, (row, length, count) in enumerate(zip(rows, seq_lens, counts, strict=False)):
            written = out[offset : offset + count]
            offset += count
            n_pages = -(-length // page_size)
            own = set(table[i, :n_pages].to(torch.int64).tolist())
            pages = set((written[written >= 0] // page_size).tolist())
            if not self.bound(row):
                self._check_padding(row, pages)
                continue
            self.row_pages[row] = own
            self.row_extent[row] = max(self.row_extent.get(row, 0), length)
            self._check_writes(row, own, pages)
            self.attribute_load(row, own)
        self.checked["row_writes"] += len(rows)
        return len(self.violations) - before

    def _check_writes(self, row: int, own: set[int], pages: set[int]) -> None:
        for page in sorted(pages):
            if page == 0:
                continue
            if self.attribute_double(row, page):
                continue
            others = self.holders(page, excluding=(row,))
            if page not in own:
                held = f"held by {self._names(others)}" if others else "held by no live request"
                self.report(
                    Violation(
                        "foreign_write",
                        page=page,
                        expected="a write into the writer's own pages",
                        found=f"write into a page outside the row's table ({held})",
                    ),
                    row=row,
                )
            elif others:
                self.report(
                    Violation(
                        "foreign_write",
                        page=page,
                        expected="a write into a page only the writer holds",
                        found=f"page shared with {self._names(others)} "
                        f"(refcount {len(others) + 1})",
                    ),
                    row=row,
                )

    def attribute_double(self, row: int, page: int) -> bool:
        """`row` received `page`: a double_owner if the allocator handed it out while live."""
        earlier = self.pending_double.pop(page, None)
        if earlier is None:
            return False
        held = f"held by {self._names(earlier)}" if earlier else "held by no request row"
        self.report(
            Violation(
                "double_owner",
                page=page,
                expected="a free page",
                found=f"page handed out while live, {held}",
            ),
            row=row,
        )
        return True

    def _check_padding(self, row: int, pages: set[int]) -> None:
        for page in sorted(pages - {0}):
            others = self.holders(page)
            if not others:
                continue
            self.report(
                Violation(
                    "padded_write",
                    request=f"padding row {row}",
                    page=page,
                    expected="padding writes to the padding page 0",
                    found=f"write into a live page held by {self._names(others)}",
                ),
            )
            if self.action == "abort":
                for other in others:
                    self.abort(other, self.violations[-1])

    # --- frees -----------------------------------------------------------------------------------

    def still_holds(self, row: int, page: int) -> bool:
        """Whether the row's table (upstream's req_to_token) names `page` now, within what the
        row was written or last ran with. The ledger adds every page a row is written; a write
        that replaces part of the row (a checkpoint rebinding it to the tree's copy of pages the
        request computed again) leaves the old ones in the ledger, and upstream frees those
        later, outside the checkpoint. Without a table to read, the ledger's word stands."""
        pool = self.req_pool() if self.req_pool is not None else None
        table = getattr(pool, "req_to_token", None)
        ledger = self._full_ledger()
        extent = self.row_extent.get(row, 0)
        if table is None or ledger is None or extent <= 0:
            return True
        size = ledger.page_size
        return bool(((table[row, :extent:size] // size).cpu() == page).any())

    def check_free(self, pages: list[int]) -> None:
        """Pages about to be freed: each must be held by no live request but the releasing one
        (held: its table names it now)."""
        freer = self.freeing_row
        for page in pages:
            others = self.holders(page, excluding=() if freer is None else (freer,))
            for row in [r for r in others if not self.still_holds(r, page)]:
                self.row_pages[row].discard(page)  # rewritten away: no longer held
                others.remove(row)
            if not others:
                continue
            who = self.request_name(freer) if freer is not None else "an unattributed free"
            violation = Violation(
                "early_free",
                request=who if freer is None else None,
                page=page,
                expected="a page no other live request holds",
                found=f"freed ({_RELEASE} {who}) while held by {self._names(others)} "
                f"(refcount {len(others)})",
            )
            if freer is not None:
                self.report(violation, row=freer)
            else:
                self.report(violation)
                if self.action == "abort":
                    for other in others:
                        self.abort(other, violation)
