"""`sglang-dsv4 plan`: its figures are upstream's configurator's, and bad input is one line, exit 2."""

import json
import subprocess
import sys

import pytest
from sglang_dsv4.cli import main
from sglang_dsv4.plan import DEFAULT_KV_MEMORY_GIB, GIB
from support.dsv4 import build_chain, build_pool, size_for_budget, storage_bytes

REQUIRED_KEYS = {
    "index_k_dtype",
    "bytes_per_full_token",
    "bytes_per_swa_token",
    "indexer_bytes_per_token",
    "max_total_num_tokens",
}


def run_plan(capsys, *args):
    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def compare_report():
    import io
    from contextlib import redirect_stdout

    buffer = io.StringIO()
    with redirect_stdout(buffer):
        assert main(["plan", "--compare", "--json"]) == 0
    return json.loads(buffer.getvalue())


def test_compare_json_equals_the_configurator(compare_report):
    plans = {p["index_k_dtype"]: p for p in compare_report["compare"]}
    assert list(plans) == ["fp8", "bf16", "fp4"]
    budget = int(DEFAULT_KV_MEMORY_GIB * GIB)
    for dtype, p in plans.items():
        assert REQUIRED_KEYS <= p.keys()
        chain = build_chain(dtype)
        c = chain.configurator
        config = size_for_budget(chain, budget)
        assert p["bytes_per_full_token"] == c.bytes_per_full_token
        assert p["bytes_per_swa_token"] == c.bytes_per_swa_token
        assert p["indexer_bytes_per_token"] == c.indexer_bytes_per_token
        assert p["stored_indexer_bytes_per_token"] == c.indexer_bytes_per_token
        assert p["max_total_num_tokens"] == config.max_total_num_tokens
        assert p["max_running_requests"] == config.max_running_requests
        assert p["pools"]["c4 indexer"]["tokens"] == config.c4_max_total_num_tokens
        assert sum(part["bytes"] for part in p["pools"].values()) == p["allocated_bytes"]
        # What upstream's pools allocate stays within the budget up to upstream's own rounding.
        assert abs(p["allocated_bytes"] - budget) < 0.001 * budget
    assert plans["fp8"]["bytes_per_full_token"] == 7086.75
    assert plans["bf16"]["bytes_per_full_token"] == 7737.75
    assert plans["bf16"]["max_total_num_tokens"] < plans["fp8"]["max_total_num_tokens"]


def test_compare_reports_the_unfixed_overcommit(compare_report):
    # Unfixed: a bf16 pool built at the sizes the fp8 price gives. Measured independently here.
    fp8_config = size_for_budget(build_chain("fp8"), int(DEFAULT_KV_MEMORY_GIB * GIB))
    bf16_pool = build_pool(build_chain("bf16"), fp8_config, device="meta")
    fp8_pool = build_pool(build_chain("fp8"), fp8_config, device="meta")
    over = storage_bytes(bf16_pool) - storage_bytes(fp8_pool)
    pages = bf16_pool.index_pools[4].index_k_with_scale_buffer[0].shape[0]
    assert over == 21 * pages * 64 * (256 - 132)
    assert compare_report["unfixed_bf16_overcommit_bytes"] == over
    assert compare_report["unfixed_bf16_overcommit_gb"] == pytest.approx(over / 1e9)


def test_plan_table(capsys):
    rc, out, err = run_plan(capsys, "--index-k-dtype", "bf16", "--kv-memory-gib", "20")
    assert rc == 0, err
    for label in ("bytes per full token", "indexer bytes per token", "max total (full) tokens"):
        assert label in out
    assert "7,737.75" in out and "c4 indexer" in out and "total" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--index-k-dtype", "fp16"], "index-K dtype 'fp16' is not supported"),
        (["--model", "{tmp}"], "no config.json in that folder"),
        (["--model", "{llama}"], "not a DeepSeek-V4 model (architectures: LlamaForCausalLM)"),
        (["--kv-memory-gib", "0.001"], "is too small for the pools of this model"),
        (["--kv-memory-gib", "-3"], "must be positive"),
        (["--disaggregation-mode", "both"], "choose one of prefill, decode, null"),
        (["--page-size", "128"], "upstream runs DeepSeek-V4 with page size 256"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, args, message):
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    args = [a.format(tmp=tmp_path, llama=llama) for a in args]
    rc, out, err = run_plan(capsys, *args)
    assert rc == 2
    assert out == ""
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_console_script_bad_input_has_no_traceback(tmp_path):
    script = [sys.executable, "-m", "sglang_dsv4", "plan", "--model", str(tmp_path)]
    done = subprocess.run(script, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"sglang-dsv4 plan: --model {tmp_path}: no config.json in that folder"
    ]
