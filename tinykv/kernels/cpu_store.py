"""The fused CPU quantize-on-store kernel (numba): quant.compute_scales + quant.quantize in one
pass over the new tokens, op for op, so its codes and scales match the torch reference bit for
bit (reference.quantize_store_ref).

A decode step stores one token per sequence, K and V, in every layer: a few hundred values a call.
So what counts is the cost around the kernel: `StoreArgs` (the pool's arrays and the format's
constants) is made once per pool and reused (cpu.CpuKernels keeps it), and the kernel runs on one
thread (waking others would cost more than the work). Inside, two things count:
- every new token's row lands in a block of its own, cold in memory, and a store that misses
  waits for its line before the stores behind it go on; so the kernel prefetches the lines of
  the next TOKENS_AHEAD tokens (`ask_for_token`: a decode step's all at once), and the misses
  overlap;
- each step over a row (its absmax, the division, the clamp and rounding, the packing) is a loop
  of its own without branches, on a contiguous copy of the row, so that LLVM vectorizes it.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .. import quant
from ..quant import MSE_CLIPS, zero_room
from ..spec import FP8_MAX, QuantParams
from .cpu_args import NO_SCALES, as_index, pool_arrays
from .cpu_numerics import (
    AVAILABLE,
    FLOAT32,
    FP8,
    HALF,
    REASON,
    as_f32,
    cast_up,
    f32_bits,
    from_half,
    kernel,
    load_scale,
    njit,
    prefetch,
    to_fp8,
    to_half,
)
from .layout import PoolLayer


class StoreArgs(NamedTuple):
    """One pool as the store kernel writes it."""
    fmt: tuple  # cpu_args.PoolFormat, as a plain tuple (numba dispatches those fast)
    arrays: tuple  # cpu_args.PoolArrays
    block_size: int
    limits: tuple  # (qmax, lowest code, highest code, slack, zero room, tiny, big), each a
    # float32 value as a Python float
    dynamic: bool  # scales computed per token (not static, not a float format)
    clips: np.ndarray  # (C,) float32: the fractions of a group's absmax an mse format tries
    # (quant.MSE_CLIPS), an argument, not a global, so no compiled kernel keeps old ones; (0,)
    # for other formats
    fit_steps: int  # times the least-error scale is then fitted (quant.FIT_STEPS for a `fit`
    # format, else 0), an argument for the same reason


def store_args(p: QuantParams, data: torch.Tensor, scale: torch.Tensor | None,
               zero: torch.Tensor | None) -> StoreArgs:
    """The store kernel's arguments for one pool, layout checked."""
    assert not p.block_wise, f"{p}: block-wise scales are computed when a block fills"
    _, H, BS, _ = data.shape
    D = data.shape[-1] * p.per_byte
    dynamic = not (p.static or p.is_float)
    assert not dynamic or (scale.shape == (data.shape[0], H, BS, p.ngroups(D))
                           and scale.dtype in (torch.float16, torch.bfloat16)), \
        "dynamic scales are stored per slot, (NB, H, BS, G), in a 16-bit float"
    fmt, arrays = pool_arrays(PoolLayer(data, scale, zero, p), H, BS, D)
    arrays = (arrays[0].reshape(arrays[0].shape[0], -1), *arrays[1:])  # rows of D // per_byte
    scale_dtype = torch.float16 if scale is None else scale.dtype
    fi = torch.finfo(scale_dtype)
    fp8 = p.dtype == "fp8"
    lo, hi = (-FP8_MAX, FP8_MAX) if fp8 else (p.qmin + p.offset, p.qmax + p.offset)
    room = zero_room(p, scale_dtype)
    slack = 0.0 if fp8 else 0.5  # a code rounds into range from half a step outside it
    limits = tuple(float(np.float32(c)) for c in (p.qmax, lo, hi, slack, room, fi.tiny, fi.max))
    return StoreArgs(fmt=tuple(fmt), arrays=arrays, block_size=BS, limits=limits,
                     dynamic=dynamic, clips=np.array(MSE_CLIPS if p.clips else (), np.float32),
                     fit_steps=quant.FIT_STEPS if p.fit else 0)


# reassoc: the error sums may be added in any order, so that they vectorize. They differ from the
# reference's only in float64 rounding, as before (it sums in an order of its own); equal scales
# lose equal errors, and the first of equals is kept.
@kernel(error_model="numpy", fastmath={"reassoc"})
def least_error_scale(xs, amax, clips, qmax, offset, lo, hi, scale_code, tiny, big):
    """quant._least_error_scales for one group xs: the half bits of the scale, among
    cast_up(amax * clip / qmax) for each of `clips`, that loses the least squared error
    (float64 sums, the first of equals kept)."""
    best = 0
    least = np.inf
    for clip in clips:
        bits = cast_up(amax * clip / qmax, scale_code, tiny, big)
        s = from_half(bits, scale_code)
        err = 0.0
        for c in range(xs.shape[0]):  # by index: numba's array iterator hides the unit step
            finite = abs(xs[c]) < np.inf  # NaN and Inf lose nothing
            x = xs[c] if finite else np.float32(0.0)
            code = np.rint(min(max(x / s + offset, lo), hi))
            lost = np.float64((code - offset) * s) - np.float64(x)
            err += lost * lost if finite else 0.0
        if err < least:
            best = bits
            least = err
    return best


@kernel(error_model="numpy", fastmath={"reassoc"})
def fitted_scale(xs, bits, offset, lo, hi, scale_code, tiny, big):
    """One step of quant._least_error_scales's fit for one group xs: the half bits of sum(x^2) /
    sum(x * steps), the steps xs take at the scale of half bits `bits`, rounded up (float64
    sums, as the error sums); `bits` where no step correlates with xs."""
    s = from_half(bits, scale_code)
    along = 0.0
    energy = 0.0
    for c in range(xs.shape[0]):
        x = xs[c] if abs(xs[c]) < np.inf else np.float32(0.0)  # NaN and Inf take no part
        step = np.rint(min(max(x / s + offset, lo), hi)) - offset
        along += np.float64(x) * np.float64(step)
        energy += np.float64(x) * np.float64(x)
    if along > 0.0:
        return cast_up(np.float32(energy / along), scale_code, tiny, big)
    return bits


@njit(forceinline=True)
def absmax(xs):
    """The largest |x| of the finite values of xs (0.0 if none), found on their bits: as integers
    the magnitudes of finite floats order as the floats do, and LLVM vectorizes an integer max
    (a float max only with fast-math flags)."""
    most = 0
    for c in range(xs.shape[0]):  # by index: numba's array iterator hides the unit step
        magnitude = f32_bits(xs[c]) & 0x7FFFFFFF
        most = max(most, magnitude if magnitude < 0x7F800000 else 0)  # NaN and Inf: none
    return as_f32(most)


@njit(forceinline=True)
def store_scale(xs, scales, zeros, at, has_zero, clips, fit_steps, qmax, offset, lo, hi, room,
                scale_code, tiny, big):
    """quant.compute_scales for one group xs, into scales[at] (and zeros[at])."""
    if clips.shape[0] > 0:
        bits = least_error_scale(xs, absmax(xs), clips, qmax, offset, lo, hi, scale_code, tiny,
                                 big)
        for _ in range(fit_steps):
            bits = fitted_scale(xs, bits, offset, lo, hi, scale_code, tiny, big)
        scales[at] = bits
        return
    if not has_zero:
        scales[at] = cast_up(absmax(xs) / qmax, scale_code, tiny, big)
        return
    mn, mx = np.float32(np.inf), np.float32(-np.inf)
    for c in range(xs.shape[0]):
        finite = abs(xs[c]) < np.inf  # NaN and Inf are ignored
        mn = min(mn, xs[c] if finite else np.float32(np.inf))
        mx = max(mx, xs[c] if finite else np.float32(-np.inf))
    if mn > mx:  # no finite value
        mn = mx = np.float32(0.0)
    s = max(mx / qmax - mn / qmax, max(mn / room, -mn / (qmax + room)))
    scales[at] = cast_up(s, scale_code, tiny, big)
    zf = min(max(np.rint(-mn / from_half(scales[at], scale_code)), -room), qmax + room)
    zeros[at] = to_half(zf, scale_code)


@njit(forceinline=True)
def store_cast(values, dst, code):
    """A row of float32 values into dst as float32, fp16 or bf16 (code); returns the count of
    finite values that overflowed to inf."""
    if code == FLOAT32:
        for c in range(values.shape[0]):
            dst[c] = values[c]
        return 0
    inf_bits = 0x7C00 if code == HALF else 0x7F80  # an fp16 or a bf16 inf, its sign cleared
    count = 0
    for c in range(values.shape[0]):
        b = to_half(values[c], code)
        dst[c] = b
        count += (abs(values[c]) < np.inf) & (b & 0x7FFF == inf_bits)
    return count


@njit(forceinline=True)
def pack(out, dst, pb):
    """Codes out (D,) into dst (D // pb,): code pb * e + j at bit j * (8 // pb) of element e,
    in one loop for each count of codes per element (1, 2 or 4), so that each vectorizes."""
    if pb == 1:
        for e in range(dst.shape[0]):
            dst[e] = out[e] & 0xFF
    elif pb == 2:
        for e in range(dst.shape[0]):
            dst[e] = (out[2 * e] & 0xFF) | (out[2 * e + 1] & 0xFF) << 4
    else:
        for e in range(dst.shape[0]):
            dst[e] = ((out[4 * e] & 0xFF) | (out[4 * e + 1] & 0xFF) << 2
                      | (out[4 * e + 2] & 0xFF) << 4 | (out[4 * e + 3] & 0xFF) << 6)


TOKENS_AHEAD = 16  # tokens between the one stored and the one whose lines are asked for


@njit(forceinline=True)
def ask_for_token(i, blk, off, pool, H, BS, D, dynamic, has_zero):
    """Prefetch the lines token i's rows go to: codes and, for per-token scales, scales and
    zero points. Each new token's rows are in a block of their own, cold in memory, and a store
    that misses the cache holds up the stores behind it until its line comes: one line after
    another. Prefetches hold up nothing, so the lines come together."""
    codes, scales, zeros, block_stride, head_stride, token_stride, group_stride, gs = pool
    width = codes.shape[1]
    line = 64 // codes.itemsize  # elements a cache line
    for h in range(H):
        row = (blk[i] * H + h) * BS + off[i]
        for e in range(0, width + line - 1, line):
            prefetch(codes, row * width + min(e, width - 1))
        first = blk[i] * block_stride + h * head_stride + off[i] * token_stride
        for g in range(D // gs if dynamic else 0):
            prefetch(scales, first + g * group_stride)
            if has_zero:
                prefetch(zeros, first + g * group_stride)


@kernel(error_model="numpy")  # IEEE division: no zero checks
def compiled_store(x, blk, off, fmt, pool, BS, limits, dynamic, clips, fit_steps):
    """Quantize x (n, H, D) float32 into `pool` at rows (blk[i], h, off[i]), op for op as
    quant.compute_scales + quant.quantize; returns the count of saturated values and NaNs
    (for an mse or fit format, one with `clips`, of NaNs: its scales clip by choice). Each step
    is its own loop over a row copied contiguous, without branches, so that LLVM vectorizes
    it."""
    code, bits, scale_kind, scale_code, has_zero, offset = fmt
    codes, scales, zeros, block_stride, head_stride, token_stride, group_stride, gs = pool
    # float32 as store_args rounded them (numba dispatches a tuple of Python floats faster)
    qmax, lo, hi = np.float32(limits[0]), np.float32(limits[1]), np.float32(limits[2])
    slack, room = np.float32(limits[3]), np.float32(limits[4])
    tiny, big = np.float32(limits[5]), np.float32(limits[6])
    low, high = lo - slack, hi + slack  # a value past these is counted as saturated
    if clips.shape[0] > 0:  # but an mse or fit format's scales clip by choice
        low, high = np.float32(-np.inf), np.float32(np.inf)
    n, H, D = x.shape
    pb = D // codes.shape[1]  # codes per stored element
    values = np.empty(D, np.float32)  # one (token, head) row of x
    out = np.empty(D, np.int32)  # its codes, before packing
    for i in range(min(n, TOKENS_AHEAD)):  # a decode step's tokens: all asked for first
        ask_for_token(i, blk, off, pool, H, BS, D, dynamic, has_zero)
    count = 0
    for i in range(n):
        if i + TOKENS_AHEAD < n:  # more tokens (a prompt): each asked for a while ahead
            ask_for_token(i + TOKENS_AHEAD, blk, off, pool, H, BS, D, dynamic, has_zero)
        for h in range(H):
            row = (blk[i] * H + h) * BS + off[i]
            for c in range(D):
                values[c] = x[i, h, c]
            if scale_kind == NO_SCALES:
                count += store_cast(values, codes[row], code)
                continue
            for g in range(D // gs):
                xs, codes_g = values[g * gs:g * gs + gs], out[g * gs:g * gs + gs]  # views: their
                # indices start at 0, so LLVM sees every access a step apart (and no gathers)
                at = blk[i] * block_stride + h * head_stride + off[i] * token_stride \
                    + g * group_stride
                if dynamic:
                    store_scale(xs, scales, zeros, at, has_zero, clips, fit_steps,
                                qmax, np.float32(offset), lo, hi, room, scale_code, tiny, big)
                scale = load_scale(scales, scale_code, at)
                zero = load_scale(zeros, scale_code, at) if has_zero else np.float32(offset)
                if code == FP8:  # fp8 keeps -0.0's sign: no zero point added
                    for c in range(gs):
                        nan = xs[c] != xs[c]
                        v = (np.float32(0.0) if nan else xs[c]) / scale
                        count += nan | (v < low) | (v > high)
                        codes_g[c] = to_fp8(min(max(v, lo), hi))
                else:
                    for c in range(gs):
                        nan = xs[c] != xs[c]
                        v = (np.float32(0.0) if nan else xs[c]) / scale + zero  # divide: as torch
                        count += nan | (v < low) | (v > high)
                        codes_g[c] = np.int32(np.rint(min(max(v, lo), hi)))
            pack(out, codes[row], pb)
    return count


@kernel(error_model="numpy")
def compiled_store_pair(k_rows, v_rows, blk, off, k_fmt, k_pool, k_limits, k_dynamic, k_clips,
                        k_fit_steps, v_fmt, v_pool, v_limits, v_dynamic, v_clips, v_fit_steps,
                        BS):
    """compiled_store of a layer's keys, then of its values, in one call (a decode step's
    direct path: one dispatch, and blk, off and BS unboxed once, for both)."""
    return (compiled_store(k_rows, blk, off, k_fmt, k_pool, BS, k_limits, k_dynamic, k_clips,
                           k_fit_steps)
            + compiled_store(v_rows, blk, off, v_fmt, v_pool, BS, v_limits, v_dynamic, v_clips,
                             v_fit_steps))


def quantize_store_cpu(x: torch.Tensor, p: QuantParams, data: torch.Tensor,
                       scale: torch.Tensor | None, zero: torch.Tensor | None, blk: torch.Tensor,
                       off: torch.Tensor) -> int:
    """quantize_store_ref in one pass over the new tokens x (n, H, D): codes, and per-token/group
    scales and zeros, written into their slots; returns the count of saturated values and NaNs."""
    assert AVAILABLE, REASON
    assert blk.shape == off.shape == (x.shape[0],), "x, blk, off disagree"
    args = store_args(p, data, scale, zero)
    return store_rows(x, as_index(blk, np.int64), as_index(off, np.int64), args)


def store_rows(x: torch.Tensor, blk: np.ndarray, off: np.ndarray, args: StoreArgs) -> int:
    """x (n, H, D) into the pool of `args` at (blk[i], :, off[i]); the count quantize_store_ref
    returns."""
    assert x.device.type == "cpu", "the CPU store takes CPU tensors"
    if x.shape[0] == 0:
        return 0
    rows = x.numpy() if x.dtype is torch.float32 else x.float().numpy()  # strided views stay so
    return int(compiled_store(rows, blk, off, args.fmt, args.arrays, args.block_size,
                              args.limits, args.dynamic, args.clips, args.fit_steps))
