"""The offload policy of the paged cache, in plain Python over integers: which device blocks move
down to the host and disk tiers when the device pool runs short, and back when they are needed.
Moving a block's contents is asked of a `BlockData` (the cache, which asks offload.py).

Full blocks of sequences not in the current step go first, least recently run first; then the
oldest full blocks of the running ones. When the host tier is full its oldest block moves on to
disk. A block comes back to the device when its sequence writes into it again (tables.py) or
eviction reads the sequence (cache.py).
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from .blocks import (
    DISK,
    HOST,
    HOT,
    STORE,
    TIER_NAMES,
    Allocator,
    BlockData,
    PoolExhausted,
    SeqState,
)


class TierPolicy:
    """Least-recently-run offload over the block tables' allocators and sequences (shared with
    tables.BlockTables, which calls `note_step`, `make_room`, `move` and `freed`)."""

    def __init__(self, alloc: dict[int, Allocator], seqs: dict[int, SeqState], data: BlockData):
        self.alloc, self.seqs, self.data = alloc, seqs, data
        self.host_order: OrderedDict[int, None] = OrderedDict()  # host blocks, oldest arrival first
        self.last_step: dict[int, int] = {}  # sequence -> step it last ran, for LRU
        self.step = 0
        self.counts: Counter = Counter()  # blocks moved between tiers

    def note_step(self, seq_ids: list[int]) -> None:
        self.step += 1
        for s in seq_ids:
            self.last_step[s] = self.step

    def freed(self, tier: int, b: int) -> None:
        """A sequence let go of block b on `tier` (its count already dropped)."""
        if tier in (HOST, DISK) and self.alloc[tier].ref[b] == 0:
            self.counts["blocks_freed_offloaded"] += 1
        if tier == HOST and self.alloc[tier].ref[b] == 0:
            self.host_order.pop(b, None)  # a freed host block is no candidate to move on

    def move(self, src_tier: int, src: int, dst_tier: int) -> int:
        """Move one block to another tier; every table that held it follows, its refs too."""
        dst = self.alloc[dst_tier].alloc(TIER_NAMES[dst_tier])
        self.data.copy_block(src_tier, src, dst_tier, dst)
        refs = self.alloc[src_tier].ref[src]
        self.alloc[dst_tier].ref[dst] = refs
        for st in self.seqs.values():
            st.blocks = [(dst_tier, dst) if e == (src_tier, src) else e for e in st.blocks]
        self.alloc[src_tier].forget(src)
        for _ in range(refs):
            self.alloc[src_tier].decref(src)
        if src_tier == HOST:
            self.host_order.pop(src, None)
        if dst_tier == HOST:
            self.host_order[dst] = None
        self.counts[f"blocks_{TIER_NAMES[src_tier]}_to_{TIER_NAMES[dst_tier]}"] += 1
        return dst

    def _move_down(self, b: int) -> None:
        if not self.alloc[HOST].free:
            if DISK not in self.alloc or not self.alloc[DISK].free or not self.host_order:
                self._raise_full()
            self.move(HOST, next(iter(self.host_order)), DISK)
        self.move(STORE, b, HOST)

    def make_room(self, n: int, running: list[int]) -> None:
        """Move n full device blocks down: idle sequences' (least recently run first), then the
        running ones'."""
        idle = [s for s in self.seqs if s not in running]
        idle.sort(key=lambda s: self.last_step.get(s, -1))
        victims: list[int] = []
        for sid in idle + list(running):
            st = self.seqs[sid]
            for tier, b in st.blocks[:st.done]:
                if tier == STORE and b not in victims:
                    victims.append(b)
            if len(victims) >= n:
                break
        if len(victims) < n:
            self._raise_full()
        for b in victims[:n]:
            self._move_down(b)

    def swap_out(self, seq_id: int) -> bool:
        """Preemption by swapping: all of a sequence's own device blocks move down, if room."""
        if HOST not in self.alloc:
            return False
        store = self.alloc[STORE]
        mine = [b for tier, b in self.seqs[seq_id].blocks if tier == STORE and store.ref[b] == 1]
        room = sum(len(self.alloc[t].free) for t in (HOST, DISK) if t in self.alloc)
        if len(mine) > room:
            return False
        for b in mine:
            self._move_down(b)
        self.counts["swapped_out_sequences"] += 1
        return True

    def _raise_full(self) -> None:
        sizes = [f"{TIER_NAMES[t]} {len(a.ref)}" for t, a in self.alloc.items() if t != HOT]
        tiers = ", ".join(sizes)
        raise PoolExhausted(f"KV cache full on every tier (blocks: {tiers}); raise --device-blocks "
                            "or --host-blocks", None)
