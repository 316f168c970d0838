"""Attention over a paged, quantized KV pool, and quantize-on-store: the torch references.

Every Triton kernel (kernels_triton.py) has a torch reference here with the identical signature. The
reference is the readable statement of what the kernel computes, the CPU path, and what the kernel is
tested against.

Pool layout of one layer (see cache.py): `data` (NB, H, BS, D // per_byte) codes;
`scale`/`zero` (NB|1, H|1, BS|1, G), where G groups split the D channels. A size-1 dim is shared
(stride 0 once expanded), so one formula `x = (q - zero) * scale` serves every granularity.
Block tables hold physical block ids, with -1 for "not in this pool": key position of table
column j, row t of the block is j * BS + t.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant import QuantParams, cast_up, compute_scales, dequantize, pack, quantize


@dataclass
class PoolLayer:
    """One layer's K (or V) storage: what a kernel needs to read it."""
    data: torch.Tensor  # (NB, H, BS, D // per_byte)
    scale: torch.Tensor | None  # (NB|1, H|1, BS|1, G) or None for float storage
    zero: torch.Tensor | None  # like scale; None when symmetric
    p: QuantParams


def gather_dequant(pool: PoolLayer, ids: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Blocks `ids` (any shape S) of a pool, dequantized: (*S, H, BS, D)."""
    flat = ids.reshape(-1)

    def pick(t, always=False):  # whole blocks by index_select; a layer-wide (static) scale broadcasts as is
        keep = t is None or (t.shape[0] == 1 and not always)
        return t if keep else t.index_select(0, flat).view(*ids.shape, *t.shape[1:])
    return dequantize(pick(pool.data, always=True), pool.p, pick(pool.scale), pick(pool.zero), out_dtype=dtype)


def paged_attention_ref(q: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor, k: PoolLayer,
                        v: PoolLayer, block_table: torch.Tensor, ctx_lens: torch.Tensor,
                        sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of packed queries over paged K/V.

    q (N, Hq, D); q_seq (N,) row of block_table for each query, rows contiguous and in order;
    q_pos (N,) absolute position (a query sees keys at positions <= q_pos); block_table (B, MB);
    ctx_lens (B,) valid key positions per row. Returns o (N, Hq, D) float32 and the natural-log
    sum-exp of the scores lse (N, Hq) float32 (-inf where a query sees no key in this pool), so
    partial results over disjoint key sets merge exactly (`merge_partials`).

    Rows with one query (decoding) go through `attend_decode` together; a row with several (a
    prefill chunk) attends alone over its own blocks, so a mixed step pads nothing to its longest row.
    """
    (N, Hq, D), B = q.shape, block_table.shape[0]
    counts = torch.bincount(q_seq.long(), minlength=B).tolist()
    if N == B and N and max(counts) == 1:
        return attend_decode(q, q_pos, k, v, block_table, ctx_lens, sm_scale)
    o = torch.zeros(N, Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.full((N, Hq), float("-inf"), dtype=torch.float32, device=q.device)
    starts = [sum(counts[:b]) for b in range(B)]
    single = [b for b in range(B) if counts[b] == 1]
    if single:
        rows, idx = (torch.tensor(x, device=q.device) for x in (single, [starts[b] for b in single]))
        o[idx], lse[idx] = attend_decode(q[idx], q_pos[idx], k, v, block_table[rows], ctx_lens[rows], sm_scale)
    for b in (b for b in range(B) if counts[b] > 1):
        rows = slice(starts[b], starts[b] + counts[b])
        o[rows], lse[rows] = _attend_chunk(q[rows], q_pos[rows], k, v, block_table[b], int(ctx_lens[b]), sm_scale)
    return o, lse


def _attend_chunk(q: torch.Tensor, q_pos: torch.Tensor, k: PoolLayer, v: PoolLayer, row: torch.Tensor,
                  ctx: int, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """T queries of one sequence (T, Hq, D) over its blocks `row` (MB,) holding ctx keys -> (o, lse)."""
    (T, Hq, D), (H, BS) = q.shape, k.data.shape[1:3]
    n_rep, row = Hq // H, row[:-(-ctx // BS)]  # the row's own blocks, not the table's width
    S = len(row) * BS
    key_pos = torch.arange(S, device=q.device)
    allowed = (key_pos <= q_pos[:, None]) & (key_pos < ctx) & (row >= 0).repeat_interleave(BS)  # (T, S)
    # GQA: the n_rep query heads of a KV head attend to the same K/V without copying it per head.
    qg = q.float().view(T, H, n_rep, D).transpose(0, 1).reshape(1, H, T * n_rep, D)
    kv = [gather_dequant(x, row.clamp(min=0).long()).transpose(0, 1).reshape(1, H, S, D) for x in (k, v)]
    o, lse = dense_attention(qg, *kv, allowed.repeat_interleave(n_rep, 0), sm_scale)  # (1, H, T * n_rep, D|)
    o, lse = o.view(H, T, n_rep, D).transpose(0, 1), lse.view(H, T, n_rep).transpose(0, 1)
    return o.reshape(T, Hq, D), lse.reshape(T, Hq)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                    sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, H, M, D) over k, v (B, H, S, D) where allowed (M, S) -> o (B, H, M, D), lse (B, H, M)."""
    if q.device.type == "cpu":  # torch's CPU flash attention: tiled, and it returns the log-sum-exp too
        mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill_(~allowed, float("-inf"))
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=sm_scale)
        blind = ~allowed.any(-1)  # a query with no key: torch reports lse 0 (and o 0, or NaN in some versions)
        return o.masked_fill(blind[:, None], 0.0), lse.masked_fill(blind, float("-inf"))
    s = (q @ k.transpose(-1, -2) * sm_scale).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]).nan_to_num(0.0) @ v, lse  # no key: exp(-inf - -inf) = nan -> 0


def attend_decode(q: torch.Tensor, q_pos: torch.Tensor, k: PoolLayer, v: PoolLayer, block_table: torch.Tensor,
                  ctx_lens: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row, q (B, Hq, D) -> (o, lse) as paged_attention_ref.

    Where one scale (and zero) covers a key's whole head vector (token, head, tensor granularity),
    it is applied to the scores and the probabilities instead of to every element of K and V:
    q . (c - z) s = s (q . c - z sum(q)), and sum_t p_t s_t (c_t - z_t) = (p s) @ c - sum_t p_t s_t z_t.
    """
    (B, Hq, D), (MB, (H, BS)) = q.shape, (block_table.shape[1], k.data.shape[1:3])
    S, ids = MB * BS, block_table.clamp(min=0).long().view(-1)
    qg = q.float().view(B, H, Hq // H, D)
    run = _run_start(ids)
    kc, ks, kz = _codes(k, ids, B, MB, run)  # (B, H, S, D), factors broadcasting to (B, H, 1, S)
    s = qg @ kc.transpose(-1, -2)  # (B, H, n_rep, S)
    if kz is not None:
        s -= kz * qg.sum(-1, keepdim=True)
    s *= sm_scale if ks is None else ks * sm_scale
    key_pos = torch.arange(S, device=q.device)
    allowed = (key_pos <= q_pos[:, None]) & (key_pos < ctx_lens[:, None]) & (block_table >= 0).repeat_interleave(BS, 1)
    s.masked_fill_(~allowed[:, None, None], float("-inf"))
    m = s.amax(-1, keepdim=True).clamp(min=torch.finfo(s.dtype).min)  # finite even for a row with no key
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)  # >= 1 when the row has a key
    vc, vs, vz = _codes(v, ids, B, MB, run)
    if vs is not None:
        p *= vs
    o = p @ vc
    if vz is not None:
        o -= (p * vz).sum(-1, keepdim=True)
    o /= l.clamp(min=1.0)
    return o.view(B, Hq, D), (m + l.log()).view(B, Hq)


def _codes(pool: PoolLayer, ids: torch.Tensor, B: int, MB: int, run: int | None):
    """Blocks `ids` (B * MB,) as (B, H, S, D) float32, with the per-key scale and zero point kept apart
    ((B|1, H|1, 1, S|1) each, or None) when one scale covers a key's head vector; dequantized otherwise."""
    p, (H, BS, Dp) = pool.p, pool.data.shape[1:]
    D = Dp * p.per_byte
    if pool.scale is not None and pool.scale.shape[-1] > 1:  # channel or group scales: dequantize
        x = gather_dequant(pool, ids).view(B, MB, H, BS, D)
        return x.transpose(1, 2).reshape(B, H, MB * BS, D), None, None
    raw = _blocks(pool.data, ids, run).view(B, MB, H, BS, Dp).transpose(1, 2)  # (B, H, MB, BS, Dp)
    x = torch.empty(B, H, MB, BS, Dp, p.per_byte, device=ids.device)
    if p.per_byte == 1:
        x[..., 0] = raw  # the cast to float rides on the transposing copy
    else:
        bits = 8 // p.per_byte
        for j in range(p.per_byte):  # channel 2i + j sits in bits j*bits.. of byte i
            c = raw >> (j * bits) if j else raw
            x[..., j] = c & ((1 << bits) - 1) if j < p.per_byte - 1 else c
    x = x.view(B, H, MB * BS, D)
    if p.is_float:
        return x, None, None
    zero = p.offset or None if pool.zero is None else _per_key(pool.zero, ids, B, MB, BS, run)
    return x, _per_key(pool.scale, ids, B, MB, BS, run), zero


def _per_key(t: torch.Tensor, ids: torch.Tensor, B: int, MB: int, BS: int, run: int | None) -> torch.Tensor:
    """Scales (NB|1, H|1, BS|1, 1) of blocks ids -> float32 broadcasting to (B, H, 1, MB * BS)."""
    NB, Hs, BSs, _ = t.shape
    if NB == 1:  # one per layer (static): (1, H|1, 1, 1)
        return t.float().view(1, Hs, 1, 1)
    g = _blocks(t, ids, run).view(B, MB, Hs, BSs).transpose(1, 2)  # (B, Hs, MB, BS|1)
    return torch.empty(B, Hs, MB, BS, device=t.device).copy_(g.expand(B, Hs, MB, BS)).view(B, Hs, 1, MB * BS)


def _run_start(ids: torch.Tensor) -> int | None:
    """ids[0] when the ids are consecutive, as one sequence's blocks from a fresh pool are; else None.
    Checked only for long contexts, where reading the pool in place saves copying K and V once more."""
    if ids.numel() < 16:
        return None
    first = int(ids[0])
    return first if int(ids[-1]) - first == ids.numel() - 1 and bool((ids.diff() == 1).all()) else None


def _blocks(t: torch.Tensor, ids: torch.Tensor, run: int | None) -> torch.Tensor:
    return t.index_select(0, ids) if run is None else t[run:run + ids.numel()]


def merge_partials(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of attention over disjoint key sets from (o, lse) pairs: o (N, Hq, D), lse (N, Hq)."""
    if len(parts) == 1:
        return parts[0]
    return merge_stacked(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))


def merge_stacked(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """merge_partials over a leading parts dim: o (P, N, Hq, D), lse (P, N, Hq)."""
    total = torch.logsumexp(lse, dim=0)  # (N, Hq)
    w = torch.exp(lse - total).nan_to_num(0.0)  # a part with no keys weighs 0
    return (w[..., None] * o).sum(0), total


def quantize_store_ref(x: torch.Tensor, p: QuantParams, data: torch.Tensor, scale: torch.Tensor | None,
                       zero: torch.Tensor | None, blk: torch.Tensor, off: torch.Tensor) -> torch.Tensor | int:
    """Quantize new tokens x (n, H, D) into one layer's pool (NB, H, BS, D // per_byte) at data[blk[i], :, off[i]].

    Per-token/group scales (and zeros) are computed and stored at scale[blk[i], :, off[i]] ((NB, H, BS, G), in
    the scale tensor's dtype); static ones (1, H|1, 1, G) are read; float formats are a plain cast. Returns the
    count of saturated values and NaNs: an int here, an int32 0-dim tensor from the kernel (no sync on a GPU).
    """
    assert not p.block_wise, f"{p}: block-wise scales are computed when a block fills, not per token"
    if p.is_float:
        data[blk, :, off] = x.to(data.dtype)
        return 0
    if p.sym and not (p.static or p.dtype == "fp8"):  # the decode step's common case, lean
        xg = x.float().unflatten(-1, (scale.shape[-1], -1))  # (n, H, G, D // G)
        amax = xg.abs().amax(-1)
        if float(amax.max()) <= p.qmax * torch.finfo(scale.dtype).max:  # no NaN/Inf, nothing can saturate
            s = cast_up(amax / p.qmax, scale.dtype)  # the same codes as compute_scales + quantize
            v = xg / s.float().unsqueeze(-1)
            codes = (v + p.offset if p.offset else v).round().clamp(p.qmin + p.offset, p.qmax + p.offset)
            scale[blk, :, off] = s
            codes = codes.flatten(-2).to(data.dtype)
            data[blk, :, off] = codes if p.per_byte == 1 else pack(codes, p.per_byte)
            return 0
    x = x.unsqueeze(2)  # (n, H, 1, D): each token is its own block of one row
    s, z = (scale, zero) if p.static else compute_scales(x, p, torch.float16 if scale is None else scale.dtype)
    if s is not None and not p.static:
        scale[blk, :, off] = s[:, :, 0]
        if z is not None:
            zero[blk, :, off] = z[:, :, 0]
    q, n_sat = quantize(x, p, s, z)
    data[blk, :, off] = q[:, :, 0]
    return n_sat
