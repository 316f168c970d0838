"""Offload tiers for the paged KV cache: host memory, then a disk file, behind the device pool.

Blocks move quantized, with their scales, so offloading an int4 cache moves a quarter of the bytes
of an fp16 one. Attention never brings a whole sequence back: its offloaded blocks are staged,
one layer and `stage_blocks` blocks at a time, into two fixed device buffers in turn (the next
chunk's copy overlaps this chunk's attention: on CUDA from pinned memory on a side stream, see
Stager), and the partial results merged exactly by log-sum-exp with the device part
(the kernels' merge).

The Offloader holds data only: which block moves where, and when, is the block tables' policy
(tables.py), which call `copy`; the cache calls `plan_chunks` and `attend_parts` in a step. The
disk file is checked on every read (size and a CRC32 per block and layer), so a truncated or
altered file is an error, never garbage.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from .blocks import DISK, HOST, STORE, TIER_NAMES
from .tables import PlacedBlock


@dataclass(frozen=True)
class OffloadConfig:
    """Offload tiers behind the device pool, in blocks; no host blocks means no offload."""
    host_blocks: int = 0
    disk_dir: str | None = None
    disk_blocks: int = 0
    stage_blocks: int = 64


class StagedChunk(NamedTuple):
    """Blocks attended together from one staging buffer."""
    table: torch.Tensor  # (B, MB) each sequence's blocks as slots of the buffer, -1 elsewhere
    ids: dict[int, list[int]]  # tier -> block ids, in buffer order: tier after tier


class OffloadError(RuntimeError):
    """The disk tier file is missing, truncated or altered."""


class HostTier:
    """Blocks in CPU memory (pinned when the device is CUDA): the same tensors as the device pool,
    (L, NB, ...) -> (L, n, ...)."""

    def __init__(self, like: list[torch.Tensor], n: int, pin: bool):
        self.t = [torch.zeros((x.shape[0], n, *x.shape[2:]), dtype=x.dtype, pin_memory=pin)
                  for x in like]

    def put(self, i: int, src: list[torch.Tensor], b: int) -> None:
        """Block b of the tensors src (all layers) into slot i."""
        for dst, s in zip(self.t, src):
            dst[:, i].copy_(s[:, b])

    def get(self, i: int, dst: list[torch.Tensor], b: int) -> None:
        """Slot i into block b of the tensors dst (all layers)."""
        for s, d in zip(self.t, dst):
            d[:, b].copy_(s[:, i], non_blocking=True)

    def read_into(self, rows: list[tuple[int, int]], ids: torch.Tensor,
                  outs: list[torch.Tensor]) -> None:
        """Blocks ids of (tensor, layer) rows into outs."""
        for (ti, layer), out in zip(rows, outs):
            torch.index_select(self.t[ti][layer], 0, ids, out=out)


class DiskTier:
    """Blocks in one file, memory-mapped as raw bytes; a CRC32 per (tensor, layer, block) guards
    reads."""

    def __init__(self, like: list[torch.Tensor], n: int, directory: str | Path):
        directory = Path(directory)
        if directory.exists() and not directory.is_dir():
            raise OffloadError(f"--disk-dir {directory} is a file, not a directory")
        directory.mkdir(parents=True, exist_ok=True)
        size = sum(x[0, 0].numel() * x.element_size() * x.shape[0] * n for x in like)
        free = shutil.disk_usage(directory).free
        if size > free:
            raise OffloadError(f"the disk tier needs {size / 2**30:.1f} GiB but {directory} has "
                               f"{free / 2**30:.1f} GiB free; lower --disk-blocks")
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
        try:
            with open(self.path, "wb") as f:
                f.truncate(self.size)
            self.mm = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(self.size,))
        except BaseException:  # a tier that was never made leaves no file behind
            self.path.unlink(missing_ok=True)
            raise
        self.views = [self.mm[o:o + s[0] * n * r].reshape(s[0], n, r)
                      for o, s, r in zip(self.offsets, self.shapes, self.row)]
        self.crc: dict[tuple[int, int, int], int] = {}

    def _check_file(self) -> None:
        if not self.path.exists() or self.path.stat().st_size != self.size:
            raise OffloadError(f"KV disk tier file {self.path} is missing or truncated")

    def put(self, i: int, src: list[torch.Tensor], b: int) -> None:
        """Block b of the tensors src (all layers) into slot i, with its checksums."""
        for ti, (view, t) in enumerate(zip(self.views, src)):
            raw = t[:, b].contiguous().cpu().view(torch.uint8).reshape(t.shape[0], -1).numpy()
            view[:, i] = raw  # (L, bytes of one layer's block)
            for layer in range(raw.shape[0]):
                self.crc[ti, layer, i] = zlib.crc32(raw[layer].tobytes())
        self.mm.flush()

    def _rows(self, ti: int, layer: int, ids: list[int]) -> torch.Tensor:
        """Slots ids of tensor ti's layer, checked: (len(ids), ...) in the tensor's dtype."""
        self._check_file()
        raw = np.ascontiguousarray(self.views[ti][layer, ids])
        for row, i in zip(raw, ids):
            if zlib.crc32(row.tobytes()) != self.crc[ti, layer, i]:
                raise OffloadError(f"KV disk tier file {self.path} was altered "
                                   f"(block {i}, layer {layer})")
        shape = (len(ids), *self.shapes[ti][2:])
        return torch.from_numpy(raw).view(self.dtypes[ti]).reshape(shape)

    def get(self, i: int, dst: list[torch.Tensor], b: int) -> None:
        """Slot i into block b of the tensors dst (all layers)."""
        for ti, d in enumerate(dst):
            rows = torch.stack([self._rows(ti, layer, [i])[0] for layer in range(d.shape[0])])
            d[:, b].copy_(rows)

    def read_into(self, rows: list[tuple[int, int]], ids: torch.Tensor,
                  outs: list[torch.Tensor]) -> None:
        """Blocks ids of (tensor, layer) rows into outs."""
        for (ti, layer), out in zip(rows, outs):
            out.copy_(self._rows(ti, layer, ids.tolist()))

    def close(self) -> None:
        """Unmap and delete the file."""
        del self.views, self.mm
        self.path.unlink(missing_ok=True)


class Stager:
    """Two fixed staging buffers on the device: chunk i+1 is copied into one while chunk i is
    attended in the other. On CUDA the rows are first gathered into pinned host memory and copied
    on a side stream; events order each copy after the attention that last read its buffer, and
    each attention after its copy. Elsewhere (CPU) the copies are plain, but the slots alternate
    the same way."""

    def __init__(self, like: list[torch.Tensor], n: int, device: torch.device):
        self.cuda = device.type == "cuda"
        shapes = [((n, *t.shape[2:]), t.dtype) for t in like]  # n blocks of one layer
        self.dev = [[torch.zeros(s, dtype=d, device=device) for s, d in shapes] for _ in range(2)]
        self.host = self.dev
        if self.cuda:
            self.host = [[torch.zeros(s, dtype=d, pin_memory=True) for s, d in shapes]
                         for _ in range(2)]
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # per slot: the copy stream is done with it (host side free, data ready)
        self.copied: list = [None, None]
        # per slot: attention has finished reading the device buffer
        self.read: list = [None, None]

    def fill(self, slot: int, n: int, gather: Callable[[list[torch.Tensor]], None],
             which: list[int]) -> list[torch.Tensor]:
        """gather(host buffers) writes n rows into the buffers of tensors `which`; returns those
        device buffers (data in flight on CUDA)."""
        dev = [self.dev[slot][i] for i in which]
        if not self.cuda:
            gather([b[:n] for b in dev])
            return dev
        host = [self.host[slot][i] for i in which]
        if self.copied[slot] is not None:
            self.copied[slot].synchronize()  # the pinned buffer's last upload has left it
        gather([b[:n] for b in host])
        with torch.cuda.stream(self.stream):
            if self.read[slot] is not None:
                self.stream.wait_event(self.read[slot])
            for d, h in zip(dev, host):
                d[:n].copy_(h[:n], non_blocking=True)
            self.copied[slot] = torch.cuda.Event()
            self.copied[slot].record(self.stream)
        return dev

    def attend(self, slot: int, fn: Callable[..., tuple], *args: object) -> tuple:
        """fn(*args), an attention over the slot's buffers, once their copy has landed; note when
        it is done."""
        if not self.cuda:
            return fn(*args)
        torch.cuda.current_stream().wait_event(self.copied[slot])
        out = fn(*args)
        self.read[slot] = torch.cuda.Event()
        self.read[slot].record(torch.cuda.current_stream())
        return out


class Offloader:
    """The host and disk tiers' data, and the staged attention over them."""

    def __init__(self, tensors: list[torch.Tensor], cfg: OffloadConfig, device: torch.device,
                 layer_rows: Callable[[int], list[tuple[int, int]]]):
        self.tensors = tensors  # device pool tensors (L, NB, ...) whose dim 1 is the block
        self.layer_rows = layer_rows  # layer -> (tensor, layer within it) holding that layer
        self.tiers: dict = {HOST: HostTier(tensors, cfg.host_blocks, pin=device.type == "cuda")}
        if cfg.disk_dir and cfg.disk_blocks:
            self.tiers[DISK] = DiskTier(tensors, cfg.disk_blocks, cfg.disk_dir)
        self.stage_blocks = cfg.stage_blocks
        self.device = device
        self.stager = Stager(tensors, cfg.stage_blocks, device)
        self.block_bytes = sum(t[0, 0].nbytes for t in tensors) * tensors[0].shape[0]
        self.counts: Counter = Counter()  # bytes moved, blocks read

    def copy(self, src_tier: int, src: int, dst_tier: int, dst: int) -> None:
        """Copy one block's data (all layers) from one tier to another."""
        if src_tier == STORE:
            self.tiers[dst_tier].put(dst, self.tensors, src)
        elif dst_tier == STORE:
            self.tiers[src_tier].get(src, self.tensors, dst)
        else:  # host -> disk, through the host tensors
            self.tiers[dst_tier].put(dst, self.tiers[src_tier].t, src)
        self.counts[f"bytes_{TIER_NAMES[src_tier]}_to_{TIER_NAMES[dst_tier]}"] += self.block_bytes

    # ---- staged attention ---------------------------------------------------------------------
    def plan_chunks(self, entries: list[PlacedBlock], n_rows: int, width: int,
                    one_pass: bool) -> list[StagedChunk]:
        """A step's blocks as chunks to stage. `entries` hold the offloaded blocks, and with
        `one_pass` (the CPU, where host memory is the device's memory anyway) the resident ones
        too: one chunk, so attention is one pass over exactly the same dense K/V as without
        offload, bitwise. Otherwise chunks of `stage_blocks`; a chunk's table is (n_rows, width)."""
        staged = sum(e.tier != STORE for e in entries)
        if not staged:
            return []
        self.counts["blocks_read_staged"] += staged
        self.counts["blocks_read_on_device"] += len(entries) - staged
        tiers = (STORE, HOST, DISK) if one_pass else (HOST, DISK)
        size = len(entries) if one_pass else self.stage_blocks
        chunks = []
        for c0 in range(0, len(entries), size):
            table = torch.full((n_rows, width), -1, dtype=torch.int32)
            ids: dict[int, list[int]] = {tier: [] for tier in tiers}
            slot = 0
            for tier in tiers:  # slots: resident blocks first, then host, then disk
                for e in entries[c0:c0 + size]:
                    if e.tier == tier:
                        table[e.row, e.logical] = slot
                        ids[tier].append(e.block)
                        slot += 1
            chunks.append(StagedChunk(table=table.to(self.device), ids=ids))
        return chunks

    def attend_parts(self, layer: int, chunks: list[StagedChunk],
                     attend: Callable[[list[torch.Tensor], torch.Tensor], tuple]) -> list[tuple]:
        """Partial attention (o, lse) over each chunk, for one layer: attend(buffers, table)
        attends over staging buffers laid out like the pool's tensors (one layer)."""
        if is_one_pass(chunks):  # a buffer the size of this step's blocks
            (table, ids), = chunks
            n = sum(len(x) for x in ids.values())
            rows = self.layer_rows(layer)
            bufs = [torch.empty((n, *self.tensors[ti].shape[2:]), dtype=self.tensors[ti].dtype)
                    for ti, _ in rows]
            self._gather(layer, ids, bufs)
            return [attend(bufs, table)]
        parts = []
        bufs = self._fill(0, layer, chunks[0].ids)
        for i, chunk in enumerate(chunks):
            nxt = None
            if i + 1 < len(chunks):  # this copy overlaps the attention below
                nxt = self._fill((i + 1) % 2, layer, chunks[i + 1].ids)
            parts.append(self.stager.attend(i % 2, attend, bufs, chunk.table))
            bufs = nxt
        return parts

    def _fill(self, slot: int, layer: int, ids: dict[int, list[int]]) -> list[torch.Tensor]:
        """Start staging one chunk (ids per tier) of one layer into a slot's buffers."""
        n = sum(len(x) for x in ids.values())

        def gather(outs: list[torch.Tensor]) -> None:
            self._gather(layer, ids, outs)

        which = [ti for ti, _ in self.layer_rows(layer)]
        return self.stager.fill(slot, n, gather, which)

    def _gather(self, layer: int, ids: dict[int, list[int]], outs: list[torch.Tensor]) -> None:
        """One layer's rows of the listed blocks, tier after tier (plan_chunks' slot order)."""
        at = 0
        where = self.layer_rows(layer)  # (tensor, layer within it) of each of outs
        for tier, lst in ids.items():
            if not lst:
                continue
            rows = [o[at:at + len(lst)] for o in outs]
            idx = torch.tensor(lst)
            if tier == STORE:  # one pass: only on the CPU, where the pool is
                for (ti, local), r in zip(where, rows):
                    torch.index_select(self.tensors[ti][local], 0, idx, out=r)
            else:
                self.tiers[tier].read_into(where, idx, rows)
                self.counts[f"bytes_{TIER_NAMES[tier]}_to_device"] += sum(r.nbytes for r in rows)
            at += len(lst)

    def read_blocks(self, layer: int, entries: list[PlacedBlock],
                    width: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One sequence's blocks (row 0), read where they lie: (its table (1, width) into the
        rows, one layer's rows as new device tensors in layer_rows' order). Eviction reads a
        whole sequence this way; nothing moves between tiers."""
        where = self.layer_rows(layer)
        table = torch.full((1, width), -1, dtype=torch.int32)
        parts, at = [], 0
        for tier in (STORE, HOST, DISK):  # rows: tier after tier
            mine = [e for e in entries if e.tier == tier]
            if not mine:
                continue
            for n, e in enumerate(mine):
                table[0, e.logical] = at + n
            at += len(mine)
            idx = torch.tensor([e.block for e in mine])
            if tier == STORE:
                idx = idx.to(self.device)
                parts.append([self.tensors[ti][local].index_select(0, idx) for ti, local in where])
                continue
            rows = [torch.empty((len(mine), *self.tensors[ti].shape[2:]),
                                dtype=self.tensors[ti].dtype) for ti, _ in where]
            self.tiers[tier].read_into(where, idx, rows)
            parts.append([r.to(self.device) for r in rows])
        return table.to(self.device), [torch.cat(column) for column in zip(*parts)]

    def close(self) -> None:
        """Delete the disk tier's file, if there is one."""
        if DISK in self.tiers:
            self.tiers[DISK].close()


def is_one_pass(chunks: list[StagedChunk]) -> bool:
    """Whether the chunks are one pass over resident and offloaded blocks alike (plan_chunks)."""
    return bool(chunks) and STORE in chunks[0].ids
