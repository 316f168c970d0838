"""The fused CPU quantize-on-store kernel (numba): quant.compute_scales + quant.quantize in one
pass over the new tokens, op for op, so its codes and scales match the torch reference bit for
bit (reference.quantize_store_ref)."""

from __future__ import annotations

import numpy as np
import torch

from ..quant import zero_room
from ..spec import FP8_MAX, QuantParams
from .cpu_numerics import (
    AVAILABLE,
    BF16,
    F32,
    FP8,
    REASON,
    _c,
    _cast_up,
    _half,
    _load,
    _pool,
    _to_fp8,
    _to_half,
    njit,
)
from .layout import PoolLayer


@njit(cache=True)
def _store_kernel(x, blk, off, sp, qmax, lo, hi, slack, room, tiny, big, dynamic):
    """Quantize x (n, H, D) float32 into the pool `sp` at rows (blk[i], h, off[i]), op for op as
    quant.compute_scales + quant.quantize; returns the count of saturated values and NaNs.
    Serial: a decode step stores a few rows, and waking threads would cost more than the work."""
    d8, d16, d32, s16, s32, z16, z32, meta = sp
    n, H, D = x.shape
    fmt, kind, has_zero, G, gs, dp = meta[0], meta[1], meta[2], meta[4], meta[5], meta[6]
    offset = np.float32(meta[3]) / np.float32(2)  # meta holds it in half steps
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
                zero = _load(z16, z32, kind, si) if has_zero else offset
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
    scale_dtype = torch.float16 if scale is None else scale.dtype
    fi = torch.finfo(scale_dtype)
    fp8 = p.dtype == "fp8"
    lo, hi = (-FP8_MAX, FP8_MAX) if fp8 else (p.qmin + p.offset, p.qmax + p.offset)
    room = zero_room(p, scale_dtype)
    pool = _pool(PoolLayer(data, scale, zero, p), H, BS, D)
    if n == 0:
        return 0
    f32 = [np.float32(c) for c in (p.qmax, lo, hi, 0.0 if fp8 else 0.5, room, fi.tiny, fi.max)]
    return int(_store_kernel(x.float().contiguous().numpy(), _c(blk, np.int64), _c(off, np.int64),
                             pool, *f32, dynamic))
