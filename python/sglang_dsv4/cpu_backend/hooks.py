"""The CPU backend's targets upstream: what `sglang_dsv4.cpu_backend` replaces on `--device cpu`.

Imported only in a process where the backend is on (see `sglang_dsv4.cpu_backend.entries`),
once upstream imports a module holding one of these targets. Each replacement keeps the
upstream wrapper's parameters (checked at apply time, as for every fix) and calls the torch op
in `sglang_dsv4.cpu_backend.ops` that stands for the CUDA kernel.
"""

from __future__ import annotations

from sglang.kernels.ops.attention.dsv4.compress import (
    CompressorDecodePlan,
    CompressorPrefillPlan,
)
from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

from sglang_dsv4.cpu_backend import (
    ID,
    TITLE,
    UPSTREAM_MODULES,
    install_platform,
    ops,
    sparse_attention,
)
from sglang_dsv4.fix import Fix, Replace

# The sm_120 platform fact, before upstream's model code asks for it (this module is imported
# as soon as upstream imports the first module holding a target, ahead of the model's build).
install_platform()

(_COMPRESS, _NORM_ROPE, _ROPE_FACTORY, _TOPK, _MHC, _SWIGLU, _MOE, _SPARSE_MLA, _MHC_HEAD,
 _METADATA, _INDEXER) = UPSTREAM_MODULES


def generate_prefill_plan(compress_ratio, req_pool_indices, seq_lens, extend_lens, req_to_token,
                          full_to_state, swa_page_size, ring_size, num_q_tokens,
                          use_cuda_graph=False, use_req_ring=False):
    """`CompressorPrefillPlan.generate` on the CPU: c_plan.cuh's prefill plan in torch (and no
    pinned scratch buffer, which needs CUDA)."""
    plan_c, plan_w = ops.plan_compress_prefill(
        req_pool_indices, req_to_token, full_to_state, seq_lens, extend_lens,
        int(num_q_tokens), int(compress_ratio), int(swa_page_size), int(ring_size),
        use_req_ring=bool(use_req_ring), use_cuda_graph=bool(use_cuda_graph),
    )
    return CompressorPrefillPlan(compress_ratio, plan_c, plan_w, None)


def generate_decode_plan(compress_ratio, req_pool_indices, req_to_token, full_to_state, seq_lens,
                         swa_page_size, ring_size, use_req_ring=False):
    """`CompressorDecodePlan.generate` on the CPU: c_plan.cuh's decode plan in torch."""
    plan_d = ops.plan_compress_decode(
        req_pool_indices, req_to_token, full_to_state, seq_lens, int(compress_ratio),
        int(swa_page_size), int(ring_size), use_req_ring=bool(use_req_ring),
    )
    return CompressorDecodePlan(compress_ratio, plan_d)


def compress_forward(kv_score_buffer, kv_score_input, ape, plan, *, head_dim, compress_ratio,
                     out=None, is_online=False):
    return ops.compress_forward(
        kv_score_buffer, kv_score_input, ape, plan, head_dim=head_dim,
        compress_ratio=compress_ratio, out=out, is_online=is_online,
    )


def compress_norm_rope_store(kv, plan, *, norm_weight, norm_eps, freq_cis, out_loc, kvcache,
                             page_size, use_fp4=False, bf16_store=False, kvcache_scale=None,
                             rope_cache=None, fp4_k_write_metadata=None, layout=KVLayout.V4,
                             fp8_2buff=False, kvcache_rope=None):
    ops.compress_norm_rope_store(
        kv, plan, norm_weight=norm_weight, norm_eps=norm_eps, freq_cis=freq_cis,
        out_loc=out_loc, kvcache=kvcache, page_size=page_size, use_fp4=use_fp4,
        bf16_store=bf16_store, kvcache_scale=kvcache_scale, rope_cache=rope_cache,
        fp4_k_write_metadata=fp4_k_write_metadata, layout=layout, fp8_2buff=fp8_2buff,
        kvcache_rope=kvcache_rope,
    )


def fused_q_norm_rope(q_input, q_output, eps, freqs_cis, positions):
    ops.fused_q_norm_rope(q_input, q_output, eps, freqs_cis, positions)


def fused_rope_inplace(q, k, freqs_cis, positions, inverse=False):
    ops.fused_rope_inplace(q, k, freqs_cis, positions, inverse=inverse)


def fused_q_indexer_rope_hadamard_quant(q_input, weight, weight_scale, freqs_cis, positions):
    return ops.fused_q_indexer_rope_hadamard_quant(
        q_input, weight, weight_scale, freqs_cis, positions
    )


def fused_k_norm_rope_flashmla(kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache,
                               page_size, layout=KVLayout.V4, q=None):
    ops.fused_k_norm_rope_flashmla(
        kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache, page_size,
        layout=layout, q=q,
    )


def get_rope_wrapper(head_size, rotary_dim, max_position, base, is_neox_style=True,
                     rope_scaling=None, dtype=None, partial_rotary_factor=1.0, device=None):
    """Upstream's CPU branch (`get_rope_cpu`) only builds the deepseek_yarn rope and asserts on
    the sliding-window layers, which have no rope scaling: those take the generic `get_rope`.
    Both are built as for a CPU engine (`_is_cpu`), else the rope base class imports vllm's
    rotary kernel. (The DeepSeek-V4 layers rotate with their own freqs_cis table.)"""
    from sglang.srt.layers.rotary_embedding import base as rope_base
    from sglang.srt.layers.rotary_embedding import factory

    args = (head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, dtype,
            partial_rotary_factor)
    saved = rope_base._is_cpu
    rope_base._is_cpu = True
    try:
        if rope_scaling:
            return factory.get_rope_cpu(*args, device)
        return factory.get_rope(*args)
    finally:
        rope_base._is_cpu = saved


def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    """The hyper-connection Sinkhorn in torch (upstream's is TileLang, or Triton on gfx1250)."""
    return ops.hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult, sinkhorn_iters, eps)


def mhc_combine(x_flat, pre, hc, out_dtype):
    return ops.mhc_combine(x_flat, pre, hc, out_dtype)


def silu_and_mul_clamp(input, output, swiglu_limit):
    ops.silu_and_mul_clamp(input, output, swiglu_limit)


def hash_topk(router_logits, input_ids, tid2eid, num_fused_shared_experts=0,
              routed_scaling_factor=1.0, scoring_func="sqrtsoftplus"):
    return ops.hash_topk(router_logits, input_ids, tid2eid, num_fused_shared_experts,
                         routed_scaling_factor, scoring_func)


def flash_mla_with_kvcache_sm120(**kwargs):
    """The sm_120 sparse MLA entry (keyword arguments only, as upstream's): `sparse_attention.sparse_mla`,
    the torch path's attention with each cache row dequantized once."""
    return _sparse_mla(**kwargs)


def _sparse_mla(*, q, k_cache, indices, head_dim_v, topk_length=None, attn_sink=None,
                softmax_scale=None, extra_k_cache=None, extra_indices_in_kvcache=None,
                extra_topk_length=None, **ignored):
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return sparse_attention.sparse_mla(q, k_cache, indices, topk_length, attn_sink, head_dim_v, scale,
                          extra_k_cache, extra_indices_in_kvcache, extra_topk_length)


def fused_hc_head(x, hc_fn, hc_scale, hc_base, norm_eps, hc_eps):
    return ops.fused_hc_head(x, hc_fn, hc_scale, hc_base, norm_eps, hc_eps)


def init_compression_metadata(seq_lens, positions, raw_out_loc, page_table=None, page_size=0,
                              compute_page_indices=True):
    return ops.init_compression_metadata(seq_lens, positions, raw_out_loc, page_table,
                                         page_size, compute_page_indices)


def fp8_paged_mqa_logits_torch_sm120(q_fp8, kvcache_fp8, weight, seq_lens, page_table,
                                     deep_gemm_metadata, max_seq_len, clean_logits=True):
    return sparse_attention.fp8_paged_mqa_logits(q_fp8, kvcache_fp8, weight, seq_lens, page_table,
                                    deep_gemm_metadata, max_seq_len, clean_logits=clean_logits)


def resolve_topk_backend(cls, model_runner):
    """The DSA top-k backend: upstream's torch one (`topk_transform_pytorch_vectorized`); the
    sgl-kernel and flashinfer ones need CUDA."""
    return cls.TORCH


resolve_topk_backend.__name__ = "resolve"
generate_prefill_plan.__name__ = generate_decode_plan.__name__ = "generate"

FIX = Fix(
    id=ID,
    title=TITLE,
    area="cpu",
    why=(
        "Upstream 0.5.23 builds a tiny DeepSeek-V4 on --device cpu but its forward stops at "
        "CUDA-only JIT ops (the compress plan, compress_4/128_v2, fused_norm_rope_v2, "
        "main_q_norm_rope, main_k_norm_rope_flashmla, fused_rope, "
        "main_q_indexer_rope_hadamard_quant), a pinned buffer in the prefill plan, "
        "get_rope_cpu's assertion on the sliding-window layers and the sgl-kernel top-k."
    ),
    how=(
        "Torch versions of each op written from its CUDA source, same byte layouts; "
        "upstream's own torch paths switched on for the rest."
    ),
    upstream="not for upstream: development and tests only",
    remove_when="never: it is how the distribution is tested without a GPU",
    targets=(
        f"{_COMPRESS}.CompressorPrefillPlan.generate",
        f"{_COMPRESS}.CompressorDecodePlan.generate",
        f"{_COMPRESS}.compress_forward",
        f"{_COMPRESS}.compress_norm_rope_store",
        f"{_NORM_ROPE}.fused_q_norm_rope",
        f"{_NORM_ROPE}.fused_rope_inplace",
        f"{_NORM_ROPE}.fused_q_indexer_rope_hadamard_quant",
        f"{_NORM_ROPE}.fused_k_norm_rope_flashmla",
        f"{_ROPE_FACTORY}.get_rope_wrapper",
        f"{_TOPK}.DSATopKBackend.resolve",
        f"{_MHC}.hc_split_sinkhorn",
        f"{_MHC}.mhc_combine",
        f"{_SWIGLU}.silu_and_mul_clamp",
        f"{_MOE}.hash_topk",
        f"{_SPARSE_MLA}.flash_mla_with_kvcache_sm120",
        f"{_MHC_HEAD}.fused_hc_head",
        f"{_METADATA}.init_compression_metadata",
        f"{_INDEXER}.fp8_paged_mqa_logits_torch_sm120",
    ),
    replaces=(
        Replace(
            f"{_COMPRESS}.CompressorPrefillPlan.generate",
            generate_prefill_plan,
            "(compress_ratio, req_pool_indices, seq_lens, extend_lens, req_to_token, "
            "full_to_state, swa_page_size, ring_size, num_q_tokens, use_cuda_graph=False, "
            "use_req_ring=False)",
        ),
        Replace(
            f"{_COMPRESS}.CompressorDecodePlan.generate",
            generate_decode_plan,
            "(compress_ratio, req_pool_indices, req_to_token, full_to_state, seq_lens, "
            "swa_page_size, ring_size, use_req_ring=False)",
        ),
        Replace(
            f"{_COMPRESS}.compress_forward",
            compress_forward,
            "(kv_score_buffer, kv_score_input, ape, plan, *, head_dim, compress_ratio, "
            "out=None, is_online=False)",
        ),
        Replace(
            f"{_COMPRESS}.compress_norm_rope_store",
            compress_norm_rope_store,
            "(kv, plan, *, norm_weight, norm_eps, freq_cis, out_loc, kvcache, page_size, "
            "use_fp4=False, bf16_store=False, kvcache_scale=None, rope_cache=None, "
            "fp4_k_write_metadata=None, layout=<KVLayout.V4: 'v4'>, fp8_2buff=False, "
            "kvcache_rope=None)",
        ),
        Replace(
            f"{_NORM_ROPE}.fused_q_norm_rope",
            fused_q_norm_rope,
            "(q_input, q_output, eps, freqs_cis, positions)",
        ),
        Replace(
            f"{_NORM_ROPE}.fused_rope_inplace",
            fused_rope_inplace,
            "(q, k, freqs_cis, positions, inverse=False)",
        ),
        Replace(
            f"{_NORM_ROPE}.fused_q_indexer_rope_hadamard_quant",
            fused_q_indexer_rope_hadamard_quant,
            "(q_input, weight, weight_scale, freqs_cis, positions)",
        ),
        Replace(
            f"{_NORM_ROPE}.fused_k_norm_rope_flashmla",
            fused_k_norm_rope_flashmla,
            "(kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache, page_size, "
            "layout=<KVLayout.V4: 'v4'>, q=None)",
        ),
        Replace(
            f"{_ROPE_FACTORY}.get_rope_wrapper",
            get_rope_wrapper,
            "(head_size, rotary_dim, max_position, base, is_neox_style=True, "
            "rope_scaling=None, dtype=None, partial_rotary_factor=1.0, device=None)",
        ),
        Replace(
            f"{_TOPK}.DSATopKBackend.resolve",
            resolve_topk_backend,
            "(cls, model_runner)",
        ),
        Replace(
            f"{_MHC}.hc_split_sinkhorn",
            hc_split_sinkhorn,
            "(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-06)",
        ),
        Replace(f"{_MHC}.mhc_combine", mhc_combine, "(x_flat, pre, hc, out_dtype)"),
        Replace(
            f"{_SWIGLU}.silu_and_mul_clamp",
            silu_and_mul_clamp,
            "(input, output, swiglu_limit)",
        ),
        Replace(
            f"{_MOE}.hash_topk",
            hash_topk,
            "(router_logits, input_ids, tid2eid, num_fused_shared_experts=0, "
            "routed_scaling_factor=1.0, scoring_func='sqrtsoftplus')",
        ),
        Replace(f"{_SPARSE_MLA}.flash_mla_with_kvcache_sm120", flash_mla_with_kvcache_sm120,
                "(**kwargs)"),
        Replace(f"{_MHC_HEAD}.fused_hc_head", fused_hc_head,
                "(x, hc_fn, hc_scale, hc_base, norm_eps, hc_eps)"),
        Replace(
            f"{_METADATA}.init_compression_metadata",
            init_compression_metadata,
            "(seq_lens, positions, raw_out_loc, page_table=None, page_size=0, "
            "compute_page_indices=True)",
        ),
        Replace(
            f"{_INDEXER}.fp8_paged_mqa_logits_torch_sm120",
            fp8_paged_mqa_logits_torch_sm120,
            "(q_fp8, kvcache_fp8, weight, seq_lens, page_table, deep_gemm_metadata, "
            "max_seq_len, clean_logits=True)",
        ),
    ),
)
