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

The package, one module per concern, the arrows pointing down:

- `chain`: the upstream chain and the pool builders (also what every fix's tests and the GPU kit
  build pools with: test/support/dsv4.py, benchmark/gpu_check_sglang.py); upstream modules only,
  so they work on upstream patched by the exported series too;
- `budget`: the KV budget a server derives, sessions, the launch command, `plan()`, `compare()`;
- `sweep`: the plan over a grid of configurations;
- `render`: the tables on the terminal;
- `command`: the `sglang-dsv4 plan` arguments and run.

The names below are the plan's public API (`sglang-dsv4 k8s` builds its manifests from `plan()`).
"""

from sglang_dsv4.plan.budget import (
    DEFAULT_GPU,
    GPUS_MIB,
    Budget,
    compare,
    derive_budget,
    launch_command,
    parse_gpu,
    plan,
    sessions,
)
from sglang_dsv4.plan.chain import GIB, MIB, PlanError, default_model_dir, gpu_capacity
from sglang_dsv4.plan.render import render_compare, render_plan, render_sweep
from sglang_dsv4.plan.sweep import SWEEP_AXES, sweep, sweep_cells

__all__ = [
    "DEFAULT_GPU",
    "GIB",
    "GPUS_MIB",
    "MIB",
    "SWEEP_AXES",
    "Budget",
    "PlanError",
    "compare",
    "default_model_dir",
    "derive_budget",
    "gpu_capacity",
    "launch_command",
    "parse_gpu",
    "plan",
    "render_compare",
    "render_plan",
    "render_sweep",
    "sessions",
    "sweep",
    "sweep_cells",
]

