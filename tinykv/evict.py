"""Selective caching: eviction policies that keep a budget of N tokens per sequence and KV head,
and the compaction that gives the dropped tokens' blocks back to the pool.

A spec's `evict=POLICY:N` sets the budget. Sinks (`sink=`) and the most recent `residual` tokens
count against it and are never evicted. Each layer and KV head keeps its own tokens; keys carry
their RoPE position already, so after compaction attention reads every kept slot as is.

  streaming  the sinks and the most recent tokens (StreamingLLM)
  knorm      drop the keys of largest L2 norm: low-norm keys draw the most attention
  snapkv     once the prompt is in, keep the prompt tokens that its last `WINDOW` queries attend
             to most (scores summed over the GQA group, pooled over neighbours), plus that window;
             decoding then appends as usual
  h2o        keep the heavy hitters, by attention accumulated over every query so far (prefill and
             decode), and the most recent half of the budget

Compaction dequantizes a sequence's kept keys and values, frees all its blocks and stores the
kept ones again from slot 0 through the ordinary store path, so it composes with every format (a
per-token code stored again from its own dequantized value keeps its code), with sinks, residual
windows and offload (an evicted block is freed, never staged).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

WINDOW = 32  # snapkv's observation window: the prompt's last queries
POOL = 7  # snapkv pools scores over this many neighbouring slots, so kept tokens come in runs


def protected(n: int, budget: int, sink: int, recent: int) -> tuple[int, int]:
    """(first, last): slots [0, first) and [last, n) are kept whatever the scores say."""
    first = min(sink, budget, n)
    last = max(n - min(recent, budget - first), first)
    return first, last


def keep_by_score(score: torch.Tensor, budget: int, first: int, last: int) -> torch.Tensor:
    """Slots to keep (L, H, budget), ascending: [0, first), [last, n), and the highest scores
    (L, H, n) between them."""
    L, H, n = score.shape
    n_pick = budget - first - (n - last)
    middle = score[..., first:last]  # (L, H, last - first)
    picked = middle.topk(n_pick, dim=-1).indices + first  # (L, H, n_pick)
    head = torch.arange(first).expand(L, H, first)
    tail = torch.arange(last, n).expand(L, H, n - last)
    return torch.cat([head, picked.sort(-1).values, tail], -1)


def select(policy: str, n: int, budget: int, sink: int, residual: int,
           keys: torch.Tensor | None = None, score: torch.Tensor | None = None) -> torch.Tensor:
    """The slots (L, H, budget) a sequence of n slots keeps. keys (L, H, n, D) for knorm; score
    (L, H, n) of attention received for snapkv and h2o."""
    if policy == "streaming":
        first, last = protected(n, budget, sink, budget)
        return keep_by_score(torch.zeros(1, 1, n), budget, first, last)
    if policy == "knorm":
        first, last = protected(n, budget, sink, residual)
        return keep_by_score(-keys.norm(dim=-1), budget, first, last)  # low norm first
    if policy == "snapkv":
        first, last = protected(n, budget, sink, max(residual, WINDOW))
        pooled = F.avg_pool1d(score, POOL, stride=1, padding=POOL // 2, count_include_pad=False)
        return keep_by_score(pooled, budget, first, last)
    if policy == "h2o":
        first, last = protected(n, budget, sink, max(residual, budget // 2))
        return keep_by_score(score, budget, first, last)
    raise ValueError(f"unknown eviction policy {policy!r}")


def attention_received(q: torch.Tensor, q_slots: torch.Tensor, keys: torch.Tensor,
                       sm_scale: float) -> torch.Tensor:
    """How much attention each key slot gets from queries q (T, Hq, D) at slots q_slots (T,),
    causally, over keys (H, n, D): probabilities summed over the queries and each KV head's
    query group -> (H, n)."""
    T, Hq, D = q.shape
    H, n, _ = keys.shape
    qg = q.float().view(T, H, Hq // H, D).permute(1, 0, 2, 3).reshape(H, -1, D)  # (H, T*rep, D)
    s = qg @ keys.float().transpose(1, 2) * sm_scale  # (H, T * rep, n)
    visible = torch.arange(n, device=q.device) <= q_slots[:, None]  # (T, n)
    visible = visible.repeat_interleave(Hq // H, 0)  # (T * rep, n)
    p = s.masked_fill(~visible, float("-inf")).softmax(-1)
    return p.sum(1)  # (H, n)


def over_budget(policy: str, slots: int, budget: int, block_size: int) -> bool:
    """Whether a sequence compacts now: when it holds a block more than its budget (snapkv only
    at the end of its prompt, decided by the caller)."""
    if policy == "snapkv":
        return False
    return slots - budget >= block_size


def pool_bytes_bound(budget: int, block_size: int, bytes_per_token: float) -> float:
    """KV bytes a sequence holds at most under eviction (store pool): its budget plus one block."""
    return math.ceil((budget + block_size) / block_size) * block_size * bytes_per_token
