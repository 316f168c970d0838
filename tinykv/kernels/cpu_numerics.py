"""Numbers the fused CPU kernels share (cpu.py attends, cpu_store.py stores): numba, or the flag
that says why it is missing; half, bf16 and fp8 conversions on integer bits (numba has no float16
on the CPU); a vectorizable 2^x, and e^x (the GEMV's SwiGLU); a prefetch hint.

Every conversion here rounds as torch's CPU casts do, so the store kernel writes the bits the torch
reference writes, and the attention kernel reads them back as the reference does.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numpy as np

try:
    import numba
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.core.caching import FunctionCache
    from numba.extending import intrinsic

    AVAILABLE, REASON = True, ""
except ImportError as err:  # the caller falls back to the torch references
    AVAILABLE, REASON = False, f"numba is not importable ({err}); use the torch references"
    ir = types = numba = cgutils = None
    prange = range
    FunctionCache = object

    def intrinsic(*args, **_kw):  # a decorator, with or without options: nothing to compile
        return args[0] if args else intrinsic

    def njit(*_args, **_kw):
        return intrinsic

_GIVEN = threading.local()  # the thread count use_threads last gave numba, per Python thread


def use_threads(n: int) -> None:
    """numba.set_num_threads(n), skipped where tinykv already set n in this Python thread (numba
    keeps its count per thread). A decode step asks before each parallel kernel, and a call costs
    about what a small kernel does, many times that with cold caches (bench kernel --cpu's cold
    fixed costs). Every setting in tinykv goes through here; code outside it that sets numba's
    count leaves this one stale, which costs speed, not correctness."""
    if getattr(_GIVEN, "count", None) != n:
        numba.set_num_threads(n)
        _GIVEN.count = n


# How a stored element (or a scale) becomes a number. Integer codes are read through the array's
# own dtype: int8 for sym int8, uint8 for everything else (packed, asym, fp8 bits).
FLOAT32, HALF, BFLOAT, FP8, INTEGER = range(5)

# Dot products may be reordered and fused (that is what vectorizes them). No nnan/ninf: -inf is a
# running maximum before any key, and NaN in a stored value must come out as NaN.
FAST = {"reassoc", "contract", "nsz", "arcp"}

# What the compiled kernels were built from: every CPU kernel source file (numba's own disk cache
# watches only the file that defines a function, not the helpers it inlines from others). cpu.py
# is the Python side: its one small kernel is cached by numba's own key, so editing it compiles
# nothing else again.
SOURCES = hashlib.sha256(b"".join(
    f.read_bytes() for f in sorted(Path(__file__).parent.glob("cpu*.py"))
    if f.name != "cpu.py")).hexdigest()


class _KernelCache(FunctionCache):
    """numba's disk cache, keyed by the kernel's variant (the formats and shapes it was compiled
    for) and the kernel sources, instead of the bytecode and closure cells: the cells of a
    specialized kernel hold other compiled functions, which pickle differently in every process,
    so numba's own key would never match again."""

    def __init__(self, py_func, variant: tuple):
        super().__init__(py_func)
        self._variant = repr(variant)

    def _index_key(self, sig, codegen):
        return (sig, codegen.magic_tuple(), (SOURCES, self._variant))


def kernel(variant: tuple = (), **options):
    """numba.njit(**options), cached on disk under `variant` and the sources' hash."""
    def compile_(fn):
        if not AVAILABLE:
            return fn
        dispatcher = njit(**options)(fn)
        dispatcher._cache = _KernelCache(fn, variant)
        return dispatcher
    return compile_


HALF_REBIAS = np.float32(2.0**112)  # 2^(127 - 15): a half's exponent field into a float's
FP8_STEP = np.float32(2.0**-9)  # value of one e4m3 subnormal step
HALF_STEPS = np.float32(2.0**24)  # half subnormals are multiples of 2^-24
FP8_STEPS = np.float32(512.0)  # e4m3 subnormals are multiples of 2^-9
EXP2_FLOOR = np.float32(-126.0)  # 2^x below it is taken as 2^-126: no subnormal, never 0
LOG2E = np.float32(1.4426950408889634)  # scores go base 2: e^s = 2^(s log2 e)
LN2 = np.float32(0.6931471805599453)
EXP_FLOOR, EXP_CEILING = np.float32(-87.0), np.float32(88.0)  # e^x a normal float32


@intrinsic
def as_f32(typingctx, u):
    """The float32 whose bits are the low 32 bits of integer u (numba has no scalar bitcast)."""
    def codegen(context, builder, sig, args):
        v, i32 = args[0], ir.IntType(32)
        if v.type.width != 32:
            v = builder.trunc(v, i32) if v.type.width > 32 else builder.zext(v, i32)
        return builder.bitcast(v, ir.FloatType())
    return types.float32(u), codegen


@intrinsic
def f32_bits(typingctx, x):
    """The bits of float32 x, as an int64 in [0, 2^32)."""
    def codegen(context, builder, sig, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))
    return types.int64(types.float32), codegen


def _prefetch(locality: int, what: str):
    def prefetch_line(typingctx, arr, i):
        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
            ptr = builder.bitcast(builder.gep(data, [args[1]]), i8p)
            builder.call(fn, [ptr, i32(0), i32(locality), i32(1)])  # read, data cache
            return context.get_dummy_value()
        return types.none(arr, types.intp), codegen
    prefetch_line.__doc__ = f"""Hint the cache line of flat element i of a C-contiguous array into
    {what} (llvm.prefetch: it never faults, so an address past the end is harmless)."""
    return intrinsic(prefetch_line)


prefetch = _prefetch(3, "every cache level")
# Into L2 and below, not L1: where L1 holds what the loop reuses (gemv_tiles: the activations),
# lines brought ahead into L1 would push it out.
prefetch_l2 = _prefetch(2, "L2 and below")


@njit(forceinline=True)  # inlined where used: a call per value would stop vectorization
def from_half(b, code):
    """fp16 (code HALF) or bf16 (BFLOAT) bits -> float32, exactly. Plain integer code that LLVM
    vectorizes; the F16C instruction would be faster, but LLVM may lower it to a library call
    numba cannot link where the CPU (or NUMBA_CPU_NAME) lacks it."""
    if code == BFLOAT:
        return as_f32(np.uint32(b) << 16)
    sign = (np.uint32(b) & 0x8000) << 16
    em = np.uint32(b) & 0x7FFF  # exponent and mantissa
    if em >= 0x7C00:  # inf, nan
        return as_f32(sign | (em << 13) | 0x7F800000)
    return as_f32(sign | (em << 13)) * HALF_REBIAS  # subnormals too: the multiply normalizes


@njit(forceinline=True)
def from_fp8(b):
    """float8 e4m3fn bits -> float32 (0x7F and 0xFF are nan)."""
    mag = np.uint32(b) & 0x7F
    x = as_f32((mag << 20) + (120 << 23)) if mag >= 8 else np.float32(mag) * FP8_STEP
    x = np.float32(np.nan) if mag == 0x7F else x
    return -x if b & 0x80 else x


@njit(forceinline=True)
def load_scale(values, code, i):
    """Element i of a scale or zero array: float32 as is, or half/bf16 bits."""
    if code == FLOAT32:
        return np.float32(values[i])
    return from_half(values[i], code)


@njit(forceinline=True)
def _exp_series(f):
    """e^f for |f| <= ln 2 / 2, by Taylor's series to the 7th power (error < 1e-8, under
    float32's rounding)."""
    p = np.float32(1 / 5040)
    for c in (1 / 720, 1 / 120, 1 / 24, 1 / 6, 1 / 2, 1.0, 1.0):
        p = p * f + np.float32(c)
    return p


@njit(forceinline=True)
def exp2(x):
    """2^x for float32 x <= 0, vectorizable (no libm call): 2^k by the exponent bits times 2^f,
    |f| <= 1/2, as e^(f ln 2). x below -126 (and -inf) gives 2^-126, a weight no sum of ones
    can see."""
    x = max(x, EXP2_FLOOR)
    k = np.rint(x)
    return _exp_series((x - k) * LN2) * as_f32((np.int64(k) + 127) << 23)


@njit(forceinline=True)
def exp(x):
    """e^x for float32 x, vectorizable (no libm call): 2^k e^r, k = rint(x log2 e), r = x - k ln 2.
    Unlike e^x = 2^(x log2 e), the rounding of x log2 e only picks k, so r keeps x's bits: a few
    units in the last place where |x| is small, as libm. x is clamped to [-87, 88], where e^x is
    a normal float32 (NaN stays NaN)."""
    x = min(max(x, EXP_FLOOR), EXP_CEILING)
    k = np.rint(x * LOG2E)
    return _exp_series(x - k * LN2) * as_f32((np.int64(k) + 127) << 23)


@njit(forceinline=True)  # inlined: a call per value would stop vectorization
def to_half(x, code):
    """float32 -> fp16 (HALF) / bf16 (BFLOAT) bits, to nearest even like torch's CPU casts."""
    u = f32_bits(x)
    if code == BFLOAT:
        return 0xFFFF if x != x else (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # torch: nan -> 0xFFFF
    sign, a = (u >> 16) & 0x8000, u & 0x7FFFFFFF
    if a > 0x7F800000:  # nan: quiet, top payload bits kept
        return sign | 0x7E00 | ((a >> 13) & 0x3FF)
    if a >= 0x477FF000:  # rounds past 65504 (or inf)
        return sign | 0x7C00
    if a < 0x38800000:  # below 2^-14: a multiple of 2^-24, exact before the rounding
        return sign | np.int64(np.rint(abs(x) * HALF_STEPS))
    return sign | ((a - 0x38000000 + 0xFFF + ((a >> 13) & 1)) >> 13)


@njit(cache=True)
def to_fp8(v):
    """float32 in [-448, 448] -> e4m3fn bits, to nearest even like torch's cast (sign of 0 kept)."""
    u, a = f32_bits(v), abs(v)
    if a < 0.015625:  # subnormal: multiples of 2^-9
        mag = np.int64(np.rint(a * FP8_STEPS))
    else:
        mag = (((u & 0x7FFFFFFF) + 0x7FFFF + ((u >> 20) & 1)) >> 20) - (120 << 3)
    return mag | ((u >> 24) & 0x80)


@njit(cache=True)
def cast_up(s, code, tiny, big):
    """Positive float32 -> half bits, rounded up, never down, as quant.cast_up."""
    s = min(max(s, tiny), big)
    c = to_half(s, code)
    return c + 1 if from_half(c, code) < s else c
