"""The kit's cpu_ops stage: each torch op of the CPU backend against the CUDA op it stands for.

`sglang_dsv4.cpu_backend.ops` holds torch versions of upstream's CUDA-only DeepSeek-V4 JIT ops,
proven on the CPU only against references built from the layouts. On a GPU host this stage runs
upstream's own op (its Python wrapper, unpatched: the CPU backend is off on CUDA) on CUDA and the
torch op on the CPU on the same seeded inputs, at the tiny model's shapes (8 heads, 8 index
heads) and DeepSeek-V4-Flash's (64 and 64), and reports per op:

- plans (c_plan.cuh, prefill for ratio 4 and 128 and decode): byte-equal;
- compress_4_v2 / compress_128_v2 (prefill then decode): compressed rows and the state ring
  after, max relative difference (fp32 math, expf vs exp: <= 1e-3);
- fused_norm_rope_v2 (indexer 132 B and V4 584 B pages), main_k_norm_rope_flashmla: the share
  of cache bytes that differ (fp8 rounding ties only: <= 1 %) and the scale bytes equal;
- main_q_norm_rope, fused_rope (inverse), main_q_indexer_rope_hadamard_quant, hash_topk, the
  clamped SwiGLU, the Sinkhorn split and mhc_combine: max relative difference (bf16 / fp8 outputs: <= 2^-6,
  fp8 rows by the share of differing bytes).

Runs only when sglang is importable; on the CPU it compares nothing and says so. It is not in
the kit's default run (`harness.STAGE_MODULES`, whose budgets fill the kit's 8 minutes): the
first call of each upstream op JIT-compiles it, minutes on a fresh host. Run it on its own:

    PYTHONPATH=python:sgl-kernel/python python -m benchmark.gpu_check.cpu_ops_stage --out DIR

which writes DIR/cpu_ops.json and prints one line per case; exit 0 when every case passed.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

from benchmark.gpu_check import harness
from benchmark.gpu_check.harness import Stage

REPO = Path(__file__).resolve().parents[2]
SHAPES = {"tiny": SimpleNamespace(heads=8, index_heads=8), "real": SimpleNamespace(heads=64,
                                                                                 index_heads=64)}


def _ops():
    python_dir = str(REPO / "python")
    if python_dir not in sys.path:
        sys.path.insert(0, python_dir)
    from sglang_dsv4.cpu_backend import ops

    return ops


def _rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _byte_diff(a, b) -> float:
    return float((a.cpu() != b.cpu()).double().mean())


class _Plan(tuple):
    compress_ratio = property(lambda self: self[0])


def case_plans(device, up, ops, torch):
    out = []
    seq, ext, rids = [300, 9, 140], [300, 5, 70], [2, 0, 1]
    r2t = torch.randperm(4 * 512, generator=torch.Generator().manual_seed(1)).view(4, 512)
    r2t = r2t.to(torch.int32)
    f2s = torch.randperm(4 * 512, generator=torch.Generator().manual_seed(2))
    for ratio, ring in ((4, 8), (128, 128)):
        args = dict(compress_ratio=ratio, req_pool_indices=torch.tensor(rids),
                    seq_lens=torch.tensor(seq), extend_lens=torch.tensor(ext),
                    req_to_token=r2t, full_to_state=f2s, swa_page_size=256, ring_size=ring,
                    num_q_tokens=sum(ext))
        cuda = up.CompressorPrefillPlan.generate(**{
            k: (v.to(device) if k in ("req_pool_indices", "req_to_token", "full_to_state")
                else v) for k, v in args.items()})
        c, w = ops.plan_compress_prefill(
            args["req_pool_indices"], r2t, f2s, args["seq_lens"], args["extend_lens"],
            sum(ext), ratio, 256, ring)
        same = torch.equal(cuda.plan_c.cpu(), c) and torch.equal(cuda.plan_w.cpu(), w)
        out.append({"case": f"prefill plan ratio {ratio}", "byte_equal": same, "ok": same})
        cuda_d = up.CompressorDecodePlan.generate(
            ratio, args["req_pool_indices"].to(device), r2t.to(device), f2s.to(device),
            torch.tensor(seq).to(device), 256, ring)
        d = ops.plan_compress_decode(args["req_pool_indices"], r2t, f2s, torch.tensor(seq),
                                     ratio, 256, ring)
        same = torch.equal(cuda_d.plan_d.cpu(), d)
        out.append({"case": f"decode plan ratio {ratio}", "byte_equal": same, "ok": same})
    return out


def case_compress(device, up, ops, torch, head_dim):
    out = []
    for ratio in (4, 128):
        parts, ring = (4, 8) if ratio == 4 else (2, 128)
        gen = torch.Generator().manual_seed(ratio + head_dim)
        total = 300 if ratio == 128 else 40
        x = torch.randn(total, parts * head_dim, generator=gen)
        ape = torch.randn(8 if ratio == 4 else 128, head_dim, generator=gen)
        rid = torch.tensor([1])
        r2t = torch.zeros(4, 512, dtype=torch.int32)
        f2s = torch.zeros(1, dtype=torch.long)
        buf_cpu = torch.zeros(4 * ring // ratio, ratio, parts * head_dim)
        buf_gpu = buf_cpu.to(device)
        chunk = total - 3
        c, w = ops.plan_compress_prefill(rid, r2t, f2s, torch.tensor([chunk]),
                                         torch.tensor([chunk]), chunk, ratio, 256, ring,
                                         use_req_ring=ratio == 4)
        got = ops.compress_forward(buf_cpu, x[:chunk], ape,
                                   up.CompressorPrefillPlan(ratio, c, w, None),
                                   head_dim=head_dim, compress_ratio=ratio)
        want = up.compress_forward(buf_gpu, x[:chunk].to(device), ape.to(device),
                                   up.CompressorPrefillPlan(ratio, c.to(device), w.to(device)),
                                   head_dim=head_dim, compress_ratio=ratio)
        errs = [_rel(got, want)]
        for pos in range(chunk, total):
            d = ops.plan_compress_decode(rid, r2t, f2s, torch.tensor([pos + 1]), ratio, 256,
                                         ring, use_req_ring=ratio == 4)
            g = ops.compress_forward(buf_cpu, x[pos : pos + 1], ape,
                                     up.CompressorDecodePlan(ratio, d), head_dim=head_dim,
                                     compress_ratio=ratio)
            v = up.compress_forward(buf_gpu, x[pos : pos + 1].to(device), ape.to(device),
                                    up.CompressorDecodePlan(ratio, d.to(device)),
                                    head_dim=head_dim, compress_ratio=ratio)
            if (pos + 1) % ratio == 0:
                errs.append(_rel(g, v))
        ring_err = _rel(buf_cpu, buf_gpu)
        ok = max(errs) <= 1e-3 and ring_err <= 1e-6
        out.append({"case": f"compress_{ratio}_v2 head_dim {head_dim}", "rows_max_rel": max(errs),
                    "ring_max_rel": ring_err, "ok": ok})
    return out


def case_norm_rope_store(device, up, ops, torch, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    n, page_size = 64, 64
    kv = (torch.randn(n, head_dim, generator=gen) * 2).bfloat16()
    weight = torch.rand(head_dim, generator=gen) + 0.5
    freqs = torch.polar(torch.ones(512, 32), torch.rand(512, 32, generator=gen) * 6)
    seq_len = (torch.arange(n) + 1) * 4
    plan = ops._words_to_bytes(torch.stack((seq_len,) * 4, 1))
    out_loc = torch.randperm(4 * page_size, generator=gen)[:n]
    page_bytes = 132 * page_size if head_dim == 128 else ops.v4_page_bytes(page_size)
    cache_cpu = torch.zeros(4, page_bytes, dtype=torch.uint8)
    cache_gpu = cache_cpu.to(device)
    kw = dict(norm_weight=weight, norm_eps=1e-6, freq_cis=freqs, page_size=page_size)
    ops.compress_norm_rope_store(kv, up.CompressorDecodePlan(4, plan), out_loc=out_loc,
                                 kvcache=cache_cpu, **kw)
    up.compress_norm_rope_store(kv.to(device), up.CompressorDecodePlan(4, plan.to(device)),
                                out_loc=out_loc.to(device), kvcache=cache_gpu,
                                **{k: (v.to(device) if hasattr(v, "to") else v)
                                   for k, v in kw.items()})
    diff = _byte_diff(cache_cpu, cache_gpu)
    return [{"case": f"fused_norm_rope_v2 head_dim {head_dim}", "bytes_differing": diff,
             "ok": diff <= 0.01}]


def case_norm_rope(device, up_nr, ops, torch, shape):
    out = []
    gen = torch.Generator().manual_seed(shape.heads)
    b = 32
    freqs = torch.polar(torch.ones(1024, 32), torch.rand(1024, 32, generator=gen) * 6)
    pos = torch.randint(0, 1024, (b,), generator=gen)
    q = (torch.randn(b, shape.heads, 512, generator=gen) * 2).bfloat16()
    got = torch.empty_like(q)
    ops.fused_q_norm_rope(q, got, 1e-6, freqs, pos)
    want = torch.empty_like(q, device=device)
    up_nr.fused_q_norm_rope(q.to(device), want, 1e-6, freqs.to(device), pos.to(device))
    err = _rel(got, want)
    out.append({"case": f"main_q_norm_rope {shape.heads} heads", "max_rel": err,
                "ok": err <= 2**-6})
    tail = q[..., -64:].clone()
    tail_gpu = tail.to(device)
    ops.fused_rope_inplace(tail, None, freqs, pos, inverse=True)
    up_nr.fused_rope_inplace(tail_gpu, None, freqs.to(device), pos.to(device), inverse=True)
    err = _rel(tail, tail_gpu)
    out.append({"case": f"fused_rope inverse {shape.heads} heads", "max_rel": err,
                "ok": err <= 2**-6})
    qi = torch.randn(b, shape.index_heads, 128, generator=gen).bfloat16()
    w = torch.randn(b, shape.index_heads, generator=gen).bfloat16()
    g_q, g_w = ops.fused_q_indexer_rope_hadamard_quant(qi, w, 0.125, freqs, pos)
    u_q, u_w = up_nr.fused_q_indexer_rope_hadamard_quant(qi.to(device), w.to(device), 0.125,
                                                         freqs.to(device), pos.to(device))
    diff = _byte_diff(g_q.view(torch.uint8), u_q.view(torch.uint8))
    err = _rel(g_w, u_w)
    out.append({"case": f"main_q_indexer_rope_hadamard_quant {shape.index_heads} heads",
                "fp8_bytes_differing": diff, "weights_max_rel": err,
                "ok": diff <= 0.01 and err <= 1e-5})
    kv = (torch.randn(b, 512, generator=gen) * 2).bfloat16()
    kw = (torch.rand(512, generator=gen) + 0.5).bfloat16()
    loc = torch.randperm(256, generator=gen)[:b].to(torch.int32)
    loc[3] = -1
    cache = torch.zeros(4, ops.v4_page_bytes(64), dtype=torch.uint8)
    cache_gpu = cache.to(device)
    ops.fused_k_norm_rope_flashmla(kv, kw, 1e-6, freqs, pos, loc, cache, 64)
    up_nr.fused_k_norm_rope_flashmla(kv.to(device), kw.to(device), 1e-6, freqs.to(device),
                                     pos.to(device), loc.to(device), cache_gpu, 64)
    diff = _byte_diff(cache, cache_gpu)
    out.append({"case": "main_k_norm_rope_flashmla (SWA store)", "bytes_differing": diff,
                "ok": diff <= 0.01})
    return out


def case_misc(device, ops, torch):
    from sglang.kernels.ops.activation.silu_and_mul_clamp import silu_and_mul_clamp
    from sglang.kernels.ops.layernorm.mhc import hc_split_sinkhorn
    from sglang.kernels.ops.moe.dsv4 import hash_topk

    out = []
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 256, generator=gen)
    ids = torch.randint(0, 1024, (64,), generator=gen)
    tid2eid = torch.stack([torch.randperm(256, generator=gen)[:6] for _ in range(1024)])
    tid2eid = tid2eid.to(torch.int32)
    gw, gi = ops.hash_topk(logits, ids, tid2eid, 1, 1.5)
    uw, ui = hash_topk(logits.to(device), ids.to(device), tid2eid.to(device), 1, 1.5)
    ok = torch.equal(gi, ui.cpu()) and _rel(gw, uw) <= 1e-5
    out.append({"case": "hash_topk", "ids_equal": torch.equal(gi, ui.cpu()),
                "weights_max_rel": _rel(gw, uw), "ok": ok})
    x = (torch.randn(64, 2 * 2048, generator=gen) * 8).bfloat16()
    got = torch.empty(64, 2048, dtype=torch.bfloat16)
    ops.silu_and_mul_clamp(x, got, 10.0)
    want = torch.empty(64, 2048, dtype=torch.bfloat16, device=device)
    silu_and_mul_clamp(x.to(device), want, 10.0)
    err = _rel(got, want)
    out.append({"case": "silu_and_mul_clamp", "max_rel": err, "ok": err <= 2**-7})
    mixes = torch.randn(2, 16, 24, generator=gen)
    scale, base = torch.rand(3, generator=gen), torch.randn(24, generator=gen)
    g = ops.hc_split_sinkhorn(mixes, scale, base)
    u = hc_split_sinkhorn(mixes.to(device), scale.to(device), base.to(device))
    err = max(_rel(a, b) for a, b in zip(g, u, strict=True))
    out.append({"case": "hc_split_sinkhorn", "max_rel": err, "ok": err <= 1e-4})
    from sglang.kernels.ops.layernorm.mhc import mhc_combine

    x = torch.randn(64, 4 * 4096, generator=gen).bfloat16()
    pre = torch.rand(64, 4, generator=gen)
    err = _rel(ops.mhc_combine(x, pre, 4, torch.bfloat16),
               mhc_combine(x.to(device), pre.to(device), 4, torch.bfloat16))
    out.append({"case": "mhc_combine", "max_rel": err, "ok": err <= 2**-7})
    return out


def stage_cpu_ops(kit, rec):
    """Every CPU-backend op against its CUDA original, tiny and real shapes."""
    import torch

    ops = _ops()
    if not str(kit.device).startswith("cuda"):
        rec["notes"].append("no CUDA: nothing to compare against; the torch ops are proven on the "
                            "CPU by test/test_cpu_ops.py")
        rec["ok"] = True
        return
    from sglang.kernels.ops.attention.dsv4 import compress as up
    from sglang.kernels.ops.attention.dsv4 import norm_rope as up_nr

    rec["cases"] += case_plans(kit.device, up, ops, torch)
    for head_dim in (128, 512):
        rec["cases"] += case_compress(kit.device, up, ops, torch, head_dim)
        rec["cases"] += case_norm_rope_store(kit.device, up, ops, torch, head_dim)
    for shape in SHAPES.values():
        rec["cases"] += case_norm_rope(kit.device, up_nr, ops, torch, shape)
    rec["cases"] += case_misc(kit.device, ops, torch)
    rec["ok"] = bool(rec["cases"]) and all(c["ok"] for c in rec["cases"])


STAGES = (
    Stage(
        "cpu_ops",
        900,
        "the CPU backend's torch ops against upstream's CUDA ops, tiny and real shapes",
        stage_cpu_ops,
        needs_sglang=True,
        proves_correctness=True,
    ),
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmark.gpu_check.cpu_ops_stage",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "out" / "gpu-check")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("cpu_ops: no CUDA device; this stage compares against the CUDA ops")
        return harness.EXIT_CANNOT_RUN
    signal.signal(signal.SIGALRM, harness.on_alarm)
    kit = SimpleNamespace(device="cuda", cuda=True, torch=torch, sglang_version="importable",
                          sglang_absent="", report={"stages": {}}, progress=print)
    (stage,) = STAGES
    rec = harness.run_stage(kit, stage)
    for case in rec["cases"]:
        print(("PASS " if case["ok"] else "FAIL ") + json.dumps(case))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_ops.json").write_text(json.dumps(rec, indent=2))
    return harness.EXIT_OK if rec["status"] == "passed" else harness.EXIT_CORRECTNESS


if __name__ == "__main__":
    sys.exit(main())
