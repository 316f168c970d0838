"""KV-cache quantization for tinykv: the KV spec string (parse/str), scales, quantize and
dequantize, int4/int2 packing and fp8 (e4m3), all of it in this single file.

Every tensor is shaped (..., H, T, D): heads, tokens, channels last. Scales and zero points
are shaped (..., H|1, T|1, G) where channel c belongs to group c // (D // G), so one formula
dequantizes every granularity: x = (q - zero) * scale. Symmetric formats have no zero
tensor; the constant `offset` takes its place (sym int4/int2 codes are stored unsigned).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8", "int4", "int2")
GRANS = ("tensor", "head", "channel", "token")  # plus gN, held as gran="group", group=N
_FLOAT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4, "int2": 2}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Dims reduced over the grouped view (..., H, T, G, D // G); the last one is squeezed afterwards.
_REDUCE = {"token": (-1,), "group": (-1,), "channel": (-3, -1), "head": (-3, -1), "tensor": (-4, -3, -1)}


class SpecError(ValueError):
    """A malformed KV spec; the message is one line naming the bad part."""


def _fail(spec: str, why: str, part: str | None = None) -> SpecError:
    return SpecError(f"bad KV spec {spec!r}: {why}" + (f" in {part!r}" if part not in (None, spec) else ""))


def _default_gran(dtype: str) -> str:
    return "token" if dtype.startswith("int") else "tensor"


def _problem(dtype: str, gran: str, group: int, sym: bool, static: bool) -> str | None:
    """Why these fields are no valid format, or None; shared by parse and the constructor."""
    if dtype not in DTYPES:
        return f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})"
    if gran not in GRANS + ("group",) or (gran == "group") != (group > 0):
        return f"bad granularity {gran!r} (expected {'|'.join(GRANS)}|gN with N > 0)"
    if dtype in _FLOAT and (gran, sym, static) != ("tensor", True, False):
        return f"{dtype} is stored by plain cast and takes no options"
    if dtype == "fp8" and not sym:
        return "fp8 supports sym only"
    if static and gran in ("token", "group"):
        return f"static needs tensor/head/channel scales (per-{gran} scales cannot be calibrated)"
    return None


@dataclass(frozen=True)
class QuantParams:
    """How one of K or V is stored. Float dtypes are a plain cast (gran "tensor", sym, dynamic)."""

    dtype: str
    gran: str = ""  # tensor | head | channel | token | group; "" = the dtype's default
    group: int = 0  # channels per group when gran == "group", else 0
    sym: bool = True
    static: bool = False

    def __post_init__(self) -> None:
        if not self.gran:
            object.__setattr__(self, "gran", _default_gran(self.dtype))
        # Every instance is valid and canonical, so str() always round-trips through parse().
        if why := _problem(self.dtype, self.gran, self.group, self.sym, self.static):
            raise _fail(str(self), why)

    @classmethod
    def parse(cls, part: str, spec: str | None = None) -> QuantParams:
        """Parse 'DTYPE[:GRAN][:sym|asym][:static|dynamic]' (no k=/v= prefix)."""
        spec = part if spec is None else spec
        dtype, *opts = (t.strip() for t in part.split(":"))
        if dtype in _FLOAT and opts:
            raise _fail(spec, f"{dtype} is stored by plain cast and takes no options", part)
        kw: dict = {}
        for o in opts:
            key = ("gran" if o in GRANS or o.startswith("g") else "sym" if o in ("sym", "asym")
                   else "static" if o in ("static", "dynamic") else None)
            if key is None:
                raise _fail(spec, f"unknown option {o!r} (expected {'|'.join(GRANS)}|gN, sym|asym or "
                            "static|dynamic)", part)
            if key in kw:
                raise _fail(spec, f"{key} given twice", part)
            kw[key] = o if key == "gran" else o in ("sym", "static")
        gran, group = kw.get("gran", _default_gran(dtype)), 0
        if gran not in GRANS:  # gN
            if not (gran[1:].isascii() and gran[1:].isdigit() and int(gran[1:]) > 0):
                raise _fail(spec, f"bad group size {gran!r} (expected gN with N > 0)", part)
            gran, group = "group", int(gran[1:])
        fields = (dtype, gran, group, kw.get("sym", True), kw.get("static", False))
        if why := _problem(*fields):
            raise _fail(spec, why, part)
        return cls(*fields)

    def __str__(self) -> str:
        out = self.dtype
        if self.gran != _default_gran(self.dtype):
            out += f":g{self.group}" if self.gran == "group" else f":{self.gran}"
        return out + (":asym" if not self.sym else "") + (":static" if self.static else "")

    def check(self, head_dim: int) -> None:
        """Raise SpecError unless rows of head_dim channels fit this format (groups, packing)."""
        if head_dim % max(self.group, 1) or head_dim % self.per_byte:
            raise _fail(str(self), f"head_dim {head_dim} is not a multiple of the group size "
                        f"{self.group} / values per byte {self.per_byte}")

    # Derived properties. qmin/qmax: signed range (sym) or code range (asym); ±448 for fp8.
    is_float = property(lambda self: self.dtype in _FLOAT)
    bits = property(lambda self: _BITS[self.dtype])
    per_byte = property(lambda self: {"int4": 2, "int2": 4}.get(self.dtype, 1))  # values per stored element
    qmin = property(lambda self: -self.qmax if self.sym else 0)
    # Stored code minus offset is the signed value: sym int4/int2 codes are stored unsigned.
    offset = property(lambda self: 2 ** (self.bits - 1) if self.sym and self.per_byte > 1 else 0)

    @property
    def qmax(self) -> int:
        if self.is_float or self.dtype == "fp8":
            return 0 if self.is_float else int(FP8_MAX)
        return 2 ** (self.bits - 1) - 1 if self.sym else 2**self.bits - 1

    @property
    def storage_dtype(self) -> torch.dtype:
        if self.is_float or self.dtype == "fp8":
            return _FLOAT.get(self.dtype, torch.float8_e4m3fn)
        return torch.int8 if self.dtype == "int8" and self.sym else torch.uint8

    @property
    def block_wise(self) -> bool:
        """Scales shared across tokens, computed dynamically: once per cache block, when it fills."""
        return self.gran in ("tensor", "head", "channel") and not self.static and not self.is_float

    def ngroups(self, head_dim: int) -> int:
        return {"group": head_dim // max(self.group, 1), "channel": head_dim}.get(self.gran, 1)

    def scale_shape(self, n_heads: int, tokens: int, head_dim: int) -> tuple[int, int, int] | None:
        """Shape of scale (and zero) for an (n_heads, tokens, head_dim) tensor; None: no scales."""
        if self.is_float:
            return None
        h = 1 if self.gran == "tensor" else n_heads
        return (h, tokens if self.gran in ("token", "group") else 1, self.ngroups(head_dim))


@dataclass(frozen=True)
class KVSpec:
    """A parsed KV spec: how K and V are stored, and how many recent (residual) and first (sink)
    tokens stay in full precision."""

    k: QuantParams
    v: QuantParams
    residual: int = 0
    sink: int = 0

    def __post_init__(self) -> None:
        if min(self.residual, self.sink) < 0:
            raise SpecError(f"bad KV spec {str(self)!r}: residual and sink must be >= 0")

    @classmethod
    def parse(cls, s: str) -> KVSpec:
        parts: dict[str, QuantParams] = {}  # "k"/"v", plus "k="/"v=" once set explicitly
        opts: dict[str, int] = {}
        for item in (t.strip() for t in s.split(",")):
            key, eq, val = (t.strip() for t in item.partition("="))
            if not item:
                raise _fail(s, "empty spec" if not s.strip() else "empty part (stray comma?)")
            if eq and key not in ("k", "v"):
                if key not in ("residual", "sink"):
                    raise _fail(s, f"unknown option {key!r} (expected residual=N or sink=N)", item)
                if key in opts or not (val.isascii() and val.isdigit()):
                    raise _fail(s, f"{key} {'given twice' if key in opts else 'needs an integer >= 0'}", item)
                opts[key] = int(val)
                continue
            if opts:
                raise _fail(s, "options must come after the parts", item)
            targets = (key,) if eq else ("k", "v")
            # A bare part sets both, so it must come first; each k=/v= may then override it once.
            if (not eq and parts) or any(t + "=" in parts for t in targets):
                raise _fail(s, f"{'/'.join(targets)} set twice", item)
            qp = QuantParams.parse(val if eq else item, s)
            parts.update({t: qp for t in targets})
            parts.update({t + "=": qp for t in targets if eq})
        if missing := [t for t in ("k", "v") if t not in parts]:
            raise _fail(s, f"{missing[0]} is never set (add {missing[0]}=DTYPE or a part without k=/v=)")
        return cls(parts["k"], parts["v"], **opts)

    def __str__(self) -> str:
        out = [str(self.k)] if self.k == self.v else [f"k={self.k}", f"v={self.v}"]
        return ",".join(out + [f"{n}={getattr(self, n)}" for n in ("residual", "sink") if getattr(self, n)])

    needs_scales = property(lambda self: self.k.static or self.v.static)  # from a calibration file
    is_float = property(lambda self: self.k.is_float and self.v.is_float)


def pack(codes: torch.Tensor, per_byte: int) -> torch.Tensor:
    """uint8 codes (..., D) -> (..., D // per_byte); element per_byte*i + j lands at bit j * bits."""
    c = codes.unflatten(-1, (-1, per_byte))
    return sum(c[..., j] << (j * 8 // per_byte) for j in range(per_byte))  # bit fields never overlap


def unpack(stored: torch.Tensor, per_byte: int) -> torch.Tensor:
    """Inverse of pack: uint8 (..., D // per_byte) -> codes (..., D)."""
    if per_byte == 1:
        return stored
    bits = 8 // per_byte
    return torch.stack([(stored >> (j * bits)) & ((1 << bits) - 1) for j in range(per_byte)], -1).flatten(-2)


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
    if p.sym:
        amax = xg.abs().where(fin, 0.0).amax(dims, keepdim=True).squeeze(-1)
        return cast_up(amax / p.qmax, scale_dtype), None
    mn = xg.where(fin, float("inf")).amin(dims, keepdim=True).squeeze(-1)
    mx = xg.where(fin, float("-inf")).amax(dims, keepdim=True).squeeze(-1)
    empty = mn > mx  # no finite value in the group
    mn, mx = mn.masked_fill(empty, 0.0), mx.masked_fill(empty, 0.0)
    # zero may leave [0, qmax] by `room` so that a group far from 0 (a KIVI key channel) keeps its
    # resolution, yet stays an integer the scale dtype holds exactly (x / scale + zero stays exact
    # to ~2^-12 step in fp32). Divide before subtracting so huge ranges cannot overflow.
    qmax = p.qmax
    room = min(round(2 / torch.finfo(scale_dtype).eps), 2048) - qmax
    s = torch.maximum(mx / qmax - mn / qmax, torch.maximum(mn / room, -mn / (qmax + room)))
    scale = cast_up(s, scale_dtype)
    zero = (-mn / scale.float()).round().clamp(-room, qmax + room)
    return scale, zero.to(scale_dtype)


def _zero_point(p: QuantParams, zero: torch.Tensor | None) -> torch.Tensor | int:
    assert p.sym or zero is not None, f"{p} needs a zero point"
    return p.offset if p.sym else zero.float().unsqueeze(-1)


def quantize(x: torch.Tensor, p: QuantParams, scale: torch.Tensor | None, zero: torch.Tensor | None,
             count: bool = True) -> tuple[torch.Tensor, int]:
    """Quantize x (..., H, T, D) with the given (already cast) scale/zero -> (stored, n_saturated).

    n_saturated counts values more than half a step outside the representable range (clamped)
    and NaNs (stored as the code of 0). count=False skips counting, which syncs the device.
    """
    if p.is_float:
        return x.to(p.storage_dtype), 0
    assert scale is not None, f"{p} needs a scale"
    xg = x.float().unflatten(-1, (scale.shape[-1], -1))  # (..., H, T, G, D // G)
    nan = xg.isnan()
    v = xg.masked_fill(nan, 0.0) / scale.float().unsqueeze(-1)  # divide, not multiply: exact ties
    if p.dtype == "fp8":
        sat = v.abs() > FP8_MAX
        q = v.clamp(-FP8_MAX, FP8_MAX).flatten(-2).to(torch.float8_e4m3fn)
    else:
        v = v + _zero_point(p, zero)
        lo, hi = (p.qmin + p.offset, p.qmax + p.offset) if p.sym else (0, p.qmax)
        sat = (v < lo - 0.5) | (v > hi + 0.5)
        codes = v.round().clamp(lo, hi).flatten(-2)
        q = codes.to(torch.int8) if p.storage_dtype == torch.int8 else pack(codes.to(torch.uint8), p.per_byte)
    return q, int((sat | nan).sum()) if count else 0


def dequantize(stored: torch.Tensor, p: QuantParams, scale: torch.Tensor | None, zero: torch.Tensor | None,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpack and apply x = (q - zero) * scale; scale/zero may be expanded (stride-0) views."""
    if p.is_float:
        return stored.to(out_dtype)
    assert scale is not None, f"{p} needs a scale"
    q = unpack(stored, p.per_byte).float().unflatten(-1, (scale.shape[-1], -1))
    if zero is not None or p.offset:  # signed int8 codes need no shift: skip a full-size pass
        q = q - _zero_point(p, zero)
    return (q * scale.float().unsqueeze(-1)).flatten(-2).to(out_dtype)


def bytes_per_token(p: QuantParams, n_kv_heads: int, head_dim: int, block_size: int | None = None,
                    scale_dtype: torch.dtype = torch.float16) -> float:
    """Exact bytes per token and layer of K or V: data, token/gN scales and zeros, and with block_size
    block-wise scales spread over a block's tokens. Static scales (once per layer) are not counted."""
    data = n_kv_heads * head_dim * p.bits / 8
    if p.is_float or p.static or (p.block_wise and block_size is None):
        return data
    h, t, g = p.scale_shape(n_kv_heads, block_size or 1, head_dim)
    return data + h * t * g * scale_dtype.itemsize * (1 if p.sym else 2) / (block_size or 1)
