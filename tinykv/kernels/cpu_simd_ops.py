"""What the vector kernel does with Vec values (cpu_simd.py): copies per head, per-head
reductions, the orders of packed codes, and lane-by-lane math (2^x, log2, rounding); the
transpose-and-add tree is cpu_simd_tree.py. Every mask is a compile-time constant and no shuffle
is wider than two 16-lane pieces (cpu_simd._pick), so LLVM lowers each to one or two permute
instructions.
"""

from __future__ import annotations

from .cpu_numerics import cgutils, intrinsic, ir, types
from .cpu_simd import (
    FLAGS,
    PIECE,
    Vec,
    _data,
    _literal,
    _map,
    _mask,
    _pick,
    _pieces,
    _splat_piece,
    _whole,
)


def _larger(builder, a, b):
    """The larger of float vectors a and b per lane. `a > b ? a : b` is what x86's max
    instruction computes (b on a tie or a NaN); `>=` differs from it on a tie of +0 with -0,
    so LLVM would compile that to a compare and a blend."""
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


def _rint(builder, p):
    """Float lanes rounded to the nearest (even) whole number."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(p.type, [p.type]),
                                        f"llvm.rint.v{p.type.count}f32")
    return builder.call(fn, [p])


@intrinsic(prefer_literal=True)
def spread(typingctx, v, each):
    """Every lane of v repeated `each` times (one value per head over the head's segment)."""
    k = _literal(each)

    def codegen(context, builder, sig, args):
        n = sig.args[0].lanes
        return _pick(builder, [args[0]], [(0, i // k) for i in range(n * k)], n * k)
    return Vec(v.dtype, v.lanes * k)(v, each), codegen


def _segment(v, seg, op: str):
    """One lane per segment of `seg` lanes (a multiple of 16): its max, max |x| or sum."""
    n = _literal(seg)

    def codegen(context, builder, sig, args):
        def combine(a, b):
            return builder.fadd(a, b, flags=FLAGS) if op == "sum" else _larger(builder, a, b)
        pieces = _pieces(builder, args[0])
        if op == "absmax":
            fabs = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(pieces[0].type, [pieces[0].type]),
                f"llvm.fabs.v{PIECE}f32")
            pieces = [builder.call(fabs, [p]) for p in pieces]
        def tree(values):  # pairwise: a chain log2(len) combines deep, not len - 1
            return values[0] if len(values) == 1 else combine(
                tree(values[:len(values) // 2]), tree(values[len(values) // 2:]))
        tops, per = [], n // PIECE
        for first in range(0, len(pieces), per):
            p = tree(pieces[first:first + per])
            width = PIECE
            while width > 1:  # the lo half against the hi half
                half = width // 2
                p = combine(builder.shuffle_vector(p, p, _mask(list(range(half)))),
                            builder.shuffle_vector(p, p, _mask(list(range(half, width)))))
                width = half
            tops.append(builder.extract_element(p, ir.IntType(32)(0)))
        w = PIECE if len(tops) % PIECE == 0 else len(tops)  # as Vec holds them (_llvm_type)
        outs = [ir.Constant(ir.VectorType(ir.FloatType(), w), ir.Undefined)] * (len(tops) // w)
        for i, x in enumerate(tops):
            outs[i // w] = builder.insert_element(outs[i // w], x, ir.IntType(32)(i % w))
        return _whole(builder, outs)
    return Vec(v.dtype, v.lanes // n)(v, seg), codegen


@intrinsic(prefer_literal=True)
def segment_max(typingctx, v, seg):
    """The max of each seg-lane segment: one lane per segment."""
    return _segment(v, seg, "max")


@intrinsic(prefer_literal=True)
def segment_absmax(typingctx, v, seg):
    """The largest |x| of each seg-lane segment: one lane per segment."""
    return _segment(v, seg, "absmax")


@intrinsic(prefer_literal=True)
def segment_sum(typingctx, v, seg):
    """The sum of each seg-lane segment: one lane per segment."""
    return _segment(v, seg, "sum")


# Orders of a row's channels as the kernel reads packed codes. BYTES: plane j of byte i is channel
# planes * i + j, planes side by side. WORDS (keys read in pairs, cpu_simd.word_planes): per
# 32-byte chunk c, field j of 16-bit word i is channel (16 c + i) * fields + j, fields = 2 planes.
# DWORDS (value codes narrower than a byte, cpu_vector_rows.dword_fields): per 32-byte chunk c,
# field j of 32-bit word i is channel (8 c + i) * fields + j, fields = 4 planes: a field of all
# 8 words is one shift and one mask, no widening.
BYTES, WORDS, DWORDS = 0, 1, 2


def _lane_channels(planes: int, D: int, order: int) -> list[int]:
    """The channel each lane of a row holds, in that order."""
    if order == BYTES:
        n = D // planes
        return [planes * i + j for j in range(planes) for i in range(n)]
    if order == DWORDS:
        fields = 4 * planes
        return [(8 * c + i) * fields + j for c in range(D // (8 * fields)) for j in range(fields)
                for i in range(8)]
    fields = 2 * planes
    return [(16 * c + i) * fields + j for c in range(D // (16 * fields)) for j in range(fields)
            for i in range(16)]


@intrinsic(prefer_literal=True)
def stored_order(typingctx, v, planes, group_size, channels, order):
    """Group values (scales of G groups of channels) -> one per channel, in a stored order."""
    pb, gs, D, how = (_literal(x) for x in (planes, group_size, channels, order))

    def codegen(context, builder, sig, args):
        return _pick(builder, [args[0]], [(0, c // gs) for c in _lane_channels(pb, D, how)], D)
    return Vec(v.dtype, D)(v, planes, group_size, channels, order), codegen


@intrinsic
def first_keys(typingctx, v, n, fill):
    """Lanes of each 16-lane segment at index >= n replaced by fill (keys past a block's end)."""
    def codegen(context, builder, sig, args):
        idx = ir.Constant(ir.VectorType(ir.IntType(64), PIECE), list(range(PIECE)))
        n64 = context.cast(builder, args[1], sig.args[1], types.int64)
        keep = builder.icmp_signed("<", idx, _splat_piece(builder, n64, PIECE))
        fill = _splat_piece(builder, context.cast(builder, args[2], sig.args[2], types.float32),
                            PIECE)
        return _map(builder, lambda p: builder.select(keep, p, fill), args[0])
    return v(v, n, fill), codegen


@intrinsic(prefer_literal=True)
def head_dots(typingctx, x, q_all, heads):
    """A key's dot products with `heads` query heads, each left as 16 partial sums: x (D,) against
    q_all (heads x D,) -> (heads x 16,). int16 lanes go 32 at a time, products summed in pairs
    into int32 (exact; LLVM's vpdpwssd or vpmaddwd); float32 lanes 16 at a time (FMAs)."""
    R = _literal(heads)
    is_int = isinstance(x.dtype, types.Integer)

    def codegen(context, builder, sig, args):
        xs, qs = _pieces(builder, args[0]), _pieces(builder, args[1])
        per = len(xs)  # pieces per head
        sums = []
        for r in range(R):
            total = None
            for c in range(0, per, 2 if is_int else 1):
                if is_int:  # two int16 pieces: 32 lanes -> 16 int32 sums of pairs
                    wide = ir.VectorType(ir.IntType(32), 2 * PIECE)
                    a = builder.shuffle_vector(xs[c], xs[c + 1], _mask(list(range(2 * PIECE))))
                    b = builder.shuffle_vector(qs[r * per + c], qs[r * per + c + 1],
                                               _mask(list(range(2 * PIECE))))
                    prod = builder.mul(builder.sext(a, wide), builder.sext(b, wide))
                    part = builder.add(
                        builder.shuffle_vector(prod, prod, _mask(list(range(0, 2 * PIECE, 2)))),
                        builder.shuffle_vector(prod, prod, _mask(list(range(1, 2 * PIECE, 2)))))
                    total = part if total is None else builder.add(total, part)
                else:
                    part = builder.fmul(xs[c], qs[r * per + c], flags=FLAGS)
                    total = part if total is None else builder.fadd(total, part, flags=FLAGS)
            sums.append(total)
        return _whole(builder, sums)
    return Vec(types.int32 if is_int else types.float32, PIECE * R)(x, q_all, heads), codegen


@intrinsic(prefer_literal=True)
def to_channel_order(typingctx, v, planes, channels, order):
    """The inverse of to_stored_order(v, planes, channels, order)."""
    pb, D, how = _literal(planes), _literal(channels), _literal(order)

    def codegen(context, builder, sig, args):
        heads = sig.args[0].lanes // D
        lane_of = {c: i for i, c in enumerate(_lane_channels(pb, D, how))}
        return _pick(builder, [args[0]], [(0, r * D + lane_of[c]) for r in range(heads)
                                          for c in range(D)], heads * D)
    return v(v, planes, channels, order), codegen


@intrinsic(prefer_literal=True)
def spread_loads(typingctx, arr, first, stride, count, planes, group_size, channels, lane, lanes):
    """A key's weight per head and group over lanes lane .. lane+lanes-1 of a head's `channels`
    (BYTES order): those of head r, group g (of G) get arr.flat[first + (r * G + g) * stride]."""
    R, pb, gs, D, f, n = (_literal(x) for x in (count, planes, group_size, channels, lane, lanes))
    groups = [_lane_channels(pb, D, BYTES)[i] // gs for i in range(f, f + n, PIECE)]  # per piece

    def codegen(context, builder, sig, args):
        data = _data(context, builder, sig.args[0], args[0])
        step = context.cast(builder, args[2], sig.args[2], types.intp)
        pieces = []
        for r in range(R):
            for g in groups:
                at = builder.add(args[1], builder.mul(step, ir.IntType(64)(r * (D // gs) + g)))
                pieces.append(_splat_piece(builder, builder.load(builder.gep(data, [at])), PIECE))
        return _whole(builder, pieces)
    operands = (arr, first, stride, count, planes, group_size, channels, lane, lanes)
    return Vec(arr.dtype, R * n)(*operands), codegen


@intrinsic(prefer_literal=True)
def piece_copies(typingctx, v, times):
    """Each 16-lane piece of v `times` times in a row."""
    k = _literal(times)

    def codegen(context, builder, sig, args):
        return _whole(builder, [p for p in _pieces(builder, args[0]) for _ in range(k)])
    return Vec(v.dtype, k * v.lanes)(v, times), codegen


# ---- lane by lane -----------------------------------------------------------------------------

@intrinsic(prefer_literal=True)
def repeat(typingctx, v, times):
    """v's lanes, `times` copies side by side (a key's channels once per query head)."""
    k = _literal(times)

    def codegen(context, builder, sig, args):
        n = sig.args[0].lanes
        return _pick(builder, [args[0]], [(0, i % n) for i in range(n * k)], n * k)
    return Vec(v.dtype, v.lanes * k)(v, times), codegen


@intrinsic
def rint(typingctx, v):
    """float32 lanes rounded to the nearest (even) whole number, still float32."""
    def codegen(context, builder, sig, args):
        return _map(builder, lambda p: _rint(builder, p), args[0])
    return v(v), codegen


@intrinsic
def exp2(typingctx, v):
    """2^x per lane for float32 x <= 127, as cpu_numerics.exp2 (floor -126, Taylor to f^7)."""
    def codegen(context, builder, sig, args):
        def one(p):
            n = p.type.count
            f32, i32 = p.type, ir.VectorType(ir.IntType(32), n)

            def const(c):
                return _splat_piece(builder, ir.FloatType()(c), n)
            x = _larger(builder, p, const(-126.0))
            k = _rint(builder, x)
            f = builder.fmul(builder.fsub(x, k), const(0.6931471805599453))
            e = const(1 / 5040)
            for c in (1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0):
                e = builder.fadd(builder.fmul(e, f, flags=("contract",)), const(c),
                                 flags=("contract",))
            scale = builder.shl(builder.add(builder.fptosi(k, i32),
                                            _splat_piece(builder, ir.IntType(32)(127), n)),
                                _splat_piece(builder, ir.IntType(32)(23), n))
            return builder.fmul(e, builder.bitcast(scale, f32))
        return _map(builder, one, args[0])
    return v(v), codegen


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c, lane by lane, fused and exactly as written (llvm.fma: never reassociated)."""
    def codegen(context, builder, sig, args):
        def one(x, y, z):
            fnty, name = ir.FunctionType(x.type, [x.type] * 3), f"llvm.fma.v{x.type.count}f32"
            fn = cgutils.get_or_insert_function(builder.module, fnty, name)
            return builder.call(fn, [x, y, z])
        return _map(builder, one, *args)
    return a(a, b, c), codegen


@intrinsic
def vmax(typingctx, a, b):
    """The larger of a and b, lane by lane (float32), as _larger."""
    def codegen(context, builder, sig, args):
        return _map(builder, lambda p, q: _larger(builder, p, q), args[0], args[1])
    return a(a, b), codegen


@intrinsic(prefer_literal=True)
def to_stored_order(typingctx, v, planes, channels, order):
    """Per segment of `channels` lanes (a head): channel order -> a stored order."""
    pb, D, how = _literal(planes), _literal(channels), _literal(order)

    def codegen(context, builder, sig, args):
        heads = sig.args[0].lanes // D
        lanes = _lane_channels(pb, D, how)
        return _pick(builder, [args[0]], [(0, r * D + c) for r in range(heads) for c in lanes],
                     heads * D)
    return v(v, planes, channels, order), codegen


@intrinsic
def log2(typingctx, v):
    """log2 per lane (float32)."""
    def codegen(context, builder, sig, args):
        def one(p):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(p.type, [p.type]),
                                                f"llvm.log2.v{p.type.count}f32")
            return builder.call(fn, [p])
        return _map(builder, one, args[0])
    return v(v), codegen


@intrinsic
def any_above(typingctx, a, b):
    """Whether any lane of a is greater than the same lane of b (float32): one test per vector."""
    def codegen(context, builder, sig, args):
        hit = None
        for x, y in zip(_pieces(builder, args[0]), _pieces(builder, args[1])):
            above = builder.fcmp_ordered(">", x, y)
            hit = above if hit is None else builder.or_(hit, above)
        bits = builder.bitcast(hit, ir.IntType(hit.type.count))
        return builder.icmp_unsigned("!=", bits, ir.Constant(bits.type, 0))
    return types.boolean(a, b), codegen


@intrinsic
def where_positive(typingctx, test, a, b):
    """a where test > 0, else b, lane by lane."""
    def codegen(context, builder, sig, args):
        def one(t, x, y):
            zero = ir.Constant(t.type, None)
            return builder.select(builder.fcmp_ordered(">", t, zero), x, y)
        return _map(builder, one, *args)
    return a(test, a, b), codegen
