"""A decode step's store and attention as numpy calls, a layer at a time (cpu.CpuKernels.direct
makes them): the compiled kernels `CpuKernels.store` and `.attend` call, with the arguments those
convert from torch made once (each layer's pools once per cache, the step's metadata once per
step), so that nothing between a layer's compiled calls makes a torch tensor
(gemv_layer.layers_cpu runs the layers). In a decode step each op between two layers' weight reads
runs with cold caches, where it costs many times what it costs in a loop (bench kernel --cpu)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from .cpu_numerics import use_threads
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


class LayerCalls(NamedTuple):
    """One layer's store and attention as DirectLayers calls them, converted once per cache."""
    store: Resolved  # cpu_store.compiled_store_pair: K and V in one call (the rows at 0 and 1)
    store_args: tuple  # its arguments after blk and off: each pool's (format, arrays, limits,
    # dynamic, clips), K's then V's, and the block size (cpu_store.StoreArgs)
    attend: Resolved  # the serial attention kernel of this pair of formats (q at 2)
    attend_parallel: Resolved  # and the parallel one (q at 1)
    k_arrays: tuple  # cpu_args.PoolArrays of K, then V
    v_arrays: tuple
    kv_heads: int
    block_size: int


class DirectLayers:
    """One decode step's store and attention, a layer at a time, in numpy (CpuKernels.direct).
    Everything but the rows is bound when the step begins (each layer's arguments, the outputs),
    so a call checks the rows, finds its compiled version and calls it: in a decode step every
    line here runs with cold caches, between two layers' weight reads (bench kernel --cpu's cold
    fixed costs)."""

    def __init__(self, step, blk: np.ndarray, off: np.ndarray, layers: list[LayerCalls],
                 sm_scale: np.float32, count_saturated: Callable[[int], None], Hq: int, D: int,
                 share: tuple[int, int], merge: Callable):
        """step: the step's metadata as numpy (cpu._Step); blk, off (N,): every token's slot;
        share: (threads, splits of each query's blocks) of the attention (CpuKernels._share);
        merge: cpu._merge_splits, which folds the splits into the first."""
        self.layers, self.count_saturated = layers, count_saturated
        N = step.n_queries
        H = layers[0].kv_heads if layers else 0
        self.q_shape, self.kv_shape = (N, Hq, D), (N, H, D)
        self.threads, splits = share
        self.merge = merge if splits > 1 else None
        self.items = splits * N * H  # work items of a layer's attention: (query, split, KV head)
        # every layer's outputs in the same arrays: an np.empty between two layers' weight reads
        # would run with cold caches, as every op there does
        self.out = (empty_rows((splits, N, Hq, D)), empty_rows((splits, N, Hq)))  # o, lse
        self.o_rows = self.out[0][0].reshape(N, Hq * D)  # a view: o as the next product reads it
        self.attend_args = [(step.q_seq, step.q_pos, step.table, step.ctx_lens, calls.k_arrays,
                             calls.v_arrays, H, calls.block_size, sm_scale, *self.out)
                            for calls in layers]
        self.store_args = [(blk, off, *calls.store_args) for calls in layers]
        assert all(calls.kv_heads == H for calls in layers), "every layer has H KV heads"

    def __call__(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Store k, v (N, H, D) float32 of `layer`, then attend q (N, Hq, D) -> o (N, Hq * D),
        the same array every call (overwritten by the next)."""
        self.store(layer, k, v)
        self.attend(layer, q)
        return self.o_rows

    def store(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """CpuKernels.store of k, then of v (N, H, D) float32, without the conversions."""
        if k.dtype is not _FLOAT32 or v.dtype is not _FLOAT32 or k.shape != self.kv_shape \
                or v.shape != self.kv_shape:
            k, v = _checked(self.kv_shape, k, v)
        calls = self.layers[layer].store
        layout = k.flags.num & TYPED_FLAGS | (v.flags.num & TYPED_FLAGS) << 16
        n_sat = calls.entries.get(layout, calls)(k, v, *self.store_args[layer])
        if n_sat:
            self.count_saturated(n_sat)

    def attend(self, layer: int, q: np.ndarray) -> np.ndarray:
        """CpuKernels.attend of q (N, Hq, D) float32, without the conversions. The output is
        overwritten by the next call: read it before attending another layer."""
        if q.dtype is not _FLOAT32 or q.shape != self.q_shape:
            q, = _checked(self.q_shape, q)
        if not q.flags.c_contiguous:  # the kernel reads q at flat offsets
            q = np.ascontiguousarray(q)
        layout = q.flags.num & TYPED_FLAGS
        if self.threads == 1:
            calls = self.layers[layer].attend
            calls.entries.get(layout, calls)(0, self.items, q, *self.attend_args[layer])
        else:
            use_threads(self.threads)
            calls = self.layers[layer].attend_parallel
            calls.entries.get(layout, calls)(self.threads, q, *self.attend_args[layer])
        if self.merge is not None:
            self.merge(*self.out)
        return self.out[0][0]  # (N, Hq, D)


def layer_calls(layers: list[tuple[PoolLayer, PoolLayer]],
                attention: Callable[[PoolLayer, PoolLayer], tuple | None]
                ) -> list[LayerCalls] | None:
    """Every layer's calls, its pools (K, V) given; `attention`: CpuKernels._call for a pair of
    pools. None if a pool's store or attention is not done in place."""
    calls = []
    for k, v in layers:
        if k.p.block_wise or v.p.block_wise:  # their scales are made when a block fills
            return None
        call = attention(k, v)
        if call is None:
            return None
        serial, parallel, k_arrays, v_arrays, H, BS = call
        k_store, v_store = (store_args(pool.p, pool.data, pool.scale, pool.zero)
                            for pool in (k, v))
        assert k_store.block_size == v_store.block_size == BS, "K and V share the block table"
        pair_args = (k_store.fmt, k_store.arrays, k_store.limits, k_store.dynamic, k_store.clips,
                     v_store.fmt, v_store.arrays, v_store.limits, v_store.dynamic, v_store.clips,
                     BS)
        calls.append(LayerCalls(Resolved(compiled_store_pair, 0, 1), pair_args,
                                Resolved(serial, 2), Resolved(parallel, 1), k_arrays,
                                v_arrays, H, BS))
    return calls


def _checked(shape: tuple, *rows: np.ndarray) -> tuple:
    """The rows as the direct calls take them: float32 of `shape` (another float32 descriptor,
    say one with metadata, is copied to numpy's own); anything else is a TypeError."""
    if not all(r.dtype == _FLOAT32 and r.shape == shape for r in rows):
        got = ", ".join(f"{r.dtype} of shape {r.shape}" for r in rows)
        raise TypeError(f"the direct path takes float32 rows of shape {shape}, got {got}")
    return tuple(r if r.dtype is _FLOAT32 else r.astype(_FLOAT32) for r in rows)
