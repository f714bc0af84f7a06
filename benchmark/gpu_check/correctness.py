"""The kit's correctness stages: inputs as the indexer passes them, an independent fp32
reference, and the comparisons.

- correctness: the Triton logits kernel and the torch path against the reference at decode and
  prefill shapes (rows with seq_len 0, CUDA-graph padding, among them), the -inf tail past each
  row's seq_len, and the fused query rotation and key store (decode and prefill plans) against
  their torch references;
- cuda_graphs: the logits call and the rotations captured at the decode batch sizes, replayed on
  new inputs, bit-equal to eager and different from the replay on the old inputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from benchmark.gpu_check.harness import HEAD_DIM, PAGE, TOPK, Stage, cdiv, release

MAX_REL_ERR = 1e-4  # fp32 accumulation of exact bf16 products: only the summation order differs
ROPE_POSITIONS = 4096

# --- inputs ----------------------------------------------------------------------------------


def build_case(kit, lengths, width, *, rows_share_pages=False, hole=True, seed=0):
    """Decode / prefill inputs as the indexer passes them.

    Keys live in one pool of bf16 pages (a uint8 buffer viewed as bf16, like the pool's); every
    row's pages come in shuffled order; the page table is wider than any row needs (-1 past each
    row's pages) and, with `hole`, one row has a -1 inside its pages. `rows_share_pages`: every
    row reads the same pages (the rows of one prefill request)."""
    torch = kit.torch
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    needed = [cdiv(n, PAGE) for n in lengths]
    cols = cdiv(width, PAGE) + 2
    distinct = [max(needed)] if rows_share_pages else needed
    num_pages = sum(distinct) + 3
    order = torch.randperm(num_pages, generator=gen).to(torch.int32)
    table = torch.full((batch, cols), -1, dtype=torch.int32)
    taken = 0
    for row, count in enumerate(needed):
        if rows_share_pages:
            table[row, :count] = order[:count]
        else:
            table[row, :count] = order[taken : taken + count]
            taken += count
    if hole:
        row = max(range(batch), key=lambda r: needed[r]) if batch > 1 else 0
        if needed[row] > 2:
            table[row, 1] = -1
    device_gen = torch.Generator(device=kit.device).manual_seed(seed + 1)
    pool = torch.empty(num_pages, PAGE * HEAD_DIM * 2, dtype=torch.uint8, device=kit.device)
    pool.view(torch.bfloat16).normal_(generator=device_gen)
    q = torch.randn(batch, 1, kit.sizes.heads, HEAD_DIM, generator=device_gen, device=kit.device)
    weights = torch.randn(batch, kit.sizes.heads, generator=device_gen, device=kit.device)
    return (
        q.to(torch.bfloat16),
        pool.view(torch.bfloat16).view(num_pages, PAGE, 1, HEAD_DIM),
        weights * (HEAD_DIM * kit.sizes.heads) ** -0.5,
        torch.tensor(lengths, dtype=torch.int32).to(kit.device),
        table.to(kit.device),
        width,
    )


def decode_lengths(batch: int, keys: int) -> list:
    """Rows of a decode batch: near the full context, none a multiple of a page, and every
    fourth row much shorter (its table ends in -1 entries long before the others')."""
    lengths = []
    for row in range(batch):
        n = keys - 13 - (row * 61) % 200 if row % 4 != 3 else keys // 3 + 7
        lengths.append(max(1, n - (n % PAGE == 0)))
    return lengths


def padded_lengths(batch: int, keys: int) -> list:
    """A decode batch padded to a CUDA-graph size: its last quarter of rows has seq_len 0."""
    lengths = decode_lengths(batch, keys)
    padding = max(1, batch // 4)
    return lengths[: batch - padding] + [0] * padding


def prefill_lengths(rows: int, context: int) -> list:
    """One request's prefill chunk at compress ratio 4: a new key every 4 query tokens."""
    return [context + (t + 1) // 4 for t in range(rows)]


# --- references and comparisons ---------------------------------------------------------------


def reference_logits(kit, args):
    """fp32, written independently of the kernels: row by row, the row's keys gathered densely
    through its page table, scores by one matmul, the head sum by another (TF32 off)."""
    torch = kit.torch
    q, kv, weights, seq_lens, table, width = args
    out = torch.full((q.shape[0], width), float("-inf"), dtype=torch.float32, device=q.device)
    keys_by_page = kv[:, :, 0, :]
    lengths = seq_lens.view(-1).tolist()
    for row, n in enumerate(lengths):
        n = min(n, width, table.shape[1] * PAGE)
        if n <= 0:
            continue
        pages = table[row, : cdiv(n, PAGE)].long()
        keys = keys_by_page[pages.clamp(min=0)].reshape(-1, HEAD_DIM)[:n].float()
        scores = torch.relu(keys @ q[row, 0].float().t())
        logits = scores @ weights[row].float()
        present = (pages >= 0).repeat_interleave(PAGE)[:n]
        out[row, :n] = torch.where(present, logits, torch.full_like(logits, float("-inf")))
    return out


def within_lengths(kit, logits, seq_lens):
    """Positions at or past a row's length are -inf in the result: the contract covers only
    t < seq_len there (the top-k step reads no further), so a kernel may leave them unwritten."""
    torch = kit.torch
    positions = torch.arange(logits.shape[1], device=logits.device)
    inside = positions.unsqueeze(0) < seq_lens.view(-1, 1)
    return torch.where(inside, logits, torch.full_like(logits, float("-inf")))


def tail_is_neg_inf(kit, logits, seq_lens) -> bool:
    """Every position at or past a row's seq_len is -inf (the contract upstream's torch top-k
    relies on: it gathers the unmasked scores)."""
    torch = kit.torch
    positions = torch.arange(logits.shape[1], device=logits.device)
    past = positions.unsqueeze(0) >= seq_lens.view(-1, 1)
    return bool(torch.isneginf(logits[past]).all())


def compare(kit, got, ref, seq_lens) -> dict:
    """Max relative error (max |got - ref| over max |ref|, finite reference positions), the same
    -inf positions, and top-512 agreement per row (share of the reference's top 512 the result
    also picks; a miss counts only if the reference does not tie it with the 512th key)."""
    torch = kit.torch
    got = within_lengths(kit, got.float(), seq_lens)
    ref = within_lengths(kit, ref.float(), seq_lens)
    same_inf = bool(torch.equal(torch.isneginf(got), torch.isneginf(ref)))
    finite = torch.isfinite(ref)
    if not bool(finite.any()):
        return {
            "max_rel_err": 0.0,
            "top512": 1.0,
            "strict_misses": 0,
            "same_inf": same_inf,
            "ok": same_inf,
        }
    scale = ref[finite].abs().max().clamp(min=1e-30)
    diff = (got[finite] - ref[finite]).abs()
    abs_err = diff.max() if bool(torch.isfinite(diff).all()) else torch.tensor(float("inf"))
    rel_err = float(abs_err / scale)
    k = min(TOPK, ref.shape[1])
    ref_top = ref.topk(k, dim=1)
    picked = torch.zeros_like(got, dtype=torch.bool).scatter_(1, got.topk(k, dim=1).indices, True)
    counted = torch.arange(k, device=ref.device).unsqueeze(0) < finite.sum(1, keepdim=True).clamp(
        max=k
    )
    hits = picked.gather(1, ref_top.indices) & counted
    kth_index = (counted.sum(1, keepdim=True) - 1).clamp(min=0)
    kth = ref_top.values.gather(1, kth_index)
    tie = 2 * float(abs_err) + 1e-6 * float(scale)
    strict = counted & ~hits & (ref_top.values - kth > tie)
    agreement = float(hits.sum()) / max(1, int(counted.sum()))
    strict_misses = int(strict.sum())
    ok = same_inf and rel_err <= MAX_REL_ERR and strict_misses == 0
    return {
        "max_rel_err": rel_err,
        "top512": agreement,
        "strict_misses": strict_misses,
        "same_inf": same_inf,
        "ok": ok,
    }


# --- the correctness stage -------------------------------------------------------------------


def stage_correctness(kit, rec):
    sizes = kit.sizes
    cases = [
        (f"decode B={b} keys={k}", decode_lengths(b, k), k)
        for k in sizes.decode_keys
        for b in sizes.decode_batches
    ]
    widest = max(sizes.decode_batches)
    cases += [
        (f"decode B={widest} keys={k} padded (seq_len 0 rows)", padded_lengths(widest, k), k)
        for k in sizes.decode_keys
    ]
    prefill = [prefill_lengths(rows, context) for rows, context in sizes.prefill]
    prefill_width = max(max(p) for p in prefill)
    rec["planned"] = len(cases) + len(prefill)
    for name, lengths, width in cases:
        args = build_case(kit, lengths, width, seed=len(rec["cases"]))
        rec["cases"].append(check_case(kit, name, args, chunk_rows=None))
        del args
        release(kit)
    for index, lengths in enumerate(prefill):
        args = build_case(kit, lengths, prefill_width, rows_share_pages=True, seed=100 + index)
        name = f"prefill rows={len(lengths)} keys={lengths[0]}..{lengths[-1]}"
        rec["cases"].append(check_case(kit, name, args, chunk_rows=sizes.prefill_chunk_rows))
        del args
        release(kit)
    rec["rotation_cases"] = rotation_correctness_cases(kit)
    rec["ok"] = (
        all(c["ok"] for c in rec["cases"] + rec["rotation_cases"])
        and len(rec["cases"]) == rec["planned"]
    )


def check_case(kit, name, args, chunk_rows):
    """Triton and the torch path against the fp32 reference (and each other), and -inf past
    each row's seq_len. With chunk_rows, the Triton kernel is called in row chunks, as the
    prefill indexer calls it, and the chunks together must equal one whole call bit for bit."""
    torch = kit.torch
    started = time.perf_counter()
    seq_lens = args[3]
    if chunk_rows:
        parts = []
        for start in range(0, args[0].shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            parts.append(
                kit.kernels.triton(
                    args[0][rows], args[1], args[2][rows], seq_lens[rows], args[4][rows], args[5]
                )
            )
        triton_out = torch.cat(parts)
    else:
        triton_out = kit.kernels.triton(*args)
    torch_out = kit.kernels.torch_path(*args)
    ref = reference_logits(kit, args)
    vs_ref = compare(kit, triton_out, ref, seq_lens)
    torch_vs_ref = compare(kit, torch_out, ref, seq_lens)
    vs_torch = compare(kit, triton_out, torch_out, seq_lens)
    tail = tail_is_neg_inf(kit, triton_out, seq_lens) and tail_is_neg_inf(kit, torch_out, seq_lens)
    case = {
        "case": name,
        "rows": int(args[0].shape[0]),
        "keys": int(args[5]),
        "triton_rel_err": vs_ref["max_rel_err"],
        "torch_rel_err": torch_vs_ref["max_rel_err"],
        "triton_vs_torch_rel_err": vs_torch["max_rel_err"],
        "triton_top512": vs_ref["top512"],
        "torch_top512": torch_vs_ref["top512"],
        "triton_strict_misses": vs_ref["strict_misses"],
        "same_inf": vs_ref["same_inf"] and torch_vs_ref["same_inf"],
        "tail_neg_inf": tail,
        "ok": vs_ref["ok"] and torch_vs_ref["ok"] and vs_torch["ok"] and tail,
    }
    if chunk_rows:
        whole = kit.kernels.triton(*args)
        same = torch.equal(whole, triton_out)
        case["chunk_rows"] = chunk_rows
        case["chunks_equal_whole"] = bool(same)
        case["ok"] = case["ok"] and bool(same)
    case["seconds"] = round(time.perf_counter() - started, 2)
    kit.progress(
        f"  {name}: {'ok' if case['ok'] else 'FAILED'} "
        f"(rel err {case['triton_rel_err']:.1e}, top-512 {case['triton_top512']:.4f})"
    )
    return case


# --- the fused rotations ---------------------------------------------------------------------


def rotation_inputs(kit, tokens, heads, seed):
    torch = kit.torch
    gen = torch.Generator(device=kit.device).manual_seed(seed)
    x = torch.randn(tokens, heads, HEAD_DIM, generator=gen, device=kit.device).to(torch.bfloat16)
    angles = torch.rand(tokens, 32, generator=gen, device=kit.device) * 6.28
    freqs = torch.polar(torch.ones_like(angles), angles)
    return x, freqs


def torch_rotations(kit):
    """The bf16 path's query and key rotations as the torch reference runs them."""
    rot = kit.kernels.rotation

    def query(x, freqs):
        return rot.hadamard_rotate(rot.apply_rope_tail(x, freqs)).to(kit.torch.bfloat16)

    def key(x, freqs):
        return rot.hadamard_rotate(rot.apply_rope_tail(x[:, 0], freqs)).to(kit.torch.bfloat16)

    return {"query rotation (torch)": query, "key rotation (torch)": key}


@dataclass(frozen=True)
class FusedRotation:
    """A fused Triton rotation and its torch reference, with how to build inputs and run it."""

    fused: object
    reference: object
    inputs: object  # (kit, rows, seed) -> argument list; the first one receives a store
    returns_output: bool  # False: the function stores into its first argument

    def run(self, fn, args):
        out = fn(*args)
        return out if self.returns_output else args[0]


def query_rotation_inputs(kit, tokens, seed):
    """The indexer query: q [T, H, 128] bf16, the RoPE table, each token's position."""
    torch = kit.torch
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, kit.sizes.heads, HEAD_DIM, generator=gen).to(torch.bfloat16)
    angles = torch.rand(ROPE_POSITIONS, 32, generator=gen) * 6.28
    freqs = torch.polar(torch.ones_like(angles), angles)
    positions = torch.randint(0, ROPE_POSITIONS, (tokens,), generator=gen)
    return [t.to(kit.device) for t in (q, freqs, positions)]


def key_store_inputs(kit, rows, seed, is_decode=True):
    """A step's key write: compressed rows kv [N, 128] and upstream's compress plan. Decode: one
    row per request, rows whose seq_len is not a multiple of 4 complete no key and must not be
    written. Prefill: the plan's second column holds each row's ragged token id (its out_loc
    index, low 16 bits) and invalid rows (seq_len 0xffffffff) must not be written."""
    torch = kit.torch
    gen = torch.Generator().manual_seed(seed)
    tokens = rows if is_decode else 4 * rows
    slots = 4 * tokens + 16
    pool = torch.randn(slots, HEAD_DIM, generator=gen).to(torch.bfloat16)
    kv = torch.randn(rows, HEAD_DIM, generator=gen) * 3
    norm_weight = torch.rand(HEAD_DIM, generator=gen) + 0.5
    angles = torch.rand(ROPE_POSITIONS, 32, generator=gen) * 6.28
    freqs = torch.polar(torch.ones_like(angles), angles)
    plan = torch.zeros(rows, 4, dtype=torch.int32)
    plan[:, 0] = torch.randint(4, ROPE_POSITIONS, (rows,), generator=gen, dtype=torch.int32)
    if is_decode:
        plan[::3, 0] = plan[::3, 0] // 4 * 4
        plan[1::3, 0] = plan[1::3, 0] // 4 * 4 + 1  # every third row completes no key this step
    else:
        plan[:, 0] = plan[:, 0] // 4 * 4
        plan[:, 1] = torch.randperm(tokens, generator=gen)[:rows].to(torch.int32)
        plan[1::3, 0] = -1  # invalid rows: nothing to write
    out_loc = torch.randperm(slots, generator=gen)[:tokens]
    tensors = [t.to(kit.device) for t in (pool, kv, norm_weight)]
    return [
        *tensors,
        1e-6,
        freqs.to(kit.device),
        plan.to(kit.device),
        out_loc.to(kit.device),
        4,
        is_decode,
    ]


def prefill_key_store_inputs(kit, rows, seed):
    return key_store_inputs(kit, rows, seed, is_decode=False)


def rotation_kernels(kit) -> dict:
    """The fused Triton rotations and their torch references: {label: FusedRotation}."""
    fused, reference = kit.kernels.rotation_triton, kit.kernels.rotation
    return {
        "query rotation": FusedRotation(
            fused.index_query_bf16_triton, reference.index_query_bf16_torch,
            query_rotation_inputs, True,
        ),
        "key write (decode)": FusedRotation(
            fused.store_index_keys_bf16_triton, reference.store_index_keys_bf16_torch,
            key_store_inputs, False,
        ),
        "key write (prefill)": FusedRotation(
            fused.store_index_keys_bf16_triton, reference.store_index_keys_bf16_torch,
            prefill_key_store_inputs, False,
        ),
    }


def clone_args(args):
    return [a.clone() if hasattr(a, "clone") else a for a in args]


def rotation_correctness_cases(kit) -> list:
    """Each fused rotation against its torch reference: bf16 results within one rounding of
    each other (both compute in fp32 and round once: at most one bf16 ulp apart, beside fp32
    noise), the share of bit-equal values reported."""
    torch = kit.torch
    cases = []
    for label, op in rotation_kernels(kit).items():
        for rows in kit.sizes.rotation_rows:
            args = op.inputs(kit, rows, seed=700 + rows)
            fused = op.run(op.fused, clone_args(args)).float()
            ref = op.run(op.reference, clone_args(args)).float()
            # one bf16 ulp of the value, plus the rotation's own noise, 2^-14 of the row's largest
            # value (fp32 sums in another order, or a fused kernel's fp32 operand split into two
            # bf16 parts: about 2^-17 of |x|): values that nearly cancel may round either way
            # at a bf16 scale of their own. A wrong rotation is off by far more.
            row_scale = ref.abs().amax(dim=-1, keepdim=True)
            ulp = (ref.abs() * 2.0**-7 + row_scale * 2.0**-14).clamp(min=2.0**-126)
            worst = float(((fused - ref).abs() / ulp).max())
            cases.append(
                {
                    "case": f"{label} rows={rows}",
                    "max_err_in_bf16_ulps": worst,
                    "bit_equal_share": float((fused == ref).float().mean()),
                    "ok": worst <= 1.0 and bool(torch.isfinite(fused).all()),
                }
            )
            kit.progress(f"  {label} rows={rows}: {'ok' if cases[-1]['ok'] else 'FAILED'}")
    return cases


# --- the CUDA graph stage --------------------------------------------------------------------


def mutate_decode_inputs(kit, args, seed):
    """New lengths (the last row 0, as CUDA-graph padding), a reshuffled page table (other -1
    places) and new queries and weights, in the captured tensors' own storage."""
    torch = kit.torch
    q, kv, weights, seq_lens, table, width = args
    gen = torch.Generator().manual_seed(seed)
    batch = q.shape[0]
    num_pages = kv.shape[0]
    lengths = torch.randint(1, width + 1, (batch,), generator=gen, dtype=torch.int32)
    if batch > 1:
        lengths[-1] = 0
    new_table = torch.full(tuple(table.shape), -1, dtype=torch.int32)
    for row in range(batch):
        count = cdiv(int(lengths[row]), PAGE)
        new_table[row, :count] = torch.randperm(num_pages, generator=gen)[:count].to(torch.int32)
        if count > 3:
            new_table[row, count // 2] = -1
    seq_lens.copy_(lengths.to(seq_lens.device))
    table.copy_(new_table.to(table.device))
    q.copy_(torch.randn(tuple(q.shape), generator=gen).to(q.dtype).to(q.device))
    weights.copy_(torch.randn(tuple(weights.shape), generator=gen).to(weights.device))


def capture(kit, fn, args):
    """Capture fn(*args) in a CUDA graph: (replay, the graph's output tensor)."""
    torch = kit.torch
    fn(*args)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn(*args)

    def replay():
        graph.replay()
        torch.cuda.synchronize()

    return replay, output


def stage_cuda_graphs(kit, rec):
    width = kit.sizes.graph_keys
    kernels = (("triton", kit.kernels.triton), ("torch path", kit.kernels.torch_path))
    for batch in kit.sizes.decode_batches:
        for name, fn in kernels:
            args = build_case(kit, decode_lengths(batch, width), width, seed=200 + batch)
            replay, captured = capture(kit, fn, args)
            replay()
            before = captured.clone()
            mutate_decode_inputs(kit, args, seed=batch)
            replay()
            eager = fn(*args)
            same = kit.torch.equal(captured, eager)
            changed = not kit.torch.equal(before, captured)
            rec["cases"].append(
                {
                    "case": f"logits {name} B={batch} keys={width}",
                    "bit_equal": bool(same),
                    "replay_saw_new_inputs": changed,
                    "ok": bool(same) and changed,
                }
            )
            del replay, captured, eager, before, args
            release(kit)
    rec["cases"].extend(graph_rotation_cases(kit))
    rec["ok"] = all(c["ok"] for c in rec["cases"])


def graph_fused_rotation_cases(kit) -> list:
    """Each fused rotation captured at the decode batch sizes: replayed on its capture inputs,
    then on new inputs (a store: into a fresh pool), the second replay bit-equal to an eager
    call on copies of the new inputs and different from the first replay."""
    torch = kit.torch
    cases = []
    for label, op in rotation_kernels(kit).items():
        for batch in kit.sizes.decode_batches:
            args = op.inputs(kit, batch, seed=800 + batch)

            def fn(*a, op=op):
                return op.run(op.fused, a)

            replay, captured = capture(kit, fn, args)
            replay()
            before = captured.clone()  # what the graph gives for its capture inputs
            for old, new in zip(args, op.inputs(kit, batch, seed=900 + batch), strict=True):
                if hasattr(old, "copy_"):
                    old.copy_(new)
            eager = fn(*clone_args(args))
            replay()
            same = torch.equal(captured, eager)
            changed = not torch.equal(before, captured)
            cases.append(
                {
                    "case": f"{label} (fused) B={batch}",
                    "bit_equal": bool(same),
                    "replay_saw_new_inputs": changed,
                    "ok": bool(same) and changed,
                }
            )
    return cases


def graph_rotation_cases(kit):
    cases = []
    for batch in kit.sizes.decode_batches:
        for name, fn in torch_rotations(kit).items():
            x, freqs = rotation_inputs(kit, batch, kit.sizes.heads, seed=300 + batch)
            replay, captured = capture(kit, fn, (x, freqs))
            replay()
            before = captured.clone()
            new_x, new_freqs = rotation_inputs(kit, batch, kit.sizes.heads, seed=400 + batch)
            x.copy_(new_x)
            freqs.copy_(new_freqs)
            replay()
            same = kit.torch.equal(captured, fn(x, freqs))
            changed = not kit.torch.equal(before, captured)
            cases.append(
                {
                    "case": f"{name} B={batch}",
                    "bit_equal": bool(same),
                    "replay_saw_new_inputs": changed,
                    "ok": bool(same) and changed,
                }
            )
    cases.extend(graph_fused_rotation_cases(kit))
    return cases


STAGES = (
    Stage(
        "correctness",
        120,
        "Triton vs torch vs fp32 reference, decode (padded too) + prefill, -inf tail, rotations",
        stage_correctness,
        proves_correctness=True,
    ),
    Stage(
        "cuda_graphs",
        40,
        "capture at decode batch sizes, replay == eager bit for bit",
        stage_cuda_graphs,
        needs_cuda=True,
        proves_correctness=True,
    ),
)
