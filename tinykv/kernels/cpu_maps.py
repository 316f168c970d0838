"""quant.HeadMap on the CPU in one compiled call: a layer's transform (`:rot`, `:center`,
`:smooth`, folded into one affine map per head by quant.Transform.maps) applied to a decode
step's few rows. In torch each map is a product and an add, each an op with a fixed cost that
the arithmetic (a 64 x 64 map a head) does not come near; here it is one call.

The cache's kernels apply it on both of a decode step's paths (Plan.attend, and the direct calls
of cpu_direct.py), so both give the same numbers bit for bit."""

from __future__ import annotations

import numpy as np
import torch

from ..quant import HeadMap, head_map_ref
from .cpu_numerics import kernel
from .layout import empty_rows


@kernel(("head_map",), error_model="numpy")
def head_map_rows(x, maps, bias, out):
    """out[n, j] = x[n, j] @ maps[g] + bias[h] for rows x (N, J, D) float32, maps (G, D, D)
    (G = 0: none), bias (Hb, D) (Hb = 0: none); g = j // (J / G), h = j // (J / Hb). Each
    output row is summed over the input's channels in order, a vector of D lanes at a time."""
    N, J, D = x.shape
    G, Hb = maps.shape[0], bias.shape[0]
    row = np.empty(D, np.float32)
    for n in range(N):
        for j in range(J):
            if G == 0:
                for e in range(D):
                    row[e] = x[n, j, e]
            else:
                g = j // (J // G)
                for e in range(D):
                    row[e] = 0.0
                for d in range(D):
                    weight = x[n, j, d]
                    for e in range(D):
                        row[e] += weight * maps[g, d, e]
            if Hb != 0:
                h = j // (J // Hb)
                for e in range(D):
                    row[e] += bias[h, e]
            for e in range(D):
                out[n, j, e] = row[e]


def head_map_cpu(x: torch.Tensor, m: HeadMap) -> torch.Tensor:
    """quant.head_map_ref's contract, compiled, for float32 rows (N, J, D) on the CPU; anything
    else (other dtypes or ranks) through quant.head_map_ref."""
    if x.dim() != 3 or x.dtype != torch.float32 or m.maps.dtype != torch.float32 \
            or x.device.type != "cpu":
        return head_map_ref(x, m)
    out = empty_rows(tuple(x.shape))  # (N, J, D)
    head_map_rows(x.numpy(), m.maps.numpy(), m.bias.numpy(), out)
    return torch.from_numpy(out)
