"""index-k-bf16: bf16 index keys for the DeepSeek-V4 c4 indexer.

Register entry
  Target:      sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4IndexerPool
               sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool
               sglang.srt.layers.attention.dsv4.indexer.C4Indexer
               sglang.srt.layers.attention.dsv4.indexer.C4IndexerBackendMixin
               sglang.srt.layers.attention.dsv4.compressor_v2.CompressorBackendMixin
               sglang.srt.layers.attention.deepseek_v4_backend.DeepseekV4AttnBackend
  Why:         The c4 lightning indexer scores every cached index key (128 values per compressed
               token, 21 c4 layers in DeepSeek-V4-Flash) and keeps the top 512 for sparse attention.
               Upstream 0.5.23 stores keys as fp8 e4m3 plus one fp32 scale per 128 values (132
               B/token; fp4: 68) and quantizes the query to fp8; the precision lost there costs
               long-context recall.
  How:         SGLANG_DSV4_INDEX_K_DTYPE=fp8|bf16|fp4, default fp8 (upstream's numerics, so
               installing the distribution changes nothing silently); fp4 goes with upstream's
               --enable-deepseek-v4-fp4-indexer and a contradiction stops start-up. Under bf16 the
               c4 indexer pool stores keys as they are: 256 B/token, no scale, in upstream's page
               rows (same page count and registration), with bf16 set/get methods on the indexer and
               token pools (the getters wait for the layer's HiCache transfer).
               dsv4_index_k_bytes_per_token is the one byte rule for every dtype; the pool records
               its dtype as index_k_dtype. Compute: C4Indexer.forward sends a layer whose pool is
               bf16 to forward_c4_indexer_bf16 (others to upstream's forward_c4_indexer): the query
               gets RoPE and the Hadamard rotation but stays bf16, sgl_kernel_dsv4's
               bf16_paged_mqa_logits scores the pool's bf16 pages (-inf past each row's seq_len, as
               upstream's top-k needs; the kernel's loads and dots follow the keys a row has, not
               the page table's width), and upstream's top-k step follows, in row chunks whose
               temporaries fit a budget (SGLANG_DSV4_INDEXER_BUDGET_MIB, default 512). Write path:
               DeepseekV4AttnBackend.forward_indexer_compressor sends bf16 pools through upstream's
               compress_forward, then RMSNorm, RoPE and Hadamard rotation in fp32 and a bf16 store
               into the pool slots that skips rows completing no token, as upstream does; fp8 pools
               keep upstream's fused fp8 store (forward_unified). On CUDA the query, the key store
               and the logits are one Triton kernel each (written for sm_120); elsewhere their torch
               references run.
  Upstream:    not upstream
  Remove when: upstream ships a bf16 (or otherwise lossless) index-K option for DeepSeek-V4.

How, in detail
  SGLANG_DSV4_INDEX_K_DTYPE=fp8|bf16|fp4 (default fp8, upstream's numerics). Under
  bf16 the c4 pool stores the keys as they are: 256 B/token, no scale, same pages.
  One function, dsv4_index_k_bytes_per_token, decides the bytes per indexer token for
  every dtype; the pool allocates by it (and pool-sizing-bf16 prices by it).
  Compute (bf16 pools only; fp8 and fp4 layers run upstream's code unchanged):
  C4Indexer.forward routes the layer to forward_c4_indexer_bf16, which keeps the
  query bf16 (RoPE + Hadamard, no fp8), scores the pool's bf16 pages with
  sgl_kernel_dsv4.bf16_paged_mqa_logits and runs upstream's top-k step. Write:
  DeepseekV4AttnBackend.forward_indexer_compressor runs upstream's compress_forward,
  then store_bf16_index_keys_from_plan (RMSNorm, RoPE, Hadamard in fp32, bf16 into
  the pool slots; rows that complete no token are skipped, as upstream skips them,
  never aimed at slot 0).
  Which path runs where: on CUDA three Triton kernels (sgl_kernel_dsv4; written for
  sm_120): the fused query (index_query_bf16_triton), the fused key store
  (store_index_keys_bf16_triton) and the logits (bf16_paged_mqa_logits_triton); on
  any other device their torch references (index_rotation, index_logits), which
  are also the tests' reference.
  Logits launch rule: grid (rows, workers), workers from shapes and the device's SM
  count only (CUDA-graph safe); each program walks its row's pages up to seq_len, so
  loads and dots follow the keys, not the page-table width (in a decode CUDA graph
  as wide as the longest context the server allows). Positions past seq_len are
  -inf, filled by plain stores: upstream's torch / flashinfer-unfused top-k masks
  them to select but gathers the unmasked scores, so a row with fewer finite scores
  than 512 (holes in its page table) would otherwise select stale values.
  Memory: rows go in chunks (query, logits, top-k per chunk) of
  indexer_rows_per_chunk(T, L, H) = min(T, 3/4 B // (12 L + 24 H * 128),
  B/4 // (64 * (6 * 128 + 8 H + 8))), B the budget (SGLANG_DSV4_INDEXER_BUDGET_MIB,
  default 512 MiB per rank), L the logits width, H the heads; peak <= B at any T
  (the torch logits path keeps its page steps under B/4). At L = 262,144 (1M
  tokens at ratio 4), H = 64: 3.34 MB per row, 120 rows per chunk; at L = 4,096:
  246 KB per row, 1,628 rows. test_index_k_dispatch measures the peak on CPU.

Storage contract (the compute part of this fix, HiCache and PD build on it)
  - Dtype. SGLANG_DSV4_INDEX_K_DTYPE is read once per process (`requested_dsv4_index_k_dtype`,
    cached). fp4 is upstream's fp4 indexer and goes with --enable-deepseek-v4-fp4-indexer: the
    flag alone means fp4; the variable set to fp4 without the flag, or to fp8 / bf16 with it, is a
    contradiction and stops start-up with one line (`get_dsv4_c4_index_k_dtype`, which the pool
    configurator calls before any pool exists). Low-ratio (ratio 1 / 2) pools are built fp4 by
    upstream whatever the variable says, and stay so.
  - Each DeepSeekV4IndexerPool fixes its dtype when it creates its buffers and keeps it as
    `pool.index_k_dtype` ("fp8" | "bf16" | "fp4"); runtime code reads that, never the variable, so
    pools of several dtypes can live in one process. Tests switch dtypes by setting the variable
    and calling `requested_dsv4_index_k_dtype.cache_clear()` (see `sglang_dsv4.plan.chain`).
  - Layout. Under bf16 the c4 indexer pool keeps upstream's buffer family: per layer one uint8
    tensor [num_pages, page_size * 256] (`index_k_with_scale_buffer`, same page count and the
    same page rows PD and HiCache register, item = one page). Its bf16 view is
    [num_pages, page_size, 1, 128], row-major per token: slot s is token s % page_size of page
    s // page_size. That view is the `kv_cache` argument of bf16_paged_mqa_logits.
  - DeepSeekV4IndexerPool: get_index_k_bf16_buffer(layer_id) -> the bf16 view;
    set_index_k_bf16(layer_id, loc int[n], index_k bf16[n, 128]); get_index_k_bf16(layer_id,
    slots int[n]) -> bf16[n, 128] (a copy). Each refuses a pool of another dtype with one line.
  - DeepSeekV4TokenToKVPool: the same three for a model layer id (getters wait for the layer's
    HiCache transfer first), and index_k_dtype_of(layer_id) -> str.
"""

from __future__ import annotations

import torch

# The functions below run with this module's globals: the same names the upstream module imports.
from sgl_kernel_dsv4.index_logits import bf16_paged_mqa_logits, indexer_rows_per_chunk
from sgl_kernel_dsv4.index_rotation import index_query_bf16, store_index_keys_bf16
from sglang.srt.layers.attention.dsv4.compressor_v2 import compress_forward, is_overlap_compress
from sglang.srt.layers.attention.dsv4.indexer import (
    get_global_indexer_capturer,
    iter_row_chunks,
    plan_topk_v2,
    topk_transform_paged,
    topk_transform_paged_v2,
    topk_transform_pytorch_vectorized,
)
from sglang.srt.runtime_context import get_exec

from sglang_dsv4.fix import Add, Fix, Replace
from sglang_dsv4.index_k_dtype import (
    dsv4_index_k_bytes_per_token,
    dsv4_index_k_dtype_for,
    parse_dsv4_index_k_dtype,
    requested_dsv4_index_k_dtype,
    resolve_dsv4_index_k_dtype,
)

POOL_MODULE = "sglang.srt.mem_cache.deepseek_v4_memory_pool"
INDEXER_POOL = f"{POOL_MODULE}.DeepSeekV4IndexerPool"
TOKEN_POOL = f"{POOL_MODULE}.DeepSeekV4TokenToKVPool"


# --- storage: functions added to sglang.srt.mem_cache.deepseek_v4_memory_pool ------------------
# The dtype rules live in sglang_dsv4.index_k_dtype (imported above); this one reads the flag.


def get_dsv4_c4_index_k_dtype() -> str:
    """Dtype the c4 indexer pool of this server stores; refuses a contradictory setting."""
    use_fp4_indexer = get_exec().kernel.enable_deepseek_v4_fp4_indexer
    return dsv4_index_k_dtype_for(requested_dsv4_index_k_dtype(), use_fp4_indexer)


# --- storage: DeepSeekV4IndexerPool (the class only groups what this fix adds to it) ----------


class IndexerPoolStorage:
    def get_bytes_per_token(self) -> int:
        # Buffer creation asks this first, so the pool's dtype is fixed with its buffers, once.
        if getattr(self, "index_k_dtype", None) is None:
            self.index_k_dtype = resolve_dsv4_index_k_dtype(self.use_fp4_indexer)
        return dsv4_index_k_bytes_per_token(self.index_head_dim, self.index_k_dtype)

    def require_index_k_dtype(self, index_k_dtype: str) -> None:
        """Refuse, in one line, an access in a layout this pool does not store."""
        if self.index_k_dtype != index_k_dtype:
            raise ValueError(
                f"this DeepSeek-V4 indexer pool stores {self.index_k_dtype} index keys, not "
                f"{index_k_dtype} (SGLANG_DSV4_INDEX_K_DTYPE)"
            )

    def get_index_k_bf16_buffer(self, layer_id: int) -> torch.Tensor:
        """One layer's bf16 keys as [num_pages, page_size, 1, index_head_dim]: a view of its page
        rows, in which slot s is token s % page_size of page s // page_size."""
        self.require_index_k_dtype("bf16")
        page_rows = self.index_k_with_scale_buffer[layer_id - self.start_layer]
        return page_rows.view(torch.bfloat16).view(-1, self.page_size, 1, self.index_head_dim)

    def set_index_k_bf16(self, layer_id: int, loc: torch.Tensor, index_k: torch.Tensor) -> None:
        """Store bf16 keys index_k [n, index_head_dim] at slots loc [n]."""
        token_rows = self.get_index_k_bf16_buffer(layer_id).view(-1, self.index_head_dim)
        if index_k.dtype != torch.bfloat16 or index_k.shape[-1] != self.index_head_dim:
            raise ValueError(
                f"bf16 index keys must be bfloat16 [n, {self.index_head_dim}], got "
                f"{index_k.dtype} {list(index_k.shape)}"
            )
        token_rows.index_copy_(0, loc.to(torch.int64), index_k.reshape(-1, self.index_head_dim))

    def get_index_k_bf16(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        """The bf16 keys at slots [n], as a new [n, index_head_dim] tensor."""
        token_rows = self.get_index_k_bf16_buffer(layer_id).view(-1, self.index_head_dim)
        return token_rows.index_select(0, slots.to(torch.int64))


# --- storage: DeepSeekV4TokenToKVPool (model layer ids; getters wait for HiCache) --------------


class TokenPoolStorage:
    def index_k_dtype_of(self, layer_id: int) -> str:
        """The index-K dtype ("fp8", "bf16" or "fp4") of a compressed layer's indexer pool."""
        ratio = self.layer_mapping[layer_id].compress_ratio
        return self._indexer_pool(ratio).index_k_dtype

    def get_index_k_bf16_buffer(self, layer_id: int) -> torch.Tensor:
        self.wait_layer_transfer(layer_id)
        ratio, pool_layer_id, _ = self.layer_mapping[layer_id]
        return self._indexer_pool(ratio).get_index_k_bf16_buffer(pool_layer_id)

    def get_index_k_bf16(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        self.wait_layer_transfer(layer_id)
        ratio, pool_layer_id, _ = self.layer_mapping[layer_id]
        return self._indexer_pool(ratio).get_index_k_bf16(pool_layer_id, slots)

    def set_index_k_bf16(self, layer_id: int, loc: torch.Tensor, index_k: torch.Tensor) -> None:
        ratio, pool_layer_id, _ = self.layer_mapping[layer_id]
        self._indexer_pool(ratio).set_index_k_bf16(pool_layer_id, loc, index_k)


STORAGE_REPLACES = (
    Replace(
        target=f"{INDEXER_POOL}.get_bytes_per_token",
        func=IndexerPoolStorage.get_bytes_per_token,
        signature="(self)",
    ),
)
STORAGE_ADDS = (
    Add(owner=POOL_MODULE, func=parse_dsv4_index_k_dtype),
    Add(owner=POOL_MODULE, func=requested_dsv4_index_k_dtype),
    Add(owner=POOL_MODULE, func=dsv4_index_k_dtype_for),
    Add(owner=POOL_MODULE, func=resolve_dsv4_index_k_dtype),
    Add(owner=POOL_MODULE, func=get_dsv4_c4_index_k_dtype),
    Add(owner=POOL_MODULE, func=dsv4_index_k_bytes_per_token),
    Add(owner=INDEXER_POOL, func=IndexerPoolStorage.require_index_k_dtype),
    Add(owner=INDEXER_POOL, func=IndexerPoolStorage.get_index_k_bf16_buffer),
    Add(owner=INDEXER_POOL, func=IndexerPoolStorage.set_index_k_bf16),
    Add(owner=INDEXER_POOL, func=IndexerPoolStorage.get_index_k_bf16),
    Add(owner=TOKEN_POOL, func=TokenPoolStorage.index_k_dtype_of),
    Add(owner=TOKEN_POOL, func=TokenPoolStorage.get_index_k_bf16_buffer),
    Add(owner=TOKEN_POOL, func=TokenPoolStorage.get_index_k_bf16),
    Add(owner=TOKEN_POOL, func=TokenPoolStorage.set_index_k_bf16),
)
STORAGE_IMPORTS = {POOL_MODULE: ("import functools", "import os")}


# --- compute: sglang.srt.layers.attention.dsv4.indexer ----------------------------------------


def resize_query_rows(tensor: torch.Tensor, rows: int, fill) -> torch.Tensor:
    """`tensor` cut to, or padded with `fill` up to, `rows` rows (dim 0); a view when cut."""
    if tensor.shape[0] >= rows:
        return tensor[:rows]
    padding = tensor.new_full((rows - tensor.shape[0], *tensor.shape[1:]), fill)
    return torch.cat((tensor, padding))


class C4IndexerCompute:
    def forward(
        self,
        x,
        q_lora,
        forward_batch,
        attn_backend,
        enable_multi_stream=False,
        q_lora_ready=None,
        skip_compressor=False,
        q_lora_quant=None,
    ) -> None:
        # The pool decides: keys stored as bf16 are scored by the bf16 path, others by upstream's.
        if attn_backend.token_to_kv_pool.index_k_dtype_of(self.layer_id) == "bf16":
            run = attn_backend.forward_c4_indexer_bf16
        else:
            run = attn_backend.forward_c4_indexer
        options = {}
        if q_lora_quant is not None:  # passed only when there is one, as upstream does
            options["q_lora_quant"] = q_lora_quant
        return run(
            x=x,
            q_lora=q_lora,
            c4_indexer=self,
            forward_batch=forward_batch,
            alt_streams=self.alt_streams,
            skip_compressor=skip_compressor,
            enable_multi_stream=enable_multi_stream,
            q_lora_ready=q_lora_ready,
            **options,
        )

    def compute_q_bf16(self, q_lora, positions, weight, q_lora_quant=None):
        """The query for bf16 index keys: upstream's projection, then RoPE and Hadamard rotation
        in fp32 rounded to bf16 rather than quantized to fp8 (one fused kernel on CUDA). The head
        weights get the indexer's weight scale and no per-query scale.
        Returns (q [T, H, D] bf16, weights [T, H] fp32)."""
        q, _ = self.wq_b(q_lora if q_lora_quant is None else q_lora_quant)
        q = q.view(-1, self.n_local_heads, self.head_dim)
        return index_query_bf16(q, self.freqs_cis, positions), weight.float() * self.weight_scale


class C4IndexerBackendCompute:
    def forward_c4_indexer_bf16(
        self,
        x,
        q_lora,
        c4_indexer,
        forward_batch,
        alt_streams=None,
        enable_multi_stream=False,
        q_lora_ready=None,
        skip_compressor=False,
        q_lora_quant=None,
    ) -> None:
        """forward_c4_indexer for a bf16 index-K pool (C4Indexer.forward routes here).

        Same inputs, same outputs: the compressor stores this step's keys, the query stays bf16,
        the logits are float32 [rows, max_compressed_seq_len] (each row's first seq_len scores;
        upstream's top-k reads no more), and upstream's top-k step fills c4_sparse_page_indices.
        Rows go in chunks (query, logits, top-k per chunk) whose temporaries fit the indexer's
        memory budget (indexer_rows_per_chunk), never more than upstream's own row chunk.
        Prefill runs the same paged kernel; it has no fp8-only ragged variant to take.
        Streams run in sequence here: only the wait for q_lora is kept.
        """
        if forward_batch.forward_mode.is_idle():
            return
        paged = self.forward_metadata.indexer_metadata
        core = self.forward_metadata.core_metadata
        rows = min(x.shape[0], q_lora.shape[0], core.positions.shape[0])
        if q_lora.shape[0] != rows:
            q_lora, q_lora_quant = q_lora[:rows], None  # the quantized copy has the old rows
        x, positions = x[:rows], core.positions[:rows]
        if not skip_compressor:
            self.forward_indexer_compressor(
                x=x, forward_batch=forward_batch, layer_id=c4_indexer.layer_id,
                compressor=c4_indexer.compressor,
            )
        if q_lora_ready is not None:  # on a side stream: q_lora comes from the caller's stream
            torch.cuda.current_stream().wait_event(q_lora_ready)
        weights = c4_indexer.compute_weights(x, skip_scale=True)

        seq_lens = resize_query_rows(paged.compressed_seq_lens, rows, 1)
        page_table = resize_query_rows(paged.page_table, rows, 0)
        selected = resize_query_rows(core.c4_sparse_page_indices, rows, -1)
        if self.debug_use_external_c4_sparse_indices:
            return
        positions_out = self._c4_raw_indices(forward_batch, core, selected)
        keys = self.token_to_kv_pool.get_index_k_bf16_buffer(c4_indexer.layer_id)
        rows_per_chunk = indexer_rows_per_chunk(
            rows, paged.max_compressed_seq_len, c4_indexer.n_local_heads
        )
        if paged.rows_per_chunk is not None:
            rows_per_chunk = min(rows_per_chunk, paged.rows_per_chunk)
        for part in iter_row_chunks(num_rows=rows, rows_per_chunk=rows_per_chunk):
            whole = part == slice(0, rows)
            # the quantized copy of q_lora cannot be cut by rows: chunks project q_lora itself
            q, head_weights = c4_indexer.compute_q_bf16(
                q_lora[part], positions[part], weights[part], q_lora_quant if whole else None
            )
            logits = bf16_paged_mqa_logits(
                q.unsqueeze(1), keys, head_weights, seq_lens[part], page_table[part],
                paged.max_compressed_seq_len,
            )
            del q  # one chunk of query and logits alive at a time
            self._c4_topk_transform(
                logits, seq_lens[part], page_table[part], selected[part],
                None if positions_out is None else positions_out[part],
                paged.compressed_page_size,
                paged.topk_metadata if whole else None,
            )
            del logits
        self._c4_after_topk(forward_batch, c4_indexer, paged, core, positions_out)

    def _c4_topk_transform(
        self, logits, seq_lens, page_table, out_page_indices, out_raw_indices, page_size,
        topk_plan=None,
    ) -> None:
        """Upstream's top-k step for a block of rows, by the configured top-k backend."""
        backend = self.dsa_topk_backend
        common = (logits, seq_lens, page_table, out_page_indices, page_size)
        if backend.is_torch():
            topk_transform_pytorch_vectorized(*common, out_raw_indices)
        elif backend.is_flashinfer():
            self.flashinfer_topk_transform(*common, out_raw_indices)
        elif backend.should_use_topk_v2():
            # the cached plan routes rows by index in the whole batch; a chunk needs its own
            plan = plan_topk_v2(seq_lens) if topk_plan is None else topk_plan
            topk_transform_paged_v2(*common, plan, out_raw_indices)
        else:
            topk_transform_paged(*common, out_raw_indices)

    def _c4_raw_indices(self, forward_batch, core, out_page_indices):
        """Where top-k also writes the selected positions: the metadata's buffer, or one for the
        indexer capturer or HiSparse decode; None when nothing reads them."""
        if core.c4_sparse_raw_indices is not None:
            return core.c4_sparse_raw_indices
        if get_global_indexer_capturer() is not None:
            return torch.empty_like(out_page_indices)
        coordinator = self.hisparse_coordinator
        if coordinator is not None and forward_batch.forward_mode.is_decode():
            return coordinator.raw_indices_buffer[: out_page_indices.shape[0]]
        return None

    def _c4_after_topk(self, forward_batch, c4_indexer, paged, core, raw_indices) -> None:
        """Hand the selection to HiSparse and the indexer capturer, as upstream does."""
        coordinator = self.hisparse_coordinator
        capturer = get_global_indexer_capturer()
        if coordinator is None and capturer is None:
            return
        pool = self.token_to_kv_pool
        layer = pool.layer_mapping[c4_indexer.layer_id].compress_layer_id
        if coordinator is not None and forward_batch.forward_mode.is_decode():
            core.c4_sparse_page_indices = coordinator.swap_in_selected_pages(
                req_pool_indices=forward_batch.req_pool_indices,
                compressed_seq_lens=paged.compressed_seq_lens,
                top_k_result=raw_indices,
                layer_id=layer,
            )
        elif coordinator is not None:
            # pool slots -> HiSparse device slots; flash_mla's c4 attention takes int32
            device_slots = pool.c4_kv_pool.translate_loc_to_hisparse_device(
                core.c4_sparse_page_indices
            )
            core.c4_sparse_page_indices = device_slots.to(torch.int32)
        if capturer is not None:
            capturer.capture(layer, raw_indices)


# --- compute: the write path (sglang.srt.layers.attention.dsv4.compressor_v2 and the backend) --


def store_bf16_index_keys_from_plan(pool_rows, kv, plan, out_loc, norm, freqs_cis) -> None:
    """Store the index keys of compressed rows kv [N, D] (one per row of `plan`) into the bf16
    pool rows pool_rows [slots, D].

    The steps upstream's fused store runs before quantizing to fp8, in fp32: RMSNorm with the
    compressor's weight, RoPE at the compressed token's position (seq_len - ratio), the Hadamard
    rotation; then bf16 (one fused kernel on CUDA). Rows that complete no compressed token
    (decode: seq_len not a multiple of the ratio; prefill: invalid plan rows) are skipped, as
    upstream skips them: nothing is written for them, slot 0 included.
    """
    store_index_keys_bf16(
        pool_rows, kv, norm.weight, norm.variance_epsilon, freqs_cis,
        plan[1].view(torch.int32),  # 16-byte plan rows: seq_len (uint32) first
        out_loc, plan.compress_ratio, plan.is_decode,
    )


class CompressorBackendCompute:
    def forward_indexer_compressor_bf16(self, x, forward_batch, layer_id, compressor) -> None:
        """The c4 indexer's compressor for a bf16 index-K pool: upstream's compress_forward, then
        store_bf16_index_keys_from_plan into the pool's bf16 rows (in place of the fused fp8
        store)."""
        if forward_batch.forward_mode.is_idle():
            return
        ratio, head_dim = compressor.ratio, compressor.head_dim
        plan = self._get_paged_compress_metadata(ratio)
        score_width = 2 * head_dim * (2 if is_overlap_compress(ratio) else 1)
        scores = compressor.get_state_pool(self).kv_score_buffer.kv_score
        compressed = compress_forward(
            kv_score_buffer=scores.view(-1, ratio, score_width),
            kv_score_input=compressor.compute_kv_score(x, forward_batch),
            ape=compressor.ape.view(-1, head_dim),
            plan=plan,
            compress_ratio=ratio,
            head_dim=head_dim,
            is_online=False,
        )
        pool_rows = self.token_to_kv_pool.get_index_k_bf16_buffer(layer_id).view(-1, head_dim)
        store_bf16_index_keys_from_plan(
            pool_rows, compressed, plan, self._get_out_loc(ratio), compressor.norm,
            compressor.freqs_cis,
        )


class DeepseekV4BackendCompute:
    def forward_indexer_compressor(self, x, forward_batch, layer_id, compressor) -> None:
        """The c4 indexer's compressor: bf16 index-K pools store bf16 keys, every other pool takes
        forward_unified (what CompressorBackendMixin names forward_indexer_compressor)."""
        if self.token_to_kv_pool.index_k_dtype_of(layer_id) == "bf16":
            return self.forward_indexer_compressor_bf16(x, forward_batch, layer_id, compressor)
        return self.forward_unified(x, forward_batch, layer_id, compressor)


INDEXER_MODULE = "sglang.srt.layers.attention.dsv4.indexer"
COMPRESSOR_MODULE = "sglang.srt.layers.attention.dsv4.compressor_v2"
BACKEND_MODULE = "sglang.srt.layers.attention.deepseek_v4_backend"
C4_INDEXER = f"{INDEXER_MODULE}.C4Indexer"
C4_INDEXER_BACKEND = f"{INDEXER_MODULE}.C4IndexerBackendMixin"
COMPRESSOR_BACKEND = f"{COMPRESSOR_MODULE}.CompressorBackendMixin"
DSV4_BACKEND = f"{BACKEND_MODULE}.DeepseekV4AttnBackend"

COMPUTE_REPLACES = (
    Replace(
        target=f"{C4_INDEXER}.forward",
        func=C4IndexerCompute.forward,
        signature=(
            "(self, x, q_lora, forward_batch, attn_backend, enable_multi_stream=False, "
            "q_lora_ready=None, skip_compressor=False, q_lora_quant=None)"
        ),
    ),
)
COMPUTE_ADDS = (
    Add(owner=C4_INDEXER, func=C4IndexerCompute.compute_q_bf16),
    Add(owner=INDEXER_MODULE, func=resize_query_rows),
    Add(owner=C4_INDEXER_BACKEND, func=C4IndexerBackendCompute.forward_c4_indexer_bf16),
    Add(owner=C4_INDEXER_BACKEND, func=C4IndexerBackendCompute._c4_topk_transform),
    Add(owner=C4_INDEXER_BACKEND, func=C4IndexerBackendCompute._c4_raw_indices),
    Add(owner=C4_INDEXER_BACKEND, func=C4IndexerBackendCompute._c4_after_topk),
    Add(owner=COMPRESSOR_MODULE, func=store_bf16_index_keys_from_plan),
    Add(owner=COMPRESSOR_BACKEND, func=CompressorBackendCompute.forward_indexer_compressor_bf16),
    # A method of the backend class in front of the mixin's forward_indexer_compressor alias.
    Add(owner=DSV4_BACKEND, func=DeepseekV4BackendCompute.forward_indexer_compressor),
)
COMPUTE_IMPORTS = {
    INDEXER_MODULE: (
        "from sgl_kernel_dsv4.index_logits import bf16_paged_mqa_logits, indexer_rows_per_chunk",
        "from sgl_kernel_dsv4.index_rotation import index_query_bf16",
    ),
    COMPRESSOR_MODULE: ("from sgl_kernel_dsv4.index_rotation import store_index_keys_bf16",),
}
# The kernels travel with the exported patch as new upstream modules.
COMPUTE_NEW_FILES = {
    "sglang.kernels.ops.attention.dsv4.bf16_index_contract": "sgl_kernel_dsv4.index_contract",
    "sglang.kernels.ops.attention.dsv4.bf16_index_logits": "sgl_kernel_dsv4.index_logits",
    "sglang.kernels.ops.attention.dsv4.bf16_index_logits_triton": "sgl_kernel_dsv4.index_logits_triton",
    "sglang.kernels.ops.attention.dsv4.index_rotation": "sgl_kernel_dsv4.index_rotation",
    "sglang.kernels.ops.attention.dsv4.index_rotation_triton": "sgl_kernel_dsv4.index_rotation_triton",
}

FIX = Fix(
    id="index-k-bf16",
    title="bf16 index keys for the DeepSeek-V4 c4 indexer",
    area="dsv4",
    why=(
        "The c4 lightning indexer scores every cached index key (128 values per compressed token, "
        "21 c4 layers in DeepSeek-V4-Flash) and keeps the top 512 for sparse attention. Upstream "
        "0.5.23 stores keys as fp8 e4m3 plus one fp32 scale per 128 values (132 B/token; fp4: 68) "
        "and quantizes the query to fp8; the precision lost there costs long-context recall."
    ),
    how=(
        "SGLANG_DSV4_INDEX_K_DTYPE=fp8|bf16|fp4, default fp8 (upstream's numerics, so installing "
        "the distribution changes nothing silently); fp4 goes with upstream's "
        "--enable-deepseek-v4-fp4-indexer and a contradiction stops start-up. Under bf16 the c4 "
        "indexer pool stores keys as they are: 256 B/token, no scale, in upstream's page rows "
        "(same page count and registration), with bf16 set/get methods on the indexer and token "
        "pools (the getters wait for the layer's HiCache transfer). dsv4_index_k_bytes_per_token "
        "is the one byte rule for every dtype; the pool records its dtype as index_k_dtype. "
        "Compute: C4Indexer.forward sends a layer whose pool is bf16 to forward_c4_indexer_bf16 "
        "(others to upstream's forward_c4_indexer): the query gets RoPE and the Hadamard "
        "rotation but stays bf16, sgl_kernel_dsv4's bf16_paged_mqa_logits scores the pool's "
        "bf16 pages (-inf past each row's seq_len, as upstream's top-k needs; the kernel's "
        "loads and dots follow the keys a row has, not the page table's width), and "
        "upstream's top-k step follows, in row chunks whose temporaries fit a budget "
        "(SGLANG_DSV4_INDEXER_BUDGET_MIB, default 512). Write path: DeepseekV4AttnBackend."
        "forward_indexer_compressor sends bf16 pools through upstream's compress_forward, then "
        "RMSNorm, RoPE and Hadamard rotation in fp32 and a bf16 store into the pool slots that "
        "skips rows completing no token, as upstream does; fp8 pools keep upstream's fused fp8 "
        "store (forward_unified). On CUDA the query, the key store and the logits are one "
        "Triton kernel each (written for sm_120); elsewhere their torch references run."
    ),
    upstream="not upstream",
    remove_when="upstream ships a bf16 (or otherwise lossless) index-K option for DeepSeek-V4.",
    tests=(
        "test/behaviour/test_index_k_pool.py",
        "test/behaviour/test_index_k_dispatch.py",
    ),
    targets=(
        INDEXER_POOL,
        TOKEN_POOL,
        C4_INDEXER,
        C4_INDEXER_BACKEND,
        COMPRESSOR_BACKEND,
        DSV4_BACKEND,
    ),
    replaces=STORAGE_REPLACES + COMPUTE_REPLACES,
    adds=STORAGE_ADDS + COMPUTE_ADDS,
    imports={**STORAGE_IMPORTS, **COMPUTE_IMPORTS},
    new_files=COMPUTE_NEW_FILES,
)
