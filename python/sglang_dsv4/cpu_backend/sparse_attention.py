"""Torch versions of DeepSeek-V4's sparse attention reads for `--device cpu`: the sm_120 sparse
MLA over V4 pages and the c4 indexer's paged logits (fp8 and bf16).

Split from `ops` (the byte layouts and the other ops they read through): these read many cache
rows per query, so each is written to read every distinct page or row once, in strided copies,
and chunked to bound its temporaries. Each function names the upstream function it stands for.
"""

from __future__ import annotations

import torch

from sglang_dsv4.cpu_backend import batch_invariant
from sglang_dsv4.cpu_backend.ops import (
    V4_DATA_BYTES,
    V4_NOPE,
    V4_SCALE_BYTES,
    V4_TILE,
    _unsupported,
)

# --- flash_mla_sm120.py: sparse MLA over V4 pages ------------------------------------------------


def v4_rows(k_cache: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """The V4 FlashMLA rows at flat `slots` (page * page_size + offset) of a paged cache,
    dequantized as the sm_120 torch path reads them: 448 e4m3 values times their UE8M0 tile
    scale rounded to bf16, then the 64 bf16 rope dims. fp32 [n, 512].

    Each row is one strided copy of its 576 data bytes and 8 scale bytes (the page layout of
    `store_v4_rows`), not a byte-wise gather."""
    page_bytes = k_cache.stride(0)
    pages = k_cache.shape[0]
    base = k_cache.storage_offset()
    flat = k_cache.view(torch.uint8) if k_cache.dtype != torch.uint8 else k_cache
    data = flat.as_strided((pages, page_size, V4_DATA_BYTES), (page_bytes, V4_DATA_BYTES, 1),
                           base)
    scales = flat.as_strided((pages, page_size, V4_SCALE_BYTES), (page_bytes, V4_SCALE_BYTES, 1),
                             base + V4_DATA_BYTES * page_size)
    page = torch.div(slots, page_size, rounding_mode="floor")
    slot = slots % page_size
    rows = data[page, slot]
    exponent = scales[page, slot][:, : V4_NOPE // V4_TILE]
    n = rows.shape[0]
    nope = rows[:, :V4_NOPE].view(torch.float8_e4m3fn).float().view(n, V4_NOPE // V4_TILE, V4_TILE)
    scale = exponent.contiguous().view(torch.float8_e8m0fnu).float().unsqueeze(-1)
    nope = (nope * scale).view(n, V4_NOPE).to(torch.bfloat16).float()
    rope = rows[:, V4_NOPE:].contiguous().view(torch.bfloat16).float()
    return torch.cat((nope, rope), dim=1)


def distinct(values: torch.Tensor, bound: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.unique(values, return_inverse=True)` without the CPU unique (many times slower
    than a sort): (ascending distinct values, each value's index among them). With `bound`
    (every value in [0, bound)) and few values per slot, a presence mask instead of a sort."""
    flat = values.reshape(-1)
    if flat.numel() == 0:
        return flat.clone(), torch.zeros_like(values)
    if bound is not None and bound <= 8 * flat.numel() + 4096:
        present = torch.zeros(bound, dtype=torch.bool)
        present[flat] = True
        rank = torch.cumsum(present, 0) - 1
        return present.nonzero().squeeze(1), rank[flat].view(values.shape)
    ordered, order = torch.sort(flat)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    inverse = torch.empty_like(flat)
    inverse[order] = torch.cumsum(starts, 0) - 1
    return ordered[starts], inverse.view(values.shape)


def _sparse_source(k_cache, indices, topk_length, tokens, batch):
    """(fp32 table of the distinct rows a source's valid indices name, [tokens, K] positions
    into it, [tokens, K] validity)."""
    page_size = k_cache.shape[1]
    idx = indices.reshape(tokens, -1).long()
    valid = idx >= 0
    if topk_length is not None:
        per_token = topk_length.long().repeat_interleave(tokens // batch)
        valid &= torch.arange(idx.shape[1]).unsqueeze(0) < per_token.unsqueeze(1)
    slots, inverse = distinct(idx[valid], k_cache.shape[0] * page_size)
    table = v4_rows(k_cache, slots, page_size)
    pos = torch.zeros_like(idx)
    pos[valid] = inverse
    return table, pos, valid


def sparse_mla(q, k_cache, indices, topk_length, attn_sink, head_dim_v, softmax_scale,
               extra_k_cache=None, extra_indices=None, extra_topk_length=None, chunk_entries=1 << 16):
    """`_sm120_sparse_decode_fwd` (sglang/kernels/ops/attention/flash_mla_sm120.py, the torch path
    of the sm_120 sparse MLA that SGLANG_SM120_FLASHMLA_BACKEND=torch selects), the same
    attention computed with less memory traffic: each distinct cache row the indices name is
    dequantized once (instead of a byte-wise gather per index), the rows a token attends to are
    gathered from that fp32 table a chunk of tokens at a time, and a head whose query is all
    zeros (the decode path pads to 64 heads) gets its closed form (every score 0) instead of a
    product.

    q [B, S, H, D] (D >= 512: the first 512 dims meet the 512-dim rows); indices [B, S, K] flat
    slots of k_cache's pages, -1 or past topk_length[b] invalid; the extra cache and indices
    (the compressed rows) join the same softmax. Scores in fp32 times softmax_scale, the
    attention sink joins the normaliser, a token with no valid index gets 0. Returns (out bf16
    [B, S, H, head_dim_v], lse fp32 [B, H, S], the log-sum-exp without the sink)."""
    b, s, h, _ = q.shape
    tokens = b * s
    sources = [_sparse_source(k_cache, indices, topk_length, tokens, b)]
    if extra_k_cache is not None and extra_indices is not None:
        sources.append(_sparse_source(extra_k_cache, extra_indices, extra_topk_length, tokens, b))
    dim = sources[0][0].shape[1]
    tables, positions, valids, offset = [], [], [], 0
    for table, pos, valid in sources:
        tables.append(table)
        positions.append(pos + offset)
        valids.append(valid)
        offset += table.shape[0]
    table = torch.cat(tables + [torch.zeros(1, dim)])
    valid = torch.cat(valids, dim=1)
    pos = torch.where(valid, torch.cat(positions, dim=1), offset)  # invalid: the zero row

    qf = q.reshape(tokens, h, -1)[..., :dim].float()
    live = (qf != 0).any(dim=-1).any(dim=0)
    heads = live.nonzero().squeeze(1)
    idle = (~live).nonzero().squeeze(1)
    sink = attn_sink.float() if attn_sink is not None else None
    out = torch.zeros(tokens, h, head_dim_v)
    lse = torch.full((tokens, h), float("-inf"))
    attend = _attend_each_alone if batch_invariant.enabled() else _attend_by_chunks
    attend(qf, table, pos, valid, heads, idle, sink, head_dim_v, softmax_scale, chunk_entries,
           out, lse)
    return (out.view(b, s, h, head_dim_v).to(torch.bfloat16),
            lse.view(b, s, h).permute(0, 2, 1))


def _attend_by_chunks(qf, table, pos, valid, heads, idle, sink, head_dim_v, scale,
                      chunk_entries, out, lse):
    """sparse_mla by chunks of tokens: a chunk whose tokens share most of their rows (a
    prefill's window, the compressed rows) scores each distinct row once and reads the scores
    back per index; any other is gathered token by token."""
    tokens = qf.shape[0]
    step = max(1, int(chunk_entries) // max(1, pos.shape[1]))
    for start in range(0, tokens, step):
        rows = slice(start, min(tokens, start + step))
        mask = ~valid[rows]
        rows_used, local = distinct(pos[rows], table.shape[0])
        if rows_used.numel() * 2 <= local.numel():
            out[rows], lse[rows] = _attend_shared(qf[rows], table[rows_used], local, mask, heads,
                                                  idle, sink, head_dim_v, scale)
        else:
            out[rows], lse[rows] = _attend_gathered(qf[rows], table[pos[rows]], mask, heads,
                                                    idle, sink, head_dim_v, scale)


# The batch-invariant mode's attention width: a token's valid rows padded to a multiple of this.
INVARIANT_WIDTH_STEP = 64


def _attend_each_alone(qf, table, pos, valid, heads, idle, sink, head_dim_v, scale,
                       chunk_entries, out, lse):
    """sparse_mla in the batch-invariant mode: each token's result a function of its own query
    and rows. The index lists are as wide as the batch's longest (the c128 rows, a prefill's
    causal windows), and a softmax or product over a row padded with masked entries rounds
    differently from the same row unpadded; so each token's valid rows are moved to the front
    in their order and attended over its own width (their count rounded up to
    `INVARIANT_WIDTH_STEP`), tokens of one width together, gathered token by token (which rows a
    chunk of tokens shares depends on the chunk)."""
    count = valid.sum(dim=1)
    width = (count + INVARIANT_WIDTH_STEP - 1) // INVARIANT_WIDTH_STEP * INVARIANT_WIDTH_STEP
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)  # valid first, in order
    pos, valid = pos.gather(1, order), valid.gather(1, order)
    wider = int(width.max()) - pos.shape[1] if pos.numel() else 0
    if wider > 0:  # past the lists' width: the zero row (the table's last), masked
        pos = torch.nn.functional.pad(pos, (0, wider), value=table.shape[0] - 1)
        valid = torch.nn.functional.pad(valid, (0, wider), value=False)
    for w in torch.unique(width).tolist():
        if w == 0:
            continue  # no valid row: 0 and -inf, as initialised
        group = (width == w).nonzero().squeeze(1)
        step = max(1, int(chunk_entries) // w)
        for start in range(0, group.numel(), step):
            rows = group[start:start + step]
            out[rows], lse[rows] = _attend_gathered(qf[rows], table[pos[rows, :w]],
                                                    ~valid[rows, :w], heads, idle, sink,
                                                    head_dim_v, scale)


def _softmax_rows(scores, mask, sink):
    """exp(scores - log(sum exp(scores) [+ exp(sink)])) over the last dim with masked entries
    out; (weights, lse without the sink). A row with nothing valid gets weights 0, lse -inf."""
    scores = scores.masked_fill(mask.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    norm = lse if sink is None else torch.logaddexp(lse, sink.expand_as(lse))
    norm = norm.masked_fill(lse == float("-inf"), float("inf"))
    return torch.exp(scores - norm.unsqueeze(-1)), lse


def _idle_heads(total, count, sink, idle):
    """Heads whose query is all zeros: every valid score is 0, so the output is the sum of the
    valid rows over (count [+ exp(sink)]) and the lse log(count)."""
    lse = torch.log(count).unsqueeze(1).expand(-1, idle.numel())
    norm = lse if sink is None else torch.logaddexp(lse, sink[idle].expand_as(lse))
    norm = norm.masked_fill(lse == float("-inf"), float("inf"))
    return total.unsqueeze(1) * torch.exp(-norm).unsqueeze(-1), lse


def _attend_gathered(q, kv, mask, heads, idle, sink, head_dim_v, scale):
    """q [c, H, D], kv [c, K, D] (the rows each token attends to; invalid ones zero)."""
    c, h = q.shape[:2]
    out = torch.zeros(c, h, head_dim_v)
    lse = torch.full((c, h), float("-inf"))
    if heads.numel():
        scores = torch.bmm(q[:, heads], kv.transpose(1, 2)) * scale
        weights, lse[:, heads] = _softmax_rows(scores, mask, None if sink is None else sink[heads])
        out[:, heads] = torch.bmm(weights, kv[..., :head_dim_v])
    if idle.numel():
        count = (~mask).sum(dim=1).float()
        out[:, idle], lse[:, idle] = _idle_heads(kv[..., :head_dim_v].sum(dim=1), count, sink,
                                                 idle)
    return out, lse


def _attend_shared(q, rows, local, mask, heads, idle, sink, head_dim_v, scale):
    """q [c, H, D]; rows [U, D] the distinct rows of the chunk, local [c, K] each index's row
    in it. Scores q x rows once, picked per index; the weights summed back per row."""
    c, h = q.shape[:2]
    u = rows.shape[0]
    out = torch.zeros(c, h, head_dim_v)
    lse = torch.full((c, h), float("-inf"))
    values = rows[:, :head_dim_v]
    if heads.numel():
        n = heads.numel()
        dense = (q[:, heads].reshape(c * n, -1) @ rows.T).view(c, n, u) * scale
        where = local.unsqueeze(1).expand(c, n, local.shape[1])
        weights, lse[:, heads] = _softmax_rows(dense.gather(2, where), mask,
                                               None if sink is None else sink[heads])
        per_row = torch.zeros(c, n, u).scatter_add_(2, where, weights)
        out[:, heads] = (per_row.view(c * n, u) @ values).view(c, n, head_dim_v)
    if idle.numel():
        counts = torch.zeros(c, u).scatter_add_(1, local, (~mask).float())
        out[:, idle], lse[:, idle] = _idle_heads(counts @ values, counts.sum(dim=1), sink, idle)
    return out, lse


# --- indexer.py: the c4 indexer's fp8 logits (sm_120 torch path) -------------------------------


def fp8_paged_mqa_logits(q_fp8, kvcache_fp8, weight, seq_lens, page_table, deep_gemm_metadata,
                         max_seq_len, clean_logits=False, chunk_values=1 << 24):
    """`fp8_paged_mqa_logits_torch_sm120` (sglang/srt/layers/attention/dsv4/indexer.py, the
    c4 indexer's logits that SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1 selects on sm_120), the same
    numbers with less work: each distinct index-K page is dequantized once, and the product
    runs in fp32 (the CPU's bf16 matmul is slow) rounded to bf16 as upstream's bf16 product is.

    logits[b, t] = scale[t] * sum_h weight[b, h] * relu(bf16(q[b, h] . k[t])) for t below
    seq_lens[b], -inf from there to max_seq_len; k[t] is slot t % 64 of page
    page_table[b, t // 64] (64 e4m3 rows of 128, then their 64 fp32 scales). When the rows
    share their pages (a prefill), each query meets each distinct key once; otherwise (a decode
    batch) each row gathers its own pages."""
    if clean_logits:
        _unsupported("clean_logits in the fp8 paged MQA logits")
    batch, _, heads, head_dim = q_fp8.shape
    block = kvcache_fp8.shape[1]
    if seq_lens.dim() > 1:
        seq_lens = seq_lens.squeeze(-1)
    max_pages = -(-int(max_seq_len) // block)
    width = min(max_pages * block, int(max_seq_len))
    logits = torch.full((batch, int(max_seq_len)), float("-inf"))
    if batch == 0 or max_pages == 0:
        return logits
    pages = kvcache_fp8.shape[0]
    flat = kvcache_fp8.view(torch.uint8).reshape(pages, -1)
    table = page_table[:, :max_pages].long() % pages  # as upstream's indexing wraps a -1
    used, local = distinct(table, pages)
    raw = flat[used]
    keys = raw[:, : block * head_dim].contiguous().view(torch.float8_e4m3fn).float()
    keys = keys.view(-1, head_dim)  # [U * block, 128]
    scales = raw[:, block * head_dim :].contiguous().view(torch.float32).reshape(-1)
    logits[:, :width] = _paged_scores(q_fp8[:, 0].float(), weight.float(), keys, scales, local,
                                      block, round_bf16=True, chunk_values=chunk_values)[:, :width]
    beyond = torch.arange(int(max_seq_len)).unsqueeze(0) >= seq_lens.long().unsqueeze(1)
    return logits.masked_fill_(beyond, float("-inf"))


def _paged_scores(query, weight, keys, scales, local, block, round_bf16, chunk_values):
    """sum_h weight[b, h] * relu(query[b, h] . key) [* scale] for every key of each row's pages:
    query [B, H, D] fp32, keys [U * block, D] fp32 (the distinct pages), scales [U * block] or
    None, local [B, P] each row's pages among them. [B, P * block] fp32. When the rows share
    their pages (a prefill) every query meets each distinct key once; otherwise (a decode
    batch) each row gathers its own pages."""
    batch, heads, head_dim = query.shape
    span = local.shape[1] * block
    out = torch.empty(batch, span)
    if batch == 0 or span == 0:
        return out

    def reduce(score, w):  # [c, H, n] -> [c, n]
        if round_bf16:
            score = score.bfloat16().float()
        return (score.relu_() * w.unsqueeze(-1)).sum(dim=1)

    # The batch-invariant mode always takes the shared path: which path a batch takes depends
    # on the batch, and the two paths' products round differently.
    if keys.shape[0] * 2 <= batch * span or batch_invariant.enabled():
        columns = (local.unsqueeze(-1) * block + torch.arange(block)).reshape(batch, -1)
        step = max(1, int(chunk_values) // max(1, heads * keys.shape[0]))
        for start in range(0, batch, step):
            rows = slice(start, min(batch, start + step))
            dense = (query[rows].reshape(-1, head_dim) @ keys.T).view(-1, heads, keys.shape[0])
            dense = reduce(dense, weight[rows])
            if scales is not None:
                dense = dense * scales
            out[rows] = dense.gather(1, columns[rows])
        return out
    step = max(1, int(chunk_values) // max(1, span * (head_dim + heads)))
    key_pages = keys.view(-1, block, head_dim)
    scale_pages = None if scales is None else scales.view(-1, block)
    for start in range(0, batch, step):
        rows = slice(start, min(batch, start + step))
        k = key_pages[local[rows]].reshape(-1, span, head_dim)
        score = reduce(torch.bmm(query[rows], k.transpose(1, 2)), weight[rows])
        if scale_pages is not None:
            score = score * scale_pages[local[rows]].reshape(-1, span)
        out[rows] = score
    return out


def bf16_paged_mqa_logits(q, kv_cache, weights, seq_lens, page_table, max_seq_len,
                          chunk_values=1 << 24):
    """`sgl_kernel_dsv4.index_logits.bf16_paged_mqa_logits` (the distribution's bf16 index
    logits, whose torch path gathers every row's pages for each query row), the same contract
    with each distinct page read once when the rows share their pages (a prefill):
    logits[b, t] = sum_h weights[b, h] * relu(q[b, 0, h] . k[t]) in fp32 for t below seq_lens[b]
    on a page-table entry >= 0, -inf elsewhere up to max_seq_len."""
    from sgl_kernel_dsv4.index_logits import check_logits_inputs

    seq_lens = check_logits_inputs(q, kv_cache, weights, seq_lens, page_table, max_seq_len)
    batch = q.shape[0]
    block = kv_cache.shape[1]
    logits = torch.full((batch, int(max_seq_len)), float("-inf"))
    pages = min(page_table.shape[1], -(-int(max_seq_len) // block))
    if batch == 0 or pages == 0:
        return logits
    table = page_table[:, :pages].long()
    used, local = distinct(table.clamp(min=0), kv_cache.shape[0])
    keys = kv_cache[used, :, 0, :].float().reshape(-1, kv_cache.shape[-1])
    scores = _paged_scores(q[:, 0].float(), weights.float(), keys, None, local, block,
                           round_bf16=False, chunk_values=chunk_values)
    width = min(pages * block, int(max_seq_len))
    position = torch.arange(pages * block)
    valid = (position.unsqueeze(0) < seq_lens.long().unsqueeze(1)) & (
        table >= 0).repeat_interleave(block, dim=1)
    logits[:, :width] = scores.masked_fill_(~valid, float("-inf"))[:, :width]
    return logits
