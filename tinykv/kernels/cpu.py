"""The fused CPU kernels for the paged, quantized KV cache (numba): attention, chosen per pair of
stored formats (cpu_plain.py), and the store (cpu_store.py). The torch references in reference.py
have the same signatures: read them first.

This file holds what a call costs beside the kernel itself, and how the work is shared:
- `CpuKernels` (one per cache) converts each pool into kernel arguments once, on first use, and
  a step's metadata (query rows, positions, block tables, lengths) once per step, not per layer.
- Work items are (query, split of its blocks, KV head), in that order. One thread takes them all
  with no split; several threads take equal runs of them, and a batch too small to share evenly
  splits each query's blocks, merged by log-sum-exp: then each thread reads its share of the
  blocks for every head (cpu_plain.attention_kernel says why the heads go innermost). numba's
  threads follow torch's count (--threads); a call of few reads (a short context) stays on one
  thread, as starting them costs more.
- Rows of more than CHUNK_MAX queries (prefill chunks) go to the reference, which reads a row once
  for all its queries; the kernel reads it once per query.
- `direct` hands a decode step's store and attention to the model as numpy calls, layer by layer
  (`DirectLayers`): the same kernels and arguments as `store` and `attend`, without the torch
  tensors around them. In a decode step each op between two layers' weight reads runs with cold
  caches (bench kernel --cpu's cold fixed costs), so the ops it saves cost more than in a loop.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np
import torch

from ..spec import QuantParams
from .cpu_args import PoolArrays, as_index, pool_arrays, readable
from .cpu_direct import (
    MERGE,
    DirectLayers,
    KernelCall,
    PoolCalls,
    key_bytes,
    layer_calls,
    merge_splits,
    transform_arrays,
)
from .cpu_maps import head_map_cpu  # noqa: F401 (a layer's transform)
from .cpu_numerics import AVAILABLE, REASON, numba, use_threads
from .cpu_plain import attention_kernel
from .cpu_store import quantize_store_cpu, store_args, store_rows  # noqa: F401 (the store)
from .cpu_vector import ALL, head_share, takes, vector_kernel
from .layout import PoolLayer
from .reference import Partial, paged_attention_ref

CHUNK_MAX = 4
# Starting numba's threads costs a call tens of microseconds; below this many (key, KV head)
# reads a call is faster on one thread (bench kernel --cpu's fixed costs say how much).
THREADS_MIN_READS = 4096
# Bytes of codes (K and V, every KV head) per share of a long query's blocks. A block holds every
# KV head, and a thread reads a share's blocks for each head in turn (cpu_plain.attention_kernel):
# the lines read ahead past one head's rows are the next head's, still in L2 when that head comes
# within a share of about L2's size (2 MiB a core on the Xeons measured; 1 MiB on a Zen 5).
# Whole decode steps at 8k keys, one thread, shares of 1 and 2 MiB against none: fp16 faster,
# int8 slower by a few % at 1 MiB and about even at 2; the README's speed section has the times.
SHARE_BYTES = 2 << 20
# the kernels take a pool's arrays as a plain tuple in PoolArrays' order
_GROUP_SIZE = PoolArrays._fields.index("group_size")


class _Step:
    """A step's metadata as the kernel reads it, and which queries it takes."""

    def __init__(self, q_seq: torch.Tensor, q_pos: torch.Tensor, table: torch.Tensor,
                 ctx_lens: torch.Tensor):
        self.tensors = (q_seq, q_pos, table, ctx_lens)
        self.versions = _versions(q_seq, q_pos, table, ctx_lens)
        self.q_seq = as_index(q_seq, np.int64)
        self.q_pos = as_index(q_pos, np.int64)
        self.table = as_index(table, np.int32)
        self.ctx_lens = as_index(ctx_lens, np.int64)
        self.n_queries = len(self.q_seq)
        visible = np.minimum(self.q_pos + 1, self.ctx_lens[self.q_seq])  # (N,) keys per query
        self.key_reads = int(visible.sum())  # per KV head
        self.longest = int(visible.max()) if len(visible) else 0  # the most keys of one query
        self.chunked = False  # a row of more than CHUNK_MAX queries: a prefill chunk
        self.shares: dict[tuple, tuple[int, int]] = {}  # CpuKernels._share's answers for it
        if len(self.q_seq) > CHUNK_MAX:
            counts = np.bincount(self.q_seq, minlength=len(self.ctx_lens))  # queries per row
            self.chunked = int(counts.max()) > CHUNK_MAX

    def holds(self, q_seq, q_pos, table, ctx_lens) -> bool:
        mine = self.tensors
        return (table is mine[2] and q_seq is mine[0] and q_pos is mine[1] and ctx_lens is mine[3]
                and self.versions is not None
                and self.versions == (q_seq._version, q_pos._version, table._version,
                                      ctx_lens._version))


def _versions(*tensors: torch.Tensor) -> tuple | None:
    """In-place edit counts, which tell that a kept conversion went stale; None where one is an
    inference tensor (it keeps no count, so its conversion is never kept)."""
    if any(t.is_inference() for t in tensors):
        return None
    return tuple(t._version for t in tensors)


class CpuKernels:
    """The fused CPU kernels of one cache, remembering what they convert: each pool's arguments
    (by the pool's identity, while it lives) and the last few steps' metadata."""

    STEPS = 4  # a step attends a store pool, a hot pool and staged chunks: tables per step

    def __init__(self, vector: bool = True, threads_min_reads: int = THREADS_MIN_READS,
                 by_chunk: bool | None = None, parts: int = ALL):
        assert AVAILABLE, REASON
        self.vector = vector  # the vector kernel where it takes the formats (else cpu_plain's)
        self.variant = (by_chunk, parts)  # cpu_vector.vector_kernel's (parts: ALL but in a bench)
        self.threads_min_reads = threads_min_reads  # fewer (key, KV head) reads: one thread
        self._pools: dict[int, tuple] = {}  # id(pool) -> (weakref to pool, format, arrays)
        self._steps: list[_Step] = []
        self._calls: dict[tuple, tuple] = {}  # (id(k), id(v), Hq, D) -> refs and kernel call
        self._threads_set = 0  # torch's thread count numba was last set to follow
        self._slots: tuple = (None, None, None)  # the last store's (blk, off, versions, arrays)
        self._scale = (None, None)  # the softmax scale, and as the kernels take it
        self._maps: tuple = (None, None)  # direct: a cache's transforms, and as numpy arrays
        self._layers: dict[int, tuple] = {}  # direct: id(a pool's layers) -> (its layers,
        # (Hq, D), their calls), made once

    def attend(self, q: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor, k: PoolLayer,
               v: PoolLayer, block_table: torch.Tensor, ctx_lens: torch.Tensor, sm_scale: float,
               num_splits: int | None = None) -> Partial:
        """paged_attention_ref, fused. num_splits: shares of each query's blocks (default: one
        per SHARE_BYTES of the longest query's codes, and enough items to keep every thread
        busy)."""
        step = self._step(q_seq, q_pos, block_table, ctx_lens)
        N, Hq, D = q.shape
        if step.chunked or step.n_queries != N or q_seq.dim() != 1:
            return self._with_chunks(q, q_seq, q_pos, k, v, block_table, ctx_lens, sm_scale,
                                     num_splits)
        call = self._call(k, v, Hq, D)
        if call is None:  # a format the kernels do not read in place
            return paged_attention_ref(q, q_seq, q_pos, k, v, block_table, ctx_lens, sm_scale)
        serial, parallel, k_arrays, v_arrays, H, BS, per_key = call
        threads, num_splits = self._share(step, H, per_key, num_splits)
        o = np.empty((num_splits, N, Hq, D), np.float32)
        lse = np.empty((num_splits, N, Hq), np.float32)
        if q.dtype is torch.float32 and q.is_contiguous():
            q_rows = q.numpy()  # (N, Hq, D), a view
        else:
            q_rows = q.float().contiguous().numpy()
        if sm_scale != self._scale[0]:  # one cache, one scale: converted once
            self._scale = (sm_scale, np.float32(sm_scale))
        args = (q_rows, step.q_seq, step.q_pos, step.table, step.ctx_lens, k_arrays, v_arrays,
                H, BS, self._scale[1], o, lse)
        if threads == 1:
            serial(0, num_splits * N * H, *args)
        else:
            parallel(threads, *args)
        if num_splits > 1:
            merge_splits(o, lse)
        return torch.from_numpy(o[0]), torch.from_numpy(lse[0])

    def direct(self, q_seq: torch.Tensor, q_pos: torch.Tensor, ctx_lens: torch.Tensor,
               pools: list[tuple[torch.Tensor, list[tuple[PoolLayer, PoolLayer]]]], target: int,
               blk: torch.Tensor, off: torch.Tensor, Hq: int, D: int, sm_scale: float,
               count_saturated: Callable[[int], None] | None,
               transforms: list | None = None) -> DirectLayers | None:
        """A step's `store` (every token at blk, off of pool `target`) and `attend` over each
        pool (its block table, each layer's pools K, V; partials merged in this order), as numpy
        calls, shared among threads as `attend` shares it; None for prefill chunks (more than one
        call a pool and layer) or a pool not read, or (the target) written, in place. Clipped
        values go to `count_saturated` (None: not counted); `transforms`: each layer's maps."""
        parts = []
        for at, (table, layers) in enumerate(pools):
            step = self._step(q_seq, q_pos, table, ctx_lens)
            if step.chunked or q_seq.dim() != 1:
                return None
            written = at == target  # its store is called too
            known = self._layers.get((id(layers), written))
            if known is None or known[0] is not layers or known[1] != (Hq, D):
                made = layer_calls(layers, lambda k, v: self._call(k, v, Hq, D), written)
                known = self._layers[id(layers), written] = (layers, (Hq, D), made)
            calls = known[2]
            if calls is None:
                return None
            share = (1, 1)
            if calls:  # the first layer's formats stand for all
                share = self._share(step, calls[0].kv_heads, key_bytes(*layers[0]))
            parts.append(PoolCalls(step, calls, share))
        if sm_scale != self._scale[0]:
            self._scale = (sm_scale, np.float32(sm_scale))
        if transforms is not None and self._maps[0] is not transforms:
            self._maps = (transforms, transform_arrays(transforms))
        if transforms is not None and self._maps[1] is None:  # maps the kernel does not take
            return None
        return DirectLayers(parts, target, as_index(blk, np.int64), as_index(off, np.int64),
                            self._scale[1], count_saturated, Hq, D, MERGE,
                            None if transforms is None else self._maps[1])

    def _share(self, step: _Step, H: int, key_bytes: int,
               num_splits: int | None = None) -> tuple[int, int]:
        """(threads, shares of each query's blocks) for attention over the step's queries and H
        KV heads: one thread under threads_min_reads (key, KV head) reads; else torch's count.
        Unless num_splits says how many, each query's blocks split in shares of at most
        SHARE_BYTES of codes (key_bytes a key), and with too few (query, KV head) items to
        share evenly among the threads, in a multiple of their count (partials merged by
        log-sum-exp). Each step remembers its answers: a layer call asks again the same."""
        wanted = torch.get_num_threads()
        asked = (H, key_bytes, num_splits, wanted, SHARE_BYTES)
        if asked in step.shares and wanted == self._threads_set:
            return step.shares[asked]
        threads = self._threads()
        if step.key_reads * H < self.threads_min_reads:  # starting the threads costs more
            threads = 1
        if num_splits is None:
            items = step.n_queries * H
            uneven = threads > 1 and items % threads != 0 and items < 8 * threads
            for_threads = threads if uneven else 1
            for_length = -(-step.longest * key_bytes // SHARE_BYTES)
            num_splits = for_threads * max(1, -(-for_length // for_threads))
        step.shares[asked] = (threads, num_splits)
        return threads, num_splits

    def _call(self, k: PoolLayer, v: PoolLayer, Hq: int, D: int) -> KernelCall | None:
        """The kernels and arguments for a pair of pools (kept while they live), or None where a
        format is not read in place."""
        key = (id(k), id(v), Hq, D)
        known = self._calls.get(key)
        if known is not None and known[0]() is k and known[1]() is v:
            return known[2]
        H, BS = k.data.shape[1:3]
        assert Hq % H == 0, f"{Hq} query heads do not group over {H} KV heads"
        kf, k_arrays = self._pool(k, H, BS, D)
        vf, v_arrays = self._pool(v, H, BS, D)
        call = None
        k_group, v_group = k_arrays[_GROUP_SIZE], v_arrays[_GROUP_SIZE]  # channels per scale
        if readable(kf, k_group) and readable(vf, v_group):
            k_groups, v_groups = D // k_group, D // v_group
            R = head_share(Hq // H, D)  # query heads a pass over a KV head's blocks takes
            if self.vector and takes(kf, vf, R, D, BS, k_groups):
                kernels = vector_kernel(kf, vf, R, D, k_groups, v_groups, *self.variant)
            else:
                kernels = attention_kernel(kf, vf)
            call = KernelCall(*kernels, k_arrays, v_arrays, H, BS, key_bytes(k, v))
        if len(self._calls) > 1024:  # staged copies come and go: forget the dead
            self._calls = {i: e for i, e in self._calls.items() if e[0]() is not None}
        self._calls[key] = (weakref.ref(k), weakref.ref(v), call)
        return call

    def _threads(self) -> int:
        """torch's thread count (--threads), which numba's pool follows (never past its size)."""
        wanted = torch.get_num_threads()
        if wanted != self._threads_set:
            self._threads_set = _follow_torch_threads(wanted)
        return min(wanted, numba.config.NUMBA_NUM_THREADS)

    def store(self, x: torch.Tensor, p: QuantParams, data: torch.Tensor,
              scale: torch.Tensor | None, zero: torch.Tensor | None, blk: torch.Tensor,
              off: torch.Tensor) -> int:
        """quantize_store_ref, fused (cpu_store.py)."""
        known = self._pools.get(id(data))
        if not (known is not None and known[0]() is data and known[1] == (p, scale, zero)):
            args = store_args(p, data, scale, zero)
            known = (weakref.ref(data), (p, scale, zero), args)
            self._pools[id(data)] = known
        last = self._slots
        if not (last[0] is blk and last[1] is off and last[2] is not None
                and last[2] == (blk._version, off._version)):
            last = (blk, off, _versions(blk, off), as_index(blk, np.int64),
                    as_index(off, np.int64))
            self._slots = last
        assert last[3].shape == last[4].shape == (x.shape[0],), "x, blk, off disagree"
        return store_rows(x, last[3], last[4], known[2])

    def _step(self, q_seq, q_pos, table, ctx_lens) -> _Step:
        for step in self._steps:
            if step.holds(q_seq, q_pos, table, ctx_lens):
                return step
        step = _Step(q_seq, q_pos, table, ctx_lens)
        self._steps = [step] + self._steps[:self.STEPS - 1]
        return step

    def _pool(self, pool: PoolLayer, H: int, BS: int, D: int) -> tuple:
        known = self._pools.get(id(pool))
        if known is not None and known[0]() is pool:
            return known[1], known[2]
        if len(self._pools) > 1024:  # staged copies come and go: forget the dead
            self._pools = {i: e for i, e in self._pools.items() if e[0]() is not None}
        fmt, arrays = pool_arrays(pool, H, BS, D)
        self._pools[id(pool)] = (weakref.ref(pool), fmt, arrays)
        return fmt, arrays

    def _with_chunks(self, q, q_seq, q_pos, k, v, table, ctx_lens, sm_scale, num_splits):
        """Prefill chunks through the reference, the other queries through the kernel."""
        seq = q_seq.long()
        counts = torch.bincount(seq, minlength=len(ctx_lens))  # queries per row
        chunk = counts[seq] > CHUNK_MAX  # (N,) queries of prefill chunks
        rows = counts > CHUNK_MAX
        remap = torch.cumsum(rows, 0) - 1  # row of table[rows] for each chunk row
        o = torch.zeros(q.shape)
        lse = torch.full(q.shape[:2], float("-inf"))
        o[chunk], lse[chunk] = paged_attention_ref(q[chunk], remap[seq[chunk]], q_pos[chunk], k,
                                                   v, table[rows], ctx_lens[rows], sm_scale)
        if not bool(chunk.all()):
            o[~chunk], lse[~chunk] = self.attend(q[~chunk], q_seq[~chunk], q_pos[~chunk], k, v,
                                                 table, ctx_lens, sm_scale, num_splits)
        return o, lse


def _follow_torch_threads(wanted: int) -> int:
    """Set numba's thread count to torch's (never past numba's pool); returns `wanted`."""
    numba.get_num_threads()  # the first call starts numba's pool, and with the OpenMP layer
    if torch.get_num_threads() != wanted:  # that resets the count torch shares: restore it
        torch.set_num_threads(wanted)
    use_threads(min(wanted, numba.config.NUMBA_NUM_THREADS))
    return wanted


def merge_partials_cpu(parts: list[Partial]) -> Partial:
    """reference.merge_partials in one compiled pass (a pool and its hot blocks: two partials a
    layer call)."""
    if len(parts) == 1:
        return parts[0]
    o = np.stack([o.float().numpy() for o, _ in parts])  # (P, N, Hq, D)
    lse = np.stack([lse.float().numpy() for _, lse in parts])  # (P, N, Hq)
    merge_splits(o, lse)
    return torch.from_numpy(o[0]), torch.from_numpy(lse[0])


def paged_attention_cpu(q: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor, k: PoolLayer,
                        v: PoolLayer, block_table: torch.Tensor, ctx_lens: torch.Tensor,
                        sm_scale: float, num_splits: int | None = None) -> Partial:
    """paged_attention_ref, fused on the CPU (a cache keeps one CpuKernels: this converts its
    arguments afresh on every call)."""
    return CpuKernels().attend(q, q_seq, q_pos, k, v, block_table, ctx_lens, sm_scale, num_splits)
