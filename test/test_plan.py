"""`sglang-dsv4 plan`: its figures are upstream's configurator's, it follows the server's settings,
it answers the operator's questions, and bad input is one line, exit 2."""

import json
import math

import pytest
import sglang_dsv4.plan as plan_module
from sglang_dsv4 import warm_python
from sglang_dsv4.cli import main
from sglang_dsv4.plan import GIB, GPUS_MIB, MIB, gpu_capacity
from support.dsv4 import build_chain, build_pool, size_for_budget, storage_bytes

KV_GIB = 40
REQUIRED_KEYS = {
    "index_k_dtype",
    "index_k_dtype_source",
    "bytes_per_full_token",
    "bytes_per_swa_token",
    "indexer_bytes_per_token",
    "max_total_num_tokens",
    "max_running_requests",
    "one_more_page_bytes",
    "kv_memory_bytes",
    "allocated_bytes",
    "unallocated_bytes",
    "req_to_token_bytes",
    "launch",
}


def run_plan(capsys, *args):
    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def plan_json(capsys, *args) -> dict:
    rc, out, err = run_plan(capsys, *args, "--json")
    assert rc == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def compare_report():
    import io
    from contextlib import redirect_stdout

    buffer = io.StringIO()
    with redirect_stdout(buffer):
        assert main(["plan", "--compare", "--kv-memory-gib", str(KV_GIB), "--json"]) == 0
    return json.loads(buffer.getvalue())


def test_compare_json_equals_the_configurator(compare_report):
    plans = {p["index_k_dtype"]: p for p in compare_report["compare"]}
    assert list(plans) == ["fp8", "bf16", "fp4"]
    budget = KV_GIB * GIB
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
        assert p["pools"]["c4 kv"]["tokens"] == config.c4_max_total_num_tokens
        assert sum(part["bytes"] for part in p["pools"].values()) == p["allocated_bytes"]
        # Never more than the budget, never a whole page of every pool less.
        assert 0 <= p["unallocated_bytes"] < p["one_more_page_bytes"]
        assert p["allocated_bytes"] + p["unallocated_bytes"] == budget
    assert plans["fp8"]["bytes_per_full_token"] == 7086.75
    assert plans["bf16"]["bytes_per_full_token"] == 7737.75
    assert plans["bf16"]["max_total_num_tokens"] < plans["fp8"]["max_total_num_tokens"]


def test_compare_reports_the_unfixed_overcommit_with_its_budget(compare_report, capsys):
    # Unfixed: a bf16 pool built at the sizes the fp8 price gives. Measured independently here.
    fp8_config = size_for_budget(build_chain("fp8"), KV_GIB * GIB)
    bf16_pool = build_pool(build_chain("bf16"), fp8_config, device="meta")
    fp8_pool = build_pool(build_chain("fp8"), fp8_config, device="meta")
    over = storage_bytes(bf16_pool) - storage_bytes(fp8_pool)
    pages = bf16_pool.index_pools[4].index_k_with_scale_buffer[0].shape[0]
    assert over == 21 * pages * 64 * (256 - 132)
    assert compare_report["unfixed_bf16_overcommit_bytes"] == over
    assert compare_report["unfixed_bf16_overcommit_gib"] == pytest.approx(over / GIB)
    assert compare_report["kv_memory_bytes"] == KV_GIB * GIB
    plan_module.render_compare(compare_report)
    out = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal's width
    assert f"over-commits {over / GIB:.2f} GiB per rank at a KV budget of 40.00 GiB" in out


def test_plan_follows_the_servers_index_k_settings(capsys, monkeypatch):
    monkeypatch.setenv("SGLANG_DSV4_INDEX_K_DTYPE", "bf16")
    p = plan_json(capsys, "--kv-memory-gib", "20")
    assert (p["index_k_dtype"], p["index_k_dtype_source"]) == (
        "bf16",
        "SGLANG_DSV4_INDEX_K_DTYPE=bf16",
    )
    assert p["bytes_per_full_token"] == 7737.75
    assert p["launch"]["environment"] == {"SGLANG_DSV4_INDEX_K_DTYPE": "bf16"}
    # The flag overrides the variable.
    p = plan_json(capsys, "--kv-memory-gib", "20", "--index-k-dtype", "fp8")
    assert (p["index_k_dtype"], p["index_k_dtype_source"]) == ("fp8", "--index-k-dtype")
    monkeypatch.delenv("SGLANG_DSV4_INDEX_K_DTYPE")
    p = plan_json(capsys, "--kv-memory-gib", "20", "--enable-deepseek-v4-fp4-indexer")
    assert (p["index_k_dtype"], p["index_k_dtype_source"]) == (
        "fp4",
        "--enable-deepseek-v4-fp4-indexer",
    )
    assert "--enable-deepseek-v4-fp4-indexer" in p["launch"]["command"]
    p = plan_json(capsys, "--kv-memory-gib", "20")
    assert (p["index_k_dtype"], p["index_k_dtype_source"]) == (
        "fp8",
        "upstream default (no setting)",
    )


def upstream_mem_fraction(gpu_mib, **server_args):
    """--mem-fraction-static as upstream's own memory hook resolves it for a GPU."""
    from sglang.srt.runtime_context import get_schedule, publish
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=str(plan_module.default_model_dir()), device="cpu", **server_args)
    with gpu_capacity(gpu_mib):
        publish(args, role="scheduler")
    return get_schedule().mem_fraction_static


def test_budget_is_derived_from_the_gpu_tp_and_role_as_upstream_would(capsys):
    gpu = GPUS_MIB["rtx-pro-6000"] * MIB
    figures = {}
    for tp, mode in ((4, "decode"), (4, "prefill"), (8, "prefill")):
        p = plan_json(capsys, "--tp", str(tp), "--disaggregation-mode", mode)
        fraction = upstream_mem_fraction(
            GPUS_MIB["rtx-pro-6000"], tp_size=tp, disaggregation_mode=mode
        )
        assert p["mem_fraction_static"] == fraction
        assert p["weights_bytes_per_rank"] == 160 * 10**9 // tp
        assert p["kv_memory_bytes"] == int(gpu * fraction) - 160 * 10**9 // tp
        assert p["reserve_bytes"] == gpu - int(gpu * fraction)
        assert 0 <= p["unallocated_bytes"] < p["one_more_page_bytes"]
        assert f"--tp-size {tp}" in p["launch"]["command"]
        figures[tp, mode] = p
    # The role changes upstream's activation reserve; TP the weights per rank (and the reserve).
    assert figures[4, "decode"]["mem_fraction_static"] == 0.895
    assert figures[4, "prefill"]["mem_fraction_static"] < 0.895
    assert figures[8, "prefill"]["kv_memory_bytes"] > figures[4, "prefill"]["kv_memory_bytes"]
    # DeepSeek-V4 keeps one latent KV head, so the price per token is the same at every TP, as
    # upstream's own configurator says.
    assert (
        figures[8, "prefill"]["bytes_per_full_token"]
        == build_chain(tp=8).configurator.bytes_per_full_token
        == figures[4, "decode"]["bytes_per_full_token"]
    )


def test_role_changes_the_request_slots_as_upstream_does(capsys):
    # With 16 requests upstream gives a decode server 32 pre-allocation slots on top.
    decode = plan_json(capsys, "--kv-memory-gib", "20", "--max-running-requests", "16")
    prefill = plan_json(
        capsys, "--kv-memory-gib", "20", "--max-running-requests", "16",
        "--disaggregation-mode", "prefill",
    )  # fmt: skip
    assert decode["pools"]["c128 states"]["tokens"] == (16 + 32 + 1) * 128
    assert prefill["pools"]["c128 states"]["tokens"] == (16 + 1) * 128
    assert decode["max_total_num_tokens"] < prefill["max_total_num_tokens"]


def test_sessions_per_rank_and_deployment_by_dtype(capsys):
    p = plan_json(capsys, "--context", "80000", "--gpus", "8")
    per_session = math.ceil(80000 / 256) * 256
    s = p["sessions"]
    assert s["limits"]["full tokens"] == p["max_total_num_tokens"] // per_session
    assert s["per_rank"] == min(s["limits"].values())
    assert s["deployment"] == s["per_rank"] * 2
    by_dtype = p["sessions_by_index_k_dtype"]
    assert by_dtype["fp8"] == s["per_rank"]
    assert by_dtype["fp4"] >= by_dtype["fp8"] > by_dtype["bf16"]
    assert by_dtype["bf16_cost_vs_fp8"] == by_dtype["fp8"] - by_dtype["bf16"]


def test_plan_table_shows_what_the_json_carries(capsys):
    rc, out, err = run_plan(capsys, "--index-k-dtype", "bf16", "--context", "80000")
    assert rc == 0, err
    out = " ".join(out.split())  # rich wraps at the terminal's width
    p = plan_json(capsys, "--index-k-dtype", "bf16", "--context", "80000")
    for text in (
        "7,737.75",
        f"{p['max_total_num_tokens']:,}",
        f"{p['one_more_page_bytes']:,}",
        f"{p['weights_bytes_per_rank'] / GIB:.2f}",
        f"{p['reserve_bytes'] / GIB:.2f}",
        f"{p['kv_memory_bytes'] / GIB:.2f}",
        f"{p['req_to_token_bytes'] / GIB:.2f}",
        f"{p['sessions']['per_rank']:,} per rank",
        "SGLANG_DSV4_INDEX_K_DTYPE=bf16 python -m sglang.launch_server",
        "MEM_FRACTION=0.895",
        "computed, not measured",
    ):
        assert text in out, text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--index-k-dtype", "fp16"], "--index-k-dtype 'fp16' is not supported"),
        (["--model", "{tmp}"], "no config.json in that folder"),
        (
            ["--model", "deepseek-ai/DeepSeek-V4-Flash"],
            "a local folder with config.json, not a hub id",
        ),
        (["--model", "{llama}"], "not a DeepSeek-V4 model (architectures: LlamaForCausalLM)"),
        (["--model", "{v4}"], "no model.safetensors.index.json to read the weights' size"),
        (
            ["--kv-memory-gib", "0.1"],
            "is too small for the pools of this model (they need at least",
        ),
        (["--kv-memory-gib", "1000"], "more than the whole rtx-pro-6000 (95.6 GiB)"),
        (["--kv-memory-gib", "-3"], "must be positive"),
        (["--disaggregation-mode", "both"], "choose one of prefill, decode, null"),
        (["--gpu", "a100x"], "--gpu 'a100x': unknown GPU"),
        (["--tp", "3"], "--tp 3 does not divide the model's 64 attention heads"),
        (["--index-k-dtype", "bf16", "--enable-deepseek-v4-fp4-indexer"], "contradicts"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, args, message):
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    v4 = tmp_path / "v4"  # a DeepSeek-V4 config without its checkpoint index
    v4.mkdir()
    (v4 / "config.json").write_text((plan_module.default_model_dir() / "config.json").read_text())
    args = [a.format(tmp=tmp_path, llama=llama, v4=v4) for a in args]
    rc, out, err = run_plan(capsys, *args)
    assert rc == 2
    assert out == ""
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert "--mem-fraction-static" not in err  # no advice about flags the plan does not take


def test_env_settings_the_server_refuses_are_refused(capsys, monkeypatch):
    monkeypatch.setenv("SGLANG_DSV4_INDEX_K_DTYPE", "fp4")
    rc, _, err = run_plan(capsys)
    # The server's own refusal line, from the one rule (sglang_dsv4.index_k_dtype).
    assert rc == 2 and "pass --enable-deepseek-v4-fp4-indexer as well" in err
    monkeypatch.setenv("SGLANG_DSV4_INDEX_K_DTYPE", "int4")
    rc, _, err = run_plan(capsys)
    assert rc == 2 and "SGLANG_DSV4_INDEX_K_DTYPE='int4' is not supported" in err


def test_page_size_is_refused_before_any_sizing(capsys, monkeypatch):
    def no_chain(*args, **kwargs):
        raise AssertionError("the chain was built for a page size upstream does not run")

    from sglang_dsv4.plan import budget

    monkeypatch.setattr(budget, "build_chain", no_chain)  # where plan() looks it up
    rc, _, err = run_plan(capsys, "--page-size", "128")
    assert rc == 2 and "upstream runs DeepSeek-V4 with page size 256" in err


def test_console_script_bad_input_has_no_traceback(tmp_path):
    script = ["-m", "sglang_dsv4", "plan", "--model", str(tmp_path)]
    done = warm_python.run(script, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"sglang-dsv4 plan: --model {tmp_path}: no config.json in that folder"
    ]
