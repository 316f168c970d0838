"""Float32 weights that came from a 4- or 8-bit file, read by the CPU decode GEMV in 6 or 9 bits a
weight, losslessly.

The default model ships as a GGUF: its linear layers in Q4_1, where each block of 32 weights of a
row is w = d * q + m with a scale d and a minimum m in float16 and codes q in 0..15; its embedding
(also its LM head) in Q8_0, w = d * q with q in -127..127. fetch.py dequantizes it into a float32
checkpoint, so a decode step reads 4 bytes for each weight that holds 4 or 8 bits. At one sequence
a step's linear layers are bound by those bytes, and they cap what a smaller KV cache can gain: at
8k tokens the fp32 weights are three quarters of a step's reads beside an int4 cache.

`pack(weight)` recovers d, m and q for every block of a float32 matrix, as Q4_1 or else as Q8_0,
and keeps them only when they give back every weight bit for bit. d is a float16 value and q has
at most 8 bits, so d * q is exact in float32 and the one rounding of + m is the same whether or
not it is fused: the kernel rebuilds the very float32 weights (tests/test_packed.py checks
against gguf's own quantizers and dequantizers). Any other matrix (trained float32 weights, a row
length that is not a multiple of 32, one bit off) is left as it is.

The packed layout is the GEMV's (gemv_packed.py): panels of 16 output rows (the last padded with
zero rows), and in a panel, per pair of input channels, the 16 rows' codes side by side: 16 bytes
for 4-bit codes (byte j: row j's code at the even channel in the low nibble, at the odd one in
the high nibble), 32 for 8-bit ones (the even channel's 16 rows, then the odd one's). d and m
are float32, per panel and block of 32 channels, the 16 rows' side by side (no m for Q8_0). So
one load of codes and one vector load of d (and of m) rebuild 16 rows' weights in registers: 24
or 36 bytes per 32 weights instead of 128. Prefill keeps the float32 matrices (torch's matmul).
`pack_model` packs every linear layer of a loaded model that packs.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .gemv_packed import GROUP, PANEL
from .kernels.cpu_numerics import AVAILABLE

LEVELS = 15  # Q4_1's largest code
LIMIT = 127  # Q8_0's largest code magnitude (d = the block's largest magnitude / 127)
_ATTRIBUTE = "tinykv_packed"  # the packed arrays ride on the weight tensor itself


class Packed(NamedTuple):
    """A float32 matrix W (rows, K) as its Q4_1 or Q8_0 blocks, in panels of PANEL output rows;
    p, t, j below: panel, channel pair, row in the panel (row p * 16 + j of W)."""

    codes: np.ndarray  # Q4_1: (P, K/2, 16) uint8, [p, t, j] the codes at channels 2t (low), 2t+1
    #                    Q8_0: (P, K/2, 32) int8, [p, t, j] at channel 2t, [p, t, 16 + j] at 2t+1
    scales: np.ndarray  # (P, K/32, 16) float32: d of row p * 16 + j's block
    mins: np.ndarray  # (P, K/32, 16) float32: m of the same block; (0,) for Q8_0
    rows: int  # N: the rows past it in the last panel are zeros, never written


def pack(weight: torch.Tensor) -> Packed | None:
    """The Packed form of the float32 matrix `weight` (N, K), which rebuilds it exactly, or None
    where no such codes exist."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % GROUP:
        return None
    n, k = weight.shape
    blocks = weight.detach().reshape(n, k // GROUP, GROUP)  # (N, K/32, 32)
    found = _q4_1(blocks)
    if found is None:
        found = _q8_0(blocks)
    if found is None:
        return None
    codes, scales, mins = found
    pairs = _padded(codes.view(n, k)).view(-1, PANEL, k // 2, 2)  # (P, 16, K/2, 2)
    if codes.dtype == torch.uint8:  # Q4_1: a channel pair's two codes in one byte
        nibbles = pairs[..., 0] | (pairs[..., 1] << 4)  # (P, 16, K/2)
        return Packed(nibbles.transpose(1, 2).contiguous().numpy(), _by_panel(scales),
                      _by_panel(mins), n)
    side_by_side = pairs.permute(0, 2, 3, 1).reshape(-1, k // 2, 2 * PANEL)  # (P, K/2, 32)
    return Packed(side_by_side.contiguous().numpy(), _by_panel(scales), np.zeros(0, np.float32),
                  n)


def _q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(codes (N, K/32, 32) uint8, d, m (N, K/32)) with d * q + m == blocks (N, K/32, 32)."""
    low = blocks.amin(-1)  # (N, K/32): m is the block's smallest weight (its code is 0)
    high = blocks.amax(-1)
    if not torch.equal(low.half().float(), low):
        return None
    # d is (max - min) / 15 rounded to float16 when the block used its top code; the float16
    # values beside it cover a rounding the other way (each block keeps the first that works)
    return _codes(blocks, (high - low) / LEVELS, low, 0, LEVELS, torch.uint8)


def _q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(codes (N, K/32, 32) int8, d, m = 0 (N, K/32)) with d * q == blocks (N, K/32, 32)."""
    return _codes(blocks, blocks.abs().amax(-1) / LIMIT, torch.zeros(blocks.shape[:2]), -LIMIT,
                  LIMIT, torch.int8)


def _codes(blocks, estimate, low, least, most, dtype):
    """Codes q in least..most and float16 scales d per block with d * q + low == blocks exactly:
    d from `estimate` rounded to float16 or one float16 step either side (the first that works
    for each block), or None where some block has none."""
    estimate = estimate.half().view(torch.int16)
    scales = torch.zeros_like(low)
    codes = torch.zeros(blocks.shape, dtype=dtype)
    found = torch.zeros(low.shape, dtype=torch.bool)
    for step in (0, 1, -1):
        d = (estimate + step).view(torch.float16).float()
        if not torch.isfinite(d).all():
            continue
        q = torch.round((blocks - low[..., None]) / torch.where(d == 0, 1.0, d)[..., None])
        q = q.clamp(least, most)
        exact = (d[..., None] * q + low[..., None] == blocks).all(-1) & ~found
        scales[exact] = d[exact]
        codes[exact] = q[exact].to(dtype)
        found |= exact
    return (codes, scales, low) if found.all() else None


def _padded(rows: torch.Tensor) -> torch.Tensor:
    """rows (N, ...) with zero rows after them up to a whole number of panels."""
    out = rows.new_zeros((-(-rows.shape[0] // PANEL) * PANEL, *rows.shape[1:]))
    out[:rows.shape[0]] = rows
    return out


def _by_panel(per_block: torch.Tensor) -> np.ndarray:
    """(N, K/32) -> (P, K/32, 16): each panel's 16 rows side by side."""
    padded = _padded(per_block)
    return padded.view(-1, PANEL, padded.shape[1]).transpose(1, 2).contiguous().numpy()


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
    losslessly, the LM head too (tied to the embedding, whose lookups keep reading the float32
    table); returns how many matrices were packed, 0 without numba. The decode GEMV
    (gemv._block) reads them packed from then on; a weight given new storage later is read as it
    is."""
    if not AVAILABLE:
        return 0
    weights = [m.weight for m in model.modules()  # model.Linear is an nn.Linear
               if isinstance(m, torch.nn.Linear) and m.weight.is_cpu]
    count = 0
    for w in weights:
        arrays = pack(w)
        if arrays is not None:
            setattr(w, _ATTRIBUTE, (w.data_ptr(), arrays))
            count += 1
    return count
