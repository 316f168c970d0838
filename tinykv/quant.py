"""KV-cache quantization for tinykv: scales, quantize and dequantize, int4/int2 packing, fp8
(e4m3) and the `:rot` / `:center` / `:smooth` transforms (the spec string is spec.py).

Every tensor is shaped (..., H, T, D): heads, tokens, channels last. Scales and zero points
are shaped (..., H|1, T|1, G) where channel c belongs to group c // (D // G), so one formula
dequantizes every granularity: x = (q - zero) * scale. Symmetric formats have no zero
tensor; the constant `offset` takes its place (sym int4/int2 codes are stored unsigned; sym int2
is midrise, offset 1.5: its four codes are -1.5, -0.5, 0.5 and 1.5 steps).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from .spec import FP8_MAX, KVSpec, QuantParams, SpecError

# The fractions of a group's absmax that an `mse` format tries as its clip (formats.QuantParams),
# largest first (a tie keeps the larger): float32, as every store multiplies by them.
MSE_CLIP_DIVISOR = 20  # clip i is 1 - i / MSE_CLIP_DIVISOR
MSE_CLIPS = tuple(float(torch.tensor(1 - i / MSE_CLIP_DIVISOR, dtype=torch.float32))
                  for i in range(13))
# How many times a `fit` scale is fitted again to the steps it gives (README: 1, 4, 12 measured).
FIT_STEPS = 4

# Dims reduced over the grouped view (..., H, T, G, D // G); the last one is squeezed afterwards.
_REDUCE = {"token": (-1,), "group": (-1,), "channel": (-3, -1), "head": (-3, -1),
           "tensor": (-4, -3, -1)}


def rotation_matrix(head_dim: int, seed: int) -> torch.Tensor:
    """A seeded orthogonal (head_dim, head_dim) float32 matrix R: x @ R spreads an outlier
    channel's energy over all channels, so a per-token scale wastes less range.

    A power-of-two head_dim gets a randomized Hadamard, H diag(random signs) / sqrt(n): every
    entry is +-1/sqrt(n), so it spreads evenly (the transform llama.cpp and QuaRot use). Any
    other size (80, 96) gets a random orthogonal matrix (QR of a Gaussian), which mixes every
    channel too; a block-diagonal Hadamard would only mix within blocks.
    """
    gen = torch.Generator().manual_seed(seed)
    n = head_dim
    if n & (n - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:  # Sylvester: [[H, H], [H, -H]]
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1
        return (signs[:, None] * h / math.sqrt(n)).float()  # diag(signs) @ H, orthogonal
    g = torch.randn(n, n, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(g)
    return (q * torch.sign(torch.diagonal(r))).float()  # signs fixed: a unique, seeded Q


class HeadMap(NamedTuple):
    """One affine map of rows (N, J, D): row j becomes x_j @ maps[j // (J / G)] + bias[j // (J /
    Hb)], so a group of heads (GQA: a KV head's query heads) shares a map or a bias. maps (G, D,
    D), bias (Hb, D); G or Hb 0: none. Applied by head_map_ref, or kernels.cpu_maps."""
    maps: torch.Tensor
    bias: torch.Tensor

    @property
    def identity(self) -> bool:
        return self.maps.shape[0] == 0 and self.bias.shape[0] == 0


def head_map_ref(x: torch.Tensor, m: HeadMap) -> torch.Tensor:
    """x (..., J, D) through the map m (HeadMap), in torch."""
    if m.maps.shape[0]:
        x = (x.unflatten(-2, (m.maps.shape[0], -1)) @ m.maps).flatten(-3, -2)  # (..., J, D)
    if m.bias.shape[0]:
        x = (x.unflatten(-2, (m.bias.shape[0], -1)) + m.bias[:, None]).flatten(-3, -2)
    return x


class TransformMaps(NamedTuple):
    """A Transform folded into one HeadMap for each of what it turns."""
    queries: HeadMap
    keys: HeadMap
    values: HeadMap
    output: HeadMap


@dataclass
class Transform:
    """How one layer's keys, queries and values enter the cache and its attention output leaves,
    outside the kernels (so every kernel serves it unchanged); a field is None where the spec
    asks for nothing.

    Centering (`:center`) subtracts a calibrated per-channel mean from keys and values before
    they are stored. Scores move by q . mu_k, the same for every key of a query, and softmax
    ignores a shift common to a row, so attention is unchanged; the output comes back with mu_v
    added, since probabilities sum to 1. On this model the key mean holds half of the keys'
    energy (a bias per channel, not a spread), so without it a per-token scale spends most of
    its range on the mean. Rotation (`:rot`) turns centered keys and the queries by one
    orthogonal R_k (q R . k R = q . k), and values by R_v, turned back in the output.

    Smoothing (`:smooth`) maps each head's centered keys by a calibrated invertible S, before
    R_k, and its queries by S^-T (q S^-T . k S = q . k). A per-token scale spreads error evenly
    over the stored channels, so S decides where the error lands: calibrate.smooth_maps picks
    the S that makes the expected score error E[(q . err)^2] smallest, which moves it to the
    directions queries look along least.

    Each of the four is one affine map per head (`maps`, folded in float64 once): keys k S R -
    mu_k S R, queries q S^-T R, values v R_v - mu_v R_v, the output o R_v^T + mu_v; a decode
    step's few rows pay per op, not per multiply-add. `apply`: head_map_ref, or the cache's
    kernels' (kernels.Kernels.head_map)."""

    rk: torch.Tensor | None = None  # (D, D)
    rv: torch.Tensor | None = None  # (D, D)
    mk: torch.Tensor | None = None  # (H, D): subtracted from keys
    mv: torch.Tensor | None = None  # (H, D): subtracted from values, added to the output
    sk: torch.Tensor | None = None  # (H, D, D): S, applied to keys
    sq: torch.Tensor | None = None  # (H, D, D): S^-T, applied to the queries of head h

    def queries(self, q: torch.Tensor, apply: Callable = head_map_ref) -> torch.Tensor:
        """q (..., Hq, D) as the kernels meet it."""
        return q if self.maps.queries.identity else apply(q, self.maps.queries)

    def keys(self, k: torch.Tensor, apply: Callable = head_map_ref) -> torch.Tensor:
        """k (N, H, D) as the cache stores it."""
        return k if self.maps.keys.identity else apply(k, self.maps.keys)

    def values(self, v: torch.Tensor, apply: Callable = head_map_ref) -> torch.Tensor:
        """v (N, H, D) as the cache stores it."""
        return v if self.maps.values.identity else apply(v, self.maps.values)

    def output(self, o: torch.Tensor, apply: Callable = head_map_ref) -> torch.Tensor:
        """o (N, Hq, D) over stored values -> the attention output over the model's values."""
        return o if self.maps.output.identity else apply(o, self.maps.output)

    @cached_property
    def maps(self) -> TransformMaps:
        """The four maps, folded from the fields in float64 when first used."""
        fields = (self.rk, self.rv, self.mk, self.mv, self.sk, self.sq)
        rk, rv, mk, mv, sk, sq = (None if t is None else t.double() for t in fields)
        like = next((t for t in fields if t is not None), torch.zeros(1, 1))  # dtype, device
        D = like.shape[-1]

        def head_map(maps, bias):  # none as empty tensors
            maps = torch.zeros(0, D, D) if maps is None else maps
            bias = torch.zeros(0, D) if bias is None else bias
            return HeadMap(maps.to(like).contiguous(), bias.to(like).contiguous())  # like's

        def then_rotate(m, r):  # m (H, D, D) or None, then r (D, D) or None
            return m if r is None else r[None] if m is None else m @ r

        k_map = then_rotate(sk, rk)  # (H | 1, D, D)
        k_bias = None
        if mk is not None:  # -(mu_k S R), each head's
            k_bias = -mk if k_map is None else -(mk[:, None, :] @ k_map).squeeze(-2)
        v_bias = None if mv is None else -(mv if rv is None else mv @ rv)
        return TransformMaps(queries=head_map(then_rotate(sq, rk), None),
                             keys=head_map(k_map, k_bias),
                             values=head_map(then_rotate(None, rv), v_bias),
                             output=head_map(None if rv is None else rv.T[None], mv))

    @property
    def identity(self) -> bool:
        """Whether it leaves keys, queries, values and outputs as they are."""
        return all(t is None for t in (self.rk, self.rv, self.mk, self.mv, self.sk, self.sq))

    def to(self, device: torch.device | str, dtype: torch.dtype) -> Transform:
        moved = [None if t is None else t.to(device, dtype) for t in
                 (self.rk, self.rv, self.mk, self.mv, self.sk, self.sq)]
        return Transform(*moved)


def layer_transforms(spec: KVSpec, n_layers: int, head_dim: int,
                     centers: dict[str, torch.Tensor] | None = None) -> list[Transform]:
    """One Transform per layer for its parts' `:rot`, `:center` and `:smooth` (nothing for
    skipped layers). Rotations are seeded by layer, so a cache and its calibration agree; the
    means are centers["k_center"] / ["v_center"] (L, H, D) and the smoothing maps
    centers["k_smooth"] (L, H, D, D), from the scale file."""
    parts = spec.layer_parts(n_layers)
    wanted = [("k_center", any(k.center for k, _ in parts), "centers k: its means"),
              ("v_center", any(v.center for _, v in parts), "centers v: its means"),
              ("k_smooth", any(k.smooth for k, _ in parts), "smooths k: its maps")]
    for name, asked, what in wanted:
        if asked and (centers is None or name not in centers):
            raise SpecError(f"KV spec '{spec}' {what} come from a calibration file "
                            "(tinykv calibrate)")
    out = []
    for layer, (kp, vp) in enumerate(parts):
        t = Transform()
        if kp.rot:
            t.rk = rotation_matrix(head_dim, 2 * layer)
        if vp.rot:
            t.rv = rotation_matrix(head_dim, 2 * layer + 1)
        if kp.center:
            t.mk = centers["k_center"][layer]
        if vp.center:
            t.mv = centers["v_center"][layer]
        if kp.smooth:
            s = centers["k_smooth"][layer].double()  # (H, D, D)
            t.sk = s.float()
            t.sq = torch.linalg.inv(s).transpose(-1, -2).float()
        out.append(t)
    return out


def pack(codes: torch.Tensor, per_byte: int) -> torch.Tensor:
    """uint8 codes (..., D) -> (..., D // per_byte): element per_byte*i + j goes to bit j * bits
    of byte i (the bit fields never overlap, so a sum is an or)."""
    c = codes.unflatten(-1, (-1, per_byte))  # (..., D // per_byte, per_byte)
    return sum(c[..., j] << (j * 8 // per_byte) for j in range(per_byte))


def unpack(stored: torch.Tensor, per_byte: int) -> torch.Tensor:
    """Inverse of pack: uint8 (..., D // per_byte) -> codes (..., D)."""
    if per_byte == 1:
        return stored
    bits = 8 // per_byte
    mask = (1 << bits) - 1
    fields = [(stored >> (j * bits)) & mask for j in range(per_byte)]
    return torch.stack(fields, -1).flatten(-2)  # (..., D)


def cast_up(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Round up, never down: a scale rounded down would clip the group's extreme values.
    fi = torch.finfo(dtype)
    s = s.clamp(fi.tiny, fi.max)
    c = s.to(dtype)
    return torch.where(c.float() < s, torch.nextafter(c, torch.full_like(c, fi.max)), c)


def compute_scales(x: torch.Tensor, p: QuantParams, scale_dtype: torch.dtype = torch.float16
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Dynamic absmax (sym) or min/max (asym) scales of x (..., H, T, D) -> (scale, zero | None).

    NaN/Inf are ignored; an all-zero group gets the smallest normal scale; scales are rounded up
    to scale_dtype, so every finite value is within half a step. Plain-cast dtypes: (None, None).
    """
    if p.is_float:
        return None, None
    xg = x.float().unflatten(-1, (p.ngroups(x.shape[-1]), -1))  # (..., H, T, G, D // G)
    dims, fin = _REDUCE[p.gran], xg.isfinite()
    room = zero_room(p, scale_dtype)
    # Tensor divisors: CUDA torch multiplies by a Python number's reciprocal (a bit off at times).
    qmax, room_t, qmax_room_t = (xg.new_full((), d) for d in (p.qmax, room, p.qmax + room))
    if p.sym:
        amax = xg.abs().where(fin, 0.0).amax(dims, keepdim=True).squeeze(-1)
        if p.clips:
            return _least_error_scales(xg, fin, amax, p, scale_dtype), None
        return cast_up(amax / qmax, scale_dtype), None
    mn = xg.where(fin, float("inf")).amin(dims, keepdim=True).squeeze(-1)
    mx = xg.where(fin, float("-inf")).amax(dims, keepdim=True).squeeze(-1)
    empty = mn > mx  # no finite value in the group
    mn, mx = mn.masked_fill(empty, 0.0), mx.masked_fill(empty, 0.0)
    # Divide before subtracting so huge ranges cannot overflow.
    s = torch.maximum(mx / qmax - mn / qmax, torch.maximum(mn / room_t, -mn / qmax_room_t))
    scale = cast_up(s, scale_dtype)
    zero = (-mn / scale.float()).round().clamp(-room, p.qmax + room)
    return scale, zero.to(scale_dtype)


def _least_error_scales(xg: torch.Tensor, fin: torch.Tensor, amax: torch.Tensor, p: QuantParams,
                        scale_dtype: torch.dtype) -> torch.Tensor:
    """Per group, the scale among cast_up(amax * clip / qmax), clip in MSE_CLIPS, whose round trip
    loses the least squared error over the group's finite values (summed in float64, so every
    store sums the same errors to the same choice), fitted for `fit`; xg (..., G, D // G), amax
    (..., G)."""
    lo, hi = p.qmin + p.offset, p.qmax + p.offset
    x = xg.where(fin, 0.0)  # (..., G, D // G) non-finite values take no part in the error
    best, least = None, None
    clip_t, qmax = amax.new_tensor(MSE_CLIPS), amax.new_full((), p.qmax)  # exact: compute_scales
    for i in range(len(MSE_CLIPS)):
        scale = cast_up(amax * clip_t[i] / qmax, scale_dtype)  # (..., G)
        s = scale.float().unsqueeze(-1)  # (..., G, 1)
        codes = (x / s + p.offset).round().clamp(lo, hi)  # as quantize stores them
        lost = (((codes - p.offset) * s).double() - x.double()).where(fin, 0.0)  # (..., G, D//G)
        err = lost.square().sum(-1)  # (..., G)
        if best is None:
            best, least = scale, err
            continue
        better = err < least
        best, least = torch.where(better, scale, best), torch.where(better, err, least)
    # fit (formats.QuantParams says why): s = sum(x^2) / sum(x * steps at s), rounded up, FIT_STEPS
    # times from best; s stays where no step correlates with x (all zero)
    energy = x.double().square().sum(-1) if p.fit else None  # (..., G)
    for _ in range(FIT_STEPS if p.fit else 0):
        steps = (x / best.float().unsqueeze(-1) + p.offset).round().clamp(lo, hi) - p.offset
        along = (x.double() * steps.double()).sum(-1)  # (..., G)
        fitted = cast_up((energy / along).float(), scale_dtype)
        best = torch.where(along > 0, fitted, best)
    return best


def zero_room(p: QuantParams, scale_dtype: torch.dtype = torch.float16) -> int:
    """How far an asym zero point may leave [0, qmax], either way: far enough that a group far from
    0 (a KIVI key channel) keeps its resolution, near enough that the zero stays an integer the
    scale dtype holds exactly (x / scale + zero stays exact to ~2^-12 step in fp32). Every store
    (compute_scales, the CPU and Triton kernels) clamps zero points with it."""
    return min(round(2 / torch.finfo(scale_dtype).eps), 2048) - p.qmax


def _zero_point(p: QuantParams, zero: torch.Tensor | None) -> torch.Tensor | int:
    assert p.sym or zero is not None, f"{p} needs a zero point"
    return p.offset if p.sym else zero.float().unsqueeze(-1)


def quantize(x: torch.Tensor, p: QuantParams, scale: torch.Tensor | None,
             zero: torch.Tensor | None, count: bool = True) -> tuple[torch.Tensor, int]:
    """Quantize x (..., H, T, D) with the given (already cast) scale/zero -> (stored, n_saturated).

    n_saturated counts values more than half a step outside the representable range (clamped;
    not for an mse format, whose scales clip by choice) and NaNs (stored as the code of 0); for
    float formats, finite values that overflow to inf. count=False skips counting, which syncs
    the device.
    """
    if p.is_float:
        q = x.to(p.storage_dtype)
        if not count or p.dtype == "fp32":
            return q, 0
        return q, int((q.isinf() & x.isfinite()).sum())
    assert scale is not None, f"{p} needs a scale"
    xg = x.float().unflatten(-1, (scale.shape[-1], -1))  # (..., H, T, G, D // G)
    nan = xg.isnan()
    v = xg.masked_fill(nan, 0.0) / scale.float().unsqueeze(-1)  # divide, not multiply: exact ties
    if p.dtype == "fp8":
        sat = v.abs() > FP8_MAX
        q = v.clamp(-FP8_MAX, FP8_MAX).flatten(-2).to(torch.float8_e4m3fn)
    else:
        v = v + _zero_point(p, zero)
        lo, hi = p.qmin + p.offset, p.qmax + p.offset
        # An mse or fit scale clips its group's extremes by design: only NaNs count there.
        sat = torch.zeros_like(nan) if p.clips else (v < lo - 0.5) | (v > hi + 0.5)
        codes = v.round().clamp(lo, hi).flatten(-2)  # (..., H, T, D)
        if p.storage_dtype == torch.int8:
            q = codes.to(torch.int8)
        else:
            q = pack(codes.to(torch.uint8), p.per_byte)
    return q, int((sat | nan).sum()) if count else 0


def dequantize(stored: torch.Tensor, p: QuantParams, scale: torch.Tensor | None,
               zero: torch.Tensor | None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpack and apply x = (q - zero) * scale; scale/zero may be expanded (stride-0) views."""
    if p.is_float:
        return stored.to(out_dtype)
    assert scale is not None, f"{p} needs a scale"
    q = unpack(stored, p.per_byte).float().unflatten(-1, (scale.shape[-1], -1))
    if zero is not None or p.offset:  # signed int8 codes need no shift: skip a full-size pass
        q = q - _zero_point(p, zero)
    return (q * scale.float().unsqueeze(-1)).flatten(-2).to(out_dtype)

