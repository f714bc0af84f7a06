"""Load a tiny-model checkpoint with upstream's own loader, in a process of its own, and say how
each parameter compares with the checkpoint's tensors.

    python test/support/tiny_load.py DIR     # prints one JSON object

Upstream's path as a scheduler takes it: ServerArgs(device="cpu") -> publish -> the parallel
groups (gloo, world 1) -> ModelConfig -> get_model (DefaultModelLoader, safetensors) ->
DeepseekV4ForCausalLM.load_weights (renames, fuses, dequantizes wo_a). Its own process because
publish and the parallel groups are process-wide.

Until the distribution's CPU backend is active in this process, two upstream CPU gaps (both in
issue #22: `get_rope_cpu` asserts on the unscaled sliding-window layers; the CPU rotary class
imports vllm unless `_is_cpu` is set) are bridged here the way that backend bridges them.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys

os.environ.setdefault("SGLANG_OPT_USE_TILELANG_MHC_PRE", "0")  # its prewarm needs CUDA


def _bridge_cpu_rope() -> None:
    import sglang.srt.layers.rotary_embedding.base as base
    import sglang.srt.layers.rotary_embedding.factory as factory

    base._is_cpu = True
    scaled_only = factory.get_rope_cpu

    def get_rope_cpu(head_size, rotary_dim, max_position, base_, is_neox_style=True,
                     rope_scaling=None, dtype=None, partial_rotary_factor=1.0, device=None):
        if rope_scaling is None:
            return factory.get_rope(head_size, rotary_dim, max_position, base_, is_neox_style,
                                    rope_scaling, dtype, partial_rotary_factor)
        return scaled_only(head_size, rotary_dim, max_position, base_, is_neox_style,
                           rope_scaling, dtype, partial_rotary_factor, device)

    factory.get_rope_cpu = get_rope_cpu


def load(model_dir: str):
    """(model, warnings logged by the loader) for the checkpoint in `model_dir`."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.model_loader import get_model
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=model_dir, device="cpu", skip_tokenizer_init=True)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=None))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel()
    _bridge_cpu_rope()

    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("sglang.srt.models.deepseek_v4").addHandler(Collect())
    model = get_model(
        model_config=ModelConfig.from_server_args(server_args),
        load_config=LoadConfig(load_format="auto"),
        device_config=DeviceConfig("cpu"),
    )
    return model, warnings


def expected(checkpoint: dict, config: dict) -> dict:
    """The value each upstream parameter must hold after loading `checkpoint` (upstream names)."""
    import torch
    from sglang_dsv4.tiny_model import FP8_BLOCK

    want = {
        "model.embed_tokens.weight": checkpoint["embed.weight"],
        "lm_head.weight": checkpoint["head.weight"],
        "model.norm.weight": checkpoint["norm.weight"],
    }
    for part in ("fn", "base", "scale"):
        want[f"model.hc_head_{part}"] = checkpoint[f"hc_head_{part}"]
    for layer, ratio in enumerate(config["compress_ratios"]):
        c, m = f"layers.{layer}.", f"model.layers.{layer}."
        for sub in ("attn", "ffn"):
            for part in ("fn", "base", "scale"):
                want[m + f"hc_{sub}_{part}"] = checkpoint[c + f"hc_{sub}_{part}"]
        want[m + "input_layernorm.weight"] = checkpoint[c + "attn_norm.weight"]
        want[m + "post_attention_layernorm.weight"] = checkpoint[c + "ffn_norm.weight"]
        a, s = c + "attn.", m + "self_attn."
        for name in ("attn_sink", "q_norm.weight", "wq_b.weight", "kv_norm.weight", "wo_b.weight"):
            want[s + name] = checkpoint[a + name]
        want[s + "wqkv_a.weight"] = torch.cat([checkpoint[a + "wq_a.weight"], checkpoint[a + "wkv.weight"]])
        scale = checkpoint[a + "wo_a.scale"].float()
        scale = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
        want[s + "wo_a.weight"] = (checkpoint[a + "wo_a.weight"].float() * scale).to(torch.bfloat16)
        prefixes = [("compressor.", "compressor.")] if ratio else []
        if ratio == 4:
            prefixes.append(("indexer.compressor.", "indexer.compressor."))
            for name in ("wq_b.weight", "weights_proj.weight"):
                want[s + "indexer." + name] = checkpoint[a + "indexer." + name]
        for cp, sp in prefixes:
            ape = checkpoint[a + cp + "ape"]
            if ratio == 4:
                # Overlapping windows: upstream keeps the two halves of each row one after the
                # other (first halves of all rows, then second halves), same shape.
                ape = torch.cat(ape.chunk(2, dim=-1), dim=0).reshape(ape.shape)
            want[s + sp + "ape"] = ape
            want[s + sp + "norm.weight"] = checkpoint[a + cp + "norm.weight"]
            want[s + sp + "wkv_gate.weight"] = torch.cat(
                [checkpoint[a + cp + "wkv.weight"], checkpoint[a + cp + "wgate.weight"]])
        f, g = c + "ffn.", m + "mlp."
        want[g + "gate.weight"] = checkpoint[f + "gate.weight"]
        if f + "gate.tid2eid" in checkpoint:
            want[g + "topk.tid2eid"] = checkpoint[f + "gate.tid2eid"]
        else:
            want[g + "gate.e_score_correction_bias"] = checkpoint[f + "gate.bias"]
        experts = range(config["n_routed_experts"])
        want[g + "experts.w13_weight"] = torch.stack(
            [torch.cat([checkpoint[f + f"experts.{e}.w1.weight"], checkpoint[f + f"experts.{e}.w3.weight"]])
             for e in experts])
        want[g + "experts.w2_weight"] = torch.stack(
            [checkpoint[f + f"experts.{e}.w2.weight"] for e in experts])
        want[g + "shared_experts.gate_up_proj.weight"] = torch.cat(
            [checkpoint[f + "shared_experts.w1.weight"], checkpoint[f + "shared_experts.w3.weight"]])
        want[g + "shared_experts.down_proj.weight"] = checkpoint[f + "shared_experts.w2.weight"]
    return want


def main(model_dir: str) -> dict:
    import torch
    from safetensors.torch import load_file

    model, warnings = load(model_dir)
    checkpoint = load_file(os.path.join(model_dir, "model.safetensors"))
    config = json.load(open(os.path.join(model_dir, "config.json")))
    want = expected(checkpoint, config)
    params = dict(model.named_parameters())
    mismatched = sorted(
        name for name, value in want.items()
        if name in params and not torch.equal(params[name].detach().to(value.dtype), value))
    return {
        "params": sorted(params),
        "checked": sorted(set(want) & set(params)),
        "unchecked": sorted(set(params) - set(want)),
        "not_in_model": sorted(set(want) - set(params)),
        "mismatched": mismatched,
        "warnings": warnings,
        "architecture": type(model).__name__,
        "layers": [type(layer).__name__ for layer in model.model.layers],
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
