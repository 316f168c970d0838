"""Block tables of the paged cache, in plain Python over integers: which blocks each sequence holds,
on which tier, and what one step may allocate. No tensors live here: moving or quantizing a block's
contents is asked of a `BlockData` (the cache), so the bookkeeping reads, and is tested, alone.

A sequence's logical block j holds its tokens j * block_size .. (j + 1) * block_size - 1. A block
starts its life in HOT (full precision) while it must stay exact: the tail while block-wise scales
cannot be computed yet, `sink` blocks, and blocks inside the `residual` window; else in STORE.
`commit` moves finished hot blocks to the store, oldest first. Full store blocks are hashed by their
tokens and the previous block's hash, so a new sequence with a known prefix reuses them.

With offload tiers (HOST, DISK), blocks move down when the device pool is short: full blocks of
sequences not in the current step first, least recently run first; then the oldest full blocks of
the running ones. When the host tier is full its oldest block moves on to disk.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from .blocks import DISK, HOST, HOT, STORE, TIER_NAMES, Allocator, PoolExhausted, SeqState


class BlockData(Protocol):
    """What the tables ask of whoever holds the blocks' contents."""

    def copy_block(self, src_tier: int, src: int, dst_tier: int, dst: int) -> None: ...

    def quantize_hot(self, hot_block: int, store_block: int) -> None: ...


class SlotRows(NamedTuple):
    """The step's tokens that go to one pool, one entry per token."""
    token: list[int]  # index of the token in the step's packed batch
    block: list[int]  # block id in the pool
    offset: list[int]  # slot within the block


class PlacedBlock(NamedTuple):
    """Where one logical block of a sequence in a step lives."""
    row: int  # the sequence's row in the step
    logical: int  # the block's index in the sequence (its tokens logical * block_size ...)
    tier: int  # STORE, HOT, HOST or DISK
    block: int  # block id on that tier


@dataclass
class Slots:
    """Where one step's new tokens go, per pool, and where they sit in their sequences."""
    rows: dict[int, SlotRows]  # pool (STORE, HOT) -> the tokens written there
    positions: list[int]  # absolute position of every packed token (RoPE)
    q_slots: list[int]  # its cache slot: it sees the slots up to this one (= position unevicted)
    q_seq: list[int]  # row (sequence) of every packed token
    n_tokens: int


class BlockTables:
    """Every sequence's blocks, on every tier, and the allocators they come from."""

    def __init__(self, *, num_blocks: int, n_hot: int, block_size: int, sink: int, residual: int,
                 needs_tail: bool, data: BlockData, host_blocks: int = 0, disk_blocks: int = 0):
        self.bs, self.data = block_size, data
        self.sink_blocks = math.ceil(sink / block_size)
        self.res_blocks = math.ceil(residual / block_size)
        self.residual, self.needs_tail = residual, needs_tail
        self.alloc = {STORE: Allocator(num_blocks), HOT: Allocator(n_hot)}
        if host_blocks:
            self.alloc[HOST] = Allocator(host_blocks)
        if disk_blocks:
            self.alloc[DISK] = Allocator(disk_blocks)
        self.seqs: dict[int, SeqState] = {}
        self.peak_blocks = 0
        self.host_order: OrderedDict[int, None] = OrderedDict()  # host blocks, oldest arrival first
        self.last_step: dict[int, int] = {}  # sequence -> step it last ran, for LRU
        self.step = 0
        self.counts: Counter = Counter()  # blocks moved between tiers

    # ---- sizes ----------------------------------------------------------------------------------
    def free_blocks(self, tier: int = STORE) -> int:
        return len(self.alloc[tier].free)

    def used_blocks(self, tier: int = STORE) -> int:
        return len(self.alloc[tier].ref) - len(self.alloc[tier].free)

    def free_everywhere(self) -> int:
        """Free blocks on every tier a sequence may occupy (device, host, disk)."""
        return sum(len(a.free) for tier, a in self.alloc.items() if tier != HOT)

    def blocks_needed(self, seq_id: int, n_new: int) -> int:
        """Store blocks a step of n_new tokens may allocate (upper bound, for the scheduler)."""
        n = self.seqs[seq_id].slots if seq_id in self.seqs else 0
        return math.ceil((n + n_new) / self.bs) - n // self.bs + 1

    # ---- sequences ------------------------------------------------------------------------------
    def add_sequence(self, seq_id: int, prompt: list[int] | None = None) -> int:
        """Start a sequence; returns how many prompt tokens are already cached (shared prefix)."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} exists")
        st = self.seqs[seq_id] = SeqState()
        if self.sink_blocks:  # sinks are per-sequence full precision: nothing after them is shared
            st.last_hash = None
            return 0
        store = self.alloc[STORE]
        h = 0
        n_full = (len(prompt or []) - 1) // self.bs  # keep >= 1 prompt token to compute logits from
        for j in range(max(n_full, 0)):
            toks = prompt[j * self.bs:(j + 1) * self.bs]
            h = hash((h, tuple(toks)))
            b = store.table.get(h)
            if b is None:
                break
            store.incref(b)
            st.blocks.append((STORE, b))
            st.tokens += toks
            st.done += 1
            st.last_hash = h
        return len(st.tokens)

    def fork(self, src: int, dst: int) -> None:
        """dst shares all of src's blocks; the first write to a shared block copies it."""
        s = self.seqs[src]
        for tier, b in s.blocks:
            self.alloc[tier].incref(b)
        self.seqs[dst] = SeqState(blocks=list(s.blocks), tokens=list(s.tokens), done=s.done,
                                  last_hash=s.last_hash, evicted=s.evicted)

    def free(self, seq_id: int) -> None:
        for tier, b in self.seqs.pop(seq_id).blocks:
            self.alloc[tier].decref(b)
            if tier in (HOST, DISK) and self.alloc[tier].ref[b] == 0:
                self.counts["blocks_freed_offloaded"] += 1
            if tier == HOST and self.alloc[tier].ref[b] == 0:
                self.host_order.pop(b, None)  # a freed host block is no candidate to move on

    def _first_tier(self, j: int) -> int:
        """Where logical block j starts its life."""
        if self.needs_tail or j < self.sink_blocks or self.res_blocks > 0:
            return HOT
        return STORE

    # ---- one step -------------------------------------------------------------------------------
    def assign(self, seq_ids: list[int], new_tokens: list[list[int]]) -> Slots:
        """Give every new token a slot: allocate blocks, bring a written block home, copy it if
        shared.
        Raises PoolExhausted, having changed nothing, when the step (and its commit) may not fit."""
        self._check_room(seq_ids, new_tokens)
        self._note_step(seq_ids)
        rows = {STORE: SlotRows([], [], []), HOT: SlotRows([], [], [])}
        positions, q_slots, q_seq, n = [], [], [], 0
        for row, (sid, toks) in enumerate(zip(seq_ids, new_tokens)):
            st = self.seqs[sid]
            start = st.slots
            for i in range(len(toks)):
                slot = start + i
                j, off = divmod(slot, self.bs)
                if j == len(st.blocks):
                    tier = self._first_tier(j)
                    st.blocks.append((tier, self.alloc[tier].alloc(TIER_NAMES[tier])))
                elif i == 0:  # the first write into an existing block
                    self._make_writable(st, j)
                tier, b = st.blocks[j]
                rows[tier].token.append(n)
                rows[tier].block.append(b)
                rows[tier].offset.append(off)
                positions.append(len(st.tokens) + i)
                q_slots.append(slot)
                q_seq.append(row)
                n += 1
            st.tokens += toks
        self.peak_blocks = max(self.peak_blocks, self.used_blocks())
        return Slots(rows=rows, positions=positions, q_slots=q_slots, q_seq=q_seq, n_tokens=n)

    def _make_writable(self, st: SeqState, j: int) -> None:
        tier, b = st.blocks[j]
        if tier in (HOST, DISK):  # offloaded: bring it back to the device
            b = self.move(tier, b, STORE)
            tier = STORE
        if self.alloc[tier].ref[b] > 1:  # shared (a fork, a prefix): copy on write
            nb = self.alloc[tier].alloc(TIER_NAMES[tier])
            self.data.copy_block(tier, b, tier, nb)
            self.alloc[tier].decref(b)
            st.blocks[j] = (tier, nb)

    def _check_room(self, seq_ids: list[int], new_tokens: list[list[int]]) -> None:
        need = {STORE: 0, HOT: 0}
        for sid, toks in zip(seq_ids, new_tokens):
            st = self.seqs[sid]
            n0, n1 = st.slots, st.slots + len(toks)
            if n0 % self.bs and st.blocks:  # copy-on-write of a shared tail block, or its swap-in
                tier, b = st.blocks[-1]
                shared_or_away = self.alloc[tier].ref[b] > 1 or tier in (HOST, DISK)
                need[HOT if tier == HOT else STORE] += shared_or_away
            for j in range(st.done, math.ceil(n1 / self.bs)):
                if j < len(st.blocks):
                    tier = st.blocks[j][0]
                else:
                    tier = self._first_tier(j)
                    need[tier] += 1
                # commit will quantize this hot block into the store: full, no sink, out of
                # the window
                full_and_old = (j + 1) * self.bs <= n1 - self.residual
                need[STORE] += tier == HOT and j >= self.sink_blocks and full_and_old
        if HOST in self.alloc and need[STORE] > self.free_blocks():
            self.make_room(need[STORE] - self.free_blocks(), seq_ids)
        for tier in (STORE, HOT):
            free = self.free_blocks(tier)
            if need[tier] > free:
                raise PoolExhausted(f"KV block pool exhausted: this step needs {need[tier]} "
                                    f"{TIER_NAMES[tier]} blocks, {free} of "
                                    f"{len(self.alloc[tier].ref)} are free", tier)

    def table_rows(self, seq_ids: list[int], tier: int) -> list[list[int]]:
        """(B, MB) block ids of `tier` per sequence, -1 where a block is elsewhere."""
        width = max(len(self.seqs[s].blocks) for s in seq_ids)
        rows = []
        for sid in seq_ids:
            row = [-1] * width
            for j, (t, b) in enumerate(self.seqs[sid].blocks):
                if t == tier:
                    row[j] = b
            rows.append(row)
        return rows

    def commit(self, seq_ids: list[int]) -> None:
        """After a step: quantize hot blocks that need full precision no more; hash full blocks."""
        for sid in seq_ids:
            st = self.seqs[sid]
            n = st.slots
            while st.done < n // self.bs:  # blocks become final in order, oldest first
                j = st.done
                tier, b = st.blocks[j]
                in_window = (j + 1) * self.bs > n - self.residual
                if tier == HOT and j >= self.sink_blocks and in_window:
                    break  # still inside the residual window (or the tail awaiting its scales)
                st.done += 1
                if j < self.sink_blocks:
                    continue  # sinks stay in full precision for good
                h = None
                if not self.sink_blocks and not st.evicted:  # an evicted block is no prefix
                    h = hash((st.last_hash, tuple(st.tokens[j * self.bs:(j + 1) * self.bs])))
                if tier == HOT:
                    st.blocks[j] = (STORE, self._to_store(b, h))
                elif h is not None:
                    self.alloc[STORE].register(b, h)
                st.last_hash = h

    def _to_store(self, hot_b: int, h: int | None) -> int:
        """Quantize one hot block into the store (or share an identical block already there)."""
        store = self.alloc[STORE]
        b = None if h is None else store.table.get(h)
        if b is not None:
            store.incref(b)
        else:
            b = store.alloc("KV")
            self.data.quantize_hot(hot_b, b)
            if h is not None:
                store.register(b, h)
        self.alloc[HOT].decref(hot_b)
        return b

    def rewrite(self, seq_id: int, n: int) -> Slots:
        """Eviction: the sequence gives up every block and gets fresh slots 0..n-1 for the n
        tokens it keeps (the caller stores them); its other tokens count as evicted."""
        st = self.seqs[seq_id]
        for tier, b in st.blocks:
            self.alloc[tier].decref(b)
        tokens = st.tokens
        st.blocks, st.tokens, st.done, st.last_hash, st.evicted = [], [], 0, None, 0
        slots = self.assign([seq_id], [[0] * n])
        st.tokens = tokens
        st.evicted = len(tokens) - n
        return slots

    # ---- offload policy -------------------------------------------------------------------------
    def _note_step(self, seq_ids: list[int]) -> None:
        self.step += 1
        for s in seq_ids:
            self.last_step[s] = self.step

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

    def placed(self, seq_ids: list[int], tiers: tuple[int, ...]) -> list[PlacedBlock]:
        """Every block of these sequences that lives on `tiers`."""
        out = []
        for row, sid in enumerate(seq_ids):
            for j, (tier, b) in enumerate(self.seqs[sid].blocks):
                if tier in tiers:
                    out.append(PlacedBlock(row=row, logical=j, tier=tier, block=b))
        return out
