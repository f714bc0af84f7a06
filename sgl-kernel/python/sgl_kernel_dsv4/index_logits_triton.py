"""Triton kernel behind `bf16_paged_mqa_logits_triton` (contract: see `index_logits`).

Written for sm_120 (RTX PRO 6000): `tl.dot` on bf16 (mma.sync; sm_120 has no wgmma or TMA). Per
program the query [128, H] is 16 KB in bf16 and one step of `pages_per_step` 64-key pages is
16 KB per page, so two pipeline stages stay far below the ~100 KB of shared memory of an SM.

Launch rule (work follows the keys a row has, not the page table's width):
- The grid is (rows, workers). `workers` comes from argument shapes and the launch config only
  (CUDA-graph safe): enough programs to fill the device (`programs_per_sm` x SM count, shared
  by the rows), never more than the steps the widest row could have.
- Each program reads its row's `seq_len` and walks that row's pages only, round robin with the
  row's other workers (page steps w, w + workers, ...). A worker with no page of its row exits
  at once: no query load, no dot, no store. Past the row's last page nothing is read, computed
  or written; inside it, positions past `seq_len` get -inf.

Launch config (a dict; `launch_config_for(device)` picks one):
    pages_per_step   64-key pages scored by one dot (1, 2 or 4)
    programs_per_sm  target programs per SM over the whole launch
    num_warps, num_stages   Triton's own knobs
    sm_count         the device's SM count (filled from the device when absent)
A measured entry in `tuned_launch.json` (keyed by `torch.cuda.get_device_name()`, used when its
"capability" matches the device) wins over the heuristic.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from sgl_kernel_dsv4.index_logits import HEAD_DIM, PAGE_TOKENS

MAX_HEADS = 128
TUNED_LAUNCH_FILE = Path(__file__).with_name("tuned_launch.json")
CONFIG_KEYS = ("pages_per_step", "programs_per_sm", "num_warps", "num_stages", "sm_count")

# Candidates a tuner times on a device (benchmark/gpu_check.py); sm_count comes from the device.
# Shared memory per program: 16 KB of query plus 16 KB per page and pipeline stage, kept at or
# under 80 KB (an sm_120 SM has about 100 KB).
LAUNCH_SWEEP = [
    {"pages_per_step": 1, "programs_per_sm": 4, "num_warps": 4, "num_stages": 3},
    {"pages_per_step": 2, "programs_per_sm": 2, "num_warps": 4, "num_stages": 2},
    {"pages_per_step": 2, "programs_per_sm": 4, "num_warps": 4, "num_stages": 2},
    {"pages_per_step": 2, "programs_per_sm": 4, "num_warps": 8, "num_stages": 2},
    {"pages_per_step": 4, "programs_per_sm": 2, "num_warps": 8, "num_stages": 1},
]


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
    DOT_IN_FP32: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    worker = tl.program_id(1)
    workers = tl.num_programs(1)
    STEP: tl.constexpr = PAGE * PAGES_PER_STEP

    # Positions this row has in the output; only their pages are visited.
    length = tl.minimum(tl.load(seq_lens_ptr + row * seq_lens_stride), max_seq_len)
    row_steps = tl.cdiv(length, STEP)
    # stores end with the row's last page (-inf after seq_len inside it), never past it
    store_end = tl.minimum(tl.cdiv(length, PAGE) * PAGE, max_seq_len)
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
        for step in range(worker, row_steps, workers):
            positions = step * STEP + offsets
            in_row = positions < length
            cols = positions // PAGE
            page = tl.load(
                page_table_ptr + row * page_table_row_stride + cols * page_table_col_stride,
                mask=in_row & (cols < table_cols),
                other=-1,
            )
            valid = in_row & (page >= 0)
            # Keys past seq_len (or without a page) are never read from memory.
            keys = tl.load(
                kv_ptr
                + page.to(tl.int64)[:, None] * kv_page_stride
                + (positions % PAGE)[:, None] * kv_token_stride
                + dims[None, :],
                mask=valid[:, None],
                other=0.0,
            )
            if DOT_IN_FP32:
                # Only under TRITON_INTERPRET: the interpreter keeps bf16 as raw uint16 and its
                # tl.dot multiplies those bits (triton-lang/triton#11584); bf16 is exact in fp32.
                scores = tl.dot(keys.to(tl.float32), query.to(tl.float32))
            else:
                scores = tl.dot(keys, query)
            logits = tl.sum(tl.maximum(scores, 0.0) * head_weights[None, :], axis=1)
            logits = tl.where(valid, logits, float("-inf"))
            tl.store(out_ptr + row * out_row_stride + positions, logits, mask=positions < store_end)


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


def heuristic_config(sm_count: int) -> dict:
    """The launch config without a measurement: two pages (128 keys) per dot, enough programs
    for four per SM, so several rows share the device and one long row spreads over all SMs."""
    return {
        "pages_per_step": 2,
        "programs_per_sm": 4,
        "num_warps": 4,
        "num_stages": 2,
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
        return check_config({**heuristic_config(properties.multi_processor_count), **tuned},
                            f"{TUNED_LAUNCH_FILE.name}[{name!r}]")
    return heuristic_config(properties.multi_processor_count)


def launch_config_for(device) -> dict:
    """The launch config for `device`: its measured entry in tuned_launch.json when there is one
    for its name and capability, else `heuristic_config` of its SM count. A new dict each call."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return dict(_config_for(str(device)))


def workers_per_row(batch: int, max_seq_len: int, table_cols: int, config: dict) -> int:
    """Programs per query row: the device's share for each row, at most the page steps the
    widest possible row has. From shapes and the config only, never from seq_lens."""
    step = PAGE_TOKENS * config["pages_per_step"]
    steps = max(1, triton.cdiv(min(max_seq_len, table_cols * PAGE_TOKENS), step))
    share = triton.cdiv(config["programs_per_sm"] * config["sm_count"], max(batch, 1))
    return max(1, min(steps, share))


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
    # Positions past each row's seq_len are left unwritten (see index_logits).
    logits = torch.empty((batch, max_seq_len), dtype=torch.float32, device=q.device)
    if batch == 0 or max_seq_len == 0:
        return logits
    grid = (batch, workers_per_row(batch, max_seq_len, page_table.shape[1], config))
    _bf16_paged_mqa_logits_kernel[grid](
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
        PAGE=PAGE_TOKENS,
        DIM=HEAD_DIM,
        BLOCK_H=max(16, triton.next_power_of_2(heads)),
        PAGES_PER_STEP=config["pages_per_step"],
        DOT_IN_FP32=isinstance(_bf16_paged_mqa_logits_kernel, InterpretedFunction),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    return logits
