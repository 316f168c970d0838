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

from .cpu_store import compiled_store_pair, store_args
from .layout import PoolLayer, empty_rows


class Resolved:
    """A compiled kernel called with arguments of the same types every time: the first call goes
    through numba's dispatcher, later ones straight to the compiled version it chose. The
    dispatcher types every argument of every call (a dozen arrays and tuples here: 1-2 us of a
    direct attention call's 4-6, bench kernel --cpu), and a direct layer's calls take the same
    pools, step arrays and output arrays every step. Only the rows (the arguments at positions
    `rows_at`, float32 of rank 3: _float32_rows) change between steps, and with them maybe their
    layout (a view of one token is contiguous, of several may not be): a version is kept per
    layout of them all."""

    def __init__(self, dispatcher: Callable, *rows_at: int):
        self.dispatcher, self.rows_at = dispatcher, rows_at
        self.entries: dict[tuple[bool, ...], Callable] = {}  # (C, Fortran) flags of each rows

    def __call__(self, *args):
        layout = ()
        for at in self.rows_at:
            flags = args[at].flags
            layout += (flags.c_contiguous, flags.f_contiguous)
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
    # dynamic), K's then V's, and the block size (cpu_store.StoreArgs)
    attend: Resolved  # the serial attention kernel of this pair of formats
    k_arrays: tuple  # cpu_args.PoolArrays of K, then V
    v_arrays: tuple
    kv_heads: int
    block_size: int


class DirectLayers:
    """One decode step's store and attention, a layer at a time, in numpy (CpuKernels.direct)."""

    def __init__(self, step, blk: np.ndarray, off: np.ndarray, layers: list[LayerCalls],
                 sm_scale: np.float32, count_saturated: Callable[[int], None]):
        """step: the step's metadata as numpy (cpu._Step); blk, off (N,): every token's slot."""
        self.step, self.blk, self.off, self.layers = step, blk, off, layers
        self.sm_scale, self.count_saturated = sm_scale, count_saturated
        # every layer's outputs in the same arrays, made on the first call: an np.empty between
        # two layers' weight reads would run with cold caches, as every op there does
        self.out: tuple[np.ndarray, np.ndarray] | None = None  # o (1, N, Hq, D), lse (1, N, Hq)

    def __call__(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Store k, v (N, H, D) float32 of `layer`, then attend q (N, Hq, D) -> o (N, Hq, D)."""
        self.store(layer, k, v)
        return self.attend(layer, q)

    def store(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """CpuKernels.store of k, then of v (N, H, D), without the conversions."""
        calls = self.layers[layer]
        _float32_rows(k)
        _float32_rows(v)
        n_sat = calls.store(k, v, self.blk, self.off, *calls.store_args)
        if n_sat:
            self.count_saturated(n_sat)

    def attend(self, layer: int, q: np.ndarray) -> np.ndarray:
        """CpuKernels.attend of q (N, Hq, D) on one thread, without the conversions. The output
        is overwritten by the next call: read it before attending another layer."""
        calls, step = self.layers[layer], self.step
        N, Hq, D = q.shape
        if self.out is None or self.out[0].shape != (1, N, Hq, D):
            self.out = (empty_rows((1, N, Hq, D)), empty_rows((1, N, Hq)))
        o, lse = self.out
        H = calls.kv_heads
        _float32_rows(q)
        calls.attend(0, N * H, np.ascontiguousarray(q), step.q_seq, step.q_pos, step.table,
                     step.ctx_lens, calls.k_arrays, calls.v_arrays, H, calls.block_size,
                     self.sm_scale, o, lse)
        return o[0]  # (N, Hq, D)


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
        serial, _, k_arrays, v_arrays, H, BS = call
        k_store, v_store = (store_args(pool.p, pool.data, pool.scale, pool.zero)
                            for pool in (k, v))
        assert k_store.block_size == v_store.block_size == BS, "K and V share the block table"
        pair_args = (k_store.fmt, k_store.arrays, k_store.limits, k_store.dynamic,
                     v_store.fmt, v_store.arrays, v_store.limits, v_store.dynamic, BS)
        calls.append(LayerCalls(Resolved(compiled_store_pair, 0, 1), pair_args,
                                Resolved(serial, 2), k_arrays, v_arrays, H, BS))
    return calls


def _float32_rows(rows: np.ndarray) -> None:
    """What Resolved's callers promise: (N, heads, D) float32 rows, as the layers make them."""
    if rows.dtype != np.float32 or rows.ndim != 3:
        raise TypeError(f"the direct path takes (N, heads, D) float32 rows, got {rows.dtype} "
                        f"of shape {rows.shape}")
