"""The GEMV's float32 tiles where vectors are 256 bits (AVX2; gemv.py chooses them there from
gemv.NARROW_MIN_ROWS activation rows): 4 activation rows by 3 weight rows at a time, 8 channels
a step.

Each step loads 8 channels of 3 weight rows and of 4 activation rows and does 12 fused
multiply-adds into 12 accumulators of 8 lanes, one register each: with the 3 weight rows and the
activation row in use, that is AVX2's 16 registers. Twelve independent sums keep both FMA units
of a core busy while each sum waits on its own previous multiply-add (4 cycles: 8 would be just
enough). gemv_tiles' tiles keep 16 accumulators of 16 lanes, 32 of these registers, and spill;
the eight-row loop loads 9 vectors for 8 multiply-adds, so loads bound it; here 7 load for 12.

A block of output rows goes 3 weight rows at a time, each through every group of 4 activation
rows while its 3 rows stay in L1. The 3 rows after them are asked for into L2 meanwhile, a few
lines every BURST steps, spread evenly over the tile's steps, so that their reads overlap its
arithmetic; the steps after the last request go in a loop without any. A group past the last
activation or weight row repeats that row (its sums are dropped); channels past the last multiple
of 8 are added one by one.
"""

from __future__ import annotations

from .gemv_tiles import _FASTMATH, _lane
from .kernels.cpu_numerics import AVAILABLE, intrinsic, njit, prefetch_l2
from .kernels.cpu_simd import Vec, _pick, load, splat
from .kernels.cpu_simd_ops import fma
from .kernels.cpu_simd_tree import pair

X_ROWS, W_ROWS = 4, 3  # activation rows and weight rows a tile
LANES = 8  # channels a step: one 256-bit register of float32
LINE = 16  # float32 a cache line
BURST = 4  # steps between requests for the next tile's lines
NARROW_ROWS = 8 * W_ROWS  # output rows a block of the GEMV (gemv.blocks): whole tiles


@intrinsic
def _join(typingctx, a, b):
    """Two 8-lane Vecs side by side as one 16-lane Vec (for the transpose-and-add tree)."""
    def codegen(context, builder, sig, args):
        picks = [(0, i) for i in range(LANES)] + [(1, i) for i in range(LANES)]
        return _pick(builder, list(args), picks, 2 * LANES)
    if getattr(a, "lanes", None) != LANES or getattr(b, "lanes", None) != LANES:
        return None
    return Vec(a.dtype, 2 * LANES)(a, b), codegen


def _row_sums(a0, a1, a2):
    """One activation row's 3 accumulators (8 lanes each) summed to 4 sums of 4 lanes each: the
    3 weight rows', then zeros (a tile's 12 sums fill 16 lanes)."""
    return pair(_join(a0, a1), _join(a2, splat(0.0, LANES)), 8)


def _step(x, w, x_rows, w_rows, c, sums):
    """One step of _tile_sums: channels c .. c+7 of the 4 activation rows times the 3 weight
    rows, added into the 12 sums (activation row i, weight row j at 3 i + j)."""
    x0, x1, x2, x3 = x_rows
    w0, w1, w2 = w_rows
    a00, a01, a02, a10, a11, a12, a20, a21, a22, a30, a31, a32 = sums
    v0, v1, v2 = load(w, w0 + c, 8), load(w, w1 + c, 8), load(w, w2 + c, 8)
    u = load(x, x0 + c, 8)
    a00, a01, a02 = fma(u, v0, a00), fma(u, v1, a01), fma(u, v2, a02)
    u = load(x, x1 + c, 8)
    a10, a11, a12 = fma(u, v0, a10), fma(u, v1, a11), fma(u, v2, a12)
    u = load(x, x2 + c, 8)
    a20, a21, a22 = fma(u, v0, a20), fma(u, v1, a21), fma(u, v2, a22)
    u = load(x, x3 + c, 8)
    a30, a31, a32 = fma(u, v0, a30), fma(u, v1, a31), fma(u, v2, a32)
    return a00, a01, a02, a10, a11, a12, a20, a21, a22, a30, a31, a32


def _tile_sums(x, w, x_rows, w_rows, steps, ahead, ahead_bursts, lines):
    """The 12 dot products of activation rows x_rows (4 flat row starts in x) with weight rows
    w_rows (3 flat row starts in w) over the first 8 * steps channels, as 16 lanes: lane 4 i + j
    holds activation row i with weight row j (lanes 4 i + 3: zero). Over the first ahead_bursts
    bursts of BURST steps, `lines` lines of w a burst, from flat index `ahead` on, are asked for
    into L2; the steps after them run in a loop of their own, which pays nothing for requests."""
    zero = splat(0.0, LANES)
    sums = (zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero)
    for burst in range(ahead_bursts):
        at = ahead + burst * lines * LINE
        for line in range(lines):
            prefetch_l2(w, at + line * LINE)
        for step in range(burst * BURST, (burst + 1) * BURST):
            sums = _step(x, w, x_rows, w_rows, step * LANES, sums)
    for step in range(ahead_bursts * BURST, steps):
        sums = _step(x, w, x_rows, w_rows, step * LANES, sums)
    a00, a01, a02, a10, a11, a12, a20, a21, a22, a30, a31, a32 = sums
    # the transpose-and-add tree: 4 sums of 4 lanes a row, then 2 lanes, then 1
    top = pair(_row_sums(a00, a01, a02), _row_sums(a10, a11, a12), 4)
    bottom = pair(_row_sums(a20, a21, a22), _row_sums(a30, a31, a32), 4)
    return pair(top, bottom, 2)


def _starts(first, count, last, k):
    """Flat starts of rows first .. first+count-1 (count 3 or 4) of a (rows, k) array, repeating
    row `last` past it; a fourth start repeats the third where count is 3."""
    return (min(first, last) * k, min(first + 1, last) * k, min(first + 2, last) * k,
            min(first + count - 1, last) * k)


def _narrow_block(x, w, y, first, count):
    """Output rows first .. first+count-1 of y (B, N) = x (B, K) @ w (N, K)^T, in tiles of 4
    activation rows by 3 weight rows; the 3 weight rows after each tile (within the matrix) are
    asked for into L2 while it is multiplied, spread over its groups' steps."""
    n_rows, n_out, k = x.shape[0], w.shape[0], x.shape[1]
    steps = k // LANES
    groups = -(-n_rows // X_ROWS)
    end = min(first + count, n_out)  # this block's rows end before it
    if groups == 0 or first >= end:
        return
    n_lines = -(-W_ROWS * k // LINE)  # the next tile's lines, asked for over its groups' steps
    # Spread evenly over all the tile's groups: one or two a step from the tile's start outran
    # what one core has in flight from DRAM (with 4 groups, 0.86x the time from DRAM at 16 rows).
    group_bursts = steps // BURST
    lines = -(-n_lines // max(groups * group_bursts, 1))  # a burst
    for o in range(first, end, W_ROWS):
        w_rows = _starts(o, 3, end - 1, k)[:3]
        ahead = o + W_ROWS < n_out  # the next tile's rows are in the matrix
        for g in range(groups):
            x_rows = _starts(g * X_ROWS, 4, n_rows - 1, k)
            first_line = g * group_bursts * lines  # this group's share of the next tile's lines
            bursts = min(group_bursts, -(-(n_lines - first_line) // lines)) if ahead else 0
            sums = _tile_sums(x, w, x_rows, w_rows, steps, (o + W_ROWS) * k + first_line * LINE,
                              max(bursts, 0), lines)
            if (g + 1) * X_ROWS <= n_rows and o + W_ROWS <= end and steps * LANES == k:
                for i in range(X_ROWS):  # a whole tile, no tail channels: constant lanes
                    for j in range(W_ROWS):
                        y[g * X_ROWS + i, o + j] = _lane(sums, i * 4 + j)
                continue
            for i in range(min(X_ROWS, n_rows - g * X_ROWS)):
                row = g * X_ROWS + i
                for j in range(min(W_ROWS, end - o)):
                    total = _lane(sums, i * 4 + j)
                    for c in range(steps * LANES, k):  # channels past the last 8
                        total += x[row, c] * w[o + j, c]
                    y[row, o + j] = total


if AVAILABLE:
    _row_sums = njit(inline="always", cache=True)(_row_sums)
    _step = njit(fastmath=_FASTMATH, inline="always", cache=True)(_step)
    _tile_sums = njit(fastmath=_FASTMATH, inline="always", cache=True)(_tile_sums)
    _starts = njit(inline="always", cache=True)(_starts)
    narrow_block = njit(fastmath=_FASTMATH, cache=True)(_narrow_block)
else:
    narrow_block = _narrow_block
