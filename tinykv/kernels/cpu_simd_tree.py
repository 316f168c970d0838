"""The transpose-and-add tree: many vectors of per-key partial sums (one segment of lanes per
head or output) into one vector holding each key's whole sum in a lane of its own, so that no key
pays a horizontal sum. Each step (`pair`) takes two vectors whose segments hold keys of `width`
lanes and returns one whose segments hold both vectors' keys at width / 2 lanes.

Segments are 16 lanes (one AVX-512 register of float32 or int32) or 8 (`pair8`: one AVX2
register). Over 16-lane segments, AVX2 holds each level of the tree in twice the registers, and a
tile of keys spills (cpu_vector_rows.tile_scorer); `half` and `join` go between the two widths.
"""

from __future__ import annotations

from .cpu_numerics import intrinsic
from .cpu_simd import FLAGS, PIECE, Vec, _is_float, _literal, _map, _pick


def _pair(x, y, width, seg: int):
    """pair's signature and code generator over segments of seg lanes."""
    w = _literal(width)

    def codegen(context, builder, sig, args):
        lo, hi = [], []
        for g in range(sig.args[0].lanes // seg):
            for src in (0, 1):
                for key in range(seg // w):
                    first = g * seg + key * w
                    lo += [(src, first + i) for i in range(w // 2)]
                    hi += [(src, first + w // 2 + i) for i in range(w // 2)]
        n = len(lo)
        a = _pick(builder, list(args[:2]), lo, n)
        b = _pick(builder, list(args[:2]), hi, n)
        if _is_float(sig.args[0]):
            return _map(builder, lambda p, q: builder.fadd(p, q, flags=FLAGS), a, b)
        return _map(builder, builder.add, a, b)
    return x(x, y, width), codegen


@intrinsic(prefer_literal=True)
def pair(typingctx, x, y, width):
    """One step of the transpose-and-add tree over 16-lane segments (one per head): x and y hold,
    per segment, keys of `width` lanes of partial sums; the result holds x's keys then y's, each
    summed to width / 2 lanes. Four steps from 16 keys of 16 lanes leave one lane per key, in
    key order."""
    return _pair(x, y, width, PIECE)


@intrinsic(prefer_literal=True)
def pair8(typingctx, x, y, width):
    """pair over 8-lane segments."""
    return _pair(x, y, width, PIECE // 2)


@intrinsic(prefer_literal=True)
def half(typingctx, v, which):
    """Lanes 8 * which .. 8 * which + 7 of each 16-lane segment."""
    k = _literal(which)

    def codegen(context, builder, sig, args):
        n = sig.args[0].lanes // 2
        return _pick(builder, [args[0]], [(0, i // 8 * 16 + k * 8 + i % 8) for i in range(n)], n)
    return Vec(v.dtype, v.lanes // 2)(v, which), codegen


@intrinsic
def join(typingctx, a, b):
    """Per 8-lane segment of a and of b, a's then b's: two halves back into 16-lane segments."""
    def codegen(context, builder, sig, args):
        n = 2 * sig.args[0].lanes
        return _pick(builder, list(args), [(i // 8 % 2, i // 16 * 8 + i % 8) for i in range(n)],
                     n)
    return Vec(a.dtype, 2 * a.lanes)(a, b), codegen
