"""The operator's questions: the KV budget a server derives, sessions, the launch command, one
plan and the dtype comparison."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

# Not from sglang_dsv4.fixes: these builders also serve the run on upstream patched by the
# exported series, which imports no fix module (sglang_dsv4.index_k_dtype imports nothing).
from sglang_dsv4.index_k_dtype import (
    INDEX_K_DTYPE_ENV,
    INDEX_K_DTYPES,
)
from sglang_dsv4.plan.chain import (
    DSV4_PAGE_SIZE,
    GIB,
    MIB,
    MTP_SERVER_ARGS,
    Chain,
    PlanError,
    activated,
    build_chain,
    build_pool,
    build_pools,
    default_model_dir,
    one_more_page_bytes,
    pool_breakdown,
    size_for_budget,
    storage_bytes,
)

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


