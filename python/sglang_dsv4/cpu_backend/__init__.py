"""Register entry: cpu-backend — DeepSeek-V4 on `--device cpu`, for development and tests.

NOT FOR UPSTREAM. This entry is not in `sglang_dsv4.fixes.REGISTER`: `sglang-dsv4
export-patches` never exports it and `sglang-dsv4 rebase-check` never asks whether it is still
needed. It exists so that upstream's own DeepSeek-V4 model code runs a real forward with no GPU.

Target: the CUDA-only JIT op wrappers a DeepSeek-V4 forward calls
  (`sglang.kernels.ops.attention.dsv4.compress`: CompressorPrefillPlan.generate,
  CompressorDecodePlan.generate, compress_forward, compress_norm_rope_store;
  `sglang.kernels.ops.attention.dsv4.norm_rope`: fused_q_norm_rope, fused_rope_inplace,
  fused_q_indexer_rope_hadamard_quant, fused_k_norm_rope_flashmla), the CPU rope factory
  (`sglang.srt.layers.rotary_embedding.factory.get_rope_wrapper`) and the DSA top-k backend
  (`sglang.srt.layers.attention.dsa.dsa_topk_backend.DSATopKBackend.resolve`); for speed, the
  Triton kernels a CPU forward would run interpreted (mhc_combine, fused_hc_head,
  init_compression_metadata, hc_split_sinkhorn, hash_topk) and upstream's torch sparse MLA and
  fp8 index logits (`flash_mla_with_kvcache_sm120`, `fp8_paged_mqa_logits_torch_sm120`: a
  byte-wise gather per index, a bf16 matmul the CPU runs slowly).
Why: upstream 0.5.23 builds the model, the DSV4 KV pool and `DeepseekV4AttnBackend` on the CPU,
  but the forward stops at eight JIT CUDA ops (sources in the wheel under
  `sglang/kernels/jit/csrc/deepseek_v4/`), a `pin_memory=True` buffer in the prefill plan,
  `get_rope_cpu` asserting on the sliding-window layers (no rope scaling), the generic rope
  importing vllm unless `_is_cpu`, and the sgl-kernel top-k.
How: torch versions of those ops (`ops`), each written from the CUDA source it stands for and
  writing the same bytes; upstream's own CPU-capable paths switched on (`SWITCHES`, and the
  platform fact is_sm120 so that the sm_120 torch sparse-MLA and fp8 MQA-logits paths are the
  ones taken). On only when the server runs with `--device cpu` on a DeepSeek-V4 model; any other
  process gets no hook and no switch from it (`sglang-dsv4 status` says which).
Upstream: not for upstream (development and tests only).
Remove when: never; it is how the distribution is tested without a GPU.

Activation: the process that parses the command line (`python -m sglang.launch_server ...`)
decides from `--device` and `--model-path` and records the decision in SGLANG_DSV4_CPU_BACKEND
for the processes it starts (schedulers read it when they load the plugin). Setting
SGLANG_DSV4_CPU_BACKEND=1 yourself turns it on for an in-process driver; 0 keeps it off.
SGLANG_DSV4_CPU_TRITON=1 (with SGLANG_DSV4_INDEX_K_DTYPE=bf16) also routes the bf16 index logits
through the project's Triton kernel under the interpreter (`triton_hooks`), for tests; otherwise
they take `sparse_attention.bf16_paged_mqa_logits` (`index_hooks`). A PD server's NIXL buffers
are registered and moved as host memory and a prefill's early send of a cached prefix records no
CUDA event (`nixl_hooks`); its NIXL progress threads wait when idle instead of polling a core
flat out (`nixl_progress`). A HiCache server's host pools are plain host memory and their pages
move by torch copies (`hicache_hooks`). With
`--enable-deterministic-inference` the launcher accepts the dsv4 backend and upstream's
batch-invariant mode runs on the CPU: row-blocked GEMMs and the batch-independent paths of the
CPU attention and index scores (`batch_invariant`). A launch_server command line
that sizes no KV pool gets `--max-total-tokens DEFAULT_POOL_TOKENS` (`_default_pool`), and one
without `--sleep-on-idle` gets it, so an idle CPU server waits on its sockets instead of polling a
core flat out (`_default_sleep_on_idle`; SGLANG_DSV4_CPU_SLEEP_ON_IDLE=0 or a `--config` file
keeps upstream's default).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger("sglang_dsv4")

ID = "cpu-backend"
TITLE = "DeepSeek-V4 on --device cpu: torch versions of the CUDA-only ops (development and tests)"
ENV = "SGLANG_DSV4_CPU_BACKEND"
# 1: the bf16 index logits run the project's Triton kernel (interpreted) instead of torch.
TRITON_ENV = "SGLANG_DSV4_CPU_TRITON"
MODULE = "sglang_dsv4.cpu_backend.hooks"
UPSTREAM_MODULES = (
    "sglang.kernels.ops.attention.dsv4.compress",
    "sglang.kernels.ops.attention.dsv4.norm_rope",
    "sglang.srt.layers.rotary_embedding.factory",
    "sglang.srt.layers.attention.dsa.dsa_topk_backend",
    "sglang.kernels.ops.layernorm.mhc",
    "sglang.kernels.ops.activation.silu_and_mul_clamp",
    "sglang.kernels.ops.moe.dsv4",
    "sglang.kernels.ops.attention.flash_mla_sm120",
    "sglang.kernels.ops.layernorm.mhc_head",
    "sglang.kernels.ops.attention.dsv4.metadata_kernel",
    "sglang.srt.layers.attention.dsv4.indexer",
)
DSV4_ARCHITECTURES = ("DeepseekV4ForCausalLM",)
# Intra-op threads of torch in a process where the backend is on (default 1). A forward of the
# tiny model is thousands of small ops: with two threads each op's parallel region waits for
# the second thread, and on a shared 2-core machine (the suite runs several servers) that
# thread is often descheduled, which made a decode step's attention some 30 times slower.
THREADS_ENV = "SGLANG_DSV4_CPU_THREADS"

# Upstream's own switches to its CPU-capable paths (sglang/srt/environ.py names them).
SWITCHES = {
    "SGLANG_SM120_FLASHMLA_BACKEND": "torch",  # sparse MLA in torch (flash_mla_sm120)
    "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1",  # fp8 paged MQA logits in torch (indexer)
    "SGLANG_OPT_USE_TILELANG_INDEXER": "0",
    "SGLANG_OPT_FUSE_MHC_POST_PRE": "0",
    "SGLANG_OPT_USE_TILELANG_MHC_PRE": "0",
    "SGLANG_OPT_USE_TILELANG_MHC_POST": "0",
    "SGLANG_OPT_USE_ONLINE_COMPRESS": "0",  # the online c128 state pool has no torch version
    "SGLANG_DSV4_FP4_EXPERTS": "0",  # bf16 experts: the mxfp4 MoE kernels need CUDA
    # Upstream's Triton kernels that have no torch path (metadata, hc_split_sinkhorn, hash
    # top-k) and the distribution's own run under the interpreter.
    "TRITON_INTERPRET": "1",
}
PLATFORM_FACTS = {"is_sm120": True}
# The KV pool a `python -m sglang.launch_server --device cpu` gets when its command line sizes none:
# upstream sizes the pools from the host's free memory (~23.9M tokens, 15 GB on a 24 GB machine),
# and zero-filling that took 37 of a 67 s start, and held the memory for the server's life. This
# is every request of the tiny model's default cap (256) at its full context (4096): 0.7 GB, ~2 s.
# --max-total-tokens, --mem-fraction-static or --config on the command line keep upstream's sizing.
DEFAULT_POOL_TOKENS = 256 * 4096
_POOL_FLAGS = ("--max-total-tokens", "--mem-fraction-static", "--config")
# Upstream's scheduler polls its sockets without pause when it has no work unless started with
# --sleep-on-idle (a server idle for 69 minutes on a 2-core machine burnt one core all along).
# A CPU server gets the flag unless this variable is 0 or a --config file decides (upstream's
# flag is store_true: a config file is the only way upstream has to say false explicitly).
SLEEP_ENV = "SGLANG_DSV4_CPU_SLEEP_ON_IDLE"
_SLEEP_FLAG = "--sleep-on-idle"
_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

_state = {"on": False, "reason": "the dsv4_sm120 plugin did not run", "platform": None}


def _argv_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def is_deepseek_v4(model_path: str | None) -> bool:
    """Whether the checkpoint at `model_path` (a directory with config.json) is DeepSeek-V4."""
    if not model_path:
        return False
    config = Path(model_path) / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    archs = data.get("architectures") or ()
    return any(a in DSV4_ARCHITECTURES for a in archs) or data.get("model_type") == "deepseek_v4"


def decide(argv: list[str] | None = None, environ=None) -> tuple[bool, str]:
    """(on, why) for this process: SGLANG_DSV4_CPU_BACKEND when set, else the command line."""
    environ = os.environ if environ is None else environ
    argv = sys.argv if argv is None else argv
    value = (environ.get(ENV) or "").strip().lower()
    if value in _ON:
        return True, f"{ENV}={environ.get(ENV)}"
    if value in _OFF:
        return False, f"{ENV}={environ.get(ENV)}"
    if value:
        raise ValueError(f"{ENV}={environ.get(ENV)!r}: use 1 or 0")
    device = _argv_value(argv, "--device")
    if device != "cpu":
        return False, "not a --device cpu run"
    model = _argv_value(argv, "--model-path") or _argv_value(argv, "--model")
    if not is_deepseek_v4(model):
        return False, "--device cpu, but the model is not DeepSeek-V4"
    return True, "--device cpu on a DeepSeek-V4 model"


def entries(argv: list[str] | None = None, environ=None) -> tuple:
    """The plugin's entries for this process: the backend's, or none (nothing hooked).

    When on, sets upstream's switches and records the decision for child processes."""
    environ = os.environ if environ is None else environ
    on, why = decide(argv, environ)
    _state.update(on=on, reason=why)
    if not why.startswith(ENV):
        environ[ENV] = "1" if on else "0"  # the processes this one starts inherit the decision
    if not on:
        return ()
    for name, value in SWITCHES.items():
        if environ.get(name, value) != value:
            logger.warning("sglang-dsv4 cpu backend: %s=%s overridden to %s", name,
                           environ[name], value)
        environ[name] = value
    if argv is None:  # this process's own command line, not a caller's list
        _default_pool(sys.argv)
        _default_sleep_on_idle(sys.argv, environ)
    entries = [_entry(ID, MODULE, UPSTREAM_MODULES)]
    if (environ.get(TRITON_ENV) or "").strip() == "1":
        entries.append(_entry("cpu-backend-triton", "sglang_dsv4.cpu_backend.triton_hooks",
                              ("sgl_kernel_dsv4.index_logits",)))
    else:
        entries.append(_entry("cpu-backend-index", "sglang_dsv4.cpu_backend.index_hooks",
                              ("sgl_kernel_dsv4.index_logits",)))
    # PD: the NIXL manager's buffers are host memory (imported only by a PD server).
    entries.append(_entry("cpu-backend-nixl", "sglang_dsv4.cpu_backend.nixl_hooks",
                          ("sglang.srt.disaggregation.nixl.conn",
                           "sglang.srt.disaggregation.prefill")))
    # HiCache: host pools without cudaHostRegister, pages moved by torch.
    entries.append(_entry("cpu-backend-hicache", "sglang_dsv4.cpu_backend.hicache_hooks",
                          ("sglang.srt.mem_cache.pool_host.base",
                           "sglang.srt.mem_cache.pool_host.common",
                           "sglang.srt.mem_cache.memory_pool_host")))
    # --enable-deterministic-inference: the launcher accepts it for dsv4, the schedulers' mode
    # switch and RMSNorm branch run on the CPU.
    from sglang_dsv4.cpu_backend import batch_invariant

    batch_invariant.allow_dsv4_deterministic()
    entries.append(_entry(batch_invariant.ID, "sglang_dsv4.cpu_backend.batch_invariant",
                          batch_invariant.UPSTREAM_MODULES))
    return tuple(entries)


def _default_pool(argv: list[str]) -> None:
    """Add `--max-total-tokens DEFAULT_POOL_TOKENS` to a launch_server command line that sizes no
    pool (upstream's launcher parses `sys.argv` after loading the plugins; its schedulers get the
    parsed arguments)."""
    if not _is_launch_server(argv):
        return
    if _gives_any(argv, _POOL_FLAGS):
        return
    argv += ["--max-total-tokens", str(DEFAULT_POOL_TOKENS)]
    logger.info("sglang-dsv4 cpu backend: --max-total-tokens %d (no pool size given)",
                DEFAULT_POOL_TOKENS)


def _default_sleep_on_idle(argv: list[str], environ=None) -> None:
    """Add `--sleep-on-idle` to a launch_server command line that does not set it, unless
    SGLANG_DSV4_CPU_SLEEP_ON_IDLE=0 or a `--config` file carries the server's settings."""
    environ = os.environ if environ is None else environ
    if not _is_launch_server(argv):
        return
    value = (environ.get(SLEEP_ENV) or "1").strip().lower()
    if value in _OFF:
        return
    if value not in _ON:
        raise ValueError(f"{SLEEP_ENV}={environ.get(SLEEP_ENV)!r}: use 1 or 0")
    if _gives_any(argv, (_SLEEP_FLAG, "--config")):
        return
    argv.append(_SLEEP_FLAG)
    logger.info("sglang-dsv4 cpu backend: %s (an idle CPU server waits on its sockets)",
                _SLEEP_FLAG)


def _is_launch_server(argv: list[str]) -> bool:
    return bool(argv) and os.path.basename(argv[0]).removesuffix(".py").endswith("launch_server")


def _gives_any(argv: list[str], flags: tuple[str, ...]) -> bool:
    """Whether the command line (after the program) sets one of `flags` (`--f v` or `--f=v`)."""
    return any(a == f or a.startswith(f + "=") for a in argv[1:] for f in flags)


def _entry(entry_id: str, module: str, upstream_modules: tuple[str, ...]):
    """The plugin's view of a backend part: a register `Entry` whose id is not its module's name."""
    from sglang_dsv4.fixes import Entry

    class CpuBackendEntry(Entry):
        @property
        def id(self) -> str:
            return entry_id

    return CpuBackendEntry(module, upstream_modules)


def install_platform() -> None:
    """Declare the sm_120 platform facts (upstream's `override_platform`) and set torch's
    intra-op threads (`torch_threads`), once per process."""
    if _state["platform"] is not None or not _state["on"]:
        return
    from sglang.srt.runtime_context import override_platform

    _state["platform"] = override_platform(**PLATFORM_FACTS).install()
    import torch

    torch.set_num_threads(torch_threads())


def torch_threads(environ=None) -> int:
    """The intra-op threads a CPU-backend process runs torch with: SGLANG_DSV4_CPU_THREADS, 1
    when unset."""
    environ = os.environ if environ is None else environ
    value = (environ.get(THREADS_ENV) or "1").strip()
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{THREADS_ENV}={value!r}: use a positive number of threads")
    return int(value)


def describe(plugin_state: dict | None = None) -> dict:
    """The backend as `sglang-dsv4 status` reports it."""
    if not _state["on"]:
        return {"on": False, "hooks": 0, "summary": f"off, 0 hooks ({_state['reason']})"}
    from sglang_dsv4.cpu_backend.hooks import FIX

    st = (plugin_state or {}).get(ID)
    status = st.status if st else "not loaded"
    reason = f": {st.reason}" if st and st.reason else ""
    return {
        "on": True,
        "hooks": len(FIX.replaces),
        "status": status,
        "switches": dict(SWITCHES),
        "summary": f"on ({_state['reason']}), {len(FIX.replaces)} hooks {status}{reason}",
    }
