"""Block tables of the paged cache, in plain Python over integers: which blocks each sequence holds,
on which tier, and what one step may allocate. No tensors live here: moving or quantizing a block's
contents is asked of a `BlockData` (the cache), so the bookkeeping reads, and is tested, alone.

A sequence's logical block j holds its tokens j * block_size .. (j + 1) * block_size - 1. A block
starts its life in HOT (full precision) while it must stay exact: the tail while block-wise scales
cannot be computed yet, `sink` blocks, and blocks inside the `residual` window; else in STORE.
`commit` moves finished hot blocks to the store, oldest first. Full store blocks are hashed by their
tokens and the previous block's hash, so a new sequence with a known prefix reuses them.

With offload tiers (HOST, DISK), blocks move down when the device pool is short: which ones is
tiers.py's policy, which the tables ask for room and for a written block's way back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

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
from .tiers import TierPolicy


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
        self.tiers = TierPolicy(self.alloc, self.seqs, data)  # what moves to host and disk

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
            self.tiers.freed(tier, b)

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
        self.tiers.note_step(seq_ids)
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
            b = self.tiers.move(tier, b, STORE)
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
            self.tiers.make_room(need[STORE] - self.free_blocks(), seq_ids)
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

    def placed(self, seq_ids: list[int], tiers: tuple[int, ...]) -> list[PlacedBlock]:
        """Every block of these sequences that lives on `tiers`."""
        out = []
        for row, sid in enumerate(seq_ids):
            for j, (tier, b) in enumerate(self.seqs[sid].blocks):
                if tier in tiers:
                    out.append(PlacedBlock(row=row, logical=j, tier=tier, block=b))
        return out
