"""The Triton quantize-on-store kernel: quant.compute_scales + quant.quantize for each new token,
op for op, so its codes match the torch reference (reference.quantize_store_ref) bit for bit. The
storage KINDs and argument packing are triton.py's."""

from __future__ import annotations

import torch

from .. import quant
from ..quant import MSE_CLIP_DIVISOR, MSE_CLIPS, zero_room
from ..spec import FP8_MAX, QuantParams
from .layout import PoolLayer
from .triton import _i32, _jit, _pool_args, tl, triton

# quant.MSE_CLIPS, as a kernel may read them: clip i is 1 - i / _CLIP_DIVISOR, rounded to float32
_N_CLIPS = tl.constexpr(len(MSE_CLIPS))
_CLIP_DIVISOR = tl.constexpr(MSE_CLIP_DIVISOR)


@_jit
def _rint(x):
    """Round half to even like torch.round, from floor: exact, whatever the compiler's flags."""
    f = tl.floor(x)
    odd = f - 2.0 * tl.floor(f * 0.5) == 1.0
    up = (x - f > 0.5) | ((x - f == 0.5) & odd)
    return f + tl.where(up, 1.0, 0.0)


@_jit
def _cast_up(s, tiny, big, DT: tl.constexpr):
    """Positive float32 -> 16-bit float dtype DT, rounding up, never down, like quant.cast_up."""
    s = tl.minimum(tl.maximum(s, tiny), big)
    c = s.to(DT)  # nearest
    up = (c.to(tl.int16, bitcast=True) + 1).to(tl.int16).to(DT, bitcast=True)  # next larger
    return tl.where(c.to(tl.float32) < s, up, c)


@_jit
def _fp8_bits(v):
    """float32 in [-448, 448] -> e4m3fn bits (int32), rounding to nearest even like torch's cast."""
    u = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    # Round the mantissa to 3 bits (ties to even), then rebias the exponent from 127 to 7.
    normal = (((u & 0x7FFFFFFF) + 0x7FFFF + ((u >> 20) & 1)) >> 20) - (120 << 3)
    sub = _rint(a * 512.0).to(tl.int32)  # below 2^-6 e4m3 values are multiples of 2^-9
    sign = (u >> 24) & 0x80
    return tl.where(a < 0.015625, sub, normal) | sign


@_jit
def _least_error_scale(xv, in_g, use, amax, qmax, offset, code_min, code_max, tiny, big,
                       DT: tl.constexpr):
    """quant._least_error_scales for the groups of one row: per group (GP,), the scale in DT among
    cast_up(amax * clip / qmax), clip in MSE_CLIPS, whose round trip loses the least squared
    error over the values `use` marks (float64 sums; the first of equals kept)."""
    best = tl.zeros_like(amax).to(DT)  # (GP,) replaced at the first clip: errors are finite
    least = tl.full(amax.shape, float("inf"), tl.float64)  # (GP,)
    for i in tl.static_range(_N_CLIPS):
        clip = 1 - i / _CLIP_DIVISOR  # a constant, float32 in the product
        sc = _cast_up(tl.math.div_rn(amax * clip, qmax), tiny, big, DT)  # (GP,)
        s_el = tl.sum(tl.where(in_g, sc.to(tl.float32)[:, None, None], 0.0), 0)  # (CP, PB)
        v = tl.math.div_rn(xv, tl.where(use, s_el, 1.0)) + offset  # (CP, PB)
        code = _rint(tl.minimum(tl.maximum(v, code_min), code_max))  # (CP, PB)
        lost = ((code - offset) * s_el).to(tl.float64) - xv.to(tl.float64)  # (CP, PB)
        lost = tl.where(use, lost, 0.0)
        err = tl.sum(tl.sum(tl.where(in_g, (lost * lost)[None], 0.0), 2), 1)  # (GP,)
        better = err < least
        best = tl.where(better, sc, best)
        least = tl.where(better, err, least)
    return best


@_jit
def _fitted_scale(xv, in_g, use, sc, offset, code_min, code_max, tiny, big, DT: tl.constexpr):
    """One step of quant._least_error_scales's fit, for the groups of one row: per group (GP,),
    sum(x^2) / sum(x * steps), the steps of the values `use` marks at the scales sc, rounded up
    to sc's dtype (float64 sums); sc where no step correlates with its group."""
    s_el = tl.sum(tl.where(in_g, sc.to(tl.float32)[:, None, None], 0.0), 0)  # (CP, PB)
    x = tl.where(use, xv, 0.0)  # (CP, PB)
    v = tl.math.div_rn(x, tl.where(use, s_el, 1.0)) + offset  # (CP, PB)
    step = _rint(tl.minimum(tl.maximum(v, code_min), code_max)) - offset  # (CP, PB)
    along = tl.sum(tl.sum(tl.where(in_g, (x.to(tl.float64) * step.to(tl.float64))[None], 0.0),
                          2), 1)  # (GP,)
    energy = tl.sum(tl.sum(tl.where(in_g, (x.to(tl.float64) * x.to(tl.float64))[None], 0.0),
                           2), 1)  # (GP,)
    ratio = tl.where(along > 0.0, energy / tl.where(along > 0.0, along, 1.0), 1.0)  # (GP,)
    fitted = _cast_up(ratio.to(tl.float32), tiny, big, DT)  # (GP,)
    return tl.where(along > 0.0, fitted, sc)


@_jit
def _store_kernel(
        x, x_stride_n, x_stride_head, blk_ids, offs, count,
        qmax, code_min, code_max, slack, zero_room, scale_tiny, scale_big,
        data, scale, zero, stride_block, stride_head, stride_token,
        scale_stride_block, scale_stride_head, scale_stride_token, scale_stride_group,
        offset,
        KIND: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, DYNAMIC: tl.constexpr,
        MSE: tl.constexpr, FIT_STEPS: tl.constexpr,
        GROUP_SIZE: tl.constexpr, PB: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
        D: tl.constexpr, CP: tl.constexpr):
    """Token i, head h: quantize one row of D channels and store its codes (and scales)."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.load(blk_ids + i).to(tl.int64)  # () the token's block; int64 for large pools
    tok = tl.load(offs + i)  # () its row within the block
    e = tl.arange(0, CP)  # (CP,) stored elements of the row (bytes of packed codes)
    j = tl.arange(0, PB)[None, :]  # (1, PB) code within a byte
    ch = e[:, None] * PB + j  # (CP, PB) channel
    in_row = ch < D  # (CP, PB)
    xv = tl.load(x + i * x_stride_n + h * x_stride_head + ch, mask=in_row, other=0)
    xv = xv.to(tl.float32)  # (CP, PB)
    dst = data + blk * stride_block + h * stride_head + tok * stride_token  # () the slot's row
    if KIND == 0:
        tl.store(dst + ch, xv.to(data.dtype.element_ty), mask=in_row)
    else:
        gid = ch // GROUP_SIZE  # (CP, PB) group of each channel
        # () the slot's scales; static ones have block and token strides 0
        s_at = blk * scale_stride_block + h * scale_stride_head + tok * scale_stride_token
        if DYNAMIC:  # quant.compute_scales for one token, op for op: codes match bit for bit
            g = tl.arange(0, GP)  # (GP,) groups; g >= G pads
            in_g = gid[None] == g[:, None, None]  # (GP, CP, PB)
            finite = tl.abs(xv) < float("inf")  # (CP, PB) NaN and Inf take no part in scales
            sel = in_g & in_row[None] & finite[None]  # (GP, CP, PB)
            if HAS_ZERO:
                mn = tl.min(tl.min(tl.where(sel, xv[None], float("inf")), 2), 1)  # (GP,)
                mx = tl.max(tl.max(tl.where(sel, xv[None], float("-inf")), 2), 1)  # (GP,)
                empty = mn > mx  # (GP,) no finite value: the range is [0, 0]
                mn = tl.where(empty, 0.0, mn)
                mx = tl.where(empty, 0.0, mx)
                span = tl.math.div_rn(mx, qmax) - tl.math.div_rn(mn, qmax)  # (GP,)
                reach = tl.maximum(tl.math.div_rn(mn, zero_room),
                                   tl.math.div_rn(-mn, qmax + zero_room))  # (GP,)
                s = tl.maximum(span, reach)  # (GP,)
                sc = _cast_up(s, scale_tiny, scale_big, scale.dtype.element_ty)  # (GP,)
            else:
                amax = tl.max(tl.max(tl.where(sel, tl.abs(xv)[None], 0.0), 2), 1)  # (GP,)
                if MSE:
                    sc = _least_error_scale(xv, in_g, in_row & finite, amax, qmax, offset,
                                            code_min, code_max, scale_tiny, scale_big,
                                            scale.dtype.element_ty)  # (GP,)
                    for _ in tl.static_range(FIT_STEPS):
                        sc = _fitted_scale(xv, in_g, in_row & finite, sc, offset, code_min,
                                           code_max, scale_tiny, scale_big,
                                           scale.dtype.element_ty)  # (GP,)
                else:
                    s = tl.math.div_rn(amax, qmax)  # (GP,)
                    sc = _cast_up(s, scale_tiny, scale_big, scale.dtype.element_ty)  # (GP,)
            tl.store(scale + s_at + g * scale_stride_group, sc, mask=g < G)
            s_el = tl.sum(tl.where(in_g, sc.to(tl.float32)[:, None, None], 0.0), 0)  # (CP, PB)
            if HAS_ZERO:
                z = _rint(tl.math.div_rn(-mn, sc.to(tl.float32)))  # (GP,)
                z = tl.minimum(tl.maximum(z, -zero_room), qmax + zero_room)  # (GP,)
                tl.store(zero + s_at + g * scale_stride_group, z.to(zero.dtype.element_ty),
                         mask=g < G)
                z_el = tl.sum(tl.where(in_g, z[:, None, None], 0.0), 0)  # (CP, PB)
        else:
            s_ptr = scale + s_at + gid * scale_stride_group  # (CP, PB)
            s_el = tl.load(s_ptr, mask=in_row, other=1.0).to(tl.float32)  # (CP, PB)
            if HAS_ZERO:
                z_ptr = zero + s_at + gid * scale_stride_group  # (CP, PB)
                z_el = tl.load(z_ptr, mask=in_row, other=0.0).to(tl.float32)  # (CP, PB)
        nan = xv != xv  # (CP, PB)
        # Divide, not multiply by the inverse: ties land exactly where torch's land.
        v = tl.math.div_rn(tl.where(nan, 0.0, xv), tl.where(in_row, s_el, 1.0))  # (CP, PB)
        if KIND == 1:  # not for fp8, where -0.0 + 0.0 would lose the sign torch's cast keeps
            if HAS_ZERO:
                v = v + z_el
            else:
                v = v + offset
        if MSE:  # its scales clip by choice: only NaNs count
            sat = nan & in_row  # (CP, PB)
        else:
            sat = (nan | (v < code_min - slack) | (v > code_max + slack)) & in_row  # (CP, PB)
        tl.atomic_add(count, tl.sum(tl.sum(sat.to(tl.int32), 1), 0))
        v = tl.minimum(tl.maximum(v, code_min), code_max)  # (CP, PB)
        if KIND == 2:
            codes = _fp8_bits(v)  # (CP, PB)
        else:
            codes = _rint(v).to(tl.int32)  # (CP, PB)
        if PB > 1:
            packed = tl.sum(codes << (j * BITS), 1).to(tl.uint8)  # (CP,) bytes
            tl.store(dst + e, packed, mask=e < D // PB)
        else:
            tl.store(dst + ch, codes.to(data.dtype.element_ty), mask=in_row)


def _store_args(x: torch.Tensor, p: QuantParams, data: torch.Tensor, scale: torch.Tensor | None,
                zero: torch.Tensor | None, blk: torch.Tensor, off: torch.Tensor,
                count: torch.Tensor) -> dict:
    """Every argument of _store_kernel, by name, layouts checked."""
    (n, H, D), BS = x.shape, data.shape[2]
    G = 1 if scale is None else scale.shape[-1]
    pa = _pool_args(PoolLayer(data, scale, zero, p), H, BS, D, "store")
    assert not p.block_wise, f"{p}: block-wise scales are computed when a block fills"
    assert x.stride(-1) == 1 and blk.shape == off.shape == (n,), "x (n, H, D), blk and off (n,)"
    per_slot = scale is None or (scale.shape[::2] == data.shape[::2] and scale.dtype.itemsize == 2)
    assert p.static or per_slot, "dynamic scales are stored per slot, (NB, H, BS, G), in 16 bits"
    scale_dtype = torch.float16 if scale is None else scale.dtype
    fi = torch.finfo(scale_dtype)
    if p.dtype == "fp8":
        code_min, code_max = -FP8_MAX, FP8_MAX
    elif p.sym:
        code_min, code_max = p.qmin + p.offset, p.qmax + p.offset
    else:
        code_min, code_max = 0, p.qmax
    return dict(
        x=x, x_stride_n=x.stride(0), x_stride_head=x.stride(1), blk_ids=_i32(blk),
        offs=_i32(off), count=count, qmax=float(p.qmax),
        code_min=float(code_min), code_max=float(code_max),
        slack=0.0 if p.dtype == "fp8" else 0.5,  # saturated: more than half a step outside
        zero_room=float(zero_room(p, scale_dtype)),
        scale_tiny=fi.tiny, scale_big=fi.max,
        **{name: value for name, value in pa.kernel_args().items() if name != "STATIC"},
        DYNAMIC=not p.static, MSE=p.clips, FIT_STEPS=quant.FIT_STEPS if p.fit else 0,
        PB=p.per_byte, G=G, GP=triton.next_power_of_2(G), D=D,
        CP=triton.next_power_of_2(D // p.per_byte))


def quantize_store_triton(x: torch.Tensor, p: QuantParams, data: torch.Tensor,
                          scale: torch.Tensor | None, zero: torch.Tensor | None, blk: torch.Tensor,
                          off: torch.Tensor) -> torch.Tensor:
    """quantize_store_ref in one kernel launch: one program per (token, head)."""
    assert triton is not None, "quantize_store_triton needs Triton (Linux); use quantize_store_ref"
    count = torch.zeros((), dtype=torch.int32, device=x.device)
    args = _store_args(x, p, data, scale, zero, blk, off, count)
    if x.shape[0]:
        _store_kernel[(x.shape[0], x.shape[1])](**args)
    return count


# ---- ahead-of-time compilation ---------------------------------------------------------------
