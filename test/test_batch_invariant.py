"""The CPU backend's batch-invariant mode (`--enable-deterministic-inference` on `--device cpu`).

The premise is measured here, not assumed: on this CPU an fp32 GEMM row changes with the call's
row count (so a test that compares the mode's GEMM with plain torch is one that can fail). The
launcher check runs upstream's own argument resolution on the tiny DeepSeek-V4 in a process of
its own (the choice lists it extends are process-wide).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from sglang_dsv4.cpu_backend import batch_invariant, sparse_attention
from support.v4_pages import v4_cache

torch.set_num_threads(1)  # the backend's default: one intra-op thread


@pytest.fixture()
def mode():
    """The mode on (upstream's switch as this backend replaces it), off again afterwards."""
    from sglang.srt.batch_invariant_ops import batch_invariant_ops

    batch_invariant.enable_batch_invariant_mode()
    yield
    batch_invariant._library._destroy()
    batch_invariant._library = None
    batch_invariant_ops._batch_invariant_MODE = False


def test_plain_fp32_gemm_rows_depend_on_the_row_count():
    a, w = torch.randn(64, 256), torch.randn(512, 256)
    alone = torch.nn.functional.linear(a[:1], w)[0]
    assert any(not torch.equal(torch.nn.functional.linear(a[:m], w)[0], alone)
               for m in (2, 4, 17, 64))


def test_plain_fp32_gemm_with_few_columns_depends_on_the_rows_place_and_the_column_count():
    """Below 12 output columns (a hyper-connection or routing head) an fp32 product's row changes
    with its place in the call at a fixed row count, and its columns with the column count."""
    block, b, x = torch.randn(16, 256), torch.randn(256, 24), torch.randn(256)
    rows = []
    for place in range(16):
        placed = block.clone()
        placed[place] = x
        rows.append(torch.mm(placed, b[:, :7].contiguous())[place])
    assert any(not torch.equal(row, rows[0]) for row in rows)
    assert not torch.equal(torch.mm(block, b[:, :7].contiguous()), torch.mm(block, b)[:, :7])


@pytest.mark.parametrize("columns", [4, 7, 11, 24])
def test_in_the_mode_a_narrow_products_row_is_the_same_in_every_place(mode, columns):
    a, b = torch.randn(40, 256), torch.randn(256, 24)
    narrow = b[:, :columns].contiguous()
    alone = torch.mm(a[9:10], narrow)[0]
    for start, stop in ((0, 40), (1, 17), (8, 12), (9, 10), (2, 30)):
        assert torch.equal(torch.mm(a[start:stop], narrow)[9 - start], alone), (start, stop)
        assert torch.equal(torch.nn.functional.linear(a[start:stop], narrow.T)[9 - start],
                           alone), (start, stop)
    assert torch.equal(torch.mm(a, narrow), torch.mm(a, b)[:, :columns])
    torch.testing.assert_close(torch.mm(a, narrow), (a.double() @ narrow.double()).float(),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_the_mode_a_rows_product_is_the_same_whatever_is_batched_with_it(mode, dtype):
    a, w, bias = torch.randn(300, 256, dtype=dtype), torch.randn(96, 256, dtype=dtype), \
        torch.randn(96, dtype=dtype)
    alone = torch.nn.functional.linear(a[5:6], w, bias)[0]
    for start, stop in ((0, 17), (3, 300), (5, 6), (5, 21)):
        rows = torch.nn.functional.linear(a[start:stop], w, bias)
        assert torch.equal(rows[5 - start], alone), (start, stop)
    x, y = torch.randn(4, 50, 64, dtype=dtype), torch.randn(4, 64, 40, dtype=dtype)
    assert torch.equal(torch.bmm(x[:, 7:8], y)[:, 0], torch.bmm(x, y)[:, 7])
    # the same numbers as torch's product, within rounding
    torch.testing.assert_close(torch.nn.functional.linear(a, w, bias),
                               (a.double() @ w.double().T + bias.double()).to(dtype),
                               rtol=2e-2, atol=2e-2)


def test_the_rms_norm_branch_is_row_invariant_and_an_rms_norm():
    x, weight = torch.randn(40, 128, dtype=torch.bfloat16), torch.randn(128)
    out = batch_invariant.rms_norm_batch_invariant(x, weight, 1e-6)
    assert torch.equal(batch_invariant.rms_norm_batch_invariant(x[3:4], weight, 1e-6)[0], out[3])
    reference = x.float() / x.float().pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * weight
    torch.testing.assert_close(out.float(), reference, rtol=1e-2, atol=1e-2)


def _shared_rows_batch(tokens=30, heads=8, dim=576, topk=40, rows=200):
    table = torch.randn(rows, dim)
    q = torch.randn(tokens, heads, dim)
    pos = torch.stack([torch.randperm(rows)[:topk] for _ in range(tokens)])
    pos[:, :20] = torch.arange(20)  # a window every token shares, as in a prefill
    mask = torch.zeros(tokens, topk, dtype=torch.bool)
    mask[:, 35:] = True
    return table, q, pos, mask


def _attend(table, q, pos, mask):
    """sparse_mla's chunk step (`_attend_shared` when the chunk's tokens share most rows)."""
    heads, idle, sink = torch.arange(q.shape[1]), torch.tensor([], dtype=torch.long), None
    used, local = sparse_attention.distinct(pos, table.shape[0])
    if used.numel() * 2 <= local.numel() and not batch_invariant.enabled():
        return sparse_attention._attend_shared(q, table[used], local, mask, heads, idle, sink,
                                               512, 0.1)[0]
    return sparse_attention._attend_gathered(q, table[pos], mask, heads, idle, sink, 512, 0.1)[0]


def test_shared_row_attention_depends_on_the_batch_outside_the_mode():
    table, q, pos, mask = _shared_rows_batch()
    assert not torch.equal(_attend(table, q, pos, mask)[0],
                           _attend(table, q[:1], pos[:1], mask[:1])[0])


def test_in_the_mode_each_token_attends_alone(mode):
    table, q, pos, mask = _shared_rows_batch()
    together = _attend(table, q, pos, mask)
    for t in (0, 7, 29):
        assert torch.equal(_attend(table, q[t:t + 1], pos[t:t + 1], mask[t:t + 1])[0],
                           together[t])


def test_index_scores_in_the_mode_do_not_depend_on_the_batch(mode):
    pages, block, heads, dim = 6, 64, 4, 128
    keys = torch.randn(pages * block, dim)
    query, weight = torch.randn(5, heads, dim), torch.rand(5, heads)
    local = torch.tensor([[0, 1, 2], [0, 1, 3], [0, 4, 5], [2, 3, 4], [5, 0, 1]])
    together = sparse_attention._paged_scores(query, weight, keys, None, local, block,
                                              round_bf16=True, chunk_values=1 << 24)
    for row in range(5):
        alone = sparse_attention._paged_scores(query[row:row + 1], weight[row:row + 1], keys,
                                               None, local[row:row + 1], block,
                                               round_bf16=True, chunk_values=1 << 24)
        assert torch.equal(alone[0], together[row]), row


def test_the_launcher_accepts_the_flag_for_dsv4_on_the_cpu_and_keeps_the_radix_cache(tmp_path):
    """Upstream's own argument resolution, in one process of its own: before the plugins load it
    refuses the flag for dsv4 (the control: this test can fail), after they load (deciding from
    this --device cpu command line, as launch_server's do) it keeps dsv4, the radix cache and
    the pytorch sampler."""
    from sglang_dsv4.tiny_model import write

    model = write(tmp_path / "tiny", seed=0)
    script = textwrap.dedent(f"""
        import sys
        sys.argv = ["launch_server", "--model-path", {str(model)!r}, "--device", "cpu",
                    "--enable-deterministic-inference"]
        from sglang.srt.arg_groups.overrides import resolving_view
        from sglang.srt.plugins import load_plugins
        from sglang.srt.server_args import prepare_server_args

        def resolve():
            args = prepare_server_args(sys.argv[1:])
            args.resolve_once()  # upstream's resolution (run_server's first step)
            return resolving_view(args)

        try:
            resolve()
        except ValueError as refusal:
            print("UPSTREAM", refusal)
        load_plugins()  # as launch_server does, before it parses
        view = resolve()
        print("RESOLVED", view.attention_backend, view.disable_radix_cache,
              view.sampling_backend)
    """)
    # The backend decides from this command line (a parent's recorded decision removed).
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_DSV4_CPU_BACKEND"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "UPSTREAM Currently only" in done.stdout, done.stdout[-2000:]
    assert "but you explicitly specified 'dsv4'" in done.stdout
    assert "RESOLVED dsv4 False pytorch" in done.stdout, done.stdout[-2000:]


def _padded(row: torch.Tensor, width: int) -> torch.Tensor:
    """A row of index scores as the DSA top-k sees it in a batch: -inf past its sequence, up to
    the batch's longest."""
    out = torch.full((1, width), float("-inf"))
    out[0, :row.numel()] = row
    return out


def test_plain_top_k_order_depends_on_the_rows_width():
    row = torch.randn(700)
    alone = torch.topk(_padded(row, 700), 512, dim=1, sorted=False).indices
    wider = [torch.topk(_padded(row, w), 512, dim=1, sorted=False).indices for w in (800, 3000)]
    assert all(torch.equal(w.sort().values, alone.sort().values) for w in wider)  # the same set
    assert any(not torch.equal(w, alone) for w in wider)  # in another order


def test_in_the_mode_top_k_is_a_function_of_the_row_with_ties_to_the_lower_index(mode):
    row = torch.randn(700)
    row[100:110] = row[5]  # ties
    alone = torch.topk(_padded(row, 700), 512, dim=1, sorted=False)
    for width in (701, 800, 1024, 3000):
        wide = torch.topk(_padded(row, width), 512, dim=1, sorted=False)
        assert torch.equal(wide.indices, alone.indices), width
        assert torch.equal(wide.values, alone.values), width
    expected = sorted(range(700), key=lambda i: (-row[i].item(), i))[:512]
    assert alone.indices[0].tolist() == expected
    # largest=False and another dimension take the same rule
    grid = torch.randn(6, 40)
    low = torch.topk(grid, 5, dim=0, largest=False)
    assert torch.equal(low.values, grid.sort(dim=0).values[:5])


def _sparse_mla_alone_and_batched():
    """sparse_mla (the CPU sm_120 path) for a decode token alone, its lists as wide as its own
    sequence, and in a batch whose longest sequence widens every token's compressed-row list
    (a c128 layer's), padded to 64 heads: (alone, the same token in the batch), out and lse."""
    gen = torch.Generator().manual_seed(5)
    window, compressed = v4_cache(6, 64, 384, 1), v4_cache(3, 64, 160, 2)
    tokens, heads, real = 4, 64, 8
    q = torch.zeros(tokens, 1, heads, 576, dtype=torch.bfloat16)
    q[:, :, :real] = torch.randn(tokens, 1, real, 576, generator=gen).bfloat16()
    idx = torch.randint(0, 384, (tokens, 1, 128), generator=gen, dtype=torch.int32)
    lengths = torch.tensor([128, 128, 90, 128], dtype=torch.int32)
    extra = torch.randint(0, 160, (tokens, 1, 150), generator=gen, dtype=torch.int32)
    extra_lengths = torch.tensor([21, 150, 64, 7], dtype=torch.int32)
    sink = torch.randn(heads, generator=gen)
    common = (sink, 512, 0.06)
    alone = sparse_attention.sparse_mla(q[:1], window, idx[:1], lengths[:1], *common,
                                        compressed, extra[:1, :, :21], extra_lengths[:1])
    batched = sparse_attention.sparse_mla(q, window, idx, lengths, *common, compressed, extra,
                                          extra_lengths)
    return (alone[0][0], alone[1][0]), (batched[0][0], batched[1][0])


def test_plain_sparse_mla_depends_on_the_widest_list_in_the_batch():
    (alone, alone_lse), (batched, batched_lse) = _sparse_mla_alone_and_batched()
    assert not (torch.equal(alone, batched) and torch.equal(alone_lse, batched_lse))
    torch.testing.assert_close(alone_lse, batched_lse)  # rounding, not a bug


def test_in_the_mode_sparse_mla_attends_each_token_over_its_own_rows(mode):
    (alone, alone_lse), (batched, batched_lse) = _sparse_mla_alone_and_batched()
    assert torch.equal(alone, batched)
    assert torch.equal(alone_lse, batched_lse)


def test_in_the_mode_sparse_mla_is_upstreams_attention(mode):
    """The mode's path computes what upstream's torch sparse MLA (`_sm120_sparse_decode_fwd`)
    does, within rounding: moving each token's valid rows to the front changes no result."""
    from sglang.kernels.ops.attention.flash_mla_sm120 import _sm120_sparse_decode_fwd

    gen = torch.Generator().manual_seed(6)
    window, compressed = v4_cache(6, 64, 384, 1), v4_cache(3, 64, 160, 2)
    q = torch.zeros(5, 1, 64, 576, dtype=torch.bfloat16)
    q[:, :, :8] = torch.randn(5, 1, 8, 576, generator=gen).bfloat16()
    idx = torch.randint(-1, 384, (5, 1, 128), generator=gen, dtype=torch.int32)
    extra = torch.randint(-1, 160, (5, 1, 150), generator=gen, dtype=torch.int32)
    extra[2] = -1
    args = (q, window, idx, torch.tensor([128, 3, 90, 128, 1], dtype=torch.int32),
            torch.randn(64, generator=gen), 512, 0.06, compressed, extra,
            torch.tensor([21, 150, 0, 7, 150], dtype=torch.int32))
    out, lse = sparse_attention.sparse_mla(*args)
    want_out, want_lse = _sm120_sparse_decode_fwd(*args)
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(lse.isinf(), want_lse.isinf())
    torch.testing.assert_close(lse.nan_to_num(0, 0, 0), want_lse.nan_to_num(0, 0, 0))


# Each op measured to round by the batch size, with a float64 formula for its value.
ELEMENTWISE = {
    "sigmoid": (torch.sigmoid, lambda t: 1 / (1 + torch.exp(-t))),
    "silu": (torch.nn.functional.silu, lambda t: t / (1 + torch.exp(-t))),
    "exp2": (torch.exp2, lambda t: torch.exp(t * 0.6931471805599453)),
    "softplus": (torch.nn.functional.softplus, lambda t: torch.log(1 + torch.exp(t))),
}


def _rows_alone_differ(fn, x) -> int:
    full = fn(x)
    return sum(not torch.equal(fn(x[r:r + 1])[0], full[r]) for r in range(x.shape[0]))


def test_plain_elementwise_ops_round_a_few_column_tensors_by_the_batch_size():
    """A router's scores (a few experts per token): the scalar tail of torch's vector loop rounds
    these ops differently, and a token alone is all tail."""
    x = torch.randn(37, 4, generator=torch.Generator().manual_seed(0))
    assert all(_rows_alone_differ(fn, x) for fn, _ in ELEMENTWISE.values())


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_in_the_mode_elementwise_ops_give_a_token_the_same_bytes_alone(mode, name):
    x = torch.randn(37, 4, generator=torch.Generator().manual_seed(0))
    fn, reference = ELEMENTWISE[name]
    assert _rows_alone_differ(fn, x) == 0
    assert _rows_alone_differ(fn, x.bfloat16()) == 0
    torch.testing.assert_close(fn(x), reference(x.double()).float(), rtol=1e-5, atol=1e-6)
