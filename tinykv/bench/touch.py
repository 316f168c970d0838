"""Synthetic KV pools for the CPU attention benchmark (attention.py, parts.py), and the touch:
a call's K/V bytes and scales read in block-table order with no math, the read ceiling of that
exact layout and block order. The touch reads two ways and the benchmark keeps the faster:
plain loads, and loads with each block's lines requested TOUCH_AHEAD blocks before, as the
kernel asks for its blocks. Which is faster depends on the CPU: on an Intel Xeon the requests
changed nothing, on an AMD Zen 4 they read 1.7-1.9x faster (the README's sections).
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.cpu_numerics import njit, prange
from ..kernels.cpu_simd import prefetch_lines
from ..kernels.layout import PoolLayer
from ..quant import compute_scales, quantize
from ..spec import KVSpec, QuantParams

SHAPE = dict(kv_heads=3, n_rep=3, head_dim=64, block_size=16)  # the default model's


def make_pool(p: QuantParams, n_blocks: int, gen: torch.Generator) -> PoolLayer:
    """n_blocks random blocks stored as the cache stores them (per-token or per-block scales)."""
    H, BS, D = SHAPE["kv_heads"], SHAPE["block_size"], SHAPE["head_dim"]
    x = torch.randn(n_blocks, H, BS, D, generator=gen)  # (NB, H, BS, D)
    if p.is_float:
        return PoolLayer(x.to(p.storage_dtype), None, None, p)
    scale, zero = compute_scales(x, p)
    return PoolLayer(quantize(x, p, scale, zero, count=False)[0], scale, zero, p)


def _block_words(t: torch.Tensor | None, n_blocks: int) -> np.ndarray:
    """A pool tensor as (blocks, 64-bit words): what the touch reads of each block."""
    if t is None or t.shape[0] != n_blocks:  # absent, or one set for the layer: none per block
        return np.zeros((1, 0), np.uint64)
    flat = t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)
    pad = -flat.shape[1] % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(flat.shape[0], pad)], 1)
    return flat.numpy().view(np.uint64)


# Blocks between the one the touch reads and the one whose lines it requests, where it requests
# them: the kernel's own distance (cpu_vector.AHEAD); 2 and 8 read alike on a Zen 4.
TOUCH_AHEAD = 4
TO_L2 = 2  # prefetch_lines' level: into L2, as the kernel's requests


@njit(cache=True, parallel=True)
def _touch(table, ctx_lens, block_size, ahead, workers, kw, vw, ksw, kzw, vsw, vzw):
    """Read every block a row holds (K, V and their scales), in block-table order, on `workers`
    threads: worker w reads the w-th of `workers` equal runs of each row's blocks, as the kernel
    splits a long sequence; with ahead > 0, each worker first requests the lines of the block
    that many places later in its run."""
    folds = np.zeros(workers, np.uint64)
    for w in prange(workers):
        folds[w] = _touch_run(table, ctx_lens, block_size, ahead, w, workers,
                              kw, vw, ksw, kzw, vsw, vzw)
    acc = np.uint64(0)
    for w in range(workers):
        acc ^= folds[w]
    return acc


@njit(cache=True)
def _touch_run(table, ctx_lens, block_size, ahead, w, workers, kw, vw, ksw, kzw, vsw, vzw):
    """Worker w's run of every row's blocks, read (and requested ahead) as _touch says."""
    acc = np.uint64(0)
    for b in range(table.shape[0]):
        n_blocks = (ctx_lens[b] + block_size - 1) // block_size
        first = n_blocks * w // workers
        end = n_blocks * (w + 1) // workers
        for j in range(first, min(first + ahead, end)):  # the first blocks, before the loop asks
            _request(table[b, j], kw, vw, ksw, kzw, vsw, vzw)
        for j in range(first, end):
            if ahead > 0 and j + ahead < end:
                _request(table[b, j + ahead], kw, vw, ksw, kzw, vsw, vzw)
            blk = table[b, j]
            for words in (kw, vw, ksw, kzw, vsw, vzw):
                if words.shape[1]:
                    for i in range(words.shape[1]):
                        acc ^= words[blk, i]
    return acc


@njit(cache=True)
def _request(blk, kw, vw, ksw, kzw, vsw, vzw):
    """Ask for every line of block blk (K, V and their scales) into L2."""
    for words in (kw, vw, ksw, kzw, vsw, vzw):
        if words.shape[1]:
            prefetch_lines(words, blk * words.shape[1], (words.shape[1] * 8 + 63) // 64, TO_L2)


class Layer:
    """One pseudo-layer: its K and V pools, shuffled block table, and the touch's view of them."""

    def __init__(self, spec: KVSpec, batch: int, context: int, gen: torch.Generator):
        BS = SHAPE["block_size"]
        per_row = -(-context // BS)
        self.k = make_pool(spec.k, batch * per_row, gen)
        self.v = make_pool(spec.v, batch * per_row, gen)
        order = torch.randperm(batch * per_row, generator=gen)
        self.table = order.view(batch, per_row).int()  # (B, MB): blocks in shuffled order
        self.words = [_block_words(t, batch * per_row) for t in (
            self.k.data, self.v.data, self.k.scale, self.k.zero, self.v.scale, self.v.zero)]
        self.nbytes = sum(w.nbytes for w in self.words)

    def touch(self, ctx_lens: np.ndarray, ahead: int = 0, workers: int = 1) -> None:
        """The pool's blocks read, plain (ahead 0) or each requested `ahead` blocks before, on
        `workers` threads (numba's, as set_threads sets them)."""
        _touch(self.table.numpy(), ctx_lens, SHAPE["block_size"], ahead, workers, *self.words)


def pseudo_layers(spec: KVSpec, batch: int, context: int, budget: int) -> list[Layer]:
    """Pseudo-layers of one spec and shape, enough to hold `budget` bytes: one made, the rest
    copies of it with their own shuffled tables (their bytes at other addresses)."""
    gen = torch.Generator().manual_seed(batch * context)
    first = Layer(spec, batch, context, gen)
    out = [first]
    while sum(x.nbytes for x in out) < budget:
        layer = object.__new__(Layer)
        layer.k = PoolLayer(*[_clone(t) for t in (first.k.data, first.k.scale, first.k.zero)],
                            first.k.p)
        layer.v = PoolLayer(*[_clone(t) for t in (first.v.data, first.v.scale, first.v.zero)],
                            first.v.p)
        layer.table = torch.randperm(first.table.numel(), generator=gen).view_as(first.table)
        layer.table = layer.table.int()
        layer.words = [_block_words(t, first.table.numel()) for t in (
            layer.k.data, layer.v.data, layer.k.scale, layer.k.zero, layer.v.scale, layer.v.zero)]
        layer.nbytes = first.nbytes
        out.append(layer)
    return out


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()
