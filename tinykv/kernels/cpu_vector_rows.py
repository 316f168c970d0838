"""How the vector kernel (cpu_vector.py) reads rows of a pool: 16 keys into a vector of scores
per query head (`tile_scorer`), a row's codes into float32 lanes (`float_codes`), scales into
lanes, each returned specialized at compile time to one stored format; and how it asks for a
later block's rows before it reads them (`prefetch_block`, `prefetch_row`, `prefetch_scales`).

Integer keys whose rows are a multiple of 32 bytes are read two at a time as 16-bit words
(cpu_simd.word_planes), the query permuted once to match (cpu_simd_ops.WORDS): the dot products of
a key pair leave 8 partial sums per key, so the transpose-and-add tree starts one step shorter and
that step is paid once per key pair, not once per query head. Other keys go one at a time.
With AVX2 those key pairs go through the tree over 8-lane segments (cpu_simd_tree): over 16-lane
ones each level of the tree holds two registers a head, and a tile of 16 keys spilled sums to the
stack (about 3 instructions a key more, `inspect_asm`).

Integer keys with a scale per token and group of channels (`grouped_keys`) cannot take the scale
out of the whole dot product: each key is dequantized into float32 lanes first, as a value row is,
and dotted with the int16 query's codes as floats (so both kernels round the query alike).
"""

from __future__ import annotations

import numpy as np

from .cpu_args import TOKEN_SCALES, PoolFormat
from .cpu_numerics import BFLOAT, FLOAT32, FP8, HALF, INTEGER, intrinsic, ir, njit, types
from .cpu_simd import (
    HAS_F16C,
    PIECE,
    WIDE_VECTORS,
    Vec,
    _data,
    _literal,
    _map,
    _mask,
    _splat_piece,
    _whole,
    load,
    plane_lanes,
    prefetch_lines,
    to_float,
    to_int16,
    word_planes,
)
from .cpu_simd_ops import BYTES, DWORDS, head_dots, repeat, spread
from .cpu_simd_tree import half, join, pair, pair8

# Prefetched into L2, not L1 (prefetcht1, not t0), and a row's lines per key read, not a whole
# block's at once: a prefetch waits for a free miss buffer, so a burst of them stalls the work
# behind it, and a line bound for L1 holds one of L1's few buffers until it arrives. Each was
# timed against the other way (the README's speed section); t0 prefetches of the next block on
# top of these lost again.
LEVEL = 2


FLOAT_CODES = (FLOAT32, HALF, BFLOAT, FP8)  # float codes, as float32 lanes (widen_float)
SCALED = (INTEGER, FP8)  # codes that come with scales


@intrinsic(prefer_literal=True)
def widen_float(typingctx, v, code):
    """Float codes' bits (uint16 lanes for fp16 and bf16, uint8 for fp8 e4m3fn) -> float32 lanes,
    exactly, as cpu_numerics.from_half and from_fp8: bf16 is a float32's upper half; fp16 and
    fp8 below their inf or nan are their sign, exponent and mantissa placed in a float32's fields
    and scaled by 2^(127 - their bias), which makes their subnormals right too. float32 codes
    (a pool at a float32 model's dtype) are already float32 lanes."""
    def codegen(context, builder, sig, args):
        if _literal(sig.args[1]) == FLOAT32:
            return args[0]

        def convert(p):
            n = p.type.count
            f32, i32 = ir.VectorType(ir.FloatType(), n), ir.VectorType(ir.IntType(32), n)
            u = builder.zext(p, i32)

            def const(c):
                return _splat_piece(builder, ir.IntType(32)(c), n)
            fmt = _literal(sig.args[1])
            if fmt == BFLOAT:
                return builder.bitcast(builder.shl(u, const(16)), f32)
            if fmt == HALF and HAS_F16C:
                return builder.fpext(builder.bitcast(p, ir.VectorType(ir.HalfType(), n)), f32)
            top, width, bias = (0x8000, 10, 15) if fmt == HALF else (0x80, 3, 7)
            shift = 23 - width  # a mantissa's bits up to float32's
            sign = builder.shl(builder.and_(u, const(top)), const(32 - top.bit_length()))
            em = builder.shl(builder.and_(u, const(top - 1)), const(shift))
            bits = builder.or_(sign, em)
            finite = builder.fmul(builder.bitcast(bits, f32),
                                  _splat_piece(builder, ir.FloatType()(2.0**(127 - bias)), n))
            if fmt == HALF:  # exponent all ones: inf or nan
                special = builder.bitcast(builder.or_(bits, const(0x7F800000)), f32)
                return builder.select(builder.icmp_unsigned(">=", em, const(0x7C00 << shift)),
                                      special, finite)
            nan = _splat_piece(builder, ir.FloatType()(float("nan")), n)  # e4m3fn: 0x7F, 0xFF
            return builder.select(builder.icmp_unsigned("==", em, const(0x7F << shift)), nan,
                                  finite)
        return _map(builder, convert, args[0])
    return Vec(types.float32, v.lanes)(v, code), codegen


@intrinsic(prefer_literal=True)
def dword_fields(typingctx, arr, start, first, lanes, bits):
    """Lanes first .. first+lanes-1 of a row of packed codes (uint8 from flat element start), in
    cpu_simd_ops.DWORDS order, as int32: per 32-byte chunk, field j (`bits` wide, the low first)
    of its eight 32-bit words is 8 lanes; a 16-lane piece is fields j and j + 1 of one chunk: a
    shift and a mask each, where plane_lanes widens bytes to words (shuffles)."""
    f, n, b = _literal(first), _literal(lanes), _literal(bits)
    fields = 32 // b
    assert f % PIECE == 0 and n % PIECE == 0

    def codegen(context, builder, sig, args):
        data = _data(context, builder, sig.args[0], args[0])
        words = ir.VectorType(ir.IntType(32), 8)
        out = []
        for lane in range(f, f + n, PIECE):
            chunk, field = divmod(lane, 8 * fields)
            field //= 8
            at = builder.gep(data, [builder.add(args[1], ir.IntType(64)(32 * chunk))])
            w = builder.load(builder.bitcast(at, words.as_pointer()), align=1)
            halves = []
            for j in (field, field + 1):
                x = builder.lshr(w, _splat_piece(builder, ir.IntType(32)(j * b), 8)) if j else w
                if (j + 1) * b < 32:
                    x = builder.and_(x, _splat_piece(builder, ir.IntType(32)((1 << b) - 1), 8))
                halves.append(x)
            out.append(builder.shuffle_vector(halves[0], halves[1], _mask(list(range(PIECE)))))
        return _whole(builder, out)
    return Vec(types.int32, n)(arr, start, first, lanes, bits), codegen


def planes(fmt: PoolFormat) -> int:
    """Codes per stored element (cpu_plain.planes, for Python)."""
    return 8 // fmt.bits if fmt.code == INTEGER else 1


def row_bytes(fmt: PoolFormat, D: int) -> int:
    """Bytes a stored row of D channels: float32 codes 4 an element, fp16 and bf16 2, fp8 and
    integer codes 1 (a byte of planes)."""
    return D // planes(fmt) * {FLOAT32: 4, HALF: 2, BFLOAT: 2}.get(fmt.code, 1)


def scale_loader(code: int):
    """load(values, at, n) -> n consecutive scales (or zeros), stored as float32, fp16 or bf16
    (code), as float32 lanes."""
    @njit(forceinline=True)
    def scales(values, at, n):
        return widen_float(load(values, at, n), code)
    return scales


def grouped_keys(fmt: PoolFormat, groups: int) -> bool:
    """Whether integer or fp8 keys have a scale per token and group of channels: read
    dequantized."""
    return fmt.code in SCALED and fmt.scales == TOKEN_SCALES and groups > 1


def in_pairs(fmt: PoolFormat, D: int, groups: int = 1) -> bool:
    """Whether integer keys are read two at a time as words (rows a multiple of 32 bytes, one
    scale a row)."""
    return fmt.code == INTEGER and D * fmt.bits % 256 == 0 and not grouped_keys(fmt, groups)


def _key_reader(fmt: PoolFormat, R: int, D: int, groups: int):
    """key(codes, row, q_all, q_words, scales, zeros, at): a key's products with R query heads,
    summed to 16 lanes a head (int32 for integer codes: exact; float32 for fp16 and grouped
    keys, whose scales and zero points start at element `at`); where keys go in pairs
    (in_pairs), keys row and row + 1, 8 lanes each, against the query stored in q_words from
    element q_all."""
    width, bits = D // planes(fmt), fmt.bits
    lanes = 2 * R * D  # the query against a key pair
    if in_pairs(fmt, D, groups):
        @njit(forceinline=True)
        def key(codes, row, q_at, q_words, scales, zeros, at):  # q_words: as piece_copies
            x = word_planes(codes, row * width, (row + 1) * width, width, bits)  # (2D,) WORDS
            return head_dots(x, load(q_words, q_at, lanes), R)
    elif grouped_keys(fmt, groups):
        codes_of, dequantize = float_codes(fmt, D), group_dequantizer(fmt, D, groups)

        @njit(forceinline=True)
        def key(codes, row, q_all, q_words, scales, zeros, at):
            x = dequantize(codes_of(codes, row), scales, zeros, at)  # (D,) stored order
            return head_dots(x, q_all, R)
    elif fmt.code in FLOAT_CODES:
        codes_of = float_codes(fmt, D)

        @njit(forceinline=True)
        def key(codes, row, q_all, q_words, scales, zeros, at):
            return head_dots(codes_of(codes, row), q_all, R)
    elif fmt.bits == 8:
        @njit(forceinline=True)
        def key(codes, row, q_all, q_words, scales, zeros, at):
            c16 = to_int16(load(codes, row * width, width))  # (D,)
            return head_dots(c16, q_all, R)
    else:
        @njit(forceinline=True)
        def key(codes, row, q_all, q_words, scales, zeros, at):
            c16 = plane_lanes(codes, row * width, 0, D, bits, width)  # (D,) stored order
            return head_dots(c16, q_all, R)
    return key


def float_codes(fmt: PoolFormat, D: int, first: int = 0, lanes: int = 0, order: int = BYTES):
    """codes_of(codes, row): lanes first .. first+lanes-1 (all D where lanes is 0) of a row's
    codes (fp16: values) as float32 lanes in stored order (packed codes: BYTES or DWORDS)."""
    width, bits, lanes = D // planes(fmt), fmt.bits, lanes or D
    if order == DWORDS:
        @njit(forceinline=True)
        def codes_of(codes, row):
            return to_float(dword_fields(codes, row * width, first, lanes, bits))
    elif fmt.code in FLOAT_CODES:
        code = fmt.code

        @njit(forceinline=True)
        def codes_of(codes, row):
            return widen_float(load(codes, row * width + first, lanes), code)
    elif bits == 8:
        @njit(forceinline=True)
        def codes_of(codes, row):
            return to_float(to_int16(load(codes, row * width + first, lanes)))
    else:
        @njit(forceinline=True)
        def codes_of(codes, row):
            return to_float(plane_lanes(codes, row * width, first, lanes, bits, width))
    return codes_of


def group_dequantizer(fmt: PoolFormat, D: int, groups: int):
    """dequantize(x, scales, zeros, at): a row's float codes x (D,) in stored order less their
    group's zero point, times its scale (at: the token's first scale)."""
    n_planes = planes(fmt)
    per = D // groups // n_planes  # a group's run in one plane
    load_scales = scale_loader(fmt.scale_code)
    offset, has_zero = np.float32(fmt.offset), fmt.has_zero

    @njit(forceinline=True)
    def dequantize(x, scales, zeros, at):
        s = repeat(spread(load_scales(scales, at, groups), per), n_planes)
        if has_zero:
            return (x - repeat(spread(load_scales(zeros, at, groups), per), n_planes)) * s
        return (x - offset) * s
    return dequantize


def tile_scorer(fmt: PoolFormat, R: int, D: int, groups: int):
    """tile_scores(codes, row, q_all, q_words, scales, zeros, at, stride): (R x 16) float32 dot
    products of R query heads with keys row .. row + 15 (q_all, q_words: the query as the key
    reader takes it; at, stride: the first key's scales and the step between keys' scales)."""
    key = _key_reader(fmt, R, D, groups)
    if fmt.code == INTEGER and not grouped_keys(fmt, groups):
        @njit(forceinline=True)
        def as_float(dots):
            return to_float(dots)
    else:
        @njit(forceinline=True)
        def as_float(dots):
            return dots

    if in_pairs(fmt, D, groups):
        @njit(forceinline=True)
        def eight(codes, row, q_all, q_words, scales, zeros, at, stride):
            """Keys row .. row + 7, 2 lanes each: four key pairs of 8 partial sums, then two
            steps of the transpose-and-add tree (`pair`)."""
            return pair(pair(key(codes, row, q_all, q_words, scales, zeros, at),
                             key(codes, row + 2, q_all, q_words, scales, zeros, at), 8),
                        pair(key(codes, row + 4, q_all, q_words, scales, zeros, at),
                             key(codes, row + 6, q_all, q_words, scales, zeros, at), 8), 4)
    else:
        @njit(forceinline=True)
        def four(codes, row, q_all, q_words, scales, zeros, at, stride):
            """Keys row .. row + 3, 4 lanes each: two steps of the tree from 16 partial sums."""
            return pair(pair(key(codes, row, q_all, q_words, scales, zeros, at),
                             key(codes, row + 1, q_all, q_words, scales, zeros, at + stride), 16),
                        pair(key(codes, row + 2, q_all, q_words, scales, zeros, at + 2 * stride),
                             key(codes, row + 3, q_all, q_words, scales, zeros, at + 3 * stride),
                             16), 8)

        @njit(forceinline=True)
        def eight(codes, row, q_all, q_words, scales, zeros, at, stride):
            """Keys row .. row + 7, 2 lanes each."""
            return pair(four(codes, row, q_all, q_words, scales, zeros, at, stride),
                        four(codes, row + 4, q_all, q_words, scales, zeros, at + 4 * stride,
                             stride), 4)

    if not WIDE_VECTORS and in_pairs(fmt, D, groups):  # AVX2: the tree over 8-lane segments
        @njit(forceinline=True)
        def two(codes, row, q_all, q_words, scales, zeros, at):
            """Keys row and row + 1, 4 lanes each: a key pair's two halves summed in pairs."""
            both = key(codes, row, q_all, q_words, scales, zeros, at)  # (R x 16) int32
            return pair8(half(both, 0), half(both, 1), 8)  # (R x 8)

        @njit(forceinline=True)
        def eight8(codes, row, q_all, q_words, scales, zeros, at, stride):
            """Keys row .. row + 7, one lane each: (R x 8), the tree's levels a register a
            head each, where over 16-lane segments they take two and the tile spills."""
            return pair8(pair8(two(codes, row, q_all, q_words, scales, zeros, at),
                               two(codes, row + 2, q_all, q_words, scales, zeros, at), 4),
                         pair8(two(codes, row + 4, q_all, q_words, scales, zeros, at),
                               two(codes, row + 6, q_all, q_words, scales, zeros, at), 4), 2)

        @njit(forceinline=True)
        def tile_scores(codes, row, q_all, q_words, scales, zeros, at, stride):
            """As below: keys row .. row + 7 and row + 8 .. row + 15 joined per head."""
            return as_float(join(eight8(codes, row, q_all, q_words, scales, zeros, at, stride),
                                 eight8(codes, row + 8, q_all, q_words, scales, zeros,
                                        at + 8 * stride, stride)))
        return tile_scores

    @njit(forceinline=True)
    def tile_scores(codes, row, q_all, q_words, scales, zeros, at, stride):
        """(R x 16) float32 dot products of the R heads with keys row .. row + 15: the last step
        of the tree leaves one lane per key, in key order."""
        return as_float(pair(eight(codes, row, q_all, q_words, scales, zeros, at, stride),
                             eight(codes, row + 8, q_all, q_words, scales, zeros,
                                   at + 8 * stride, stride), 2))
    return tile_scores


@njit(forceinline=True)
def prefetch_block(pool, blk, h, H, BS, row, row_bytes, has_zero):
    """Start reading a block's codes of head h (rows as prefetch_row's), and its scales."""
    codes, scales, zeros, b_stride, h_stride = pool[:5]
    prefetch_lines(codes, (blk * H + h) * BS * row, (BS * row_bytes + 63) // 64, LEVEL)
    prefetch_scales(scales, zeros, b_stride, h_stride, blk, h, has_zero)


@njit(forceinline=True)
def prefetch_row(codes, at, row, row_bytes, t):
    """Start reading row t of a block's codes (its head's rows from flat element at; row
    elements, row_bytes bytes: constants, as an array's itemsize is not): its lines, or,
    where rows are shorter than a line, the line that row t begins. A block's lines asked
    for a row at a time are spread over the work on another block."""
    if t % max(1, 64 // row_bytes) == 0:
        prefetch_lines(codes, at + t * row, max(1, row_bytes // 64), LEVEL)


@njit(forceinline=True)
def prefetch_scales(scales, zeros, b_stride, h_stride, blk, h, has_zero):
    """Start reading a block's scales (and zero points) of head h where they change per
    block: a scale line missed per block costs a DRAM latency of its own.

    No branch touches the arrays. numba counts a reference to each array an inlined function
    is given, up on entry and down on return, and removes such pairs only where nothing
    branches between them; the ones left are atomic adds to a count that every thread's calls
    share, so the threads hand that cache line back and forth once a block. Static scales
    (b_stride 0) ask for no line: a count of 0, not a branch."""
    at = blk * b_stride + h * h_stride
    span = h_stride + b_stride * (h_stride == 0)  # elements of head h's scales in the block
    lines = ((span * scales.itemsize + 63) // 64 + 1) * (b_stride != 0)
    prefetch_lines(scales, at, lines, LEVEL)
    prefetch_lines(zeros, at, lines * has_zero, LEVEL)
