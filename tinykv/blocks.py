"""Block bookkeeping for the paged cache, plain Python over integers: the allocator (free list,
reference counts, prefix hashes) and each sequence's block table. No tensors live here.

A block id means something only together with its pool: STORE (the device pool in the spec's
storage format), HOT (full-precision device blocks), HOST and DISK (offload tiers, offload.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

STORE, HOT, HOST, DISK = 0, 1, 2, 3
TIER_NAMES = {STORE: "device", HOT: "full-precision", HOST: "host", DISK: "disk"}


class CacheError(ValueError):
    """A cache that cannot be built as asked (size, memory, kernel); one line."""


class PoolExhausted(RuntimeError):
    """No free block is left in a pool (`pool`: STORE, HOT, or None when every tier is full)."""

    def __init__(self, msg: str, pool: int | None = STORE):
        super().__init__(msg)
        self.pool = pool


class BlockData(Protocol):
    """What the block tables ask of whoever holds the blocks' contents (the cache)."""

    def copy_block(self, src_tier: int, src: int, dst_tier: int, dst: int) -> None: ...

    def quantize_hot(self, hot_block: int, store_block: int) -> None: ...


class Allocator:
    """Free list + reference counts over block ids; a freed block stays findable by hash until it
    is reused."""

    def __init__(self, n: int):
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(n))
        self.ref = [0] * n
        self.hash_of: dict[int, int] = {}  # block -> content hash, for blocks registered in `table`
        self.table: dict[int, int] = {}  # content hash -> block

    def alloc(self, what: str) -> int:
        if not self.free:
            raise PoolExhausted(f"KV block pool exhausted: all {len(self.ref)} {what} blocks are "
                                "in use", None)
        # oldest freed first: recently freed prefixes stay findable longer
        b, _ = self.free.popitem(last=False)
        self.forget(b)
        self.ref[b] = 1
        return b

    def incref(self, b: int) -> None:
        if self.ref[b] == 0:
            del self.free[b]
        self.ref[b] += 1

    def decref(self, b: int) -> None:
        self.ref[b] -= 1
        assert self.ref[b] >= 0, "block freed twice"
        if self.ref[b] == 0:
            self.free[b] = None

    def forget(self, b: int) -> None:
        """The block's contents are leaving: it can no longer be found by hash."""
        if b in self.hash_of:
            del self.table[self.hash_of.pop(b)]

    def register(self, b: int, h: int) -> None:
        if h not in self.table and b not in self.hash_of:
            self.table[h], self.hash_of[b] = b, h


@dataclass
class SeqState:
    blocks: list[tuple[int, int]] = field(default_factory=list)  # (tier, block) per logical block
    tokens: list[int] = field(default_factory=list)  # token ids written so far
    done: int = 0  # leading blocks that are final: quantized into the store (or sinks)
    last_hash: int | None = 0  # hash of the token prefix up to block `done` (chains block hashes)
    evicted: int = 0  # tokens dropped by eviction: slots in the cache = len(tokens) - evicted

    @property
    def slots(self) -> int:
        """Cache slots in use: slot i of logical block j is slot j * block_size + i."""
        return len(self.tokens) - self.evicted
