"""The value half of the vector kernel (cpu_vector.py): a tile's weights times its value rows,
added into the value sums of its R query heads.

The sums go a chunk of C channels at a time (`chunk_lanes`): for each key, its C codes are
widened to float32 lanes straight from the pool and added, times the key's weight per head, into
R x C accumulators, which stay in registers for the whole tile. C = D where the registers hold
all R x D sums (AVX-512, up to SUMS_IN_REGISTERS); narrower where they do not (AVX2: 16
registers of 8 floats), so that no value row is written out as floats and read back once per
head.

Codes narrower than a byte with one scale a token are read, where the sums go by chunk, in
cpu_simd_ops.DWORDS order (`value_order`): a chunk's 16 lanes are two fields of a row's eight
32-bit words, a shift and a mask each, where BYTES order widens each byte to a word and each word
to 32 bits. The sums keep that order to the end of a work item, as they keep BYTES.

The sums live in `buf` chunk by chunk (R x C lanes each), not head by head; `head_sums` puts
them back in (R x D) order at the end of a work item.
"""

from __future__ import annotations

import numpy as np

from .cpu_args import SHARED_SCALES, TOKEN_SCALES, PoolFormat
from .cpu_numerics import INTEGER, njit
from .cpu_simd import WIDE_VECTORS, load, splat, store
from .cpu_simd_ops import BYTES, DWORDS, repeat, spread, spread_loads, stored_order
from .cpu_vector_rows import SCALED, float_codes, group_dequantizer, planes, scale_loader

TILE = 16  # keys scored together (cpu_vector): one lane each in the score vector of a head
# A chunk's accumulators, in 8-float (AVX2) registers, at most 12 of the 16: the rest hold the
# key's C lanes (where more than one head uses them) and a weight. Fewer than 8 accumulators
# leave the multiply-adds waiting on each other (a sum takes 4 cycles, and two start a cycle).
MOST_SUMS, MOST_LANES = 96, 120
# R x D value sums that AVX-512's 32 registers hold beside a tile's work (24 of them): with more
# (R = 8 at D = 64, 5 at 96, 4 at 128) they spill, and a chunk at a time is faster (the README's
# section on wide GQA groups).
SUMS_IN_REGISTERS = 384


def chunk_lanes(R: int, D: int) -> int:
    """Channels a chunk of the value sums where vectors are 256 bits: the widest multiple of 16
    dividing D whose R x C sums and C lanes fit the registers (at least 16)."""
    fits = [c for c in range(16, D + 1, 16) if D % c == 0 and R * c <= MOST_SUMS
            and (R == 1 or (R + 1) * c <= MOST_LANES)]
    return max(fits, default=16)


def values_by_chunk(R: int, D: int) -> bool:
    """Whether the value sums go a chunk of channels at a time: where vectors are 256 bits (16
    registers of 8 floats cannot hold R heads' sums, 24 registers at R = 3, D = 64), and where
    R x D passes SUMS_IN_REGISTERS."""
    return not WIDE_VECTORS or R * D > SUMS_IN_REGISTERS


def weights_by_group(fmt: PoolFormat, D: int, groups: int) -> bool:
    """Whether per-token value scales go into the weights (one per head and scale group): integer
    or fp8 codes whose groups each fill whole 16-lane pieces of a row in stored order."""
    return fmt.code in SCALED and fmt.scales == TOKEN_SCALES \
        and D // groups % (16 * planes(fmt)) == 0


def value_order(fmt: PoolFormat, D: int, groups: int, by_chunk: bool) -> int:
    """The order of a value row's lanes in the sums: DWORDS for codes narrower than a byte with
    one scale a token (the weights take it) where the sums go a chunk at a time, else BYTES.
    DWORDS reads a field of eight 32-bit words with a shift and a mask, where BYTES widens
    bytes to words and words to 32 bits (shuffles: on Zen 3 they, not the multiply-adds, set the
    value loop's pace, the README's AVX2 section)."""
    narrow = fmt.code == INTEGER and fmt.bits < 8 and D % (32 * planes(fmt)) == 0
    one_scale = fmt.scales == TOKEN_SCALES and groups == 1
    return DWORDS if narrow and one_scale and by_chunk else BYTES


def value_summer(fmt: PoolFormat, R: int, D: int, groups: int, by_chunk: bool, sums_at: int,
                 rows_at: int, scales_at: int, prefetch_rows):
    """(add_tile, block_scales, rescale, head_sums, order) for value pools of this format, R
    heads, D channels, a chunk of channels at a time or not (by_chunk); the sums' lanes in that
    order (cpu_simd_ops: BYTES or DWORDS) until head_sums; buf holds the sums (R x D) from
    sums_at, a tile's dequantized rows (16 x D, where scales go per group but not into the
    weights) from rows_at, and a block's shared scales and zero points (2 x D) from scales_at."""
    token_weights = weights_by_group(fmt, D, groups)
    G = groups if token_weights else 1  # weights per head and key
    w_gs, v_planes = D // G, planes(fmt)  # channels a weight covers
    by_group = fmt.scales == TOKEN_SCALES and groups > 1 and not token_weights
    by_block = fmt.scales == SHARED_SCALES
    has_zero, offset = fmt.has_zero, np.float32(fmt.offset)
    load_scales, gs = scale_loader(fmt.scale_code), D // groups
    row_codes, dequantize = float_codes(fmt, D), group_dequantizer(fmt, D, groups)
    C, order = chunk_lanes(R, D) if by_chunk else D, value_order(fmt, D, groups, by_chunk)
    RD, RC, n_chunks = R * D, R * C, D // C  # lanes: all sums, a chunk's sums; chunks a row

    def chunk_reader(c: int):
        """read(codes, row, buf, t): channels c .. c+C-1 of tile row t (pool row `row`), as
        float32 lanes in stored order, less zero times scale where scales are per block."""
        if by_group:  # staged by add_tile
            @njit(forceinline=True)
            def read(codes, row, buf, t):
                return load(buf, rows_at + t * D + c, C)
            return read
        codes_of = float_codes(fmt, D, c, C, order)

        @njit(forceinline=True)
        def read(codes, row, buf, t):
            x = codes_of(codes, row)
            if by_block:
                return (x - load(buf, scales_at + D + c, C)) * load(buf, scales_at + c, C)
            return x
        return read

    @njit(forceinline=True)
    def no_more(buf, codes, row, nt, k_codes, k_ahead, v_ahead):
        pass

    def chunk_adder(c: int):
        """add(...): chunk c's sums over the tile, then the later chunks'. numba has no loop
        whose index is a compile-time constant, so each chunk is its own function."""
        rest = chunk_adder(c + C) if c + C < D else no_more
        read = chunk_reader(c)
        # The later block's rows are asked for a few per chunk, every n_chunks-th key: all in
        # one chunk's loop, a tile's requests come too close together and stall it.
        ask_from = c // C * -(-TILE // n_chunks)  # the first row this chunk asks for

        @njit(forceinline=True)
        def add(buf, codes, row, nt, k_codes, k_ahead, v_ahead):
            acc = load(buf, sums_at + c * R, RC)  # (R x C)
            for t in range(nt):
                ask = ask_from + t // n_chunks
                if k_ahead >= 0 and t % n_chunks == 0 and ask < TILE:
                    prefetch_rows(k_codes, codes, k_ahead, v_ahead, ask)
                x = read(codes, row + t, buf, t)  # (C,)
                acc = acc + spread_loads(buf, t, TILE, R, v_planes, w_gs, D, c, C) * repeat(x, R)
            store(buf, sums_at + c * R, acc)
            rest(buf, codes, row, nt, k_codes, k_ahead, v_ahead)
        return add

    add_chunks = chunk_adder(0)

    @njit(forceinline=True)
    def add_tile(buf, codes, row, nt, scales, zeros, at, stride, k_codes, k_ahead, v_ahead):
        """The tile's weights (buf from 0: R x G x 16) times its nt value rows (pool rows row ..;
        their scales from element `at`, `stride` apart) added to the sums; rows t of the block
        at k_ahead, v_ahead (flat elements of k_codes and codes) prefetched where >= 0."""
        if by_group:  # each row dequantized once, the chunks read it back
            for t in range(nt):
                x = dequantize(row_codes(codes, row + t), scales, zeros, at + t * stride)
                store(buf, rows_at + t * D, x)  # (D,)
        add_chunks(buf, codes, row, nt, k_codes, k_ahead, v_ahead)

    @njit(forceinline=True)
    def block_scales(buf, scales, zeros, at):
        """A block's shared scales and zero points, one per channel (stored order), into buf."""
        if by_block:
            store(buf, scales_at, stored_order(load_scales(scales, at, groups), v_planes, gs, D,
                                               BYTES))
            if has_zero:
                store(buf, scales_at + D, stored_order(load_scales(zeros, at, groups), v_planes,
                                                       gs, D, BYTES))
            else:
                store(buf, scales_at + D, splat(offset, D))

    @njit(forceinline=True)
    def rescale(buf, alpha):
        """Every head's sums times its alpha (R,)."""
        store(buf, sums_at, load(buf, sums_at, RD) * repeat(spread(alpha, C), n_chunks))

    @njit(forceinline=True)
    def head_sums(buf):
        """The sums in (R x D) order (R heads of D lanes, stored order)."""
        if C == D:
            return load(buf, sums_at, RD)
        for c in range(0, D, C):  # the rows area is free by now
            for r in range(R):
                store(buf, rows_at + r * D + c, load(buf, sums_at + c * R + r * C, C))
        return load(buf, rows_at, RD)

    return add_tile, block_scales, rescale, head_sums, order
