"""One forward step's `Plan`: where its tokens live in the paged cache (cache.PagedKVCache.plan
makes it), and the model-cache protocol over it (model.KVStep): `attend(layer, q, k, v)` in
each layer, or, where the step asks nothing but the CPU kernels' store and attention, `direct`:
the same as numpy calls, layer by layer (gemv_layer.layers_cpu takes them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .blocks import HOT, STORE
from .offload import StagedChunk
from .pools import SlotIndex


@dataclass
class Plan:
    """Everything one forward step needs to know about where its tokens live. It implements the
    model's cache protocol (model.KVStep): `attend(layer, q, k, v)` stores this step's keys and
    values, then attends over everything the step's sequences have cached."""
    cache: Any  # the cache.PagedKVCache that made it (cache.py imports this module)
    seq_ids: list[int]
    positions: torch.Tensor  # (N,) absolute position of every packed token (RoPE)
    q_slots: torch.Tensor  # (N,) its slot in the cache: it attends to slots <= this one
    q_seq: torch.Tensor  # (N,) row of the sequence each token belongs to
    ctx_lens: torch.Tensor  # (B,) slots each sequence holds after this step
    tables: dict[int, torch.Tensor]  # pool -> (B, MB) block ids, -1 where a block is elsewhere
    slots: dict[int, SlotIndex]  # pool -> where this step's tokens are written
    logits_idx: torch.Tensor | None  # packed rows whose logits are wanted (None: all)
    offload_chunks: list[StagedChunk] = field(default_factory=list)  # offloaded blocks, staged
    n_new: list[int] = field(default_factory=list)  # tokens each sequence feeds this step
    sampled: list[bool] = field(default_factory=list)  # whose last token's logits are wanted

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (N, Hq, D), k, v (N, H, D) -> o (N, Hq, D).

        `:center`, `:smooth` and `:rot` transform keys (after RoPE), queries and values before
        they reach the pools and the kernels, and the output after (quant.Transform): scores and
        outputs are unchanged in exact arithmetic, and every kernel serves them as is."""
        transform, apply = self.cache.transforms[layer], self.cache.kernels.head_map
        q, k, v = transform.queries(q, apply), transform.keys(k, apply), transform.values(v, apply)
        self.cache.pools.write(layer, k, v, self.slots)  # k, v (N, H, D); q (N, Hq, D)
        o = self.cache.attend(layer, q, self)  # (N, Hq, D)
        if self.cache.scores is not None:  # policies that keep what queries attend to
            self.cache.score_attention(layer, q, self)
        return transform.output(o, apply)

    def direct(self) -> Callable | None:
        """`attend` in numpy, `(layer, q, k, v) -> o (N, Hq * D)`, as the kernels' direct calls
        (kernels.cpu_direct) where the step asks nothing else of the cache: every token written
        to one pool (the store, or hot blocks), attention over the store and the hot blocks, no
        offloaded chunks or eviction scores; None otherwise (then `attend`)."""
        cache = self.cache
        if cache.kernels.direct is None or cache.scores is not None or self.offload_chunks \
                or STORE not in self.tables or not set(self.tables) <= {STORE, HOT} \
                or len(self.slots) != 1:
            return None
        (target, (every, blk, off)), = self.slots.items()
        if target not in self.tables or not isinstance(every, slice):  # some go elsewhere
            return None
        pools = cache.pools
        layers = {STORE: pools.views, HOT: pools.hot_views}
        transforms = None if all(t.identity for t in cache.transforms) else cache.transforms
        cfg = cache.cfg
        return cache.kernels.direct(self.q_seq, self.q_slots, self.ctx_lens,
                                    [(table, layers[pool]) for pool, table in self.tables.items()],
                                    list(self.tables).index(target), blk, off, cfg.n_heads,
                                    cfg.head_dim, cache.sm_scale,
                                    pools.add_saturated if target == STORE else None, transforms)
