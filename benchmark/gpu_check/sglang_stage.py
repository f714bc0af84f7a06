"""The kit's sglang stage: one bf16 decode step of a DeepSeek-V4 c4 indexer layer through upstream's
real objects with the distribution's fixes applied, on a given device, with each top-k step
serving runs there: upstream's torch top-k everywhere, and on CUDA its CUDA top-k v1 and v2
(the sgl-kernel backend, SGLANG_OPT_USE_TOPK_V2 off / on), each held against the CPU's.

Runs only when sglang is importable (the bare GPU host has no sglang; the module imports it only
inside the step). The same seeded inputs run on each device:

- the real DeepSeekV4TokenToKVPool for DeepSeek-V4-Flash with bf16 index keys, sized by upstream's
  configurator chain (`sglang_dsv4.plan.chain`), allocated on the device;
- the write path: compressed rows turned into index keys by the fix's write step
  (store_bf16_index_keys_from_plan: RMSNorm, RoPE, Hadamard, bf16) in the pool. Upstream's
  compress_forward itself is not run: its plan comes from upstream's CUDA planner, which needs a
  scheduled batch; the rows it would produce are given directly;
- the read path: a real C4Indexer (seeded random weights) and C4Indexer.forward, which the fix
  routes to forward_c4_indexer_bf16 (bf16 query, bf16_paged_mqa_logits: Triton on CUDA, torch on
  the CPU), then upstream's top-k step (the chosen backend) into the metadata's index buffers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

from benchmark.gpu_check.harness import Stage

REPO = Path(__file__).resolve().parents[2]
PAGE = 64
TOPK = 512
REQUESTS = ((700, 11), (300, 5))  # (index keys, pages) of the two requests decoded


def load_fixes():
    """The distribution's fixes, applied as a server process applies them (the plugin)."""
    python_dir = str(REPO / "python")
    if python_dir not in sys.path:
        sys.path.insert(0, python_dir)
    from sglang_dsv4 import plugin

    plugin.load()


TOPK_STEPS = ("torch", "v1", "v2")  # upstream's torch top-k; its CUDA top-k v1 and v2


def topk_steps(device: str) -> tuple:
    """The top-k steps serving runs on `device`: the CUDA ones need CUDA."""
    return TOPK_STEPS if str(device).startswith("cuda") else TOPK_STEPS[:1]


def run_decode_step_on(device: str, seed: int = 0, topk: str = "torch") -> dict:
    """Keys written and the top-512 positions chosen, on `device`, with the top-k step `topk`
    (see TOPK_STEPS); tensors come back on the CPU."""
    if topk not in TOPK_STEPS:
        raise ValueError(f"topk must be one of {TOPK_STEPS}, got {topk!r}")
    import torch

    load_fixes()
    from sglang.kernels.ops.attention.dsv4.compress import CompressorDecodePlan
    from sglang.kernels.ops.attention.dsv4.rope import precompute_freqs_cis
    from sglang.srt.environ import envs
    from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend
    from sglang.srt.layers.attention.dsv4 import compressor_v2
    from sglang.srt.layers.attention.dsv4.indexer import C4Indexer
    from sglang.srt.layers.attention.dsv4.metadata import PagedIndexerMetadata
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang_dsv4.plan.chain import activated, build_chain, build_pool, size_for_tokens

    chain = build_chain("bf16")
    pool = build_pool(chain, size_for_tokens(chain, 5120, 4), device=device)
    layer = next(i for i, m in enumerate(pool.layer_mapping) if m and m.compress_ratio == 4)
    config = chain.model_config.hf_config
    freqs = precompute_freqs_cis(config.qk_rope_head_dim, 8192, 0, 160000.0, 1, 32, 1)
    with activated(chain):
        indexer = C4Indexer(config, layer_id=layer, freqs_cis=freqs)
    gen = torch.Generator().manual_seed(seed)
    for param in indexer.parameters():  # drawn on the CPU: the same weights on every device
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    indexer.compressor.norm.weight.data.uniform_(0.5, 1.5, generator=gen)
    indexer = indexer.to(device)
    indexer.freqs_cis = indexer.freqs_cis.to(device)
    indexer.compressor.freqs_cis = indexer.compressor.freqs_cis.to(device)

    # Write: one compressed row per index key, each completing its group of 4 tokens.
    total_pages = pool.get_index_k_bf16_buffer(layer).shape[0]
    order = (torch.randperm(total_pages - 1, generator=gen) + 1).tolist()  # page 0 pads
    slots, seq_lens, tables, taken = [], [], [], 0
    for keys, pages in REQUESTS:
        mine = order[taken : taken + pages]
        taken += pages
        tables.append(mine)
        slots += [p * PAGE + s for p in mine for s in range(PAGE)][:keys]
        seq_lens += [4 * (t + 1) for t in range(keys)]
    rows = torch.zeros(len(slots), 4, dtype=torch.int32)
    rows[:, 0] = torch.tensor(seq_lens, dtype=torch.int32)
    plan = CompressorDecodePlan(4, rows.view(torch.uint8).to(device))
    compressed = (torch.randn(len(slots), 128, generator=gen) * 3).to(device)
    out_loc = torch.tensor(slots, device=device)
    rows_view = pool.get_index_k_bf16_buffer(layer).view(-1, compressed.shape[1])
    compressor_v2.store_bf16_index_keys_from_plan(
        rows_view, compressed, plan, out_loc, indexer.compressor.norm,
        indexer.compressor.freqs_cis,
    )

    # Read: one decode step of the two requests through the patched C4Indexer.forward.
    width = max(len(t) for t in tables)
    page_table = torch.zeros(len(REQUESTS), width, dtype=torch.int32)
    for row, pages in enumerate(tables):
        page_table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    lengths = torch.tensor([k for k, _ in REQUESTS], dtype=torch.int32)
    use_v2 = topk == "v2"
    with envs.SGLANG_FP8_PAGED_MQA_LOGITS_TORCH.override(True):
        paged = PagedIndexerMetadata(
            page_size=256,
            compressed_page_size=PAGE,
            page_table=page_table.to(device),
            compressed_seq_lens=lengths.to(device),
            use_topk_v2=use_v2,
        )
    core = SimpleNamespace(
        positions=(lengths.long() * 4 + 2).to(device),
        c4_sparse_page_indices=torch.full(
            (len(REQUESTS), TOPK), -7, dtype=torch.int32, device=device
        ),
        c4_sparse_raw_indices=torch.full(
            (len(REQUESTS), TOPK), -7, dtype=torch.int32, device=device
        ),
    )
    backend = object.__new__(DeepseekV4AttnBackend)  # its constructor needs a model runner
    backend.token_to_kv_pool = pool
    backend.dsa_topk_backend = DSATopKBackend.TORCH if topk == "torch" else DSATopKBackend.SGL_KERNEL
    backend.hisparse_coordinator = None
    backend.debug_use_external_c4_sparse_indices = False
    backend.forward_metadata = SimpleNamespace(indexer_metadata=paged, core_metadata=core)
    x = torch.randn(len(REQUESTS), 4096, generator=gen).to(torch.bfloat16).to(device)
    q_lora = torch.randn(len(REQUESTS), 1024, generator=gen).to(torch.bfloat16).to(device)
    with torch.no_grad(), envs.SGLANG_OPT_USE_TOPK_V2.override(use_v2):
        indexer.forward(
            x=x,
            q_lora=q_lora,
            forward_batch=SimpleNamespace(forward_mode=ForwardMode.DECODE),
            attn_backend=backend,
            skip_compressor=True,
        )
    stored = pool.get_index_k_bf16(layer, torch.tensor(slots, device=device))
    return {
        "keys": stored.cpu(),
        "positions": core.c4_sparse_raw_indices.cpu(),
        "slots": core.c4_sparse_page_indices.cpu(),
        "lengths": lengths,
        "tables": tables,
    }


def compare_steps(cpu: dict, other: dict) -> dict:
    """The keys stored (within one bf16 rounding: fp32 math may round differently per device)
    and the top-512 choice (share of positions both pick, per request; slots follow the table)."""
    diff = (other["keys"].float() - cpu["keys"].float()).abs().max()
    keys_rel = float(diff / cpu["keys"].float().abs().max())
    agreement, slots_ok = [], True
    for row, length in enumerate(cpu["lengths"].tolist()):
        count = min(TOPK, length)
        mine = set(other["positions"][row, :count].tolist())
        theirs = set(cpu["positions"][row, :count].tolist())
        agreement.append(len(mine & theirs) / count)
        table = cpu["tables"][row]
        expected = [
            table[t // PAGE] * PAGE + t % PAGE for t in other["positions"][row, :count].tolist()
        ]
        slots_ok = slots_ok and other["slots"][row, :count].tolist() == expected
    top = min(agreement)
    ok = keys_rel <= 2**-7 and top >= 0.99 and slots_ok
    return {
        "keys_max_rel_diff": keys_rel,
        "top512_agreement": top,
        "slots_follow_table": slots_ok,
        "ok": ok,
    }


def stage_sglang(kit, rec):
    """The real pool and the patched indexer, one decode step on this device vs the CPU, once
    per top-k step serving runs on this device (the smoke run has only the CPU: there it checks
    that the stage itself still runs)."""
    cpu = run_decode_step_on("cpu")
    for topk in topk_steps(kit.device):
        other = run_decode_step_on(kit.device, topk=topk)
        result = compare_steps(cpu, other)
        rec["cases"].append(
            {"case": f"decode step, top-k {topk}, pool on {kit.device} vs cpu", **result}
        )
    rec["ok"] = bool(rec["cases"]) and all(c["ok"] for c in rec["cases"])


STAGES = (
    Stage(
        "sglang",
        60,
        "real DeepSeekV4TokenToKVPool on CUDA vs CPU, one decode step per top-k step",
        stage_sglang,
        needs_sglang=True,
        proves_correctness=True,
    ),
)
