"""The sanitizer's hooks: the table installed through upstream's HookRegistry, the one sampler
the two sampling hooks share, the indexer-read adapter on a decode step, and a fresh process with
the switch on driving the hooked upstream methods themselves.

Real upstream objects on the CPU, as in test_sanitizer.py (test/support/sanitizer.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sgl_kernel_dsv4.index_logits import bf16_paged_mqa_logits
from sglang_dsv4 import sanitizer, settings
from support.dsv4 import small_pool
from support.sanitizer import C4_PER_PAGE, DIM, HEADS, PAGE, kinds, make_server

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pool():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small host ops: threads only contend on a shared machine
    yield small_pool("bf16")[1]
    torch.set_num_threads(threads)


@pytest.fixture
def server(pool, monkeypatch):
    return make_server(pool, monkeypatch)


def test_sampled_decode_step_hook_checks_the_read_and_shadows_one_request(server):
    """The indexer hook's adapter on one decode step. Stand-ins only for the attention backend and
    forward batch (built on a GPU); their fields are the ones upstream's metadata holds."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    row = server.start(4096)  # 1024 c4 positions: the kernel keeps 512
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, HEADS, DIM, generator=gen).to(torch.bfloat16)  # compute_q_bf16's output
    weights = torch.rand(1, HEADS, generator=gen)
    keys = server.pool.get_index_k_bf16_buffer(server.layer)
    table = server.page_table([row]).to(torch.int32)
    lens = torch.tensor([1024], dtype=torch.int32)
    logits = bf16_paged_mqa_logits(q.unsqueeze(1), keys, weights, lens, table, 1024)

    def step(positions):
        slots = table[0].to(torch.int64)[positions // C4_PER_PAGE] * C4_PER_PAGE
        selected = (slots + positions % C4_PER_PAGE).reshape(1, -1)
        metadata = SimpleNamespace(
            indexer_metadata=SimpleNamespace(
                page_table=table, compressed_seq_lens=lens, compressed_page_size=C4_PER_PAGE
            ),
            core_metadata=SimpleNamespace(c4_sparse_page_indices=selected),
        )
        backend = SimpleNamespace(
            token_to_kv_pool=server.pool,
            page_size=PAGE,
            req_to_token=server.rows.req_to_token,
            forward_metadata=metadata,
        )
        batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE,
            req_pool_indices=torch.tensor([row]),
            seq_lens=torch.tensor([4096]),
        )
        assert server.san.begin_forward(batch)  # sample 1.0: every decode batch
        server.san._query[server.layer] = (q, weights)
        indexer = SimpleNamespace(layer_id=server.layer)
        sanitizer.check_indexer_read(server.san, backend, indexer, batch)

    step(torch.topk(logits[0], 512).indices)
    assert kinds(server.san) == {}
    step(torch.topk(logits[0], 1024).indices[256:768])  # a kernel that kept the wrong half
    assert kinds(server.san) == {"shadow_mismatch": 1}
    assert server.san.violations[0].found.startswith("0.500")


@pytest.mark.parametrize(
    "env,line",
    [
        ({"SGLANG_DSV4_SANITIZE": "2"}, "SGLANG_DSV4_SANITIZE='2' is not supported; allowed: 0, 1"),
        (
            {"SGLANG_DSV4_SANITIZE_SAMPLE": "1.5"},
            "SGLANG_DSV4_SANITIZE_SAMPLE='1.5' is not supported; allowed: a number from 0 to 1",
        ),
        (
            {"SGLANG_DSV4_SANITIZE_ACTION": "crash"},
            "SGLANG_DSV4_SANITIZE_ACTION='crash' is not supported; allowed: log, abort",
        ),
    ],
)
def test_bad_settings_are_one_line(env, line):
    with pytest.raises(settings.SettingsError) as err:
        settings.from_environ(env)
    assert str(err.value) == line


def test_off_installs_nothing():
    from sglang.srt.plugins.hook_registry import HookRegistry

    conf = settings.from_environ({})
    assert (conf.sanitize, conf.sanitize_sample, conf.sanitize_action) == (False, 0.01, "log")
    # This session loaded the plugin with the variable unset.
    assert sanitizer.SANITIZER is None and sanitizer.INSTALLED == []
    assert not any("PagedTokenToKVPoolAllocator" in t for t in HookRegistry._hooks)
    assert sanitizer.describe()["summary"] == "off (0 hooks)"


def test_a_hook_that_does_not_take_stops_the_process_with_one_line(monkeypatch):
    from sglang_dsv4.hooks import Refusal

    target = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_gone"
    monkeypatch.setattr(sanitizer.hooks, "HOOKS", (sanitizer.Hook(target, "AFTER", print),))
    conf = settings.from_environ({"SGLANG_DSV4_SANITIZE": "1"})
    with pytest.raises(Refusal) as err:
        sanitizer.install_from_settings(conf)
    assert (
        err.value.code
        == f"sglang-dsv4: refusing to run: sanitizer hook {target}: not found upstream"
    )
    assert sanitizer.SANITIZER is None and sanitizer.INSTALLED == []


CHILD = r"""
import json, sys, torch
sys.path.insert(0, "test")
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from support.dsv4 import small_pool
from sglang_dsv4 import sanitizer, status
san = sanitizer.SANITIZER
pool = small_pool("bf16")[1]  # built through the hooked __init__s: over-commit checked
alloc = PagedTokenToKVPoolAllocator(pool.full_size, page_size=256, dtype=torch.float8_e4m3fn,
                                    device="cpu", kvcache=pool, need_sort=False)
rows = ReqToTokenPool(size=4, max_context_len=4096, device="cpu", enable_memory_saver=False)
out = {"status": status.collect()["sanitizer"]}
from prometheus_client import REGISTRY
out["counters_at_start"] = {k: REGISTRY.get_sample_value(
    "sglang:dsv4_sanitizer_violations_total", {"kind": k}) for k in sanitizer.KINDS}
for _ in range(20):  # clean cycles through the hooked methods
    (row,) = rows.alloc_rows(1)
    slots = alloc.alloc(512)
    rows.write((row, slice(0, 512)), slots.to(torch.int32))
    alloc.free(slots)
    rows.free_rows([row])
held = alloc.alloc(512)
alloc.clear()  # a flush takes every page back: handing them out again is no violation
alloc.alloc(512)
alloc.clear()
out["clean"] = {k: n for k, n in san.counts.items() if n}
slots = alloc.alloc(256)
alloc.free(slots)
alloc.free(slots)  # double free
(row,) = rows.alloc_rows(1)
rows.write((row, slice(0, 256)), slots.to(torch.int32))  # a row given a freed page
from sglang.srt.disaggregation.decode import DecodeReqToTokenPool
decode_rows = DecodeReqToTokenPool(4, 4096, "cpu", False, pre_alloc_size=0)
decode_rows.write((1, slice(0, 256)), slots.to(torch.int32))  # the same on a PD decode
live = alloc.alloc(256)
alloc.free_pages = torch.cat((live[:1] // 256, alloc.free_pages))
again = alloc.alloc(256)  # the live page handed out again
(row2,) = rows.alloc_rows(1)
rows.write((row2, slice(0, 256)), again.to(torch.int32))  # its receiver: the double owner
out["faults"] = {k: n for k, n in san.counts.items() if n}
out["poisoned"] = bool((pool.index_pools[4].index_k_with_scale_buffer[0][int(slots[0]) // 256]
                        == 0xFF).all())
print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow  # a fresh process loads upstream and the plugin: about 15 s
def test_hooks_in_a_server_process_catch_faults():
    env = {
        **os.environ,
        "SGLANG_DSV4_SANITIZE": "1",
        "SGLANG_DSV4_SANITIZE_SAMPLE": "0.5",
        "SGLANG_DSV4_SANITIZE_ACTION": "abort",
        "SGLANG_DSV4_INDEX_K_DTYPE": "bf16",
        "PYTHONPATH": f"{ROOT / 'python'}:{ROOT / 'sgl-kernel' / 'python'}",
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT ") :])
    assert out["status"]["on"] and out["status"]["hooks"] == 35
    assert out["counters_at_start"] == dict.fromkeys(sanitizer.KINDS, 0.0)
    assert out["status"]["summary"].endswith("sample 0.5, action abort)")
    assert out["clean"] == {}
    assert out["faults"] == {"use_after_free": 3, "double_owner": 1}
    assert out["poisoned"]
    assert "sanitizer violation kind=double_owner" in proc.stderr


def _forward_batch(mode):
    """A real ForwardBatch of one request (as the model runner hands it to both hooks)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    one = torch.ones(1, dtype=torch.int64)
    return ForwardBatch(
        forward_mode=mode,
        batch_size=1,
        input_ids=one,
        req_pool_indices=one,
        seq_lens=one,
        out_cache_loc=one,
        seq_lens_sum=1,
    )


def test_the_two_sampling_hooks_share_one_decision_per_batch():
    """can_run_graph (AROUND) and init_forward_metadata (AFTER) as upstream's model runner calls
    them: can_run_graph first; a batch it keeps off the graph runs eagerly and its metadata hook
    sees the same batch. The graph runner's own answer is a stand-in (it needs a GPU)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    san = sanitizer.Sanitizer(sample=0.25, seed=1)
    hooks = {target: hook for target, hook, _ in sanitizer.bind(san)}
    can_run = hooks[f"{sanitizer.hooks._DECODE_GRAPH_RUNNER}.can_run_graph"]
    metadata = hooks[f"{sanitizer.hooks._BACKEND}.init_forward_metadata"]
    graph_ok = [True, True, True, False]  # every fourth batch: the graph cannot run it anyway
    checked = eager = kept_off = 0
    for step in range(400):
        batch = _forward_batch(ForwardMode.DECODE)
        on_graph = can_run(lambda runner, fb, ok=graph_ok[step % 4]: ok, None, batch)
        if not on_graph:  # the model runner's eager path builds the metadata
            eager += 1
            metadata(None, None, batch)
            metadata(None, None, batch)  # asked again: the same answer, no new draw
        sampled = san.sampler.current(batch)
        checked += sampled
        if graph_ok[step % 4]:
            assert on_graph is not sampled  # sampled: kept off the graph; else replayed
            kept_off += sampled
    assert san.sampler.decided == 400  # one draw per batch, whichever hook asked first
    assert checked == san.sampler.chosen and 70 <= checked <= 130  # about 0.25 of 400
    assert eager == 100 + kept_off and 0 < kept_off < checked
    # Prefill batches are never sampled, even at rate 1.
    san.sample = 1.0
    extend = _forward_batch(ForwardMode.EXTEND)
    metadata(None, None, extend)
    assert not san.sampler.current(extend)
    decode = _forward_batch(ForwardMode.DECODE)
    assert can_run(lambda runner, fb: True, None, decode) is False  # sampled: runs eagerly
    assert san.sampler.current(decode)
