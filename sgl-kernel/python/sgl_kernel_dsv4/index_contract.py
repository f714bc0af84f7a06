"""The contract the bf16 indexer's kernels share: shapes, constants and input checks.

Both implementations of each kernel (the torch path and the Triton kernel) and their dispatchers
import this module, and it imports none of them, so no kernel module imports another's
implementation. It needs only torch.

- `PAGE_TOKENS`, `HEAD_DIM`, `MAX_HEADS`: the c4 indexer of DeepSeek-V4 (64-key pages, 128 values
  per key; the logits kernel takes at most 128 heads).
- `check_logits_inputs`: the arguments of `bf16_paged_mqa_logits` (shapes, dtypes, devices; no
  device sync), `IndexLogitsInputError` for what breaks them.
- `check_store_inputs`, `freqs_table`, `rotation_dims`: the arguments of the query rotation and
  the key store.
"""

from __future__ import annotations

import torch

PAGE_TOKENS = 64
HEAD_DIM = 128
MAX_HEADS = 128


class IndexLogitsInputError(ValueError):
    """The arguments do not have the shapes, dtypes or devices the kernel contract states."""


def _fail(message: str):
    raise IndexLogitsInputError(f"bf16_paged_mqa_logits: {message}")


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} on {t.device}"


def check_logits_inputs(q, kv_cache, weights, seq_lens, page_table, max_seq_len) -> torch.Tensor:
    """Validate the logits arguments (shapes and dtypes only: no device sync); returns seq_lens
    as [B]."""
    if q.dtype != torch.bfloat16 or q.dim() != 4 or q.shape[1] != 1 or q.shape[3] != HEAD_DIM:
        _fail(f"q must be bfloat16 [B, 1, H, {HEAD_DIM}], got {_describe(q)}")
    if q.stride(3) != 1:
        _fail(f"q must be dense along head_dim, strides {q.stride()}")
    batch, _, heads, _ = q.shape
    if kv_cache.dtype != torch.bfloat16 or tuple(kv_cache.shape[1:]) != (PAGE_TOKENS, 1, HEAD_DIM):
        _fail(
            f"kv_cache must be bfloat16 [num_pages, {PAGE_TOKENS}, 1, {HEAD_DIM}], "
            f"got {_describe(kv_cache)}"
        )
    if kv_cache.stride(3) != 1 or kv_cache.stride(1) != HEAD_DIM:
        _fail(f"kv_cache keys must be dense rows of {HEAD_DIM} inside a page, strides {kv_cache.stride()}")
    if weights.dtype != torch.float32 or tuple(weights.shape) != (batch, heads):
        _fail(f"weights must be float32 [{batch}, {heads}], got {_describe(weights)}")
    if seq_lens.dim() == 2 and seq_lens.shape[1] == 1:
        seq_lens = seq_lens[:, 0]
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (batch,):
        _fail(f"seq_lens must be int32 [{batch}], got {_describe(seq_lens)}")
    if page_table.dtype != torch.int32 or page_table.dim() != 2 or page_table.shape[0] != batch:
        _fail(f"page_table must be int32 [{batch}, max_pages], got {_describe(page_table)}")
    if not isinstance(max_seq_len, int) or max_seq_len < 0:
        _fail(f"max_seq_len must be a non-negative int, got {max_seq_len!r}")
    devices = {t.device for t in (q, kv_cache, weights, seq_lens, page_table)}
    if len(devices) != 1:
        _fail(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return seq_lens


def check_store_inputs(pool_rows, kv, plan_rows) -> None:
    """Validate the key store's pool rows, compressed rows and plan (shapes and dtypes)."""
    if pool_rows.dtype != torch.bfloat16 or pool_rows.dim() != 2 or pool_rows.stride(1) != 1:
        raise ValueError(
            f"store_index_keys_bf16: pool_rows must be dense bfloat16 [slots, D], got "
            f"{pool_rows.dtype} {list(pool_rows.shape)}"
        )
    if kv.dim() != 2 or kv.shape[1] != pool_rows.shape[1]:
        raise ValueError(
            f"store_index_keys_bf16: kv must be [N, {pool_rows.shape[1]}], got {list(kv.shape)}"
        )
    if plan_rows.dtype != torch.int32 or tuple(plan_rows.shape) != (kv.shape[0], 4):
        raise ValueError(
            f"store_index_keys_bf16: plan_rows must be int32 [{kv.shape[0]}, 4], got "
            f"{plan_rows.dtype} {list(plan_rows.shape)}"
        )


def freqs_table(freqs_cis: torch.Tensor) -> torch.Tensor:
    """complex [P, F] -> its fp32 [P, F, 2] view (no copy)."""
    if not freqs_cis.is_complex() or freqs_cis.dim() != 2:
        raise ValueError(f"freqs_cis must be complex [positions, pairs], got {freqs_cis.dtype} "
                         f"{list(freqs_cis.shape)}")
    return torch.view_as_real(freqs_cis.contiguous())


def rotation_dims(dim: int, pairs: int) -> tuple[int, int]:
    """(log2 of the head dim, rope dims) of a rotation over `dim` values with `pairs` rope pairs."""
    if dim & (dim - 1) or dim < 16 or 2 * pairs > dim:
        raise ValueError(f"head dim {dim} must be a power of two >= 16 holding {pairs} rope pairs")
    return dim.bit_length() - 1, 2 * pairs
