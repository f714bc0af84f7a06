"""sgl_kernel_dsv4's bf16 paged MQA logits: the torch path, the Triton kernel and the benchmarks.

The Triton kernel runs on the CPU under TRITON_INTERPRET=1. That variable must be set before the
kernel is first decorated, and this session has long imported sglang (and Triton) by the time
tests run, so `test_triton_kernel_under_interpreter` starts a child pytest on this file with the
variable set (and without conftest: no sglang there); the child alone defines the `interpreted`
tests. On a GPU host the `gpu` tests run
the compiled kernel and CUDA-graph capture (skipped without CUDA).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from sgl_kernel_dsv4 import (
    IndexLogitsInputError,
    bf16_paged_mqa_logits,
    bf16_paged_mqa_logits_torch,
    bf16_paged_mqa_logits_triton,
    hadamard_rotate,
)
from sgl_kernel_dsv4 import index_logits as index_logits_module
from sgl_kernel_dsv4.fp8_reference import (
    index_logits_dense,
    pack_fp8_index_pages,
    quantize_index_fp8,
)
from sglang_dsv4 import warm_python

REPO = Path(__file__).resolve().parents[1]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
PAGE = 64
OUTLIER_CHANNELS = [3, 40, 77, 126]


def make_case(seq_lens, *, heads=16, max_seq_len=None, table_cols=None, spare_pages=3,
              outliers=False, hole=None, seed=0):
    """Inputs as the indexer passes them: keys in a uint8 pool viewed as bf16 pages, pages handed
    out in shuffled order, -1 past each row's pages. `hole=(row, col)` punches a -1 inside a row."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    needed = [-(-s // PAGE) for s in seq_lens]
    cols = table_cols or max(1, *needed)
    num_pages = sum(needed) + spare_pages
    order = torch.randperm(num_pages, generator=gen).to(torch.int32)
    page_table = torch.full((batch, cols), -1, dtype=torch.int32)
    taken = 0
    for row, count in enumerate(needed):
        count = min(count, cols)
        page_table[row, :count] = order[taken : taken + count]
        taken += count
    if hole is not None:
        page_table[hole] = -1
    keys = torch.randn(num_pages, PAGE, 128, generator=gen)
    if outliers:
        keys[..., OUTLIER_CHANNELS] *= 40.0
    pool_bytes = torch.zeros(num_pages, PAGE * 256, dtype=torch.uint8)
    pool_bytes.view(torch.bfloat16).copy_(keys.reshape(num_pages, -1))
    return dict(
        q=torch.randn(batch, 1, heads, 128, generator=gen).to(torch.bfloat16),
        kv_cache=pool_bytes.view(torch.bfloat16).view(num_pages, PAGE, 1, 128),
        weights=torch.randn(batch, heads, generator=gen),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        page_table=page_table,
        max_seq_len=max_seq_len if max_seq_len is not None else cols * PAGE,
    )


def reference_logits(case) -> torch.Tensor:
    """fp64, position by position from the contract in the kernel docstring."""
    q = case["q"][:, 0].double()
    keys = case["kv_cache"][:, :, 0].double()
    table = case["page_table"]
    batch, width = q.shape[0], case["max_seq_len"]
    out = torch.full((batch, width), float("-inf"), dtype=torch.float64)
    for row in range(batch):
        for t in range(min(int(case["seq_lens"].view(-1)[row]), width)):
            col = t // PAGE
            if col >= table.shape[1] or table[row, col] < 0:
                continue
            key = keys[int(table[row, col]), t % PAGE]
            out[row, t] = (case["weights"][row].double() * (q[row] @ key).relu()).sum()
    return out


CASES = {
    # several rows with lengths 0, 1, 63, 64, 65 and a non-multiple of 64
    "edge_lengths": dict(seq_lens=[0, 1, 63, 64, 65, 200]),
    "real_heads": dict(seq_lens=[300, 129], heads=64),
    "odd_heads": dict(seq_lens=[70, 5, 190], heads=20),
    "outlier_channels": dict(seq_lens=[256, 100], outliers=True),
    "narrow_output": dict(seq_lens=[200, 130], max_seq_len=150),
    "wide_output": dict(seq_lens=[200, 10], max_seq_len=7 * PAGE + 5),
    "short_table": dict(seq_lens=[300, 64], table_cols=3, max_seq_len=6 * PAGE),
    "hole_in_table": dict(seq_lens=[250, 190], hole=(0, 1)),
    "column_seq_lens": dict(seq_lens=[90, 33]),
}


def case_named(name):
    case = make_case(**CASES[name])
    if name == "column_seq_lens":
        case["seq_lens"] = case["seq_lens"].unsqueeze(1)
    return case


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, seq_lens=None):
    """Same -inf pattern and values; with `seq_lens`, only each row's first seq_len positions
    (the contract leaves the rest unspecified)."""
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    if seq_lens is not None:
        inside = torch.arange(actual.shape[1]).unsqueeze(0) < seq_lens.view(-1, 1)
        actual = torch.where(inside, actual, float("-inf"))
        expected = torch.where(inside, expected, float("-inf"))
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected)), "-inf pattern differs"
    finite = torch.isfinite(expected)
    assert torch.isfinite(actual[finite]).all()
    scale = expected[finite].abs().max().item() if finite.any() else 1.0
    torch.testing.assert_close(actual[finite].double(), expected[finite], rtol=1e-5, atol=1e-5 * scale)


def topk_page_indices(logits, case, topk):
    """Upstream's own top-k step (torch backend) turns logits into pool slots, as in serving."""
    from sglang.srt.layers.attention.dsv4.indexer import topk_transform_pytorch_vectorized

    out = torch.empty(logits.shape[0], topk, dtype=torch.int32)
    topk_transform_pytorch_vectorized(
        logits.float(), case["seq_lens"].view(-1), case["page_table"], out, PAGE
    )
    return out


def assert_same_selection(actual, expected, reference, topk):
    """Equal sets, or any swap is between near-tied keys (in the fp64 reference)."""
    for row in range(actual.shape[0]):
        a, e = set(actual[row].tolist()), set(expected[row].tolist())
        if a == e:
            continue
        finite = reference[row][torch.isfinite(reference[row])]
        kth = finite.topk(min(topk, finite.numel())).values[-1].item()
        assert abs(kth) < 1e-9 or len(a ^ e) <= 2, f"row {row}: selections differ by {len(a ^ e)}"


# --- torch path --------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_path_matches_fp64_reference(name):
    case = case_named(name)
    assert_matches(bf16_paged_mqa_logits_torch(**case), reference_logits(case))


def test_torch_path_in_several_steps(monkeypatch):
    """A small budget forces the page loop through several steps, the last one partial."""
    case = make_case([700, 320, 5], heads=16)
    monkeypatch.setenv("SGLANG_DSV4_INDEXER_BUDGET_MIB", "2")  # steps of 512 KiB: 3 pages
    assert index_logits_module._pages_per_step(3, 16, 11) == 3
    assert_matches(bf16_paged_mqa_logits_torch(**case), reference_logits(case))


def test_indexer_rows_per_chunk_fits_the_budget():
    """The row chunk follows the formula in its docstring: at most the budget at any row
    count, at least one row, and wider logits or more heads mean fewer rows."""
    from sgl_kernel_dsv4.index_logits import indexer_rows_per_chunk

    budget = 512 << 20
    for rows, cols, heads in [(16384, 4096, 64), (100_000, 262_144, 64), (7, 64, 64), (5000, 8192, 16)]:
        chunk = indexer_rows_per_chunk(rows, cols, heads, budget)
        assert 1 <= chunk <= rows
        assert budget // 4 + chunk * (12 * cols + 24 * heads * 128) <= budget
        assert chunk * index_logits_module._page_step_bytes(heads) <= budget // 4
    assert indexer_rows_per_chunk(10**6, 262_144, 64, budget) == 120
    assert indexer_rows_per_chunk(10**6, 4096, 64, budget) == 1628
    assert indexer_rows_per_chunk(10, 10**9, 64, budget) == 1  # never zero


def test_indexer_budget_refuses_a_bad_value(monkeypatch):
    monkeypatch.setenv("SGLANG_DSV4_INDEXER_BUDGET_MIB", "lots")
    with pytest.raises(ValueError, match="SGLANG_DSV4_INDEXER_BUDGET_MIB='lots' must be"):
        index_logits_module.indexer_budget_bytes()


def test_torch_path_top_k_agrees_with_fp64():
    case = make_case([1000, 700, 40, 513], heads=64, outliers=True, seed=3)
    reference = reference_logits(case)
    ours = topk_page_indices(bf16_paged_mqa_logits_torch(**case), case, 64)
    theirs = topk_page_indices(reference, case, 64)
    assert_same_selection(ours, theirs, reference, 64)
    # rows no longer than top-k take every key in order; -1 after them
    assert ours[2, :40].tolist() == [
        int(case["page_table"][2, t // PAGE]) * PAGE + t % PAGE for t in range(40)
    ]
    assert (ours[2, 40:] == -1).all()


def test_torch_path_is_cuda_graph_safe():
    """On the meta device nothing has a value: any .item(), host sync or data-dependent shape
    (nonzero, boolean indexing) raises. The output shape follows from the arguments' shapes."""
    case = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in make_case([300, 5]).items()}
    out = bf16_paged_mqa_logits_torch(**case)
    assert out.device.type == "meta" and tuple(out.shape) == (2, case["max_seq_len"])


def test_dispatcher_takes_torch_off_cuda(monkeypatch):
    def no_triton(*args):
        raise AssertionError("Triton must not be chosen for CPU tensors")

    monkeypatch.setattr(index_logits_module, "bf16_paged_mqa_logits_triton", no_triton)
    case = make_case([65, 3])
    assert torch.equal(bf16_paged_mqa_logits(**case), bf16_paged_mqa_logits_torch(**case))


def _bad(**changes):
    case = make_case([65, 3])
    case.update(changes)
    return case


BAD_INPUTS = {
    "fp8 query": (_bad(q=torch.zeros(2, 1, 16, 128, dtype=torch.float8_e4m3fn)), "q must be bfloat16"),
    "next_n 2": (_bad(q=torch.zeros(2, 2, 16, 128, dtype=torch.bfloat16)), "q must be bfloat16"),
    "fp8 page layout": (_bad(kv_cache=torch.zeros(4, 64, 1, 132, dtype=torch.uint8)), "kv_cache must be"),
    "bf16 weights": (_bad(weights=torch.zeros(2, 16, dtype=torch.bfloat16)), "weights must be float32"),
    "int64 seq_lens": (_bad(seq_lens=torch.tensor([65, 3])), "seq_lens must be int32"),
    "1-D page table": (_bad(page_table=torch.zeros(2, dtype=torch.int32)), "page_table must be int32"),
    "float max_seq_len": (_bad(max_seq_len=128.0), "max_seq_len must be"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
@pytest.mark.parametrize("kernel", [bf16_paged_mqa_logits_torch, bf16_paged_mqa_logits_triton])
def test_bad_input_is_one_clear_line(name, kernel):
    case, fragment = BAD_INPUTS[name]
    with pytest.raises(IndexLogitsInputError) as raised:
        kernel(**case)
    message = str(raised.value)
    assert message.startswith("bf16_paged_mqa_logits: ") and fragment in message
    assert "\n" not in message


# --- references the benchmarks use -------------------------------------------------------


def test_hadamard_rotate_is_the_sylvester_rotation():
    sylvester = torch.ones(1, 1, dtype=torch.float64)
    while sylvester.shape[0] < 128:
        sylvester = torch.cat((torch.cat((sylvester, sylvester), 1), torch.cat((sylvester, -sylvester), 1)))
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(hadamard_rotate(x).double(), x.double() @ sylvester / 128**0.5,
                               rtol=1e-6, atol=1e-6)


def test_fp8_reference_feeds_upstreams_sm120_path():
    """Keys quantized and packed by the reference, read by upstream's own fp8 sm_120 torch path
    on the CPU, give the reference's fp8 logits (upstream rounds per-head scores to bf16)."""
    from sglang.srt.layers.attention.dsv4.indexer import fp8_paged_mqa_logits_torch_sm120

    gen = torch.Generator().manual_seed(2)
    keys = hadamard_rotate(torch.randn(150, 128, generator=gen))
    query = hadamard_rotate(torch.randn(2, 64, 128, generator=gen))
    weights = torch.randn(2, 64, generator=gen)
    k8, k_scale = quantize_index_fp8(keys)
    assert torch.equal(k_scale, keys.abs().amax(1).clamp(min=1e-4) / 448)
    q8, q_scale = quantize_index_fp8(query)
    pages = pack_fp8_index_pages(k8, k_scale)
    table = torch.arange(pages.shape[0], dtype=torch.int32).repeat(2, 1)
    upstream = fp8_paged_mqa_logits_torch_sm120(
        q8.unsqueeze(1), pages, weights * q_scale, torch.tensor([150, 100], dtype=torch.int32),
        table, None, 192, False,
    )
    ours = index_logits_dense(query, keys, weights, "fp8")
    scale = ours.abs().max().item()
    torch.testing.assert_close(upstream[0, :150], ours[0], rtol=0, atol=4e-3 * scale)
    torch.testing.assert_close(upstream[1, :100], ours[1, :100], rtol=0, atol=4e-3 * scale)
    assert torch.isneginf(upstream[1, 100:]).all() and torch.isneginf(upstream[0, 150:]).all()


def test_recall_benchmark_end_to_end(tmp_path):
    """The recall benchmark at a tiny size: table, JSON and PNG, and bf16 recovers at least as
    much of the exact top-k as fp8 on outlier-channel data."""
    proc = warm_python.run(
        [str(REPO / "benchmark" / "indexer_recall.py"), "--contexts", "300", "1200",
         "--queries", "12", "--heads", "16", "--topk", "64", "--outlier-gain", "24",
         "--out-dir", str(tmp_path)],
        timeout=300, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recall@64 mean" in proc.stdout
    assert (tmp_path / "indexer_recall.png").stat().st_size > 10_000
    report = json.loads((tmp_path / "indexer_recall.json").read_text())
    rows = {(r["context_keys"], r["dtype"]): r for r in report["results"]}
    assert set(rows) == {(n, d) for n in (300, 1200) for d in ("fp8", "bf16")}
    for n in (300, 1200):
        assert rows[n, "bf16"]["recall_mean"] >= rows[n, "fp8"]["recall_mean"]
        assert rows[n, "bf16"]["bytes_per_decode_step_per_layer"] == n * 256
        assert rows[n, "fp8"]["bytes_per_decode_step_per_layer"] == n * 132
    assert rows[1200, "fp8"]["recall_mean"] < 1.0  # the comparison is not vacuous


def test_kernel_benchmark_refuses_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA; the benchmark would run")
    proc = warm_python.run([str(REPO / "benchmark" / "indexer_kernels.py")], timeout=120, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "needs a CUDA GPU" in proc.stderr


def test_kernel_benchmark_table_width_under_the_interpreter(tmp_path):
    """The CPU table-width check end to end at a tiny size: both widths timed, the wide table's
    logits equal to the exact one's, the ratio reported (its value is a measurement, not
    checked here: --max-ratio is lifted)."""
    out = tmp_path / "widths.json"
    # A cold interpreter: --interpret sets Triton's switch before Triton is imported, and refuses
    # a process that already imported it (a warm-forked one has).
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmark" / "indexer_kernels.py"), "--interpret",
         "--batch", "2", "--keys", "200", "--heads", "16", "--iters", "1",
         "--table-width", "4", "--max-ratio", "1000", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "4x width ms (ratio)" in proc.stdout
    [row] = json.loads(out.read_text())["table_width"]
    assert row["same"] and set(row["ratio"]) == {"1", "4"} and row["ratio"]["1"] == 1.0


def test_no_kernel_module_imports_another_implementation():
    """The package's import graph (module level and inside functions) has no cycle, and the
    contract imports nothing of the package: each implementation sees only the contract."""
    import ast

    package = REPO / "sgl-kernel" / "python" / "sgl_kernel_dsv4"
    graph = {}
    for path in package.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sgl_kernel_dsv4."):
                imported.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                imported |= {a.name.split(".")[1] for a in node.names
                             if a.name.startswith("sgl_kernel_dsv4.")}
        graph[path.stem] = imported - {path.stem}
    assert graph["index_contract"] == set()
    assert graph["index_logits_triton"] == {"index_contract"}
    assert graph["index_rotation_triton"] == {"index_contract"}

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n)))
                   for n in graph.get(start, ()))

    assert [m for m in graph if reaches(m, m)] == []


# --- launch rule and config (no kernel runs) -------------------------------------------------


class FakeDevice:
    """What torch.cuda says about a GPU this host does not have (a stand-in: no GPU here)."""

    def __init__(self, name, sms, capability=(12, 0)):
        self.name, self.sms, self.capability = name, sms, capability

    def install(self, monkeypatch):
        props = SimpleNamespace(multi_processor_count=self.sms, major=self.capability[0],
                                minor=self.capability[1])
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: self.name)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.fixture
def triton_launch(monkeypatch, tmp_path):
    from sgl_kernel_dsv4 import index_logits_triton as module

    monkeypatch.setattr(module, "TUNED_LAUNCH_FILE", tmp_path / "tuned_launch.json")
    module.load_tuned_launch.cache_clear()
    module._config_for.cache_clear()
    yield module
    module.load_tuned_launch.cache_clear()
    module._config_for.cache_clear()


@pytest.mark.parametrize("sms", [188, 84, 170])
def test_launch_config_follows_the_devices_sm_count(triton_launch, monkeypatch, sms):
    """No tuned entry: the heuristic sizes the launch from the device's own SM count."""
    FakeDevice("NVIDIA RTX PRO 6000 Blackwell", sms).install(monkeypatch)
    config = triton_launch.launch_config_for("cuda:0")
    assert config["sm_count"] == sms and config["programs_per_sm"] == 2  # what fits on sm_120
    # one long row spreads over the whole device; many rows share it, in one wave
    assert triton_launch.workers_per_row(1, 1 << 20, 1 << 14, config) == 2 * sms
    assert triton_launch.workers_per_row(64, 1 << 20, 1 << 14, config) == 2 * sms // 64
    assert 64 * triton_launch.workers_per_row(64, 1 << 20, 1 << 14, config) <= 2 * sms
    # more rows than resident slots: one program each
    assert triton_launch.workers_per_row(4 * sms, 1 << 20, 1 << 14, config) == 1


def test_launch_config_takes_the_tuned_entry_for_its_device(triton_launch, monkeypatch):
    # a config of the sweep, which the committed ahead-of-time check passed for sm_120
    tuned = {"pages_per_step": 2, "programs_per_sm": 1, "num_warps": 8, "num_stages": 3}
    entry = {"capability": "12.0", "config": tuned, "measured": {"ms": 0.1}}
    triton_launch.TUNED_LAUNCH_FILE.write_text(json.dumps({"NVIDIA RTX PRO 6000 Blackwell": entry}))
    FakeDevice("NVIDIA RTX PRO 6000 Blackwell", 188).install(monkeypatch)
    config = triton_launch.launch_config_for("cuda")
    assert config == {**tuned, "sm_count": 188}
    # another device name, or the same name with another capability: the heuristic
    triton_launch._config_for.cache_clear()
    FakeDevice("NVIDIA RTX PRO 6000 Blackwell", 188, capability=(10, 0)).install(monkeypatch)
    assert triton_launch.launch_config_for("cuda") == triton_launch.heuristic_config(188, (10, 0))
    triton_launch._config_for.cache_clear()
    FakeDevice("NVIDIA H200", 132, capability=(9, 0)).install(monkeypatch)
    assert triton_launch.launch_config_for("cuda") == triton_launch.heuristic_config(132, (9, 0))


@pytest.mark.parametrize("text", ["", "{}"])
def test_launch_config_without_measurements(triton_launch, monkeypatch, text):
    triton_launch.TUNED_LAUNCH_FILE.write_text(text)
    FakeDevice("NVIDIA H200", 132, capability=(9, 0)).install(monkeypatch)
    assert triton_launch.launch_config_for("cuda") == triton_launch.heuristic_config(132, (9, 0))


def test_launch_config_refuses_a_bad_entry(triton_launch, monkeypatch):
    entry = {"capability": "12.0", "config": {"pages_per_program": 2}}
    triton_launch.TUNED_LAUNCH_FILE.write_text(json.dumps({"GPU X": entry}))
    FakeDevice("GPU X", 100).install(monkeypatch)
    with pytest.raises(ValueError, match=r"unknown keys \['pages_per_program'\]"):
        triton_launch.launch_config_for("cuda")


def test_launch_sweep_configs_are_valid(triton_launch):
    for config in triton_launch.LAUNCH_SWEEP:
        triton_launch.check_config(dict(config))
        assert "sm_count" not in config  # the device supplies it


def test_launch_shape_follows_argument_shapes_only(triton_launch):
    """CUDA-graph safety: the grid is a function of shapes and the config, and a page table 16x
    wider than needed adds no programs once the device is full."""
    config = triton_launch.heuristic_config(188)
    exact = triton_launch.workers_per_row(32, 20_480, 320, config)
    wide = triton_launch.workers_per_row(32, 16 * 20_480, 16 * 320, config)
    assert exact == wide == 2 * 188 // 32


# --- Triton kernel under the interpreter (child process) ---------------------------------

if INTERPRETED:

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_interpreted_triton_matches_torch_and_fp64(name):
        case = case_named(name)
        triton_out = bf16_paged_mqa_logits_triton(**case)
        seq_lens = case["seq_lens"]
        assert_matches(triton_out, reference_logits(case), seq_lens)
        assert_matches(triton_out, bf16_paged_mqa_logits_torch(**case).double(), seq_lens)

    @pytest.mark.parametrize("sweep", range(5))
    @pytest.mark.parametrize("sm_count", [1, 3])
    def test_interpreted_launch_configs(sweep, sm_count):
        """Every swept config, with one or several workers per row (3 SMs), gives the contract."""
        from sgl_kernel_dsv4.index_logits_triton import LAUNCH_SWEEP, launch

        case = make_case([400, 65, 0, 1000], heads=16, table_cols=20)
        config = {**LAUNCH_SWEEP[sweep], "sm_count": sm_count}
        out = launch(**case, config=config)
        assert_matches(out, reference_logits(case), case["seq_lens"])

    @pytest.mark.parametrize("sm_count", [None, 188])
    def test_interpreted_work_follows_the_keys_not_the_table_width(monkeypatch, sm_count):
        """A page table 16x wider than the sequences, with the device's own launch (None) or as
        on a 188-SM GPU: the same loads and dots as with the exact width, none past a row's last
        page, and every position stored exactly once, the tail past it as -inf (the
        interpreter's own dot, load and store are counted)."""
        from triton.runtime.interpreter import InterpreterBuilder

        counts = {"dots": 0, "loaded": 0, "stored": 0}
        dot, store = InterpreterBuilder.create_dot, InterpreterBuilder.create_masked_store
        load = InterpreterBuilder.create_masked_load

        def counting_dot(self, *args):
            counts["dots"] += 1
            return dot(self, *args)

        def counting_load(self, ptrs, mask, *args):
            if ptrs.data.size > 1:  # block loads; each program's one seq_len load aside
                counts["loaded"] += int(mask.data.sum()) if mask is not None else ptrs.data.size
            return load(self, ptrs, mask, *args)

        def counting_store(self, ptrs, value, mask, *args):
            counts["stored"] += int(mask.data.sum())
            return store(self, ptrs, value, mask, *args)

        monkeypatch.setattr(InterpreterBuilder, "create_dot", counting_dot)
        monkeypatch.setattr(InterpreterBuilder, "create_masked_load", counting_load)
        monkeypatch.setattr(InterpreterBuilder, "create_masked_store", counting_store)
        seq_lens = [768, 64, 1, 0, 130]
        seen = {}
        for width in (12, 16 * 12):
            counts.update(dots=0, loaded=0, stored=0)
            case = make_case(seq_lens, table_cols=width, max_seq_len=width * PAGE)
            if sm_count is None:
                out = bf16_paged_mqa_logits_triton(**case)
            else:
                from sgl_kernel_dsv4.index_logits_triton import launch

                out = launch(**case, config={"pages_per_step": 2, "sm_count": sm_count})
            assert_matches(out, reference_logits(case), case["seq_lens"])
            past = torch.arange(out.shape[1]).unsqueeze(0) >= case["seq_lens"].view(-1, 1)
            assert torch.isneginf(out[past]).all()
            assert counts["stored"] == len(seq_lens) * width * PAGE  # each position once
            seen[width] = dict(counts)
        dot_keys = 64 if sm_count is None else 128  # the default's one page per dot, or two
        steps = sum(-(-n // dot_keys) for n in seq_lens)
        assert seen[12]["dots"] == seen[192]["dots"] == steps
        assert seen[12]["loaded"] == seen[192]["loaded"]

    def test_interpreted_upstream_torch_top_k_selects_nothing_past_seq_len(monkeypatch):
        """Upstream's torch top-k masks positions >= seq_len to select, then gathers the unmasked
        scores. Rows with fewer than 512 finite scores (holes in their page tables inside
        seq_len) and an output buffer holding an earlier call's scores (torch.empty stands in
        for the caching allocator handing a used block back; the CPU's may hand back zeros):
        no selection may land past seq_len."""
        from sglang.srt.layers.attention.dsv4.indexer import topk_transform_pytorch_vectorized

        seq_lens = [700, 900, 530]
        case = make_case(seq_lens, heads=16, table_cols=40, seed=5)
        table = case["page_table"]
        table[0, 1:7] = -1  # 316 finite scores of 700
        table[1, 2:10] = -1  # 388 of 900
        table[2, 0:2] = -1  # 402 of 530
        empty = torch.empty

        def used_block(*shape, **kwargs):
            return empty(*shape, **kwargs).fill_(3.0)  # an earlier step's finite scores

        monkeypatch.setattr(torch, "empty", used_block)
        logits = bf16_paged_mqa_logits_triton(**case)
        monkeypatch.setattr(torch, "empty", empty)
        assert_matches(logits, reference_logits(case), case["seq_lens"])
        batch = len(seq_lens)
        pages = torch.full((batch, 512), -7, dtype=torch.int32)
        raw = torch.full((batch, 512), -7, dtype=torch.int32)
        topk_transform_pytorch_vectorized(logits, case["seq_lens"], table, pages, PAGE, raw)
        for row, n in enumerate(seq_lens):
            chosen = raw[row][raw[row] >= 0]
            finite = int(torch.isfinite(reference_logits(case)[row, :n]).sum())
            assert (chosen < n).all(), f"row {row}: {int((chosen >= n).sum())} selections past {n}"
            assert len(chosen) == finite  # every finite score, nothing else
            assert ((pages[row] >= 0) == (raw[row] >= 0)).all()

    def test_interpreted_top_k_agrees():
        # Plain torch.topk here: the child runs without sglang (see its command line); the parent
        # checks the torch path through upstream's own top-k step. Positions past seq_len are
        # unspecified, so each row's top-k looks at its first seq_len scores, as upstream's does.
        case = make_case([1000, 700, 40, 513], heads=64, outliers=True, seed=3)
        reference = reference_logits(case)
        inside = torch.arange(reference.shape[1]).unsqueeze(0) < case["seq_lens"].view(-1, 1)

        def top(logits):
            return torch.where(inside, logits.double(), float("-inf")).topk(64, dim=1).indices

        triton_out = bf16_paged_mqa_logits_triton(**case)
        assert_same_selection(top(triton_out), top(reference), reference, 64)
        assert_same_selection(top(triton_out), top(bf16_paged_mqa_logits_torch(**case)), reference, 64)
        # rows shorter than k: the -inf tail is never ranked above a key
        assert set(top(triton_out)[2, :40].tolist()) == set(range(40))

    def rope_table(positions=5000, pairs=32, seed=0):
        angles = torch.rand(positions, pairs, generator=torch.Generator().manual_seed(seed)) * 6
        return torch.polar(torch.ones_like(angles), angles)

    def assert_bf16_close(actual, expected):
        """Equal, but for values one bf16 step apart (fp32 sums in another order)."""
        assert actual.dtype == expected.dtype == torch.bfloat16 and actual.shape == expected.shape
        differ = actual != expected
        assert differ.float().mean() < 0.01
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=1e-6)

    @pytest.mark.parametrize("heads", [64, 20])
    def test_interpreted_fused_query_matches_the_reference(heads):
        from sgl_kernel_dsv4.index_rotation import index_query_bf16_torch
        from sgl_kernel_dsv4.index_rotation_triton import index_query_bf16_triton

        gen = torch.Generator().manual_seed(1)
        q = (torch.randn(6, heads, 128, generator=gen) * 4).to(torch.bfloat16)
        positions = torch.tensor([0, 7, 4999, 3, 150, 2048])
        freqs = rope_table()
        expected = index_query_bf16_torch(q, freqs, positions)
        assert_bf16_close(index_query_bf16_triton(q, freqs, positions), expected)
        # a strided view, as the projection's output is viewed
        wide = torch.zeros(6, heads, 256, dtype=torch.bfloat16)
        wide[..., :128] = q
        assert_bf16_close(index_query_bf16_triton(wide[..., :128], freqs, positions), expected)

    @pytest.mark.parametrize("is_decode", [True, False])
    def test_interpreted_fused_key_store_matches_the_reference(is_decode):
        from sgl_kernel_dsv4.index_rotation import store_index_keys_bf16_torch
        from sgl_kernel_dsv4.index_rotation_triton import store_index_keys_bf16_triton

        gen = torch.Generator().manual_seed(2)
        rows = 21  # more than one program's block, the last one partial
        plan = torch.zeros(rows, 4, dtype=torch.int32)
        if is_decode:
            plan[:, 0] = torch.randint(1, 4000, (rows,), generator=gen)
            plan[::3, 0] = plan[::3, 0] // 4 * 4 + 4  # a third complete a group
            out_loc = torch.randperm(500, generator=gen)[:rows] + 1
        else:
            plan[:, 0] = (torch.arange(rows) + 1) * 4
            plan[:, 1] = torch.randperm(40, generator=gen)[:rows]
            plan[[2, 9, 20]] = torch.tensor([-1, 0, -1, -1], dtype=torch.int32)  # invalid rows
            out_loc = torch.randperm(500, generator=gen)[:40] + 1
        kv = torch.randn(rows, 128, generator=gen) * 3
        weight = torch.rand(128, generator=gen) + 0.5
        pools = [torch.full((600, 128), 7.0, dtype=torch.bfloat16) for _ in range(2)]
        args = (kv, weight, 1e-6, rope_table(), plan, out_loc, 4, is_decode)
        store_index_keys_bf16_triton(pools[0], *args)
        store_index_keys_bf16_torch(pools[1], *args)
        assert (pools[0][0] == 7.0).all()  # slot 0 is never written
        written = (pools[1] != 7.0).any(1)
        assert torch.equal((pools[0] != 7.0).any(1), written) and written.sum() >= 7
        assert_bf16_close(pools[0], pools[1])

else:

    def test_triton_kernel_under_interpreter():
        proc = warm_python.run(
            # --noconftest: the interpreted cases need neither sglang nor its plugins
            ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "--noconftest", __file__, "-k",
             "interpreted"],
            env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600, cwd=REPO,
        )
        tail = proc.stdout[-4000:] + proc.stderr[-2000:]
        assert proc.returncode == 0, tail
        # every interpreted case ran: one per CASES entry, 10 launch configs, two work counts,
        # the top-k check, upstream's torch top-k, two fused-query and two fused-store cases
        assert f"{len(CASES) + 18} passed" in proc.stdout and "failed" not in proc.stdout, tail


# --- on a GPU ----------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_triton_matches_torch(name):
    case = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in case_named(name).items()}
    expected = bf16_paged_mqa_logits_torch(**case).double().cpu()
    assert_matches(bf16_paged_mqa_logits(**case).cpu(), expected, case["seq_lens"].cpu())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", [bf16_paged_mqa_logits_torch, bf16_paged_mqa_logits_triton])
def test_gpu_kernels_replay_in_a_cuda_graph(kernel):
    case = {k: (v.cuda() if isinstance(v, torch.Tensor) else v)
            for k, v in make_case([900, 64, 1, 300], heads=64).items()}
    kernel(**case)  # compile / warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernel(**case)
    case["seq_lens"].copy_(torch.tensor([5, 640, 0, 299], dtype=torch.int32))
    case["q"].normal_()
    graph.replay()
    inside = torch.arange(captured.shape[1], device="cuda").unsqueeze(0) < case["seq_lens"].unsqueeze(1)
    torch.testing.assert_close(captured[inside], kernel(**case)[inside], rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@needs_cuda
def test_gpu_fused_rotations_match_their_references():
    from sgl_kernel_dsv4.index_rotation import index_query_bf16_torch, store_index_keys_bf16_torch
    from sgl_kernel_dsv4.index_rotation_triton import (
        index_query_bf16_triton,
        store_index_keys_bf16_triton,
    )

    gen = torch.Generator(device="cuda").manual_seed(0)
    angles = torch.rand(5000, 32, device="cuda", generator=gen) * 6
    freqs = torch.polar(torch.ones_like(angles), angles)
    q = torch.randn(33, 64, 128, device="cuda", generator=gen).to(torch.bfloat16)
    positions = torch.randint(0, 5000, (33,), device="cuda", generator=gen)
    torch.testing.assert_close(index_query_bf16_triton(q, freqs, positions).float(),
                               index_query_bf16_torch(q, freqs, positions).float(), rtol=2**-7, atol=1e-6)
    plan = torch.zeros(33, 4, dtype=torch.int32, device="cuda")
    plan[:, 0] = torch.randint(1, 4000, (33,), device="cuda", generator=gen)
    out_loc = torch.randperm(400, device="cuda", generator=gen)[:33] + 1
    kv = torch.randn(33, 128, device="cuda", generator=gen)
    weight = torch.rand(128, device="cuda", generator=gen) + 0.5
    pools = [torch.full((401, 128), 7.0, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    args = (kv, weight, 1e-6, freqs, plan, out_loc, 4, True)
    store_index_keys_bf16_triton(pools[0], *args)
    store_index_keys_bf16_torch(pools[1], *args)
    torch.testing.assert_close(pools[0].float(), pools[1].float(), rtol=2**-7, atol=1e-6)
