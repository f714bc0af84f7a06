"""The kit's harness: stages and their budgets, the kernels looked up at call time, the run
itself (arguments, interpreter mode, watchdog, exit status), the environment stage, and
`--record`.

A stage is a `Stage` (name, budget, what it proves, the function that runs it); each stage
module lists its own in `STAGES`, and `STAGE_MODULES` orders the modules: a new stage is a new
module (or an entry in one) and a line there.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import import_module, util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KERNEL_PATH = REPO / "sgl-kernel" / "python"
TUNED_FILE = KERNEL_PATH / "sgl_kernel_dsv4" / "tuned_launch.json"

PAGE = 64
HEAD_DIM = 128
TOPK = 512
LIMIT_S = 480  # the whole run must fit the 8 minutes a borrowed GPU host gives
WATCHDOG_MARGIN_S = 30  # past every budget by this much, the run is ended

EXIT_OK, EXIT_CORRECTNESS, EXIT_CANNOT_RUN = 0, 1, 2

# The modules whose STAGES make up a run, in order.
STAGE_MODULES = (
    "benchmark.gpu_check.harness",
    "benchmark.gpu_check.correctness",
    "benchmark.gpu_check.tuner",
    "benchmark.gpu_check.sglang_stage",
)


@dataclass(frozen=True)
class Stage:
    name: str
    budget_s: int
    what: str
    run: Callable  # (kit, rec) -> None; sets rec["ok"]
    needs_cuda: bool = False
    needs_sglang: bool = False
    # a correctness stage that fails, errs or runs out of time makes the exit status 1
    proves_correctness: bool = False


def stages() -> tuple:
    """Every stage of a run, in order (see STAGE_MODULES)."""
    return tuple(stage for module in STAGE_MODULES for stage in import_module(module).STAGES)


@dataclass(frozen=True)
class Sizes:
    """Shapes of one run: the real ones on a GPU, tiny ones for the CPU smoke run."""

    heads: int
    decode_batches: tuple
    decode_keys: tuple
    prefill: tuple  # ((rows, context before the chunk), ...) one request each
    prefill_chunk_rows: int
    graph_keys: int
    speed_cases: tuple  # (batch, keys)
    target_case: tuple  # the shape of the targets
    sweep_case: tuple
    rotation_rows: tuple  # tokens (query) and compressed rows (key write)
    rotation_speed_rows: tuple
    copy_bytes: int
    min_timing_s: float
    min_iters: int


GPU_SIZES = Sizes(
    heads=64,
    decode_batches=(1, 8, 32, 64),
    decode_keys=(8192, 32768, 81920),
    prefill=((3072, 20000), (1024, 1000)),
    prefill_chunk_rows=1024,
    graph_keys=32768,
    speed_cases=((1, 81920), (8, 32768), (32, 81920), (64, 81920)),
    target_case=(32, 81920),
    sweep_case=(32, 81920),
    rotation_rows=(64, 4096),
    rotation_speed_rows=(64, 4096),
    copy_bytes=1 << 30,
    min_timing_s=0.15,
    min_iters=5,
)

SMOKE_SIZES = Sizes(
    heads=64,
    decode_batches=(1, 3),
    decode_keys=(200, 520),
    prefill=((7, 150), (3, 20)),
    prefill_chunk_rows=4,
    graph_keys=300,
    speed_cases=((2, 300),),
    target_case=(2, 300),
    sweep_case=(2, 300),
    rotation_rows=(2, 5),  # the interpreter runs the fused query at ~0.1 s per token
    rotation_speed_rows=(2,),
    copy_bytes=8 << 20,
    min_timing_s=0.0,
    min_iters=1,
)


class StageTimeout(BaseException):
    """The stage's time budget ran out. A BaseException, so that the `except Exception` a stage
    keeps around one case or config (to report it and go on) never swallows it."""


class KitError(Exception):
    """The kit cannot run as asked; the message is the one line the user reads."""


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]


# --- the kernels, looked up at call time ---------------------------------------------------


class Kernels:
    """sgl_kernel_dsv4's entry points. Attributes are read at each call, never bound once, so a
    replaced function (a test that breaks it on purpose) is the one run."""

    def __init__(self):
        self.logits = import_module("sgl_kernel_dsv4.index_logits")
        self.reference = import_module("sgl_kernel_dsv4.fp8_reference")
        self.rotation = import_module("sgl_kernel_dsv4.index_rotation")
        self._launcher = None
        self._rotation_triton = None

    def triton(self, *args):
        return self.logits.bf16_paged_mqa_logits_triton(*args)

    def torch_path(self, *args):
        return self.logits.bf16_paged_mqa_logits_torch(*args)

    @property
    def launcher(self):
        """sgl_kernel_dsv4.index_logits_triton (imports Triton: only once the mode is set)."""
        if self._launcher is None:
            self._launcher = import_module("sgl_kernel_dsv4.index_logits_triton")
        return self._launcher

    @property
    def rotation_triton(self):
        """sgl_kernel_dsv4.index_rotation_triton (imports Triton: only once the mode is set)."""
        if self._rotation_triton is None:
            self._rotation_triton = import_module("sgl_kernel_dsv4.index_rotation_triton")
        return self._rotation_triton

    @rotation_triton.setter
    def rotation_triton(self, module):
        self._rotation_triton = module

    def launch_candidates(self) -> list:
        return [dict(c) for c in self.launcher.LAUNCH_SWEEP]

    def launch(self, args, config):
        q, kv, weights, seq_lens, table, width = args
        return self.launcher.launch(q, kv, weights, seq_lens.view(-1), table, width, config=config)

    def default_config(self, device):
        return self.launcher.launch_config_for(device)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def release(kit):
    if kit.cuda:
        kit.torch.cuda.empty_cache()


def time_us(kit, fn) -> float:
    """Mean microseconds per call: CUDA events on a GPU (warm-up first, then enough calls to
    fill the minimum timing window), wall clock on the CPU."""
    torch = kit.torch
    sizes = kit.sizes
    if not kit.cuda:
        fn()
        start = time.perf_counter()
        for _ in range(sizes.min_iters):
            fn()
        return (time.perf_counter() - start) / sizes.min_iters * 1e6
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once_s = max(start.elapsed_time(end) / 1e3, 1e-6)
    iters = max(sizes.min_iters, min(500, int(sizes.min_timing_s / once_s)))
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


# --- the environment stage -------------------------------------------------------------------


def stage_environment(kit, rec):
    torch = kit.torch
    env = kit.report["environment"]
    env.update(
        python=platform.python_version(),
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        platform=platform.platform(),
        triton_interpret=os.environ.get("TRITON_INTERPRET", ""),
    )
    try:
        env["triton"] = import_module("triton").__version__
    except ImportError as exc:
        env["triton"] = f"not importable ({one_line(exc)})"
    env["sglang"] = kit.sglang_version or kit.sglang_absent
    env["deep_gemm"] = "importable" if util.find_spec("deep_gemm") else "absent"
    if kit.cuda:
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=torch.cuda.get_device_name(0),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            sm_count=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
        )
    else:
        env.update(gpu="cpu", capability="cpu", sm_count=os.cpu_count(), memory_gib=None)
    env["kernel_package"] = str(Path(kit.kernels.logits.__file__).parent)
    env["launch_candidates"] = len(kit.kernels.launch_candidates())
    try:
        env["launch_config_for_this_device"] = kit.kernels.default_config(kit.device)
    except Exception as exc:  # report it; the sweep stage still measures
        env["launch_config_for_this_device"] = f"error: {one_line(exc)}"

    # Device copy bandwidth: read + write bytes of a large copy over its time (as bandwidthTest).
    n = kit.sizes.copy_bytes
    src = torch.empty(n, dtype=torch.uint8, device=kit.device).fill_(1)
    dst = torch.empty_like(src)
    us = time_us(kit, functools.partial(dst.copy_, src))
    env["copy_bandwidth_gbps"] = round(2 * n / (us * 1e-6) / 1e9, 1)
    env["copy_bytes"] = n
    del src, dst
    release(kit)
    rec["ok"] = True


STAGES = (Stage("environment", 20, "GPU, versions, measured copy bandwidth", stage_environment),)


# --- running, budgets ------------------------------------------------------------------------


class Kit:
    def __init__(self, args):
        import torch

        self.torch = torch
        self.smoke = args.smoke
        self.cuda = not args.smoke
        self.device = "cuda" if self.cuda else "cpu"
        self.sizes = SMOKE_SIZES if args.smoke else GPU_SIZES
        self.out = args.out
        self.quiet = args.quiet
        self.kernels = Kernels()
        self.sglang_version, self.sglang_absent = sglang_version(args)
        self.tuned = None
        self.stages = stages()
        self.report = {
            "kit": "gpu_check",
            "mode": "smoke (CPU, TRITON_INTERPRET=1)" if args.smoke else "gpu",
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "environment": {},
            "budgets": {s.name: s.budget_s for s in self.stages},
            "budget_total_s": sum(s.budget_s for s in self.stages),
            "limit_s": LIMIT_S,
            "stages": {},
        }

    def progress(self, text):
        if not self.quiet:
            print(text, flush=True)


def sglang_version(args) -> tuple:
    """(sglang's version, None) when it is importable and wanted, else (None, why not). A GPU
    run uses it when present; the smoke run only with --with-sglang (its import takes seconds)."""
    if args.without_sglang:
        return None, "not used (--without-sglang)"
    if args.smoke and not args.with_sglang:
        return None, "not used (smoke run without --with-sglang)"
    if util.find_spec("sglang") is None:
        return None, "not importable"
    try:
        return import_module("sglang").__version__, None
    except Exception as exc:
        return None, f"not importable ({one_line(exc)})"


def on_alarm(signum, frame):
    raise StageTimeout()


def run_stage(kit, stage) -> dict:
    rec = {"status": "running", "budget_s": stage.budget_s, "cases": [], "notes": []}
    kit.report["stages"][stage.name] = rec
    if stage.needs_cuda and not kit.cuda:
        rec["status"] = "skipped (no CUDA)"
        return rec
    if stage.needs_sglang and not kit.sglang_version:
        rec["status"] = f"skipped (sglang {kit.sglang_absent})"
        return rec
    kit.progress(f"[{stage.name}] budget {stage.budget_s} s: {stage.what}")
    started = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, stage.budget_s)
    try:
        stage.run(kit, rec)
        rec["status"] = "passed" if rec.get("ok") else "FAILED"
    except StageTimeout:
        rec["status"] = "over budget (stopped)"
        rec["notes"].append(f"stopped at its {stage.budget_s} s budget")
    except Exception as exc:
        rec["status"] = "error"
        rec["error"] = one_line(exc)
        traceback.print_exc(file=sys.stderr)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        rec["seconds"] = round(time.perf_counter() - started, 2)
        if kit.cuda:
            kit.torch.cuda.synchronize()
            kit.torch.cuda.empty_cache()
    kit.progress(f"[{stage.name}] {rec['status']} in {rec['seconds']} s")
    return rec


def correctness_failures(kit) -> list:
    """Stages whose correctness is not proven: failed, erred, or stopped before the end."""
    failures = []
    for stage in kit.stages:
        rec = kit.report["stages"].get(stage.name)
        status = "not run" if rec is None else rec.get("status", "not run")
        if rec is None or status.startswith("skipped"):
            continue
        if stage.proves_correctness and status != "passed":
            failures.append(f"{stage.name}: {status}")
        elif stage.name == "launch_sweep" and any(c.get("ok") is False for c in rec["cases"]):
            failures.append("launch_sweep: a launch config gave wrong logits")
    return failures


def result_line(kit, failures) -> str:
    if failures:
        return "correctness FAILED"
    if kit.smoke:
        return "smoke run passed (CPU interpreter; CUDA stages skipped, nothing proven on a GPU)"
    unproven = [
        s.name
        for s in kit.stages
        if s.proves_correctness
        and s.name != "sglang"
        and kit.report["stages"].get(s.name, {}).get("status") != "passed"
    ]
    if unproven:
        return f"no correctness failure, but not run: {', '.join(unproven)}"
    return f"correctness proven on {kit.report['environment'].get('gpu')}"


def record_tuned(kit, failures) -> str:
    """Merge this run's best launch config into the project's table (other GPUs kept), only
    from a run that proved correctness and whose sweep passed; written atomically (a new file
    renamed over the old), so a crash mid-write never leaves a table that breaks every start."""
    sweep = kit.report["stages"].get("launch_sweep", {})
    if failures:
        return f"not recorded: correctness not proven ({'; '.join(failures)})"
    if sweep.get("status") != "passed" or not kit.tuned:
        return f"not recorded: the launch sweep {sweep.get('status', 'did not run')}"
    table = json.loads(TUNED_FILE.read_text() or "{}") if TUNED_FILE.exists() else {}
    table.update(kit.tuned)
    text = json.dumps(dict(sorted(table.items())), indent=2) + "\n"
    partial = TUNED_FILE.with_name(TUNED_FILE.name + ".partial")
    partial.write_text(text)
    os.replace(partial, TUNED_FILE)
    return f"recorded {', '.join(kit.tuned)} in {TUNED_FILE.relative_to(REPO)}"


def plan_text() -> str:
    lines = ["stage          budget  needs        what"]
    run = stages()
    for s in run:
        needs = "+".join(n for n, f in (("CUDA", s.needs_cuda), ("sglang", s.needs_sglang)) if f)
        lines.append(f"{s.name:<14} {s.budget_s:>4} s  {needs or '-':<12} {s.what}")
    total = sum(s.budget_s for s in run)
    lines.append(
        f"{'total':<14} {total:>4} s  (limit {LIMIT_S} s; a stage past its budget is stopped; "
        f"the watchdog ends the run at {total + WATCHDOG_MARGIN_S} s)"
    )
    return "\n".join(lines)


def parse_args(argv):
    from benchmark import gpu_check

    parser = argparse.ArgumentParser(
        prog="python -m benchmark.gpu_check", description=gpu_check.__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "out" / "gpu-check",
        help="folder for gpu_check.json, gpu_check.md, tuned_launch.json (default: %(default)s)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the same stages on the CPU: TRITON_INTERPRET=1, tiny shapes, seconds",
    )
    parser.add_argument(
        "--plan", action="store_true", help="print the stages and budgets; run nothing"
    )
    parser.add_argument(
        "--only",
        type=lambda s: [x for x in s.split(",") if x],
        help="comma-separated stages to run (environment always runs)",
    )
    parser.add_argument(
        "--record",
        action="store_true",
        help="merge the sweep's best config into sgl_kernel_dsv4/tuned_launch.json "
        "(only from a run that proved correctness)",
    )
    parser.add_argument(
        "--with-sglang",
        action="store_true",
        help="smoke run: use sglang too when importable (slow to import)",
    )
    parser.add_argument(
        "--without-sglang",
        action="store_true",
        help="act as on a host without sglang even when it is importable",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    names = [s.name for s in stages()]
    if args.only and not set(args.only) <= set(names):
        parser.error(
            f"--only: unknown stage(s) {sorted(set(args.only) - set(names))}; "
            f"stages: {', '.join(names)}"
        )
    if args.record and args.smoke:
        parser.error("--record keeps GPU measurements only; it cannot go with --smoke")
    if args.with_sglang and args.without_sglang:
        parser.error("--with-sglang and --without-sglang contradict each other")
    return args


def prepare_imports(smoke: bool):
    """The kernel package from this tree, and the interpreter chosen before Triton loads: set
    for --smoke, refused for a GPU run (the kernels would run interpreted on the CPU and prove
    nothing about the GPU)."""
    if smoke:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise KitError("--smoke needs TRITON_INTERPRET=1 before Triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        raise KitError(
            "TRITON_INTERPRET=1 is set: a GPU run would interpret the kernels on the CPU; "
            "unset it (or run --smoke)"
        )
    for path in (str(KERNEL_PATH), str(REPO)):
        if path not in sys.path:
            sys.path.insert(0, path)
    if util.find_spec("sgl_kernel_dsv4") is None:
        raise KitError(f"sgl_kernel_dsv4 not importable (looked in {KERNEL_PATH})")


def main(argv=None) -> int:
    from benchmark.gpu_check import report

    args = parse_args(argv)
    if args.plan:
        print(plan_text())
        return EXIT_OK
    try:
        prepare_imports(args.smoke)
        import torch

        if not args.smoke and not torch.cuda.is_available():
            raise KitError(
                "no CUDA device (torch.cuda.is_available() is False); --smoke runs the CPU dry run"
            )
        kit = Kit(args)
    except KitError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    kit.out.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    # Past every budget plus a margin, something hangs on the device: write what there is, stop.
    watchdog = threading.Timer(
        kit.report["budget_total_s"] + WATCHDOG_MARGIN_S, hard_stop, args=(kit,)
    )
    watchdog.daemon = True
    watchdog.start()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        for stage in kit.stages:
            if args.only and stage.name != "environment" and stage.name not in args.only:
                continue
            run_stage(kit, stage)
    finally:
        signal.signal(signal.SIGALRM, previous)
        watchdog.cancel()
    kit.report["seconds"] = round(time.perf_counter() - started, 1)
    kit.report["targets"] = report.targets(kit)
    failures = correctness_failures(kit)
    kit.report["correctness_failures"] = failures
    kit.report["result"] = result_line(kit, failures)
    kit.report["sglang_imported"] = "sglang" in sys.modules
    code = EXIT_CORRECTNESS if failures else EXIT_OK
    kit.report["exit_status"] = code
    report.write_reports(kit)
    if args.record:
        line = record_tuned(kit, failures)
        print(f"gpu_check: --record: {line}", file=sys.stdout if line.startswith("rec") else sys.stderr)
    for line in kit.report["targets"]:
        print(f"target {line['status']}: {line['target']}: {report.fmt(line.get('value'))}")
    print(
        f"gpu_check: {kit.report['result']} ({kit.report['seconds']} s); "
        f"report in {kit.out / 'gpu_check.md'}"
    )
    for failure in failures:
        print(f"gpu_check: correctness not proven: {failure}", file=sys.stderr)
    return code


def hard_stop(kit):
    from benchmark.gpu_check import report

    kit.report["result"] = "stopped by the watchdog: the run outlived every budget"
    kit.report["exit_status"] = EXIT_CORRECTNESS
    try:
        report.write_reports(kit)
    finally:
        print(
            "gpu_check: stopped by the watchdog (a stage hung past every budget)", file=sys.stderr
        )
        os._exit(EXIT_CORRECTNESS)
