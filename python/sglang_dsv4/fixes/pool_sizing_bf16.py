"""pool-sizing-bf16: price the DeepSeek-V4 indexer as it is stored and size the pools exactly.

Register entry
  Target:      sglang.srt.mem_cache.deepseek_v4_memory_pool.get_dsv4_indexer_bytes_per_token
               sglang.srt.model_executor.pool_configurator.DSV4PoolConfigurator
  Why:         DSV4PoolConfigurator prices the c4 indexer with the fp8 estimate (132 B/token; fp4
               only on HIP) whatever the pool stores. A bf16 pool (256 B/token) is under-budgeted by
               124 B per c4 token: 1.1 GB (1.02 GiB) per rank over-committed at a KV budget of 13.7
               GiB per rank, 3.44 GiB at 40 GiB (DeepSeek-V4-Flash, TP 4, decode, 256 requests), and
               output corrupted under 60+ concurrent sessions. 7086.75 B per full token priced,
               7737.75 stored (21 c4 layers x 124 B / compress ratio 4 = 651 more). The NVIDIA fp4
               indexer (68 B/token) was priced as fp8 as well, reserving memory it never used.
               Beyond the price, the configurator leaves uncounted one reserved logical page per
               paged pool and layer (SWA, c4 KV, c4 indexer, c128 KV) and the ring + 1 padded rows
               of each c4 state pool: 17,298,432 B per rank with fp8 keys, 17,965,056 B with bf16,
               whatever the budget; at 40 GiB the pools took 11,416,128 B (fp8) / 16,616,640 B
               (bf16) more than the budget.
  How:         DSV4PoolConfigurator._get_bytes_per_full_token, which __init__ calls right after its
               fp8 estimate, first re-prices the c4 indexer (c4_indexer_bytes_per_token) with the
               rule the pool allocates by (dsv4_index_k_bytes_per_token, for the dtype the c4 pool
               will store). get_dsv4_indexer_bytes_per_token delegates to the same rule, so there is
               one formula; the fp4 low-ratio pools stay priced and built as upstream has them.
               DSV4PoolConfigurator.calculate_pool_sizes searches the largest page count whose pools
               fit the budget, counted by exact_pool_bytes (every page and state row the paged pools
               and an MTP draft's SWA pool allocate, for the request slots the scheduler will settle
               on): allocation <= budget, and budget - allocation < one more page of every pool.
               Layouts it does not cover (unified ring, trtllm, NPU, HiSparse, encoder replay,
               online c128, ratio 1/2 layers) keep upstream's estimate.
  Upstream:    not upstream
  Remove when: upstream's configurator takes the indexer's bytes from the pool's own rule and sizes
               its pools by what they allocate.
"""

from __future__ import annotations

from sglang.srt.model_executor.pool_configurator import (
    MemoryPoolConfig,
    _get_dsv4_compress_state_dtype_sizes,
    _is_npu,
    ceil_div,
    envs,
    get_exec,
    get_spec,
    logger,
)

from sglang_dsv4.fix import Add, Fix, Replace
from sglang_dsv4.fixes.index_k_bf16 import (
    POOL_MODULE,
    dsv4_index_k_bytes_per_token,
    get_dsv4_c4_index_k_dtype,
)

CONFIGURATOR_MODULE = "sglang.srt.model_executor.pool_configurator"
CONFIGURATOR = f"{CONFIGURATOR_MODULE}.DSV4PoolConfigurator"


def get_dsv4_indexer_bytes_per_token(index_head_dim: int, use_fp4_indexer: bool) -> int:
    """Bytes of one compressed indexer token, fp4 or fp8 (see dsv4_index_k_bytes_per_token)."""
    return dsv4_index_k_bytes_per_token(index_head_dim, "fp4" if use_fp4_indexer else "fp8")


class ConfiguratorSizing:
    """What this fix replaces in / adds to DSV4PoolConfigurator."""

    def c4_indexer_bytes_per_token(self) -> int:
        """Bytes one c4 indexer token takes in the pool this server builds."""
        return dsv4_index_k_bytes_per_token(self.indexer_head_dim, get_dsv4_c4_index_k_dtype())

    def _get_bytes_per_full_token(self) -> float:
        # __init__ priced the c4 indexer with the fp8 estimate just before asking for this
        # price; charge what the c4 pool will actually store instead.
        self.indexer_bytes_per_token = self.c4_indexer_bytes_per_token()
        # Ring and cap modes hold SWA (and the c4 state after it) as fixed bytes instead.
        swa_is_fixed = self._unified or self.swa_cap_tokens is not None
        per_token_swa = 0 if swa_is_fixed else self.swa_ratio * self.bytes_per_swa_token
        compressed = sum(
            self._compressed_bytes_per_full_token(ratio) * len(owner_layers)
            for ratio, owner_layers in self.stage_owner_layers.items()
        )
        return per_token_swa + compressed

    def scheduler_max_running_requests(self, full_tokens: int) -> int:
        """The request slots per worker the scheduler will settle on for `full_tokens`.

        KVCacheConfigurator.resolve_max_num_reqs decides it after sizing: the operator's
        --max-running-requests (per attention-DP worker), else a context-length estimate kept
        within [2048, 4096]; never more than half the tokens.
        """
        requested = self.requested_max_running_requests_per_worker
        if requested is None:
            by_context = int(full_tokens / self.context_len * 512)
            requested = min(4096, max(2048, by_context))
        return min(requested, full_tokens // 2)

    def exact_pool_bytes(self, full_tokens: int, max_running_requests: int):
        """Bytes the paged DeepSeekV4TokenToKVPool (and an MTP draft's pool) allocate for
        `full_tokens` and `max_running_requests`, or None for a layout this does not cover.

        Counts what the coefficient leaves out: the padding page every paged pool reserves
        (`_num_dsv4_physical_kv_pages`), page rounding of the SWA pool, the `ring + 1` rows and
        ratio padding of every compress-state pool, and the request slots of the c128 state as
        the scheduler will size them.
        """
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import (
            ONLINE_C128,
            _num_dsv4_physical_kv_pages,
            resolve_compressed_kv_layout,
            select_dsv4_kv_layout,
            uses_draft_swa_ring,
        )
        from sglang.srt.runtime_context import get_platform

        covered = not (
            self._unified
            or _is_npu
            or get_exec().kernel.dsv4_attn_backend == "trtllm"
            or self.encoder_replay
            or self.c4_shrink_factor != 1
            or ONLINE_C128
            or uses_draft_swa_ring()
            or set(self.stage_owner_layers) - {4, 128}
            or (self.is_speculative and not get_spec().speculative_algorithm == "EAGLE")
        )
        if not covered:
            return None
        page = self.page_size
        layout, compressed_option = select_dsv4_kv_layout()

        def paged_bytes(tokens: int, pool_page: int, page_bytes: int) -> int:
            return _num_dsv4_physical_kv_pages(tokens, pool_page, page) * page_bytes

        def state_bytes(rows: int, ring: int, pad_to: int, row_bytes: int) -> int:
            return ceil_div(rows + ring + 1, pad_to) * pad_to * row_bytes

        swa_tokens = self._get_swa_tokens(full_tokens, page)
        direct_swa = get_platform().is_sm120 and envs.SGLANG_OPT_SM120_DIRECT_SWA_KV.get()
        swa_page = 64 if direct_swa else page
        swa_layer_bytes = paged_bytes(swa_tokens, swa_page, layout.page_bytes(swa_page))
        total = swa_layer_bytes * self.num_layers_total
        if self.is_speculative:
            # The MTP draft worker's pool: SWA only, over its one layer, same sizes.
            total += swa_layer_bytes

        c4_state_size, c128_state_size = _get_dsv4_compress_state_dtype_sizes()
        num_req_slots = self._get_num_req_slots(max_running_requests)
        c128_tokens = full_tokens // 128
        for ratio, layers in self.stage_owner_layers.items():
            ratio_page = page // ratio
            ratio_layout = resolve_compressed_kv_layout(layout, ratio, compressed_option)
            kv_tokens = full_tokens // (4 * self.c4_shrink_factor) if ratio == 4 else c128_tokens
            per_layer = paged_bytes(kv_tokens, ratio_page, ratio_layout.page_bytes(ratio_page))
            ring = self.ring_sizes[ratio]
            if ratio == 4:
                # The indexer holds c128_size * 32 slots (c4_logical_size), not c4_size.
                per_layer += paged_bytes(
                    c128_tokens * 32, ratio_page, ratio_page * self.indexer_bytes_per_token
                )
                c4_state_rows = swa_tokens // page * ring
                for head_dim in (self.attn_head_dim, self.indexer_head_dim):
                    per_layer += state_bytes(c4_state_rows, ring, 4, 4 * head_dim * c4_state_size)
            else:
                per_layer += state_bytes(
                    num_req_slots * ring, ring, 128, 2 * self.attn_head_dim * c128_state_size
                )
            total += per_layer * len(layers)
        return total

    def calculate_pool_sizes(self, available_bytes: int, page_size: int) -> MemoryPoolConfig:
        """The most full-token pages whose pools fit `available_bytes`, counted exactly.

        Where exact_pool_bytes covers the layout, the pools take at most `available_bytes` and
        leave less than one more page of every pool unused; elsewhere the bytes are estimated
        as before: fixed request-scoped pools, plus the coefficient, plus reserved pages.
        """
        assert page_size % 128 == 0, "DeepSeek-V4 compressed attention needs page_size % 128 == 0"
        estimated_requests = self._resolve_max_running_requests_per_worker(available_bytes)
        fixed_bytes = (
            self._get_c128_state_fixed_bytes(estimated_requests)
            + self._get_c2_state_fixed_bytes(estimated_requests)
            + self._get_swa_fixed_bytes()
            + self._fixed_swa_bytes(estimated_requests)
            + self._fixed_c4_state_bytes(estimated_requests)
        )

        def pool_bytes(full_tokens: int) -> float:
            exact = self.exact_pool_bytes(
                full_tokens, self.scheduler_max_running_requests(full_tokens)
            )
            if exact is not None:
                return exact
            return (
                fixed_bytes
                + full_tokens * self.bytes_per_full_token
                + self._get_low_ratio_kv_padding_bytes(full_tokens)
            )

        # Bytes grow with the pages; find the last page count that fits.
        fits, too_many = 0, int(available_bytes / self.bytes_per_full_token) // page_size + 2
        while pool_bytes(too_many * page_size) <= available_bytes:
            too_many *= 2
        while too_many - fits > 1:
            middle = (fits + too_many) // 2
            if pool_bytes(middle * page_size) <= available_bytes:
                fits = middle
            else:
                too_many = middle
        full_token = fits * page_size
        if full_token <= 0 and self.swa_cap_tokens is not None:
            raise RuntimeError(
                f"{available_bytes / (1 << 30):.2f} GiB cannot hold the DeepSeek-V4 SWA pool "
                f"cap ({self.swa_cap_tokens} tokens) and one page of the full KV pool. Lower "
                "--max-running-requests or --swa-prefix-tails, or raise --mem-fraction-static."
            )
        sizes = self._compute_dsv4_sizes(full_token, page_size)
        logger.info(
            "DSV4 memory calculation: available_bytes=%.2f GB, bytes_per_full_token=%.2f, "
            "pool_bytes=%d (exact=%s), full_token=%d",
            available_bytes / (1 << 30),
            self.bytes_per_full_token,
            pool_bytes(full_token),
            self.exact_pool_bytes(full_token, self.scheduler_max_running_requests(full_token))
            is not None,
            full_token,
        )
        return self._to_config(sizes)


FIX = Fix(
    id="pool-sizing-bf16",
    title="price the DeepSeek-V4 indexer as it is stored and size the pools exactly",
    area="model_executor",
    why=(
        "DSV4PoolConfigurator prices the c4 indexer with the fp8 estimate (132 B/token; fp4 only "
        "on HIP) whatever the pool stores. A bf16 pool (256 B/token) is under-budgeted by 124 B "
        "per c4 token: 1.1 GB (1.02 GiB) per rank over-committed at a KV budget of 13.7 GiB per "
        "rank, 3.44 GiB at 40 GiB (DeepSeek-V4-Flash, TP 4, decode, 256 requests), and output "
        "corrupted under 60+ concurrent sessions. 7086.75 B per full token priced, 7737.75 stored "
        "(21 c4 layers x 124 B / compress ratio 4 = 651 more). The NVIDIA fp4 indexer (68 "
        "B/token) was priced as fp8 as well, reserving memory it never used. Beyond the price, "
        "the configurator leaves uncounted one reserved logical page per paged pool and layer "
        "(SWA, c4 KV, c4 indexer, c128 KV) and the ring + 1 padded rows of each c4 state pool: "
        "17,298,432 B per rank with fp8 keys, 17,965,056 B with bf16, whatever the budget; at 40 "
        "GiB the pools took 11,416,128 B (fp8) / 16,616,640 B (bf16) more than the budget."
    ),
    how=(
        "DSV4PoolConfigurator._get_bytes_per_full_token, which __init__ calls right after its fp8 "
        "estimate, first re-prices the c4 indexer (c4_indexer_bytes_per_token) with the rule the "
        "pool allocates by (dsv4_index_k_bytes_per_token, for the dtype the c4 pool will store). "
        "get_dsv4_indexer_bytes_per_token delegates to the same rule, so there is one formula; "
        "the fp4 low-ratio pools stay priced and built as upstream has them. "
        "DSV4PoolConfigurator.calculate_pool_sizes searches the largest page count whose pools "
        "fit the budget, counted by exact_pool_bytes (every page and state row the paged pools "
        "and an MTP draft's SWA pool allocate, for the request slots the scheduler will settle "
        "on): allocation <= budget, and budget - allocation < one more page of every pool. "
        "Layouts it does not cover (unified ring, trtllm, NPU, HiSparse, encoder replay, online "
        "c128, ratio 1/2 layers) keep upstream's estimate."
    ),
    upstream="not upstream",
    remove_when=(
        "upstream's configurator takes the indexer's bytes from the pool's own rule and sizes "
        "its pools by what they allocate."
    ),
    tests=("test/behaviour/test_pool_sizing.py",),
    targets=(
        f"{POOL_MODULE}.get_dsv4_indexer_bytes_per_token",
        CONFIGURATOR,
    ),
    replaces=(
        Replace(
            target=f"{POOL_MODULE}.get_dsv4_indexer_bytes_per_token",
            func=get_dsv4_indexer_bytes_per_token,
            signature="(index_head_dim, use_fp4_indexer)",
        ),
        Replace(
            target=f"{CONFIGURATOR}._get_bytes_per_full_token",
            func=ConfiguratorSizing._get_bytes_per_full_token,
            signature="(self)",
        ),
        Replace(
            target=f"{CONFIGURATOR}.calculate_pool_sizes",
            func=ConfiguratorSizing.calculate_pool_sizes,
            signature="(self, available_bytes, page_size)",
        ),
    ),
    adds=(
        Add(owner=CONFIGURATOR, func=ConfiguratorSizing.c4_indexer_bytes_per_token),
        Add(owner=CONFIGURATOR, func=ConfiguratorSizing.scheduler_max_running_requests),
        Add(owner=CONFIGURATOR, func=ConfiguratorSizing.exact_pool_bytes),
    ),
    imports={
        CONFIGURATOR_MODULE: (
            "from sglang.srt.mem_cache.deepseek_v4_memory_pool import "
            "dsv4_index_k_bytes_per_token, get_dsv4_c4_index_k_dtype",
        ),
    },
)
