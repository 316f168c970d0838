"""Numeric pieces the fused CPU kernels share (cpu.py attends, cpu_store.py stores): numba, or the
flag that says why it is missing; the stored formats as integers; half, bf16 and fp8 conversions as
integer bits (numba has no float16 on the CPU); the one dequant formula `_dq`; a vectorizable exp;
and the packing of a pool into kernel arguments.
"""

from __future__ import annotations

import platform

import numpy as np
import torch

from .layout import FLOAT, INT, PoolLayer, check_layout, stored_format

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
    strides = check_layout(t, H, BS, D, str(p))
    assert data.is_contiguous() and data.device.type == "cpu", f"{p}: data must be contiguous, CPU"
    assert s is None or s.is_contiguous(), f"{p}: scale must be contiguous"
    fmt = stored_format(p, D)
    G, pb = D // fmt.group_size, fmt.per_byte
    if fmt.family == FLOAT:
        fmt_code = {32: F32, 16: F16 if p.dtype == "fp16" else BF16}[fmt.bits]
    elif fmt.family == INT:
        fmt_code = {8: I8 if fmt.signed else U8, 4: U4, 2: U2}[fmt.bits]
    else:
        fmt_code = FP8
    rows = _np(data).reshape(-1, D // pb)  # (NB * H * BS, D // per_byte)
    size = data.element_size()
    d16 = rows if size == 2 else np.zeros((1, 1), np.uint16)
    d32 = rows if size == 4 else np.zeros((1, 1), np.float32)
    kind = {torch.float16: F16, torch.bfloat16: BF16}.get(None if s is None else s.dtype, F32)
    sz = []
    for x in (s, z):  # each as (half bits, float32): the kernel reads the one `kind` names
        sz.append(np.zeros(1, np.uint16) if x is None or kind == F32 else _np(x))
        sz.append(np.zeros(1, np.float32) if x is None or kind != F32 else _np(x))
    # meta is int64: the offset goes in half steps (sym int2's is 1.5)
    meta = [fmt_code, kind, fmt.has_zero, int(2 * fmt.offset), G, fmt.group_size, D // pb, H * BS,
            BS, strides.block, strides.head, strides.token, strides.group]
    return rows.view(np.uint8), d16, d32, *sz, np.array(meta, dtype=np.int64)


def _c(t: torch.Tensor, dtype: type) -> np.ndarray:
    """An index tensor as a C-contiguous numpy array: other layouts would compile a new kernel."""
    return np.ascontiguousarray(t.numpy(), dtype)
