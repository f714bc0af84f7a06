"""The CPU backend's torch ops against references built from upstream's layout facts.

The references here are written independently of `sglang_dsv4.cpu_backend.ops`: scalar loops
over the plan rules stated in c_plan.cuh, a dense softmax pool over the whole token sequence
for the compress windows, byte offsets of the page layouts, and the distribution's own indexer
numerics (`sgl_kernel_dsv4.fp8_reference`). Upstream's Triton dequantizer and norm-rope are
compared in a subprocess under TRITON_INTERPRET=1 (no GPU here).
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch
from sglang_dsv4 import warm_python
from sglang_dsv4.cpu_backend import ops, sparse_attention
from support.v4_pages import v4_cache

torch.manual_seed(0)


class _Plan(tuple):
    """Stands for upstream's plan NamedTuples (same field order), without importing them."""

    compress_ratio = property(lambda self: self[0])


class DecodePlan(_Plan):
    is_decode = True
    plan_d = property(lambda self: self[1])


class PrefillPlan(_Plan):
    is_decode = False
    plan_c = property(lambda self: self[1])
    plan_w = property(lambda self: self[2])


def decode_c(plan_c):
    w = ops.plan_fields(plan_c).long() & 0xFFFFFFFF
    rows = []
    for seq_len, packed, p0, p1 in w.tolist():
        as_int = [v - 2**32 if v >= 2**31 else v for v in (p0, p1)]
        rows.append((seq_len, packed & 0xFFFF, packed >> 16, *as_int))
    return rows


# --- plans ---------------------------------------------------------------------------------


def test_prefill_plan_ratio4_hand_checked():
    # One request, 6 cached tokens, 6 new (positions 6..11), ratio 4, a per-request ring of 8.
    # Compressions close at positions 7 and 11: window 8, j = 1 and 5, so 6 and 2 entries of
    # the window are still in the ring. Pages: ring slot = rid * 8 + pos % 8, page = slot / 4.
    rid = 3
    plan_c, plan_w = ops.plan_compress_prefill(
        torch.tensor([rid]), torch.zeros(8, 64, dtype=torch.int32), torch.zeros(1, dtype=torch.long),
        torch.tensor([12]), torch.tensor([6]), 6, 4, swa_page_size=64, ring_size=8,
        use_req_ring=True,
    )
    assert decode_c(plan_c) == [
        (8, 1, 6, (rid * 8 + 3) // 4, (rid * 8 + 7) // 4),
        (12, 5, 2, (rid * 8 + 7) // 4, (rid * 8 + 3) // 4),
    ]
    # Writes: the last window before seq_len 12 starts at 12 // 4 * 4 - 4 = 8 -> positions 8..11.
    w = ops.plan_fields(plan_w).tolist()
    assert w == [[j, rid * 8 + (6 + j) % 8] for j in (2, 3, 4, 5)]


def reference_prefill(seq_lens, ext_lens, ratio, swa_page, ring, r2t, f2s, rids, req_ring):
    """The plan rules of c_plan.cuh's host loop and stage 1, one token at a time."""
    window = ratio * (2 if ratio == 4 else 1)
    c_rows, w_rows, base = [], [], 0

    def slot(rid, pos):
        if ratio == 128 or req_ring:
            return rid * ring + pos % ring
        swa = int(f2s[int(r2t[rid][pos])])
        return (swa // swa_page) * ring + swa % ring

    for b, (sl, el) in enumerate(zip(seq_lens, ext_lens, strict=True)):
        first_w = sl // ratio * ratio - (ratio if ratio == 4 else 0)
        for j in range(el):
            pos = sl - el + j
            if (pos + 1) % ratio == 0:
                blen = window - min(j + 1, window)
                if blen:
                    p0 = slot(rids[b], max(pos - ratio, 0)) // ratio
                    p1 = slot(rids[b], pos) // ratio
                else:
                    p0, p1 = -1, b
                c_rows.append((pos + 1, base + j, blen, p0, p1))
            keep = pos >= first_w or (
                ratio == 4 and not req_ring and pos % swa_page >= swa_page - ratio
            )
            if keep:
                w_rows.append([base + j, slot(rids[b], pos)])
        base += el
    return c_rows, w_rows


@pytest.mark.parametrize("ratio,req_ring", [(4, False), (4, True), (128, False)])
def test_prefill_plan_matches_the_rules_for_a_ragged_batch(ratio, req_ring):
    swa_page, ring = 256, 8 if ratio == 4 else 128
    seq_lens, ext_lens, rids = [300, 9, 140], [300, 5, 70], [2, 0, 1]
    r2t = torch.randperm(4 * 512).view(4, 512).to(torch.int32)
    f2s = torch.randperm(4 * 512)  # full slot -> SWA slot
    plan_c, plan_w = ops.plan_compress_prefill(
        torch.tensor(rids), r2t, f2s, torch.tensor(seq_lens), torch.tensor(ext_lens),
        sum(ext_lens), ratio, swa_page, ring, use_req_ring=req_ring,
    )
    c_ref, w_ref = reference_prefill(seq_lens, ext_lens, ratio, swa_page, ring, r2t.tolist(),
                                     f2s.tolist(), rids, req_ring)
    assert decode_c(plan_c) == c_ref
    assert ops.plan_fields(plan_w).tolist() == w_ref


def test_prefill_plan_cuda_graph_pads_invalid_rows():
    plan_c, plan_w = ops.plan_compress_prefill(
        torch.tensor([0]), torch.zeros(1, 64, dtype=torch.int32), torch.zeros(1, dtype=torch.long),
        torch.tensor([13]), torch.tensor([13]), 13, 4, 64, 8, use_req_ring=True,
        use_cuda_graph=True,
    )
    assert plan_c.shape == (13, 16) and plan_w.shape == (13, 8)
    assert [r[0] for r in decode_c(plan_c)] == [4, 8, 12] + [0xFFFFFFFF] * 10
    # positions 8..12 stay in the ring (the window before 13 starts at 8), then invalid rows
    assert ops.plan_fields(plan_w)[:, 0].tolist() == [8, 9, 10, 11, 12] + [-1] * 8


def test_decode_plan_slots():
    r2t = torch.arange(2 * 64).view(2, 64).to(torch.int32)
    f2s = torch.arange(128) + 256  # full slot s -> SWA slot s + 256
    plan = ops.plan_compress_decode(torch.tensor([1, 0]), r2t, f2s, torch.tensor([8, 3]), 4,
                                    swa_page_size=64, ring_size=8)
    fields = ops.plan_fields(plan).tolist()
    # request 1, position 7: full slot 71 -> SWA 327 -> page 5, ring offset 327 % 8 = 7 -> 47
    # position 3: full 67 -> SWA 323 -> 5 * 8 + 3 = 43 -> page 10
    assert fields[0] == [8, 47, 43 // 4, 47 // 4]
    assert fields[1] == [3, 256 // 64 * 8 + 2, (256 // 64 * 8) // 4, (256 // 64 * 8 + 2) // 4]


# --- compress windows --------------------------------------------------------------------------


def dense_windows(x, ape, ratio, head_dim):
    """Every compressed row of a whole sequence, straight from the window definition."""
    out = {}
    n = x.shape[0]
    for end in range(ratio - 1, n, ratio):
        if ratio == 4:
            cur = x[end - 3 : end + 1]
            kv = [cur[:, head_dim : 2 * head_dim]]
            score = [cur[:, 3 * head_dim :]]
            if end >= 7:
                prev = x[end - 7 : end - 3]
                kv.insert(0, prev[:, :head_dim])
                score.insert(0, prev[:, 2 * head_dim : 3 * head_dim])
                bias = ape
            else:
                bias = ape[4:]
            kv, score = torch.cat(kv).double(), torch.cat(score).double() + bias.double()
        else:
            win = x[end - 127 : end + 1].double()
            kv, score = win[:, :head_dim], win[:, head_dim:] + ape.double()
        out[end] = (torch.softmax(score, 0) * kv).sum(0)
    return out


@pytest.mark.parametrize("ratio", [4, 128])
def test_compress_prefill_chunks_then_decode_match_the_dense_windows(ratio):
    head_dim = 128
    parts = 4 if ratio == 4 else 2
    ring = 8 if ratio == 4 else 128
    total = 300 if ratio == 128 else 29
    x = torch.randn(total, parts * head_dim)
    ape = torch.randn(8 if ratio == 4 else 128, head_dim)
    rid = 1
    buffer = torch.full((4 * ring // ratio, ratio, parts * head_dim), float("nan"))
    r2t = torch.zeros(4, 512, dtype=torch.int32)
    f2s = torch.zeros(1, dtype=torch.long)
    got = {}
    done = 0
    for chunk in ((130, 140) if ratio == 128 else (6, 11)):
        plan_c, plan_w = ops.plan_compress_prefill(
            torch.tensor([rid]), r2t, f2s, torch.tensor([done + chunk]), torch.tensor([chunk]),
            chunk, ratio, 256, ring, use_req_ring=ratio == 4,
        )
        out = ops.compress_forward(buffer, x[done : done + chunk], ape,
                                   PrefillPlan((ratio, plan_c, plan_w)), head_dim=head_dim,
                                   compress_ratio=ratio)
        for row, (seq_len, *_rest) in zip(out, decode_c(plan_c), strict=True):
            got[seq_len - 1] = row
        done += chunk
    while done < total:
        plan_d = ops.plan_compress_decode(torch.tensor([rid]), r2t, f2s,
                                          torch.tensor([done + 1]), ratio, 256, ring,
                                          use_req_ring=ratio == 4)
        out = ops.compress_forward(buffer, x[done : done + 1], ape, DecodePlan((ratio, plan_d)),
                                   head_dim=head_dim, compress_ratio=ratio)
        if (done + 1) % ratio == 0:
            got[done] = out[0]
        else:
            assert torch.equal(out[0], torch.zeros(head_dim))
        done += 1
    want = dense_windows(x, ape, ratio, head_dim)
    assert sorted(got) == sorted(want)
    for end in want:
        torch.testing.assert_close(got[end].double(), want[end], rtol=1e-5, atol=1e-5)


# --- fp8 pages --------------------------------------------------------------------------------


def test_ue8m0_rounds_scales_up_to_powers_of_two():
    scale = torch.tensor([1.0, 1.5, 0.25, 3.0e-3, 2.0**-20 * 1.01])
    exp = ops.ue8m0_exponent(scale)
    value = ops.ue8m0_value(exp)
    assert value.tolist() == [1.0, 2.0, 0.25, 2.0**-8, 2.0**-19]
    assert torch.equal(ops.ue8m0_inverse(exp) * value, torch.ones(5))


def test_indexer_store_matches_the_project_reference_numerics():
    from sgl_kernel_dsv4.fp8_reference import quantize_index_fp8
    from sgl_kernel_dsv4.index_rotation import hadamard_rotate

    n, page_size = 5, 64
    kv = torch.randn(n, 128, dtype=torch.bfloat16)
    weight = torch.rand(128) + 0.5
    freqs = torch.polar(torch.ones(40, 32), torch.rand(40, 32) * 6)
    seq_len = torch.tensor([4, 8, 12, 16, 20])
    plan_d = ops._words_to_bytes(torch.stack((seq_len, seq_len, seq_len, seq_len), 1))
    out_loc = torch.tensor([70, 3, 64, 127, 1])
    cache = torch.zeros(2, 132 * page_size, dtype=torch.uint8)
    ops.compress_norm_rope_store(kv, DecodePlan((4, plan_d)), norm_weight=weight,
                                 norm_eps=1e-6, freq_cis=freqs, out_loc=out_loc, kvcache=cache,
                                 page_size=page_size)
    x = kv.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.bfloat16().float()
    f = freqs[seq_len - 4]
    tail = torch.view_as_real(torch.view_as_complex(x[:, 64:].reshape(n, 32, 2)) * f).flatten(1)
    values, scale = quantize_index_fp8(hadamard_rotate(torch.cat((x[:, :64], tail), 1)))
    for i, loc in enumerate(out_loc.tolist()):
        page, slot = divmod(loc, page_size)
        got_v = cache[page, slot * 128 : slot * 128 + 128].view(torch.float8_e4m3fn)
        off = 128 * page_size + slot * 4
        got_s = cache[page, off : off + 4].view(torch.float32)
        torch.testing.assert_close(got_s, scale[i : i + 1], rtol=1e-6, atol=0)
        mismatched = (got_v.float() != values[i].float()).sum().item()
        assert mismatched <= 2, mismatched  # rounding-boundary ties from fp32 op order


def test_q_indexer_quant_folds_the_scale_into_the_weights():
    from sgl_kernel_dsv4.fp8_reference import quantize_index_fp8
    from sgl_kernel_dsv4.index_rotation import hadamard_rotate

    q = torch.randn(3, 4, 128, dtype=torch.bfloat16)
    w = torch.randn(3, 4, dtype=torch.bfloat16)
    freqs = torch.polar(torch.ones(10, 32), torch.rand(10, 32))
    pos = torch.tensor([0, 5, 9])
    q_fp8, w_out = ops.fused_q_indexer_rope_hadamard_quant(q, w, 0.125, freqs, pos)
    x = q.float()
    f = freqs[pos].unsqueeze(1)
    tail = torch.view_as_real(torch.view_as_complex(x[..., 64:].reshape(3, 4, 32, 2)) * f)
    values, scale = quantize_index_fp8(hadamard_rotate(torch.cat((x[..., :64], tail.flatten(2)), -1)))
    assert (q_fp8.float() != values.float()).sum() <= 4
    torch.testing.assert_close(w_out.squeeze(-1), w.float() * 0.125 * scale, rtol=1e-6, atol=0)


def v4_row(cache, loc, page_size):
    """(448 dequantized nope values, 64 rope values) of V4 token `loc`, from byte offsets."""
    page_bytes = -(-page_size * 584 // 576) * 576
    flat = cache.view(-1)
    page, slot = divmod(loc, page_size)
    data = flat[page * page_bytes + slot * 576 :][:576]
    scales = flat[page * page_bytes + 576 * page_size + slot * 8 :][:7]
    nope = data[:448].view(torch.float8_e4m3fn).float().view(7, 64)
    nope = nope * torch.pow(2.0, scales.float() - 127).unsqueeze(1)
    return nope.flatten(), data[448:].view(torch.bfloat16).float()


def test_swa_k_store_writes_v4_rows_and_skips_negative_slots():
    page_size = 64
    kv = torch.randn(4, 512, dtype=torch.bfloat16) * 3
    weight = torch.rand(512, dtype=torch.bfloat16) + 0.5
    freqs = torch.polar(torch.ones(16, 32), torch.rand(16, 32) * 6)
    pos = torch.tensor([0, 3, 7, 15])
    out_loc = torch.tensor([65, -1, 0, 127], dtype=torch.int32)
    cache = torch.zeros(2, ops.v4_page_bytes(page_size), dtype=torch.uint8)
    ops.fused_k_norm_rope_flashmla(kv, weight, 1e-6, freqs, pos, out_loc, cache, page_size)
    x = kv.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()
    for i, loc in enumerate(out_loc.tolist()):
        if loc < 0:
            continue
        nope, rope = v4_row(cache, loc, page_size)
        # e4m3 keeps 3 mantissa bits: within 1/16 of each tile's power-of-two scale step.
        tile_max = x[i, :448].view(7, 64).abs().amax(1, keepdim=True)
        assert ((nope.view(7, 64) - x[i, :448].view(7, 64)).abs() <= tile_max / 8).all()
        want_rope = torch.view_as_real(torch.view_as_complex(x[i, 448:].view(32, 2)) * freqs[pos[i]])
        torch.testing.assert_close(rope, want_rope.flatten().bfloat16().float())
    # the row with out_loc -1 wrote nothing: only 3 rows' bytes are non-zero
    assert int((cache.view(-1) != 0).sum()) <= 3 * (576 + 7)


def test_rope_inverse_undoes_rope_and_q_norm_rope_keeps_the_nope_dims():
    freqs = torch.polar(torch.ones(8, 32), torch.rand(8, 32) * 6)
    pos = torch.tensor([1, 6])
    q = torch.randn(2, 3, 512, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ops.fused_q_norm_rope(q, out, 1e-6, freqs, pos)
    normed = (q.float() * torch.rsqrt(q.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert torch.equal(out[..., :448], normed[..., :448])
    tail = out[..., 448:].clone()
    ops.fused_rope_inplace(tail, None, freqs, pos, inverse=True)
    torch.testing.assert_close(tail.float(), normed[..., 448:].float(), rtol=0.02, atol=0.02)


def test_hash_topk_and_sinkhorn():
    logits = torch.randn(3, 4)
    tid2eid = torch.tensor([[0, 1], [2, 3], [1, 3]], dtype=torch.int32)
    weights, ids = ops.hash_topk(logits, torch.tensor([2, 0, 1]), tid2eid, 1, 1.5)
    assert ids.tolist() == [[1, 3, 4], [0, 1, 4], [2, 3, 4]]
    chosen = torch.nn.functional.softplus(logits.gather(1, ids[:, :2].long())).sqrt()
    torch.testing.assert_close(weights[:, :2], chosen / chosen.sum(1, keepdim=True))
    assert torch.allclose(weights[:, 2], torch.full((3,), 1 / 1.5))
    pre, post, comb = ops.hc_split_sinkhorn(torch.randn(2, 3, 24), torch.rand(3), torch.randn(24))
    assert pre.shape == post.shape == (2, 3, 4) and comb.shape == (2, 3, 4, 4)
    torch.testing.assert_close(comb.sum(-2), torch.ones(2, 3, 4), atol=1e-4, rtol=0)


def test_mhc_combine_weights_the_streams():
    x = torch.randn(5, 4 * 6, dtype=torch.bfloat16)
    pre = torch.rand(5, 4)
    y = ops.mhc_combine(x, pre, 4, torch.bfloat16)
    want = (pre.unsqueeze(-1) * x.float().view(5, 4, 6)).sum(1)
    torch.testing.assert_close(y.float(), want.bfloat16().float())


UPSTREAM_TRITON = r"""
import torch
from sglang_dsv4.cpu_backend import ops
from sglang.kernels.ops.attention.dsv4.dequant_k_cache import dequantize_k_cache_paged_dsv4
from sglang.kernels.ops.attention.dsv4.rope import fused_norm_rope_inplace_triton

torch.manual_seed(1)
page_size, n = 64, 6
kv = torch.randn(n, 512, dtype=torch.bfloat16) * 2
weight = torch.rand(512, dtype=torch.bfloat16) + 0.5
freqs = torch.polar(torch.ones(64, 32), torch.rand(64, 32) * 6)
seq_len = torch.arange(1, n + 1) * 4
plan_d = ops._words_to_bytes(torch.stack((seq_len,) * 4, 1))
out_loc = torch.tensor([0, 5, 64, 70, 127, 9])
cache = torch.zeros(2, ops.v4_page_bytes(page_size), dtype=torch.uint8)


class Plan(tuple):
    is_decode = True
    compress_ratio = 4
    plan_d = property(lambda self: self[1])


ops.compress_norm_rope_store(kv, Plan((4, plan_d)), norm_weight=weight, norm_eps=1e-6,
                             freq_cis=freqs, out_loc=out_loc, kvcache=cache, page_size=page_size)
got = dequantize_k_cache_paged_dsv4(cache, out_loc, page_size).squeeze(1).float()
ref = kv.clone()
fused_norm_rope_inplace_triton(ref, weight, 1e-6, freqs, positions=seq_len - 4)
ref = ref.float()
rope_err = (got[:, 448:] - ref[:, 448:]).abs().max().item()
tile_max = ref[:, :448].reshape(n, 7, 64).abs().amax(-1, keepdim=True)
nope_err = ((got[:, :448] - ref[:, :448]).reshape(n, 7, 64).abs() / tile_max).max().item()
print("ROPE", rope_err, "NOPE", nope_err)
"""


def test_v4_compressed_rows_read_back_by_upstream_dequantizer_equal_upstream_norm_rope():
    """Upstream's own Triton dequantizer reads the V4 pages this backend wrote, and upstream's
    Triton norm + rope (its HIP compressor path) gives the values they must hold (interpreter)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = warm_python.run(["-c", textwrap.dedent(UPSTREAM_TRITON)], env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROPE")][-1].split()
    rope_err, nope_err = float(line[1]), float(line[3])
    assert rope_err <= 0.05  # bf16 rounding of values of magnitude <= ~4
    assert nope_err <= 1 / 8  # e4m3: 3 mantissa bits against the tile's power-of-two scale


# --- ops that stand for upstream kernels: compared with those kernels themselves ----------------


@pytest.mark.parametrize("shape", ["prefill", "decode"])
def test_sparse_mla_matches_upstream_torch_path(shape):
    """`sparse_attention.sparse_mla` against upstream's `_sm120_sparse_decode_fwd` (the torch sparse MLA):
    a prefill's sliding windows (rows shared across tokens) and a decode batch padded to 64
    heads (zero queries) with random rows; invalid indices, top-k lengths, a token with no
    valid index, the compressed rows as the extra cache, the sink."""
    from sglang.kernels.ops.attention.flash_mla_sm120 import _sm120_sparse_decode_fwd

    gen = torch.Generator().manual_seed(3)
    main, extra = v4_cache(6, 64, 384, 1), v4_cache(3, 64, 96, 2)
    if shape == "prefill":
        tokens, heads, real, k, ke = 40, 8, 8, 32, 16
        t = torch.arange(tokens).view(tokens, 1, 1) + 20
        idx = (t - torch.arange(k).view(1, 1, k)).int()
    else:
        tokens, heads, real, k, ke = 6, 64, 8, 48, 16
        idx = torch.randint(0, 384, (tokens, 1, k), generator=gen, dtype=torch.int32)
    idx[:, :, -3:] = -1
    idx[1] = -1
    extra_idx = torch.randint(-1, 96, (tokens, 1, ke), generator=gen, dtype=torch.int32)
    extra_idx[1] = -1
    if shape == "decode":
        extra_idx[:] = -1  # no compressed row yet (a short sequence)
    q = torch.zeros(tokens, 1, heads, 576, dtype=torch.bfloat16)
    q[:, :, :real] = torch.randn(tokens, 1, real, 576, generator=gen).bfloat16()
    lengths = torch.randint(1, k + 1, (tokens,), generator=gen, dtype=torch.int32)
    extra_lengths = torch.randint(0, ke + 1, (tokens,), generator=gen, dtype=torch.int32)
    sink = torch.randn(heads, generator=gen)
    args = (q, main, idx, lengths, sink, 512, 0.06, extra, extra_idx, extra_lengths)
    out, lse = sparse_attention.sparse_mla(*args, chunk_entries=200)  # several chunks
    want_out, want_lse = _sm120_sparse_decode_fwd(*args)
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    assert out.dtype == want_out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(lse.isinf(), want_lse.isinf())
    torch.testing.assert_close(lse.nan_to_num(0, 0, 0), want_lse.nan_to_num(0, 0, 0))
    assert not out[1].any() and lse[1].isinf().all()  # no valid index: 0 and -inf


def test_distinct_is_unique_with_inverse():
    x = torch.tensor([[5, 3, 5], [9, 3, -1]])
    values, inverse = sparse_attention.distinct(x)
    want_values, want_inverse = torch.unique(x, return_inverse=True)
    assert torch.equal(values, want_values) and torch.equal(inverse, want_inverse)


UPSTREAM_TRITON_KERNELS = r"""
import torch
from sglang_dsv4.cpu_backend import ops
from sglang.kernels.ops.layernorm.mhc_head import fused_hc_head
from sglang.kernels.ops.attention.dsv4.metadata_kernel import init_compression_metadata

torch.manual_seed(2)
x = torch.randn(5, 4, 96, dtype=torch.bfloat16)
fn = torch.randn(4, 4 * 96) * 0.05
scale, base = torch.rand(1) + 0.5, torch.randn(4)
got = ops.fused_hc_head(x, fn, scale, base, 1e-6, 1e-6).float()
want = fused_hc_head(x, fn, scale, base, 1e-6, 1e-6).float()
print("HC_HEAD", (got - want).abs().max().item(), want.abs().max().item())

seq_lens = torch.tensor([1, 4, 128, 300, 256, 7], dtype=torch.int32)
positions = (seq_lens - 1).long()
raw_out_loc = torch.tensor([9, 16, 1024, 44, 2048], dtype=torch.int64)  # the last row writes none
page_table = torch.tensor([[3, 1], [0, 2], [5, 4], [6, 7], [2, 2], [1, 0]], dtype=torch.int32)
for compute in (True, False):
    got = ops.init_compression_metadata(seq_lens, positions, raw_out_loc, page_table, 256, compute)
    want = init_compression_metadata(seq_lens, positions, raw_out_loc, page_table, 256, compute)
    same = all((g is None and w is None) or (g.dtype == w.dtype and torch.equal(g, w))
               for g, w in zip(got, want, strict=True))
    print("METADATA", compute, same)
"""


def test_hc_head_and_compression_metadata_match_upstream_triton_kernels():
    """`ops.fused_hc_head` and `ops.init_compression_metadata` against upstream's Triton kernels
    they stand for (`_hc_head_kernel`, `_init_compressed_attn_metadata_kernel`), interpreted."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = warm_python.run(["-c", textwrap.dedent(UPSTREAM_TRITON_KERNELS)], env=env,
                           timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln.split() for ln in proc.stdout.splitlines()]
    err, magnitude = next(map(float, ln[1:]) for ln in lines if ln[0] == "HC_HEAD")
    assert 0 < magnitude and err <= magnitude / 128  # a bf16 rounding step at most
    assert [ln[1:] for ln in lines if ln[0] == "METADATA"] == [["True", "True"], ["False", "True"]]


@pytest.mark.parametrize("shape", ["prefill", "decode"])
def test_fp8_index_logits_match_upstream_torch_path(shape):
    """`sparse_attention.fp8_paged_mqa_logits` against upstream's `fp8_paged_mqa_logits_torch_sm120`: rows
    sharing one request's pages (a prefill) and rows with pages of their own (a decode batch)."""
    from sglang.srt.layers.attention.dsv4.indexer import fp8_paged_mqa_logits_torch_sm120

    gen = torch.Generator().manual_seed(4)
    pages, heads = 9, 8
    values = (torch.randn(pages, 64, 128, generator=gen) * 40).to(torch.float8_e4m3fn)
    scales = torch.rand(pages, 64, generator=gen) / 50
    raw = torch.cat((values.view(torch.uint8).reshape(pages, -1),
                     scales.view(torch.uint8).reshape(pages, -1)), dim=1)
    cache = raw.view(pages, 64, 1, 132)
    if shape == "prefill":
        rows = 30
        page_table = torch.tensor([[4, 2, 7, -1]], dtype=torch.int32).expand(rows, 4).contiguous()
        seq_lens = torch.randint(1, 3 * 64, (rows,), generator=gen, dtype=torch.int32)
    else:
        rows = 5
        page_table = torch.randint(0, pages, (rows, 4), generator=gen, dtype=torch.int32)
        seq_lens = torch.randint(1, 4 * 64, (rows,), generator=gen, dtype=torch.int32)
    q = (torch.randn(rows, 1, heads, 128, generator=gen) * 3).to(torch.float8_e4m3fn)
    weight = torch.randn(rows, heads, generator=gen)
    args = (q, cache, weight, seq_lens, page_table, None, 230)
    got = sparse_attention.fp8_paged_mqa_logits(*args, chunk_values=5000)  # several row chunks
    want = fp8_paged_mqa_logits_torch_sm120(*args, clean_logits=False)
    assert got.shape == want.shape == (rows, 230)
    assert torch.equal(got.isinf(), want.isinf()) and got.isinf().any()
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], atol=1e-3, rtol=1e-2)


@pytest.mark.parametrize("shape", ["prefill", "decode"])
def test_bf16_index_logits_match_the_kernel_packages_torch_path(shape):
    """`sparse_attention.bf16_paged_mqa_logits` against `sgl_kernel_dsv4`'s torch path (the contract its
    Triton kernel is held to): shared pages with a -1 entry inside seq_len, and own pages."""
    from sgl_kernel_dsv4.index_logits import bf16_paged_mqa_logits_torch

    gen = torch.Generator().manual_seed(5)
    pages, heads = 9, 8
    cache = torch.randn(pages, 64, 1, 128, generator=gen).bfloat16()
    if shape == "prefill":
        rows = 30
        page_table = torch.tensor([[4, -1, 7, 2]], dtype=torch.int32).expand(rows, 4).contiguous()
    else:
        rows = 5
        page_table = torch.randint(0, pages, (rows, 4), generator=gen, dtype=torch.int32)
    seq_lens = torch.randint(1, 4 * 64, (rows,), generator=gen, dtype=torch.int32)
    q = torch.randn(rows, 1, heads, 128, generator=gen).bfloat16()
    weight = torch.randn(rows, heads, generator=gen)
    args = (q, cache, weight, seq_lens, page_table, 250)
    got = sparse_attention.bf16_paged_mqa_logits(*args, chunk_values=5000)
    want = bf16_paged_mqa_logits_torch(*args)
    assert torch.equal(got.isinf(), want.isinf()) and got.isinf().any()
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], atol=1e-3, rtol=1e-4)
