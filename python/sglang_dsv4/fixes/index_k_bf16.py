"""index-k-bf16: bf16 index keys for the DeepSeek-V4 c4 sparse-attention indexer.

Register entry
  Target:      sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4IndexerPool
               sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool
               sglang.srt.layers.attention.dsv4.indexer.forward_c4_indexer
  Why:         The lightning indexer keeps one 128-value key per compressed token of each c4 layer
               (21 in DeepSeek-V4-Flash) and picks the top 512 for sparse attention. Upstream 0.5.23
               stores keys as fp8 e4m3 with one fp32 scale per 128 values (132 B/token; fp4: 68) and
               quantizes the query to fp8 too; the lost precision costs long-context recall.
  How:         SGLANG_DSV4_INDEX_K_DTYPE=fp8|bf16|fp4 (default fp8, upstream's numerics). Under
               bf16 the c4 pool stores the keys as they are: 256 B/token, no scale, same pages.
               One function, dsv4_index_k_bytes_per_token, decides the bytes per indexer token for
               every dtype; the pool allocates by it (and pool-sizing-bf16 prices by it).
  Upstream:    not upstream
  Remove when: upstream ships a bf16 (or otherwise lossless) index-K option for DeepSeek-V4.

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
    and calling `requested_dsv4_index_k_dtype.cache_clear()` (see `sglang_dsv4.plan`).
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

import functools
import os

import torch

# The functions below run with this module's globals: the same names the upstream module imports.
from sglang.srt.runtime_context import get_exec

from sglang_dsv4.register import Add, Fix, Replace

POOL_MODULE = "sglang.srt.mem_cache.deepseek_v4_memory_pool"
INDEXER_POOL = f"{POOL_MODULE}.DeepSeekV4IndexerPool"
TOKEN_POOL = f"{POOL_MODULE}.DeepSeekV4TokenToKVPool"

INDEX_K_DTYPE_ENV = "SGLANG_DSV4_INDEX_K_DTYPE"
INDEX_K_DTYPES = ("fp8", "bf16", "fp4")


# --- storage: functions added to sglang.srt.mem_cache.deepseek_v4_memory_pool ------------------


def parse_dsv4_index_k_dtype(value: str | None) -> str:
    """Normalise a SGLANG_DSV4_INDEX_K_DTYPE value; unset or empty means fp8 (upstream's)."""
    name = (value or "").strip().lower() or "fp8"
    if name not in ("fp8", "bf16", "fp4"):
        raise ValueError(
            f"SGLANG_DSV4_INDEX_K_DTYPE={value!r} is not supported; allowed: fp8, bf16, fp4"
        )
    return name


@functools.lru_cache(maxsize=1)
def requested_dsv4_index_k_dtype() -> str | None:
    """SGLANG_DSV4_INDEX_K_DTYPE as set, None when unset; read once per process.

    Tests that build pools of several dtypes set the variable and call `.cache_clear()`.
    """
    value = os.environ.get("SGLANG_DSV4_INDEX_K_DTYPE", "").strip()
    return parse_dsv4_index_k_dtype(value) if value else None


def resolve_dsv4_index_k_dtype(use_fp4_indexer: bool) -> str:
    """Dtype of an indexer pool's keys: fp4 when upstream's fp4 indexer builds the pool (the flag,
    or a forced low-ratio pool), otherwise the requested fp8 (the default) or bf16."""
    if use_fp4_indexer:
        return "fp4"
    requested = requested_dsv4_index_k_dtype()
    if requested == "fp4":
        raise ValueError(
            "SGLANG_DSV4_INDEX_K_DTYPE=fp4 selects upstream's fp4 indexer: pass "
            "--enable-deepseek-v4-fp4-indexer as well (or leave the variable unset)"
        )
    return requested or "fp8"


def get_dsv4_c4_index_k_dtype() -> str:
    """Dtype the c4 indexer pool of this server stores; refuses a contradictory setting."""
    use_fp4_indexer = get_exec().kernel.enable_deepseek_v4_fp4_indexer
    requested = requested_dsv4_index_k_dtype()
    if use_fp4_indexer and requested not in (None, "fp4"):
        raise ValueError(
            f"SGLANG_DSV4_INDEX_K_DTYPE={requested} contradicts --enable-deepseek-v4-fp4-indexer, "
            "which stores fp4 index keys; drop one of the two"
        )
    return resolve_dsv4_index_k_dtype(use_fp4_indexer)


def dsv4_index_k_bytes_per_token(index_head_dim: int, index_k_dtype: str) -> int:
    """Bytes one compressed token's index key takes in an indexer pool (payload + scales).

    The one rule for allocation and sizing. At index_head_dim 128: bf16 256, fp8 132, fp4 68.
    """
    if index_k_dtype == "bf16":
        return 2 * index_head_dim  # the key as computed, no scale
    if index_k_dtype == "fp8":
        # e4m3 values, then one fp32 scale for every 128 of them
        return index_head_dim + 4 * (index_head_dim // 128)
    if index_k_dtype == "fp4":
        # two e2m1 values per byte, then one ue8m0 scale byte for every 32 of them
        return index_head_dim // 2 + index_head_dim // 32
    raise ValueError(f"unknown DeepSeek-V4 index-K dtype {index_k_dtype!r}")


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
        "is the one byte rule for every dtype; the pool records its dtype as index_k_dtype."
    ),
    upstream="not upstream",
    remove_when="upstream ships a bf16 (or otherwise lossless) index-K option for DeepSeek-V4.",
    targets=(
        INDEXER_POOL,
        TOKEN_POOL,
        "sglang.srt.layers.attention.dsv4.indexer.forward_c4_indexer",
    ),
    replaces=STORAGE_REPLACES,
    adds=STORAGE_ADDS,
    imports=STORAGE_IMPORTS,
)
