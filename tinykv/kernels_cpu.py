"""Fused CPU kernels for the paged, quantized KV cache, JIT-compiled with Numba: dequant-attention
and quantize-on-store, with the signatures of the torch references in kernels.py (read them first).

Attention reads each K/V block once, in its stored format, dequantizes 16 tokens at a time into an
L1 tile with the one formula x = (code - zero) * scale (`_dq`), and lets all n_rep query heads of
the KV head use the tile. Work items (query, KV head, split of its blocks) run in parallel (prange)
and merge by log-sum-exp, so one long sequence uses every thread. Numba has no float16 on the CPU:
fp16, bf16 and fp8 travel as integer bits, converted in-kernel. Formats are integers in a `meta`
array, so every format shares one compiled specialization per kernel: the first run compiles for
~13 s CPU (attention) and ~2 s (store); Numba caches the machine code beside this file.

Speed (2-vCPU Xeon, default model, 4k context, one layer): ~0.9 ms for fp16, int8 and int4 alike
(torch reference ~2 ms), so the formats' byte savings stop showing: the kernel is bound by float32
FMAs (3 query heads x (QK + PV) x 64 channels a key, 256-bit vectors) and per-key overheads (a
horizontal sum per score, D = 64 loops of 2 vector steps), not by memory.
"""

from __future__ import annotations

import math
import platform

import numpy as np
import torch

from .kernels import PoolLayer, merge_stacked, paged_attention_ref
from .quant import FP8_MAX, QuantParams

try:
    import numba
    from llvmlite import binding as llvm
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    AVAILABLE, REASON = True, ""
    # Without F16C, LLVM would turn a half-to-float cast into a runtime call numba may not link.
    _F16C = platform.machine() not in ("x86_64", "AMD64") or \
        "+f16c" in llvm.get_host_cpu_features().flatten()
except ImportError as err:  # the caller falls back to the torch references
    AVAILABLE, REASON = False, f"numba is not importable ({err}); use the torch references"
    ir = types = numba = cgutils = None
    _F16C = False
    prange = range

    def intrinsic(fn):
        return fn

    def njit(**_kw):
        return intrinsic

# Stored formats; F16 and BF16 double as the `kind` of half-precision scales, F32 of float32 ones.
F32, F16, BF16, FP8, I8, U8, U4, U2 = range(8)
TILE = 16  # tokens dequantized at a time: the K and V tiles stay in L1
# Rows with more queries (prefill chunks) go to the reference: measured at the default model's
# shapes, the kernel wins up to 4 queries at 1k context (8 at 4k), the reference's flash path
# beyond (64 queries at 4k: 87 ms here, 26 ms there), as it reads the row once for all queries.
CHUNK_MAX = 4
_FM = {"reassoc", "contract"}  # vectorized dot products; no nnan/ninf: -inf means "no key yet"
_C = (np.float32(2.0**112), np.float32(2.0**-9), np.float32(1.4426950408889634),
      np.float32(0.693145751953125), np.float32(1.428606765330187e-06), np.float32(-87.0),
      np.float32(2.0**24), np.float32(512.0))  # 2^112, 2^-9, log2 e, ln 2 = hi + lo, exp floor


@intrinsic
def _as_f32(typingctx, u):
    """The float32 whose bits are the low 32 bits of integer u (numba has no scalar bitcast)."""
    def codegen(context, builder, sig, args):
        v, i32 = args[0], ir.IntType(32)
        if v.type.width != 32:
            v = builder.trunc(v, i32) if v.type.width > 32 else builder.zext(v, i32)
        return builder.bitcast(v, ir.FloatType())
    return types.float32(u), codegen


@intrinsic
def _bits(typingctx, x):
    """The bits of float32 x, as an int64 in [0, 2^32)."""
    def codegen(context, builder, sig, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))
    return types.int64(types.float32), codegen


@intrinsic
def _f16_hw(typingctx, b):
    """fp16 bits -> float32 through LLVM's half type: one vcvtph2ps per 8 values with F16C."""
    def codegen(context, builder, sig, args):
        v = builder.trunc(args[0], ir.IntType(16)) if args[0].type.width > 16 else args[0]
        return builder.fpext(builder.bitcast(v, ir.HalfType()), ir.FloatType())
    return types.float32(b), codegen


@intrinsic
def _prefetch(typingctx, arr, i):
    """Hint the cache line of flat element i of a C-contiguous array (llvm.prefetch, read)."""
    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        ptr = builder.bitcast(builder.gep(data, [args[1]]), i8p)
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])  # read, keep in all levels, data cache
        return context.get_dummy_value()
    return types.none(arr, types.intp), codegen


@njit(cache=True)
def _half(b, kind):
    """fp16 (kind F16) or bf16 (BF16) bits -> float32."""
    if kind == BF16:
        return _as_f32(np.uint32(b) << 16)
    if _F16C:
        return _f16_hw(b)
    em = np.uint32(b) & 0x7FFF
    x = _as_f32((em << 13) | ((np.uint32(b) & 0x8000) << 16)) * _C[0]  # rebias 15 -> 127
    return _as_f32((em << 13) | 0x7F800000) if em >= 0x7C00 else x  # inf, nan


@njit(cache=True)
def _fp8(b):
    """float8 e4m3fn bits -> float32 (0x7F / 0xFF are nan)."""
    mag = np.uint32(b) & 0x7F
    x = _as_f32((mag << 20) + (120 << 23)) if mag >= 8 else np.float32(mag) * _C[1]
    x = np.float32(np.nan) if mag == 0x7F else x
    return -x if b & 0x80 else x


@njit(cache=True)
def _load(a16, a32, kind, i):
    """Element i of a scale or zero tensor, held as float32 (kind F32) or half bits."""
    return a32[i] if kind == F32 else _half(a16[i], kind)


@njit(cache=True)
def _dq(code, zero, scale):
    """THE dequant formula of every integer and fp8 format and granularity."""
    return (code - zero) * scale


@njit(cache=True, fastmath=_FM, inline="always")  # a call would pay refcounts per tile
def _dequant(pool, blk, h, t0, nt, out, out3, srow, zrow):
    """Tokens t0 .. t0+nt of block blk, head h -> out (rows, D) float32, read in stored format;
    out3 is out as (rows, G, D // G); srow, zrow (D,) hold a scale row shared by the tokens.
    Every index runs from 0 up, so LLVM drops numba's negative-index fix-up and vectorizes."""
    d8, d16, d32, s16, s32, z16, z32, meta = pool  # data as rows (NB * H * BS, D // per_byte)
    fmt, kind, dp = meta[0], meta[1], meta[6]
    for t in range(nt):
        row = blk * meta[7] + h * meta[8] + t0 + t
        if fmt == F32:
            for c in range(dp):
                out[t, c] = d32[row, c]
        elif fmt == F16 or fmt == BF16:
            for c in range(dp):
                out[t, c] = _half(d16[row, c], fmt)
        elif fmt == FP8:
            for c in range(dp):
                out[t, c] = _fp8(d8[row, c])
        elif fmt == I8:
            for c in range(dp):
                out[t, c] = np.float32(np.int8(d8[row, c]))  # int8 codes arrive as uint8
        elif fmt == U8:
            for c in range(dp):
                out[t, c] = np.float32(d8[row, c])
        elif fmt == U4:  # element 2i + j of a row sits at bit 4j of byte i
            for c in range(dp):
                b = np.uint32(d8[row, c])
                out[t, 2 * c] = np.float32(b & 15)
                out[t, 2 * c + 1] = np.float32(b >> 4)
        else:
            for c in range(dp):
                b = np.uint32(d8[row, c])
                out[t, 4 * c] = np.float32(b & 3)
                out[t, 4 * c + 1] = np.float32((b >> 2) & 3)
                out[t, 4 * c + 2] = np.float32((b >> 4) & 3)
                out[t, 4 * c + 3] = np.float32(b >> 6)
    if fmt <= BF16:
        return
    G, gs, has_zero, offset = meta[4], meta[5], meta[2], np.float32(meta[3])
    sb, sst, ssg = blk * meta[9] + h * meta[10] + t0 * meta[11], meta[11], meta[12]
    if sst == 0:  # one scale row for all tokens (block-wise, static): expand it per channel
        for g in range(G):
            s = _load(s16, s32, kind, sb + g * ssg)
            z = _load(z16, z32, kind, sb + g * ssg) if has_zero else offset
            for c in range(g * gs, g * gs + gs):
                srow[c] = s
                zrow[c] = z
        for t in range(nt):
            for c in range(out.shape[1]):
                out[t, c] = _dq(out[t, c], zrow[c], srow[c])
    else:  # per-token (and per-group) scales
        for t in range(nt):
            for g in range(G):
                s = _load(s16, s32, kind, sb + t * sst + g * ssg)
                z = _load(z16, z32, kind, sb + t * sst + g * ssg) if has_zero else offset
                for c in range(gs):
                    out3[t, g, c] = _dq(out3[t, g, c], z, s)


@njit(cache=True, fastmath={"contract"})  # not reassoc: the Cody-Waite split must stay apart
def _exp(x):
    """e^x for float32 x <= 0, vectorizable (no libm call); x < -87 (and -inf) give ~1e-38."""
    x = max(x, _C[5])
    k = np.rint(x * _C[2])
    f = x - k * _C[3] - k * _C[4]  # |f| <= ln2 / 2
    p = np.float32(1 / 5040)
    for c in (1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0):  # Taylor to f^7: error < 1e-8
        p = p * f + np.float32(c)
    return p * _as_f32((np.int64(k) + 127) << 23)


@njit(cache=True, fastmath=_FM)
def _attend(qh, row, n_keys, lo, hi, h, kp, vp, BS, sm_scale, acc, m, l):
    """The n_rep query heads qh (R, D) of KV head h over blocks lo..hi of table row `row`: online
    softmax into acc (R, D) (unnormalized), m (R,) running max and l (R,) sum of exp(score - m)."""
    R, D = qh.shape
    tile = min(BS, TILE)
    rows = (tile + 3) // 4 * 4  # keys go 4 at a time; rows past a tile's end hold zeros
    qs = np.empty((R, D), np.float32)  # queries times sm_scale
    for r in range(R):
        for d in range(D):
            qs[r, d] = qh[r, d] * sm_scale
    kb = np.zeros((rows, D), np.float32)  # keys of the tile
    vb = np.zeros((rows, D), np.float32)  # values of the tile
    kb3 = kb.reshape(rows, kp[7][4], D // kp[7][4])  # (rows, G, D // G) for group scales
    vb3 = vb.reshape(rows, vp[7][4], D // vp[7][4])
    sc = np.zeros((R, rows), np.float32)  # scores, then probabilities
    srow = np.empty(D, np.float32)
    zrow = np.empty(D, np.float32)
    for j in range(lo, hi):
        blk = row[j]
        if blk < 0:  # not in this pool
            continue
        nxt = row[j + 1] if j + 1 < hi else -1
        for w in range(2 if nxt >= 0 else 0):  # start reading the next block's K and V now
            d8, meta = (kp, vp)[w][0], (kp, vp)[w][7]  # d8: every pool's data as bytes
            first = (nxt * meta[7] + h * meta[8]) * d8.shape[1]
            for e in range(first, first + BS * d8.shape[1], 64):
                _prefetch(d8, e)
        for t0 in range(0, min(BS, n_keys - j * BS), tile):
            nt = min(tile, n_keys - j * BS - t0)
            n4 = (nt + 3) // 4 * 4
            for w in range(2):  # K, then V: one inlined copy of _dequant serves both
                _dequant((kp, vp)[w], blk, h, t0, nt, (kb, vb)[w], (kb3, vb3)[w], srow, zrow)
            for t in range(nt, n4):  # a partial tile: zero keys, values and (below) probabilities
                kb[t] = 0.0
                vb[t] = 0.0
            for r in range(R):
                for t in range(0, n4, 4):  # 4 keys per pass over q: independent sums, fewer loads
                    s0 = s1 = s2 = s3 = np.float32(0.0)
                    for d in range(D):
                        s0 += qs[r, d] * kb[t, d]
                        s1 += qs[r, d] * kb[t + 1, d]
                        s2 += qs[r, d] * kb[t + 2, d]
                        s3 += qs[r, d] * kb[t + 3, d]
                    sc[r, t], sc[r, t + 1], sc[r, t + 2], sc[r, t + 3] = s0, s1, s2, s3
                mx = m[r]
                for t in range(nt):
                    mx = max(mx, sc[r, t])
                alpha = _exp(m[r] - mx)
                psum = np.float32(0.0)
                for t in range(nt):
                    p = _exp(sc[r, t] - mx)
                    sc[r, t] = p
                    psum += p
                for t in range(nt, n4):
                    sc[r, t] = 0.0
                l[r] = l[r] * alpha + psum
                m[r] = mx
                if alpha != 1.0:
                    for d in range(D):
                        acc[r, d] *= alpha
                for t in range(0, n4, 4):  # the acc row is loaded and stored once per 4 values
                    p0, p1, p2, p3 = sc[r, t], sc[r, t + 1], sc[r, t + 2], sc[r, t + 3]
                    for d in range(D):
                        acc[r, d] += (p0 * vb[t, d] + p1 * vb[t + 1, d]
                                      + p2 * vb[t + 2, d] + p3 * vb[t + 3, d])


@njit(parallel=True, cache=True)
def _attn_kernel(q, q_seq, q_pos, table, ctx_lens, kp, vp, n_rep, BS, sm_scale, o, lse):
    """Work items (query n, KV head h, split sp) in parallel, each over the sp-th share of the
    query's visible blocks into o[sp, n] (S, N, Hq, D) and lse[sp, n] (S, N, Hq), as partials."""
    n_split, N, Hq, D = o.shape
    H = Hq // n_rep
    for item in prange(n_split * N * H):
        i = np.int64(item)  # parfors may hand out an unsigned index: keep the arithmetic signed
        n, h, sp = i // (H * n_split), i // n_split % H, i % n_split
        b = q_seq[n]
        n_keys = min(q_pos[n] + 1, ctx_lens[b])  # causal: keys 0 .. n_keys-1 are visible
        n_blk = min((n_keys + BS - 1) // BS, table.shape[1])
        per = (n_blk + n_split - 1) // n_split
        lo, hi = sp * per, min(sp * per + per, n_blk)
        acc = np.zeros((n_rep, D), np.float32)  # unnormalized sum of p * v
        m = np.full(n_rep, -np.inf, np.float32)  # max score
        l = np.zeros(n_rep, np.float32)  # sum of exp(score - m)
        if lo < hi:
            qh = q[n, h * n_rep:h * n_rep + n_rep]
            _attend(qh, table[b], n_keys, lo, hi, h, kp, vp, BS, sm_scale, acc, m, l)
        for r in range(n_rep):  # loops, not slice assignment: no broadcasting code to compile
            seen = l[r] > 0  # else no key: o 0, lse -inf
            lse[sp, n, h * n_rep + r] = m[r] + math.log(l[r]) if seen else -np.inf
            for d in range(D):
                o[sp, n, h * n_rep + r, d] = acc[r, d] / l[r] if seen else 0.0


@njit(cache=True)
def _to_half(x, kind):
    """float32 -> fp16 / bf16 bits, to nearest even like torch's (vectorized) CPU casts."""
    u = _bits(x)
    if kind == BF16:
        return 0xFFFF if x != x else (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # torch: nan -> 0xFFFF
    sign, a = (u >> 16) & 0x8000, u & 0x7FFFFFFF
    if a > 0x7F800000:  # nan: quiet, top payload bits kept
        return sign | 0x7E00 | ((a >> 13) & 0x3FF)
    if a >= 0x477FF000:  # rounds past 65504 (or inf)
        return sign | 0x7C00
    if a < 0x38800000:  # below 2^-14: a multiple of 2^-24, exact before the rounding
        return sign | np.int64(np.rint(abs(x) * _C[6]))
    return sign | ((a - 0x38000000 + 0xFFF + ((a >> 13) & 1)) >> 13)


@njit(cache=True)
def _to_fp8(v):
    """float32 in [-448, 448] -> e4m3fn bits, to nearest even like torch's cast (sign of 0 kept)."""
    u, a = _bits(v), abs(v)
    if a < 0.015625:  # subnormal: multiples of 2^-9
        mag = np.int64(np.rint(a * _C[7]))
    else:
        mag = (((u & 0x7FFFFFFF) + 0x7FFFF + ((u >> 20) & 1)) >> 20) - (120 << 3)
    return mag | ((u >> 24) & 0x80)


@njit(cache=True)
def _cast_up(s, kind, tiny, big):
    """Positive float32 -> half bits, rounded up, never down, as quant.cast_up."""
    s = min(max(s, tiny), big)
    c = _to_half(s, kind)
    return c + 1 if _half(c, kind) < s else c


@njit(cache=True)
def _store_kernel(x, blk, off, sp, qmax, lo, hi, slack, room, tiny, big, dynamic):
    """Quantize x (n, H, D) float32 into the pool `sp` at rows (blk[i], h, off[i]), op for op as
    quant.compute_scales + quant.quantize; returns the count of saturated values and NaNs.
    Serial: a decode step stores a few rows, and waking threads would cost more than the work."""
    d8, d16, d32, s16, s32, z16, z32, meta = sp
    n, H, D = x.shape
    fmt, kind, has_zero, G, gs, dp = meta[0], meta[1], meta[2], meta[4], meta[5], meta[6]
    pb = D // dp  # codes per stored byte
    codes = np.empty(D, np.int64)
    count = 0
    for i in range(n):
        for h in range(H):
            row = blk[i] * meta[7] + h * meta[8] + off[i]
            if fmt <= BF16:  # a plain cast; finite values that overflow to inf are counted
                for c in range(D):
                    if fmt == F32:
                        d32[row, c] = x[i, h, c]
                        continue
                    b = _to_half(x[i, h, c], fmt)
                    d16[row, c] = b
                    count += abs(x[i, h, c]) < np.inf and b & 0x7FFF == (0x7C00, 0x7F80)[fmt - 1]
                continue
            for g in range(G):
                xs = x[i, h, g * gs:g * gs + gs]
                si = blk[i] * meta[9] + h * meta[10] + off[i] * meta[11] + g * meta[12]
                if dynamic:  # quant.compute_scales for one group
                    mn, mx, amax = np.float32(np.inf), np.float32(-np.inf), np.float32(0.0)
                    for xv in xs:
                        if abs(xv) < np.inf:  # NaN and Inf are ignored
                            mn, mx, amax = min(mn, xv), max(mx, xv), max(amax, abs(xv))
                    if not has_zero:
                        s16[si] = _cast_up(amax / qmax, kind, tiny, big)
                    else:
                        if mn > mx:  # no finite value
                            mn = mx = np.float32(0.0)
                        s = max(mx / qmax - mn / qmax, max(mn / room, -mn / (qmax + room)))
                        s16[si] = _cast_up(s, kind, tiny, big)
                        zf = min(max(np.rint(-mn / _half(s16[si], kind)), -room), qmax + room)
                        z16[si] = _to_half(zf, kind)
                scale = _load(s16, s32, kind, si)
                zero = _load(z16, z32, kind, si) if has_zero else np.float32(meta[3])
                for c in range(gs):
                    xv = xs[c]
                    nan = xv != xv
                    v = (np.float32(0.0) if nan else xv) / scale  # divide, not multiply: exact ties
                    v = v if fmt == FP8 else v + zero  # fp8 keeps the sign of -0.0
                    count += nan or v < lo - slack or v > hi + slack
                    v = min(max(v, lo), hi)
                    codes[g * gs + c] = _to_fp8(v) if fmt == FP8 else np.int64(np.rint(v))
            for e in range(dp):  # element pb*e + j at bit j * (8 // pb)
                b = 0
                for j in range(pb):
                    b |= (codes[e * pb + j] & 0xFF) << (j * 8 // pb)
                d8[row, e] = b
    return count


_NP = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.uint16), 4: (torch.float32, np.float32)}


def _np(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as a flat numpy array, as bits where numpy lacks the dtype."""
    as_torch, as_np = _NP[t.element_size()]
    return t.view(as_torch).numpy().reshape(-1).view(as_np)


def _pool(t: PoolLayer, H: int, BS: int, D: int) -> tuple:
    """Kernel arguments (d8, d16, d32, s16, s32, z16, z32, meta) of one pool, after checking its
    layout. d8 is the data as bytes for every format; unused arrays are 1-element dummies, so every
    format has the same argument types."""
    p, s, z, data = t.p, t.scale, t.zero, t.data
    G, pb = 1 if s is None else s.shape[-1], p.per_byte
    assert data.dim() == 4 and tuple(data.shape[1:]) == (H, BS, D // pb) and D % G == 0, \
        f"{p}: data {tuple(data.shape)} is not (NB, {H}, {BS}, {D // pb})"
    assert data.is_contiguous() and data.dtype == p.storage_dtype and data.device.type == "cpu", \
        f"{p}: data must be a contiguous CPU tensor of {p.storage_dtype}"
    assert (s is None) == p.is_float and (z is None) == (p.sym or p.is_float), f"{p}: scale/zero"
    full = (data.shape[0], H, BS, G)
    assert s is None or (s.dim() == 4 and all(a in (1, b) for a, b in zip(s.shape, full))), \
        f"{p}: scale {tuple(s.shape)} does not broadcast to (NB, H, BS, G) = {full}"
    assert s is None or (s.is_contiguous() and s.dtype in (torch.float32, torch.float16,
                                                           torch.bfloat16)), f"{p}: scale layout"
    assert z is None or (z.shape == s.shape and z.dtype == s.dtype and z.is_contiguous())
    fmt = {"fp32": F32, "fp16": F16, "bf16": BF16, "fp8": FP8, "int4": U4, "int2": U2}.get(p.dtype)
    fmt = (I8 if p.sym else U8) if fmt is None else fmt
    rows = _np(data).reshape(-1, D // pb)  # (NB * H * BS, D // per_byte)
    size = data.element_size()
    d16 = rows if size == 2 else np.zeros((1, 1), np.uint16)
    d32 = rows if size == 4 else np.zeros((1, 1), np.float32)
    kind = {torch.float16: F16, torch.bfloat16: BF16}.get(None if s is None else s.dtype, F32)
    sz = []
    for x in (s, z):  # each as (half bits, float32): the kernel reads the one `kind` names
        sz.append(np.zeros(1, np.uint16) if x is None or kind == F32 else _np(x))
        sz.append(np.zeros(1, np.float32) if x is None or kind != F32 else _np(x))
    strides = [0] * 4 if s is None else [0 if n == 1 else st for n, st in zip(s.shape, s.stride())]
    meta = [fmt, kind, z is not None, p.offset, G, D // G, D // pb, H * BS, BS, *strides]
    return rows.view(np.uint8), d16, d32, *sz, np.array(meta, dtype=np.int64)


def _c(t: torch.Tensor, dtype: type) -> np.ndarray:
    """An index tensor as a C-contiguous numpy array: other layouts would compile a new kernel."""
    return np.ascontiguousarray(t.numpy(), dtype)


def paged_attention_cpu(q: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor, k: PoolLayer,
                        v: PoolLayer, block_table: torch.Tensor, ctx_lens: torch.Tensor,
                        sm_scale: float, num_splits: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_attention_ref, fused on the CPU: K/V are read once per query group, dequantized in
    L1 tiles. A row with more than CHUNK_MAX queries (a prefill chunk) goes to the reference.
    num_splits: shares of a query's blocks taken by separate items (default: 4 items a thread)."""
    assert AVAILABLE, REASON
    (N, Hq, D), (B, MB), (H, BS) = q.shape, block_table.shape, k.data.shape[1:3]
    assert Hq % H == 0 and q_seq.shape == q_pos.shape == (N,) and ctx_lens.shape == (B,)
    seq = _c(q_seq, np.int64)
    counts = np.bincount(seq, minlength=B)  # queries per row
    if N and counts.max() > CHUNK_MAX:
        chunk = torch.from_numpy(counts[seq] > CHUNK_MAX)  # (N,) queries of prefill chunks
        rows = torch.from_numpy(counts > CHUNK_MAX)
        remap = torch.cumsum(rows, 0) - 1  # row of block_table[rows] for each chunk row
        o = torch.zeros(N, Hq, D)
        lse = torch.full((N, Hq), float("-inf"))
        o[chunk], lse[chunk] = paged_attention_ref(
            q[chunk], remap[q_seq[chunk].long()], q_pos[chunk], k, v, block_table[rows],
            ctx_lens[rows], sm_scale)
        if not bool(chunk.all()):
            o[~chunk], lse[~chunk] = paged_attention_cpu(
                q[~chunk], q_seq[~chunk], q_pos[~chunk], k, v, block_table, ctx_lens, sm_scale,
                num_splits)
        return o, lse
    # numba's pool follows torch's thread count (--threads), never every core
    numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if num_splits is None:  # items for every thread (a split costs a merge: none for 1 thread)
        threads = numba.get_num_threads()
        num_splits = 1 if threads == 1 else max(1, min(-(-4 * threads // max(N * H, 1)), MB))
    o = np.empty((num_splits, N, Hq, D), np.float32)
    lse = np.empty((num_splits, N, Hq), np.float32)
    _attn_kernel(q.float().contiguous().numpy(), seq, _c(q_pos, np.int64),
                 _c(block_table, np.int32), _c(ctx_lens, np.int64), _pool(k, H, BS, D),
                 _pool(v, H, BS, D), Hq // H, BS, np.float32(sm_scale), o, lse)
    o, lse = torch.from_numpy(o), torch.from_numpy(lse)
    if num_splits > 1:
        return merge_stacked(o, lse)
    return o[0], lse[0]


def quantize_store_cpu(x: torch.Tensor, p: QuantParams, data: torch.Tensor,
                       scale: torch.Tensor | None, zero: torch.Tensor | None, blk: torch.Tensor,
                       off: torch.Tensor) -> int:
    """quantize_store_ref in one pass over the new tokens x (n, H, D): codes, and per-token/group
    scales and zeros, written into their slots; returns the count of saturated values and NaNs."""
    assert AVAILABLE, REASON
    assert not p.block_wise, f"{p}: block-wise scales are computed when a block fills"
    (n, H, D), BS = x.shape, data.shape[2]
    assert blk.shape == off.shape == (n,) and x.device.type == "cpu"
    dynamic = not (p.static or p.is_float)
    assert not dynamic or (scale.shape == (data.shape[0], H, BS, p.ngroups(D))
                           and scale.dtype in (torch.float16, torch.bfloat16)), \
        "dynamic scales are stored per slot, (NB, H, BS, G), in a 16-bit float"
    fi = torch.finfo(torch.float16 if scale is None else scale.dtype)
    fp8 = p.dtype == "fp8"
    lo, hi = (-FP8_MAX, FP8_MAX) if fp8 else (p.qmin + p.offset, p.qmax + p.offset)
    room = min(round(2 / fi.eps), 2048) - p.qmax  # as quant.compute_scales
    pool = _pool(PoolLayer(data, scale, zero, p), H, BS, D)
    if n == 0:
        return 0
    f32 = [np.float32(c) for c in (p.qmax, lo, hi, 0.0 if fp8 else 0.5, room, fi.tiny, fi.max)]
    return int(_store_kernel(x.float().contiguous().numpy(), _c(blk, np.int64), _c(off, np.int64),
                             pool, *f32, dynamic))
