"""`sglang-dsv4 plan`: the per-rank KV memory plan of a DeepSeek-V4 model, without a GPU.

It runs the chain a server runs, with upstream's own classes: ServerArgs -> publish -> ModelConfig
-> KVCacheConfigurator -> DSV4PoolConfigurator (with the distribution's fixes, loaded through
upstream's plugin loader), sizes the pools for a KV byte budget as a scheduler does
(`config_from_budget`, `resolve_max_num_reqs`, `finalize_with_max_running_requests`), then builds
the real DeepSeekV4TokenToKVPool (and an MTP draft's pool) on the `meta` device (shapes, no
memory) and reports what every pool allocates. No weights, no network: `--model` needs only a
local folder with config.json.

The KV budget is derived as a server derives it: upstream's own --mem-fraction-static for the GPU's
memory, TP and PD role (its memory hook, run with the GPU's capacity standing in for the device
query), less the weights per rank. `--kv-memory-gib` overrides it.

The chain builders below are also the test support of the fixes (test/support/dsv4.py); they use
upstream modules only, so they work on upstream patched by the exported series too.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import math
import os
import random
import re
import sys
import types
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

# Named here rather than imported from sglang_dsv4.fixes: these builders also serve the run on
# upstream patched by the exported series, which imports no fix module.
INDEX_K_DTYPE_ENV = "SGLANG_DSV4_INDEX_K_DTYPE"
INDEX_K_DTYPES = ("fp8", "bf16", "fp4")
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

# Total memory as the driver reports it (nvidia-smi memory.total), which is what upstream's
# get_device_memory_capacity reads to choose --mem-fraction-static.
GPUS_MIB = {
    "rtx-pro-6000": 97887,  # RTX PRO 6000 Blackwell (Workstation / Server), 96 GB GDDR7
    "rtx-pro-6000-max-q": 97887,  # same 96 GB, 300 W
    "h200": 143771,  # 141 GB HBM3e
    "b200": 183359,  # 180 GB HBM3e
}
DEFAULT_GPU = "rtx-pro-6000"
# DeepSeek-V4-Flash checkpoint (fp4 routed experts, fp8 elsewhere, bf16 embeddings): about 160 GB.
# A --model folder with model.safetensors.index.json gives its own total_size instead.
FLASH_CHECKPOINT_BYTES = 160 * 10**9
# What the launch command serves when the plan used the embedded config.
FLASH_HUB_ID = "deepseek-ai/DeepSeek-V4-Flash"


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
    name = (value or "").strip().lower()
    if name not in INDEX_K_DTYPES:
        raise PlanError(
            f"{origin} {value!r} is not supported; allowed: {', '.join(INDEX_K_DTYPES)}"
        )
    return name


def resolve_index_k_dtype(
    flag: str | None, fp4_indexer: bool, environ=os.environ
) -> tuple[str, str]:
    """(dtype, where it came from), following the server's settings; the flag overrides.

    A server stores what SGLANG_DSV4_INDEX_K_DTYPE says (unset: fp8, upstream's), fp4 only with
    --enable-deepseek-v4-fp4-indexer, and refuses the two when they contradict.
    """
    if flag:
        return check_index_k_dtype(flag, "--index-k-dtype"), "--index-k-dtype"
    variable = (environ.get(INDEX_K_DTYPE_ENV) or "").strip()
    if variable:
        dtype = check_index_k_dtype(variable, INDEX_K_DTYPE_ENV)
        if fp4_indexer and dtype != "fp4":
            raise PlanError(
                f"{INDEX_K_DTYPE_ENV}={dtype} contradicts --enable-deepseek-v4-fp4-indexer "
                "(the server refuses the two together); drop one"
            )
        if dtype == "fp4" and not fp4_indexer:
            raise PlanError(
                f"{INDEX_K_DTYPE_ENV}=fp4 needs --enable-deepseek-v4-fp4-indexer (the server "
                "refuses it without); add the flag"
            )
        return dtype, f"{INDEX_K_DTYPE_ENV}={dtype}"
    if fp4_indexer:
        return "fp4", "--enable-deepseek-v4-fp4-indexer"
    return "fp8", "upstream default (no setting)"


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


# --- the operator's questions -------------------------------------------------------------------


def parse_gpu(value: str) -> tuple[str, int]:
    """(name, MiB) of --gpu: a known card or a memory size (96GiB, 97887MiB, 141GB, 96)."""
    name = (value or "").strip().lower()
    if name in GPUS_MIB:
        return name, GPUS_MIB[name]
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(gib|mib|gb|g)?", name)
    if not match:
        raise PlanError(
            f"--gpu {value!r}: unknown GPU; give one of {', '.join(GPUS_MIB)} or a memory size "
            "such as 96GiB, 97887MiB or 141GB"
        )
    number, unit = float(match.group(1)), match.group(2) or "gib"
    per_unit = {"gib": 1024, "g": 1024, "mib": 1, "gb": 1e9 / MIB}[unit]
    mib = int(number * per_unit)
    if mib < 1024:
        raise PlanError(f"--gpu {value!r}: less than 1 GiB of memory is not a GPU to plan for")
    return f"{mib} MiB GPU", mib


def checkpoint_bytes(model_dir: Path) -> int | None:
    """Bytes of the model's weights: the checkpoint index's total_size, or the embedded
    DeepSeek-V4-Flash figure; None when neither is known."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            return int(json.loads(index.read_text())["metadata"]["total_size"])
        except (KeyError, TypeError, ValueError, json.JSONDecodeError):
            raise PlanError(f"{index}: no metadata.total_size in it") from None
    if model_dir.resolve() == default_model_dir().resolve():
        return FLASH_CHECKPOINT_BYTES
    return None


@dataclass
class Budget:
    """Where the KV budget of one rank comes from."""

    kv_bytes: int
    source: str  # "--kv-memory-gib" or "derived"
    gpu: str | None = None
    gpu_bytes: int | None = None
    mem_fraction_static: float | None = None
    mem_fraction_source: str | None = None
    weights_bytes: int | None = None
    reserve_bytes: int | None = None  # activations and CUDA graphs: gpu x (1 - fraction)


def derive_budget(chain: Chain, *, weights_bytes: int, mem_fraction_static=None) -> Budget:
    """KV bytes per rank as a server profiles them: capacity x fraction - weights.

    Upstream's KV budget is the free memory after the weights less (1 - fraction) of the memory
    free before them; the plan takes the whole capacity as free before loading (a server also
    holds its CUDA context, so its own figure is a little lower).
    """
    from sglang.srt.runtime_context import get_schedule

    gpu_bytes = chain.gpu_mib * MIB
    if mem_fraction_static is None:
        with activated(chain):
            fraction, source = get_schedule().mem_fraction_static, "upstream's default"
    else:
        fraction, source = mem_fraction_static, "--mem-fraction-static"
    kv_bytes = int(gpu_bytes * fraction) - weights_bytes
    return Budget(
        kv_bytes=kv_bytes,
        source="derived",
        gpu_bytes=gpu_bytes,
        mem_fraction_static=fraction,
        mem_fraction_source=source,
        weights_bytes=weights_bytes,
        reserve_bytes=gpu_bytes - int(gpu_bytes * fraction),
    )


def sessions(p: dict, context: int) -> dict:
    """Concurrent sessions of `context` tokens one rank holds, and what limits it."""
    page = p["page_size"]
    per_session_full = math.ceil(context / page) * page
    # Upstream's admission floor: a request holds up to window + one page of SWA.
    per_session_swa = p["sliding_window"] + page
    limits = {
        "full tokens": p["max_total_num_tokens"] // per_session_full,
        "swa tokens": p["pools"]["swa"]["tokens"] // per_session_swa,
        "max running requests": p["max_running_requests"],
    }
    limit = min(limits, key=limits.get)
    return {"per_rank": limits[limit], "limited_by": limit, "limits": limits}


def launch_command(p: dict, model: str) -> dict:
    """The server flags and environment of this plan, bare metal and in the image."""
    flags = ["--model-path", model, "--tp-size", str(p["tp"])]
    if p["disaggregation_mode"] != "null":
        flags += ["--disaggregation-mode", p["disaggregation_mode"]]
        flags += ["--disaggregation-transfer-backend", "nixl"]
    if p.get("mem_fraction_static") is not None:
        flags += ["--mem-fraction-static", f"{p['mem_fraction_static']:g}"]
    flags += ["--max-running-requests", str(p["max_running_requests"])]
    extra = ["--max-running-requests", str(p["max_running_requests"])]
    if p["index_k_dtype"] == "fp4":
        flags.append("--enable-deepseek-v4-fp4-indexer")
        extra.append("--enable-deepseek-v4-fp4-indexer")
    if p["mtp"]:
        for name, value in MTP_SERVER_ARGS.items():
            pair = [f"--{name.replace('_', '-')}", str(value)]
            flags += pair
            extra += pair
    environment = {INDEX_K_DTYPE_ENV: p["index_k_dtype"]}
    image = {"MODEL_PATH": model, "TP": str(p["tp"]), **environment}
    if p.get("mem_fraction_static") is not None:
        image["MEM_FRACTION"] = f"{p['mem_fraction_static']:g}"
    image["EXTRA_ARGS"] = " ".join(extra)
    command = " ".join(
        [f"{k}={v}" for k, v in environment.items()]
        + ["python", "-m", "sglang.launch_server"]
        + flags
    )
    return {"command": command, "environment": environment, "image_environment": image}


def plan(
    index_k_dtype: str = "fp8",
    *,
    model_path=None,
    tp: int = 4,
    disaggregation_mode: str = "decode",
    page_size: int = DSV4_PAGE_SIZE,
    kv_memory_gib: float | None = None,
    gpu: str = DEFAULT_GPU,
    mem_fraction_static: float | None = None,
    weights_gib: float | None = None,
    max_running_requests: int | None = None,
    mtp: bool = False,
    context: int | None = None,
    gpus: int | None = None,
    index_k_source: str | None = None,
) -> dict:
    """The memory plan of one configuration as a JSON-ready dict."""
    gpu_name, gpu_mib = parse_gpu(gpu)
    fields = {} if max_running_requests is None else {"max_running_requests": max_running_requests}
    chain = build_chain(
        index_k_dtype,
        model_path=model_path,
        tp=tp,
        disaggregation_mode=disaggregation_mode,
        page_size=page_size,
        mtp=mtp,
        gpu_mib=gpu_mib,
        **fields,
    )
    model_dir = Path(chain.model_config.model_path)
    heads = chain.model_config.num_attention_heads
    if heads % tp:
        raise PlanError(f"--tp {tp} does not divide the model's {heads} attention heads")
    if weights_gib is not None:
        weights_bytes = int(weights_gib * GIB) // tp
    else:
        total = checkpoint_bytes(model_dir)
        weights_bytes = None if total is None else total // tp
    if kv_memory_gib is not None:
        budget = Budget(kv_bytes=int(kv_memory_gib * GIB), source="--kv-memory-gib")
        budget.gpu, budget.gpu_bytes = gpu_name, gpu_mib * MIB
        if budget.kv_bytes > budget.gpu_bytes:
            raise PlanError(
                f"--kv-memory-gib {kv_memory_gib:g} is more than the whole {gpu_name} "
                f"({budget.gpu_bytes / GIB:.1f} GiB); pass --gpu for a larger card"
            )
    else:
        if weights_bytes is None:
            raise PlanError(
                f"--model {model_dir}: no model.safetensors.index.json to read the weights' size "
                "from; pass --weights-gib (whole checkpoint) or --kv-memory-gib"
            )
        budget = derive_budget(
            chain, weights_bytes=weights_bytes, mem_fraction_static=mem_fraction_static
        )
        budget.gpu = gpu_name
        if budget.kv_bytes <= 0:
            raise PlanError(
                f"the weights ({weights_bytes / GIB:.1f} GiB per rank at TP {tp}) do not fit in "
                f"{budget.mem_fraction_static:g} of a {gpu_name}: raise --tp or "
                "--mem-fraction-static"
            )
    try:
        config = size_for_budget(chain, budget.kv_bytes)
    except (RuntimeError, ValueError) as exc:
        # Upstream's ways of saying the budget holds no usable pool: no full page at all, an SWA
        # share below one request's window, or request state larger than the budget.
        reason = str(exc).strip().splitlines()[0]
        if not re.search(r"Not enough memory|cannot hold even one request|cannot hold", reason):
            raise
        raise PlanError(
            f"a KV budget of {budget.kv_bytes / GIB:.3g} GiB per rank is too small for the pools "
            f"of this model (they need at least {minimum_budget(chain) / GIB:.3g} GiB: one page "
            "of every pool, an SWA pool that holds one request, and the request state)"
        ) from None
    pool, draft, req_to_token_pool = build_pools(chain, config, device="meta")
    report = describe(chain, config, pool, draft, budget)
    report["index_k_dtype_source"] = index_k_source or "--index-k-dtype"
    report["weights_bytes_per_rank"] = weights_bytes
    report["req_to_token_bytes"] = storage_bytes(req_to_token_pool)
    report["one_more_page_bytes"] = one_more_page_bytes(chain, config)
    report["launch"] = launch_command(report, str(model_path) if model_path else FLASH_HUB_ID)
    if context:
        report["context"] = context
        report["gpus"] = gpus or tp
        report["sessions"] = sessions(report, context)
        report["sessions"]["deployment"] = report["sessions"]["per_rank"] * (report["gpus"] // tp)
    return report


def minimum_budget(chain: Chain) -> int:
    """The smallest KV budget upstream's configurator accepts for this chain, in whole pages."""
    page = chain.kvc.page_size
    with activated(chain):
        c = chain.configurator
        for pages in range(1, 4096):
            full = pages * page
            if c._get_swa_tokens(full, page) > c.sliding_window_size + page:
                requests = c.scheduler_max_running_requests(full)
                exact = c.exact_pool_bytes(full, requests)
                if exact is not None:
                    return exact
                return int(full * c.bytes_per_full_token + c._get_c128_state_fixed_bytes(requests))
    return 0


def describe(chain: Chain, config, pool, draft, budget: Budget) -> dict:
    c = chain.configurator
    breakdown = pool_breakdown(pool, draft)
    c4_indexer = pool.index_pools.get(4)
    tokens = {
        "swa": config.swa_max_total_num_tokens,
        "c4 kv": config.c4_max_total_num_tokens,
        "c4 indexer": pool.c4_logical_size,
        "c128 kv": config.c128_max_total_num_tokens,
        "c4 states": config.c4_state_pool_size,
        "c4 indexer states": config.c4_state_pool_size,
        "c128 states": pool.online_c128_state_num_req_slots,
        "mtp draft swa": config.swa_max_total_num_tokens,
    }
    allocated = breakdown["total"]
    return {
        "index_k_dtype": chain.index_k_dtype,
        "model": chain.model_config.model_path,
        "tp": chain.server_args.tp_size,
        "disaggregation_mode": chain.server_args.disaggregation_mode,
        "page_size": chain.kvc.page_size,
        "mtp": chain.draft_kvc is not None,
        "sliding_window": chain.model_config.window_size,
        "budget_source": budget.source,
        "gpu": budget.gpu,
        "gpu_bytes": budget.gpu_bytes,
        "mem_fraction_static": budget.mem_fraction_static,
        "mem_fraction_source": budget.mem_fraction_source,
        "reserve_bytes": budget.reserve_bytes,
        "kv_memory_bytes": budget.kv_bytes,
        "bytes_per_full_token": c.bytes_per_full_token,
        "bytes_per_swa_token": c.bytes_per_swa_token,
        "indexer_bytes_per_token": c.indexer_bytes_per_token,
        "stored_indexer_bytes_per_token": c4_indexer.get_bytes_per_token() if c4_indexer else None,
        "max_total_num_tokens": config.max_total_num_tokens,
        "max_running_requests": config.max_running_requests,
        "pools": {
            name: {"tokens": tokens.get(name), "bytes": nbytes}
            for name, nbytes in breakdown.items()
            if name != "total"
        },
        "allocated_bytes": allocated,
        "unallocated_bytes": budget.kv_bytes - allocated,
    }


def unfixed_bf16_overcommit(chain_args: dict, kv_bytes: int) -> int:
    """What a bf16 pool built at the fp8 plan's sizes (unfixed pricing) allocates beyond it."""
    fp8_chain = build_chain("fp8", **chain_args)
    bf16_chain = build_chain("bf16", **chain_args)
    fp8_config = size_for_budget(fp8_chain, kv_bytes)
    fp8_alloc = storage_bytes(build_pool(fp8_chain, fp8_config, device="meta"))
    bf16_alloc = storage_bytes(build_pool(bf16_chain, fp8_config, device="meta"))
    return bf16_alloc - fp8_alloc


def compare(**kwargs) -> dict:
    """fp8 / bf16 / fp4 side by side, and what unfixed sizing over-commits for bf16 keys.

    Unfixed sizing priced the c4 indexer as fp8 whatever the pool stored, so a bf16 pool was built
    at the fp8 plan's sizes; the over-commit is what that bf16 pool allocates beyond the fp8 one.
    """
    kwargs.pop("index_k_source", None)
    plans = [plan(dtype, **kwargs, index_k_source="--compare") for dtype in INDEX_K_DTYPES]
    kv_bytes = plans[0]["kv_memory_bytes"]
    chain_args = {
        "model_path": kwargs.get("model_path"),
        "tp": kwargs.get("tp", 4),
        "disaggregation_mode": kwargs.get("disaggregation_mode", "decode"),
        "mtp": kwargs.get("mtp", False),
    }
    if kwargs.get("max_running_requests") is not None:
        chain_args["max_running_requests"] = kwargs["max_running_requests"]
    over = unfixed_bf16_overcommit(chain_args, kv_bytes)
    report = {
        "compare": plans,
        "kv_memory_bytes": kv_bytes,
        "unfixed_bf16_overcommit_bytes": over,
        "unfixed_bf16_overcommit_gib": over / GIB,
    }
    if kwargs.get("context"):
        by_dtype = {p["index_k_dtype"]: p["sessions"]["per_rank"] for p in plans}
        report["bf16_cost_in_sessions_per_rank"] = by_dtype["fp8"] - by_dtype["bf16"]
    return report


# --- sweep --------------------------------------------------------------------------------------

SWEEP_AXES = {
    "tp": (1, 2, 4, 8),
    "disaggregation_mode": ("prefill", "decode", "null"),
    "page_size": (DSV4_PAGE_SIZE,),  # the only page size upstream runs DeepSeek-V4 with on CUDA
    "index_k_dtype": INDEX_K_DTYPES,
    "kv_gib": (8, 12, 20, 40, 64, 90),
    "max_running_requests": (None, 16, 64, 512, 1024),  # None: upstream's default (256)
    "mtp": (False, True),
}
SWEEP_CATEGORICAL = ("disaggregation_mode", "index_k_dtype")


def sweep_cells(sample: int | None = 160, seed: int = 0) -> list[dict]:
    """The grid's corners (every combination of each numeric axis's ends, with every role and
    dtype), plus `sample` cells drawn from the rest (all of it when `sample` is None)."""
    names = list(SWEEP_AXES)
    every = [
        dict(zip(names, values, strict=True)) for values in itertools.product(*SWEEP_AXES.values())
    ]

    def is_corner(cell):
        # Numeric axes at their ends; the categorical ones (role, dtype) at every value.
        return all(
            cell[n] in (SWEEP_AXES[n][0], SWEEP_AXES[n][-1]) or n in SWEEP_CATEGORICAL
            for n in names
        )

    corners = [cell for cell in every if is_corner(cell)]
    rest = [cell for cell in every if not is_corner(cell)]
    if sample is not None and sample < len(rest):
        rest = random.Random(seed).sample(rest, sample)
    return corners + rest


def sweep(sample: int | None = 160, seed: int = 0, model_path=None) -> dict:
    """Every cell: upstream's chain sized for the budget, its real pools built on meta,
    allocated - budget. Cells whose budget cannot hold the pools are refused by upstream."""
    chains: dict = {}
    results = []
    for cell in sweep_cells(sample, seed):
        key = tuple((k, v) for k, v in cell.items() if k != "kv_gib")
        if key not in chains:
            fields = {}
            if cell["max_running_requests"] is not None:
                fields["max_running_requests"] = cell["max_running_requests"]
            chains[key] = build_chain(
                cell["index_k_dtype"],
                model_path=model_path,
                tp=cell["tp"],
                disaggregation_mode=cell["disaggregation_mode"],
                page_size=cell["page_size"],
                mtp=cell["mtp"],
                **fields,
            )
        chain = chains[key]
        budget = cell["kv_gib"] * GIB
        row = dict(cell)
        try:
            config = size_for_budget(chain, budget)
        except (RuntimeError, ValueError) as exc:
            row["refused"] = str(exc).strip().splitlines()[0]
            results.append(row)
            continue
        pool, draft, _ = build_pools(chain, config, device="meta")
        allocated = storage_bytes(pool, draft)
        row.update(
            refused=None,
            max_total_num_tokens=config.max_total_num_tokens,
            resolved_max_running_requests=config.max_running_requests,
            allocated_bytes=allocated,
            over_bytes=allocated - budget,
            one_more_page_bytes=one_more_page_bytes(chain, config),
        )
        results.append(row)
    sized = [r for r in results if r["refused"] is None]
    worst = max(sized, key=lambda r: r["over_bytes"]) if sized else None
    return {
        "cells": results,
        "sized": len(sized),
        "refused": len(results) - len(sized),
        "worst_over_bytes": worst["over_bytes"] if worst else None,
        "worst_cell": worst,
        "max_unused_bytes": max((-r["over_bytes"] for r in sized), default=None),
    }


# --- command line -----------------------------------------------------------------------------


def add_arguments(parser) -> None:
    parser.add_argument(
        "--model",
        metavar="PATH",
        help="local folder with a DeepSeek-V4 config.json (default: the embedded "
        "DeepSeek-V4-Flash config; no weights needed)",
    )
    parser.add_argument(
        "--index-k-dtype",
        default=None,
        metavar="{fp8,bf16,fp4}",
        help=f"c4 indexer key storage; overrides what the server would use ({INDEX_K_DTYPE_ENV}, "
        "--enable-deepseek-v4-fp4-indexer, else fp8)",
    )
    parser.add_argument(
        "--enable-deepseek-v4-fp4-indexer",
        action="store_true",
        help="as the server flag: fp4 index keys",
    )
    parser.add_argument("--tp", type=int, default=4, help="tensor-parallel size (default: 4)")
    parser.add_argument(
        "--disaggregation-mode",
        default="decode",
        metavar="{prefill,decode,null}",
        help="PD role of the server (default: decode)",
    )
    parser.add_argument(
        "--page-size",
        type=int,
        default=DSV4_PAGE_SIZE,
        help=f"KV page size; upstream runs DeepSeek-V4 only with {DSV4_PAGE_SIZE} on CUDA",
    )
    parser.add_argument(
        "--gpu",
        default=DEFAULT_GPU,
        help=f"{' | '.join(GPUS_MIB)} | a memory size such as 96GiB (default: {DEFAULT_GPU})",
    )
    parser.add_argument(
        "--mem-fraction-static",
        type=float,
        metavar="F",
        help="as the server flag (default: upstream's for the GPU, TP and role)",
    )
    parser.add_argument(
        "--weights-gib",
        type=float,
        metavar="G",
        help="the whole checkpoint's size, GiB (default: the checkpoint index's total_size; "
        "DeepSeek-V4-Flash embedded: 160 GB)",
    )
    parser.add_argument(
        "--kv-memory-gib",
        type=float,
        metavar="G",
        help="KV memory per rank, GiB: overrides the budget derived from the GPU (a server logs "
        "its own as available_bytes on its 'DSV4 memory calculation' line)",
    )
    parser.add_argument(
        "--max-running-requests", type=int, metavar="N", help="as the server flag (default: 256)"
    )
    parser.add_argument(
        "--mtp", action="store_true", help="speculative decoding over the MTP layer (EAGLE)"
    )
    parser.add_argument(
        "--context",
        type=int,
        metavar="N",
        help="tokens per session: how many concurrent sessions fit, per index-K dtype",
    )
    parser.add_argument(
        "--gpus", type=int, metavar="N", help="GPUs of this role in the deployment (default: TP)"
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="fp8 / bf16 / fp4 side by side, plus what unfixed sizing over-commits for bf16",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="size and build the pools over a grid of TP, role, dtype, budget, requests and "
        "MTP; report allocated - budget in each cell",
    )
    parser.add_argument(
        "--sweep-sample",
        type=int,
        default=160,
        metavar="N",
        help="cells drawn besides the grid's corners (default: 160; 0: corners only)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _validated(args) -> dict:
    if args.disaggregation_mode not in DISAGGREGATION_MODES:
        raise PlanError(
            f"--disaggregation-mode {args.disaggregation_mode!r}: choose one of "
            f"{', '.join(DISAGGREGATION_MODES)}"
        )
    if args.tp < 1:
        raise PlanError(f"--tp {args.tp}: must be at least 1")
    if args.page_size != DSV4_PAGE_SIZE:
        raise PlanError(
            f"--page-size {args.page_size}: upstream runs DeepSeek-V4 with page size "
            f"{DSV4_PAGE_SIZE} on CUDA whatever the flag says; plan with {DSV4_PAGE_SIZE}"
        )
    if args.kv_memory_gib is not None and not args.kv_memory_gib > 0:
        raise PlanError(f"--kv-memory-gib {args.kv_memory_gib:g}: must be positive")
    fraction = args.mem_fraction_static
    if fraction is not None and not 0 < fraction <= 1:
        raise PlanError(f"--mem-fraction-static {fraction:g}: must be in (0, 1]")
    if args.weights_gib is not None and not args.weights_gib > 0:
        raise PlanError(f"--weights-gib {args.weights_gib:g}: must be positive")
    for name in ("max_running_requests", "context", "gpus"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise PlanError(f"--{name.replace('_', '-')} {value}: must be at least 1")
    if args.gpus is not None and args.gpus % args.tp:
        raise PlanError(f"--gpus {args.gpus}: not a multiple of --tp {args.tp}")
    parse_gpu(args.gpu)
    dtype, source = resolve_index_k_dtype(args.index_k_dtype, args.enable_deepseek_v4_fp4_indexer)
    if args.enable_deepseek_v4_fp4_indexer and dtype != "fp4":
        raise PlanError(
            f"--index-k-dtype {dtype} contradicts --enable-deepseek-v4-fp4-indexer; drop one"
        )
    return {
        "index_k_dtype": dtype,
        "index_k_source": source,
        "model_path": check_model_dir(args.model) if args.model else None,
        "tp": args.tp,
        "disaggregation_mode": args.disaggregation_mode,
        "page_size": args.page_size,
        "kv_memory_gib": args.kv_memory_gib,
        "gpu": args.gpu,
        "mem_fraction_static": fraction,
        "weights_gib": args.weights_gib,
        "max_running_requests": args.max_running_requests,
        "mtp": args.mtp,
        "context": args.context,
        "gpus": args.gpus,
    }


@contextlib.contextmanager
def _upstream_quiet():
    """Upstream logs its sizing steps and warns at import about GPU-only features; the plan
    prints the result itself and needs no GPU. Restored afterwards (tests run plans in-process)."""
    import logging
    import warnings

    sglang_logger = logging.getLogger("sglang")
    level = sglang_logger.level
    sglang_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning, module=r"sglang\.")
            yield
    finally:
        sglang_logger.setLevel(level)


def run(args) -> int:
    try:
        kwargs = _validated(args)
        with _upstream_quiet():
            from sglang.srt.plugins import load_plugins

            load_plugins()
            if args.sweep:
                report = sweep(sample=args.sweep_sample, model_path=kwargs["model_path"])
            elif args.compare:
                kwargs.pop("index_k_dtype")
                report = compare(**kwargs)
            else:
                report = plan(**kwargs)
                if args.context:
                    report["sessions_by_index_k_dtype"] = _sessions_by_dtype(kwargs, report)
    except PlanError as exc:
        print(f"sglang-dsv4 plan: {exc}", file=sys.stderr)
        return 2
    except (AssertionError, ValueError, RuntimeError) as exc:
        # Upstream refused the configuration.
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"sglang-dsv4 plan: upstream refused this configuration: {line}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    elif args.sweep:
        render_sweep(report)
    elif args.compare:
        render_compare(report)
    else:
        render_plan(report)
    return 0


def _sessions_by_dtype(kwargs: dict, report: dict) -> dict:
    """Sessions per rank for each index-K dtype at the same budget, and bf16's cost."""
    others = {k: v for k, v in kwargs.items() if k not in ("index_k_dtype", "index_k_source")}
    found = {report["index_k_dtype"]: report["sessions"]["per_rank"]}
    for dtype in INDEX_K_DTYPES:
        if dtype not in found:
            found[dtype] = plan(dtype, **others)["sessions"]["per_rank"]
    by_dtype = {dtype: found[dtype] for dtype in INDEX_K_DTYPES}
    return {**by_dtype, "bf16_cost_vs_fp8": by_dtype["fp8"] - by_dtype["bf16"]}


# --- rendering --------------------------------------------------------------------------------


def _gib(nbytes) -> str:
    return "" if nbytes is None else f"{nbytes / GIB:.2f}"


def _count(value) -> str:
    return "" if value is None else f"{value:,}"


def _headline(p: dict) -> str:
    model = Path(p["model"]).name
    mtp = ", MTP" if p["mtp"] else ""
    return (
        f"{model}: TP {p['tp']}, {p['disaggregation_mode']}, page {p['page_size']}{mtp}, "
        f"KV memory {p['kv_memory_bytes'] / GIB:.2f} GiB per rank ({p['budget_source']})"
    )


def _where_each_gib_goes(p: dict):
    from rich.table import Table

    table = Table(title=f"where each GiB of one {p['gpu']} goes (computed, not measured)")
    table.add_column("")
    table.add_column("GiB", justify="right")
    if p["budget_source"] == "derived":
        table.add_row("GPU memory", _gib(p["gpu_bytes"]))
        table.add_row(
            f"weights per rank (checkpoint / TP {p['tp']})", _gib(p["weights_bytes_per_rank"])
        )
        table.add_row(
            f"activations + CUDA graphs (1 - {p['mem_fraction_static']:g}, "
            f"{p['mem_fraction_source']})",
            _gib(p["reserve_bytes"]),
        )
    table.add_row("KV budget", _gib(p["kv_memory_bytes"]), style="bold")
    table.add_row("  KV pools allocated", _gib(p["allocated_bytes"]))
    table.add_row(
        f"  left unallocated ({p['unallocated_bytes']:,} B, < one page of every pool)",
        _gib(p["unallocated_bytes"]),
    )
    table.add_row(
        "request-to-token table (beside the pools; upstream does not price it)",
        _gib(p["req_to_token_bytes"]),
    )
    return table


def render_plan(p: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    console.print(f"Memory plan per rank, index-K {p['index_k_dtype']}: {_headline(p)}")
    console.print(f"index-K dtype from: {p['index_k_dtype_source']}")
    facts = Table(show_header=False, box=None, pad_edge=False)
    facts.add_column(style="bold")
    facts.add_column(justify="right")
    facts.add_row("bytes per full token", f"{p['bytes_per_full_token']:,.2f}")
    facts.add_row("bytes per SWA token", f"{p['bytes_per_swa_token']:,.2f}")
    facts.add_row("indexer bytes per token", f"{p['indexer_bytes_per_token']}")
    facts.add_row("max total (full) tokens", _count(p["max_total_num_tokens"]))
    facts.add_row("max running requests", _count(p["max_running_requests"]))
    facts.add_row("one more page of every pool, bytes", _count(p["one_more_page_bytes"]))
    console.print(facts)
    if p["stored_indexer_bytes_per_token"] not in (None, p["indexer_bytes_per_token"]):
        console.print(
            f"[bold red]the c4 indexer pool stores {p['stored_indexer_bytes_per_token']} B/token "
            f"but is priced at {p['indexer_bytes_per_token']}: fix pool-sizing-bf16 is not in force[/]"
        )
    if p["unallocated_bytes"] < 0:
        console.print(
            f"[bold red]the pools take {-p['unallocated_bytes']:,} B more than the budget: "
            "fix pool-sizing-bf16 is not in force[/]"
        )
    pools = Table(title="pools (allocated on the meta device by upstream's pool classes)")
    pools.add_column("pool")
    pools.add_column("tokens / rows", justify="right")
    pools.add_column("GiB", justify="right")
    for name, part in p["pools"].items():
        pools.add_row(name, _count(part["tokens"]), _gib(part["bytes"]))
    pools.add_row("total", "", _gib(p["allocated_bytes"]), style="bold")
    console.print(pools)
    console.print(_where_each_gib_goes(p))
    if "sessions" in p:
        s = p["sessions"]
        console.print(
            f"Sessions of {p['context']:,} tokens: {s['per_rank']:,} per rank (limited by "
            f"{s['limited_by']}), {s['deployment']:,} for {p['gpus']} GPUs at TP {p['tp']}"
        )
        by_dtype = p.get("sessions_by_index_k_dtype")
        if by_dtype:
            console.print(
                "  per rank by index-K dtype: "
                + ", ".join(f"{d} {by_dtype[d]:,}" for d in INDEX_K_DTYPES)
                + f"; bf16 costs {by_dtype['bf16_cost_vs_fp8']:,} sessions per rank against fp8"
            )
    launch = p["launch"]
    console.print("Launch (bare metal):")
    console.print(f"  {launch['command']}", soft_wrap=True)
    console.print("Image environment:")
    for name, value in launch["image_environment"].items():
        console.print(f"  {name}={value}", soft_wrap=True)


def render_compare(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    plans = report["compare"]
    console.print(f"Memory plan per rank by index-K dtype: {_headline(plans[0])}")
    table = Table()
    table.add_column("")
    for p in plans:
        table.add_column(p["index_k_dtype"], justify="right")
    rows = [
        ("bytes per full token", lambda p: f"{p['bytes_per_full_token']:,.2f}"),
        ("bytes per SWA token", lambda p: f"{p['bytes_per_swa_token']:,.2f}"),
        ("indexer bytes per token", lambda p: f"{p['indexer_bytes_per_token']}"),
        ("max total (full) tokens", lambda p: _count(p["max_total_num_tokens"])),
        ("max running requests", lambda p: _count(p["max_running_requests"])),
    ]
    if "sessions" in plans[0]:
        rows.append(("sessions per rank", lambda p: _count(p["sessions"]["per_rank"])))
    for label, cell in rows:
        table.add_row(label, *(cell(p) for p in plans))
    for name in plans[0]["pools"]:
        table.add_row(f"{name} GiB", *(_gib(p["pools"][name]["bytes"]) for p in plans))
    table.add_row("allocated GiB", *(_gib(p["allocated_bytes"]) for p in plans), style="bold")
    table.add_row("unallocated GiB", *(_gib(p["unallocated_bytes"]) for p in plans))
    console.print(table)
    over = report["unfixed_bf16_overcommit_bytes"]
    console.print(
        f"Unfixed sizing (c4 indexer priced as fp8) with bf16 keys over-commits {over / GIB:.2f} "
        f"GiB per rank at a KV budget of {report['kv_memory_bytes'] / GIB:.2f} GiB per rank."
    )


def render_sweep(report: dict) -> None:
    from rich.console import Console

    console = Console(highlight=False)
    console.print(
        f"{len(report['cells'])} cells: {report['sized']} sized and built, {report['refused']} "
        "refused by upstream (budget smaller than the pools' minimum)"
    )
    worst = report["worst_cell"]
    if worst is not None:
        console.print(
            f"worst allocated - budget: {report['worst_over_bytes']:,} B ({_cell_name(worst)}); "
            f"most left unallocated: {report['max_unused_bytes']:,} B"
        )


def _cell_name(cell: dict) -> str:
    requests = cell["max_running_requests"] or "default"
    return (
        f"TP {cell['tp']}, {cell['disaggregation_mode']}, page {cell['page_size']}, "
        f"{cell['index_k_dtype']}, {cell['kv_gib']} GiB, max running requests {requests}, "
        f"MTP {'on' if cell['mtp'] else 'off'}"
    )
