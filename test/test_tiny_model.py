"""`sglang-dsv4 tiny-model`: the checkpoint it writes is one upstream reads as DeepSeek-V4.

Config fields against upstream's own DeepSeekV4Config and ModelConfig; weights through upstream's
loader (DeepseekV4ForCausalLM.load_weights, in a process of its own: test/support/tiny_load.py);
the tokenizer through transformers' AutoTokenizer, upstream's chat encoder (deepseek-recipe) and
upstream's parser detection.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
from sglang_dsv4 import tiny_model, warm_python
from sglang_dsv4.cli import main as cli_main

LOADER = Path(__file__).resolve().parent / "support" / "tiny_load.py"
FLASH = Path(tiny_model.__file__).resolve().parent / "data" / "deepseek-v4-flash" / "config.json"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    assert cli_main(["tiny-model", "--out", str(out), "--seed", "0"]) == 0
    return out


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_config_names_the_architecture_asked_for(tiny):
    c = _config(tiny)
    assert c["architectures"] == ["DeepseekV4ForCausalLM"] and c["model_type"] == "deepseek_v4"
    assert c["compress_ratios"] == [0, 4, 128, 4] and c["num_hidden_layers"] == 4
    assert (c["hidden_size"], c["num_attention_heads"], c["head_dim"]) == (256, 8, 512)
    assert (c["qk_nope_head_dim"], c["qk_rope_head_dim"]) == (448, 64)
    assert (c["index_n_heads"], c["index_head_dim"]) == (8, 128)
    assert (c["n_routed_experts"], c["num_experts_per_tok"], c["n_shared_experts"]) == (4, 2, 1)
    assert c["num_hash_layers"] == 1 and c["hc_mult"] == 4 and c["vocab_size"] == 1024


def test_config_keeps_the_flash_template_where_not_scaled_down(tiny):
    """Every field of the real DeepSeek-V4-Flash config is present; those the tiny model does not
    scale down keep the real value."""
    flash, c = json.loads(FLASH.read_text()), _config(tiny)
    assert not set(flash) - set(c), f"missing Flash fields: {set(flash) - set(c)}"
    for key in ("num_key_value_heads", "head_dim", "qk_nope_head_dim", "qk_rope_head_dim",
                "sliding_window", "index_head_dim", "index_topk", "n_shared_experts",
                "rope_theta", "compress_rope_theta", "torch_dtype", "model_type"):
        assert c[key] == flash[key], key
    assert c["rope_scaling"]["type"] == flash["rope_scaling"]["type"]
    assert c["rope_scaling"]["factor"] == flash["rope_scaling"]["factor"]
    # YaRN spans the whole context, as in the real model (16 x 65536 = 1048576).
    assert c["rope_scaling"]["factor"] * c["rope_scaling"]["original_max_position_embeddings"] == (
        c["max_position_embeddings"])


def test_config_states_every_text_field_upstreams_config_class_declares(tiny):
    """The server reads the file through transformers' DeepseekV3Config alias, which has no V4
    defaults: each field of upstream's DeepSeekV4Config the text model reads must be written."""
    from sglang.srt.configs.deepseek_v4 import DeepSeekV4Config

    not_text = ("vision_", "engram_", "image_token_id", "quantization_config",
                "kv_source_layer_ids", "index_source_layer_ids", "candidate_")
    fields = set(DeepSeekV4Config.__annotations__)  # its own, not transformers' base fields
    text_fields = {f for f in fields if not f.startswith(not_text)} - {"bos_token_id", "eos_token_id"}
    missing = text_fields - set(_config(tiny))
    assert not missing, f"upstream's DeepSeekV4Config fields not written: {sorted(missing)}"


def test_upstream_model_config_reads_it_as_deepseek_v4(tiny):
    from sglang.srt.configs.model_config import ModelConfig, is_deepseek_v4

    mc = ModelConfig(str(tiny))
    assert is_deepseek_v4(mc.hf_config)
    assert mc.context_len == tiny_model.MAX_POSITIONS
    assert mc.hf_config.compress_ratios == [0, 4, 128, 4]


def test_weights_load_through_upstreams_loader(tiny):
    """Every parameter of upstream's DeepseekV4ForCausalLM is loaded from the checkpoint and holds
    what the checkpoint says (after upstream's renames, fusions and the wo_a fp8 dequant)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = warm_python.run([str(LOADER), str(tiny)], env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["architecture"] == "DeepseekV4ForCausalLM"
    assert len(report["layers"]) == 4
    assert report["params"] and not report["unchecked"], report["unchecked"]
    assert not report["not_in_model"], report["not_in_model"]
    assert not report["mismatched"], report["mismatched"]
    assert not [w for w in report["warnings"] if "not initialized" in w or "not found" in w]


def test_weights_are_seeded(tiny, tmp_path):
    def digest(path: Path) -> str:
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    tiny_model.write(tmp_path / "again", seed=0)
    tiny_model.write(tmp_path / "other", seed=1)
    assert digest(tmp_path / "again") == digest(tiny)
    assert digest(tmp_path / "other") != digest(tiny)


def test_wo_a_is_stored_as_the_real_checkpoint_stores_it(tiny):
    import torch
    from safetensors import safe_open

    with safe_open(str(tiny / "model.safetensors"), "pt") as f:
        assert f.get_tensor("layers.0.attn.wo_a.weight").dtype == torch.float8_e4m3fn
        scale = f.get_tensor("layers.0.attn.wo_a.scale")
        assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (256 // 128, 2048 // 128)
        assert "layers.0.ffn.gate.tid2eid" in f.keys() and "layers.1.ffn.gate.bias" in f.keys()


TEXTS = [
    "def read(path):\n    return open(path).read()  # ok",
    'héllo wörld ✓ 中文 {"n": 3}',
    "<\uff5cDSML\uff5ctool_calls>\n<\uff5cDSML\uff5cinvoke name=\"read_file\">",
    "<think>plan</think>answer",
]


def test_tokenizer_round_trips_any_text(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    assert len(tok) == 1024
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert max(ids) < 1024
        assert tok.decode(ids) == text
        # The reasoning and tool-call parsers read these tokens: skipping specials keeps them.
        assert tok.decode(ids, skip_special_tokens=True) == text
    for special in tiny_model.SPECIAL_TOKENS + tiny_model.TEXT_TOKENS:
        assert len(tok.encode(special, add_special_tokens=False)) == 1, special


def test_chat_goes_through_upstreams_deepseek_v4_encoder(tiny):
    from sglang.srt.parser.deepseek_recipe_renderer import DeepSeekRecipe
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    recipe = DeepSeekRecipe.from_hf_tokenizer("dsv4", tok)
    ids = recipe.encode({"messages": [{"role": "user", "content": "read the file"}], "thinking": False})
    text = tok.decode(ids)
    assert text.startswith(tiny_model.BOS + tiny_model.USER) and "read the file" in text
    assert text.endswith(tiny_model.ASSISTANT + "</think>")


def test_chat_template_writes_dsml_tool_calls(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    call = {"type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py", "n": 3}}}
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}],
        tokenize=False,
    )
    m = "\uff5cDSML\uff5c"
    assert f"<{m}tool_calls>" in text and f'<{m}invoke name="read_file">' in text
    assert f'<{m}parameter name="path" string="true">a.py</{m}parameter>' in text
    assert f'<{m}parameter name="n" string="false">3</{m}parameter>' in text


def test_upstream_detects_the_deepseek_v4_tool_parser_from_it(tiny):
    from sglang.srt.parser.template_detection import detect_tool_call_parser
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    assert detect_tool_call_parser(tok.chat_template, tok) == "deepseekv4"


def test_cli_refuses_a_file_as_out(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    assert cli_main(["tiny-model", "--out", str(target)]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert target.read_text() == "x"
