"""A mixed serving workload on upstream's own scheduling objects, on the CPU, with the sanitizer's
hooks in force.

What is upstream's: the DeepSeek-V4 pool (support.dsv4), PagedTokenToKVPoolAllocator,
ReqToTokenPool, RadixCache, Req, ScheduleBatch (prepare_for_extend / prepare_for_decode,
merge_batch, filter_batch), match / checkpoint / release through mem_cache.common (prefix hits,
chunked prefill, finishing into the radix tree), RadixCache.evict, ForwardBatch, and the c4
indexer's page table built by upstream's BuildPageTablePositions (its CPU path, with the stale
tail past each row's length that a reused row keeps). The sanitizer's hooks wrap those upstream
methods with upstream's HookRegistry wrapper (_wrap_fn) for the test's duration.

Stand-ins, and why: the model. The attention backend and the indexer kernels need a GPU, so
`Workload.forward` plays them: it writes the c4 index keys of the tokens each forward computes
(pool.set_index_k_bf16, hooked), and on a decode step scores each row's keys with the bf16 torch
kernel (sgl_kernel_dsv4.index_logits) over upstream's page table, keeps its top-k, and hands the
sanitizer's indexer hook the same metadata fields upstream's backend holds. Keys are a function
of the tokens, so a radix-shared page holds the keys its sharers expect.
"""

from __future__ import annotations

import random
from array import array
from collections import Counter
from types import SimpleNamespace

import torch
from sgl_kernel_dsv4.index_logits import bf16_paged_mqa_logits
from sglang.kernels.ops.attention.dsv4.attn_metadata_kernels import BuildPageTablePositions
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, ScheduleBatch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.plugins.hook_registry import HookType, _wrap_fn
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang_dsv4 import sanitizer
from sglang_dsv4.hooks import resolve
from sglang_dsv4.sanitizer import c4_layers

PAGE = 256
C4_PER_PAGE = PAGE // 4
HEADS, DIM = 64, 128
TOPK = 512
SWA_WINDOW = 128


def hook_into(monkeypatch, san, only=None) -> dict:
    """Apply the sanitizer's hooks (all present upstream, or the targets in `only`) to upstream's
    methods with upstream's own HookRegistry wrapper, undone when the test ends. Returns the
    bound hook functions by target, for the ones a test calls as the GPU-only callers would."""
    bound = {}
    for target, hook, kind in sanitizer.bind(san):
        bound[target] = hook
        if only is not None and target not in only:
            continue
        owner, name, original = resolve(target)
        monkeypatch.setattr(owner, name, _wrap_fn(original, hook, HookType[kind]))
    return bound


class Workload:
    """A scheduler loop in miniature: admit (prefix match, evict when short), prefill in chunks,
    decode the running batch, finish into the radix tree."""

    def __init__(self, chain, pool, hooks: dict, *, seed=0, rows=4, chunk=512, query_seed=None):
        self.chain, self.pool, self.hooks = chain, pool, hooks
        self.alloc = PagedTokenToKVPoolAllocator(
            pool.full_size,
            page_size=PAGE,
            dtype=torch.float8_e4m3fn,
            device="cpu",
            kvcache=pool,
            need_sort=False,
        )
        self.rows = ReqToTokenPool(
            size=rows, max_context_len=4096, device="cpu", enable_memory_saver=False
        )
        self.tree = RadixCache(
            CacheInitParams(
                disable=False,
                req_to_token_pool=self.rows,
                token_to_kv_pool_allocator=self.alloc,
                page_size=PAGE,
            )
        )
        self.layer = c4_layers(pool)[0]
        self.chunk = chunk
        self.rng = random.Random(seed)
        self.qgen = torch.Generator().manual_seed(seed if query_seed is None else query_seed)
        # Keys are a function of the tokens: a table row per (token, position) mix.
        self.key_table = torch.randn(997, DIM, generator=torch.Generator().manual_seed(7)).to(
            torch.bfloat16
        )
        self.running: ScheduleBatch | None = None
        self.waiting: list[Req] = []
        self.chunked: Req | None = None
        self.stats = Counter()
        self.admitted: list[Req] = []
        # Fault injection points: before_forward(workload, forward_batch) may return the batch
        # the hooks see instead (a padded one); before_release(workload, req) runs before a
        # finished request is released.
        self.before_forward = None
        self.before_release = None
        # skip_key(req, position) -> True drops that key write (a lost write); wrong_topk(
        # positions, c4_len) -> the positions a faulty kernel returns instead.
        self.skip_key = None
        self.wrong_topk = None
        self.backend = SimpleNamespace(
            token_to_kv_pool=pool,
            page_size=PAGE,
            req_to_token=self.rows.req_to_token,
            forward_metadata=None,
        )
        self.indexer = SimpleNamespace(layer_id=self.layer)

    # --- requests --------------------------------------------------------------------------------

    def submit(self, rid: str, tokens: list[int], max_new_tokens: int) -> Req:
        req = Req(
            rid,
            "",
            array("q", tokens),
            SamplingParams(max_new_tokens=max_new_tokens, temperature=0),
        )
        self.waiting.append(req)
        return req

    def _running_reqs(self) -> list[Req]:
        return list(self.running.reqs) if self.running is not None else []

    def _admit(self) -> Req | None:
        if self.chunked is not None:
            req, self.chunked = self.chunked, None
            req.init_next_round_input()  # as upstream: a chunked request does not match again
            return req
        if not self.waiting or self.rows.available_size() == 0:
            return None
        req = self.waiting[0]
        req.init_next_round_input(self.tree)
        # Locked before anything is evicted: an unlocked matched node may be evicted under it.
        lock = self.tree.lock(req.last_node)
        left = len(req.full_untruncated_fill_ids) - req.prefix_len
        need = min(left, self.chunk) + PAGE * (2 + len(self._running_reqs()))
        if self.alloc.available_size() < need:
            before = self.alloc.available_size()
            self.tree.evict(EvictParams(num_tokens=need - before))
            if self.alloc.available_size() > before:
                self.stats["evictions"] += 1
            if self.alloc.available_size() < need:
                self.tree.unlock(lock)
                return None
        self.waiting.pop(0)
        self.stats["prefix_hits"] += req.prefix_len > 0
        self.stats["prefix_tokens"] += req.prefix_len
        req.lock = lock
        self.admitted.append(req)
        return req

    # --- one scheduler step ----------------------------------------------------------------------

    def step(self) -> bool:
        """One forward: a prefill (chunk) when one is admitted, else a decode step. False when
        nothing is left to run."""
        req = self._admit()
        if req is not None:
            self._prefill(req)
            return True
        if self.running is not None and self.running.reqs:
            self._decode()
            return True
        return bool(self.waiting)

    def _prefill(self, req: Req) -> None:
        end = len(req.full_untruncated_fill_ids)
        req.extend_end = min(end, req.prefix_len + self.chunk)
        chunked = req.extend_end < end
        batch = ScheduleBatch.init_new(
            [req],
            self.rows,
            self.alloc,
            self.tree,
            self.chain.model_config,
            False,
            SpeculativeAlgorithm.NONE,
        )
        batch.prepare_for_extend()
        self.stats["prefill_chunks"] += 1
        self.forward(batch, ForwardMode.EXTEND)
        if chunked:
            checkpoint_kv_cache(req, self.tree)
            self.chunked = req
            return
        req.output_ids.append(self._next_token(req))
        batch.output_ids = torch.tensor([req.output_ids[-1]], dtype=torch.int64)
        if self.running is None or not self.running.reqs:
            self.running = batch
        else:
            self.running.merge_batch(batch)
        self._finish_done()

    def _decode(self) -> None:
        batch = self.running
        batch.prepare_for_decode()
        self.stats["decode_steps"] += 1
        self.forward(batch, ForwardMode.DECODE)
        for req in batch.reqs:
            req.output_ids.append(self._next_token(req))
        batch.output_ids = torch.tensor([r.output_ids[-1] for r in batch.reqs], dtype=torch.int64)
        self._finish_done()

    def _finish_done(self) -> None:
        batch = self.running
        done = [r for r in batch.reqs if len(r.output_ids) >= r.sampling_params.max_new_tokens]
        for req in done:
            req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
            if self.before_release is not None:
                self.before_release(self, req)
            release_kv_cache(req, self.tree, checkpoint=True)
            self.stats["finished"] += 1
        if done:
            keep = [i for i, r in enumerate(batch.reqs) if r not in done]
            batch.filter_batch(keep_indices=keep)

    def _next_token(self, req: Req) -> int:
        return (len(req.origin_input_ids) * 31 + len(req.output_ids) * 7) % 50000

    # --- the model's part ------------------------------------------------------------------------

    def forward_batch(self, batch: ScheduleBatch, mode) -> ForwardBatch:
        """The ForwardBatch upstream's model runner gets: the schedule batch's own tensors."""
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(batch.reqs),
            input_ids=batch.input_ids,
            req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens,
            out_cache_loc=batch.out_cache_loc,
            seq_lens_sum=int(batch.seq_lens.sum()),
            seq_lens_cpu=batch.seq_lens.cpu(),
        )
        if mode.is_extend():
            fb.extend_seq_lens = torch.tensor(batch.extend_lens)
            fb.extend_prefix_lens = torch.tensor(batch.prefix_lens)
            fb.extend_seq_lens_cpu = list(batch.extend_lens)
            fb.extend_prefix_lens_cpu = list(batch.prefix_lens)
        return fb

    def forward(self, batch: ScheduleBatch, mode) -> ForwardBatch:
        fb = self.forward_batch(batch, mode)
        seen = fb
        if self.before_forward is not None:
            seen = self.before_forward(self, fb) or fb
        self.hooks[f"{sanitizer.hooks._BACKEND}.init_forward_metadata"](None, self.backend, seen)
        self._write_keys(fb, mode, batch.reqs)
        if mode.is_decode():
            self._indexer_read(fb)
        return fb

    def _write_keys(self, fb: ForwardBatch, mode, reqs) -> None:
        """The c4 keys of the compressed tokens this forward completes, at their c4 slots."""
        seq_lens = fb.seq_lens.tolist()
        locs = fb.out_cache_loc.to(torch.int64)
        starts = fb.extend_prefix_lens_cpu if mode.is_extend() else [n - 1 for n in seq_lens]
        slots, keys = [], []
        offset = 0
        for req, start, end in zip(reqs, starts, seq_lens, strict=True):
            ids = req.origin_input_ids + req.output_ids
            for pos in range(start, end):
                if pos % 4 == 3 and not (self.skip_key and self.skip_key(req, pos)):
                    # the fourth token completes a compressed token
                    slots.append(int(locs[offset + pos - start]) // 4)
                    token = int(ids[pos]) if pos < len(ids) else 0
                    keys.append(self.key_table[(token * 31 + pos * 7) % len(self.key_table)])
            offset += end - start
        if slots:
            self.pool.set_index_k_bf16(
                self.layer, torch.tensor(slots, dtype=torch.int32), torch.stack(keys)
            )
            self.stats["keys_written"] += len(slots)

    def _indexer_read(self, fb: ForwardBatch) -> None:
        """The c4 indexer of one decode step, as the backend runs it: upstream's page table for
        the batch, the kernel's top-k over it, then the sanitizer's indexer hook."""
        seq_lens = fb.seq_lens.to(torch.int32)
        prep = BuildPageTablePositions.torch(
            req_to_token=self.rows.req_to_token,
            req_pool_indices_repeated=fb.req_pool_indices,
            seq_lens_casual=seq_lens,
            max_seq_len=int(seq_lens.max()),
            page_size=PAGE,
            swa_window=SWA_WINDOW,
        )
        table = prep.page_table
        c4_lens = (seq_lens // 4).to(torch.int32)
        n = len(seq_lens)
        q = torch.randn(n, 1, HEADS, DIM, generator=self.qgen).to(torch.bfloat16)
        weights = torch.rand(n, HEADS, generator=self.qgen)
        keys = self.pool.get_index_k_bf16_buffer(self.layer)
        width = int(c4_lens.max())
        logits = bf16_paged_mqa_logits(q, keys, weights, c4_lens, table, width)
        selected = torch.full((n, TOPK), -1, dtype=torch.int32)
        for i in range(n):
            k = min(TOPK, int(c4_lens[i]))
            if k == 0:
                continue
            positions = torch.topk(logits[i, : int(c4_lens[i])], k).indices
            if self.wrong_topk is not None:
                positions = self.wrong_topk(positions, int(c4_lens[i]))
                k = len(positions)
            pages = table[i].to(torch.int64)[positions // C4_PER_PAGE]
            selected[i, :k] = (pages * C4_PER_PAGE + positions % C4_PER_PAGE).to(torch.int32)
        self.backend.forward_metadata = SimpleNamespace(
            indexer_metadata=SimpleNamespace(
                page_table=table, compressed_seq_lens=c4_lens, compressed_page_size=C4_PER_PAGE
            ),
            core_metadata=SimpleNamespace(c4_sparse_page_indices=selected),
        )
        query = self.hooks.get(f"{sanitizer.hooks._C4_INDEXER}.compute_q_bf16")
        if query is not None:
            query((q[:, 0], weights), self.indexer)
        self.hooks[f"{sanitizer.hooks._INDEXER_BACKEND}.forward_c4_indexer"](
            None, self.backend, c4_indexer=self.indexer, forward_batch=fb
        )
        self.stats["row_reads"] += n

    def run(self, max_steps: int = 100_000) -> Counter:
        for _ in range(max_steps):
            if not self.step():
                break
        return self.stats
