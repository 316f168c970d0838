"""The GEMV's inner loops (gemv.py). The eight-row loop (_eight_rows, any weight dtype): 8 weight
rows against one activation row at a time, vectorized by LLVM. The tiles, for float32 weights: 4
output rows by 4 activation rows at a time, in vector registers.

Each step along the input channels loads 16 channels of 4 weight rows and of 4 activation rows,
and does 16 fused multiply-adds: 16 accumulators of 16 lanes, one per (activation row, output
row) pair. Loads per multiply-add fall from about one (one weight row per accumulator, as in
the eight-row loop LLVM vectorizes) to a half, so with a few activation rows the loop stays bound
by the weights' bytes instead of by loads. The weight rows of the next group are prefetched into
L2 while these are multiplied, so their reads overlap this group's arithmetic instead of
following it; into L2, not L1, where they would push out the activation rows every group reuses.

From 9 to 16 activation rows, where all of them fit in one core's L1 data cache (`tile_rows`),
tiles are 8 activation rows by 2 weight rows instead (_pair_sums): the same 16 accumulators, but
a weight row's lines come from memory during one of two passes over the activations instead of
one of four, so its reads are spread over half the arithmetic instead of a quarter. Every pair
of weight rows goes through all the activation rows, so that pays only while they stay in L1;
past it each pair reads them again from L2, and the 4 x 4 tiles, which do so half as often, are
faster (the README's Zen 4 section: 14 rows of 576 channels fit its 32 KiB, 15 do not).

Tails: a group past the last activation or output row repeats that row (its sums are computed and
dropped, reads stay inside the arrays); channels past the last multiple of 16 are added one by
one. The vectors are cpu_simd's Vec (one 512-bit register per 16 lanes with AVX-512, two 256-bit
ones with AVX2).
"""

from __future__ import annotations

import numpy as np

from .kernels.cpu_numerics import AVAILABLE, intrinsic, ir, njit, prefetch_l2, types
from .kernels.cpu_simd import _pieces, load, splat
from .kernels.cpu_simd_ops import fma
from .kernels.cpu_simd_tree import pair
from .kernels.layout import cpu_caches

GROUP = 4  # activation rows, and output rows, per tile
EIGHT_ROWS = 8  # weight rows per pass of _eight_rows (gemv.ROWS: a block of the GEMV)
PAIR_ROWS = 8  # activation rows per tile of two weight rows
LANES = 16  # channels per step: one 64-byte line of float32
_FASTMATH = {"reassoc", "contract", "arcp", "nsz"}


@intrinsic
def _lane(typingctx, v, i):
    """Lane i of a 16-lane Vec, as a scalar (LLVM keeps the vector in a register or on the
    stack: no allocation)."""
    def codegen(context, builder, sig, args):
        piece = _pieces(builder, args[0])[0]
        index = context.cast(builder, args[1], sig.args[1], types.int32)
        return builder.extract_element(piece, index)
    if getattr(v, "lanes", None) != LANES:
        return None
    return v.dtype(v, i), codegen


@intrinsic
def _widen(typingctx, w):
    """Weight element -> float32: a float32 as is; bf16 bits (int16) shifted into a float32's high
    half; fp16 bits (uint16) through LLVM's half type (vcvtph2ps with F16C). Each weight type
    compiles to its own straight-line code."""
    def codegen(context, builder, sig, args):
        v = args[0]
        if w == types.float32:
            return v
        if w == types.int16:
            wide = builder.shl(builder.zext(v, ir.IntType(32)), ir.IntType(32)(16))
            return builder.bitcast(wide, ir.FloatType())
        return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())
    if w not in (types.float32, types.int16, types.uint16):
        return None
    return types.float32(w), codegen


def _eight_rows(x, w, y, first, step):
    """Output rows first + i * step (i < EIGHT_ROWS; those past the last row are dropped) of
    y (B, N) = x (B, K) @ w (N, K)^T: the 8 weight rows come from memory once and stay in L1 for
    the rest of the batch."""
    n, k = w.shape
    last = n - 1  # a row past it reads the last row again: summed, then dropped
    r0, r1, r2, r3 = min(first, last), min(first + step, last), min(first + 2 * step, last), \
        min(first + 3 * step, last)
    r4, r5, r6, r7 = min(first + 4 * step, last), min(first + 5 * step, last), \
        min(first + 6 * step, last), min(first + 7 * step, last)
    for b in range(x.shape[0]):
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)  # one per output row
        for c in range(k):  # fastmath: LLVM vectorizes the eight dot products along c
            xc = x[b, c]
            a0 += _widen(w[r0, c]) * xc
            a1 += _widen(w[r1, c]) * xc
            a2 += _widen(w[r2, c]) * xc
            a3 += _widen(w[r3, c]) * xc
            a4 += _widen(w[r4, c]) * xc
            a5 += _widen(w[r5, c]) * xc
            a6 += _widen(w[r6, c]) * xc
            a7 += _widen(w[r7, c]) * xc
        sums = (a0, a1, a2, a3, a4, a5, a6, a7)
        for i in range(EIGHT_ROWS):
            if first + i * step < n:
                y[b, first + i * step] = sums[i]


def _four_fmas(u, v0, v1, v2, v3, a0, a1, a2, a3):
    """One activation row's 16 channels u times 4 weight rows' v0..v3, into a0..a3."""
    return fma(u, v0, a0), fma(u, v1, a1), fma(u, v2, a2), fma(u, v3, a3)


def _tile_sums(x, w, x_rows, w_rows, steps, ahead, per_step):
    """The 16 dot products of activation rows x_rows (4 flat row starts in x) with weight rows
    w_rows (4 flat row starts in w) over the first 16 * steps channels, as one 16-lane vector in
    (activation, weight) order; per_step lines of w from flat index `ahead` are prefetched each
    step (ahead < 0: none)."""
    x0, x1, x2, x3 = x_rows
    w0, w1, w2, w3 = w_rows
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = splat(0.0, LANES)
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = splat(0.0, LANES)
    for step in range(steps):
        c = step * LANES
        if ahead >= 0:  # into L2 only: L1 holds the activation rows (16 rows of 576: 36 KiB)
            for i in range(per_step):
                prefetch_l2(w, ahead + (step * per_step + i) * LANES)
        v0, v1 = load(w, w0 + c, 16), load(w, w1 + c, 16)
        v2, v3 = load(w, w2 + c, 16), load(w, w3 + c, 16)
        a00, a01, a02, a03 = _four_fmas(load(x, x0 + c, 16), v0, v1, v2, v3, a00, a01, a02, a03)
        a10, a11, a12, a13 = _four_fmas(load(x, x1 + c, 16), v0, v1, v2, v3, a10, a11, a12, a13)
        a20, a21, a22, a23 = _four_fmas(load(x, x2 + c, 16), v0, v1, v2, v3, a20, a21, a22, a23)
        a30, a31, a32, a33 = _four_fmas(load(x, x3 + c, 16), v0, v1, v2, v3, a30, a31, a32, a33)
    # a transpose-and-add tree: each step halves every sum's lanes and packs two sums together
    top = pair(pair(pair(a00, a01, 16), pair(a02, a03, 16), 8),
               pair(pair(a10, a11, 16), pair(a12, a13, 16), 8), 4)
    bottom = pair(pair(pair(a20, a21, 16), pair(a22, a23, 16), 8),
                  pair(pair(a30, a31, 16), pair(a32, a33, 16), 8), 4)
    return pair(top, bottom, 2)


def _pair_sums(x, w, x_first, w0, w1, k, steps, ahead, per_step):
    """The 16 dot products of activation rows x_first .. x_first+7 (flat start x_first, rows k
    apart) with weight rows at flat starts w0 and w1 over the first 16 * steps channels, as one
    16-lane vector: the 8 rows with w0, then with w1; prefetch as _tile_sums."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = splat(0.0, LANES)  # with w0
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = splat(0.0, LANES)  # with w1
    for step in range(steps):
        c = step * LANES
        if ahead >= 0:
            for i in range(per_step):
                prefetch_l2(w, ahead + (step * per_step + i) * LANES)
        v, u = load(w, w0 + c, 16), load(w, w1 + c, 16)
        a0, b0 = _two_fmas(load(x, x_first + c, 16), v, u, a0, b0)
        a1, b1 = _two_fmas(load(x, x_first + k + c, 16), v, u, a1, b1)
        a2, b2 = _two_fmas(load(x, x_first + 2 * k + c, 16), v, u, a2, b2)
        a3, b3 = _two_fmas(load(x, x_first + 3 * k + c, 16), v, u, a3, b3)
        a4, b4 = _two_fmas(load(x, x_first + 4 * k + c, 16), v, u, a4, b4)
        a5, b5 = _two_fmas(load(x, x_first + 5 * k + c, 16), v, u, a5, b5)
        a6, b6 = _two_fmas(load(x, x_first + 6 * k + c, 16), v, u, a6, b6)
        a7, b7 = _two_fmas(load(x, x_first + 7 * k + c, 16), v, u, a7, b7)
    top = pair(pair(pair(a0, a1, 16), pair(a2, a3, 16), 8),
               pair(pair(a4, a5, 16), pair(a6, a7, 16), 8), 4)
    bottom = pair(pair(pair(b0, b1, 16), pair(b2, b3, 16), 8),
                  pair(pair(b4, b5, 16), pair(b6, b7, 16), 8), 4)
    return pair(top, bottom, 2)


def _two_fmas(t, v, u, a, b):
    """One activation row's 16 channels t times 2 weight rows' v and u, into a and b."""
    return fma(t, v, a), fma(t, u, b)


def _pairs_block(x, w, y, first, count):
    """_tiles_block's contract for 9 to 16 activation rows, in tiles of 8 by 2: the last group
    of 8 activation rows ends at the last row (rows in both groups are computed twice and
    written by the second); the 2 weight rows after each tile are prefetched while it is
    multiplied, half by each group."""
    n_rows, n_out, k = x.shape[0], w.shape[0], x.shape[1]
    steps = k // LANES
    starts = (0, n_rows - PAIR_ROWS)  # the two groups' first activation rows
    for o in range(first, min(first + count, n_out), 2):
        r0, r1 = o, min(o + 1, n_out - 1)
        for g in range(2):
            ahead = -1 if o + 2 >= n_out else (o + 2 + g) * k  # next tile's row g
            sums = _pair_sums(x, w, starts[g] * k, r0 * k, r1 * k, k, steps, ahead, 1)
            # A whole tile and no tail channels: loops of constant bounds, which LLVM unrolls,
            # so each sum leaves its lane directly (lanes picked at run time go via the stack).
            if o + 1 < n_out and steps * LANES == k:
                for i in range(PAIR_ROWS):
                    y[starts[g] + i, o] = _lane(sums, i)
                    y[starts[g] + i, o + 1] = _lane(sums, PAIR_ROWS + i)
                continue
            for i in range(PAIR_ROWS):
                row = starts[g] + i
                for j in range(min(2, n_out - o)):
                    total = _lane(sums, j * PAIR_ROWS + i)
                    for c in range(steps * LANES, k):  # channels past the last 16
                        total += x[row, c] * w[o + j, c]
                    y[row, o + j] = total


def l1_data_bytes() -> int:
    """One core's L1 data cache in bytes, from sysfs; 32 KiB where it cannot be read, the smaller
    of this project's machines' (AMD Zen 4: 32 KiB; Intel Sapphire Rapids, AMD Zen 5: 48)."""
    return next((size for level, kind, size in cpu_caches()
                 if level == 1 and kind in ("Data", "Unified")), 32 * 2**10)


L1_DATA_BYTES = l1_data_bytes()  # this machine's: gemv.py passes it to the tiles


def tile_rows(n_rows, k, l1_bytes):
    """Weight rows per tile for n_rows activation rows of k float32 channels, on a core whose L1
    data cache holds l1_bytes (_tiles_block's choice): 2 while the rows fit in it, else 4."""
    fits = n_rows * k * 4 <= l1_bytes
    return 2 if PAIR_ROWS < n_rows <= 2 * PAIR_ROWS and fits else GROUP


def _starts(first, last, k):
    """Flat starts of rows first .. first+3 of a (rows, k) array, repeating row `last` past it."""
    return (min(first, last) * k, min(first + 1, last) * k, min(first + 2, last) * k,
            min(first + 3, last) * k)


def _tiles_block(x, w, y, first, count, l1_bytes):
    """Output rows first .. first+count-1 of y (B, N) = x (B, K) @ w (N, K)^T, in tiles of 4 by
    4, or 8 by 2 where tile_rows says (l1_bytes: a core's L1 data cache; an argument, so that
    numba's disk cache of this function holds no machine's size); the 4 weight rows after each
    group are prefetched while it is multiplied."""
    n_rows, n_out, k = x.shape[0], w.shape[0], x.shape[1]
    if tile_rows(n_rows, k, l1_bytes) == 2:
        _pairs_block(x, w, y, first, count)
        return
    steps = k // LANES
    groups = -(-n_rows // GROUP)  # activation row groups: each prefetches its share
    if groups == 0:
        return
    per_step = max(1, GROUP // groups)  # lines of the next 4 weight rows per step
    for o in range(first, min(first + count, n_out), GROUP):
        w_rows = _starts(o, n_out - 1, k)
        for g in range(groups):
            ahead = (o + GROUP) * k + g * per_step * steps * LANES
            if o + GROUP >= n_out or g * per_step >= GROUP:
                ahead = -1
            sums = _tile_sums(x, w, _starts(g * GROUP, n_rows - 1, k), w_rows, steps, ahead,
                              per_step)
            if (g + 1) * GROUP <= n_rows and o + GROUP <= n_out and steps * LANES == k:
                for i in range(GROUP):  # a whole tile, no tail channels (as _pairs_block)
                    for j in range(GROUP):
                        y[g * GROUP + i, o + j] = _lane(sums, i * GROUP + j)
                continue
            for i in range(min(GROUP, n_rows - g * GROUP)):
                row = g * GROUP + i
                for j in range(min(GROUP, n_out - o)):
                    total = _lane(sums, i * GROUP + j)
                    for c in range(steps * LANES, k):  # channels past the last 16
                        total += x[row, c] * w[o + j, c]
                    y[row, o + j] = total


if AVAILABLE:
    _eight_rows = njit(fastmath=_FASTMATH, cache=True)(_eight_rows)
    _four_fmas = njit(inline="always", cache=True)(_four_fmas)
    _two_fmas = njit(inline="always", cache=True)(_two_fmas)
    _tile_sums = njit(fastmath=_FASTMATH, cache=True)(_tile_sums)
    _pair_sums = njit(fastmath=_FASTMATH, cache=True)(_pair_sums)
    _pairs_block = njit(fastmath=_FASTMATH, cache=True)(_pairs_block)
    _starts = njit(inline="always", cache=True)(_starts)
    tile_rows = njit(inline="always", cache=True)(tile_rows)
    tiles_block = njit(fastmath=_FASTMATH, cache=True)(_tiles_block)
else:
    tiles_block = _tiles_block
