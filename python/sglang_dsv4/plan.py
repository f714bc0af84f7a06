"""`sglang-dsv4 plan`: the per-rank KV memory plan of a DeepSeek-V4 model, without a GPU.

It runs the chain a server runs, with upstream's own classes: ServerArgs -> publish -> ModelConfig
-> KVCacheConfigurator -> DSV4PoolConfigurator (with the distribution's fixes, loaded through
upstream's plugin loader), sizes the pools for a KV byte budget as a scheduler does
(`config_from_budget`, `resolve_max_num_reqs`, `finalize_with_max_running_requests`), then builds
the real DeepSeekV4TokenToKVPool on the `meta` device (shapes, no memory) and reports what every
pool allocates. No weights, no network: `--model` needs only a config.json.

The chain builders below are also the test support of the fixes (test/support/dsv4.py); they use
upstream modules only, so they work on upstream patched by the exported series too.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
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

# 96 GB RTX PRO 6000 (95.6 GiB usable), TP 4, upstream's default --mem-fraction-static for it
# (0.895: 10 GiB reserved) keeps ~85.6 GiB static per rank; DeepSeek-V4-Flash weights (fp4 experts,
# fp8 elsewhere, ~160 GB) take ~37 GiB of it per rank; 40 GiB leaves a margin. A server logs its
# real figure as `available_bytes` on its "DSV4 memory calculation" line.
DEFAULT_KV_MEMORY_GIB = 40.0

GIB = 1 << 30


class PlanError(ValueError):
    """Input the plan cannot use; its message is the one line the user reads."""


def default_model_dir() -> Path:
    """The embedded DeepSeek-V4-Flash configuration (package data, no weights)."""
    return Path(str(resources.files("sglang_dsv4") / "data" / "deepseek-v4-flash"))


def check_model_dir(path: str | os.PathLike) -> Path:
    folder = Path(path)
    config = folder / "config.json"
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


def check_index_k_dtype(value: str) -> str:
    name = (value or "").strip().lower()
    if name not in INDEX_K_DTYPES:
        raise PlanError(
            f"index-K dtype {value!r} is not supported; allowed: {', '.join(INDEX_K_DTYPES)}"
        )
    return name


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


@dataclass
class Chain:
    """Upstream's sizing chain for one configuration and index-K dtype."""

    index_k_dtype: str
    server_args: Any
    model_config: Any
    kvc: Any  # KVCacheConfigurator
    configurator: Any  # DSV4PoolConfigurator


def _publish(server_args, index_k_dtype: str) -> None:
    from sglang.srt.runtime_context import get_context, get_server_args, publish

    try:
        current = get_server_args()
    except ValueError:  # nothing published yet
        current = None
    if current is not server_args:
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
        _publish(chain.server_args, chain.index_k_dtype)
        yield chain


def build_chain(
    index_k_dtype: str = "fp8",
    *,
    model_path: str | os.PathLike | None = None,
    tp: int = 4,
    disaggregation_mode: str = "decode",
    page_size: int = 256,
    **server_args_fields,
) -> Chain:
    """ServerArgs -> publish -> ModelConfig -> KVCacheConfigurator -> DSV4PoolConfigurator.

    Stand-ins only for what needs a GPU or peers: device "cpu" in ServerArgs, and a one-stage
    pipeline group object (`pp_group`).
    """
    import torch
    from sglang.srt.configs.model_config import ModelConfig
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
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
    from sglang.srt.runtime_context import get_model, get_parallel, get_schedule, get_spec
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    index_k_dtype = check_index_k_dtype(index_k_dtype)
    model_dir = check_model_dir(model_path or default_model_dir())
    server_args = ServerArgs(
        model_path=str(model_dir),
        tp_size=tp,
        disaggregation_mode=disaggregation_mode,
        page_size=page_size,
        device="cpu",
        **server_args_fields,
    )
    with index_k_dtype_in_force(index_k_dtype):
        _publish(server_args, index_k_dtype)
        model_config = ModelConfig.from_server_args(server_args)
        resolved_dtype, kv_cache_dtype = configure_kv_cache_dtype(
            server_args_kv_cache_dtype=get_model().kv_cache_dtype,
            model=None,
            model_dtype=torch.bfloat16,
            is_draft_worker=False,
            is_dflash=False,
            speculative_draft_attention_backend=None,
            speculative_draft_kv_cache_dtype=None,
        )
        kvc = KVCacheConfigurator(
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
            is_draft_worker=False,
            post_capture_kv_active=False,
            spec_aux_config=SpecAuxHiddenStateConfig(),
            is_hybrid_swa=model_config.is_hybrid_swa,
            is_hybrid_swa_compress=model_config.is_hybrid_swa_compress,
            use_mla_backend=False,
            layer_info=resolve_layer_indices(
                model=None, model_config=model_config, is_draft_worker=False
            ),
            forward_stream=None,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=None,
            memory_pool_config=None,
        )
        configurator = create_memory_pool_configurator(kvc)
    return Chain(index_k_dtype, server_args, model_config, kvc, configurator)


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


def build_pool(chain: Chain, config, device: str = "cpu"):
    """The real DeepSeekV4TokenToKVPool upstream builds for `config`, on `device`.

    The request-to-token table is not part of the KV pools (and is large: slots x context length),
    so it is built on "meta"; the pool only reads its row count.
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
        kvc.device = device
        try:
            # The builder takes the derived sizes by keyword; pass every one it names.
            wanted = inspect.signature(kvc._build_dsv4_kv_pool).parameters
            sized = {name: getattr(sizes, name) for name in wanted if hasattr(sizes, name)}
            return kvc._build_dsv4_kv_pool(**sized, req_to_token_pool=req_to_token_pool)
        finally:
            kvc.device = "cpu"


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
        _storages(obj, seen, found)
    return sum(found.values())


def pool_breakdown(pool) -> dict[str, int]:
    """Allocated bytes of each part of a DeepSeekV4TokenToKVPool."""
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
    breakdown = {
        name: storage_bytes(*(o for o in objs if o is not None)) for name, objs in parts.items()
    }
    breakdown["total"] = storage_bytes(pool)
    return breakdown


def plan(
    index_k_dtype: str = "fp8",
    *,
    model_path=None,
    tp: int = 4,
    disaggregation_mode: str = "decode",
    page_size: int = 256,
    kv_memory_gib: float = DEFAULT_KV_MEMORY_GIB,
) -> dict:
    """The memory plan of one configuration as a JSON-ready dict."""
    chain = build_chain(
        index_k_dtype,
        model_path=model_path,
        tp=tp,
        disaggregation_mode=disaggregation_mode,
        page_size=page_size,
    )
    if chain.kvc.page_size != page_size:
        raise PlanError(
            f"--page-size {page_size}: upstream runs DeepSeek-V4 with page size "
            f"{chain.kvc.page_size} here whatever the flag says; plan with {chain.kvc.page_size}"
        )
    kv_bytes = int(kv_memory_gib * GIB)
    try:
        config = size_for_budget(chain, kv_bytes)
    except (RuntimeError, ValueError) as exc:
        # Upstream's two ways of saying the budget holds no usable pool: no full page at all, or
        # an SWA share below one request's window.
        reason = str(exc).strip()
        if "Not enough memory" not in reason and "cannot hold even one request" not in reason:
            raise
        one_page = page_size * chain.configurator.bytes_per_full_token / GIB
        raise PlanError(
            f"--kv-memory-gib {kv_memory_gib:g} is too small for the pools of this model "
            f"(one page of {page_size} full tokens alone takes {one_page:.3f} GiB; upstream: "
            f"{reason.splitlines()[0]})"
        ) from None
    pool = build_pool(chain, config, device="meta")
    return describe(chain, config, pool, kv_bytes)


def describe(chain: Chain, config, pool, kv_bytes: int) -> dict:
    c = chain.configurator
    breakdown = pool_breakdown(pool)
    c4_indexer = pool.index_pools.get(4)
    tokens = {
        "swa": config.swa_max_total_num_tokens,
        "c4 kv": config.c4_max_total_num_tokens,
        "c4 indexer": config.c4_max_total_num_tokens,
        "c128 kv": config.c128_max_total_num_tokens,
        "c4 states": config.c4_state_pool_size,
        "c4 indexer states": config.c4_state_pool_size,
        "c128 states": config.c128_state_pool_size,
    }
    return {
        "index_k_dtype": chain.index_k_dtype,
        "model": chain.model_config.model_path,
        "tp": chain.server_args.tp_size,
        "disaggregation_mode": chain.server_args.disaggregation_mode,
        "page_size": chain.kvc.page_size,
        "kv_memory_bytes": kv_bytes,
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
        "allocated_bytes": breakdown["total"],
    }


def compare(**kwargs) -> dict:
    """fp8 / bf16 / fp4 side by side, and what unfixed sizing over-commits for bf16 keys.

    Unfixed sizing priced the c4 indexer as fp8 whatever the pool stored, so a bf16 pool was built
    at the fp8 plan's sizes; the over-commit is what that bf16 pool allocates beyond the fp8 one.
    """
    plans = [plan(dtype, **kwargs) for dtype in INDEX_K_DTYPES]
    fp8_args = {k: v for k, v in kwargs.items() if k != "kv_memory_gib"}
    fp8_chain = build_chain("fp8", **fp8_args)
    bf16_chain = build_chain("bf16", **fp8_args)
    kv_bytes = int(kwargs.get("kv_memory_gib", DEFAULT_KV_MEMORY_GIB) * GIB)
    fp8_config = size_for_budget(fp8_chain, kv_bytes)
    fp8_alloc = storage_bytes(build_pool(fp8_chain, fp8_config, device="meta"))
    bf16_alloc = storage_bytes(build_pool(bf16_chain, fp8_config, device="meta"))
    over = bf16_alloc - fp8_alloc
    return {
        "compare": plans,
        "unfixed_bf16_overcommit_bytes": over,
        "unfixed_bf16_overcommit_gb": over / 1e9,
    }


# --- command line -----------------------------------------------------------------------------


def add_arguments(parser) -> None:
    parser.add_argument(
        "--model",
        metavar="PATH",
        help="folder with a DeepSeek-V4 config.json (default: the embedded DeepSeek-V4-Flash "
        "config; no weights needed)",
    )
    parser.add_argument(
        "--index-k-dtype",
        default="fp8",
        metavar="{fp8,bf16,fp4}",
        help="c4 indexer key storage (default: fp8, upstream's)",
    )
    parser.add_argument("--tp", type=int, default=4, help="tensor-parallel size (default: 4)")
    parser.add_argument(
        "--disaggregation-mode",
        default="decode",
        metavar="{prefill,decode,null}",
        help="PD role of the server (default: decode)",
    )
    parser.add_argument("--page-size", type=int, default=256, help="KV page size (default: 256)")
    parser.add_argument(
        "--kv-memory-gib",
        type=float,
        default=DEFAULT_KV_MEMORY_GIB,
        metavar="G",
        help=f"memory left for the KV pools per rank, GiB (default: {DEFAULT_KV_MEMORY_GIB:g}: a "
        "96 GB RTX PRO 6000 at TP 4 with upstream's default --mem-fraction-static, 0.895, keeps "
        "~85.6 GiB static per rank, ~37 GiB of it DeepSeek-V4-Flash weights, less a margin; a "
        "server logs its own figure as available_bytes on its 'DSV4 memory calculation' line)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="fp8 / bf16 / fp4 side by side, plus what unfixed sizing over-commits for bf16",
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
    if args.page_size < 1:
        raise PlanError(f"--page-size {args.page_size}: must be positive")
    if not args.kv_memory_gib > 0:
        raise PlanError(f"--kv-memory-gib {args.kv_memory_gib:g}: must be positive")
    check_index_k_dtype(args.index_k_dtype)
    return {
        "model_path": check_model_dir(args.model) if args.model else None,
        "tp": args.tp,
        "disaggregation_mode": args.disaggregation_mode,
        "page_size": args.page_size,
        "kv_memory_gib": args.kv_memory_gib,
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
            if args.compare:
                report = compare(**kwargs)
            else:
                report = plan(check_index_k_dtype(args.index_k_dtype), **kwargs)
    except PlanError as exc:
        print(f"sglang-dsv4 plan: {exc}", file=sys.stderr)
        return 2
    except (AssertionError, ValueError, RuntimeError) as exc:
        # Upstream refused the configuration (e.g. a page size its DeepSeek-V4 pools do not take).
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"sglang-dsv4 plan: upstream refused this configuration: {line}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    elif args.compare:
        render_compare(report)
    else:
        render_plan(report)
    return 0


# --- rendering --------------------------------------------------------------------------------


def _gib(nbytes) -> str:
    return "" if nbytes is None else f"{nbytes / GIB:.2f}"


def _count(value) -> str:
    return "" if value is None else f"{value:,}"


def _headline(p: dict) -> str:
    model = Path(p["model"]).name
    return (
        f"{model}: TP {p['tp']}, {p['disaggregation_mode']}, page {p['page_size']}, "
        f"KV memory {p['kv_memory_bytes'] / GIB:g} GiB per rank"
    )


def render_plan(p: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    console.print(f"Memory plan per rank, index-K {p['index_k_dtype']}: {_headline(p)}")
    facts = Table(show_header=False, box=None, pad_edge=False)
    facts.add_column(style="bold")
    facts.add_column(justify="right")
    facts.add_row("bytes per full token", f"{p['bytes_per_full_token']:,.2f}")
    facts.add_row("bytes per SWA token", f"{p['bytes_per_swa_token']:,.2f}")
    facts.add_row("indexer bytes per token", f"{p['indexer_bytes_per_token']}")
    facts.add_row("max total (full) tokens", _count(p["max_total_num_tokens"]))
    facts.add_row("max running requests", _count(p["max_running_requests"]))
    console.print(facts)
    if p["stored_indexer_bytes_per_token"] not in (None, p["indexer_bytes_per_token"]):
        console.print(
            f"[bold red]the c4 indexer pool stores {p['stored_indexer_bytes_per_token']} B/token "
            f"but is priced at {p['indexer_bytes_per_token']}: fix pool-sizing-bf16 is not in force[/]"
        )
    pools = Table(title="pools (allocated on the meta device by upstream's pool classes)")
    pools.add_column("pool")
    pools.add_column("tokens / rows", justify="right")
    pools.add_column("GiB", justify="right")
    for name, part in p["pools"].items():
        pools.add_row(name, _count(part["tokens"]), _gib(part["bytes"]))
    pools.add_row("total", "", _gib(p["allocated_bytes"]), style="bold")
    console.print(pools)


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
    for label, cell in rows:
        table.add_row(label, *(cell(p) for p in plans))
    for name in plans[0]["pools"]:
        table.add_row(f"{name} GiB", *(_gib(p["pools"][name]["bytes"]) for p in plans))
    table.add_row("allocated GiB", *(_gib(p["allocated_bytes"]) for p in plans), style="bold")
    console.print(table)
    over = report["unfixed_bf16_overcommit_bytes"]
    console.print(
        f"Unfixed sizing (c4 indexer priced as fp8) with bf16 keys over-commits "
        f"{over / 1e9:.2f} GB ({over / GIB:.2f} GiB) per rank."
    )
