"""KV-cache quantization for tinykv: the KV spec string (parse/str), scales, quantize and
dequantize, int4/int2 packing and fp8 (e4m3), all of it in this single file.

Every tensor is shaped (..., H, T, D): heads, tokens, channels last. Scales and zero points
are shaped (..., H|1, T|1, G) where channel c belongs to group c // (D // G), so one formula
dequantizes every granularity: x = (q - zero) * scale. Symmetric formats have no zero
tensor; the constant `offset` takes its place (sym int4/int2 codes are stored unsigned).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8", "int4", "int2")
GRANS = ("tensor", "head", "channel", "token")  # plus gN, held as gran="group", group=N
_FLOAT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4, "int2": 2}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Dims reduced over the grouped view (..., H, T, G, D // G); the last one is squeezed afterwards.
_REDUCE = {"token": (-1,), "group": (-1,), "channel": (-3, -1), "head": (-3, -1),
           "tensor": (-4, -3, -1)}


class SpecError(ValueError):
    """A malformed KV spec; the message is one line naming the bad part."""


def _fail(spec: str, why: str, part: str | None = None) -> SpecError:
    where = f" in {part!r}" if part not in (None, spec) else ""
    return SpecError(f"bad KV spec {spec!r}: {why}{where}")


def _default_gran(dtype: str) -> str:
    if dtype.startswith("int"):
        return "token"
    return "tensor"


def _problem(dtype: str, gran: str, group: int, sym: bool, static: bool, rot: bool) -> str | None:
    """Why these fields are no valid format, or None; shared by parse and the constructor."""
    if dtype not in DTYPES:
        return f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})"
    if gran not in GRANS + ("group",) or (gran == "group") != (group > 0):
        return f"bad granularity {gran!r} (expected {'|'.join(GRANS)}|gN with N > 0)"
    if dtype in _FLOAT and (gran, sym, static) != ("tensor", True, False):
        return f"{dtype} is stored by plain cast and takes no options but rot"
    if dtype == "fp8" and not sym:
        return "fp8 supports sym only"
    if static and gran in ("token", "group"):
        return f"static needs tensor/head/channel scales (per-{gran} scales cannot be calibrated)"
    return None


def _option_key(opt: str) -> str | None:
    """Which field a PART option sets."""
    if opt in GRANS or opt.startswith("g"):
        return "gran"
    if opt in ("sym", "asym"):
        return "sym"
    if opt in ("static", "dynamic"):
        return "static"
    if opt == "rot":
        return "rot"
    return None


@dataclass(frozen=True)
class QuantParams:
    """How one of K or V is stored. Float dtypes are a plain cast (gran "tensor", sym, dynamic).
    `rot`: a seeded orthogonal rotation per KV head before quantizing (rotation_matrix)."""

    dtype: str
    gran: str = ""  # tensor | head | channel | token | group; "" = the dtype's default
    group: int = 0  # channels per group when gran == "group", else 0
    sym: bool = True
    static: bool = False
    rot: bool = False

    def __post_init__(self) -> None:
        if not self.gran:
            object.__setattr__(self, "gran", _default_gran(self.dtype))
        # Every instance is valid and canonical, so str() always round-trips through parse().
        why = _problem(self.dtype, self.gran, self.group, self.sym, self.static, self.rot)
        if why:
            raise _fail(str(self), why)

    @classmethod
    def parse(cls, part: str, spec: str | None = None) -> QuantParams:
        """Parse 'DTYPE[:GRAN][:sym|asym][:static|dynamic][:rot]' (no k=/v= prefix)."""
        spec = part if spec is None else spec
        dtype, *opts = (t.strip() for t in part.split(":"))
        if dtype in _FLOAT and opts not in ([], ["rot"]):
            raise _fail(spec, f"{dtype} is stored by plain cast and takes no options but rot",
                        part)
        kw: dict = {}
        for o in opts:
            key = _option_key(o)
            if key is None:
                raise _fail(spec, f"unknown option {o!r} (expected {'|'.join(GRANS)}|gN, "
                            "sym|asym, static|dynamic or rot)", part)
            if key in kw:
                raise _fail(spec, f"{key} given twice", part)
            kw[key] = o if key == "gran" else o in ("sym", "static", "rot")
        gran, group = kw.get("gran", _default_gran(dtype)), 0
        if gran not in GRANS:  # gN
            digits = gran[1:]
            if not (digits.isascii() and digits.isdigit() and int(digits) > 0):
                raise _fail(spec, f"bad group size {gran!r} (expected gN with N > 0)", part)
            gran, group = "group", int(digits)
        fields = (dtype, gran, group, kw.get("sym", True), kw.get("static", False),
                  kw.get("rot", False))
        why = _problem(*fields)
        if why:
            raise _fail(spec, why, part)
        return cls(*fields)

    def __str__(self) -> str:
        out = self.dtype
        if self.gran == "group":
            out += f":g{self.group}"
        elif self.gran != _default_gran(self.dtype):
            out += f":{self.gran}"
        if not self.sym:
            out += ":asym"
        if self.static:
            out += ":static"
        if self.rot:
            out += ":rot"
        return out

    def check(self, head_dim: int) -> None:
        """Raise SpecError unless rows of head_dim channels fit this format (groups, packing)."""
        if head_dim % max(self.group, 1) or head_dim % self.per_byte:
            raise _fail(str(self), f"head_dim {head_dim} is not a multiple of the group size "
                        f"{self.group} / values per byte {self.per_byte}")

    @property
    def is_float(self) -> bool:
        return self.dtype in _FLOAT

    @property
    def bits(self) -> int:
        return _BITS[self.dtype]

    @property
    def per_byte(self) -> int:
        """Values per stored element: int4 and int2 codes are packed into bytes."""
        return {"int4": 2, "int2": 4}.get(self.dtype, 1)

    @property
    def offset(self) -> int:
        """Stored code minus offset is the signed value: sym int4/int2 codes are stored unsigned."""
        if self.sym and self.per_byte > 1:
            return 2 ** (self.bits - 1)
        return 0

    @property
    def qmax(self) -> int:
        """Largest code: the signed range (sym), the code range (asym), 448 for fp8."""
        if self.is_float:
            return 0
        if self.dtype == "fp8":
            return int(FP8_MAX)
        if self.sym:
            return 2 ** (self.bits - 1) - 1
        return 2**self.bits - 1

    @property
    def qmin(self) -> int:
        return -self.qmax if self.sym else 0

    @property
    def storage_dtype(self) -> torch.dtype:
        if self.is_float:
            return _FLOAT[self.dtype]
        if self.dtype == "fp8":
            return torch.float8_e4m3fn
        if self.dtype == "int8" and self.sym:
            return torch.int8
        return torch.uint8

    @property
    def block_wise(self) -> bool:
        """Scales shared across tokens, computed dynamically: once per block, when it fills."""
        shared = self.gran in ("tensor", "head", "channel")
        return shared and not self.static and not self.is_float

    def ngroups(self, head_dim: int) -> int:
        return {"group": head_dim // max(self.group, 1), "channel": head_dim}.get(self.gran, 1)

    def scale_shape(self, n_heads: int, tokens: int, head_dim: int) -> tuple[int, int, int] | None:
        """Shape of scale (and zero) for an (n_heads, tokens, head_dim) tensor; None: no scales."""
        if self.is_float:
            return None
        h = 1 if self.gran == "tensor" else n_heads
        t = tokens if self.gran in ("token", "group") else 1
        return (h, t, self.ngroups(head_dim))


EVICT_POLICIES = ("streaming", "knorm", "snapkv", "h2o")


@dataclass(frozen=True)
class KVSpec:
    """A parsed KV spec: how K and V are stored; how many first (sink) and recent (residual)
    tokens stay in full precision; which layers skip quantization (negative: from the end); and
    an eviction policy with its token budget per sequence and KV head."""

    k: QuantParams
    v: QuantParams
    residual: int = 0
    sink: int = 0
    skip: tuple[int, ...] = ()
    evict: str = ""  # a policy of EVICT_POLICIES, or "" for none
    budget: int = 0  # tokens kept per sequence and KV head under `evict`

    def __post_init__(self) -> None:
        if min(self.residual, self.sink, self.budget) < 0:
            raise SpecError(f"bad KV spec {str(self)!r}: residual, sink and budgets must be >= 0")
        if bool(self.evict) != (self.budget > 0) or self.evict not in ("",) + EVICT_POLICIES:
            raise SpecError(f"bad KV spec {str(self)!r}: evict needs a policy and a budget > 0")

    @classmethod
    def parse(cls, s: str) -> KVSpec:
        parts: dict[str, QuantParams] = {}  # "k"/"v", plus "k="/"v=" once set explicitly
        opts: dict = {}
        for item in (t.strip() for t in s.split(",")):
            key, eq, val = (t.strip() for t in item.partition("="))
            if not item:
                raise _fail(s, "empty spec" if not s.strip() else "empty part (stray comma?)")
            if eq and key not in ("k", "v"):
                if key in opts:
                    raise _fail(s, f"{key} given twice", item)
                opts.update(_parse_option(s, item, key, val))
                continue
            if opts:
                raise _fail(s, "options must come after the parts", item)
            targets = (key,) if eq else ("k", "v")
            # A bare part sets both, so it must come first; each k=/v= may then override it once.
            if (not eq and parts) or any(t + "=" in parts for t in targets):
                raise _fail(s, f"{'/'.join(targets)} set twice", item)
            qp = QuantParams.parse(val if eq else item, s)
            for t in targets:
                parts[t] = qp
                if eq:
                    parts[t + "="] = qp
        missing = [t for t in ("k", "v") if t not in parts]
        if missing:
            raise _fail(s, f"{missing[0]} is never set (add {missing[0]}=DTYPE or a part "
                        "without k=/v=)")
        return cls(parts["k"], parts["v"], **opts)

    def __str__(self) -> str:
        if self.k == self.v:
            out = [str(self.k)]
        else:
            out = [f"k={self.k}", f"v={self.v}"]
        if self.residual:
            out.append(f"residual={self.residual}")
        if self.sink:
            out.append(f"sink={self.sink}")
        if self.skip:
            out.append("skip=" + ":".join(str(i) for i in self.skip))
        if self.evict:
            out.append(f"evict={self.evict}:{self.budget}")
        return ",".join(out)

    @property
    def needs_scales(self) -> bool:
        """Static parts take their scales from a calibration file."""
        return self.k.static or self.v.static

    @property
    def is_float(self) -> bool:
        return self.k.is_float and self.v.is_float

    def skipped(self, n_layers: int) -> set[int]:
        """The layers kept at the model's dtype, negative indices resolved."""
        out = set()
        for i in self.skip:
            if not -n_layers <= i < n_layers:
                raise SpecError(f"bad KV spec {str(self)!r}: skip={i} is outside the model's "
                                f"{n_layers} layers")
            out.add(i % n_layers)
        return out


def _parse_option(s: str, item: str, key: str, val: str) -> dict:
    """One OPTION of a spec (residual=N, sink=N, skip=L:L, evict=POLICY:N) as KVSpec fields."""
    if key in ("residual", "sink"):
        if not (val.isascii() and val.isdigit()):
            raise _fail(s, f"{key} needs an integer >= 0", item)
        return {key: int(val)}
    if key == "skip":
        layers = []
        for t in val.split(":"):
            t = t.strip()
            body = t.removeprefix("-")
            if not (body.isascii() and body.isdigit()):
                raise _fail(s, "skip needs layer indices, e.g. skip=0:1:-1", item)
            if int(t) in layers:
                raise _fail(s, f"layer {int(t)} skipped twice", item)
            layers.append(int(t))
        return {"skip": tuple(layers)}
    if key == "evict":
        policy, _, n = (t.strip() for t in val.partition(":"))
        if policy not in EVICT_POLICIES:
            raise _fail(s, f"unknown eviction policy {policy!r} (expected "
                        f"{'|'.join(EVICT_POLICIES)})", item)
        if not (n.isascii() and n.isdigit() and int(n) > 0):
            raise _fail(s, "evict needs a token budget > 0, e.g. evict=snapkv:1024", item)
        return {"evict": policy, "budget": int(n)}
    raise _fail(s, f"unknown option {key!r} (expected residual=N, sink=N, skip=L:L or "
                "evict=POLICY:N)", item)


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


def layer_rotations(spec: KVSpec, n_layers: int, head_dim: int
                    ) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """(R_k, R_v) per layer for a spec's `:rot` parts (None where a part has none, and for skipped
    layers); seeded by layer, so a cache and its calibration agree."""
    skipped = spec.skipped(n_layers)
    out = []
    for layer in range(n_layers):
        rk = rv = None
        if layer not in skipped and spec.k.rot:
            rk = rotation_matrix(head_dim, 2 * layer)
        if layer not in skipped and spec.v.rot:
            rv = rotation_matrix(head_dim, 2 * layer + 1)
        out.append((rk, rv))
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


def quantize(x: torch.Tensor, p: QuantParams, scale: torch.Tensor | None,
             zero: torch.Tensor | None, count: bool = True) -> tuple[torch.Tensor, int]:
    """Quantize x (..., H, T, D) with the given (already cast) scale/zero -> (stored, n_saturated).

    n_saturated counts values more than half a step outside the representable range (clamped)
    and NaNs (stored as the code of 0); for float formats, finite values that overflow to inf.
    count=False skips counting, which syncs the device.
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
        sat = (v < lo - 0.5) | (v > hi + 0.5)
        codes = v.round().clamp(lo, hi).flatten(-2)  # (..., H, T, D)
        if p.storage_dtype == torch.int8:
            q = codes.to(torch.int8)
        else:
            q = pack(codes.to(torch.uint8), p.per_byte)
    if not count:
        return q, 0
    return q, int((sat | nan).sum())


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


def bytes_per_token(p: QuantParams, n_kv_heads: int, head_dim: int, block_size: int | None = None,
                    scale_dtype: torch.dtype = torch.float16) -> float:
    """Exact bytes per token and layer of K or V: data, token/gN scales and zeros, and with
    block_size block-wise scales spread over a block's tokens. Static scales (once per layer) are
    not counted."""
    data = n_kv_heads * head_dim * p.bits / 8
    if p.is_float or p.static or (p.block_wise and block_size is None):
        return data
    h, t, g = p.scale_shape(n_kv_heads, block_size or 1, head_dim)
    return data + h * t * g * scale_dtype.itemsize * (1 if p.sym else 2) / (block_size or 1)
