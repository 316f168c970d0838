"""The fused CPU quantize-on-store kernel (numba): quant.compute_scales + quant.quantize in one
pass over the new tokens, op for op, so its codes and scales match the torch reference bit for
bit (reference.quantize_store_ref).

A decode step stores one token per sequence, K and V, in every layer: a few hundred values a call.
So what counts is the cost around the kernel: `StoreArgs` (the pool's arrays and the format's
constants) is made once per pool and reused (cpu.CpuKernels keeps it), and the kernel runs on one
thread (waking others would cost more than the work).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..quant import MSE_CLIPS, zero_room
from ..spec import FP8_MAX, QuantParams
from .cpu_args import NO_SCALES, as_index, pool_arrays
from .cpu_numerics import (
    AVAILABLE,
    FLOAT32,
    FP8,
    HALF,
    REASON,
    cast_up,
    from_half,
    kernel,
    load_scale,
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
                     dynamic=dynamic, clips=np.array(MSE_CLIPS if p.mse else (), np.float32))


@kernel(error_model="numpy")
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
        for xv in xs:
            if abs(xv) < np.inf:  # NaN and Inf take no part
                code = np.rint(min(max(xv / s + offset, lo), hi))
                lost = np.float64((code - offset) * s) - np.float64(xv)
                err += lost * lost
        if err < least:
            best = bits
            least = err
    return best


@kernel(error_model="numpy")  # IEEE division: no zero checks
def compiled_store(x, blk, off, fmt, pool, BS, limits, dynamic, clips):
    """Quantize x (n, H, D) float32 into `pool` at rows (blk[i], h, off[i]), op for op as
    quant.compute_scales + quant.quantize; returns the count of saturated values and NaNs
    (for an mse format, one with `clips`, of NaNs: its scales clip by choice)."""
    code, bits, scale_kind, scale_code, has_zero, offset = fmt
    codes, scales, zeros, block_stride, head_stride, token_stride, group_stride, gs = pool
    # float32 as store_args rounded them (numba dispatches a tuple of Python floats faster)
    qmax, lo, hi = np.float32(limits[0]), np.float32(limits[1]), np.float32(limits[2])
    slack, room = np.float32(limits[3]), np.float32(limits[4])
    tiny, big = np.float32(limits[5]), np.float32(limits[6])
    n, H, D = x.shape
    mse = clips.shape[0] > 0
    pb = D // codes.shape[1]  # codes per stored element
    out = np.empty(D, np.int64)
    count = 0
    for i in range(n):
        for h in range(H):
            row = (blk[i] * H + h) * BS + off[i]
            if scale_kind == NO_SCALES:  # a plain cast: finite values that overflow to inf count
                for c in range(D):
                    if code == FLOAT32:
                        codes[row, c] = x[i, h, c]
                        continue
                    b = to_half(x[i, h, c], code)
                    codes[row, c] = b
                    count += abs(x[i, h, c]) < np.inf and b & 0x7FFF == (0x7C00, 0x7F80)[
                        code - HALF]
                continue
            for g in range(D // gs):
                xs = x[i, h, g * gs:g * gs + gs]
                at = blk[i] * block_stride + h * head_stride + off[i] * token_stride \
                    + g * group_stride
                if dynamic:  # quant.compute_scales for one group
                    mn, mx, amax = np.float32(np.inf), np.float32(-np.inf), np.float32(0.0)
                    for xv in xs:
                        if abs(xv) < np.inf:  # NaN and Inf are ignored
                            mn, mx, amax = min(mn, xv), max(mx, xv), max(amax, abs(xv))
                    if mse:
                        scales[at] = least_error_scale(xs, amax, clips, qmax, np.float32(offset),
                                                       lo, hi, scale_code, tiny, big)
                    elif not has_zero:
                        scales[at] = cast_up(amax / qmax, scale_code, tiny, big)
                    else:
                        if mn > mx:  # no finite value
                            mn = mx = np.float32(0.0)
                        s = max(mx / qmax - mn / qmax, max(mn / room, -mn / (qmax + room)))
                        scales[at] = cast_up(s, scale_code, tiny, big)
                        zf = min(max(np.rint(-mn / from_half(scales[at], scale_code)),
                                     -room), qmax + room)
                        zeros[at] = to_half(zf, scale_code)
                scale = load_scale(scales, scale_code, at)
                zero = load_scale(zeros, scale_code, at) if has_zero else offset
                for c in range(gs):
                    xv = xs[c]
                    nan = xv != xv
                    v = (np.float32(0.0) if nan else xv) / scale  # divide, not multiply: ties
                    v = v if code == FP8 else v + np.float32(zero)  # fp8 keeps -0.0's sign
                    count += nan or (not mse and (v < lo - slack or v > hi + slack))
                    v = min(max(v, lo), hi)
                    out[g * gs + c] = to_fp8(v) if code == FP8 else np.int64(np.rint(v))
            for e in range(D // pb):  # element pb*e + j at bit j * (8 // pb)
                b = 0
                for j in range(pb):
                    b |= (out[e * pb + j] & 0xFF) << (j * 8 // pb)
                codes[row, e] = b
    return count


@kernel(error_model="numpy")
def compiled_store_pair(k_rows, v_rows, blk, off, k_fmt, k_pool, k_limits, k_dynamic, k_clips,
                        v_fmt, v_pool, v_limits, v_dynamic, v_clips, BS):
    """compiled_store of a layer's keys, then of its values, in one call (a decode step's
    direct path: one dispatch, and blk, off and BS unboxed once, for both)."""
    return (compiled_store(k_rows, blk, off, k_fmt, k_pool, BS, k_limits, k_dynamic, k_clips)
            + compiled_store(v_rows, blk, off, v_fmt, v_pool, BS, v_limits, v_dynamic, v_clips))


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
                              args.limits, args.dynamic, args.clips))
