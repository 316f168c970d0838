"""quant.HeadMap on the CPU in one compiled call: a layer's transform (`:rot`, `:center`,
`:smooth`, folded into one affine map per head by quant.Transform.maps) applied to a decode
step's few rows. In torch each map is a product and an add, each an op with a fixed cost that
the arithmetic (a 64 x 64 map a head) does not come near; here it is one call.

The cache's kernels apply it on both of a decode step's paths (Plan.attend, and the direct calls
of cpu_direct.py), so both give the same numbers bit for bit."""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from ..quant import HeadMap, head_map_ref
from .cpu_numerics import kernel
from .cpu_simd import load, splat, store
from .layout import empty_rows


@cache
def head_map_kernel(D: int):
    """head_map_rows(x, maps, bias, out) for rows of D channels (D a compile-time lane count):
    out[n, j] = x[n, j] @ maps[g] + bias[h] for rows x (N, J, D) float32 (any strides), maps
    (G, D, D) (G = 0: none), bias (Hb, D) (Hb = 0: none), out (N, J, D) C-contiguous; g = j //
    (J / G), h = j // (J / Hb). A row's D sums stay in vector registers while each of its
    channels adds a row of the map times it (written to memory each time, they ran at a tenth of
    the FMA peak)."""
    @kernel(("head_map", D), error_model="numpy")
    def head_map_rows(x, maps, bias, out):
        N, J = x.shape[0], x.shape[1]
        G, Hb = maps.shape[0], bias.shape[0]
        for n in range(N):
            for j in range(J):
                first = (n * J + j) * D  # out's flat element where row (n, j) starts
                h = j // (J // Hb) if Hb != 0 else 0
                if G == 0:  # the bias alone
                    for e in range(D):
                        out[n, j, e] = x[n, j, e] + bias[h, e]
                    continue
                g = j // (J // G)
                sums = load(bias, h * D, D) if Hb != 0 else splat(0.0, D)
                for d in range(D):
                    sums = sums + splat(x[n, j, d], D) * load(maps, (g * D + d) * D, D)
                store(out, first, sums)
    return head_map_rows


def head_map_rows(x: np.ndarray, maps: np.ndarray, bias: np.ndarray, out: np.ndarray) -> None:
    """head_map_kernel's for these rows' D."""
    head_map_kernel(x.shape[2])(x, maps, bias, out)


def head_map_cpu(x: torch.Tensor, m: HeadMap) -> torch.Tensor:
    """quant.head_map_ref's contract, compiled, for float32 rows (N, J, D) on the CPU; anything
    else (other dtypes or ranks) through quant.head_map_ref."""
    if x.dim() != 3 or x.dtype != torch.float32 or m.maps.dtype != torch.float32 \
            or x.device.type != "cpu":
        return head_map_ref(x, m)
    out = empty_rows(tuple(x.shape))  # (N, J, D)
    head_map_rows(x.numpy(), m.maps.numpy(), m.bias.numpy(), out)
    return torch.from_numpy(out)
