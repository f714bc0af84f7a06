"""Where the checks hook into upstream: one table of (target, hook type, adapter), installed
through upstream's HookRegistry by install() when SGLANG_DSV4_SANITIZE=1.

Each adapter receives the sanitizer first and then what upstream's HookRegistry wrapper passes
(AFTER: result, self, args; BEFORE: self, args; AROUND: the original, self, args). An adapter
never raises into serving: a check that fails internally is logged (see `_guarded`).
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass

import torch

from sglang_dsv4.sanitizer.checks import Sanitizer
from sglang_dsv4.sanitizer.digest import PD_DIGEST_TAG
from sglang_dsv4.sanitizer.ledger import KINDS, _violation_counter

logger = logging.getLogger("sglang_dsv4.sanitizer")

_ALLOCATOR = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator"
_SWA_ALLOCATOR = "sglang.srt.mem_cache.allocator.swa.SWATokenToKVPoolAllocator"
_REQ_POOL = "sglang.srt.mem_cache.memory_pool.ReqToTokenPool"
# A PD decode server's request table: its own class, not a ReqToTokenPool.
_DECODE_REQ_POOL = "sglang.srt.disaggregation.decode.DecodeReqToTokenPool"
_TOKEN_POOL = "sglang.srt.mem_cache.deepseek_v4_memory_pool.DeepSeekV4TokenToKVPool"
_INDEXER_BACKEND = "sglang.srt.layers.attention.dsv4.indexer.C4IndexerBackendMixin"
_C4_INDEXER = "sglang.srt.layers.attention.dsv4.indexer.C4Indexer"
_BACKEND = "sglang.srt.layers.attention.deepseek_v4_backend.DeepseekV4AttnBackend"
_DECODE_GRAPH_RUNNER = (
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
)
_CONFIGURATOR = "sglang.srt.model_executor.pool_configurator.DSV4PoolConfigurator"
_CHUNK = "sglang.srt.disaggregation.common.utils.TransferKVChunk"
_NIXL_MANAGER = "sglang.srt.disaggregation.nixl.conn.NixlKVManager"
_PREFIX_CACHE = "sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache"
_RADIX_CACHE = "sglang.srt.mem_cache.radix_cache.RadixCache"
_UNIFIED_RADIX_CACHE = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
# The status messages' builder and parser, which NixlKVManager inherits.
_COMMON_MANAGER = "sglang.srt.disaggregation.common.conn.CommonKVManager"
# HiCache's host mirror of every DeepSeek-V4 paged region.
_HOST_POOL = "sglang.srt.mem_cache.memory_pool_host.DeepSeekV4PagedHostPool"
# The logical anchor the c4 / c128 mirrors take their host indices from (and are freed through).
_HOST_ANCHOR = "sglang.srt.mem_cache.memory_pool_host.LogicalHostPool"

SANITIZER: Sanitizer | None = None  # this process's sanitizer, when installed
INSTALLED: list[str] = []  # the targets hooked in this process


def _guarded(check):
    """Run a check; an error in the sanitizer itself is logged, never raised into serving."""

    def run(*args, **kwargs):
        try:
            return check(*args, **kwargs)
        except Exception:
            logger.exception("sanitizer: a check failed internally (serving continues)")
            return None

    return run


@functools.cache
def _signature(target: str) -> inspect.Signature:
    from sglang_dsv4.hooks import resolve

    return inspect.signature(resolve(target)[2])


def _args(target: str, self, args, kwargs) -> dict:
    """A call's arguments by upstream's parameter names, however they were passed."""
    return _signature(target).bind_partial(self, *args, **kwargs).arguments


# --- adapters ------------------------------------------------------------------------------------


def after_alloc(san, result, self, *args, **kwargs):
    san.on_alloc(self, result)


def after_alloc_extend(san, result, self, *args, **kwargs):
    last_loc = _args(f"{_ALLOCATOR}.alloc_extend", self, args, kwargs).get("last_loc")
    san.on_alloc(self, result, last_loc)


def after_alloc_decode(san, result, self, *args, **kwargs):
    last_loc = _args(f"{_ALLOCATOR}.alloc_decode", self, args, kwargs).get("last_loc")
    san.on_alloc(self, result, last_loc)


def before_release(san, self, *page_ids):
    for ids in page_ids:
        _guarded(san.on_release)(self, ids)


def after_req_alloc(san, result, self, reqs):
    san.watch_req_pool(self)
    san.on_rows(reqs, result)


def _releasing(san, run, row, args, kwargs):
    """Run a release with `row` named as the request whose pages it frees."""
    outer, san.freeing_row = san.freeing_row, row
    try:
        return run(*args, **kwargs)
    finally:
        san.freeing_row = outer


def around_free_kv_row(san, run, self, kv, *args, **kwargs):
    # Every request release frees its row's pages here (release_kv_cache, overallocation).
    return _releasing(san, run, getattr(kv, "req_pool_idx", None), (self, kv, *args), kwargs)


def around_checkpoint(san, run, self, req, *args, **kwargs):
    # Inserting into the tree frees the request's own copies of pages the tree already had.
    row = getattr(getattr(req, "kv", None), "req_pool_idx", None)
    return _releasing(san, run, row, (self, req, *args), kwargs)


def after_clear(san, result, self):
    san.on_clear(self)


def after_swa_allocator(san, result, self, *args, **kwargs):
    full = getattr(self, "full_attn_allocator", None)
    if hasattr(full, "num_pages"):  # paged: DeepSeek-V4's full pages live here
        san.track(full, self._kvcache)


def after_req_write(san, result, self, indices, values):
    ledger = next(iter(san.ledgers.values()), None)
    if ledger is not None:
        san.on_row_write(indices, values, ledger.page_size)


def after_req_free_rows(san, result, self, indices):
    san.on_rows_freed(indices)


def before_decode_req_free(san, self, req):
    san.on_rows_freed([req.kv.req_pool_idx])


def after_index_k_write(san, result, self, layer_id, loc, *args, **kwargs):
    san.on_index_k_write(self, layer_id, loc)


def after_q_bf16(san, result, self, *args, **kwargs):
    if san.sampler.sampled:
        san._query[self.layer_id] = result  # (q [T, H, D] bf16, weights [T, H])
    return result


def after_indexer(san, result, self, *args, **kwargs):
    a = _args(f"{_INDEXER_BACKEND}.forward_c4_indexer", self, args, kwargs)
    check_indexer_read(san, self, a["c4_indexer"], a["forward_batch"])


def after_metadata(san, result, self, forward_batch):
    # An eager forward: the batch's sampling decision (drawn here unless can_run_graph drew it).
    san.begin_forward(forward_batch)


def around_can_run_graph(san, run, self, forward_batch):
    # A sampled step runs eagerly, so the checks never run inside a captured region.
    if not run(self, forward_batch):
        return False
    return not _guarded(san.begin_forward)(forward_batch)


def after_configurator(san, result, self, *args, **kwargs):
    san.priced_index_bytes = getattr(self, "indexer_bytes_per_token", None)


def after_token_pool(san, result, self, *args, **kwargs):
    san.watch_pool(self)
    san.check_over_commit(self, san.priced_index_bytes)


def after_chunk(san, result, self, *args, **kwargs):
    if self.wait_event is not None:  # early send: the KV is final once this event is
        self.wait_event.synchronize()
    san.on_chunk_queued(
        self.room, self.prefill_kv_indices, self.index_slice, getattr(self, "state_indices", None)
    )


def after_encode_status(san, result, self, *, bootstrap_room, status, failure_reason):
    from sglang.srt.disaggregation.base.conn import KVPoll

    # After the reason frame, which upstream's parser reads as the last one it knows: a decode
    # without the sanitizer ignores the extra frames.
    frames = _guarded(san.digest_frames)(bootstrap_room) or []
    if int(status) != int(KVPoll.Success) or not self.kv_status_msg_carries_reason:
        return None
    return result + frames if frames else None


def after_metadata_message(san, result, self, **kwargs):
    if not kwargs.get("is_dummy"):
        san.on_receiver_pages(
            kwargs["bootstrap_room"], kwargs["kv_indices"], kwargs.get("state_indices")
        )


def after_parse_status(san, result, self, msg):
    from sglang.srt.disaggregation.base.conn import KVPoll

    if result is None or int(result[1]) != int(KVPoll.Success) or PD_DIGEST_TAG not in msg:
        return None
    room, _, prefill_rank, _ = result
    line = _guarded(san.check_arrival)(room, msg[msg.index(PD_DIGEST_TAG) :])
    if line is not None and san.action == "abort":
        # The room fails through upstream's status path, with the violation as its reason.
        return room, KVPoll.Failed, prefill_rank, f"DeepSeek-V4 sanitizer: {line}"
    return None


def after_update_status(san, result, self, bootstrap_room, status):
    from sglang.srt.disaggregation.base.conn import KVPoll

    if status == KVPoll.Failed:
        san.on_room_failed(bootstrap_room)


def after_host_backup(san, result, self, *args, **kwargs):
    a = _args(f"{_HOST_POOL}.backup_from_device_all_layer", self, args, kwargs)
    san.on_host_backup(self, a["host_indices"], a["device_indices"])


def after_host_load(san, result, self, *args, **kwargs):
    a = _args(f"{_HOST_POOL}.load_to_device_per_layer", self, args, kwargs)
    san.on_host_load(self, a["host_indices"], a["device_indices"], a["layer_id"])


def after_host_free(san, result, self, indices):
    san.on_host_free(self, indices)


def after_host_clear(san, result, self):
    san.on_host_clear(self)


def after_anchor_free(san, result, self, indices):
    san.on_anchor_free(self, indices)


@dataclass(frozen=True)
class Hook:
    target: str
    type: str  # upstream's HookType name: AFTER, BEFORE or AROUND
    adapter: object
    # Installed only where the target exists: the index-k-bf16 fix adds these.
    optional: bool = False
    # Whether the adapter's own failure is caught here (False: it guards itself, or returns
    # what upstream's wrapper passes on).
    guarded: bool = True


HOOKS: tuple[Hook, ...] = (
    Hook(f"{_ALLOCATOR}.alloc", "AFTER", after_alloc),
    Hook(f"{_ALLOCATOR}.alloc_extend", "AFTER", after_alloc_extend),
    Hook(f"{_ALLOCATOR}.alloc_decode", "AFTER", after_alloc_decode),
    Hook(f"{_ALLOCATOR}._release_page_ids", "BEFORE", before_release, guarded=False),
    Hook(f"{_ALLOCATOR}.clear", "AFTER", after_clear),
    Hook(f"{_SWA_ALLOCATOR}.__init__", "AFTER", after_swa_allocator),
    Hook(f"{_REQ_POOL}.alloc", "AFTER", after_req_alloc),
    Hook(f"{_REQ_POOL}.write", "AFTER", after_req_write),
    Hook(f"{_REQ_POOL}.free_rows", "AFTER", after_req_free_rows),
    Hook(f"{_PREFIX_CACHE}.free_kv_row", "AROUND", around_free_kv_row, guarded=False),
    Hook(f"{_RADIX_CACHE}.checkpoint", "AROUND", around_checkpoint, guarded=False),
    Hook(f"{_UNIFIED_RADIX_CACHE}.checkpoint", "AROUND", around_checkpoint, guarded=False),
    Hook(f"{_DECODE_REQ_POOL}.alloc", "AFTER", after_req_alloc),
    Hook(f"{_DECODE_REQ_POOL}.write", "AFTER", after_req_write),
    Hook(f"{_DECODE_REQ_POOL}.free", "BEFORE", before_decode_req_free),
    Hook(f"{_TOKEN_POOL}.set_index_k_fused", "AFTER", after_index_k_write),
    Hook(f"{_TOKEN_POOL}.set_index_k_fp4", "AFTER", after_index_k_write),
    Hook(f"{_INDEXER_BACKEND}.forward_c4_indexer", "AFTER", after_indexer),
    Hook(f"{_BACKEND}.init_forward_metadata", "AFTER", after_metadata),
    Hook(f"{_DECODE_GRAPH_RUNNER}.can_run_graph", "AROUND", around_can_run_graph, guarded=False),
    Hook(f"{_CONFIGURATOR}.__init__", "AFTER", after_configurator),
    Hook(f"{_TOKEN_POOL}.__init__", "AFTER", after_token_pool),
    Hook(f"{_CHUNK}.__init__", "AFTER", after_chunk),
    Hook(
        f"{_COMMON_MANAGER}._encode_kv_status_message", "AFTER", after_encode_status, guarded=False
    ),
    Hook(f"{_NIXL_MANAGER}.build_receiver_metadata_message", "AFTER", after_metadata_message),
    Hook(f"{_COMMON_MANAGER}.parse_kv_status_message", "AFTER", after_parse_status, guarded=False),
    Hook(f"{_COMMON_MANAGER}.update_status", "AFTER", after_update_status),
    Hook(f"{_HOST_POOL}.backup_from_device_all_layer", "AFTER", after_host_backup),
    Hook(f"{_HOST_POOL}.load_to_device_per_layer", "AFTER", after_host_load),
    Hook(f"{_HOST_POOL}.free", "AFTER", after_host_free),
    Hook(f"{_HOST_POOL}.clear", "AFTER", after_host_clear),
    Hook(f"{_HOST_ANCHOR}.free", "AFTER", after_anchor_free),
    Hook(f"{_TOKEN_POOL}.set_index_k_bf16", "AFTER", after_index_k_write, optional=True),
    Hook(f"{_INDEXER_BACKEND}.forward_c4_indexer_bf16", "AFTER", after_indexer, optional=True),
    Hook(f"{_C4_INDEXER}.compute_q_bf16", "AFTER", after_q_bf16, optional=True, guarded=False),
)


def bind(san: Sanitizer, hooks=HOOKS) -> list[tuple[str, object, str]]:
    """(target, hook function, hook type name) for each hook present upstream, bound to `san`."""
    from sglang_dsv4.hooks import resolve

    bound = []
    for hook in hooks:
        try:
            present = resolve(hook.target)[2] is not None
        except (ImportError, AttributeError, ValueError):
            present = False  # install() names it
        if hook.optional and not present:
            continue
        if present:
            _signature(hook.target)  # upstream's own signature, read before any hook wraps it
        call = functools.partial(hook.adapter, san)
        bound.append((hook.target, _guarded(call) if hook.guarded else call, hook.type))
    return bound


def check_indexer_read(san: Sanitizer, backend, c4_indexer, forward_batch) -> None:
    """The sampled decode step's read check for one c4 layer (see the module docstring)."""
    if not san.sampler.current(forward_batch):
        return
    pool = backend.token_to_kv_pool
    layer = c4_indexer.layer_id
    paged = backend.forward_metadata.indexer_metadata
    core = backend.forward_metadata.core_metadata
    rows = forward_batch.req_pool_indices
    n = len(rows)
    selected = core.c4_sparse_page_indices[:n]
    # What each request holds is what its req_to_token row names (the extend path fills rows in
    # a Triton kernel, past ReqToTokenPool.write); the batch's page table must agree with it.
    page_size = backend.page_size
    row_tokens = backend.req_to_token  # DeepseekV4AttnBackend's view of ReqToTokenPool
    held = [
        set((row_tokens[int(r), : int(length)].to(torch.int64) // page_size).tolist())
        for r, length in zip(rows.tolist(), forward_batch.seq_lens.tolist(), strict=False)
    ]
    san.check_read(
        pool, layer, rows, paged.page_table[:n], paged.compressed_seq_lens[:n], selected, held
    )
    query = san._query.pop(layer, None)
    if query is None or pool.index_k_dtype_of(layer) != "bf16" or n == 0:
        return
    # Shadow one request: the kernel's selection as positions, against the reference's.
    i = san.rng.randrange(n)
    seq_len = int(paged.compressed_seq_lens[i])
    if seq_len <= 0:
        return
    per_page = paged.compressed_page_size
    # Only the pages inside the row's length: past it, upstream's page-table builder leaves the
    # row's stale tail (req_to_token[row, :max_seq_len:page_size] of an earlier occupant), which
    # can name a live page again.
    table = paged.page_table[i, : -(-seq_len // per_page)].to(torch.int64)
    slots = selected[i][selected[i] >= 0].to(torch.int64)
    where: dict[int, int] = {}
    for k, page in enumerate(table.tolist()):
        if page > 0:
            where.setdefault(page, k)
    positions = [where.get(int(s) // per_page, -1) * per_page + int(s) % per_page for s in slots]
    q, weights = query
    san.shadow_check(
        "bf16",
        layer,
        int(rows[i]),
        q[i : i + 1].unsqueeze(1),
        pool.get_index_k_bf16_buffer(layer),
        weights[i : i + 1],
        seq_len,
        table,
        positions,
    )


def install(sample: float, action: str, hooks=None) -> list[str]:
    """Register every sanitizer hook (HOOKS by default) with upstream's HookRegistry and apply
    them.

    Returns the targets in force; raises RuntimeError naming the first hook that did not take.
    """
    global SANITIZER
    from sglang_dsv4 import hooks as hook_layer

    if SANITIZER is not None:
        return list(INSTALLED)
    san = Sanitizer(sample=sample, action=action)
    hooks = bind(san, HOOKS if hooks is None else hooks)
    reason = hook_layer.install_hooks(
        [hook_layer.Hook(target, hook, kind) for target, hook, kind in hooks],
        what="sanitizer hook",
    )
    if reason:
        raise RuntimeError(str(reason))
    SANITIZER = san
    INSTALLED[:] = [target for target, _, _ in hooks]
    try:  # every kind at 0 from the start: a dashboard or gate sees the sanitizer is on
        for kind in KINDS:
            _violation_counter().labels(kind=kind)
    except Exception:
        logger.warning("sanitizer: violation counter unavailable", exc_info=True)
    logger.warning(
        "sglang-dsv4: KV sanitizer on (%d hooks, sample %s, action %s)",
        len(INSTALLED),
        sample,
        action,
    )
    return list(INSTALLED)


def install_from_settings(conf) -> None:
    """The plugin's call, after the fixes: nothing unless SGLANG_DSV4_SANITIZE=1; a hook that did
    not take stops the process with one line, as a fix that did not apply does."""
    if not conf.sanitize:
        return
    from sglang_dsv4.hooks import Refusal

    try:
        install(conf.sanitize_sample, conf.sanitize_action)
    except RuntimeError as exc:
        raise Refusal(str(exc)) from None


def describe() -> dict:
    """For `sglang-dsv4 status`: on/off, hooks, sample, action, violations so far."""
    if SANITIZER is None:
        return {"on": False, "hooks": 0, "summary": "off (0 hooks)"}
    return {
        "on": True,
        "hooks": len(INSTALLED),
        "sample": SANITIZER.sample,
        "action": SANITIZER.action,
        "violations": dict(SANITIZER.counts),
        "summary": f"on ({len(INSTALLED)} hooks, sample {SANITIZER.sample}, "
        f"action {SANITIZER.action})",
    }
