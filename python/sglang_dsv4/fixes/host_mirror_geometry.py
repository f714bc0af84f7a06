"""host-mirror-geometry: index-K rows outside the device pool (HiCache host mirror, PD peer) keep its geometry.

Register entry
  Target:      sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler._dsv4_indexer_regions
               sglang.srt.mem_cache.memory_pool_host.DeepSeekV4PagedHostPool
               sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool.pd_kv_layout
               sglang.srt.disaggregation.nixl.conn.NixlKVManager._add_remote_peer
               sglang.srt.disaggregation.nixl.conn.NixlKVManager.add_transfer_request
  Why:         Index-K rows leave the device pool for the HiCache host mirror
               (DeepSeekV4PagedHostPool) and for the PD peer's pool; a copy that assumes another row
               than the one stored corrupts keys. Upstream's token-granular HiCache copy
               (transfer_cache_dsv4_mla) addresses 64-token pages of 584-B V4 C4 KV tokens (37,440-B
               pages); neither an fp8 index page (8448 B) nor a bf16 one (16384 B) has that layout.
               On PD, upstream's KV layout names no index-K dtype; prefill bf16 / decode fp8 makes
               upstream's NIXL lists raise inside the prefill bootstrap thread (requests then hang);
               prefill fp8 / decode bf16 is accepted and 8448-B rows land in 16384-B pages.
  How:         HiCache: _dsv4_indexer_regions takes each region's row bytes from the live device
               buffers (one page row, numel x element_size()) for every layout and marks every fused
               index row (fp8 and bf16) whole-page only: fp8 rows are routed to whole pages, not
               proved token by token; a transfer that would need the token-granular copy stops with
               an error naming the row bytes and why. PD: DeepSeekV4TokenToKVPool.pd_kv_layout adds
               each indexer pool's index-K dtype and page-row bytes (c4_index_k=bf16/16384B), so the
               decode's layout check refuses a prefill of another dtype on its first request, before
               any receiver or KV allocation, with one line naming both. A decode without that check
               is refused by the prefill when it registers (item lengths of every paired region
               compared, no NIXL list prepared, one error line naming both index-K dtypes), and each
               room with that peer fails at once with that line as the failure reason decode
               receives and logs.
  Upstream:    upstream 0.5.23 sizes host rows from the live buffers and refuses unaligned transfers
               on page-aligned-only pools, but marks every fused index row token-granular-capable;
               its PD KV layout carries no index-K dtype and PD compares item lengths only for
               PP-heterogeneous MLA. The rest is not upstream
  Remove when: index-k-bf16 is upstream with whole-page-only index rows in the host mirror (or a
               token-granular copy for index rows) and the index-K dtype in the PD KV layout.

How, in detail
  HiCache: the indexer regions take their row bytes from the live device buffers (one
  page row: numel x element_size()) for every layout, and every fused index row
  (fp8 and bf16) is whole-page only (page_aligned_only). fp8 rows are routed to
  whole pages, not proved correct token by token; a transfer that would need the
  token-granular copy stops with an error naming the row bytes and why.
  PD: the index-K dtype and page-row bytes of every indexer pool join the PD KV
  layout (DeepSeekV4TokenToKVPool.pd_kv_layout, e.g. "c4_index_k=bf16/16384B"),
  which the decode compares with the prefill's (upstream's check in
  try_ensure_parallel_info) on its first request to that prefill, before a receiver
  exists or any KV is allocated; a mismatch stops it with one line naming both
  layouts. Second line (a decode without that check): when a decode registers, the
  prefill compares the item length of every region the transfer pairs; a difference
  refuses the pairing (no NIXL list is prepared) with one error line naming both
  index-K dtypes, and every room with that peer fails at once with the same line,
  which decode receives as the room's failure reason and logs.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout
from sglang.srt.disaggregation.common.utils import TransferKVChunk
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _IndexerRegion

from sglang_dsv4.fix import Add, Fix, Replace

_ASSEMBLER = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"
_HOST = "sglang.srt.mem_cache.memory_pool_host"
_POOL = "sglang.srt.mem_cache.deepseek_v4_memory_pool"
_NIXL = "sglang.srt.disaggregation.nixl.conn"

# The replaced NIXL methods log as the module they replace methods of.
logger = logging.getLogger(_NIXL)


def _dsv4_indexer_page_row_groups(pool: Any, page_size: int) -> list:
    """(pool name, per-layer device buffers of page rows, whole pages only) per buffer group of
    the c4 indexer pool."""
    if getattr(pool, "has_npu_storage", False):
        # NPU: int8 K and fp16 scale in separate PA_ND buffers; its transfer path derives the
        # native C4 page geometry from the buffers' shapes.
        return [
            (PoolName.DEEPSEEK_V4_C4_INDEXER, pool.index_k_buffer, False),
            (PoolName.DEEPSEEK_V4_C4_INDEXER_SCALE, pool.index_scale_buffer, False),
        ]
    if not pool.uses_aiter_fp4_layout:
        # One fused row per page, whole pages only whatever the dtype: the token-granular copy
        # (transfer_cache_dsv4_mla) addresses 584-B C4 KV tokens in 37,440-B pages, which is
        # neither an 8448-B fp8 index page (64 x 128 B keys, then 64 x 4 B scales) nor a
        # 16384-B bf16 one.
        return [(PoolName.DEEPSEEK_V4_C4_INDEXER, pool.contiguous_page_row_buffers(), True)]
    import torch

    # ROCm fp4: payload [pages, 1, 4, slots, 16] and ue8m0 scales [pages, 1, 4, slots] group
    # their slots inside a page, so a page row is the only unit that can move.
    slots = {buf.shape[3] for buf in (*pool.index_k_payload_buffer, *pool.index_k_scale_buffer)}
    if len(slots) != 1:
        raise ValueError(f"FP4 indexer payload and scale disagree on slots per page: {slots}")
    (slots_per_page,) = slots
    if page_size % slots_per_page:
        raise ValueError(
            f"tree page size {page_size} is not a multiple of the FP4 indexer's "
            f"{slots_per_page} slots per page"
        )

    def page_rows(buffers):
        return [buf.view(torch.uint8).flatten(1) for buf in buffers]

    return [
        (PoolName.DEEPSEEK_V4_C4_INDEXER, page_rows(pool.index_k_payload_buffer), True),
        (PoolName.DEEPSEEK_V4_C4_INDEXER_SCALE, page_rows(pool.index_k_scale_buffer), True),
    ]


def _dsv4_indexer_regions(kvcache: Any, page_size: int) -> list[_IndexerRegion]:
    """The c4 indexer's HiCache regions. Each host row is one page row of the live device
    buffer, whatever the index-K dtype, so host and device never disagree on its bytes."""
    regions = []
    for name, buffers, whole_pages in _dsv4_indexer_page_row_groups(
        kvcache.c4_indexer_kv_pool, page_size
    ):
        regions.append(
            _IndexerRegion(
                name=name,
                device_buffers=buffers,
                item_bytes=int(buffers[0][0].numel() * buffers[0].element_size()),
                slot_page_size=page_size,
                page_aligned_only=whole_pages,
            )
        )
    return regions


def _unaligned_transfer_error(self, host_indices, device_indices) -> ValueError:
    return ValueError(
        f"{self.pool_name}: refusing a token-granular transfer ({host_indices.numel()} host, "
        f"{device_indices.numel()} device indices; pages hold {self.slot_page_size}). This "
        f"pool's rows ({self.item_bytes} B per page) move only as whole pages: the "
        "token-granular copy transfer_cache_dsv4_mla addresses 584-B V4 C4 KV tokens in "
        "37,440-B pages, not these rows."
    )


def pd_kv_layout(self) -> str:
    """The byte layouts PD peers must share: main KV, each compressed KV, and each indexer
    pool's index keys (dtype and page row bytes), so the decode refuses a prefill of another
    SGLANG_DSV4_INDEX_K_DTYPE before it allocates KV for any of its requests."""
    if self.uniform_fp8:
        kv = [KVLayout.UNIFORM_FP8.value]
    else:
        ratios = sorted(r for r in set(self.compression_ratios) if r != 0)
        kv = [self.kv_layout.value]
        kv += [f"c{r}:{self.compressed_kv_layout(r).value}" for r in ratios]
    index_keys = []
    for ratio, index_pool in sorted(self.index_pools.items()):
        per_slot = index_pool.get_bytes_per_token()  # fixes the pool's dtype if still open
        page_row = per_slot * index_pool.page_size
        index_keys.append(f"c{ratio}_index_k={index_pool.index_k_dtype}/{page_row}B")
    return ",".join(kv + index_keys)


def dsv4_index_k_pairing_refusal(self, peer_info) -> str | None:
    """Why this prefill must not send KV to a newly registered decode peer, or None.

    DeepSeek-V4 peers exchange whole page rows per region, so every region this transfer pairs
    must have the same row bytes on both sides; index-K rows differ when the peers store index
    keys in different dtypes (bf16 256 B per slot, fp8 132 B). Other pools are left to
    upstream's own checks.
    """
    if getattr(self.kv_args, "kv_layout", None) is None:
        return None  # not a DeepSeek-V4 pool
    n_src = len(self.kv_args.kv_item_lens)
    n_dst = len(peer_info.dst_kv_item_lens)
    if n_src == 0 or n_dst < n_src:
        return None  # upstream refuses a peer with fewer regions itself
    dst_indices = self._build_transfer_dst_indices(peer_info=peer_info, n_src=n_src, n_dst=n_dst)
    differing = [
        (self.kv_args.kv_item_lens[i], peer_info.dst_kv_item_lens[j])
        for i, j in enumerate(dst_indices)
        if self.kv_args.kv_item_lens[i] != peer_info.dst_kv_item_lens[j]
    ]
    if not differing:
        return None
    ours, theirs = differing[0]
    slots = self.kv_args.page_size // 4  # c4 index slots per page

    def index_k_dtype(row_bytes):
        # Bytes per slot of each layout (get_dsv4_indexer_bytes_per_token; bf16 is 2 B x 128).
        per_slot, rest = divmod(row_bytes, slots)
        return None if rest else {132: "fp8", 256: "bf16", 68: "fp4"}.get(per_slot)

    ours_dtype, theirs_dtype = index_k_dtype(ours), index_k_dtype(theirs)
    if ours_dtype and theirs_dtype:
        what = (
            f"prefill stores {ours_dtype} index keys ({ours} B per {slots}-slot page), "
            f"decode {peer_info.agent_name} stores {theirs_dtype} ({theirs} B); start both "
            "with the same SGLANG_DSV4_INDEX_K_DTYPE"
        )
    else:
        what = (
            f"a KV region's page row is {ours} B on prefill and {theirs} B on decode "
            f"{peer_info.agent_name}"
        )
    return (
        f"DeepSeek-V4 PD pairing refused: {what} ({len(differing)} region(s) differ); "
        "no KV is sent to this peer"
    )


def _add_remote_peer(self, decode_kv_args):
    peer = decode_kv_args.agent_name
    if peer in self.decode_kv_args_table:
        logger.info(f"Peer {peer} was already registered, ignoring.")
        return
    relayout = self.requires_dcp_relayout(decode_kv_args.dst_dcp_size, decode_kv_args.dst_dcp_rank)
    decode_kv_args.requires_dcp_relayout = relayout
    if relayout:
        self._init_dcp_pack_buffers_once(decode_kv_args.dst_dcp_size)
    self.decode_kv_args_table[peer] = decode_kv_args
    self.agent.add_remote_agent(decode_kv_args.agent_metadata)
    if self.disaggregation_mode != DisaggregationMode.PREFILL:
        return
    self.check_peer_aux_buffer_count(peer, len(decode_kv_args.dst_aux_ptrs))
    # Refuse before any transfer list is prepared: rows of another width would land in the
    # peer's pages shifted, or past them.
    refusal = self.dsv4_index_k_pairing_refusal(decode_kv_args)
    if refusal is not None:
        if not hasattr(self, "dsv4_refused_peers"):
            self.dsv4_refused_peers = {}
        self.dsv4_refused_peers[peer] = refusal
        logger.error(refusal)
        return
    self._prepare_payload_xfer(decode_kv_args)
    self._prepare_state_xfer(decode_kv_args)


def add_transfer_request(
    self,
    bootstrap_room,
    kv_indices,
    index_slice,
    is_last_chunk,
    aux_index=None,
    state_indices=None,
    num_kv_tokens=None,
    *,
    wait_event=None,
    indices_event=None,
    trace_ctx=None,
):
    assert self.disaggregation_mode == DisaggregationMode.PREFILL
    assert not is_last_chunk or aux_index is not None
    # Staging is asked for before the chunk is queued, so decode has allocated it by the time
    # a worker sends (a no-op without staging or heterogeneous-TP peers).
    if self.enable_staging:
        self._prefetch_staging_reqs(bootstrap_room)
    peers = self.transfer_infos.get(bootstrap_room)
    if peers is None:
        return None  # a dummy rank, or the room is cleared already
    refused = getattr(self, "dsv4_refused_peers", {})
    refusal = next((refused[name] for name in peers if name in refused), None)
    if refusal is not None:
        # Decode learns why through the room's failure status and logs it.
        self.conclude_failure(bootstrap_room=bootstrap_room, failure_reason=refusal)
        return None
    # One worker per destination set keeps a room's chunks on one staging buffer.
    worker = sum(info.dst_port for info in peers.values()) % len(self.transfer_queues)
    chunk = TransferKVChunk(
        room=bootstrap_room,
        is_last_chunk=is_last_chunk,
        index_slice=index_slice,
        prefill_kv_indices=kv_indices,
        num_kv_tokens=num_kv_tokens,
        state_indices=state_indices,
        prefill_aux_index=aux_index,
    )
    self.transfer_queues[worker].put(chunk)
    return None


FIX = Fix(
    id="host-mirror-geometry",
    title="index-K rows outside the device pool (HiCache host mirror, PD peer) keep its geometry",
    area="mem_cache",
    why=(
        "Index-K rows leave the device pool for the HiCache host mirror (DeepSeekV4PagedHostPool) "
        "and for the PD peer's pool; a copy that assumes another row than the one stored corrupts "
        "keys. Upstream's token-granular HiCache copy (transfer_cache_dsv4_mla) addresses 64-token "
        "pages of 584-B V4 C4 KV tokens (37,440-B pages); neither an fp8 index page (8448 B) nor "
        "a bf16 one (16384 B) has that layout. On PD, upstream's KV layout names no index-K "
        "dtype; prefill bf16 / decode fp8 makes upstream's NIXL lists raise inside the prefill "
        "bootstrap thread (requests then hang); prefill fp8 / decode bf16 is accepted and "
        "8448-B rows land in 16384-B pages."
    ),
    how=(
        "HiCache: _dsv4_indexer_regions takes each region's row bytes from the live device "
        "buffers (one page row, numel x element_size()) for every layout and marks every fused "
        "index row (fp8 and bf16) whole-page only: fp8 rows are routed to whole pages, not "
        "proved token by token; a transfer that would need the token-granular copy stops with "
        "an error naming the row bytes and why. PD: DeepSeekV4TokenToKVPool.pd_kv_layout adds "
        "each indexer pool's index-K dtype and page-row bytes (c4_index_k=bf16/16384B), so the "
        "decode's layout check refuses a prefill of another dtype on its first request, before "
        "any receiver or KV allocation, with one line naming both. A decode without that check "
        "is refused by the prefill when it registers (item lengths of every paired region "
        "compared, no NIXL list prepared, one error line naming both index-K dtypes), and each "
        "room with that peer fails at once with that line as the failure reason decode "
        "receives and logs."
    ),
    upstream=(
        "upstream 0.5.23 sizes host rows from the live buffers and refuses unaligned transfers "
        "on page-aligned-only pools, but marks every fused index row token-granular-capable; its "
        "PD KV layout carries no index-K dtype and PD compares item lengths only for "
        "PP-heterogeneous MLA. The rest is not upstream"
    ),
    remove_when=(
        "index-k-bf16 is upstream with whole-page-only index rows in the host mirror (or a "
        "token-granular copy for index rows) and the index-K dtype in the PD KV layout."
    ),
    tests=(
        "test/behaviour/test_host_mirror.py",
        "test/behaviour/test_pd_index_k_agreement.py",
    ),
    targets=(
        f"{_ASSEMBLER}._dsv4_indexer_regions",
        f"{_HOST}.DeepSeekV4PagedHostPool",
        f"{_POOL}.DeepSeekV4TokenToKVPool.pd_kv_layout",
        f"{_NIXL}.NixlKVManager._add_remote_peer",
        f"{_NIXL}.NixlKVManager.add_transfer_request",
    ),
    replaces=(
        Replace(
            target=f"{_ASSEMBLER}._dsv4_indexer_regions",
            func=_dsv4_indexer_regions,
            signature="(kvcache, page_size)",
        ),
        Replace(
            target=f"{_HOST}.DeepSeekV4PagedHostPool._unaligned_transfer_error",
            func=_unaligned_transfer_error,
            signature="(self, host_indices, device_indices)",
        ),
        Replace(
            target=f"{_POOL}.DeepSeekV4TokenToKVPool.pd_kv_layout",
            func=pd_kv_layout,
            signature="(self)",
        ),
        Replace(
            target=f"{_NIXL}.NixlKVManager._add_remote_peer",
            func=_add_remote_peer,
            signature="(self, decode_kv_args)",
        ),
        Replace(
            target=f"{_NIXL}.NixlKVManager.add_transfer_request",
            func=add_transfer_request,
            signature=(
                "(self, bootstrap_room, kv_indices, index_slice, is_last_chunk, aux_index=None, "
                "state_indices=None, num_kv_tokens=None, *, wait_event=None, "
                "indices_event=None, trace_ctx=None)"
            ),
        ),
    ),
    adds=(
        Add(owner=_ASSEMBLER, func=_dsv4_indexer_page_row_groups),
        Add(owner=f"{_NIXL}.NixlKVManager", func=dsv4_index_k_pairing_refusal),
    ),
)
