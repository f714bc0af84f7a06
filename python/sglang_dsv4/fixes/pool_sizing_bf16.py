"""pool-sizing-bf16: price the DeepSeek-V4 indexer as it is stored, with one byte-size rule.

Register entry
  Target:      sglang.srt.mem_cache.deepseek_v4_memory_pool.get_dsv4_indexer_bytes_per_token
               sglang.srt.model_executor.pool_configurator.DSV4PoolConfigurator
  Why:         DSV4PoolConfigurator prices the c4 indexer with the fp8 estimate (132 B/token; fp4
               only on HIP) whatever the pool stores. A bf16 pool (256 B/token) is under-budgeted
               by 124 B per c4 token: about 1.1 GB per rank over-committed in production, and output
               corrupted under 60+ concurrent sessions. DeepSeek-V4-Flash, TP 4, decode, page 256:
               7086.75 B per full token priced, 7737.75 stored (21 x 124 / 4 = 651 more). On
               NVIDIA the fp4 indexer (68 B/token) was priced as fp8 too: over-reserved, not unsafe.
  How:         The configurator's full-token price (_get_bytes_per_full_token, computed in its
               __init__ right after the fp8 estimate) first re-prices the c4 indexer with
               c4_indexer_bytes_per_token: index-k-bf16's dsv4_index_k_bytes_per_token for the dtype
               the c4 pool will store (get_dsv4_c4_index_k_dtype). get_dsv4_indexer_bytes_per_token
               (still used for the fp4 low-ratio pools, which stay as upstream has them) delegates to
               the same rule, so the formula exists once.
  Upstream:    not upstream
  Remove when: upstream's configurator takes the indexer's bytes from the pool's own rule.
"""

from __future__ import annotations

from sglang_dsv4.fixes.index_k_bf16 import (
    POOL_MODULE,
    dsv4_index_k_bytes_per_token,
    get_dsv4_c4_index_k_dtype,
)
from sglang_dsv4.register import Add, Fix, Replace

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


FIX = Fix(
    id="pool-sizing-bf16",
    title="price the DeepSeek-V4 indexer as it is stored",
    area="model_executor",
    why=(
        "DSV4PoolConfigurator prices the c4 indexer with the fp8 estimate (132 B/token; fp4 only "
        "on HIP) whatever the pool stores. A bf16 pool (256 B/token) is under-budgeted by 124 B "
        "per c4 token: about 1.1 GB per rank over-committed in production, and output corrupted "
        "under 60+ concurrent sessions. DeepSeek-V4-Flash at TP 4, decode, page 256: 7086.75 B "
        "per full token priced, 7737.75 stored (21 x 124 / 4 = 651 more). The NVIDIA fp4 indexer "
        "(68 B/token) was priced as fp8 as well, reserving memory it never used."
    ),
    how=(
        "DSV4PoolConfigurator._get_bytes_per_full_token, which __init__ calls right after its fp8 "
        "estimate, first re-prices the c4 indexer (c4_indexer_bytes_per_token) with the rule the "
        "pool allocates by (dsv4_index_k_bytes_per_token, for the dtype the c4 pool will store). "
        "get_dsv4_indexer_bytes_per_token delegates to the same rule, so there is one formula; "
        "the fp4 low-ratio pools stay priced and built as upstream has them."
    ),
    upstream="not upstream",
    remove_when="upstream's configurator takes the indexer's bytes from the pool's own rule.",
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
    ),
    adds=(Add(owner=CONFIGURATOR, func=ConfiguratorSizing.c4_indexer_bytes_per_token),),
    imports={
        CONFIGURATOR_MODULE: (
            "from sglang.srt.mem_cache.deepseek_v4_memory_pool import "
            "dsv4_index_k_bytes_per_token, get_dsv4_c4_index_k_dtype",
        ),
    },
)
