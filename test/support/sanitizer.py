"""One scheduler's memory objects on the CPU for the sanitizer tests: upstream's DeepSeek-V4 pool
(support.dsv4), PagedTokenToKVPoolAllocator and ReqToTokenPool, and a Sanitizer fed as its hooks
feed it in a server process."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang_dsv4.sanitizer import Sanitizer, c4_layers

PAGE = 256  # full tokens per page
C4_PER_PAGE = PAGE // 4  # c4 slots per page
HEADS, DIM = 64, 128


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
        # A release frees a request's pages inside upstream's BasePrefixCache.free_kv_row, whose
        # hook names the releasing row; the same here.
        self.san.freeing_row = row
        try:
            self.alloc.free(self.rows.req_to_token[row, :tokens].to(torch.int64))
        finally:
            self.san.freeing_row = None
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
def make_server(pool, monkeypatch):
    srv = Server(pool)
    release = PagedTokenToKVPoolAllocator._release_page_ids

    def released(alloc_self, *page_ids):
        for ids in page_ids:
            srv.san.on_release(alloc_self, ids)
        return release(alloc_self, *page_ids)

    monkeypatch.setattr(srv.alloc, "_release_page_ids", released.__get__(srv.alloc))
    return srv
