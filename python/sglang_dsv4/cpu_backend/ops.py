"""Torch versions of the CUDA-only JIT ops a DeepSeek-V4 forward needs, for `--device cpu`.

Each function stands for one upstream op (sglang 0.5.23, the `.cuh` sources ship in the wheel
under `sglang/kernels/jit/csrc/deepseek_v4/`), takes the same arguments as the Python wrapper
upstream calls it through, and writes what the CUDA kernel writes, in the same byte layout:
plans as packed structs, compress-state rows, fp8 pages with their scales. Where the kernel
leaves rows of a fresh output untouched (rows with no compression event), these write zeros, so
that a CPU run is deterministic.

Numerics follow the kernels: fp32 arithmetic, the same bf16 round trips, UE8M0 scales rounded
up to a power of two, e4m3 values clipped to +-448 and rounded to nearest even.
"""

from __future__ import annotations

import functools

import torch

FP8_MAX = 448.0
SCALE_FLOOR = 1e-4
FLT_MAX = 3.4028234663852886e38
ROPE_DIM = 64

# Byte sizes of the plan structs (sgl_kernel/deepseek_v4/compress_v2.cuh).
PLAN_C_BYTES = 16  # CompressPlan: u32 seq_len, u16 ragged_id, u16 buffer_len, i32 page0, i32 page1
PLAN_W_BYTES = 8  # WritePlan: u32 ragged_id, i32 write_loc
PLAN_D_BYTES = 16  # DecodePlan: u32 seq_len, i32 write_loc, i32 page0, i32 page1

# The V4 FlashMLA cache row (sgl_kernel/deepseek_v4/kv_layout.cuh, KVLayoutTraits<V4>).
V4_DATA_BYTES = 576  # 448 e4m3 + 64 bf16 rope
V4_SCALE_BYTES = 8  # 7 UE8M0 scales (one per 64 values) + 1 pad byte
V4_NOPE = 448
V4_TILE = 64
INDEXER_BYTES = 132  # 128 e4m3 + one fp32 scale


class UnsupportedOnCpu(NotImplementedError):
    """A variant of an op the CPU backend does not implement; the message names it."""


def _unsupported(what: str):
    raise UnsupportedOnCpu(f"sglang-dsv4 cpu backend: {what} is not implemented on the CPU")


# --- shared numerics -----------------------------------------------------------------------


def fp8_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3 as `pack_fp8` does it (fp8_utils.cuh): clip to +-448, round to nearest."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def ue8m0_exponent(scale: torch.Tensor) -> torch.Tensor:
    """`cast_to_ue8m0` (fp8_utils.cuh): the biased exponent of `scale` rounded up (int32)."""
    bits = scale.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    return exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def ue8m0_inverse(exponent: torch.Tensor) -> torch.Tensor:
    """`inv_scale_ue8m0`: 2 ** (127 - exponent) as fp32, from its bit pattern."""
    return ((254 - exponent) << 23).to(torch.int32).view(torch.float32)


def ue8m0_value(exponent: torch.Tensor) -> torch.Tensor:
    """The scale a UE8M0 byte stands for: 2 ** (exponent - 127)."""
    return (exponent.to(torch.int32) << 23).view(torch.float32)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.square().mean(dim=-1, keepdim=True) + eps)


def rotate_pairs(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved complex rotation of the last dim: pairs (2i, 2i + 1) times freqs[..., i].

    `freqs` holds (cos, sin) interleaved, fp32, shape [..., rope_dim] broadcastable to x."""
    x = x.float()
    real, imag = x[..., 0::2], x[..., 1::2]
    cos, sin = freqs[..., 0::2], freqs[..., 1::2]
    if inverse:
        sin = -sin
    out = torch.empty_like(x)
    out[..., 0::2] = real * cos - imag * sin
    out[..., 1::2] = real * sin + imag * cos
    return out


def freqs_real(freqs_cis: torch.Tensor) -> torch.Tensor:
    """The complex [positions, rope_dim / 2] table as upstream's wrappers pass it to the
    kernels: fp32 [positions, rope_dim], (cos, sin) interleaved."""
    if freqs_cis.is_complex():
        return torch.view_as_real(freqs_cis).flatten(-2).float()
    return freqs_cis.float()


@functools.lru_cache(maxsize=4)
def _hadamard_matrix(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h * (n**-0.5)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The 128-point Walsh-Hadamard transform in natural (Sylvester) order, scaled by
    1/sqrt(128): the butterflies of the indexer kernels (two in-lane stages, five shfl_xor
    stages, lower index keeps the sum)."""
    return x.float() @ _hadamard_matrix(x.shape[-1])


def quantize_row_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 with an fp32 scale max(amax, 1e-4) / 448 (the indexer kernels)."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=SCALE_FLOOR) / FP8_MAX
    return fp8_e4m3(x * (1.0 / scale)), scale.squeeze(-1)


def quantize_tiles_ue8m0(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and UE8M0 exponent bytes, one scale per `tile` values of the last dim."""
    tiles = x.unflatten(-1, (-1, tile))
    amax = tiles.abs().amax(dim=-1)
    exponent = ue8m0_exponent(amax.clamp(min=SCALE_FLOOR) / FP8_MAX)
    values = fp8_e4m3(tiles * ue8m0_inverse(exponent).unsqueeze(-1)).flatten(-2)
    return values, exponent.to(torch.uint8)


def _scatter_bytes(cache: torch.Tensor, page: torch.Tensor, offset: torch.Tensor,
                   data: torch.Tensor) -> None:
    """cache[page[i], offset[i] : offset[i] + data.shape[1]] = data[i] (cache: uint8 [pages, bytes])."""
    if page.numel() == 0:
        return
    cols = offset.unsqueeze(1) + torch.arange(data.shape[1], device=cache.device)
    cache[page.unsqueeze(1), cols] = data.view(torch.uint8).reshape(data.shape[0], -1)


# --- plans: c_plan.cuh ---------------------------------------------------------------------


def _trunc_div(a: torch.Tensor, b: int) -> torch.Tensor:
    return torch.div(a, b, rounding_mode="trunc")


def _state_loc(swa_loc: torch.Tensor, swa_page_size: int, ring_size: int) -> torch.Tensor:
    """c_plan.cuh `compute_loc`: SWA slot -> compress-state ring slot (C++ integer semantics)."""
    return _trunc_div(swa_loc, swa_page_size) * ring_size + torch.fmod(swa_loc, ring_size)


def _req_ring_loc(rid: torch.Tensor, position: torch.Tensor, ring_size: int) -> torch.Tensor:
    """c_plan.cuh `compute_req_ring_loc`: a per-request ring of `ring_size` slots."""
    return rid * ring_size + torch.fmod(position, ring_size)


def _state_slot(ratio, use_req_ring, rid, position, req_to_token, full_to_state,
                swa_page_size, ring_size) -> torch.Tensor:
    if ratio == 128 or use_req_ring:
        return _req_ring_loc(rid, position, ring_size)
    raw = req_to_token[rid, position].long()
    return _state_loc(full_to_state[raw].long(), swa_page_size, ring_size)


def pack_plan_c(seq_len, ragged_id, buffer_len, page0, page1) -> torch.Tensor:
    """CompressPlan rows as uint8 [n, 16] (little-endian, the struct's field order)."""
    words = torch.stack(
        (
            seq_len.long() & 0xFFFFFFFF,
            (ragged_id.long() & 0xFFFF) | ((buffer_len.long() & 0xFFFF) << 16),
            page0.long() & 0xFFFFFFFF,
            page1.long() & 0xFFFFFFFF,
        ),
        dim=1,
    )
    return _words_to_bytes(words)


def pack_plan_w(ragged_id, write_loc) -> torch.Tensor:
    """WritePlan rows as uint8 [n, 8]."""
    words = torch.stack((ragged_id.long() & 0xFFFFFFFF, write_loc.long() & 0xFFFFFFFF), dim=1)
    return _words_to_bytes(words)


def _words_to_bytes(words: torch.Tensor) -> torch.Tensor:
    # Two's-complement int32 of the low 32 bits, then its bytes.
    signed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return signed.contiguous().view(torch.uint8).reshape(words.shape[0], words.shape[1] * 4)


def plan_fields(plan: torch.Tensor) -> torch.Tensor:
    """A packed plan (uint8 [n, 16] or [n, 8]) as int32 words [n, 4] / [n, 2]."""
    return plan.contiguous().view(torch.int32)


def _invalid_c(n: int, device) -> torch.Tensor:
    minus = torch.full((n,), -1, dtype=torch.long, device=device)
    zero = torch.zeros(n, dtype=torch.long, device=device)
    return pack_plan_c(minus, zero, zero, minus, minus)


def _invalid_w(n: int, device) -> torch.Tensor:
    minus = torch.full((n,), -1, dtype=torch.long, device=device)
    return pack_plan_w(minus, minus)


def plan_compress_prefill(req_pool_indices, req_to_token, full_to_state, seq_lens, extend_lens,
                          num_q_tokens, compress_ratio, swa_page_size, ring_size,
                          use_req_ring=False, use_cuda_graph=False):
    """`plan_compress_prefill` (c_plan.cuh: the host loop, then `plan_compress_prefill_kernel_1`).

    Per extend token at `position`: a compress plan when (position + 1) % ratio == 0 (with
    buffer_len = window - min(j + 1, window) entries of its window still in the state ring),
    a write plan when the token stays needed in the ring (from the last window before seq_len,
    and for ratio 4 without a per-request ring the last `ratio` slots of each SWA page). Stage 1
    turns the batch id into ring pages / slots. Returns (plan_c uint8 [C, 16], plan_w uint8
    [W, 8]), padded with invalid rows to num_q_tokens when `use_cuda_graph`."""
    ratio = int(compress_ratio)
    if ratio not in (4, 128):
        raise ValueError(f"compress ratio {ratio}: only 4 and 128 have a plan")
    if use_req_ring and ratio != 4:
        raise ValueError("use_req_ring is a ratio-4 layout")
    if swa_page_size % ring_size or ring_size % ratio:
        raise ValueError(
            f"swa_page_size {swa_page_size} / ring_size {ring_size} / ratio {ratio}: "
            "each must divide the one before"
        )
    device = req_to_token.device
    overlap = ratio == 4
    window = ratio * (2 if overlap else 1)
    mtp_pad = ring_size - window + 2 if ring_size > window else 0
    seq = [int(v) for v in seq_lens.tolist()]
    ext = [int(v) for v in extend_lens.tolist()]
    if sum(ext) != int(num_q_tokens):
        raise ValueError(f"extend lengths sum to {sum(ext)}, num_q_tokens is {num_q_tokens}")
    c_parts, w_parts = [], []
    base = 0
    for batch_id, (seq_len, ext_len) in enumerate(zip(seq, ext, strict=True)):
        if not 0 < ext_len <= seq_len:
            raise ValueError(f"request {batch_id}: extend {ext_len} of seq_len {seq_len}")
        prefix = seq_len - ext_len
        j = torch.arange(ext_len, dtype=torch.long)
        position = prefix + j
        ragged = base + j
        last_c = seq_len // ratio * ratio
        first_w = min(last_c - (ratio if overlap else 0), seq_len - mtp_pad)
        is_c = (position + 1) % ratio == 0
        buffer_len = window - torch.clamp(j + 1, max=window)
        c_parts.append((position[is_c] + 1, ragged[is_c], buffer_len[is_c], batch_id))
        is_w = position >= first_w
        if overlap and not use_req_ring:
            is_w |= position % swa_page_size >= swa_page_size - ratio
        w_parts.append((ragged[is_w], position[is_w], batch_id))
        base += ext_len

    rid_all = req_pool_indices.long().cpu()
    r2t = req_to_token.cpu()
    f2s = full_to_state.cpu()

    def slot(rid, position):
        return _state_slot(ratio, use_req_ring, rid, position, r2t, f2s, swa_page_size, ring_size)

    c_rows = []
    for seq_len_c, ragged, buffer_len, batch_id in c_parts:
        n = seq_len_c.numel()
        if n == 0:
            continue
        page0 = torch.full((n,), -1, dtype=torch.long)
        page1 = torch.full((n,), batch_id, dtype=torch.long)
        need = buffer_len > 0
        if bool(need.any()):
            rid = rid_all[batch_id].expand(int(need.sum()))
            pos1 = seq_len_c[need] - 1
            pos0 = torch.clamp(pos1 - ratio, min=0)
            page0[need] = _trunc_div(slot(rid, pos0), ratio)
            page1[need] = _trunc_div(slot(rid, pos1), ratio)
        c_rows.append(pack_plan_c(seq_len_c, ragged, buffer_len, page0, page1))
    w_rows = []
    for ragged, position, batch_id in w_parts:
        if ragged.numel() == 0:
            continue
        rid = rid_all[batch_id].expand(ragged.numel())
        w_rows.append(pack_plan_w(ragged, slot(rid, position)))

    plan_c = torch.cat(c_rows) if c_rows else torch.empty((0, PLAN_C_BYTES), dtype=torch.uint8)
    plan_w = torch.cat(w_rows) if w_rows else torch.empty((0, PLAN_W_BYTES), dtype=torch.uint8)
    if use_cuda_graph:
        plan_c = torch.cat((plan_c, _invalid_c(int(num_q_tokens) - plan_c.shape[0], "cpu")))
        plan_w = torch.cat((plan_w, _invalid_w(int(num_q_tokens) - plan_w.shape[0], "cpu")))
    return plan_c.to(device), plan_w.to(device)


def plan_compress_decode(req_pool_indices, req_to_token, full_to_state, seq_lens, compress_ratio,
                         swa_page_size, ring_size, use_req_ring=False):
    """`plan_compress_decode_kernel` (c_plan.cuh): per request, the ring slot its new token is
    written to and the ring pages of the window ending at it. uint8 [B, 16] DecodePlan rows."""
    ratio = int(compress_ratio)
    if use_req_ring and ratio != 4:
        raise ValueError("use_req_ring is a ratio-4 layout")
    rid = req_pool_indices.long()
    seq_len = seq_lens.long()
    pos1 = seq_len - 1
    pos0 = torch.clamp(pos1 - ratio, min=0)
    if ratio == 128 or use_req_ring:
        write_loc = _req_ring_loc(rid, pos1, ring_size)
        page0 = _trunc_div(_req_ring_loc(rid, pos0, ring_size), ratio)
    else:
        write_loc = _state_slot(ratio, False, rid, pos1, req_to_token, full_to_state,
                                swa_page_size, ring_size)
        page0 = _trunc_div(_state_slot(ratio, False, rid, pos0, req_to_token, full_to_state,
                                       swa_page_size, ring_size), ratio)
    page1 = _trunc_div(write_loc, ratio)
    words = torch.stack((seq_len, write_loc, page0, page1), dim=1)
    return _words_to_bytes(words)


# --- compression: c4_v2.cuh / c128_v2.cuh ----------------------------------------------------


def _softmax_pool(kv: torch.Tensor, score: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Softmax over the window axis (1) of score + bias, weighted sum of kv: fp32."""
    weights = torch.softmax(score + bias.float().unsqueeze(0), dim=1)
    return (kv * weights).sum(dim=1)


def compress_forward(kv_score_buffer, kv_score_input, ape, plan, *, head_dim, compress_ratio,
                     out=None, is_online=False):
    """`FlashCompress4Kernel` (c4_v2.cuh) / `FlashCompress128Kernel` (c128_v2.cuh), decode and
    prefill: softmax-pool each window of (kv, score) rows into one compressed row, and keep the
    tokens later windows need in the compress-state ring `kv_score_buffer`.

    Ratio 4 rows are | kv overlap | kv | score overlap | score | (4 x head_dim): a window is the
    4 "overlap" halves of the previous 4 tokens then the 4 main halves of its own, 8 entries,
    ape [8, head_dim]. Ratio 128 rows are | kv | score |, a window of 128, ape [128, head_dim].
    Window entries still in the ring are read from it (pages read_page_0 / read_page_1), the
    others from the ragged input; ring values are rounded to the input dtype as the kernel's
    mixed-dtype path does. Decode writes the new token first, then compresses when its
    position closes a window; prefill compresses from the ring as it was, then writes."""
    if is_online:
        _unsupported("the online c128 compressor (SGLANG_OPT_USE_ONLINE_COMPRESS)")
    ratio = int(compress_ratio)
    if plan.compress_ratio != ratio:
        raise ValueError(f"plan is for ratio {plan.compress_ratio}, called with {ratio}")
    in_dtype = kv_score_input.dtype
    parts = 4 if ratio == 4 else 2
    rows = kv_score_buffer.view(-1, parts * head_dim)
    bias = ape.to(in_dtype).float().view(-1, head_dim)
    n_out = plan[1].shape[0]
    if out is None:
        out = kv_score_input.new_empty((n_out, head_dim))
    out.zero_()

    if plan.is_decode:
        fields = plan_fields(plan.plan_d).long()
        seq_len, write_loc, page0, page1 = fields.unbind(1)
        rows[write_loc] = kv_score_input.to(rows.dtype)
        if ratio == 4:
            fire = seq_len % 4 == 0
            idx = fire.nonzero().squeeze(1)
            if idx.numel():
                window_rows = torch.cat(
                    (page0[idx, None] * 4 + torch.arange(4), page1[idx, None] * 4 + torch.arange(4)),
                    dim=1,
                )
                entries = rows[window_rows].to(in_dtype).float()
                kv, score = _c4_split(entries)
                no_overlap = (seq_len[idx] <= 4)[:, None, None]
                kv[:, :4] = torch.where(no_overlap, 0.0, kv[:, :4])
                score[:, :4] = torch.where(no_overlap, -FLT_MAX, score[:, :4])
                out[idx] = _softmax_pool(kv, score, bias).to(out.dtype)
        else:
            fire = write_loc % 128 == 127
            idx = fire.nonzero().squeeze(1)
            if idx.numel():
                window_rows = page1[idx, None] * 128 + torch.arange(128)
                entries = rows[window_rows].to(in_dtype).float()
                kv, score = entries[..., :head_dim], entries[..., head_dim:]
                out[idx] = _softmax_pool(kv, score, bias).to(out.dtype)
        return out

    fields_c = plan_fields(plan.plan_c)
    c_seq = fields_c[:, 0].long() & 0xFFFFFFFF
    valid = c_seq != 0xFFFFFFFF
    idx = valid.nonzero().squeeze(1)
    if idx.numel():
        packed = fields_c[idx, 1].long() & 0xFFFFFFFF
        ragged = packed & 0xFFFF
        buffer_len = packed >> 16
        page0 = fields_c[idx, 2].long()
        page1 = fields_c[idx, 3].long()
        seq_len = c_seq[idx]
        src = kv_score_input.float()
        if ratio == 4:
            out[idx] = _c4_prefill_windows(rows, src, in_dtype, ragged, buffer_len, page0, page1,
                                           seq_len, bias).to(out.dtype)
        else:
            j = torch.arange(128)
            from_ring = j[None, :] < buffer_len[:, None]
            ring_rows = (page1.clamp(min=0)[:, None] * 128 + j).clamp(max=rows.shape[0] - 1)
            input_rows = (ragged[:, None] - 127 + j).clamp(0, src.shape[0] - 1)
            entries = torch.where(
                from_ring[..., None], rows[ring_rows].to(in_dtype).float(), src[input_rows]
            )
            kv, score = entries[..., :head_dim], entries[..., head_dim:]
            out[idx] = _softmax_pool(kv, score, bias).to(out.dtype)

    fields_w = plan_fields(plan.plan_w)
    w_valid = fields_w[:, 0] != -1
    w_idx = w_valid.nonzero().squeeze(1)
    if w_idx.numel():
        ragged_w = fields_w[w_idx, 0].long()
        loc_w = fields_w[w_idx, 1].long()
        rows[loc_w] = kv_score_input[ragged_w].to(rows.dtype)
    return out


def _c4_split(entries: torch.Tensor):
    """[n, 8, 4 x hd] window rows -> (kv, score) [n, 8, hd]: the overlap halves for entries
    0..3, the main halves for 4..7 (c4_v2.cuh `kOverlapOffset`, `kScoreOffset`)."""
    hd = entries.shape[-1] // 4
    kv = torch.cat((entries[:, :4, 0:hd], entries[:, 4:, hd : 2 * hd]), dim=1)
    score = torch.cat((entries[:, :4, 2 * hd : 3 * hd], entries[:, 4:, 3 * hd :]), dim=1)
    return kv, score


def _c4_prefill_windows(rows, src, in_dtype, ragged, buffer_len, page0, page1, seq_len, bias):
    n = ragged.shape[0]
    i = torch.arange(4)
    # entries 0..3 (overlap): ring page0 slot i when i < buffer_len, else input[ragged - 7 + i]
    # entries 4..7: ring page1 slot i when i + 4 < buffer_len, else input[ragged - 3 + i]
    ring_rows = torch.cat((page0[:, None] * 4 + i, page1[:, None] * 4 + i), dim=1)
    ring_rows = ring_rows.clamp(0, rows.shape[0] - 1)
    input_rows = torch.cat((ragged[:, None] - 7 + i, ragged[:, None] - 3 + i), dim=1)
    input_rows = input_rows.clamp(0, src.shape[0] - 1)
    from_ring = torch.arange(8)[None, :] < buffer_len[:, None]
    entries = torch.where(
        from_ring[..., None], rows[ring_rows].to(in_dtype).float(), src[input_rows]
    )
    kv, score = _c4_split(entries)
    no_overlap = (seq_len <= 4).view(n, 1, 1)
    kv[:, :4] = torch.where(no_overlap, 0.0, kv[:, :4])
    score[:, :4] = torch.where(no_overlap, -FLT_MAX, score[:, :4])
    return _softmax_pool(kv, score, bias)


# --- fused_norm_rope_v2.cuh: norm + RoPE + store of compressed rows ----------------------------


def v4_page_bytes(page_size: int) -> int:
    """`kv_page_bytes<V4>` (kv_layout.cuh): page_size x 584 B, padded to a multiple of 576."""
    return -(-page_size * (V4_DATA_BYTES + V4_SCALE_BYTES) // V4_DATA_BYTES) * V4_DATA_BYTES


def store_v4_rows(kvcache, out_loc, nope_fp8, nope_exponent, rope_bf16, page_size) -> None:
    """Write V4 FlashMLA rows: data (448 e4m3 + 64 bf16) at page * page_bytes + slot * 576,
    the 7 UE8M0 bytes at page * page_bytes + 576 * page_size + slot * 8."""
    if page_size & (page_size - 1):
        raise ValueError(f"page size {page_size} is not a power of two")
    page = torch.div(out_loc, page_size, rounding_mode="floor")
    slot = out_loc % page_size
    data = torch.cat((nope_fp8.view(torch.uint8), rope_bf16.contiguous().view(torch.uint8)), dim=1)
    _scatter_bytes(kvcache, page, slot * V4_DATA_BYTES, data)
    _scatter_bytes(kvcache, page, V4_DATA_BYTES * page_size + slot * V4_SCALE_BYTES, nope_exponent)


def store_indexer_rows(kvcache, out_loc, values_fp8, scale, page_size) -> None:
    """Write indexer rows: 128 e4m3 at page * 132 * page_size + slot * 128, the fp32 scale at
    page * 132 * page_size + 128 * page_size + slot * 4 (fused_norm_rope_v2.cuh, indexer)."""
    page = torch.div(out_loc, page_size, rounding_mode="floor")
    slot = out_loc % page_size
    _scatter_bytes(kvcache, page, slot * 128, values_fp8.view(torch.uint8))
    _scatter_bytes(kvcache, page, 128 * page_size + slot * 4,
                   scale.float().contiguous().view(torch.uint8).view(-1, 4))


def _compressed_targets(plan, out_loc, compress_ratio):
    """(rows of the compressed input, their positions, their cache slots) a plan stores:
    decode rows whose seq_len closes a window; prefill rows with a valid compress plan."""
    if plan.is_decode:
        seq_len = plan_fields(plan.plan_d)[:, 0].long()
        rows = (seq_len % compress_ratio == 0).nonzero().squeeze(1)
        return rows, seq_len[rows] - compress_ratio, out_loc[rows].long()
    fields = plan_fields(plan.plan_c)
    seq_len = fields[:, 0].long() & 0xFFFFFFFF
    rows = (seq_len != 0xFFFFFFFF).nonzero().squeeze(1)
    ragged = fields[rows, 1].long() & 0xFFFF
    return rows, seq_len[rows] - compress_ratio, out_loc[ragged].long()


def compress_norm_rope_store(kv, plan, *, norm_weight, norm_eps, freq_cis, out_loc, kvcache,
                             page_size, use_fp4=False, bf16_store=False, kvcache_scale=None,
                             rope_cache=None, fp4_k_write_metadata=None, layout="v4",
                             fp8_2buff=False, kvcache_rope=None):
    """`FusedNormRopeKernel::forward` (fused_norm_rope_v2.cuh): RMSNorm (with weight) each
    compressed row, RoPE its last 64 dims at position seq_len - ratio, and store it at out_loc.

    head_dim 128 (indexer, `fused_norm_rope_indexer`): Hadamard-rotate, one e4m3 row with an fp32
    scale, 132 B pages. head_dim 512 (`fused_norm_rope_flashmla`): the V4 row (448 e4m3 from
    bf16-rounded values, 7 UE8M0 scales, 64 bf16 rope dims), or with `bf16_store` the whole
    row as bf16 at out_loc."""
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

    if use_fp4:
        _unsupported("the fp4 indexer store (SGLANG_DSV4_INDEX_K_DTYPE=fp4)")
    if fp8_2buff:
        _unsupported("the fp8 two-pool latent store")
    if KVLayout.parse(layout) is not KVLayout.V4:
        _unsupported(f"KV layout {layout}")
    head_dim = kv.shape[-1]
    rows, positions, locs = _compressed_targets(plan, out_loc, plan.compress_ratio)
    if rows.numel() == 0:
        return
    weight = norm_weight.to(kv.dtype).float()
    data = rms_normalize(kv[rows], norm_eps) * weight
    freqs = freqs_real(freq_cis)[positions]
    rope = rotate_pairs(data[:, -ROPE_DIM:], freqs)
    if head_dim == 128:
        data = torch.cat((data[:, :-ROPE_DIM], rope), dim=1)
        values, scale = quantize_row_fp8(hadamard(data))
        store_indexer_rows(kvcache, locs, values, scale, page_size)
        return
    if head_dim != 512:
        _unsupported(f"norm-rope store of head_dim {head_dim}")
    if bf16_store:
        full = torch.cat((data[:, :-ROPE_DIM], rope), dim=1).to(torch.bfloat16)
        flat = kvcache.view(-1)
        cols = locs.unsqueeze(1) * (head_dim * 2) + torch.arange(head_dim * 2)
        flat[cols] = full.view(torch.uint8)
        return
    nope = data[:, :V4_NOPE].to(torch.bfloat16).float()
    values, exponent = quantize_tiles_ue8m0(nope, V4_TILE)
    store_v4_rows(kvcache, locs, values, exponent, rope.to(torch.bfloat16), page_size)


# --- main_norm_rope.cuh and rope.cuh ----------------------------------------------------------


def fused_q_norm_rope(q_input, q_output, eps, freqs_cis, positions) -> None:
    """`FusedQNormRopeKernel` (main_norm_rope.cuh, `fused_q_norm_rope`): per (token, head),
    RMSNorm without weight when eps is given (rounded to the dtype), then RoPE of the last 64
    dims, into q_output (an e4m3 output gets the dtype result converted, as the wrapper does)."""
    x = q_input
    if eps is not None:
        x = rms_normalize(x, eps).to(q_input.dtype)
    freqs = freqs_real(freqs_cis)[positions.long()].unsqueeze(1)
    rope = rotate_pairs(x[..., -ROPE_DIM:], freqs).to(q_input.dtype)
    result = torch.cat((x[..., :-ROPE_DIM].to(q_input.dtype), rope), dim=-1)
    q_output.copy_(result)


def fused_rope_inplace(q, k, freqs_cis, positions, inverse=False) -> None:
    """`FusedQKRopeKernel` (rope.cuh, `deepseek_rope_kernel`): rotate q [B, H, 64] (and k) in
    place by freqs at positions; `inverse` multiplies by the conjugate."""
    freqs = freqs_real(freqs_cis)[positions.long()].unsqueeze(1)
    for t in (q, k):
        if t is None:
            continue
        t.copy_(rotate_pairs(t, freqs, inverse=inverse).to(t.dtype))


def fused_q_indexer_rope_hadamard_quant(q_input, weight, weight_scale, freqs_cis, positions):
    """`FusedQIndexerRopeHadamardQuantKernel` (main_norm_rope.cuh): per (token, head) of the
    c4 indexer query [B, H, 128], RoPE the last 64 dims, 128-point Hadamard, e4m3 with scale
    max(amax, 1e-4) / 448; returns (q_fp8 [B, H, 128], weights_out [B, H, 1] = weight *
    weight_scale * scale)."""
    x = q_input.float()
    freqs = freqs_real(freqs_cis)[positions.long()].unsqueeze(1)
    x = torch.cat((x[..., :-ROPE_DIM], rotate_pairs(x[..., -ROPE_DIM:], freqs)), dim=-1)
    values, scale = quantize_row_fp8(hadamard(x))
    weights_out = weight.float() * float(weight_scale) * scale
    return values.contiguous(), weights_out.unsqueeze(-1).contiguous()


def fused_k_norm_rope_flashmla(kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache,
                               page_size, layout="v4", q=None) -> None:
    """`FusedKNormRopeFlashMLAKernel` (main_norm_rope.cuh, `fused_k_norm_rope_flashmla`): the
    SWA latent store. RMSNorm with weight, RoPE the last 64 dims, write the V4 row (448 e4m3 with
    7 UE8M0 scales from the fp32 values, 64 bf16 rope dims) at out_loc; rows with out_loc < 0
    have no slot and are skipped."""
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

    if q is not None:
        _unsupported("the K store that also ropes q (a ROCm launch)")
    if KVLayout.parse(layout) is not KVLayout.V4:
        _unsupported(f"KV layout {layout}")
    keep = (out_loc >= 0).nonzero().squeeze(1)
    if keep.numel() == 0:
        return
    data = rms_normalize(kv[keep], eps) * kv_weight.to(kv.dtype).float()
    freqs = freqs_real(freqs_cis)[positions[keep].long()]
    rope = rotate_pairs(data[:, -ROPE_DIM:], freqs).to(torch.bfloat16)
    values, exponent = quantize_tiles_ue8m0(data[:, :V4_NOPE], V4_TILE)
    store_v4_rows(kvcache, out_loc[keep].long(), values, exponent, rope, page_size)


# --- mhc.py: the hyper-connection split + Sinkhorn ----------------------------------------------


def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    """`hc_split_sinkhorn` (sglang/kernels/ops/layernorm/mhc.py; TileLang
    `hc_split_sinkhorn_kernel`, same numerics as its Triton port): per token, the mixes row
    [pre (hc) | post (hc) | comb (hc x hc)] gives pre = sigmoid(. * s0 + b) + eps,
    post = 2 sigmoid(. * s1 + b), and comb = a row softmax (+ eps) followed by alternating
    column / row normalisations (sinkhorn_iters column steps in all). fp32, cast back."""
    b, s, _ = mixes.shape
    hc = int(hc_mult)
    flat = mixes.reshape(b * s, (2 + hc) * hc).float()
    scale = hc_scale.float()
    base = hc_base.float()
    pre = torch.sigmoid(flat[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2.0 * torch.sigmoid(flat[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (flat[:, 2 * hc :] * scale[2] + base[2 * hc :]).view(-1, hc, hc)
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(int(sinkhorn_iters) - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    dtype = mixes.dtype
    return (
        pre.view(b, s, hc).to(dtype),
        post.view(b, s, hc).to(dtype),
        comb.view(b, s, hc, hc).to(dtype),
    )


# --- silu_and_mul_masked_post_quant.cuh: the clamped SwiGLU ------------------------------------


def silu_and_mul_clamp(input, output, swiglu_limit) -> None:
    """`SiluAndMulClampKernel` (silu_and_mul_masked_post_quant.cuh, `silu_mul_clamp_kernel`):
    rows [gate | up]; gate clamped above and up clamped to +-limit in bf16 (the limit rounded to
    bf16 too), then silu(gate) * up in fp32, written in the output dtype."""
    half = input.shape[-1] // 2
    limit = torch.tensor(float(swiglu_limit), dtype=torch.bfloat16)
    gate = torch.minimum(input[..., :half].to(torch.bfloat16), limit).float()
    up = input[..., half:].to(torch.bfloat16)
    up = torch.minimum(torch.maximum(up, -limit), limit).float()
    output.copy_((gate / (1.0 + torch.exp(-gate)) * up).to(output.dtype))


# --- hash_topk.cuh: routing of the hash layers ---------------------------------------------------


def hash_topk(router_logits, input_ids, tid2eid, num_fused_shared_experts=0,
              routed_scaling_factor=1.0, scoring_func="sqrtsoftplus"):
    """`HashTopKKernel` (hash_topk.cuh, act_sqrt_softplus): the experts of a hash layer come
    from the token id (tid2eid[token]); their weights are sqrt(softplus(logit)) renormalised
    to sum 1 (+1e-20); fused shared experts follow, ids E.., weight 1 / routed_scaling_factor.
    Returns (topk_weights fp32 [N, k + s], topk_ids int32 [N, k + s])."""
    if scoring_func != "sqrtsoftplus":
        raise ValueError(f"hash top-k scoring {scoring_func!r}: only sqrtsoftplus exists")
    logits = router_logits.float()
    num_tokens, num_experts = logits.shape
    ids = tid2eid[input_ids.long()].long()
    x = logits.gather(1, ids)
    weights = torch.sqrt(torch.clamp(x, min=0.0) + torch.log1p(torch.exp(-x.abs())))
    weights = weights / (weights.sum(dim=1, keepdim=True) + 1e-20)
    shared = int(num_fused_shared_experts)
    if shared:
        shared_ids = (num_experts + torch.arange(shared)).expand(num_tokens, shared)
        ids = torch.cat((ids, shared_ids), dim=1)
        weights = torch.cat(
            (weights, torch.full((num_tokens, shared), 1.0 / routed_scaling_factor)), dim=1
        )
    return weights.to(torch.float32), ids.to(torch.int32)


def mhc_combine(x_flat, pre, hc, out_dtype):
    """`mhc_combine` (mhc.py, Triton `_mhc_combine_kernel`): y[m, h] = sum_k pre[m, k] *
    x_flat[m, k * H + h], accumulated in fp32 in the order k = 0..hc-1, stored as out_dtype.
    (Interpreted, the Triton kernel is one program per row: most of a CPU prefill.)"""
    h = x_flat.shape[1] // hc
    acc = torch.zeros(x_flat.shape[0], h, dtype=torch.float32)
    for k in range(hc):
        acc += pre[:, k : k + 1].float() * x_flat[:, k * h : (k + 1) * h].float()
    return acc.to(out_dtype)


# --- mhc_head.py: the LM-head hyper-connection mixer --------------------------------------------


def fused_hc_head(x, hc_fn, hc_scale, hc_base, norm_eps, hc_eps):
    """`fused_hc_head` (sglang/kernels/ops/layernorm/mhc_head.py, Triton `_hc_head_kernel`, one
    program per token: interpreted, a large share of a CPU forward). For x [T, hc, H]: the
    streams flattened to hc x H fp32 values, their RMS, the hc mixing logits hc_fn . x over that
    RMS, gates sigmoid(logit * scale + base) + hc_eps, and y [T, H] = the gated sum of the
    streams, in x's dtype."""
    tokens, hc, hidden = x.shape
    streams = x.float()
    flat = streams.reshape(tokens, hc * hidden)
    inv_rms = torch.rsqrt(flat.square().mean(dim=1, keepdim=True) + norm_eps)
    logits = (flat @ hc_fn.float().T) * inv_rms
    gates = torch.sigmoid(logits * hc_scale.float().reshape(()) + hc_base.float()) + hc_eps
    return torch.einsum("tm,tmh->th", gates, streams).to(x.dtype)


# --- metadata_kernel.py: the compressed layers' per-token metadata ------------------------------


def init_compression_metadata(seq_lens, positions, raw_out_loc, page_table=None, page_size=0,
                              compute_page_indices=True):
    """`init_compression_metadata` (sglang/kernels/ops/attention/dsv4/metadata_kernel.py,
    Triton `_init_compressed_attn_metadata_kernel`, one program per token). For ratios 4 and
    128, per row: the compressed slot raw_out_loc / ratio where seq_len closes a window (else 0;
    only the first len(raw_out_loc) rows have one), the position rounded down to the ratio,
    seq_len / ratio and that at least 1; and with `compute_page_indices` the c128 slots of
    each row's pages (page * (page_size / 128) + offset), -1 from seq_len / 128 on.
    Returns the nine tensors in the kernel's order and dtypes."""
    rows = seq_lens.shape[0]
    writes = raw_out_loc.shape[0]
    if writes > rows:
        raise ValueError(f"raw_out_loc has {writes} rows, more than the {rows} metadata rows")
    seq = seq_lens.long()
    loc = raw_out_loc.long()
    pos = positions.long()
    result = []
    for ratio in (4, 128):
        closes = seq[:writes] % ratio == 0
        out_loc = torch.where(closes, torch.div(loc, ratio, rounding_mode="trunc"), 0)
        count = torch.div(seq, ratio, rounding_mode="floor")
        result += [out_loc.to(torch.int64), (pos - pos % ratio).to(torch.int32),
                   count.to(torch.int32), count.clamp(min=1).to(torch.int32)]
    if not compute_page_indices:
        return (*result, None)
    if page_table is None:
        raise ValueError("page_table is required when compute_page_indices=True")
    if page_size < 128 or page_size % 128:
        raise ValueError(f"page_size {page_size}: must be a multiple of 128")
    per_page = page_size // 128
    width = per_page * page_table.shape[1]
    column = torch.arange(width)
    slots = page_table.long()[:, column // per_page] * per_page + column % per_page
    reachable = column.unsqueeze(0) < torch.div(seq, 128, rounding_mode="floor").unsqueeze(1)
    result.append(torch.where(reachable, slots, -1).to(torch.int32))
    return tuple(result)
