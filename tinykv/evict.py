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

import torch
import torch.nn.functional as F

from .spec import KVSpec

WINDOW = 32  # snapkv's observation window: the prompt's last queries
# snapkv pools scores over this many neighbouring slots, so kept tokens come in runs: a question
# attends to where a fact starts, and the fact runs on for several tokens (a five-digit pass key
# is five tokens after the one attended). With 7, SmolLM2 recalled the first digits of a kept key
# and lost the rest (2/5 at a 25% budget of 2,000 tokens); with 15 it recalls 5/5.
POOL = 15


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


class Evictor:
    """One cache's eviction: the scores a policy keeps per sequence, and when to compact. It reads
    and rewrites a sequence through the cache's public parts (seq_kv, layer_kv, tables, pools)."""

    def __init__(self, spec: KVSpec, n_layers: int, n_kv_heads: int):
        self.spec, self.n_layers, self.n_kv_heads = spec, n_layers, n_kv_heads
        self.scores: dict[int, torch.Tensor] = {}  # attention received (L, H, room >= slots)

    def forget(self, seq_id: int) -> None:
        self.scores.pop(seq_id, None)

    def prepare(self, cache, seq_ids: list[int], n_new: list[int]) -> None:
        """Room in the score buffers for this step's slots: snapkv scores a prompt's last chunk
        afresh, h2o keeps adding up."""
        policy = self.spec.evict
        if policy not in ("snapkv", "h2o"):
            return
        for sid, n in zip(seq_ids, n_new):
            if policy == "snapkv" and n == 1:
                continue  # decoding appends as usual
            slots = cache.slots(sid)
            old = self.scores.get(sid)
            if policy == "h2o" and old is not None and old.shape[-1] >= slots:
                continue
            fresh = torch.zeros(self.n_layers, self.n_kv_heads, 2 * slots, device=cache.device)
            if policy == "h2o" and old is not None:
                fresh[..., :old.shape[-1]] = old
            self.scores[sid] = fresh

    def observe(self, cache, layer: int, q: torch.Tensor, plan) -> None:
        """Attention each cached slot receives from this step's queries q (N, Hq, D), per
        sequence and KV head: accumulated for h2o; for snapkv, from a prompt's last queries."""
        policy = self.spec.evict
        if policy not in ("snapkv", "h2o"):
            return
        start = 0
        for row, (sid, n_new) in enumerate(zip(plan.seq_ids, plan.n_new)):
            rows = slice(start, start + n_new)
            start += n_new
            if policy == "snapkv":
                if n_new == 1 or not plan.sampled[row]:
                    continue  # a prompt is scored at its end, by its last WINDOW queries
                rows = slice(max(rows.start, rows.stop - WINDOW), rows.stop)
            n = int(plan.ctx_lens[row])
            tables = {tier: t[row:row + 1] for tier, t in plan.tables.items()}
            keys = cache.layer_kv(layer, 0, tables)[:, :n]  # (H, n, D)
            got = attention_received(q[rows], plan.q_slots[rows], keys, cache.sm_scale)
            self.scores[sid][layer, :, :n] += got  # (H, n)

    def after_step(self, cache, plan) -> None:
        """Compact the step's sequences that went over budget (snapkv: once a prompt is in)."""
        budget = self.spec.budget
        for sid, n_new, sampled in zip(plan.seq_ids, plan.n_new, plan.sampled):
            slots = cache.slots(sid)
            if slots <= budget:
                continue
            prompt_in = self.spec.evict == "snapkv" and n_new > 1 and sampled
            if prompt_in or over_budget(self.spec.evict, slots, budget, cache.bs):
                self.compact(cache, sid)

    def compact(self, cache, seq_id: int) -> None:
        """Keep the budget per layer and KV head; give every other block back to the pool."""
        spec = self.spec
        k, v = cache.seq_kv(seq_id)  # (L, H, n, D)
        L, H, n, D = k.shape
        score = self.scores.get(seq_id)
        if score is not None:
            score = score[..., :n]  # (L, H, n)
        keep = select(spec.evict, n, spec.budget, spec.sink, spec.residual, keys=k, score=score)
        keep = keep.expand(L, H, -1)  # (L, H, budget), ascending
        idx = keep[..., None].expand(-1, -1, -1, D)
        k, v = k.gather(2, idx), v.gather(2, idx)  # (L, H, budget, D)
        step = cache.step_slots(cache.tables.rewrite(seq_id, spec.budget))
        for layer in range(L):
            cache.pools.write(layer, k[layer].transpose(0, 1), v[layer].transpose(0, 1), step)
        cache.tables.commit([seq_id])
        if score is not None:
            self.scores[seq_id] = score.gather(-1, keep)
