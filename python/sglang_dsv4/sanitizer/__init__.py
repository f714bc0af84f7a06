"""KV / index-K sanitizer for DeepSeek-V4 pools (SGLANG_DSV4_SANITIZE=1): a diagnostic, not a fix.

It catches the silent corruption class (a page read by the wrong request, after it was freed, or
before it was written; a wrong kernel result; a page changed in a PD transfer) as it happens, on a
live server. Off by default; when off the plugin installs nothing (status: "off (0 hooks)").

Modules: ledger (violations, counter, page ledger), checks (the Sanitizer and its host-side
checks), pd and digest (PD transfer digests and their frames), hicache (HiCache host-mirror
digests), sampler (the one decision per forward batch), hooks (the table of upstream targets,
install, describe).

What is checked, where, and what it costs (hooks through upstream's HookRegistry, one process):

  Allocator (PagedTokenToKVPoolAllocator, the DeepSeek-V4 full-page allocator; the c4 KV,
  index-K and c4 state pages share its page ids). Every call, host side, outside any CUDA graph.
  - alloc / alloc_extend / alloc_decode (after): the pages handed out must be free in the
    ledger; a page handed out while live is `double_owner`, reported naming its receiver when a
    row is given or writes it (owners.py). Each
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
  only (SGLANG_DSV4_SANITIZE_SAMPLE, default 0.01; sampler.py draws once per batch); a sampled
  step runs eagerly (the decode CUDA graph runner's can_run_graph says no for it), so nothing
  runs inside a captured region:
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
  Ownership (owners.py), every forward: each row's pages from its table inside its length, its
    writes from out_cache_loc: `foreign_write`, `padded_write`, `early_free` (see there).
  PD transfer (NIXL): page_checksums() digests every buffer the transfer addresses by full page
  id (c4 KV, c4 index-K, c128 KV) per (buffer, page); digest.row_digests says how.
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
  - Decode, CommonKVManager.update_status (after): a room that fails is remembered with its
    pages; when they are freed (poisoned) they are watched, and every allocation first checks
    that each watched page still holds its poison in every poisoned buffer: a byte changed is
    `late_write` naming the room and page (a prefill that transferred into slots its decode
    gave up). Pages handed out leave the watch; at most 8192 are watched. Cost: nothing until a
    room fails, then one compare of the watched pages per allocation.
  A prefill without the sanitizer sends no digests: nothing is checked. A prefill whose pool
  has other buffers (a pipeline stage) is not checked (one warning line). Cost: one digest pass
  over the room's pages on each side (benchmark/sanitizer_cost.py: about 10x copying them) and
  42 x 8 B per page on the status message. Upstream's own checksum
  (--disaggregation-enable-kv-checksum, disaggregation/checksum.py) is not used: one adler32
  digest per request in an 8-wide metadata row, CUDA-only, and on this pool it fails its own
  `state_indices_gpu is not None` assertion (kv_args lists 85 compressed-state buffers while
  state_indices_for_request returns None for DeepSeekV4TokenToKVPool).
  HiCache (hicache.py): DeepSeekV4PagedHostPool.backup_from_device_all_layer (after) digests each
    device page per layer as it leaves for the host mirror, keyed by host page;
    load_to_device_per_layer (after) digests what arrived in the device page and compares, read
    back at the mirror's last layer: each changed (layer, page) is `hicache_checksum` naming the
    region, layer, device page and host page. The mirror's free / clear and the logical anchor's
    free (LogicalHostPool.free) drop digests of pages leaving the mirror. The table is fixed at
    8 B per (layer, host page). With ACTION=abort a changed full page fails each request that
    holds it until it is freed.
  Metrics: every kind of sglang:dsv4_sanitizer_violations_total is created at 0 when the
  sanitizer installs, so a reader sees it is on before any violation.

A violation: one ERROR line "sanitizer violation kind=... request=... layer=... page=... slot=...
expected=... found=...", sglang:dsv4_sanitizer_violations_total{kind} += 1, and with
SGLANG_DSV4_SANITIZE_ACTION=abort the request is failed through upstream's
Req.set_finish_with_abort (the scheduler aborts it at its next step with that message).
"""

from sglang_dsv4.sanitizer import hooks as _hooks_module
from sglang_dsv4.sanitizer.checks import Sanitizer
from sglang_dsv4.sanitizer.digest import (
    PD_DIGEST_TAG,
    c4_layers,
    decode_frames,
    encode_frames,
    page_buffers,
    page_checksums,
)
from sglang_dsv4.sanitizer.hooks import (
    HOOKS,
    INSTALLED,
    Hook,
    bind,
    check_indexer_read,
    describe,
    install,
    install_from_settings,
)
from sglang_dsv4.sanitizer.ledger import KINDS, METRIC_NAME, POISON_BYTE, PageLedger, Violation
from sglang_dsv4.sanitizer.sampler import Sampler

__all__ = [
    "HOOKS",
    "INSTALLED",
    "KINDS",
    "METRIC_NAME",
    "PD_DIGEST_TAG",
    "POISON_BYTE",
    "SANITIZER",
    "Hook",
    "PageLedger",
    "Sampler",
    "Sanitizer",
    "Violation",
    "bind",
    "c4_layers",
    "check_indexer_read",
    "decode_frames",
    "describe",
    "encode_frames",
    "install",
    "install_from_settings",
    "page_buffers",
    "page_checksums",
]


def __getattr__(name):
    # The process's sanitizer is set by install(); read it where install() keeps it.
    if name == "SANITIZER":
        return _hooks_module.SANITIZER
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
