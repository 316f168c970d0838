"""The GEMV's loops for packed weights (packed.py): y (B, N) = x (B, K) @ W^T, W read as its 4- or
8-bit codes and rebuilt in registers, never in memory.

packed.py stores W in panels of 16 output rows: per pair of input channels, the 16 rows' codes
side by side (16 bytes of nibbles, or 32 bytes). One load of them, a widening to float32 and
d * q (+ m) give the weights of 16 output rows at two channels as two 16-lane vectors. Each is
then multiplied by one activation of a row (broadcast from memory into all lanes) and added to
that row's 16 outputs: an outer product, so each accumulator holds 16 outputs, there is no
horizontal sum at the end, and the rebuilt weights are reused across every activation row in
registers.

The 32 vector registers of AVX-512 hold 16 accumulators in three shapes, picked by the rows left:
8 activation rows by 2 panels (from 5 rows; at 16 rows as fast as 16 rows by one panel, which
decodes half as often but needs a broadcast load per multiply-add, and twice as fast at 8), 4 by 4
(2 to 4 rows), 1 by 4 (one row: 4 panels keep 4 independent sums in flight). Rows past the last
repeat it, panels past the last repeat it; neither is written. AVX2's 16 registers of 8 lanes
hold only a quarter of that: there a panel goes by halves, 8 of its rows by 8 activation rows (8
sums, each pair's weights decoded once for 8 rows), 2 to 4 rows a whole panel by 4 rows, and one
row a panel at a time, each faster there than the shapes above (timed in the README's Zen 3
section). Each call covers UNIT panels, the unit threads split; while it multiplies a block of
32 channels, the same block of the panels after it is prefetched into L2, so their reads overlap
this arithmetic instead of following it (the README's speed section: the GEMV alone).
"""

from __future__ import annotations

import numpy as np

from .gemv_tiles import _FASTMATH, _lane
from .kernels.cpu_numerics import AVAILABLE, njit, prefetch_l2
from .kernels.cpu_simd import WIDE_VECTORS, load, plane_lanes, splat, splat_at, store, to_float
from .kernels.cpu_simd_ops import fma

PANEL = 16  # output rows per panel: one 16-lane vector of outputs
GROUP = 32  # input channels per (d, m) pair, as in Q4_1
PAIRS = 16  # channel pairs per group: the loop over them has constant bounds (LLVM unrolls it)
UNIT = 4  # panels per panels_product call: the unit threads split (64 output rows)
LINE = 64  # bytes per cache line


def _weights(w, panel, group, pair):
    """Panel `panel`'s 16 rows at channels 2 * (group * PAIRS + pair) and the next, as two 16-lane
    float32 vectors rebuilt from their codes: 4-bit codes (uint8, Q4_1) as d * q + m (two nibble
    planes of one 16-byte load), 8-bit ones (int8, Q8_0) as d * q. d and m are the same for a
    group's pairs: LLVM loads them once per group. numba compiles the format's own version."""
    return _weights4(w, panel, group, pair)


def _weights4(w, panel, group, pair):
    at = (panel * w.scales.shape[1] + group) * PANEL
    d, m = load(w.scales, at, PANEL), load(w.mins, at, PANEL)
    byte = (panel * w.codes.shape[1] + group * PAIRS + pair) * PANEL
    even = fma(to_float(plane_lanes(w.codes, byte, 0, PANEL, 4, PANEL)), d, m)
    odd = fma(to_float(plane_lanes(w.codes, byte, PANEL, PANEL, 4, PANEL)), d, m)
    return even, odd


def _weights8(w, panel, group, pair):
    d = load(w.scales, (panel * w.scales.shape[1] + group) * PANEL, PANEL)
    byte = (panel * w.codes.shape[1] + group * PAIRS + pair) * 2 * PANEL
    return (to_float(load(w.codes, byte, PANEL)) * d,
            to_float(load(w.codes, byte + PANEL, PANEL)) * d)


def _prefetch_group(w, panel, group):
    """Group `group` of panel `panel` (its codes, d and m) into L2."""
    per_pair = w.codes.shape[2]  # bytes of codes: 16 (4-bit) or 32 (8-bit)
    byte = (panel * w.codes.shape[1] + group * PAIRS) * per_pair
    for line in range(PAIRS * per_pair // LINE):
        prefetch_l2(w.codes, byte + line * LINE)
    at = (panel * w.scales.shape[1] + group) * PANEL
    prefetch_l2(w.scales, at)
    if w.mins.size:
        prefetch_l2(w.mins, at)


def _two_panels(x, at, w0, w1, a, b):
    """One row's two channels into two panels' sums a and b."""
    x0, x1 = splat_at(x, at, PANEL), splat_at(x, at + 1, PANEL)
    return fma(x1, w0[1], fma(x0, w0[0], a)), fma(x1, w1[1], fma(x0, w1[0], b))


def _four_weights(w, panels, group, pair):
    """The weights of 4 panels at a channel pair (_weights of each)."""
    p0, p1, p2, p3 = panels
    return (_weights(w, p0, group, pair), _weights(w, p1, group, pair),
            _weights(w, p2, group, pair), _weights(w, p3, group, pair))


def _four_panels(x, at, ws, a0, a1, a2, a3):
    """One row's two channels (flat at and at + 1 in x) into four panels' sums (ws: their
    weights)."""
    x0, x1 = splat_at(x, at, PANEL), splat_at(x, at + 1, PANEL)
    return (fma(x1, ws[0][1], fma(x0, ws[0][0], a0)), fma(x1, ws[1][1], fma(x0, ws[1][0], a1)),
            fma(x1, ws[2][1], fma(x0, ws[2][0], a2)), fma(x1, ws[3][1], fma(x0, ws[3][0], a3)))


def _rows8_panels2(x, w, p0, p1, starts):
    """Sums of 8 activation rows (flat starts in x) by panels p0 and p1, row by row (a, b)."""
    s0, s1, s2, s3, s4, s5, s6, s7 = starts
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = splat(0.0, PANEL)  # with p0
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = splat(0.0, PANEL)  # with p1
    for group in range(w.scales.shape[1]):
        _prefetch_group(w, p1 + 1, group)
        _prefetch_group(w, p1 + 2, group)
        for pair in range(PAIRS):
            w0, w1 = _weights(w, p0, group, pair), _weights(w, p1, group, pair)
            c = 2 * (group * PAIRS + pair)
            a0, b0 = _two_panels(x, s0 + c, w0, w1, a0, b0)
            a1, b1 = _two_panels(x, s1 + c, w0, w1, a1, b1)
            a2, b2 = _two_panels(x, s2 + c, w0, w1, a2, b2)
            a3, b3 = _two_panels(x, s3 + c, w0, w1, a3, b3)
            a4, b4 = _two_panels(x, s4 + c, w0, w1, a4, b4)
            a5, b5 = _two_panels(x, s5 + c, w0, w1, a5, b5)
            a6, b6 = _two_panels(x, s6 + c, w0, w1, a6, b6)
            a7, b7 = _two_panels(x, s7 + c, w0, w1, a7, b7)
    return (a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7)


def _half_weights(w, panel, group, pair, half):
    """_weights for rows 8 * half .. + 7 of the panel: two 8-lane float32 vectors."""
    return _half_weights4(w, panel, group, pair, half)


def _half_weights4(w, panel, group, pair, half):
    at = (panel * w.scales.shape[1] + group) * PANEL + 8 * half
    d, m = load(w.scales, at, 8), load(w.mins, at, 8)
    byte = (panel * w.codes.shape[1] + group * PAIRS + pair) * PANEL + 8 * half
    even = fma(to_float(plane_lanes(w.codes, byte, 0, 8, 4, 8)), d, m)
    odd = fma(to_float(plane_lanes(w.codes, byte, 8, 8, 4, 8)), d, m)
    return even, odd


def _half_weights8(w, panel, group, pair, half):
    d = load(w.scales, (panel * w.scales.shape[1] + group) * PANEL + 8 * half, 8)
    byte = (panel * w.codes.shape[1] + group * PAIRS + pair) * 2 * PANEL + 8 * half
    return to_float(load(w.codes, byte, 8)) * d, to_float(load(w.codes, byte + PANEL, 8)) * d


def _half_row(x, at, ws, a):
    """One row's two channels (flat at and at + 1 in x) into 8 outputs' sums a (ws: their
    weights at the two channels)."""
    return fma(splat_at(x, at + 1, 8), ws[1], fma(splat_at(x, at, 8), ws[0], a))


def _one_panel(x, at, ws, a):
    """One row's two channels (flat at and at + 1 in x) into one panel's sums a (ws: its
    weights)."""
    return fma(splat_at(x, at + 1, PANEL), ws[1], fma(splat_at(x, at, PANEL), ws[0], a))


def _rows4_panel1(x, w, p, starts):
    """Sums of 4 activation rows (flat starts) by panel p, row by row: where vectors are 256 bits,
    4 sums and a pair's weights in 12 of the 16 registers."""
    s0, s1, s2, s3 = starts
    a0 = a1 = a2 = a3 = splat(0.0, PANEL)
    for group in range(w.scales.shape[1]):
        _prefetch_group(w, p + UNIT, group)
        for pair in range(PAIRS):
            ws = _weights(w, p, group, pair)
            c = 2 * (group * PAIRS + pair)
            a0, a1 = _one_panel(x, s0 + c, ws, a0), _one_panel(x, s1 + c, ws, a1)
            a2, a3 = _one_panel(x, s2 + c, ws, a2), _one_panel(x, s3 + c, ws, a3)
    return (a0, a1, a2, a3)


def _rows8_half(x, w, p, half, starts, ahead):
    """Sums of 8 activation rows (flat starts) by rows 8 * half .. + 7 of panel p, 8 lanes a row:
    where vectors are 256 bits, 8 sums in 8 registers and each pair's weights decoded once for
    8 rows; panel `ahead` prefetched (< 0: none)."""
    s0, s1, s2, s3, s4, s5, s6, s7 = starts
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = splat(0.0, 8)
    for group in range(w.scales.shape[1]):
        if ahead >= 0:
            _prefetch_group(w, ahead, group)
        for pair in range(PAIRS):
            ws = _half_weights(w, p, group, pair, half)
            c = 2 * (group * PAIRS + pair)
            a0, a1 = _half_row(x, s0 + c, ws, a0), _half_row(x, s1 + c, ws, a1)
            a2, a3 = _half_row(x, s2 + c, ws, a2), _half_row(x, s3 + c, ws, a3)
            a4, a5 = _half_row(x, s4 + c, ws, a4), _half_row(x, s5 + c, ws, a5)
            a6, a7 = _half_row(x, s6 + c, ws, a6), _half_row(x, s7 + c, ws, a7)
    return (a0, a1, a2, a3, a4, a5, a6, a7)


def _write_half(y, sums, first_row, col, n_out):
    """y[first_row + i, col .. col + 7] = sums[i] (8 lanes each), inside y (B, n_out)."""
    lanes = np.empty(8, np.float32)
    for i in range(len(sums)):
        row = first_row + i
        if row >= y.shape[0]:
            break
        if col + 8 <= n_out and y.flags.c_contiguous:
            store(y, row * y.shape[1] + col, sums[i])
            continue
        store(lanes, 0, sums[i])
        for lane in range(min(8, n_out - col)):
            y[row, col + lane] = lanes[lane]


def _rows4_panels4(x, w, panels, starts):
    """Sums of 4 activation rows (flat starts) by 4 panels, row by row."""
    s0, s1, s2, s3 = starts
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = splat(0.0, PANEL)  # a<row><panel>
    a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = splat(0.0, PANEL)
    for group in range(w.scales.shape[1]):
        for p in panels:
            _prefetch_group(w, p + UNIT, group)
        for pair in range(PAIRS):
            ws = _four_weights(w, panels, group, pair)
            c = 2 * (group * PAIRS + pair)
            a00, a01, a02, a03 = _four_panels(x, s0 + c, ws, a00, a01, a02, a03)
            a10, a11, a12, a13 = _four_panels(x, s1 + c, ws, a10, a11, a12, a13)
            a20, a21, a22, a23 = _four_panels(x, s2 + c, ws, a20, a21, a22, a23)
            a30, a31, a32, a33 = _four_panels(x, s3 + c, ws, a30, a31, a32, a33)
    return (a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33)


def _row1_panel1(x, w, p, start):
    """Sums of one activation row (flat start) by panel p, where vectors are 256 bits: the even
    and the odd channels in sums of their own, so four chains of multiply-adds overlap, and the
    sums, a pair's weights and d, m fit the 16 registers (4 panels at once spill them)."""
    even = odd = splat(0.0, PANEL)
    for group in range(w.scales.shape[1]):
        _prefetch_group(w, p + UNIT, group)
        for pair in range(PAIRS):
            ws = _weights(w, p, group, pair)
            at = start + 2 * (group * PAIRS + pair)
            even = fma(splat_at(x, at, PANEL), ws[0], even)
            odd = fma(splat_at(x, at + 1, PANEL), ws[1], odd)
    return (even + odd,)


def _row1_panels4(x, w, panels, start):
    """Sums of one activation row (flat start) by 4 panels."""
    a0 = a1 = a2 = a3 = splat(0.0, PANEL)
    for group in range(w.scales.shape[1]):
        for p in panels:
            _prefetch_group(w, p + UNIT, group)
        for pair in range(PAIRS):
            ws = _four_weights(w, panels, group, pair)
            a0, a1, a2, a3 = _four_panels(x, start + 2 * (group * PAIRS + pair), ws,
                                          a0, a1, a2, a3)
    return (a0, a1, a2, a3)


def _write(y, sums, first_row, panels, n_out):
    """y[first_row + i, panel p's rows] = sums[i * len(panels) + p], inside y (B, n_out): a
    vector store where the panel's 16 outputs are all inside a C-contiguous y, else lane by
    lane."""
    per_row = len(panels)
    for i in range(len(sums) // per_row):
        row = first_row + i
        if row >= y.shape[0]:
            break
        for p in range(per_row):
            col = panels[p] * PANEL
            if col + PANEL <= n_out and y.flags.c_contiguous:
                store(y, row * y.shape[1] + col, sums[i * per_row + p])
                continue
            for lane in range(PANEL):
                if col + lane < n_out:
                    y[row, col + lane] = _lane(sums[i * per_row + p], lane)


def _start(row, last, k):
    """Flat start of row `row` of x (rows of k channels), or of row `last` past it."""
    return min(row, last) * k


def panels_product(x, w, y, unit):
    """Output rows of panels UNIT * unit .. + UNIT - 1 of y (B, N) = x (B, K) @ W^T, W packed in
    w (packed.Packed) and x C-contiguous: rows 8 at a time while more than 4 are left, then 4 or
    1 (the shapes above; with AVX2 their own)."""
    n_rows, k = x.shape
    last = n_rows - 1
    last_panel = w.codes.shape[0] - 1
    first = unit * UNIT
    p = (first, min(first + 1, last_panel), min(first + 2, last_panel),
         min(first + 3, last_panel))
    done = 0
    if not WIDE_VECTORS:  # AVX2: tiles whose sums fit 16 registers
        while n_rows - done > 4:  # half a panel by 8 rows: a pair's weights decoded per 8 rows
            starts = (_start(done, last, k), _start(done + 1, last, k), _start(done + 2, last, k),
                      _start(done + 3, last, k), _start(done + 4, last, k),
                      _start(done + 5, last, k), _start(done + 6, last, k),
                      _start(done + 7, last, k))
            for q in range(UNIT):
                for half in range(2 if first + q <= last_panel else 0):
                    ahead = first + q + UNIT if done == 0 and half == 0 else -1
                    _write_half(y, _rows8_half(x, w, p[q], half, starts, ahead), done,
                                p[q] * PANEL + 8 * half, w.rows)
            done += 8
        if n_rows - done > 1:  # 2 to 4 rows: a panel by 4 rows
            starts4 = (_start(done, last, k), _start(done + 1, last, k),
                       _start(done + 2, last, k), _start(done + 3, last, k))
            for q in range(UNIT):
                if first + q <= last_panel:
                    _write(y, _rows4_panel1(x, w, p[q], starts4), done, (p[q],), w.rows)
        elif n_rows - done == 1:  # one row: a panel at a time
            for q in range(UNIT):
                if first + q <= last_panel:
                    _write(y, _row1_panel1(x, w, p[q], done * k), done, (p[q],), w.rows)
        done = n_rows
    while n_rows - done > 4:
        starts = (_start(done, last, k), _start(done + 1, last, k), _start(done + 2, last, k),
                  _start(done + 3, last, k), _start(done + 4, last, k), _start(done + 5, last, k),
                  _start(done + 6, last, k), _start(done + 7, last, k))
        _write(y, _rows8_panels2(x, w, p[0], p[1], starts), done, (p[0], p[1]), w.rows)
        if first + 2 <= last_panel:
            _write(y, _rows8_panels2(x, w, p[2], p[3], starts), done, (p[2], p[3]), w.rows)
        done += 8
    if n_rows - done > 1:
        starts4 = (_start(done, last, k), _start(done + 1, last, k), _start(done + 2, last, k),
                   _start(done + 3, last, k))
        _write(y, _rows4_panels4(x, w, p, starts4), done, p, w.rows)
    elif n_rows - done == 1:
        _write(y, _row1_panels4(x, w, p, done * k), done, p, w.rows)


if AVAILABLE:
    from numba import types
    from numba.extending import overload

    @overload(_weights, inline="always")
    def _weights_for(w, panel, group, pair):
        return _weights8 if w.types[0].dtype == types.int8 else _weights4

    @overload(_half_weights, inline="always")
    def _half_weights_for(w, panel, group, pair, half):
        return _half_weights8 if w.types[0].dtype == types.int8 else _half_weights4

    _prefetch_group = njit(inline="always", cache=True)(_prefetch_group)
    _two_panels = njit(inline="always", cache=True)(_two_panels)
    _four_weights = njit(inline="always", cache=True)(_four_weights)
    _four_panels = njit(inline="always", cache=True)(_four_panels)
    _half_row = njit(inline="always", cache=True)(_half_row)
    _one_panel = njit(inline="always", cache=True)(_one_panel)
    _start = njit(inline="always", cache=True)(_start)
    _rows8_panels2 = njit(fastmath=_FASTMATH, cache=True)(_rows8_panels2)
    _rows4_panels4 = njit(fastmath=_FASTMATH, cache=True)(_rows4_panels4)
    _rows8_half = njit(fastmath=_FASTMATH, cache=True)(_rows8_half)
    _rows4_panel1 = njit(fastmath=_FASTMATH, cache=True)(_rows4_panel1)
    _write_half = njit(cache=True)(_write_half)
    _row1_panel1 = njit(fastmath=_FASTMATH, cache=True)(_row1_panel1)
    _row1_panels4 = njit(fastmath=_FASTMATH, cache=True)(_row1_panels4)
    _write = njit(cache=True)(_write)
    panels_product = njit(fastmath=_FASTMATH, inline="always", cache=True)(panels_product)
