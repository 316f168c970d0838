"""Selective caching: eviction policies that keep a budget of N tokens per sequence and KV head.
Pure policy: scores in, kept slots out. The cache does the keeping (cache.PagedKVCache.keep_only).

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

`Policy` says when a sequence compacts and what it keeps; `Scores` holds the attention its slots
received, for snapkv and h2o. Compaction (the cache's) dequantizes a sequence's kept keys and
values, frees all its blocks and stores the kept ones again from slot 0 through the ordinary store
path, so it composes with every format (a per-token code stored again from its own dequantized
value keeps its code), with sinks, residual windows and offload (an evicted block is freed, never
staged).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    n_rep = Hq // H  # query heads per KV head (GQA)
    qg = q.float().view(T, H, n_rep, D).permute(1, 0, 2, 3).reshape(H, -1, D)  # (H, T*rep, D)
    s = qg @ keys.float().transpose(1, 2) * sm_scale  # (H, T * rep, n)
    visible = torch.arange(n, device=q.device) <= q_slots[:, None]  # (T, n)
    visible = visible.repeat_interleave(n_rep, 0)  # (T * rep, n)
    p = s.masked_fill(~visible, float("-inf")).softmax(-1)
    return p.sum(1)  # (H, n)


@dataclass(frozen=True)
class Policy:
    """A spec's `evict=POLICY:N`, with the sinks and residual window it protects: when a sequence
    compacts, which of its queries score, and what it keeps."""
    name: str  # streaming | knorm | snapkv | h2o
    budget: int  # tokens kept per sequence and KV head
    sink: int
    residual: int

    @classmethod
    def from_spec(cls, spec: KVSpec) -> Policy | None:
        """The spec's policy; None when it evicts nothing."""
        if not spec.evict:
            return None
        return cls(name=spec.evict, budget=spec.budget, sink=spec.sink, residual=spec.residual)

    @property
    def scores_attention(self) -> bool:
        """Whether the policy keeps what queries attend to (the cache then tracks Scores)."""
        return self.name in ("snapkv", "h2o")

    def scored_rows(self, start: int, n_new: int, sampled: bool) -> slice | None:
        """Which of a sequence's queries (its n_new packed rows from `start`) add to its scores:
        every query for h2o; for snapkv a prompt's last WINDOW queries, once the prompt is in."""
        rows = slice(start, start + n_new)
        if self.name != "snapkv":
            return rows
        if n_new == 1 or not sampled:
            return None  # decoding appends as usual; a prompt is scored at its end
        return slice(max(rows.start, rows.stop - WINDOW), rows.stop)

    def due(self, slots: int, n_new: int, sampled: bool, block_size: int) -> bool:
        """Whether a sequence holding `slots` compacts after a step that fed it n_new tokens (and
        sampled from it, or not): snapkv once its prompt is in, the others a block over budget."""
        if slots <= self.budget:
            return False
        if self.name == "snapkv":
            return n_new > 1 and sampled
        return slots - self.budget >= block_size

    def keep(self, keys: torch.Tensor, score: torch.Tensor | None) -> torch.Tensor:
        """The slots (L, H, budget), ascending, that a sequence with keys (L, H, n, D) keeps,
        given the attention its slots received (L, H, n) for snapkv and h2o."""
        L, H, n, _ = keys.shape
        kept = select(self.name, n, self.budget, self.sink, self.residual, keys=keys, score=score)
        return kept.expand(L, H, -1)


class Scores:
    """The attention each cached slot has received, per sequence, layer and KV head, for the
    policies that keep what queries attend to: snapkv scores a prompt's last chunk afresh, h2o
    keeps adding up."""

    def __init__(self, policy: Policy, n_layers: int, n_kv_heads: int):
        self.policy, self.n_layers, self.n_kv_heads = policy, n_layers, n_kv_heads
        self.by_seq: dict[int, torch.Tensor] = {}  # (L, H, room >= slots)

    def prepare(self, seq_id: int, slots: int, n_new: int, device: torch.device) -> None:
        """Room for a sequence's `slots` (this step's included) before its queries are scored."""
        if self.policy.name == "snapkv" and n_new == 1:
            return  # decoding appends as usual
        old = self.by_seq.get(seq_id)
        h2o = self.policy.name == "h2o"
        if h2o and old is not None and old.shape[-1] >= slots:
            return
        fresh = torch.zeros(self.n_layers, self.n_kv_heads, 2 * slots, device=device)
        if h2o and old is not None:
            fresh[..., :old.shape[-1]] = old
        self.by_seq[seq_id] = fresh

    def add(self, seq_id: int, layer: int, received: torch.Tensor) -> None:
        """Attention received (H, n) by a sequence's first n slots in one layer."""
        self.by_seq[seq_id][layer, :, :received.shape[-1]] += received

    def get(self, seq_id: int, n: int) -> torch.Tensor | None:
        """The scores (L, H, n) of a sequence's n slots; None if it has none."""
        score = self.by_seq.get(seq_id)
        return None if score is None else score[..., :n]

    def keep_only(self, seq_id: int, kept: torch.Tensor) -> None:
        """The scores of the kept slots (L, H, budget) only, as the cache keeps them."""
        score = self.by_seq.get(seq_id)
        if score is not None:
            self.by_seq[seq_id] = score.gather(-1, kept)

    def forget(self, seq_id: int) -> None:
        self.by_seq.pop(seq_id, None)
