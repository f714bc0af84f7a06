"""The upstream chain a DeepSeek-V4 server runs, on the CPU, and the pools it builds.

ServerArgs -> publish -> ModelConfig -> KVCacheConfigurator -> DSV4PoolConfigurator, sized as a
scheduler sizes them, and the real DeepSeekV4TokenToKVPool (and an MTP draft's pool) built from
those sizes on `cpu` or `meta`. The plan command reports on them; every fix's tests build their
pools with them (test/support/dsv4.py). They use upstream modules only, so they work on upstream
patched by the exported series too.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import types
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

# Not from sglang_dsv4.fixes: these builders also serve the run on upstream patched by the
# exported series, which imports no fix module (sglang_dsv4.index_k_dtype imports nothing).
from sglang_dsv4.index_k_dtype import (
    FP4_INDEXER_FLAG,
    INDEX_K_DTYPE_ENV,
    INDEX_K_DTYPES,
    dsv4_index_k_dtype_for,
    parse_dsv4_index_k_dtype,
)

DSV4_ARCHITECTURES = ("DeepseekV4ForCausalLM", "DeepseekV4ForCausalLMNextN")
DISAGGREGATION_MODES = ("prefill", "decode", "null")
# Upstream's DeepSeek-V4 override sets page_size 256 on CUDA whatever --page-size says
# (arg_groups/model_overrides/deepseek_v4.py), and the pool builder asserts it.
DSV4_PAGE_SIZE = 256
# MTP as upstream runs DeepSeek-V4 with it: EAGLE over the NextN layer, top-k 1.
MTP_SERVER_ARGS = {
    "speculative_algorithm": "EAGLE",
    "speculative_num_steps": 1,
    "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 2,
}

GIB = 1 << 30
MIB = 1 << 20

class PlanError(ValueError):
    """Input the plan cannot use; its message is the one line the user reads."""


def default_model_dir() -> Path:
    """The embedded DeepSeek-V4-Flash configuration (package data, no weights)."""
    return Path(str(resources.files("sglang_dsv4") / "data" / "deepseek-v4-flash"))


def check_model_dir(path: str | os.PathLike) -> Path:
    folder = Path(path)
    config = folder / "config.json"
    if not folder.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", str(path)):
        raise PlanError(
            f"--model {path}: plan reads a local folder with config.json, not a hub id; "
            f"fetch the config first (huggingface-cli download {path} config.json --local-dir DIR)"
        )
    if not config.is_file():
        raise PlanError(f"--model {path}: no config.json in that folder")
    try:
        architectures = json.loads(config.read_text()).get("architectures") or []
    except (json.JSONDecodeError, AttributeError) as exc:
        raise PlanError(f"--model {path}: config.json is not a JSON object ({exc})") from None
    if not set(architectures) & set(DSV4_ARCHITECTURES):
        found = ", ".join(map(str, architectures)) or "none"
        raise PlanError(f"--model {path}: not a DeepSeek-V4 model (architectures: {found})")
    return folder


def check_index_k_dtype(value: str, origin: str = "index-K dtype") -> str:
    try:
        name = parse_dsv4_index_k_dtype(value)
    except ValueError:
        name = None
    if name is None:
        raise PlanError(
            f"{origin} {value!r} is not supported; allowed: {', '.join(INDEX_K_DTYPES)}"
        )
    return name


def resolve_index_k_dtype(
    flag: str | None, fp4_indexer: bool, environ=os.environ
) -> tuple[str, str]:
    """(dtype, where it came from), by the server's own rule (sglang_dsv4.index_k_dtype); the
    --index-k-dtype flag overrides the variable. What the server refuses, the plan refuses."""
    if flag:
        return check_index_k_dtype(flag, "--index-k-dtype"), "--index-k-dtype"
    try:
        requested = parse_dsv4_index_k_dtype(environ.get(INDEX_K_DTYPE_ENV))
        dtype = dsv4_index_k_dtype_for(requested, fp4_indexer)
    except ValueError as exc:
        raise PlanError(f"{exc} (the server refuses this setting)") from None
    if requested:
        return dtype, f"{INDEX_K_DTYPE_ENV}={dtype}"
    if fp4_indexer:
        return dtype, FP4_INDEXER_FLAG
    return dtype, "upstream default (no setting)"


@contextlib.contextmanager
def index_k_dtype_in_force(index_k_dtype: str):
    """Make `index_k_dtype` this process's index-K dtype for the duration, then restore.

    Upstream (with fix index-k-bf16) reads SGLANG_DSV4_INDEX_K_DTYPE once and caches it; this
    sets the variable and clears that cache on entry and on exit. Pools keep the dtype they were
    built with, so pools of several dtypes can live in one process.
    """
    from sglang.srt.mem_cache import deepseek_v4_memory_pool as upstream_pool

    cached_read = getattr(upstream_pool, "requested_dsv4_index_k_dtype", None)
    if cached_read is None and index_k_dtype != "fp8":
        raise PlanError(
            f"index-K dtype {index_k_dtype} needs fix index-k-bf16 in force (see `sglang-dsv4 status`)"
        )
    previous = os.environ.get(INDEX_K_DTYPE_ENV)
    os.environ[INDEX_K_DTYPE_ENV] = index_k_dtype
    if cached_read is not None:
        cached_read.cache_clear()
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(INDEX_K_DTYPE_ENV, None)
        else:
            os.environ[INDEX_K_DTYPE_ENV] = previous
        if cached_read is not None:
            cached_read.cache_clear()


@contextlib.contextmanager
def gpu_capacity(gpu_mib: int | None):
    """Upstream's memory hook asks the device for its capacity to pick --mem-fraction-static and
    the chunk / CUDA-graph sizes; with no GPU here, answer with `gpu_mib` (stand-in for the
    device query). None leaves upstream's no-GPU fallback."""
    if gpu_mib is None:
        yield
        return
    from sglang.srt.arg_groups import memory_hook

    original = memory_hook.get_device_memory_capacity
    memory_hook.get_device_memory_capacity = lambda *args, **kwargs: gpu_mib
    try:
        yield
    finally:
        memory_hook.get_device_memory_capacity = original


@dataclass
class Chain:
    """Upstream's sizing chain for one configuration and index-K dtype."""

    index_k_dtype: str
    server_args: Any
    model_config: Any
    kvc: Any  # KVCacheConfigurator
    configurator: Any  # DSV4PoolConfigurator
    draft_kvc: Any = None  # the MTP draft worker's KVCacheConfigurator, if any
    gpu_mib: int | None = None


def _publish(server_args, index_k_dtype: str, gpu_mib: int | None = None) -> None:
    from sglang.srt.runtime_context import get_context, get_server_args, publish

    try:
        current = get_server_args()
    except ValueError:  # nothing published yet
        current = None
    if current is not server_args:
        with gpu_capacity(gpu_mib):
            publish(server_args, role="scheduler")
    # Upstream's fp4 indexer switch; ServerArgs refuses it without an sm_100 / sm_120 GPU, so on
    # this machine it is set on the published config instead (stand-in for the GPU check).
    get_context().override(
        "sglang-dsv4 plan", enable_deepseek_v4_fp4_indexer=index_k_dtype == "fp4"
    )


@contextlib.contextmanager
def activated(chain: Chain):
    """The chain's config published and its index-K dtype in force."""
    with index_k_dtype_in_force(chain.index_k_dtype):
        _publish(chain.server_args, chain.index_k_dtype, chain.gpu_mib)
        yield chain


def _kv_cache_configurator(server_args, model_config, *, is_draft_worker: bool):
    """Upstream's KVCacheConfigurator as a model runner builds it, less the GPU-only parts."""
    import torch
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype
    from sglang.srt.model_executor.model_runner_components.layer_setup import (
        resolve_layer_indices,
    )
    from sglang.srt.model_executor.model_runner_components.load_model_utils import (
        resolve_sliding_window_size,
    )
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        SpecAuxHiddenStateConfig,
    )
    from sglang.srt.runtime_context import get_model, get_parallel, get_schedule, get_spec
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    resolved_dtype, kv_cache_dtype = configure_kv_cache_dtype(
        server_args_kv_cache_dtype=get_model().kv_cache_dtype,
        model=None,
        model_dtype=torch.bfloat16,
        is_draft_worker=is_draft_worker,
        is_dflash=False,
        speculative_draft_attention_backend=None,
        speculative_draft_kv_cache_dtype=None,
    )
    return KVCacheConfigurator(
        device="cpu",
        gpu_id=0,
        attn_dp_size=get_parallel().attn_dp_size,
        pp_size=1,
        pp_group=types.SimpleNamespace(world_size=1, rank_in_group=0),
        model=None,
        model_config=model_config,
        server_args=server_args,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_dtype_str=resolved_dtype or get_model().kv_cache_dtype,
        model_dtype=torch.bfloat16,
        page_size=get_schedule().page_size,
        sliding_window_size=resolve_sliding_window_size(None, model_config),
        spec_algorithm=SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm),
        is_draft_worker=is_draft_worker,
        post_capture_kv_active=False,
        spec_aux_config=SpecAuxHiddenStateConfig(),
        is_hybrid_swa=model_config.is_hybrid_swa,
        is_hybrid_swa_compress=model_config.is_hybrid_swa_compress,
        use_mla_backend=False,
        layer_info=resolve_layer_indices(
            model=None, model_config=model_config, is_draft_worker=is_draft_worker
        ),
        forward_stream=None,
        req_to_token_pool=None,
        token_to_kv_pool_allocator=None,
        memory_pool_config=None,
    )


def build_chain(
    index_k_dtype: str = "fp8",
    *,
    model_path: str | os.PathLike | None = None,
    tp: int = 4,
    disaggregation_mode: str = "decode",
    page_size: int = DSV4_PAGE_SIZE,
    mtp: bool = False,
    gpu_mib: int | None = None,
    **server_args_fields,
) -> Chain:
    """ServerArgs -> publish -> ModelConfig -> KVCacheConfigurator -> DSV4PoolConfigurator.

    Stand-ins only for what needs a GPU or peers: device "cpu" in ServerArgs, a one-stage
    pipeline group object (`pp_group`), and the GPU's capacity (`gpu_mib`) for upstream's memory
    hook. `mtp` adds upstream's EAGLE draft over the NextN layer, whose worker has its own pool.
    """
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
    from sglang.srt.server_args import ServerArgs

    index_k_dtype = check_index_k_dtype(index_k_dtype)
    model_dir = check_model_dir(model_path or default_model_dir())
    if mtp:
        server_args_fields = {**MTP_SERVER_ARGS, **server_args_fields}
    server_args = ServerArgs(
        model_path=str(model_dir),
        tp_size=tp,
        disaggregation_mode=disaggregation_mode,
        page_size=page_size,
        device="cpu",
        **server_args_fields,
    )
    with index_k_dtype_in_force(index_k_dtype):
        _publish(server_args, index_k_dtype, gpu_mib)
        model_config = ModelConfig.from_server_args(server_args)
        kvc = _kv_cache_configurator(server_args, model_config, is_draft_worker=False)
        configurator = create_memory_pool_configurator(kvc)
        draft_kvc = None
        if mtp:
            draft_config = ModelConfig.from_server_args(server_args, is_draft_model=True)
            draft_kvc = _kv_cache_configurator(server_args, draft_config, is_draft_worker=True)
    return Chain(index_k_dtype, server_args, model_config, kvc, configurator, draft_kvc, gpu_mib)


def size_for_budget(chain: Chain, kv_bytes: int):
    """The MemoryPoolConfig a scheduler derives from `kv_bytes` of KV memory per rank."""
    with activated(chain):
        config = chain.kvc.config_from_budget(int(kv_bytes))
        config.max_running_requests = chain.kvc.resolve_max_num_reqs(config.max_total_num_tokens)
        return chain.configurator.finalize_with_max_running_requests(config)


def size_for_tokens(chain: Chain, full_tokens: int, max_running_requests: int):
    """The MemoryPoolConfig for a given full-token capacity (a capped budget's path)."""
    from sglang.srt.runtime_context import get_schedule

    with activated(chain):
        config = chain.configurator.calculate_pool_sizes_from_max_tokens(
            full_tokens, get_schedule().page_size
        )
        config.max_running_requests = max_running_requests
        return chain.configurator.finalize_with_max_running_requests(config)


def _build_kv_pool(kvc, config, req_to_token_pool, device: str):
    sizes = kvc._derive_pool_sizes(config=config)
    kvc.device = device
    try:
        # The builder takes the derived sizes by keyword; pass every one it names.
        wanted = inspect.signature(kvc._build_dsv4_kv_pool).parameters
        sized = {name: getattr(sizes, name) for name in wanted if hasattr(sizes, name)}
        return kvc._build_dsv4_kv_pool(**sized, req_to_token_pool=req_to_token_pool)
    finally:
        kvc.device = "cpu"


def build_pools(chain: Chain, config, device: str = "cpu"):
    """(target pool, MTP draft pool or None, request-to-token pool) as a server builds them.

    The request-to-token table is large (slots x context length) and not a KV pool, so it is
    always built on "meta"; the pools only read its row count.
    """
    kvc = chain.kvc
    with activated(chain):
        sizes = kvc._derive_pool_sizes(config=config)
        kvc.device = "meta"
        try:
            req_to_token_pool = kvc._build_req_to_token_pool(
                max_num_reqs=sizes.max_running_requests
            )
        finally:
            kvc.device = "cpu"
        pool = _build_kv_pool(kvc, config, req_to_token_pool, device)
        draft = None
        if chain.draft_kvc is not None:
            draft = _build_kv_pool(chain.draft_kvc, config, req_to_token_pool, device)
    return pool, draft, req_to_token_pool


def build_pool(chain: Chain, config, device: str = "cpu"):
    """The real DeepSeekV4TokenToKVPool upstream builds for `config`, on `device`."""
    return build_pools(chain, config, device)[0]


def _storages(obj, seen_objects: set, out: dict, depth: int = 0) -> None:
    """Every tensor storage reachable from an upstream pool object, keyed by storage identity."""
    import torch

    if id(obj) in seen_objects or depth > 8:
        return
    seen_objects.add(id(obj))
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        out[storage._cdata] = storage.nbytes()
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _storages(item, seen_objects, out, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            _storages(item, seen_objects, out, depth + 1)
    elif type(obj).__module__.startswith("sglang.") and hasattr(obj, "__dict__"):
        for item in vars(obj).values():
            _storages(item, seen_objects, out, depth + 1)


def storage_bytes(*objects) -> int:
    """Bytes of the distinct tensor storages the objects hold (views counted once)."""
    found: dict[int, int] = {}
    seen: set = set()
    for obj in objects:
        if obj is not None:
            _storages(obj, seen, found)
    return sum(found.values())


def pool_breakdown(pool, draft=None) -> dict[str, int]:
    """Allocated bytes of each part of a DeepSeekV4TokenToKVPool (and an MTP draft's pool)."""
    states: dict[str, list] = {}
    for kind, pools in (
        ("", pool.compress_state_pools),
        ("indexer ", pool.indexer_compress_state_pools),
    ):
        for state_pool in pools:
            if state_pool is not None:
                states.setdefault(f"c{state_pool.ratio} {kind}states", []).append(state_pool)
    parts = {
        "swa": [pool.swa_kv_pool, pool.request_window, pool.unified_kv_pool],
        **{f"c{ratio} kv": [kv] for ratio, kv in sorted(pool.kv_pools.items())},
        **{f"c{ratio} indexer": [ix] for ratio, ix in sorted(pool.index_pools.items())},
        **states,
    }
    if draft is not None:
        parts["mtp draft swa"] = [draft]
    breakdown = {name: storage_bytes(*objs) for name, objs in parts.items()}
    breakdown["total"] = storage_bytes(pool, draft)
    return breakdown


def one_more_page_bytes(chain: Chain, config) -> int:
    """What one more page of every pool costs: the pools rebuilt (on meta) with each size one
    page larger (full, SWA, c4, c128 and the c4 state of one SWA page), less the pools as sized."""
    page = chain.kvc.page_size
    grown = type(config)(**vars(config))
    grown.max_total_num_tokens += page
    grown.full_max_total_num_tokens += page
    grown.swa_max_total_num_tokens += page
    grown.c4_max_total_num_tokens += page // 4
    grown.c128_max_total_num_tokens += page // 128
    grown.c4_state_pool_size += chain.configurator.ring_sizes.get(4, 0)
    before = build_pools(chain, config, device="meta")
    after = build_pools(chain, grown, device="meta")
    return storage_bytes(*after[:2]) - storage_bytes(*before[:2])


