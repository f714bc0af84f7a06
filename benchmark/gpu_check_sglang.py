"""The GPU proof kit's sglang stage: one bf16 decode step of a DeepSeek-V4 c4 indexer layer through
upstream's real objects with the distribution's fixes applied, on a given device.

Only `benchmark.gpu_check` imports this, and only when sglang is importable (the bare GPU host has
no sglang). The same seeded inputs run on each device, so the CUDA step can be held against the
CPU step:

- the real DeepSeekV4TokenToKVPool for DeepSeek-V4-Flash with bf16 index keys, sized by upstream's
  configurator chain (`sglang_dsv4.plan`), allocated on the device;
- the write path: compressed rows turned into index keys by the fix's write step (RMSNorm,
  RoPE, Hadamard, bf16; `write_keys` takes either form the fix has had) in the pool. Upstream's
  compress_forward itself is not run: its plan comes from upstream's CUDA planner, which needs a
  scheduled batch; the rows it would produce are given directly;
- the read path: a real C4Indexer (seeded random weights) and C4Indexer.forward, which the fix
  routes to forward_c4_indexer_bf16 (bf16 query, bf16_paged_mqa_logits: Triton on CUDA, torch on
  the CPU), then upstream's top-k step (torch backend) into the metadata's index buffers.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
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


def write_keys(compressor_module, pool, layer, compressed, plan, out_loc, compressor) -> None:
    """The fix's write step, whichever form it has: the store into the pool's bf16 rows
    (store_bf16_index_keys_from_plan), or keys and slots, then the pool's set_index_k_bf16
    (bf16_index_keys_from_plan, before the fused store)."""
    store = getattr(compressor_module, "store_bf16_index_keys_from_plan", None)
    if store is not None:
        rows = pool.get_index_k_bf16_buffer(layer).view(-1, compressed.shape[1])
        store(rows, compressed, plan, out_loc, compressor.norm, compressor.freqs_cis)
        return
    keys, slots = compressor_module.bf16_index_keys_from_plan(
        compressed, plan, out_loc, compressor.norm, compressor.freqs_cis
    )
    pool.set_index_k_bf16(layer, slots, keys)


def run_decode_step_on(device: str, seed: int = 0) -> dict:
    """Keys written and the top-512 positions chosen, on `device`; tensors come back on the CPU."""
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
    from sglang_dsv4.plan import activated, build_chain, build_pool, size_for_tokens

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
    write_keys(compressor_v2, pool, layer, compressed, plan, out_loc, indexer.compressor)

    # Read: one decode step of the two requests through the patched C4Indexer.forward.
    width = max(len(t) for t in tables)
    page_table = torch.zeros(len(REQUESTS), width, dtype=torch.int32)
    for row, pages in enumerate(tables):
        page_table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    lengths = torch.tensor([k for k, _ in REQUESTS], dtype=torch.int32)
    with envs.SGLANG_FP8_PAGED_MQA_LOGITS_TORCH.override(True):
        paged = PagedIndexerMetadata(
            page_size=256,
            compressed_page_size=PAGE,
            page_table=page_table.to(device),
            compressed_seq_lens=lengths.to(device),
            use_topk_v2=False,
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
    backend.dsa_topk_backend = DSATopKBackend.TORCH
    backend.hisparse_coordinator = None
    backend.debug_use_external_c4_sparse_indices = False
    backend.forward_metadata = SimpleNamespace(indexer_metadata=paged, core_metadata=core)
    x = torch.randn(len(REQUESTS), 4096, generator=gen).to(torch.bfloat16).to(device)
    q_lora = torch.randn(len(REQUESTS), 1024, generator=gen).to(torch.bfloat16).to(device)
    with torch.no_grad():
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
