"""Attention over a paged, quantized KV pool, and quantize-on-store: the torch references.

Every fused kernel (cpu.py, triton.py and their stores) has a reference here with the identical
signature. The reference is the readable statement of what the kernels compute and what they are
tested against, so it uses quant.py's one formula each way: it reads blocks through
`quant.dequantize` and stores tokens through `quant.compute_scales` and `quant.quantize`.

The pool layout of one layer is layout.py's. Block tables hold physical block ids, with -1 for
"not in this pool": key position of table column j, row t of the block is j * BS + t.
"""

from __future__ import annotations

import torch

from ..quant import compute_scales, dequantize, quantize
from ..spec import QuantParams
from .layout import PoolLayer

# (o, lse): attention over a set of keys and the log-sum-exp of its scores, which merges exactly
# with other sets' (merge_partials)
Partial = tuple[torch.Tensor, torch.Tensor]


def gather_dequant(pool: PoolLayer, table: torch.Tensor) -> torch.Tensor:
    """The blocks of each row of `table` (B, MB), dequantized to float32: (B, H, MB * BS, D),
    each KV head's keys in position order. A -1 in the table reads block 0 (the caller masks it)."""
    B, MB = table.shape
    ids = table.clamp(min=0).long().view(-1)

    def by_head(t: torch.Tensor) -> torch.Tensor:
        """Blocks of t (NB, H|1, ...) as (B, H|1, MB, ...), copied while still 1-2 bytes wide."""
        return t.index_select(0, ids).view(B, MB, *t.shape[1:]).transpose(1, 2).contiguous()

    def scales(t: torch.Tensor | None) -> torch.Tensor | None:
        """Scales or zero points (NB|1, H|1, BS|1, G) laid out like the codes."""
        if t is None:
            return None
        if t.shape[0] == 1:  # one set for the layer (static, or a one-block pool): (1, H|1, 1, ...)
            return t.unsqueeze(2)
        return by_head(t)

    codes = by_head(pool.data)  # (B, H, MB, BS, D // per_byte)
    x = dequantize(codes, pool.p, scales(pool.scale), scales(pool.zero))  # (B, H, MB, BS, D)
    return x.flatten(2, 3)


def paged_attention_ref(q: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor, k: PoolLayer,
                        v: PoolLayer, block_table: torch.Tensor, ctx_lens: torch.Tensor,
                        sm_scale: float) -> Partial:
    """Causal attention of packed queries over paged K/V.

    q (N, Hq, D); q_seq (N,) row of block_table for each query, rows contiguous and in order;
    q_pos (N,) absolute position (a query sees keys at positions <= q_pos); block_table (B, MB);
    ctx_lens (B,) valid key positions per row. Returns o (N, Hq, D) float32 and the natural-log
    sum-exp of the scores lse (N, Hq) float32 (-inf where a query sees no key in this pool), so
    partial results over disjoint key sets merge exactly (`merge_partials`).

    Rows with one query (decoding) go through `attend_decode` together; a row with several (a
    prefill chunk) attends alone over its own blocks, so a mixed step pads no row to the longest.
    """
    N, Hq, D = q.shape
    B = block_table.shape[0]
    counts = torch.bincount(q_seq.long(), minlength=B).tolist()  # queries per row
    if N == B and N and max(counts) == 1:
        return attend_decode(q, q_pos, k, v, block_table, ctx_lens, sm_scale)
    o = torch.zeros(N, Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.full((N, Hq), float("-inf"), dtype=torch.float32, device=q.device)
    starts = [sum(counts[:b]) for b in range(B)]  # each row's first packed query
    decoding = [b for b in range(B) if counts[b] == 1]
    if decoding:
        rows = torch.tensor(decoding, device=q.device)
        idx = torch.tensor([starts[b] for b in decoding], device=q.device)
        o[idx], lse[idx] = attend_decode(q[idx], q_pos[idx], k, v, block_table[rows],
                                         ctx_lens[rows], sm_scale)
    for b in range(B):
        if counts[b] > 1:
            chunk = slice(starts[b], starts[b] + counts[b])
            o[chunk], lse[chunk] = _attend_chunk(q[chunk], q_pos[chunk], k, v, block_table[b],
                                                 int(ctx_lens[b]), sm_scale)
    return o, lse


def attend_decode(q: torch.Tensor, q_pos: torch.Tensor, k: PoolLayer, v: PoolLayer,
                  block_table: torch.Tensor, ctx_lens: torch.Tensor, sm_scale: float) -> Partial:
    """One query per row, q (B, Hq, D) -> (o, lse) as paged_attention_ref: every row's blocks
    dequantized, then one batched matmul for the scores and one for the output."""
    B, Hq, D = q.shape
    MB = block_table.shape[1]
    H, BS = k.data.shape[1:3]
    keys = gather_dequant(k, block_table)  # (B, H, S, D)
    values = gather_dequant(v, block_table)  # (B, H, S, D)
    key_pos = torch.arange(MB * BS, device=q.device)
    in_pool = (block_table >= 0).repeat_interleave(BS, 1)
    allowed = (key_pos <= q_pos[:, None]) & (key_pos < ctx_lens[:, None]) & in_pool  # (B, S)
    # GQA: the n_rep query heads of a KV head attend to its K/V without copying it per head.
    n_rep = Hq // H
    qg = q.float().view(B, H, n_rep, D)
    o, lse = _softmax_attention(qg, keys, values, allowed[:, None, None], sm_scale)
    return o.view(B, Hq, D), lse.view(B, Hq)


def _attend_chunk(q: torch.Tensor, q_pos: torch.Tensor, k: PoolLayer, v: PoolLayer,
                  row: torch.Tensor, ctx: int, sm_scale: float) -> Partial:
    """T queries of one sequence, q (T, Hq, D), over the ctx keys of its blocks `row` (MB,)."""
    T, Hq, D = q.shape
    H, BS = k.data.shape[1:3]
    n_rep = Hq // H
    row = row[:-(-ctx // BS)]  # the row's own blocks, not the table's width
    S = len(row) * BS
    keys = gather_dequant(k, row[None])  # (1, H, S, D)
    values = gather_dequant(v, row[None])  # (1, H, S, D)
    key_pos = torch.arange(S, device=q.device)
    in_pool = (row >= 0).repeat_interleave(BS)
    allowed = (key_pos <= q_pos[:, None]) & (key_pos < ctx) & in_pool  # (T, S)
    # GQA: a KV head's n_rep query heads are T * n_rep queries of that one head.
    qg = q.float().view(T, H, n_rep, D).transpose(0, 1).reshape(1, H, T * n_rep, D)
    allowed = allowed.repeat_interleave(n_rep, 0)  # (T * n_rep, S)
    o, lse = dense_attention(qg, keys, values, allowed, sm_scale)
    # back from (1, H, T * n_rep, D|) to the query heads: o (T, Hq, D), lse (T, Hq)
    o = o.view(H, T, n_rep, D).transpose(0, 1).reshape(T, Hq, D)
    lse = lse.view(H, T, n_rep).transpose(0, 1).reshape(T, Hq)
    return o, lse


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                    sm_scale: float) -> Partial:
    """q (B, H, M, D) over k, v (B, H, S, D) where allowed (M, S) -> o (B, H, M, D), lse (B, H, M).

    On the CPU through torch's flash attention, which tiles the keys (a long chunk never holds
    its (M, S) scores at once) and returns the log-sum-exp too.
    """
    if q.device.type != "cpu":
        return _softmax_attention(q, k, v, allowed, sm_scale)
    mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill_(~allowed, float("-inf"))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o, lse = flash(q, k, v, attn_mask=mask, scale=sm_scale)
    # A query that sees no key: torch reports lse 0 (and o 0, or NaN in some versions).
    blind = ~allowed.any(-1)  # (M,)
    return o.masked_fill(blind[:, None], 0.0), lse.masked_fill(blind, float("-inf"))


def _softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                       sm_scale: float) -> Partial:
    """softmax(q k^T * sm_scale) v over the allowed keys, and the log-sum-exp of the scores:
    q (..., M, D), k and v (..., S, D), allowed broadcasting to (..., M, S)."""
    scores = (q @ k.transpose(-1, -2)) * sm_scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf for a query that sees no key
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # no key: exp(-inf + inf) = NaN -> 0
    return probs @ v, lse


def merge_partials(parts: list[Partial]) -> Partial:
    """Exact merge of attention over disjoint key sets from (o, lse) pairs: o (N, Hq, D),
    lse (N, Hq)."""
    if len(parts) == 1:
        return parts[0]
    o = torch.stack([o for o, _ in parts])
    lse = torch.stack([lse for _, lse in parts])
    return merge_stacked(o, lse)


def merge_stacked(o: torch.Tensor, lse: torch.Tensor) -> Partial:
    """merge_partials over a leading parts dim: o (P, N, Hq, D), lse (P, N, Hq)."""
    total = torch.logsumexp(lse, dim=0)  # (N, Hq)
    w = torch.exp(lse - total).nan_to_num(0.0)  # a part with no keys weighs 0
    return (w[..., None] * o).sum(0), total


def quantize_store_ref(x: torch.Tensor, p: QuantParams, data: torch.Tensor,
                       scale: torch.Tensor | None, zero: torch.Tensor | None, blk: torch.Tensor,
                       off: torch.Tensor) -> torch.Tensor | int:
    """Quantize new tokens x (n, H, D) into one layer's pool at data[blk[i], :, off[i]].

    data is (NB, H, BS, D // per_byte). Per-token/group scales (and zeros) are computed and stored
    at scale[blk[i], :, off[i]] ((NB, H, BS, G), in the scale tensor's dtype); static ones
    (1, H|1, 1, G) are read; float formats are a plain cast. Returns quant.quantize's count of
    saturated values and NaNs: an int here, an int32 0-dim tensor from the kernels (no sync on a
    GPU).
    """
    assert not p.block_wise, (f"{p}: block-wise scales are computed when a block fills, "
                              "not per token")
    x = x.unsqueeze(2)  # (n, H, 1, D): each token is quantized as a block of one row
    if p.static:  # calibrated: read, never written
        s, z = scale, zero
    elif p.is_float:
        s, z = None, None
    else:  # each token's own scales (n, H, 1, G), stored beside its codes
        s, z = compute_scales(x, p, scale.dtype)
        scale[blk, :, off] = s[:, :, 0]
        if z is not None:
            zero[blk, :, off] = z[:, :, 0]
    codes, n_sat = quantize(x, p, s, z)
    data[blk, :, off] = codes[:, :, 0]
    return n_sat
