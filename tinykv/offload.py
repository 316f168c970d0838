"""Offload tiers for the paged KV cache: host memory, then a disk file, behind the device pool.

Blocks move quantized, with their scales, so offloading an int4 cache moves a quarter of the bytes
of an fp16 one. Attention never brings a whole sequence back: its offloaded blocks are staged,
one layer and `stage_blocks` blocks at a time, into two fixed device buffers in turn (the next
chunk's copy overlaps this chunk's attention: on CUDA from pinned memory on a side stream, see
Stager), and the partial results merged exactly by log-sum-exp with the device part
(kernels.merge_partials).

Policy when the device pool is short: full blocks of sequences not in the current step move down
first, least recently used first; then the oldest full blocks of the running sequences. When the
host tier is full its oldest block moves on to disk. The disk file is checked on every read (size
and a CRC32 per block and layer), so a truncated or altered file is an error, never garbage.
"""

from __future__ import annotations

import os
import tempfile
import zlib
from collections import Counter, OrderedDict
from pathlib import Path

import numpy as np
import torch

from .blocks import DISK, HOST, HOT, STORE, TIER_NAMES, Allocator, PoolExhausted


class OffloadError(RuntimeError):
    """The disk tier file is missing, truncated or altered."""


class HostTier:
    """Blocks in CPU memory (pinned when the device is CUDA): same tensors as the device pool, NB -> n."""

    def __init__(self, like: list[torch.Tensor], n: int, pin: bool):
        self.t = [torch.zeros((x.shape[0], n, *x.shape[2:]), dtype=x.dtype, pin_memory=pin) for x in like]

    def put(self, i: int, src: list[torch.Tensor], b: int) -> None:
        for dst, s in zip(self.t, src):
            dst[:, i].copy_(s[:, b])

    def get(self, i: int, dst: list[torch.Tensor], b: int) -> None:
        for s, d in zip(self.t, dst):
            d[:, b].copy_(s[:, i], non_blocking=True)

    def read_into(self, layer: int, ids: torch.Tensor, outs: list[torch.Tensor]) -> None:
        for t, out in zip(self.t, outs):
            torch.index_select(t[layer], 0, ids, out=out)


class DiskTier:
    """Blocks in one file, memory-mapped as raw bytes; a CRC32 per (tensor, layer, block) guards reads."""

    def __init__(self, like: list[torch.Tensor], n: int, directory: str | Path):
        Path(directory).mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="tinykv-kv-", suffix=".bin", dir=directory)
        os.close(fd)
        self.path = Path(name)
        self.shapes = [(x.shape[0], n, *x.shape[2:]) for x in like]
        self.dtypes = [x.dtype for x in like]
        self.row = [x[0, 0].numel() * x.element_size() for x in like]  # bytes of one (layer, block)
        self.offsets, off = [], 0
        for shape, row in zip(self.shapes, self.row):
            self.offsets.append(off)
            off += shape[0] * n * row
        self.size = off
        with open(self.path, "wb") as f:
            f.truncate(self.size)
        self.mm = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(self.size,))
        self.views = [self.mm[o:o + s[0] * n * r].reshape(s[0], n, r)
                      for o, s, r in zip(self.offsets, self.shapes, self.row)]
        self.crc: dict[tuple[int, int, int], int] = {}

    def _check_file(self) -> None:
        if not self.path.exists() or self.path.stat().st_size != self.size:
            raise OffloadError(f"KV disk tier file {self.path} is missing or truncated")

    def put(self, i: int, src: list[torch.Tensor], b: int) -> None:
        for k, (v, s) in enumerate(zip(self.views, src)):
            raw = s[:, b].contiguous().cpu().view(torch.uint8).reshape(s.shape[0], -1).numpy()
            v[:, i] = raw
            for layer in range(raw.shape[0]):
                self.crc[k, layer, i] = zlib.crc32(raw[layer].tobytes())
        self.mm.flush()

    def _rows(self, k: int, layer: int, ids: list[int]) -> torch.Tensor:
        self._check_file()
        raw = np.ascontiguousarray(self.views[k][layer, ids])
        for r, i in zip(raw, ids):
            if zlib.crc32(r.tobytes()) != self.crc[k, layer, i]:
                raise OffloadError(f"KV disk tier file {self.path} was altered (block {i}, layer {layer})")
        shape = (len(ids), *self.shapes[k][2:])
        return torch.from_numpy(raw).view(self.dtypes[k]).reshape(shape)

    def get(self, i: int, dst: list[torch.Tensor], b: int) -> None:
        for k, d in enumerate(dst):
            rows = torch.stack([self._rows(k, layer, [i])[0] for layer in range(d.shape[0])])
            d[:, b].copy_(rows)

    def read_into(self, layer: int, ids: torch.Tensor, outs: list[torch.Tensor]) -> None:
        for k, out in enumerate(outs):
            out.copy_(self._rows(k, layer, ids.tolist()))

    def close(self) -> None:
        del self.views, self.mm
        self.path.unlink(missing_ok=True)


class Stager:
    """Two fixed staging buffers on the device: chunk i+1 is copied into one while chunk i is attended in
    the other. On CUDA the rows are first gathered into pinned host memory and copied on a side stream;
    events order each copy after the attention that last read its buffer, and each attention after its
    copy. Elsewhere (CPU) the copies are plain, but the slots alternate the same way."""

    def __init__(self, like: list[torch.Tensor], n: int, device: torch.device):
        self.cuda = device.type == "cuda"
        shapes = [((n, *t.shape[2:]), t.dtype) for t in like]
        self.dev = [[torch.zeros(s, dtype=d, device=device) for s, d in shapes] for _ in range(2)]
        self.host = [[torch.zeros(s, dtype=d, pin_memory=True) for s, d in shapes] for _ in range(2)] \
            if self.cuda else self.dev
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.copied: list = [None, None]  # per slot: the copy stream is done with it (host side free, data ready)
        self.read: list = [None, None]  # per slot: attention has finished reading the device buffer

    def fill(self, slot: int, n: int, gather) -> list[torch.Tensor]:
        """gather(host buffers) writes n rows; returns the slot's device buffers (data in flight on CUDA)."""
        if not self.cuda:
            gather([b[:n] for b in self.dev[slot]])
            return self.dev[slot]
        if self.copied[slot] is not None:
            self.copied[slot].synchronize()  # the pinned buffer's last upload has left it
        gather([b[:n] for b in self.host[slot]])
        with torch.cuda.stream(self.stream):
            if self.read[slot] is not None:
                self.stream.wait_event(self.read[slot])
            for d, h in zip(self.dev[slot], self.host[slot]):
                d[:n].copy_(h[:n], non_blocking=True)
            self.copied[slot] = torch.cuda.Event()
            self.copied[slot].record(self.stream)
        return self.dev[slot]

    def attend(self, slot: int, fn, *args):
        """fn(*args), an attention over the slot's buffers, once their copy has landed; note when it is done."""
        if not self.cuda:
            return fn(*args)
        torch.cuda.current_stream().wait_event(self.copied[slot])
        out = fn(*args)
        self.read[slot] = torch.cuda.Event()
        self.read[slot].record(torch.cuda.current_stream())
        return out


class Offloader:
    """The host and disk tiers of one PagedKVCache, and the staged attention over them."""

    def __init__(self, cache, host_blocks: int, disk_dir: str | None = None, disk_blocks: int = 0,
                 stage_blocks: int = 64):
        self.cache = cache
        dev = torch.device(cache.device)
        self.tensors = cache.block_tensors()  # device pool tensors whose dim 1 is the block
        self.tiers = {HOST: HostTier(self.tensors, host_blocks, pin=dev.type == "cuda")}
        cache.alloc[HOST] = Allocator(host_blocks)
        if disk_dir and disk_blocks:
            self.tiers[DISK] = DiskTier(self.tensors, disk_blocks, disk_dir)
            cache.alloc[DISK] = Allocator(disk_blocks)
        self.order: OrderedDict[int, None] = OrderedDict()  # host blocks, oldest arrival first
        self.stage_blocks = stage_blocks
        self.stager = Stager(self.tensors, stage_blocks, dev)
        self.block_bytes = sum(t[0, 0].nbytes for t in self.tensors) * self.tensors[0].shape[0]
        self.counts: Counter = Counter()
        self.last_step: dict[int, int] = {}  # seq -> step it last ran, for LRU
        self.step = 0

    # ---- moving whole blocks (all layers) -----------------------------------------------------------
    def _move(self, src_pool: int, src: int, dst_pool: int) -> int:
        """Copy one block down (or up) a tier, retarget every table that held it, free the source."""
        c = self.cache
        dst = c.alloc[dst_pool].alloc(TIER_NAMES[dst_pool])
        if src_pool == STORE:
            self.tiers[dst_pool].put(dst, self.tensors, src)
        elif dst_pool == STORE:
            self.tiers[src_pool].get(src, self.tensors, dst)
        else:  # host -> disk, through the host tensors
            self.tiers[dst_pool].put(dst, self.tiers[src_pool].t, src)
        refs = c.alloc[src_pool].ref[src]
        c.alloc[dst_pool].ref[dst] = refs  # every sharer follows the block
        for st in c.seqs.values():
            st.blocks = [(dst_pool, dst) if e == (src_pool, src) else e for e in st.blocks]
        c.alloc[src_pool].forget(src)
        for _ in range(refs):
            c.alloc[src_pool].decref(src)
        if src_pool == HOST:
            self.order.pop(src, None)
        if dst_pool == HOST:
            self.order[dst] = None
        self.counts[f"blocks_{TIER_NAMES[src_pool]}_to_{TIER_NAMES[dst_pool]}"] += 1
        self.counts[f"bytes_{TIER_NAMES[src_pool]}_to_{TIER_NAMES[dst_pool]}"] += self.block_bytes
        return dst

    def _evict_one(self, b: int) -> None:
        if not self.cache.alloc[HOST].free:
            if DISK not in self.tiers or not self.cache.alloc[DISK].free or not self.order:
                raise_full(self.cache)
            self._move(HOST, next(iter(self.order)), DISK)
        self._move(STORE, b, HOST)

    def make_room(self, n: int, running: list[int]) -> None:
        """Move n full device blocks down: idle sequences' (least recently run first), then running ones'."""
        c = self.cache
        idle = sorted((s for s in c.seqs if s not in running), key=lambda s: self.last_step.get(s, -1))
        victims: list[int] = []
        for sid in idle + list(running):
            st = c.seqs[sid]
            victims += [b for pool, b in st.blocks[:st.done] if pool == STORE and b not in victims]
            if len(victims) >= n:
                break
        if len(victims) < n:
            raise_full(c)
        for b in victims[:n]:
            self._evict_one(b)

    def swap_out(self, sid: int) -> bool:
        """Preemption by swapping: move all of a sequence's device blocks down, if the tiers have room."""
        c = self.cache
        mine = [b for pool, b in c.seqs[sid].blocks if pool == STORE and c.alloc[STORE].ref[b] == 1]
        if len(mine) > sum(len(c.alloc[p].free) for p in self.tiers):
            return False
        for b in mine:
            self._evict_one(b)
        self.counts["swapped_out_sequences"] += 1
        return True

    def swap_in(self, st, j: int) -> None:
        """Bring logical block j of a sequence back to the device (it is about to be written)."""
        pool, b = st.blocks[j]
        if pool in (HOST, DISK):
            self._move(pool, b, STORE)

    def note_step(self, seq_ids: list[int]) -> None:
        self.step += 1
        for s in seq_ids:
            self.last_step[s] = self.step
        self.counts["peak_device_blocks"] = max(self.counts["peak_device_blocks"], self.cache.blocks_used)

    # ---- staged attention ---------------------------------------------------------------------------
    def plan_chunks(self, seq_ids: list[int], mb: int, one_pass: bool) -> list[tuple[torch.Tensor, dict]]:
        """This step's offloaded blocks as chunks: (table (B, MB) of slots in a staging buffer, ids per tier).

        `one_pass` (the CPU torch path, where host memory is the device's memory anyway): a single chunk
        that also holds the resident blocks, so attention is one pass over exactly the same dense K/V as
        without offload, and the results are bitwise identical. Otherwise chunks of `stage_blocks`.
        """
        tiers = (STORE, HOST, DISK) if one_pass else (HOST, DISK)
        entries = [(row, j, pool, b) for row, sid in enumerate(seq_ids)
                   for j, (pool, b) in enumerate(self.cache.seqs[sid].blocks) if pool in tiers]
        staged = sum(e[2] != STORE for e in entries)
        if not staged:
            return []
        self.counts["blocks_read_staged"] += staged
        self.counts["blocks_read_on_device"] += sum(pool == STORE for sid in seq_ids
                                                    for pool, _ in self.cache.seqs[sid].blocks)
        size = len(entries) if one_pass else self.stage_blocks
        chunks = []
        for c0 in range(0, len(entries), size):
            table = torch.full((len(seq_ids), mb), -1, dtype=torch.int32)
            ids: dict[int, list[int]] = {pool: [] for pool in tiers}
            slot = 0
            for pool in tiers:  # slots: resident blocks first, then host, then disk
                for row, j, pl, b in entries[c0:c0 + size]:
                    if pl == pool:
                        table[row, j] = slot
                        ids[pool].append(b)
                        slot += 1
            chunks.append((table.to(self.cache.device), ids))
        return chunks

    def attend_parts(self, layer: int, q: torch.Tensor, plan, fn, sm: float) -> list:
        """Partial attention (o, lse) over each chunk of offloaded blocks, for one layer."""
        chunks = plan.offload_chunks
        attend = lambda table, bufs: fn(q, plan.q_seq, plan.positions, *self.cache.layer_views(layer, bufs),
                                        table, plan.ctx_lens, sm)
        if STORE in chunks[0][1]:  # one pass: a buffer the size of this step's blocks
            (table, ids), = chunks
            bufs = [torch.empty((sum(map(len, ids.values())), *t.shape[2:]), dtype=t.dtype) for t in self.tensors]
            self._gather(layer, ids, bufs)
            return [attend(table, bufs)]
        parts = []
        fill = lambda i: self.stager.fill(i % 2, sum(map(len, chunks[i][1].values())),
                                          lambda outs: self._gather(layer, chunks[i][1], outs))
        bufs = fill(0)
        for i, (table, _) in enumerate(chunks):
            nxt = fill(i + 1) if i + 1 < len(chunks) else None  # this copy overlaps the attention below
            parts.append(self.stager.attend(i % 2, attend, table, bufs))
            bufs = nxt
        return parts

    def _gather(self, layer: int, ids: dict[int, list[int]], outs: list[torch.Tensor]) -> None:
        """One layer's rows of the listed blocks, tier after tier (the order plan_chunks numbered them)."""
        at = 0
        for pool, lst in ids.items():
            if not lst:
                continue
            rows = [o[at:at + len(lst)] for o in outs]
            idx = torch.tensor(lst)
            if pool == STORE:
                for t, r in zip(self.tensors, rows):  # one pass: only on the CPU, where the pool is
                    torch.index_select(t[layer], 0, idx, out=r)
            else:
                self.tiers[pool].read_into(layer, idx, rows)
                self.counts[f"bytes_{TIER_NAMES[pool]}_to_device"] += sum(r.nbytes for r in rows)
            at += len(lst)

    def stats(self) -> dict:
        c = self.cache
        out = dict(self.counts)
        out["host_blocks_used"] = len(c.alloc[HOST].ref) - len(c.alloc[HOST].free)
        out["disk_blocks_used"] = len(c.alloc[DISK].ref) - len(c.alloc[DISK].free) if DISK in c.alloc else 0
        return out

    def close(self) -> None:
        if DISK in self.tiers:
            self.tiers[DISK].close()


def raise_full(cache) -> None:
    tiers = ", ".join(f"{TIER_NAMES[p]} {len(a.ref)}" for p, a in cache.alloc.items() if p != HOT)
    raise PoolExhausted(f"KV cache full on every tier (blocks: {tiers}); raise --device-blocks or --host-blocks",
                        None)

