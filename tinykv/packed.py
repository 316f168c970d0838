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
not a multiple of 32) is left as it is. A packed matrix holds per block 16 bytes of codes (two
per byte, the Q4_1 order: byte j holds weights j and j + 16) and d and m as float32: 24 bytes per
32 weights instead of 128.

The GEMV (gemv._block, by block_product) decodes a block of 8 output rows (or one register
tile's rows) into a small float32 tile, which stays in L1 or L2, and multiplies it with the
float32 loops of gemv_tiles.py, so the arithmetic is theirs; only the bytes from memory shrink.
Prefill keeps the float32 matrices (torch's matmul). `pack_model` packs every linear layer of a
loaded model that packs.
"""

from __future__ import annotations

import numpy as np
import torch

from .gemv_tiles import _FASTMATH, _eight_rows, tile_rows, tiles_block
from .kernels.cpu_numerics import AVAILABLE, njit
from .kernels.cpu_simd import plane_lanes, splat, store, to_float
from .kernels.cpu_simd_ops import fma

GROUP = 32  # weights of a row per (d, m) pair, as in Q4_1
HALF = GROUP // 2  # bytes of codes per group (numba reads constants, not expressions, as literals)
LEVELS = 15  # the largest code
_ATTRIBUTE = "tinykv_packed"  # the packed arrays ride on the weight tensor itself


def pack(weight: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(codes (N, K/2) uint8, scales (N, K/32) float32, mins (N, K/32) float32) that rebuild the
    float32 matrix `weight` (N, K) exactly, or None where no such codes exist."""
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
    halves = codes[..., :HALF] | (codes[..., HALF:] << 4)  # (N, K/32, 16)
    return halves.reshape(n, k // 2).numpy(), scales.numpy(), low.numpy()


def packed_arrays(weight: torch.Tensor) -> tuple | None:
    """The arrays `pack_model` attached to `weight` (codes, scales, mins), or None, also when
    the weight has new storage since (.data replaced: those arrays are another matrix's)."""
    address, arrays = getattr(weight, _ATTRIBUTE, (None, None))
    return arrays if address == weight.data_ptr() else None


def packed_bytes(weight: torch.Tensor) -> int:
    """The bytes a decode step reads for `weight`: its packed codes and scales, or itself."""
    arrays = packed_arrays(weight)
    return weight.nbytes if arrays is None else sum(a.nbytes for a in arrays)


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


def _decode_rows(codes, scales, mins, first, rows, tile):
    """tile (flat, rows * K used) = the float32 weights of rows first .. first+rows-1, rebuilt
    from their codes: per block of 32, one 16-byte load, two nibble planes, d * q + m fused."""
    k = codes.shape[1] * 2
    for r in range(rows):
        row = first + r
        for block in range(k // GROUP):
            q = to_float(plane_lanes(codes, row * (k // 2) + block * HALF, 0, GROUP, 4, HALF))
            weights = fma(q, splat(scales[row, block], GROUP), splat(mins[row, block], GROUP))
            store(tile, r * k + block * GROUP, weights)


def _block_product(x, w, y, first, count, eight):
    """Output rows first .. first+count-1 of y (B, N) = x (B, K) @ W^T for W packed in w (codes,
    scales, mins): the rows decoded into a tile of their own, then multiplied by the float32
    loops: all of them at once for the eight-row loop (`eight`), else as many as one register
    tile takes (2 or 4), so that the tile shares L1 with the activation rows. The tile is
    allocated here: a shared one per thread would need numba's thread id, and code that calls
    it crashed when loaded from numba's disk cache."""
    codes, scales, mins = w
    last = min(first + count, codes.shape[0])
    k = codes.shape[1] * 2
    flat = np.empty(count * k, np.float32)  # (count * K,)
    step = count if eight else tile_rows(x.shape[0], k)
    for start in range(first, last, step):
        rows = min(step, last - start)
        _decode_rows(codes, scales, mins, start, rows, flat)
        tile = flat[:rows * k].reshape((rows, k))  # (rows, K)
        out = y[:, start:start + rows]  # (B, rows), a view
        if eight:
            _eight_rows(x, tile, out, 0, 1)
        else:
            tiles_block(x, tile, out, 0, rows)


if AVAILABLE:
    _decode_rows = njit(inline="always", cache=True)(_decode_rows)
    block_product = njit(fastmath=_FASTMATH, inline="always", cache=True)(_block_product)
else:
    block_product = _block_product
