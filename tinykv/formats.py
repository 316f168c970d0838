"""One stored format of keys or values, a PART of the KV spec (spec.py): `QuantParams`, with its
parse, canonical str and the quantities every other module derives from it (bits, codes per
byte, qmax, offset, scale shapes). The grammar is in DESIGN.md and the README.

PART := DTYPE [":" GRAN] [":" sym|asym] [":" static|dynamic] [":mse"|":fit"] [":rot"]
        [":center"] [":smooth"]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8", "int4", "int2")
GRANS = ("tensor", "head", "channel", "token")  # plus gN, held as gran="group", group=N
_FLOAT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4, "int2": 2}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
TRANSFORMS = ("rot", "center", "smooth")  # PART flags applied around the kernels, in order
_TRANSFORMS = "rot, center or smooth"  # the same, for messages


class SpecError(ValueError):
    """A malformed KV spec; the message is one line naming the bad part."""


def spec_error(spec: str, why: str, part: str | None = None) -> SpecError:
    where = f" in {part!r}" if part not in (None, spec) else ""
    return SpecError(f"bad KV spec {spec!r}: {why}{where}")


def _default_gran(dtype: str) -> str:
    if dtype.startswith("int"):
        return "token"
    return "tensor"


def _problem(dtype: str, gran: str, group: int, sym: bool, static: bool,
             mse: bool = False, fit: bool = False) -> str | None:
    """Why these fields are no valid format, or None; shared by parse and the constructor."""
    if dtype not in DTYPES:
        return f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})"
    if gran not in GRANS + ("group",) or (gran == "group") != (group > 0):
        return f"bad granularity {gran!r} (expected {'|'.join(GRANS)}|gN with N > 0)"
    if dtype in _FLOAT and (gran, sym, static) != ("tensor", True, False):
        return f"{dtype} is stored by plain cast and takes no options but {_TRANSFORMS}"
    if dtype == "fp8" and not sym:
        return "fp8 supports sym only"
    if static and gran in ("token", "group"):
        return f"static needs tensor/head/channel scales (per-{gran} scales cannot be calibrated)"
    if mse and fit:
        return "mse and fit each choose the scale: give one"
    searched = "mse" if mse else "fit" if fit else None
    if searched and (dtype not in ("int8", "int4", "int2") or not sym
                     or gran not in ("token", "group")):
        return f"{searched} takes sym int8/int4/int2 with per-token or per-group (gN) scales"
    return None


def _option_key(opt: str) -> str | None:
    """Which field a PART option sets."""
    if opt in GRANS or opt.startswith("g"):
        return "gran"
    if opt in ("sym", "asym"):
        return "sym"
    if opt in ("static", "dynamic"):
        return "static"
    if opt in ("mse", "fit") or opt in TRANSFORMS:
        return opt
    return None


@dataclass(frozen=True)
class QuantParams:
    """How one of K or V is stored. Float dtypes are a plain cast (gran "tensor", sym, dynamic).
    `rot`: a seeded orthogonal rotation per KV head before quantizing (rotation_matrix).
    `center`: a calibrated per-channel mean subtracted before storing (quant.Transform).
    `smooth` (keys only): a calibrated per-head linear map on keys, its inverse on queries, that
    puts the keys' quantization error where queries look least (quant.Transform).
    `mse`: each group's scale is the one, among its absmax shrunk by each of quant.MSE_CLIPS,
    whose round trip loses the least squared error (a 2-bit group of rotated values does best
    clipped to ~60% of its absmax; the clipped values saturate by design).
    `fit`: mse's scale, then fitted so that each group keeps its inner product with itself
    (sum of x * stored x = sum of x^2, refitted to its own steps quant.FIT_STEPS times;
    quant._least_error_scales): a least-error clip shrinks every group toward zero, which
    lowers the scores of the keys a query matches best."""

    dtype: str
    gran: str = ""  # tensor | head | channel | token | group; "" = the dtype's default
    group: int = 0  # channels per group when gran == "group", else 0
    sym: bool = True
    static: bool = False
    mse: bool = False
    fit: bool = False
    rot: bool = False
    center: bool = False
    smooth: bool = False

    def __post_init__(self) -> None:
        if not self.gran:
            object.__setattr__(self, "gran", _default_gran(self.dtype))
        # Every instance is valid and canonical, so str() always round-trips through parse().
        why = _problem(self.dtype, self.gran, self.group, self.sym, self.static, self.mse,
                       self.fit)
        if why:
            raise spec_error(str(self), why)

    @classmethod
    def parse(cls, part: str, spec: str | None = None) -> QuantParams:
        """Parse 'DTYPE[:GRAN][:sym|asym][:static|dynamic][:mse|:fit][:rot][:center][:smooth]'
        (no k=/v= prefix)."""
        spec = part if spec is None else spec
        dtype, *opts = (t.strip() for t in part.split(":"))
        if dtype in _FLOAT and not set(opts) <= set(TRANSFORMS):
            raise spec_error(spec, f"{dtype} is stored by plain cast and takes no options but "
                        f"{_TRANSFORMS}", part)
        kw: dict = {}
        for o in opts:
            key = _option_key(o)
            if key is None:
                raise spec_error(spec, f"unknown option {o!r} (expected {'|'.join(GRANS)}|gN, "
                            f"sym|asym, static|dynamic, mse|fit, {_TRANSFORMS})", part)
            if key in kw:
                raise spec_error(spec, f"{key} given twice", part)
            kw[key] = o if key == "gran" else o in ("sym", "static", "mse", "fit", *TRANSFORMS)
        gran, group = kw.get("gran", _default_gran(dtype)), 0
        if gran not in GRANS:  # gN
            digits = gran[1:]
            if not (digits.isascii() and digits.isdigit() and int(digits) > 0):
                raise spec_error(spec, f"bad group size {gran!r} (expected gN with N > 0)", part)
            gran, group = "group", int(digits)
        fields = (dtype, gran, group, kw.get("sym", True), kw.get("static", False),
                  kw.get("mse", False), kw.get("fit", False))
        why = _problem(*fields)
        if why:
            raise spec_error(spec, why, part)
        return cls(*fields, *(kw.get(t, False) for t in TRANSFORMS))

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
        if self.mse:
            out += ":mse"
        if self.fit:
            out += ":fit"
        if self.rot:
            out += ":rot"
        if self.center:
            out += ":center"
        if self.smooth:
            out += ":smooth"
        return out

    def check(self, head_dim: int) -> None:
        """Raise SpecError unless rows of head_dim channels fit this format (groups, packing)."""
        if self.group and head_dim % self.group:
            raise spec_error(str(self), f"head_dim {head_dim} is not a multiple of the group size "
                                        f"{self.group}")
        if head_dim % self.per_byte:
            raise spec_error(str(self), f"head_dim {head_dim} is not a multiple of the "
                                        f"{self.per_byte} codes a byte holds")

    @property
    def stored(self) -> QuantParams:
        """This format without the transforms: what its codes and scales are (the transforms act
        on what is stored, layer by layer, so static scales of one stored format serve all)."""
        return dataclasses.replace(self, rot=False, center=False, smooth=False)

    @property
    def is_float(self) -> bool:
        return self.dtype in _FLOAT

    @property
    def bits(self) -> int:
        return _BITS[self.dtype]

    @property
    def clips(self) -> bool:
        """Its scales are chosen among clips of the absmax (mse, fit): values past them saturate
        by design, so they are not counted as saturated."""
        return self.mse or self.fit

    @property
    def per_byte(self) -> int:
        """Values per stored element: int4 and int2 codes are packed into bytes."""
        return {"int4": 2, "int2": 4}.get(self.dtype, 1)

    @property
    def offset(self) -> float:
        """Stored code minus offset is the signed value: sym int4/int2 codes are stored unsigned.
        Sym int2 is midrise (qmax)."""
        if self.sym and self.dtype == "int2":
            return 1.5
        if self.sym and self.per_byte > 1:
            return 2 ** (self.bits - 1)
        return 0

    @property
    def qmax(self) -> float:
        """Largest value in steps: the signed range (sym), the code range (asym), 448 for fp8.
        Sym int8/int4 keep a zero level (-qmax..qmax: 255 and 15 levels). Sym int2 does not: a
        zero level would leave 3 of its 4 codes, so it is midrise, -1.5, -0.5, 0.5, 1.5 steps."""
        if self.is_float:
            return 0
        if self.dtype == "fp8":
            return int(FP8_MAX)
        if self.sym and self.dtype == "int2":
            return 1.5
        if self.sym:
            return 2 ** (self.bits - 1) - 1
        return 2**self.bits - 1

    @property
    def qmin(self) -> float:
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
