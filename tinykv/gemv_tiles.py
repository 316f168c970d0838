"""The GEMV's inner loop for float32 weights (gemv.py): 4 output rows by 4 activation rows at a
time, in vector registers.

Each step along the input channels loads 16 channels of 4 weight rows and of 4 activation rows,
and does 16 fused multiply-adds: 16 accumulators of 16 lanes, one per (activation row, output
row) pair. Loads per multiply-add fall from about one (one weight row per accumulator, as in
the eight-row loop LLVM vectorizes) to a half, so with a few activation rows the loop stays bound
by the weights' bytes instead of by loads. The weight rows of the next group are prefetched into
L2 while these are multiplied, so their reads overlap this group's arithmetic instead of
following it; into L2, not L1, where they would push out the activation rows every group reuses.

Tails: a group past the last activation or output row repeats that row (its sums are computed and
dropped, reads stay inside the arrays); channels past the last multiple of 16 are added one by
one. The vectors are cpu_simd's Vec (one 512-bit register per 16 lanes with AVX-512, two 256-bit
ones with AVX2).
"""

from __future__ import annotations

from .kernels.cpu_numerics import AVAILABLE, intrinsic, njit, prefetch_l2, types
from .kernels.cpu_simd import _pieces, load, splat
from .kernels.cpu_simd_ops import fma, pair

GROUP = 4  # activation rows, and output rows, per tile
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


def _starts(first, last, k):
    """Flat starts of rows first .. first+3 of a (rows, k) array, repeating row `last` past it."""
    return (min(first, last) * k, min(first + 1, last) * k, min(first + 2, last) * k,
            min(first + 3, last) * k)


def _tiles_block(x, w, y, first, count):
    """Output rows first .. first+count-1 of y (B, N) = x (B, K) @ w (N, K)^T, in tiles of 4 by
    4; the 4 weight rows after each group are prefetched while it is multiplied."""
    n_rows, n_out, k = x.shape[0], w.shape[0], x.shape[1]
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
            for i in range(min(GROUP, n_rows - g * GROUP)):
                row = g * GROUP + i
                for j in range(min(GROUP, n_out - o)):
                    total = _lane(sums, i * GROUP + j)
                    for c in range(steps * LANES, k):  # channels past the last 16
                        total += x[row, c] * w[o + j, c]
                    y[row, o + j] = total


if AVAILABLE:
    _four_fmas = njit(inline="always", cache=True)(_four_fmas)
    _tile_sums = njit(fastmath=_FASTMATH, cache=True)(_tile_sums)
    _starts = njit(inline="always", cache=True)(_starts)
    tiles_block = njit(fastmath=_FASTMATH, cache=True)(_tiles_block)
else:
    tiles_block = _tiles_block
