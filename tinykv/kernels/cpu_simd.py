"""LLVM vector values inside numba: the vocabulary the vector attention kernel (cpu_vector.py) is
written in. numba has no vector type, so `Vec(dtype, lanes)` is one. A Vec of a multiple of 16
lanes is held as 16-lane pieces (an LLVM array of <16 x dtype>: one 512-bit register for float32
on AVX-512, two 256-bit ones on AVX2): as one long vector (R = 3 heads of 64 lanes: 192) LLVM
would lower it lane by lane. Smaller Vecs (one lane per head) are one LLVM vector.
Lane counts are compile-time constants (literal ints in the kernel), so each operation is a few
LLVM instructions with constant shuffle masks. LLVM picks the instructions: `head_dots` on int16
is vpmaddwd + vpaddd, fused into vpdpwssd only for CPUs LLVM 22 tunes as fast at it (not Xeons
seen as rocketlake, where forcing it by inline assembly measured 0.97-1.03x the time).

The kernel keeps "wide" vectors: R query heads side by side, each a segment of D (or 16) lanes.
`repeat` copies a key's D lanes once per head; `spread` widens one value per head to its segment.
"""

from __future__ import annotations

import operator

from .cpu_numerics import cgutils, intrinsic, ir, types

PIECE = 16  # lanes per piece

if types is not None:  # numba is installed
    from numba.core import config
    from numba.extending import models, overload, register_model

    class Vec(types.Type):
        """`lanes` values of numba type `dtype`, in registers."""

        def __init__(self, dtype, lanes: int):
            self.dtype, self.lanes = dtype, lanes
            super().__init__(name=f"Vec({dtype} x {lanes})")

    @register_model(Vec)
    class _VecModel(models.PrimitiveModel):
        def __init__(self, dmm, fe_type):
            element = dmm.lookup(fe_type.dtype).get_value_type()
            super().__init__(dmm, fe_type, _llvm_type(element, fe_type.lanes))

    # F16C converts 8 halves an instruction; without it LLVM would call a helper numba cannot
    # link, so the bits are converted by integer arithmetic. Asked of the target numba builds for.
    _features = config.CPU_FEATURES
    if _features is None:
        from llvmlite import binding as _llvm
        _features = _llvm.get_host_cpu_features().flatten()
    HAS_F16C = "+f16c" in _features
    # A 16-lane piece is one register with AVX-512, two of AVX2's 16 (or a NEON CPU's four):
    # code that keeps many pieces live (gemv_tiles.py) pays only where they are wide.
    WIDE_VECTORS = "+avx512f" in _features
else:  # nothing is compiled; the names stay importable (cpu.AVAILABLE says why)
    Vec, HAS_F16C, WIDE_VECTORS = None, False, False
FLAGS = ("reassoc", "contract", "nsz")  # float sums may be reordered and fused


def _llvm_type(element, lanes: int):
    if lanes % PIECE == 0:
        return ir.ArrayType(ir.VectorType(element, PIECE), lanes // PIECE)
    return ir.VectorType(element, lanes)


def _literal(t) -> int:
    assert isinstance(t, types.IntegerLiteral), f"a lane count must be a constant, got {t}"
    return t.literal_value


# ---- pieces: what every operation below is built from ------------------------------------------

def _pieces(builder, v) -> list:
    if isinstance(v.type, ir.ArrayType):
        return [builder.extract_value(v, i) for i in range(v.type.count)]
    return [v]


def _whole(builder, pieces: list):
    """The Vec value of these pieces (16-lane pieces: an array of them; else the one vector)."""
    if pieces[0].type.count != PIECE:
        assert len(pieces) == 1
        return pieces[0]
    out = ir.Constant(ir.ArrayType(pieces[0].type, len(pieces)), ir.Undefined)
    for i, p in enumerate(pieces):
        out = builder.insert_value(out, p, i)
    return out


def _map(builder, fn, *values):
    """fn piece by piece over values of the same lane count."""
    return _whole(builder, [fn(*ps) for ps in zip(*[_pieces(builder, v) for v in values])])


def _mask(lanes: list[int]):
    return ir.Constant(ir.VectorType(ir.IntType(32), len(lanes)), lanes)


def _pick(builder, sources: list, picks: list[tuple[int, int]], lanes: int):
    """A vector of `lanes` lanes whose lane i is lane picks[i][1] of source picks[i][0] (sources:
    values of Vec types). Each output piece is built from the source pieces it needs, two at a
    time, so no shuffle is wider than a piece."""
    pieces, lookup = [], {}  # lookup: (source, lane) -> (piece, lane within it)
    for number, source in enumerate(sources):
        first = 0
        for p in _pieces(builder, source):
            for i in range(p.type.count):
                lookup[(number, first + i)] = (len(pieces), i)
            pieces.append(p)
            first += p.type.count
    width = PIECE if lanes % PIECE == 0 else lanes
    out = []
    for first in range(0, lanes, width):
        want = [lookup[p] for p in picks[first:first + width]]
        used = list(dict.fromkeys(k for k, _ in want))
        common = max([width] + [pieces[k].type.count for k in used])
        acc = None
        for k in used:
            piece = _widen(builder, pieces[k], common)
            if acc is None:
                acc = builder.shuffle_vector(piece, piece, _mask(
                    [i if kk == k else 0 for kk, i in want]))
            else:
                acc = builder.shuffle_vector(_widen(builder, acc, common), piece, _mask(
                    [common + i if kk == k else j for j, (kk, i) in enumerate(want)]))
        out.append(acc)
    return _whole(builder, out)


def _widen(builder, piece, width: int):
    """A vector with undefined lanes appended up to `width` (shuffles need equal widths)."""
    n = piece.type.count
    if n == width:
        return piece
    undef = ir.Constant(piece.type, ir.Undefined)
    return builder.shuffle_vector(piece, undef, _mask([min(i, n) for i in range(width)]))


def _splat_piece(builder, x, n: int):
    undef = ir.Constant(ir.VectorType(x.type, n), ir.Undefined)
    one = builder.insert_element(undef, x, ir.IntType(32)(0))
    return builder.shuffle_vector(one, undef, _mask([0] * n))


def _splat(builder, x, lanes: int):
    width = PIECE if lanes % PIECE == 0 else lanes
    return _whole(builder, [_splat_piece(builder, x, width)] * (lanes // width))


def _is_float(t) -> bool:
    return isinstance(t.dtype, types.Float)


def _data(context, builder, arrty, arr):
    return context.make_array(arrty)(context, builder, arr).data


# ---- memory -----------------------------------------------------------------------------------

@intrinsic(prefer_literal=True)
def load(typingctx, arr, start, lanes):
    """Elements start .. start+lanes-1 of a C-contiguous array (flat index), as a Vec."""
    n = _literal(lanes)

    def codegen(context, builder, sig, args):
        data = _data(context, builder, sig.args[0], args[0])
        width = PIECE if n % PIECE == 0 else n
        pieces = []
        for first in range(0, n, width):
            at = builder.gep(data, [builder.add(args[1], ir.IntType(64)(first))])
            ptr = builder.bitcast(at, ir.VectorType(data.type.pointee, width).as_pointer())
            pieces.append(builder.load(ptr, align=1))
        return _whole(builder, pieces)
    return Vec(arr.dtype, n)(arr, start, lanes), codegen


@intrinsic
def store(typingctx, arr, start, v):
    """arr.flat[start:start+lanes] = v."""
    def codegen(context, builder, sig, args):
        data = _data(context, builder, sig.args[0], args[0])
        first = 0
        for p in _pieces(builder, args[2]):
            at = builder.gep(data, [builder.add(args[1], ir.IntType(64)(first))])
            builder.store(p, builder.bitcast(at, p.type.as_pointer()), align=1)
            first += p.type.count
        return context.get_dummy_value()
    return types.none(arr, start, v), codegen


@intrinsic(prefer_literal=True)
def splat(typingctx, x, lanes):
    """x (as float32) in every lane."""
    n = _literal(lanes)

    def codegen(context, builder, sig, args):
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), n)
    return Vec(types.float32, n)(x, lanes), codegen



@intrinsic(prefer_literal=True)
def splat_at(typingctx, arr, start, lanes):
    """Element `start` (flat index, no negative wrap) of a float32 array in every lane."""
    n = _literal(lanes)

    def codegen(context, builder, sig, args):
        data = _data(context, builder, sig.args[0], args[0])
        return _splat(builder, builder.load(builder.gep(data, [args[1]])), n)
    return Vec(types.float32, n)(arr, start, lanes), codegen

# ---- conversions ------------------------------------------------------------------------------

@intrinsic
def to_int16(typingctx, v):
    """Lanes -> int16: int8 sign-extended, uint8 zero-extended, float32 (whole numbers within
    int16's range) converted."""
    def codegen(context, builder, sig, args):
        def widen(p):
            t = ir.VectorType(ir.IntType(16), p.type.count)
            if isinstance(sig.args[0].dtype, types.Float):
                return builder.fptosi(p, t)
            return builder.sext(p, t) if sig.args[0].dtype.signed else builder.zext(p, t)
        return _map(builder, widen, args[0])
    return Vec(types.int16, v.lanes)(v), codegen


@intrinsic
def to_float(typingctx, v):
    """Integer lanes -> float32 (exact below 2^24)."""
    def codegen(context, builder, sig, args):
        def convert(p):
            t = ir.VectorType(ir.FloatType(), p.type.count)
            return builder.sitofp(p, t) if sig.args[0].dtype.signed else builder.uitofp(p, t)
        return _map(builder, convert, args[0])
    return Vec(types.float32, v.lanes)(v), codegen


@intrinsic(prefer_literal=True)
def plane_lanes(typingctx, arr, start, first, lanes, bits, row_bytes):
    """Lanes first .. first+lanes-1 of a row of packed codes (row_bytes uint8 from flat element
    start) as int16, in stored order: lane j * row_bytes + i is field j (`bits` wide, the low
    first) of byte i, so the lanes follow the query's stored order (cpu_plain). A 16-lane piece
    is one plane of 16 bytes: a load, a shift and a mask; a chunk of a row reads only its own."""
    f, n, b, width = (_literal(x) for x in (first, lanes, bits, row_bytes))
    piece = min(PIECE, width)
    assert f % piece == 0 and n % piece == 0 and width % piece == 0

    def codegen(context, builder, sig, args):
        data = _data(context, builder, sig.args[0], args[0])
        out = []
        for lane in range(f, f + n, piece):
            plane, byte = divmod(lane, width)
            at = builder.gep(data, [builder.add(args[1], ir.IntType(64)(byte))])
            x = builder.load(builder.bitcast(at, ir.VectorType(ir.IntType(8), piece).as_pointer()),
                             align=1)
            if plane:
                x = builder.lshr(x, _splat_piece(builder, ir.IntType(8)(plane * b), piece))
            x = builder.and_(x, _splat_piece(builder, ir.IntType(8)((1 << b) - 1), piece))
            out.append(builder.zext(x, ir.VectorType(ir.IntType(16), piece)))
        return _whole(builder, out)
    return Vec(types.int16, n)(arr, start, first, lanes, bits, row_bytes), codegen


@intrinsic(prefer_literal=True)
def word_planes(typingctx, arr, first, second, nbytes, bits):
    """Two keys' rows of codes (nbytes bytes each, a multiple of 32, from flat elements first and
    second of a uint8 or int8 array) as 16-bit words -> int16 lanes (cpu_simd_ops.WORDS order):
    per 32-byte chunk and field j (bits j*bits.. of each word; a signed byte for int8 codes), 16
    lanes of the first key's words, then 16 of the second's. A dot of these with the query in the
    same order (each 16 lanes twice: piece_copies) sums pairs of lanes: each key's products land in
    its own 8 lanes: the first step of the transpose-and-add tree, done once per key pair instead
    of once per query head, and the packed fields come out with a shift and a mask."""
    n, b = _literal(nbytes), _literal(bits)
    signed = arr.dtype.signed

    def codegen(context, builder, sig, args):
        data = _data(context, builder, sig.args[0], args[0])
        words = ir.VectorType(ir.IntType(16), PIECE)

        def const(c):
            return _splat_piece(builder, ir.IntType(16)(c), PIECE)
        out = []
        for chunk in range(0, n, 32):
            rows = []
            for at in args[1:3]:
                ptr = builder.gep(data, [builder.add(at, ir.IntType(64)(chunk))])
                rows.append(builder.load(builder.bitcast(ptr, words.as_pointer()), align=1))
            for j in range(16 // b):
                for w in rows:
                    if signed:  # int8 codes: the low byte shifted up, then both down with sign
                        out.append(builder.ashr(builder.shl(w, const(8)) if j == 0 else w,
                                                const(8)))
                        continue
                    x = builder.lshr(w, const(j * b)) if j else w
                    out.append(builder.and_(x, const((1 << b) - 1)) if (j + 1) * b < 16 else x)
        return _whole(builder, out)
    return Vec(types.int16, n * 16 // b)(arr, first, second, nbytes, bits), codegen


# ---- arithmetic: the operators, lane by lane, a scalar standing for every lane -----------------

def _arith(name: str, float_op: str, int_op: str):
    @intrinsic
    def op(typingctx, a, b):
        vt = a if isinstance(a, Vec) else b

        def codegen(context, builder, sig, args):
            x, y = args[0], args[1]
            if not isinstance(sig.args[0], Vec):
                x = _splat(builder, context.cast(builder, x, sig.args[0], vt.dtype), vt.lanes)
            if not isinstance(sig.args[1], Vec):
                y = _splat(builder, context.cast(builder, y, sig.args[1], vt.dtype), vt.lanes)
            if _is_float(vt):
                return _map(builder, lambda p, q: getattr(builder, float_op)(p, q, flags=FLAGS),
                            x, y)
            return _map(builder, getattr(builder, int_op), x, y)
        return vt(a, b), codegen

    @overload(getattr(operator, name))
    def _impl(a, b):
        if isinstance(a, Vec) or isinstance(b, Vec):
            return lambda a, b: op(a, b)
    return op


if types is not None:
    vadd = _arith("add", "fadd", "add")
    vsub = _arith("sub", "fsub", "sub")
    vmul = _arith("mul", "fmul", "mul")
    vdiv = _arith("truediv", "fdiv", "sdiv")


@intrinsic(prefer_literal=True)
def prefetch_lines(typingctx, arr, start, lines, level):
    """Hint `lines` 64-byte lines from flat element `start` of a C-contiguous array into the
    caches (llvm.prefetch: never faults); a constant level: 3 down to L1, 2 down to L2."""

    def codegen(context, builder, sig, args):
        data = _data(context, builder, sig.args[0], args[0])
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        base = builder.bitcast(builder.gep(data, [args[1]]), i8p)
        count = context.cast(builder, args[2], sig.args[2], types.intp)
        with cgutils.for_range(builder, count) as loop:
            at = builder.gep(base, [builder.mul(loop.index, ir.IntType(64)(64))])
            builder.call(fn, [at, i32(0), i32(_literal(sig.args[3])), i32(1)])
        return context.get_dummy_value()
    return types.none(arr, start, lines, level), codegen
