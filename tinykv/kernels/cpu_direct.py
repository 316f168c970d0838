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

from .cpu_store import StoreArgs, store_args, store_kernel
from .layout import PoolLayer


class LayerCalls(NamedTuple):
    """One layer's store and attention as DirectLayers calls them, converted once per cache."""
    k_store: StoreArgs
    v_store: StoreArgs
    attend: Callable  # the serial attention kernel of this pair of formats
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
        n_sat = store_kernel(k, self.blk, self.off, calls.k_store)
        n_sat += store_kernel(v, self.blk, self.off, calls.v_store)
        if n_sat:
            self.count_saturated(n_sat)

    def attend(self, layer: int, q: np.ndarray) -> np.ndarray:
        """CpuKernels.attend of q (N, Hq, D) on one thread, without the conversions. The output
        is overwritten by the next call: read it before attending another layer."""
        calls, step = self.layers[layer], self.step
        N, Hq, D = q.shape
        if self.out is None or self.out[0].shape != (1, N, Hq, D):
            self.out = (np.empty((1, N, Hq, D), np.float32), np.empty((1, N, Hq), np.float32))
        o, lse = self.out
        H = calls.kv_heads
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
        stores = [store_args(pool.p, pool.data, pool.scale, pool.zero) for pool in (k, v)]
        calls.append(LayerCalls(*stores, serial, k_arrays, v_arrays, H, BS))
    return calls
