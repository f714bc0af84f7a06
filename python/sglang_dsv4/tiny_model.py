"""`sglang-dsv4 tiny-model`: a tiny random DeepSeek-V4 checkpoint that upstream serves as it is.

The architecture is DeepSeek-V4-Flash's (`data/deepseek-v4-flash/config.json`), scaled down:
4 layers with compress ratios 0, 4, 128, 4 (a sliding-window-only layer, a c4 layer with the
indexer, a c128 layer, another c4 layer); hidden 256; 8 query heads of 512 (448 nope + 64 rope),
one latent KV head; 8 index heads of 128 and index top-k 512 (upstream accepts only 512 or 1024);
4 routed experts, top-2, one shared expert; the first layer hash-routed; hyper-connections of
width 4; vocabulary 1024; window 128; YaRN factor 16 over 256 positions (4096 in all, so the
c4 top-k selects once a context passes 2048 tokens).

Every config field upstream's `DeepSeekV4Config` (sglang/srt/configs/deepseek_v4.py) declares for
the text model is written out: the server loads the file through transformers' DeepseekV3Config
alias (sglang/srt/utils/hf_transformers/common.py), which has no V4 defaults.

The weights use the real checkpoint's names (`embed.weight`, `layers.N.attn.wq_a.weight`,
`layers.N.ffn.experts.E.w1.weight`, `layers.N.attn.compressor.wkv.weight` / `.wgate.weight`, ...):
upstream's `DeepseekV4ForCausalLM.load_weights` renames, fuses (wq_a + wkv, compressor wkv +
wgate, w1 + w3) and loads them. They are bf16 except where the real checkpoint differs in a way
the CPU can serve: `wo_a` is stored as fp8 e4m3 with ue8m0 block scales (128 x 128), as in the
real checkpoint, which upstream dequantizes while loading; the hyper-connection, attention-sink,
compressor position and norm tensors are float32 as upstream's parameters are. The other fp8
(and the routed experts' fp4) tensors of the real checkpoint are bf16 here: the CPU has no fp8
GEMM, and a checkpoint without `quantization_config` is upstream's unquantized path.

The tokenizer is a byte-level BPE made with the `tokenizers` package (any text round-trips), with
DeepSeek-V4's special tokens (those deepseek-recipe's DeepseekV4Encoding spells, which upstream's
chat endpoint renders with) and a chat template with the DSML tool-call markup (upstream detects
its DeepSeek-V4 parsers from that markup).

No `swiglu_limit`: the Flash template and upstream's DeepSeekV4Config carry none, and with one
upstream's MoE takes a clamped SiLU that exists only as a CUDA JIT kernel.

    sglang-dsv4 tiny-model --out /tmp/tiny [--seed 0]
    python -m sglang.launch_server --model-path /tmp/tiny --device cpu
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

# --- the architecture ---------------------------------------------------------------------------

COMPRESS_RATIOS = [0, 4, 128, 4]
VOCAB_SIZE = 1024
MAX_POSITIONS = 4096

CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "torch_dtype": "bfloat16",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "num_hidden_layers": len(COMPRESS_RATIOS),
    # The real model has one MTP layer; the tiny one has none (no speculative decoding on CPU).
    "num_nextn_predict_layers": 0,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_nope_head_dim": 448,
    "qk_rope_head_dim": 64,
    "v_head_dim": 512,
    "kv_lora_rank": 512,
    "q_lora_rank": 128,
    "o_lora_rank": 128,
    "o_groups": 2,
    "q_head_norm": True,
    "sliding_window": 128,
    "window_size": 128,
    "compress_ratios": COMPRESS_RATIOS,
    "index_n_heads": 8,
    "index_head_dim": 128,
    "index_topk": 512,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 128,
    "intermediate_size": 128,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 0,
    "num_hash_layers": 1,
    "n_hash_layers": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "hidden_act": "silu",
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "hc_pre_from_prev_sublayer": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": MAX_POSITIONS,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": MAX_POSITIONS // 16,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "ep_size": 1,
    "tie_word_embeddings": False,
    "use_cache": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

# --- the tokenizer ------------------------------------------------------------------------------

BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
PAD = "<\uff5c\u2581pad\u2581\uff5c>"
USER = "<\uff5cUser\uff5c>"
ASSISTANT = "<\uff5cAssistant\uff5c>"
DSML = "\uff5cDSML\uff5c"
# Special tokens (skipped when text is decoded), in id order after BOS and EOS.
SPECIAL_TOKENS = [
    BOS,
    EOS,
    PAD,
    "<\uff5cSystem\uff5c>",
    USER,
    ASSISTANT,
    "<\uff5clatest_reminder\uff5c>",
    "<\uff5cdeepseek_image\uff5c>",
    "<\uff5cref\uff5c>",
    "<\uff5c/ref\uff5c>",
    "<\uff5cbox\uff5c>",
    "<\uff5c/box\uff5c>",
    "<\uff5cpoint\uff5c>",
    "<\uff5c/point\uff5c>",
    "<\uff5cpolygon\uff5c>",
    "<\uff5c/polygon\uff5c>",
    "<\uff5caction\uff5c>",
    "<\uff5cquery\uff5c>",
    "<\uff5cauthority\uff5c>",
    "<\uff5cdomain\uff5c>",
    "<\uff5ctitle\uff5c>",
    "<\uff5cread_url\uff5c>",
]
# Added tokens the text keeps: the reasoning and tool-call parsers read them from the output.
TEXT_TOKENS = ["<think>", "</think>", DSML]

_WORDS = (
    "the of and to in is that for it as with was on be by at this from or have an are which not "
    "but all they one there their can has more if will would about when what so up out who also "
    "model server request token prefill decode cache page layer index key value query attention "
    "expert router tensor memory transfer host device batch session context window compress "
    "read write file path line error status return list dict string number true false none "
    "def class self import from return yield async await with try except raise print len range "
    "function name parameter arguments result tool call invoke json data time seed test value"
).split()


def _corpus(seed: int) -> list[str]:
    """Seeded training text: English and Python-like words, digits, JSON and DSML punctuation."""
    rng = random.Random(seed)
    lines = []
    for _ in range(4000):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        if rng.random() < 0.2:
            key, value = rng.choice(_WORDS), rng.choice(_WORDS)
            words.append(json.dumps({key: value, "n": rng.randint(0, 512)}))
        if rng.random() < 0.1:
            words.append(f'name="{rng.choice(_WORDS)}" string="true">')
        lines.append(" ".join(words) + rng.choice([".", ",", ":", "\n", "()", " {}", ";"]))
    return lines


CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}## Tools\n\nYou may call these tools with the DSML markup "
    '<\uff5cDSML\uff5ctool_calls><\uff5cDSML\uff5cinvoke name="NAME">'
    '<\uff5cDSML\uff5cparameter name="KEY" string="true|false">VALUE</\uff5cDSML\uff5cparameter>'
    "</\uff5cDSML\uff5cinvoke></\uff5cDSML\uff5ctool_calls>:\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{ message['content'] }}"
    "{%- elif message['role'] == 'user' %}" + USER + "{{ message['content'] }}"
    "{%- elif message['role'] == 'tool' %}" + USER + "<tool_result>{{ message['content'] }}</tool_result>"
    "{%- elif message['role'] == 'assistant' %}" + ASSISTANT + "</think>{{ message['content'] or '' }}"
    "{%- if message['tool_calls'] %}\n\n<\uff5cDSML\uff5ctool_calls>"
    "{%- for call in message['tool_calls'] %}\n"
    "<\uff5cDSML\uff5cinvoke name=\"{{ call['function']['name'] }}\">"
    "{%- set arguments = call['function']['arguments'] %}"
    "{%- if arguments is mapping %}{%- for key, value in arguments.items() %}\n"
    "<\uff5cDSML\uff5cparameter name=\"{{ key }}\" string=\"{{ 'true' if value is string else 'false' }}\">"
    "{{ value if value is string else value | tojson }}</\uff5cDSML\uff5cparameter>"
    "{%- endfor %}{%- else %}\n{{ arguments }}{%- endif %}\n</\uff5cDSML\uff5cinvoke>"
    "{%- endfor %}\n</\uff5cDSML\uff5ctool_calls>{%- endif %}" + EOS + "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}" + ASSISTANT + "</think>{%- endif %}"
)


def build_tokenizer(seed: int):
    """The byte-level BPE tokenizer (a `tokenizers.Tokenizer`) of exactly VOCAB_SIZE tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    added = SPECIAL_TOKENS + TEXT_TOKENS
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[AddedToken(t, special=t in SPECIAL_TOKENS, normalized=False) for t in added],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer)
    # The text tokens are trained as "special" (so BPE never splits them); mark them plain again
    # so that decoding keeps them in the text the parsers read.
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"tiny-model: the tokenizer has {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}"
        )
    return tokenizer


# --- the weights --------------------------------------------------------------------------------

FP8_BLOCK = 128


def _fp8_blocks(weight, torch):
    """`weight` (float) as fp8 e4m3 with one ue8m0 (power of two) scale per 128 x 128 block, as
    the real checkpoint stores wo_a."""
    rows, cols = weight.shape
    blocks = weight.reshape(rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    quant = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
    return quant, scale.to(torch.float8_e8m0fnu)


def build_weights(config: dict, seed: int) -> dict:
    """name -> tensor in the real checkpoint's names and layout, seeded."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    heads, head_dim = config["num_attention_heads"], config["head_dim"]
    q_rank, o_rank, groups = config["q_lora_rank"], config["o_lora_rank"], config["o_groups"]
    experts, inter = config["n_routed_experts"], config["moe_intermediate_size"]
    hc = config["hc_mult"]
    index_heads, index_dim = config["index_n_heads"], config["index_head_dim"]
    vocab = config["vocab_size"]
    mix = (2 + hc) * hc  # pre (hc) + post (hc) + combination (hc x hc) weights per sublayer

    def linear(out_features, in_features, dtype=torch.bfloat16):
        # Unit-variance outputs for unit-variance inputs, so activations stay O(1) through depth.
        std = in_features**-0.5
        return (torch.randn(out_features, in_features, generator=gen) * std).to(dtype)

    def small(*shape, std=0.02, dtype=torch.float32):
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def ones(n, dtype=torch.bfloat16):
        return torch.ones(n, dtype=dtype)

    w: dict[str, torch.Tensor] = {
        "embed.weight": small(vocab, hidden, std=1.0, dtype=torch.bfloat16),
        "head.weight": linear(vocab, hidden),
        "norm.weight": ones(hidden),
        "hc_head_fn": small(hc, hc * hidden),
        "hc_head_base": small(hc),
        "hc_head_scale": torch.ones(1, dtype=torch.float32),
    }
    for layer, ratio in enumerate(config["compress_ratios"]):
        p = f"layers.{layer}."
        for sub in ("attn", "ffn"):
            w[p + f"hc_{sub}_fn"] = small(mix, hc * hidden)
            w[p + f"hc_{sub}_base"] = small(mix)
            w[p + f"hc_{sub}_scale"] = torch.ones(3, dtype=torch.float32)
        w[p + "attn_norm.weight"] = ones(hidden)
        w[p + "ffn_norm.weight"] = ones(hidden)
        a = p + "attn."
        w[a + "attn_sink"] = small(heads, std=0.5)
        w[a + "wq_a.weight"] = linear(q_rank, hidden)
        w[a + "q_norm.weight"] = ones(q_rank)
        w[a + "wq_b.weight"] = linear(heads * head_dim, q_rank)
        w[a + "wkv.weight"] = linear(head_dim, hidden)
        w[a + "kv_norm.weight"] = ones(head_dim)
        wo_a = linear(groups * o_rank, heads * head_dim // groups, dtype=torch.float32)
        w[a + "wo_a.weight"], w[a + "wo_a.scale"] = _fp8_blocks(wo_a, torch)
        w[a + "wo_b.weight"] = linear(hidden, groups * o_rank)
        if ratio:
            coff = 2 if ratio == 4 else 1
            c = a + "compressor."
            w[c + "ape"] = small(ratio, coff * head_dim, std=0.1)
            w[c + "wkv.weight"] = linear(coff * head_dim, hidden)
            w[c + "wgate.weight"] = linear(coff * head_dim, hidden)
            w[c + "norm.weight"] = ones(head_dim, torch.float32)
        if ratio == 4:
            i = a + "indexer."
            w[i + "wq_b.weight"] = linear(index_heads * index_dim, q_rank)
            w[i + "weights_proj.weight"] = linear(index_heads, hidden)
            w[i + "compressor.ape"] = small(ratio, 2 * index_dim, std=0.1)
            w[i + "compressor.wkv.weight"] = linear(2 * index_dim, hidden)
            w[i + "compressor.wgate.weight"] = linear(2 * index_dim, hidden)
            w[i + "compressor.norm.weight"] = ones(index_dim, torch.float32)
        f = p + "ffn."
        w[f + "gate.weight"] = linear(experts, hidden)
        if layer < config["num_hash_layers"]:
            # Hash routing: each token id names its experts (distinct within a row).
            rows = [torch.randperm(experts, generator=gen)[: config["num_experts_per_tok"]]
                    for _ in range(vocab)]
            w[f + "gate.tid2eid"] = torch.stack(rows).to(torch.int32)
        else:
            w[f + "gate.bias"] = small(experts)
        for e in range(experts):
            x = f + f"experts.{e}."
            w[x + "w1.weight"] = linear(inter, hidden)
            w[x + "w3.weight"] = linear(inter, hidden)
            w[x + "w2.weight"] = linear(hidden, inter)
        s = f + "shared_experts."
        w[s + "w1.weight"] = linear(inter, hidden)
        w[s + "w3.weight"] = linear(inter, hidden)
        w[s + "w2.weight"] = linear(hidden, inter)
    return w


# --- writing ------------------------------------------------------------------------------------


def write(out: Path, seed: int = 0) -> Path:
    """Write the checkpoint into `out` (created; files already there are replaced)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = dict(CONFIG)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, indent=2) + "\n"
    )
    tokenizer = build_tokenizer(seed)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "pad_token": PAD,
                "add_bos_token": False,
                "add_eos_token": False,
                "model_max_length": MAX_POSITIONS,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
            ensure_ascii=False,
        )
        + "\n"
    )
    weights = build_weights(config, seed)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="directory to write it into")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and tokenizer (0)")
    parser.add_argument("--json", action="store_true", help="print what was written as JSON")


def run(args: argparse.Namespace) -> int:
    if args.out.exists() and not args.out.is_dir():
        print(f"sglang-dsv4 tiny-model: --out {args.out} is not a directory", file=sys.stderr)
        return 2
    out = write(args.out, args.seed)
    files = sorted(p.name for p in out.iterdir())
    if args.json:
        print(json.dumps({"out": str(out), "seed": args.seed, "files": files}))
    else:
        print(f"tiny DeepSeek-V4 (seed {args.seed}) written to {out}: {', '.join(files)}")
        print(f"serve it: python -m sglang.launch_server --model-path {out} --device cpu")
    return 0
