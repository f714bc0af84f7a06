"""Triton kernel behind `bf16_paged_mqa_logits_triton` (contract: `index_contract`, `index_logits`).

Written for sm_120 (RTX PRO 6000): `tl.dot` on bf16 (mma.sync; sm_120 has no wgmma or TMA).
Per program the query [128, H] is 16 KB in bf16 at 64 heads, and `num_stages - 1` key tiles of
`pages_per_step` 64-key pages (16 KB per page) are in flight at once: the page-table entries of a
worker's next step are loaded one step ahead, so a step's key load depends on no load of its own
iteration and Triton's pipeliner multi-buffers it (cp.async). The default on sm_120, one page
per dot and three stages, keeps two 16 KB key tiles in flight (TTGIR: a
`memdesc<2x64x128xbf16>` key buffer, `async_wait {num = 1}` in the loop) in 49,664 B of shared
memory: two programs per SM in sm_120's 100 KB. `sglang-dsv4 kernels` shows it for every config.

Launch rule (work follows the keys a row has, not the page table's width):
- The grid is (rows, workers). `workers` comes from argument shapes and the launch config only
  (CUDA-graph safe): the device's resident slots (`programs_per_sm`, the programs the compiled
  kernel fits per SM, x SM count) shared by the rows, rounded down so that the whole grid is one
  wave whenever the rows fit the slots (no tail of programs running alone), and never more than
  the steps the widest row could have. Each worker walks its steps round robin (persistent).
- Each program reads its row's `seq_len` and walks that row's pages only, round robin with the
  row's other workers (page steps w, w + workers, ...). A worker with no page of its row loads
  nothing and computes nothing. Past the row's last page nothing is read or computed: the
  workers fill it with -inf in blocks of FILL_BLOCK 4-byte stores; inside it, positions past
  `seq_len` get -inf too.

Launch config (a dict; `launch_config_for(device)` picks one):
    pages_per_step   64-key pages scored by one dot (1, 2 or 4)
    programs_per_sm  programs resident per SM (at most what the compiled kernel fits: checked
                     by `sglang-dsv4 kernels` for each target)
    num_warps, num_stages   Triton's own knobs
    sm_count         the device's SM count (filled from the device when absent)
A measured entry in `tuned_launch.json` (keyed by `torch.cuda.get_device_name()`, used when its
"capability" matches the device) wins over the heuristic.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from sgl_kernel_dsv4.index_contract import HEAD_DIM, MAX_HEADS, PAGE_TOKENS

FILL_BLOCK = 1024  # -inf positions one program stores at once past a row's last page
TUNED_LAUNCH_FILE = Path(__file__).with_name("tuned_launch.json")
# What the ahead-of-time check (`compile_check`, `sglang-dsv4 kernels --record`) passed.
RECORD_FILE = Path(__file__).with_name("launch_checked.json")
CONFIG_KEYS = ("pages_per_step", "programs_per_sm", "num_warps", "num_stages", "sm_count")

# Candidates a tuner times on a device (benchmark/gpu_check/tuner.py); sm_count comes from the
# device. On sm_120 each keeps two or three key tiles in flight per program, fits at 64 and 128
# heads without spills, and asks for no more programs per SM than fit (`sglang-dsv4 kernels`).
LAUNCH_SWEEP = [
    {"pages_per_step": 1, "programs_per_sm": 2, "num_warps": 4, "num_stages": 3},
    {"pages_per_step": 1, "programs_per_sm": 2, "num_warps": 8, "num_stages": 3},
    {"pages_per_step": 1, "programs_per_sm": 1, "num_warps": 4, "num_stages": 4},
    {"pages_per_step": 2, "programs_per_sm": 1, "num_warps": 4, "num_stages": 3},
    {"pages_per_step": 2, "programs_per_sm": 1, "num_warps": 8, "num_stages": 3},
]
# Programs of the default config resident per SM, by compute capability (the compiled kernel's
# shared memory against the SM's: `sglang-dsv4 kernels`); others get the sm_120 figure.
DEFAULT_RESIDENT = {(12, 0): 2, (9, 0): 3, (10, 0): 3}


@triton.jit
def _bf16_paged_mqa_logits_kernel(
    q_ptr,
    kv_ptr,
    weights_ptr,
    seq_lens_ptr,
    page_table_ptr,
    out_ptr,
    q_row_stride,
    q_head_stride,
    kv_page_stride,
    kv_token_stride,
    weights_row_stride,
    weights_head_stride,
    seq_lens_stride,
    page_table_row_stride,
    page_table_col_stride,
    out_row_stride,
    num_heads,
    table_cols,
    max_seq_len,
    PAGE: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGES_PER_STEP: tl.constexpr,
    FILL_BLOCK: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    worker = tl.program_id(1)
    workers = tl.num_programs(1)
    STEP: tl.constexpr = PAGE * PAGES_PER_STEP

    # Positions this row has in the output; only their pages are visited.
    length = tl.minimum(tl.load(seq_lens_ptr + row * seq_lens_stride), max_seq_len)
    row_steps = tl.cdiv(length, STEP)
    # the page steps store up to the end of the row's last page (-inf past seq_len inside it)
    store_end = tl.minimum(tl.cdiv(length, PAGE) * PAGE, max_seq_len)
    # The rest of the row, [store_end, max_seq_len), is -inf (upstream's contract: its torch
    # top-k gathers these scores): plain 4-byte stores in blocks, shared round robin by the
    # row's workers; nothing is loaded for them.
    out_row = out_ptr + row * out_row_stride
    fills = tl.arange(0, FILL_BLOCK)
    for block in range(worker, tl.cdiv(max_seq_len - store_end, FILL_BLOCK), workers):
        tail = store_end + block * FILL_BLOCK + fills
        tl.store(out_row + tail, tl.full((FILL_BLOCK,), float("-inf"), tl.float32),
                 mask=tail < max_seq_len)
    if worker < row_steps:
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, DIM)
        offsets = tl.arange(0, STEP)
        head_ok = heads < num_heads
        # The query is loaded transposed, [DIM, BLOCK_H], so one dot gives [STEP, BLOCK_H]
        # scores; padded heads are zero and carry zero weight.
        query = tl.load(
            q_ptr + row * q_row_stride + heads[None, :] * q_head_stride + dims[:, None],
            mask=head_ok[None, :],
            other=0.0,
        )
        head_weights = tl.load(
            weights_ptr + row * weights_row_stride + heads * weights_head_stride,
            mask=head_ok,
            other=0.0,
        )
        # The page-table entries of the worker's next step are loaded one step ahead, so the
        # key load of a step depends on no load of its own iteration.
        table_row = page_table_ptr + row * page_table_row_stride
        positions = worker * STEP + offsets
        cols = positions // PAGE
        page = tl.load(table_row + cols * page_table_col_stride,
                       mask=(positions < length) & (cols < table_cols), other=-1)
        for step in range(worker, row_steps, workers):
            positions = step * STEP + offsets
            in_row = positions < length
            valid = in_row & (page >= 0)
            keys = tl.load(
                kv_ptr
                + page.to(tl.int64)[:, None] * kv_page_stride
                + (positions % PAGE)[:, None] * kv_token_stride
                + dims[None, :],
                mask=valid[:, None],
                other=0.0,
            )
            ahead = positions + workers * STEP
            ahead_cols = ahead // PAGE
            page = tl.load(table_row + ahead_cols * page_table_col_stride,
                           mask=(ahead < length) & (ahead_cols < table_cols), other=-1)
            if DOT_IN_FP32:
                # Only under TRITON_INTERPRET: the interpreter keeps bf16 as raw uint16 and its
                # tl.dot multiplies those bits (triton-lang/triton#11584); bf16 is exact in fp32.
                scores = tl.dot(keys.to(tl.float32), query.to(tl.float32))
            else:
                scores = tl.dot(keys, query)
            logits = tl.sum(tl.maximum(scores, 0.0) * head_weights[None, :], axis=1)
            logits = tl.where(valid, logits, float("-inf"))
            tl.store(out_row + positions, logits, mask=positions < store_end)


@functools.lru_cache(maxsize=1)
def load_tuned_launch() -> dict:
    """tuned_launch.json as a dict ({} when the file is absent or empty)."""
    if not TUNED_LAUNCH_FILE.exists():
        return {}
    text = TUNED_LAUNCH_FILE.read_text().strip()
    try:
        table = json.loads(text) if text else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{TUNED_LAUNCH_FILE}: not valid JSON ({exc})") from None
    if not isinstance(table, dict):
        raise ValueError(f"{TUNED_LAUNCH_FILE}: must hold a JSON object keyed by device name")
    return table


def check_config(config: dict, where: str = "launch config") -> dict:
    """Refuse, in one line, a config with unknown keys or values of the wrong kind."""
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known: {list(CONFIG_KEYS)}")
    for key, value in config.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where}: {key} must be a positive int, got {value!r}")
    if config.get("pages_per_step", 1) not in (1, 2, 4):
        raise ValueError(f"{where}: pages_per_step must be 1, 2 or 4, got {config['pages_per_step']}")
    return config


def heuristic_config(sm_count: int, capability=(12, 0)) -> dict:
    """The launch config without a measurement: one page (64 keys) per dot, three stages (two
    key tiles in flight), as many programs per SM as the compiled kernel fits there."""
    return {
        "pages_per_step": 1,
        "programs_per_sm": DEFAULT_RESIDENT.get(tuple(capability), DEFAULT_RESIDENT[(12, 0)]),
        "num_warps": 4,
        "num_stages": 3,
        "sm_count": int(sm_count),
    }


@functools.lru_cache(maxsize=16)
def _config_for(device_key: str) -> dict:
    device = torch.device(device_key)
    if device.type != "cuda":
        # The interpreter runs one program at a time: one "SM".
        return heuristic_config(1)
    properties = torch.cuda.get_device_properties(device)
    name = torch.cuda.get_device_name(device)
    capability = f"{properties.major}.{properties.minor}"
    entry = load_tuned_launch().get(name)
    if isinstance(entry, dict) and str(entry.get("capability")) == capability:
        tuned = dict(entry.get("config") or {})
        tuned.setdefault("sm_count", properties.multi_processor_count)
        where = f"{TUNED_LAUNCH_FILE.name}[{name!r}]"
        default = heuristic_config(properties.multi_processor_count, (properties.major, properties.minor))
        config = check_config({**default, **tuned}, where)
        refuse_unchecked(config, f"sm_{properties.major}{properties.minor}", where)
        return config
    return heuristic_config(properties.multi_processor_count, (properties.major, properties.minor))


def logits_source_digest() -> str:
    """The kernel's source as the check compiled it (this module's bytes)."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def load_record() -> dict:
    """launch_checked.json as a dict ({} when absent)."""
    if not RECORD_FILE.exists():
        return {}
    try:
        record = json.loads(RECORD_FILE.read_text() or "{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"{RECORD_FILE}: not valid JSON ({exc})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{RECORD_FILE}: must hold a JSON object keyed by target")
    return record


def passed_configs(target: str):
    """The launch configs recorded as passed on `target` for this kernel source; None when
    there is no record for it (or the kernel changed since)."""
    entry = load_record().get(target)
    if not isinstance(entry, dict) or entry.get("logits_source") != logits_source_digest():
        return None
    return [dict(c) for c in entry.get("passed", [])]


def refuse_unchecked(config: dict, target: str, where: str) -> None:
    """A tuned config runs only once the ahead-of-time check (`sglang-dsv4 kernels`, recorded
    in launch_checked.json for this kernel source) has compiled it for `target` and found it
    fitting without spills at every head count."""
    wanted = {k: v for k, v in config.items() if k != "sm_count"}
    passed = passed_configs(target)
    if passed is None:
        raise ValueError(
            f"{where}: no ahead-of-time check of this kernel for {target} in {RECORD_FILE.name} "
            f"(run `sglang-dsv4 kernels --target {target} --record`); refusing {wanted}"
        )
    if wanted not in passed:
        raise ValueError(
            f"{where}: {wanted} has not passed the ahead-of-time check for {target} "
            f"({RECORD_FILE.name}: {len(passed)} configs passed)"
        )


def launch_config_for(device) -> dict:
    """The launch config for `device`: its measured entry in tuned_launch.json when there is one
    for its name and capability, else `heuristic_config` of its SM count. A new dict each call."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return dict(_config_for(str(device)))


def workers_per_row(batch: int, max_seq_len: int, table_cols: int, config: dict) -> int:
    """Programs per query row: the device's resident slots shared by the rows, rounded down
    (one wave while the rows fit the slots), at least one, at most the page steps the widest
    possible row has. From shapes and the config only, never from seq_lens."""
    step = PAGE_TOKENS * config["pages_per_step"]
    steps = max(1, triton.cdiv(min(max_seq_len, table_cols * PAGE_TOKENS), step))
    share = (config["programs_per_sm"] * config["sm_count"]) // max(batch, 1)
    return max(1, min(steps, share))


def launch_args(q, kv_cache, weights, seq_lens, page_table, max_seq_len, logits, config):
    """(grid, positional arguments, keyword arguments) of the kernel launch `launch` makes: the
    one place they are built, shared with the ahead-of-time check (`compile_check`)."""
    batch, _, heads, _ = q.shape
    grid = (batch, workers_per_row(batch, max_seq_len, page_table.shape[1], config))
    args = (
        q,
        kv_cache,
        weights,
        seq_lens,
        page_table,
        logits,
        q.stride(0),
        q.stride(2),
        kv_cache.stride(0),
        kv_cache.stride(1),
        weights.stride(0),
        weights.stride(1),
        seq_lens.stride(0),
        page_table.stride(0),
        page_table.stride(1),
        logits.stride(0),
        heads,
        page_table.shape[1],
        max_seq_len,
    )
    kwargs = dict(
        PAGE=PAGE_TOKENS,
        DIM=HEAD_DIM,
        BLOCK_H=max(16, triton.next_power_of_2(heads)),
        PAGES_PER_STEP=config["pages_per_step"],
        FILL_BLOCK=FILL_BLOCK,
        DOT_IN_FP32=isinstance(_bf16_paged_mqa_logits_kernel, InterpretedFunction),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return grid, args, kwargs


def launch(q, kv_cache, weights, seq_lens, page_table, max_seq_len, config=None):
    """Run the kernel on arguments `bf16_paged_mqa_logits_triton` has checked (seq_lens [B]).
    `config`: a launch config dict (see the module docstring); None takes
    `launch_config_for(q.device)`, and a partial dict is completed from it."""
    batch, _, heads, _ = q.shape
    if heads > MAX_HEADS:
        raise ValueError(
            f"bf16_paged_mqa_logits_triton: at most {MAX_HEADS} heads per query, got {heads}"
        )
    config = {**launch_config_for(q.device), **check_config(dict(config or {}))}
    # every position is written: the row's scores, -inf past seq_len (see index_logits)
    logits = torch.empty((batch, max_seq_len), dtype=torch.float32, device=q.device)
    if batch == 0 or max_seq_len == 0:
        return logits
    grid, args, kwargs = launch_args(
        q, kv_cache, weights, seq_lens, page_table, max_seq_len, logits, config
    )
    _bf16_paged_mqa_logits_kernel[grid](*args, **kwargs)
    return logits
