"""A decode step's store and attention as numpy calls, a layer at a time (cpu.CpuKernels.direct
makes them): the compiled kernels `CpuKernels.store` and `.attend` call, with the arguments those
convert from torch made once (each layer's pools once per cache, the step's metadata once per
step), so that nothing between a layer's compiled calls makes a torch tensor
(gemv_layer.layers_cpu runs the layers). In a decode step each op between two layers' weight reads
runs with cold caches, where it costs many times what it costs in a loop (bench kernel --cpu).

Also here, as both paths use them: a pair of pools' kernels and arguments (`KernelCall`) and the
log-sum-exp merge of partials (`merge_splits`)."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any, NamedTuple

import numpy as np
import torch

from .cpu_maps import head_map_kernel
from .cpu_numerics import njit, use_threads
from .cpu_store import compiled_store_pair, store_args
from .layout import PoolLayer, empty_rows

_FLOAT32 = np.dtype(np.float32)  # numpy's one float32 descriptor, told by `is`: no comparison call
# The array flags numba's type of an array depends on (C_CONTIGUOUS, F_CONTIGUOUS, ALIGNED,
# WRITEABLE, numpy's NPY_ARRAY_* bits): a compiled version is kept per combination of them.
TYPED_FLAGS = 0x1 | 0x2 | 0x100 | 0x400


class Resolved:
    """A compiled kernel called with arguments of the same types every time: the first call goes
    through numba's dispatcher, later ones straight to the compiled version it chose. The
    dispatcher types every argument of every call (a dozen arrays and tuples here: bench kernel
    --cpu's dispatch_us against direct_attend_us), and a direct layer's calls take the same
    pools, step arrays and output arrays every step. Only the rows (the arguments at positions
    `rows_at`, float32 of rank 3: DirectLayers checks them) change between steps, and with them
    maybe how numba types them (a view of one token is contiguous, of several may not be): a
    version is kept per `layout` key of them all."""

    def __init__(self, dispatcher: Callable, *rows_at: int):
        self.dispatcher, self.rows_at = dispatcher, rows_at
        self.entries: dict[int, Callable] = {}  # layout -> the compiled version for it

    def __call__(self, *args):
        """The kernel on `args`, resolving the version for their rows' layout on its first call
        (DirectLayers looks `entries` up itself, and comes here only then)."""
        layout = 0
        for i, at in enumerate(self.rows_at):
            layout |= (args[at].flags.num & TYPED_FLAGS) << (16 * i)
        entry = self.entries.get(layout)
        if entry is not None:
            return entry(*args)
        out = self.dispatcher(*args)
        overloads = getattr(self.dispatcher, "overloads", None)
        key = tuple(self.dispatcher.typeof_pyval(a) for a in args) if overloads else None
        # no numba (plain functions), or arguments numba matched by conversion: keep dispatching
        self.entries[layout] = overloads[key].entry_point if key in (overloads or {}) \
            else self.dispatcher
        return out


def key_bytes(k: PoolLayer, v: PoolLayer) -> int:
    """Bytes of codes one key holds in a pair of pools, every KV head, K and V."""
    return sum(p.data.element_size() * p.data.shape[1] * p.data.shape[3] for p in (k, v))


@njit(cache=True, error_model="numpy")  # numba's own cache key: this file's stamp
def merge_splits(o, lse):
    """Merge partials over disjoint key sets into o[0], lse[0]: o (S, N, Hq, D), lse (S, N, Hq)."""
    S, N, Hq, D = o.shape
    weights = np.empty(S)  # each part's share of a head's probability mass
    for n in range(N):
        for hq in range(Hq):
            top = -np.inf
            for s in range(S):
                top = max(top, lse[s, n, hq])
            if top == -np.inf:  # no key in any part
                o[0, n, hq, :] = 0.0
                lse[0, n, hq] = -np.inf
                continue
            total = 0.0
            for s in range(S):
                total += np.exp(lse[s, n, hq] - top)
            for s in range(S):  # once per head, not per channel: S exps instead of S * D
                weights[s] = np.exp(lse[s, n, hq] - top) / total
            for d in range(D):
                x = 0.0
                for s in range(S):
                    x += weights[s] * o[s, n, hq, d]
                o[0, n, hq, d] = x
            lse[0, n, hq] = top + np.log(total)


# the direct calls' merge: its arguments are always the same types (DirectLayers' outputs)
MERGE = Resolved(merge_splits)


class KernelCall(NamedTuple):
    """A pair of pools' attention as CpuKernels.attend calls it, converted once."""
    serial: Callable  # the work items from first to last, on the calling thread
    parallel: Callable  # and shared among `workers` threads
    k_arrays: tuple  # cpu_args.PoolArrays of K, then V
    v_arrays: tuple
    kv_heads: int
    block_size: int
    key_bytes: int  # bytes of codes a key holds, every KV head, K and V (key_bytes)


class LayerCalls(NamedTuple):
    """One layer's store and attention as DirectLayers calls them, converted once per cache."""
    store: Resolved | None  # cpu_store.compiled_store_pair: K and V in one call (rows at 0, 1)
    store_args: tuple  # its arguments after blk and off: each pool's (format, arrays, limits,
    # dynamic, clips, fit steps), K's then V's, and the block size (cpu_store.StoreArgs)
    attend: Resolved  # the serial attention kernel of this pair of formats (q at 2)
    attend_parallel: Resolved  # and the parallel one (q at 1)
    k_arrays: tuple  # cpu_args.PoolArrays of K, then V
    v_arrays: tuple
    kv_heads: int
    block_size: int


@cache
def _head_map(D: int) -> Resolved:
    """A layer's transform on a step's rows of D channels: its arguments but the rows are
    always the same types."""
    return Resolved(head_map_kernel(D), 0)


class PoolCalls(NamedTuple):
    """One pool a direct step attends (the store, or the hot blocks beside it): its layers'
    calls, the step's metadata over its block table (cpu._Step), and how its attention is
    shared (CpuKernels._share: threads, splits of each query's blocks)."""
    step: Any
    layers: list[LayerCalls]
    share: tuple[int, int]


class DirectLayers:
    """One decode step's store and attention, a layer at a time, in numpy (CpuKernels.direct).
    Everything but the rows is bound when the step begins (each layer's arguments, the outputs),
    so a call checks the rows, finds its compiled version and calls it: in a decode step every
    line here runs with cold caches, between two layers' weight reads (bench kernel --cpu's cold
    fixed costs).

    A step may attend two pools, the store and its hot blocks (a residual window, sinks), each
    over its own block table, merged by log-sum-exp as cache.attend merges them; and a layer
    may transform what enters the cache and what leaves it (quant.Transform's maps, applied by
    the compiled call Plan.attend's go through too, so the numbers are the same)."""

    def __init__(self, pools: list[PoolCalls], target: int, blk: np.ndarray, off: np.ndarray,
                 sm_scale: np.float32, count_saturated: Callable[[int], None] | None, Hq: int,
                 D: int, merge: Callable, transforms: list | None = None):
        """pools: in the order their partials merge; target: the pool the new tokens go to, at
        blk, off (N,); count_saturated: where clipped values are counted (None: not counted, as
        for hot blocks, a cast); merge: merge_splits, which folds partials into the first;
        transforms: each layer's maps as transform_arrays makes them, or None."""
        self.count_saturated = count_saturated
        self.transforms = transforms or [None] * len(pools[0].layers)
        N = pools[0].step.n_queries
        H = pools[0].layers[0].kv_heads if pools[0].layers else 0
        self.q_shape, self.kv_shape = (N, Hq, D), (N, H, D)
        # every layer's outputs in the same arrays: an np.empty between two layers' weight reads
        # would run with cold caches, as every op there does. With two pools, each one's merged
        # partial is a row of `both`, merged into its first
        both = None
        if len(pools) > 1:
            both = (empty_rows((len(pools), N, Hq, D)), empty_rows((len(pools), N, Hq)))
        self.merge, self.both = merge, both
        self.parts = []  # per pool: (attend calls, threads, work items, out, args per layer)
        for at, pool in enumerate(pools):
            threads, splits = pool.share
            if both is not None and splits == 1:  # the kernel writes its row of `both`
                out = (both[0][at:at + 1], both[1][at:at + 1])
            else:
                out = (empty_rows((splits, N, Hq, D)), empty_rows((splits, N, Hq)))  # o, lse
            args = [(pool.step.q_seq, pool.step.q_pos, pool.step.table, pool.step.ctx_lens,
                     calls.k_arrays, calls.v_arrays, H, calls.block_size, sm_scale, *out)
                    for calls in pool.layers]
            self.parts.append((pool.layers, threads, splits * N * H, out, args))
            assert all(calls.kv_heads == H for calls in pool.layers), "every layer has H KV heads"
        self.o = both[0][0] if both is not None else self.parts[0][3][0][0]  # (N, Hq, D)
        self.o_rows = self.o.reshape(N, Hq * D)  # a view: o as the next product reads it
        self.stores = pools[target].layers
        self.store_args = [(blk, off, *calls.store_args) for calls in self.stores]
        # what the transforms write: q, k, v as the cache meets them, and the output
        self.turned = (empty_rows(self.q_shape), empty_rows(self.kv_shape),
                       empty_rows(self.kv_shape), empty_rows(self.q_shape))
        self.turned_rows = self.turned[3].reshape(self.o_rows.shape)

    def __call__(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Store k, v (N, H, D) float32 of `layer`, then attend q (N, Hq, D) -> o (N, Hq * D),
        the same array every call where the layer has no transform (overwritten by the next)."""
        maps = self.transforms[layer]
        if maps is None:
            self.store(layer, k, v)
            self.attend(layer, q)
            return self.o_rows
        q, k, v = (self.turn(x, m, out) for x, m, out in zip((q, k, v), maps, self.turned))
        self.store(layer, k, v)
        o = self.turn(self.attend(layer, q), maps[3], self.turned[3])  # (N, Hq, D)
        return self.turned_rows if o is self.turned[3] else self.o_rows

    @staticmethod
    def turn(x: np.ndarray, m: tuple, out: np.ndarray) -> np.ndarray:
        """x through one map of a layer's transform (cpu_maps.head_map_kernel) into out; x
        itself where the map is none, as quant.Transform leaves it."""
        maps, bias = m
        if maps.shape[0] == 0 and bias.shape[0] == 0:
            return x
        if x.dtype is not _FLOAT32 or x.shape != out.shape:
            x, = _checked(out.shape, x)
        call = _head_map(out.shape[2])
        call.entries.get(x.flags.num & TYPED_FLAGS, call)(x, maps, bias, out)
        return out

    def store(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """CpuKernels.store of k, then of v (N, H, D) float32, without the conversions."""
        if k.dtype is not _FLOAT32 or v.dtype is not _FLOAT32 or k.shape != self.kv_shape \
                or v.shape != self.kv_shape:
            k, v = _checked(self.kv_shape, k, v)
        calls = self.stores[layer].store
        layout = k.flags.num & TYPED_FLAGS | (v.flags.num & TYPED_FLAGS) << 16
        n_sat = calls.entries.get(layout, calls)(k, v, *self.store_args[layer])
        if n_sat and self.count_saturated is not None:
            self.count_saturated(n_sat)

    def attend(self, layer: int, q: np.ndarray) -> np.ndarray:
        """CpuKernels.attend of q (N, Hq, D) float32 over each pool, merged, without the
        conversions. The output is overwritten by the next call: read it before attending
        another layer."""
        if q.dtype is not _FLOAT32 or q.shape != self.q_shape:
            q, = _checked(self.q_shape, q)
        if not q.flags.c_contiguous:  # the kernel reads q at flat offsets
            q = np.ascontiguousarray(q)
        layout = q.flags.num & TYPED_FLAGS
        for at, (layers, threads, items, out, args) in enumerate(self.parts):
            if threads == 1:
                calls = layers[layer].attend
                calls.entries.get(layout, calls)(0, items, q, *args[layer])
            else:
                use_threads(threads)
                calls = layers[layer].attend_parallel
                calls.entries.get(layout, calls)(threads, q, *args[layer])
            if out[0].shape[0] > 1:  # splits of each query's blocks
                self.merge(*out)
                if self.both is not None:  # this pool's partial into its row of `both`
                    self.both[0][at] = out[0][0]
                    self.both[1][at] = out[1][0]
        if self.both is not None:
            self.merge(*self.both)
        return self.o  # (N, Hq, D)


def layer_calls(layers: list[tuple[PoolLayer, PoolLayer]],
                attention: Callable[[PoolLayer, PoolLayer], KernelCall | None], written: bool
                ) -> list[LayerCalls] | None:
    """Every layer's calls, its pools (K, V) given; `attention`: CpuKernels._call for a pair of
    pools; the store's too where the step writes the pool. None if a pool's store or attention is
    not done in place: a written pool's block-wise scales are made when a block fills."""
    calls = []
    for k, v in layers:
        call = attention(k, v)
        if call is None or written and (k.p.block_wise or v.p.block_wise):
            return None
        store, pair_args = None, ()  # a pool only read: its blocks filled in the hot pool
        if written:
            k_store, v_store = (store_args(pool.p, pool.data, pool.scale, pool.zero)
                                for pool in (k, v))
            assert k_store.block_size == v_store.block_size == call.block_size, \
                "K and V share the table"
            store = Resolved(compiled_store_pair, 0, 1)
            pair_args = (k_store.fmt, k_store.arrays, k_store.limits, k_store.dynamic,
                         k_store.clips, k_store.fit_steps, v_store.fmt, v_store.arrays,
                         v_store.limits, v_store.dynamic, v_store.clips, v_store.fit_steps,
                         call.block_size)
        calls.append(LayerCalls(store, pair_args, Resolved(call.serial, 2),
                                Resolved(call.parallel, 1), call.k_arrays, call.v_arrays,
                                call.kv_heads, call.block_size))
    return calls


def transform_arrays(transforms: list) -> list | None:
    """Each layer's quant.Transform as DirectLayers takes it (its maps: (maps, bias) numpy
    arrays each; None where it has none); None if any is not float32, as the kernel is."""
    if any(m.maps.dtype != torch.float32 for t in transforms for m in t.maps):
        return None
    return [None if t.identity else tuple((m.maps.numpy(), m.bias.numpy()) for m in t.maps)
            for t in transforms]


def _checked(shape: tuple, *rows: np.ndarray) -> tuple:
    """The rows as the direct calls take them: float32 of `shape` (another float32 descriptor,
    say one with metadata, is copied to numpy's own); anything else is a TypeError."""
    if not all(r.dtype == _FLOAT32 and r.shape == shape for r in rows):
        got = ", ".join(f"{r.dtype} of shape {r.shape}" for r in rows)
        raise TypeError(f"the direct path takes float32 rows of shape {shape}, got {got}")
    return tuple(r if r.dtype is _FLOAT32 else r.astype(_FLOAT32) for r in rows)
