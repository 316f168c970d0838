"""Attention over a paged, quantized KV pool: torch references (and Triton kernels beside them).

Every kernel has a torch reference with the identical signature. The reference is the readable
statement of what the kernel computes, the CPU path, and what the kernel is tested against.

Pool layout of one layer (see cache.py): `data` (NB, H, BS, D // per_byte) codes;
`scale`/`zero` (NB|1, H|1, BS|1, G), where G groups split the D channels. A size-1 dim is shared
(stride 0 once expanded), so one formula `x = (q - zero) * scale` serves every granularity.
Block tables hold physical block ids, with -1 for "not in this pool": key position of table
column j, row t of the block is j * BS + t.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant import QuantParams, dequantize


@dataclass
class PoolLayer:
    """One layer's K (or V) storage: what a kernel needs to read it."""
    data: torch.Tensor  # (NB, H, BS, D // per_byte)
    scale: torch.Tensor | None  # (NB|1, H|1, BS|1, G) or None for float storage
    zero: torch.Tensor | None  # like scale; None when symmetric
    p: QuantParams


def gather_dequant(pool: PoolLayer, ids: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Blocks `ids` (any shape S) of a pool, dequantized: (*S, H, BS, D)."""
    def pick(t):
        if t is None:
            return None
        return t.expand(pool.data.shape[0], *t.shape[1:])[ids] if t.shape[0] == 1 else t[ids]
    return dequantize(pool.data[ids], pool.p, pick(pool.scale), pick(pool.zero), out_dtype=dtype)


def paged_attention_ref(q: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor, k: PoolLayer,
                        v: PoolLayer, block_table: torch.Tensor, ctx_lens: torch.Tensor,
                        sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of packed queries over paged K/V.

    q (N, Hq, D); q_seq (N,) row of block_table for each query, rows contiguous and in order;
    q_pos (N,) absolute position (a query sees keys at positions <= q_pos); block_table (B, MB);
    ctx_lens (B,) valid key positions per row. Returns o (N, Hq, D) float32 and the natural-log
    sum-exp of the scores lse (N, Hq) float32 (-inf where a query sees no key in this pool), so
    partial results over disjoint key sets merge exactly (`merge_partials`).
    """
    N, Hq, D = q.shape
    B, MB = block_table.shape
    H, BS = k.data.shape[1], k.data.shape[2]
    n_rep = Hq // H
    ids = block_table.clamp(min=0).long()
    # (B, MB, H, BS, D) -> (B, H, S, D), S = MB * BS in logical order
    K = gather_dequant(k, ids).permute(0, 2, 1, 3, 4).reshape(B, H, MB * BS, D)
    V = gather_dequant(v, ids).permute(0, 2, 1, 3, 4).reshape(B, H, MB * BS, D)
    key_pos = torch.arange(MB * BS, device=q.device)
    valid = (block_table >= 0).repeat_interleave(BS, dim=1) & (key_pos < ctx_lens[:, None])  # (B, S)
    # Queries of one row padded to (B, Tq, ...): row b's queries are contiguous in the packed stream.
    counts = torch.bincount(q_seq.long(), minlength=B)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(N, device=q.device) - starts[q_seq.long()]
    Tq = int(counts.max()) if N else 0
    qp = q.new_zeros(B, Tq, Hq, D, dtype=torch.float32)
    qp[q_seq.long(), rank] = q.float()
    pos = torch.full((B, Tq), -1, dtype=torch.long, device=q.device)
    pos[q_seq.long(), rank] = q_pos.long()
    # GQA: the n_rep query heads of a KV head attend to the same K/V without copying it per head.
    qg = qp.view(B, Tq, H, n_rep, D).permute(0, 2, 1, 3, 4).reshape(B, H, Tq * n_rep, D)
    s = (qg @ K.transpose(-1, -2) * sm_scale).view(B, H, Tq, n_rep, MB * BS)  # not -1: N may be 0
    allowed = valid[:, None, :] & (key_pos[None, None, :] <= pos[:, :, None])  # (B, Tq, S)
    s = s.masked_fill(~allowed[:, None, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Tq, n_rep)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows with no key: exp(-inf - -inf) = nan -> 0
    o = (p.view(B, H, Tq * n_rep, MB * BS) @ V).view(B, H, Tq, n_rep, D)
    o = o.permute(0, 2, 1, 3, 4).reshape(B, Tq, Hq, D)[q_seq.long(), rank]
    lse = lse.permute(0, 2, 1, 3).reshape(B, Tq, Hq)[q_seq.long(), rank]
    return o, lse


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
