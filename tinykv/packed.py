"""Float32 weights that came from a 4-bit file, read by the CPU decode GEMV in 6 bits, losslessly.

The default model ships as a Q4_1 GGUF: each block of 32 weights of a row is w = d * q + m, with
a scale d and a minimum m in float16 and codes q in 0..15. fetch.py dequantizes it into a float32
checkpoint, so a decode step reads 4 bytes for each weight that holds 4 bits. At one sequence a
step's linear layers are bound by those bytes, and they cap what a smaller KV cache can gain: at
8k tokens the fp32 weights are three quarters of a step's reads beside an int4 cache.

`pack(weight)` recovers d, m and q for every block of a float32 matrix and keeps them only when
d * q + m gives back every weight bit for bit. d is a float16 value and q has 4 bits, so d * q is
exact in float32 and the one rounding of + m is the same whether or not it is fused: the kernel's
fused multiply-add rebuilds the very float32 weights (tests/test_packed.py checks against gguf's
own dequantizer). Any other matrix (trained float32 weights, 8-bit blocks, a row length that is
not a multiple of 32) is left as it is.

The packed layout is the GEMV's (gemv_packed.py): panels of 16 output rows (the last padded with
zero rows), and in a panel, per pair of input channels, 16 bytes: byte j holds row j's code at
the even channel (low nibble) and at the odd one (high nibble). d and m are float32, per panel
and block of 32 channels, the 16 rows' side by side. So one 16-byte load and one vector load of d
and of m rebuild 16 rows' weights in registers: 24 bytes per 32 weights instead of 128.
Prefill keeps the float32 matrices (torch's matmul). `pack_model` packs every linear layer of a
loaded model that packs.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .gemv_packed import GROUP, PANEL
from .kernels.cpu_numerics import AVAILABLE

LEVELS = 15  # the largest code
_ATTRIBUTE = "tinykv_packed"  # the packed arrays ride on the weight tensor itself


class Packed(NamedTuple):
    """A float32 matrix W (rows, K) as its Q4_1 blocks, in panels of PANEL output rows."""

    codes: np.ndarray  # (panels, K/2, PANEL) uint8: [p, t, j] = row p*16+j, channels 2t (low), 2t+1
    scales: np.ndarray  # (panels, K/32, PANEL) float32: d of row p*16+j's block
    mins: np.ndarray  # (panels, K/32, PANEL) float32: m of the same block
    rows: int  # N: the rows past it in the last panel are zeros, never written


def pack(weight: torch.Tensor) -> Packed | None:
    """The Packed form of the float32 matrix `weight` (N, K), which rebuilds it exactly, or None
    where no such codes exist."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % GROUP:
        return None
    n, k = weight.shape
    blocks = weight.detach().reshape(n, k // GROUP, GROUP)  # (N, K/32, 32)
    low = blocks.amin(-1)  # (N, K/32): m is the block's smallest weight (its code is 0)
    high = blocks.amax(-1)
    if not torch.equal(low.half().float(), low):
        return None
    # d is (max - min) / 15 rounded to float16 when the block used its top code; the float16
    # values beside it cover a rounding the other way (each block keeps the first that works)
    estimate = ((high - low) / LEVELS).half().view(torch.int16)
    scales = torch.zeros_like(low)
    codes = torch.zeros(blocks.shape, dtype=torch.uint8)
    found = torch.zeros(low.shape, dtype=torch.bool)
    for step in (0, 1, -1):
        d = (estimate + step).view(torch.float16).float()
        if not torch.isfinite(d).all():
            continue
        q = torch.round((blocks - low[..., None]) / torch.where(d == 0, 1.0, d)[..., None])
        q = q.clamp(0, LEVELS)
        exact = (d[..., None] * q + low[..., None] == blocks).all(-1) & ~found
        scales[exact] = d[exact]
        codes[exact] = q[exact].to(torch.uint8)
        found |= exact
    if not found.all():
        return None
    return _panels(codes.reshape(n, k), scales, low)


def _panels(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> Packed:
    """codes (N, K) uint8, scales and mins (N, K/32) -> Packed (the layout above)."""
    n, k = codes.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=torch.uint8)  # (P*16, K)
    padded[:n] = codes
    pairs = padded.view(panels, PANEL, k // 2, 2)
    nibbles = pairs[..., 0] | (pairs[..., 1] << 4)  # (P, 16, K/2)

    def by_panel(per_block: torch.Tensor) -> np.ndarray:  # (N, K/32) -> (P, K/32, 16)
        out = torch.zeros(panels * PANEL, k // GROUP)
        out[:n] = per_block
        return out.view(panels, PANEL, -1).transpose(1, 2).contiguous().numpy()
    return Packed(nibbles.transpose(1, 2).contiguous().numpy(), by_panel(scales), by_panel(mins),
                  n)


def packed_arrays(weight: torch.Tensor) -> Packed | None:
    """The Packed form `pack_model` attached to `weight`, or None, also when the weight has new
    storage since (.data replaced: those arrays are another matrix's)."""
    address, arrays = getattr(weight, _ATTRIBUTE, (None, None))
    return arrays if address == weight.data_ptr() else None


def packed_bytes(weight: torch.Tensor) -> int:
    """The bytes a decode step reads for `weight`: its packed codes and scales, or itself."""
    arrays = packed_arrays(weight)
    if arrays is None:
        return weight.nbytes
    return arrays.codes.nbytes + arrays.scales.nbytes + arrays.mins.nbytes


def pack_model(model) -> int:
    """Pack every linear layer's weight of `model` (a loaded Transformer on the CPU) that packs
    losslessly, except the LM head (read whole, but it is an embedding table too); returns how
    many matrices were packed, 0 without numba. The decode GEMV (gemv._block) reads them packed
    from then on; a weight given new storage later is read as it is."""
    if not AVAILABLE:
        return 0
    weights = [m.weight for m in model.modules()  # model.Linear is an nn.Linear
               if isinstance(m, torch.nn.Linear) and m is not model.lm_head and m.weight.is_cpu]
    count = 0
    for w in weights:
        arrays = pack(w)
        if arrays is not None:
            setattr(w, _ATTRIBUTE, (w.data_ptr(), arrays))
            count += 1
    return count
