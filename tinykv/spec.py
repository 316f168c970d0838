"""The KV spec: one user-facing string that says how keys and values are stored, parsed into
`KVSpec` (a `QuantParams` per part: formats.py), printed back canonically, with a one-line error
naming the bad part of a malformed one. The grammar is in DESIGN.md and the README.

SPEC   := PART ("," PART)* ("," LPART)* ("," OPTION)*
PART   := ["k=" | "v="] FORMAT                   (formats.py; a PART without k=/v= sets both)
LPART  := ["k" | "v"] "@" LAYERS "=" FORMAT      (those layers' K, V or both in their own format)
LAYERS := L | A-B (":" L | A-B)*                 (L may be negative: -1 is the last layer)
OPTION := residual=N | sink=N | hot=DTYPE | skip=LAYERS | evict=POLICY:N
"""

from __future__ import annotations

from dataclasses import dataclass

from .formats import (  # noqa: F401  (the spec's names stay importable from here)
    DTYPES,
    FP8_MAX,
    GRANS,
    TRANSFORMS,
    QuantParams,
    SpecError,
    spec_error,
)

EVICT_POLICIES = ("streaming", "knorm", "snapkv", "h2o")
HOT_DTYPES = ("fp32", "fp16", "bf16")  # what hot= may hold the unquantized tokens in
FP32 = QuantParams("fp32")


@dataclass(frozen=True)
class LayerPart:
    """`k@LAYERS=FORMAT`, `v@LAYERS=FORMAT` or `@LAYERS=FORMAT`: the listed layers store their
    keys, values or both in their own format (a pool group of their own, pools.py); negative
    layers count from the end, as in skip=."""

    which: str  # "k", "v" or "kv"
    layers: tuple[int, ...]
    p: QuantParams

    @property
    def prefix(self) -> str:
        """What comes before '@': k, v, or nothing for both."""
        return "" if self.which == "kv" else self.which

    def __str__(self) -> str:
        return f"{self.prefix}@{layer_list(self.layers)}={self.p}"


@dataclass(frozen=True)
class KVSpec:
    """A parsed KV spec: how K and V are stored (`k`, `v`; `per_layer` parts override them at
    chosen layers); how many first (sink) and recent (residual) tokens stay in full precision,
    and in which float dtype the hot pool holds them (with blocks still filling: `hot`, "" for
    the model's); which layers skip quantization (negative: from the end); and an eviction
    policy with its token budget per sequence and KV head."""

    k: QuantParams
    v: QuantParams
    residual: int = 0
    sink: int = 0
    hot: str = ""  # a dtype of HOT_DTYPES, or "" for the model's
    skip: tuple[int, ...] = ()
    evict: str = ""  # a policy of EVICT_POLICIES, or "" for none
    budget: int = 0  # tokens kept per sequence and KV head under `evict`
    per_layer: tuple[LayerPart, ...] = ()

    def __post_init__(self) -> None:
        if min(self.residual, self.sink, self.budget) < 0:
            raise SpecError(f"bad KV spec {str(self)!r}: residual, sink and budgets must be >= 0")
        if self.hot not in ("",) + HOT_DTYPES:
            raise SpecError(f"bad KV spec {str(self)!r}: hot= takes {'|'.join(HOT_DTYPES)}")
        if bool(self.evict) != (self.budget > 0) or self.evict not in ("",) + EVICT_POLICIES:
            raise SpecError(f"bad KV spec {str(self)!r}: evict needs a policy and a budget > 0")
        if any(p.smooth for p in self.value_parts):
            raise SpecError(f"bad KV spec {str(self)!r}: smooth is for keys only (it weighs key "
                            "error by the queries; write k=...:smooth)")
        # Indices as written: a clash is an error before any model is known; the same layer
        # written two ways (-1 and 29) is caught by layer_parts.
        self._assign({i: i for lp in self.per_layer for i in lp.layers}, set(self.skip))

    @classmethod
    def parse(cls, s: str) -> KVSpec:
        parts: dict[str, QuantParams] = {}  # "k"/"v", plus "k="/"v=" once set explicitly
        per_layer: list[LayerPart] = []
        opts: dict = {}
        for item in (t.strip() for t in s.split(",")):
            key, eq, val = (t.strip() for t in item.partition("="))
            if not item:
                raise spec_error(s, "empty spec" if not s.strip() else "empty part (stray comma?)")
            if eq and key not in ("k", "v") and "@" not in key:
                if key in opts:
                    raise spec_error(s, f"{key} given twice", item)
                opts.update(_parse_option(s, item, key, val))
                continue
            if opts:
                raise spec_error(s, "options must come after the parts", item)
            if "@" in key:
                per_layer.append(_parse_layer_part(s, item, key, val))
                continue
            targets = (key,) if eq else ("k", "v")
            qp = QuantParams.parse(val if eq else item, s)  # first: a typo is named as one
            if per_layer:
                raise spec_error(s, "per-layer parts (k@..., v@..., @...) come after the k/v "
                                 "parts", item)
            # A bare part sets both, so it must come first; each k=/v= may then override it once.
            if (not eq and parts) or any(t + "=" in parts for t in targets):
                raise spec_error(s, f"{'/'.join(targets)} set twice", item)
            for t in targets:
                parts[t] = qp
                if eq:
                    parts[t + "="] = qp
        missing = [t for t in ("k", "v") if t not in parts]
        if missing:
            raise spec_error(s, f"{missing[0]} is never set (add {missing[0]}=DTYPE or a part "
                             "without k=/v=)")
        try:
            return cls(parts["k"], parts["v"], per_layer=tuple(per_layer), **opts)
        except SpecError as e:  # a clash between parts: name the spec as the user wrote it
            raise spec_error(s, str(e).partition(": ")[2]) from None

    def __str__(self) -> str:
        if self.k == self.v:
            out = [str(self.k)]
        else:
            out = [f"k={self.k}", f"v={self.v}"]
        out += [str(lp) for lp in self.per_layer]
        if self.residual:
            out.append(f"residual={self.residual}")
        if self.sink:
            out.append(f"sink={self.sink}")
        if self.hot:
            out.append(f"hot={self.hot}")
        if self.skip:
            out.append("skip=" + layer_list(self.skip))
        if self.evict:
            out.append(f"evict={self.evict}:{self.budget}")
        return ",".join(out)

    # ---- what the parts ask for, over every layer ---------------------------------------------
    @property
    def key_parts(self) -> tuple[QuantParams, ...]:
        """Every format some layer's keys may take (skipped layers aside)."""
        return (self.k, *(lp.p for lp in self.per_layer if "k" in lp.which))

    @property
    def value_parts(self) -> tuple[QuantParams, ...]:
        return (self.v, *(lp.p for lp in self.per_layer if "v" in lp.which))

    @property
    def needs_scales(self) -> bool:
        """Static parts take their scales, centered parts their means, smoothed keys their maps,
        from a calibration file."""
        parts = self.key_parts + self.value_parts
        return any(p.static or p.center for p in parts) or any(p.smooth for p in self.key_parts)

    @property
    def is_float(self) -> bool:
        return all(p.is_float for p in self.key_parts + self.value_parts)

    @property
    def block_wise(self) -> bool:
        """Some layer's format shares scales across a block's tokens (computed as it fills)."""
        return any(p.block_wise for p in self.key_parts + self.value_parts)

    def skipped(self, n_layers: int) -> set[int]:
        """The layers kept at the model's dtype, negative indices resolved."""
        return {self._resolve(i, n_layers, f"skip={i}") for i in self.skip}

    def layer_parts(self, n_layers: int, full: QuantParams = FP32
                    ) -> list[tuple[QuantParams, QuantParams]]:
        """(K format, V format) of every layer: `full` (the model's dtype) where skipped, a
        per-layer part where one names the layer, else the spec's k and v."""
        resolved = {}
        for lp in self.per_layer:
            for i in lp.layers:
                resolved[i] = self._resolve(i, n_layers, f"{lp.prefix}@{i}")
        assigned = self._assign(resolved, self.skipped(n_layers))
        out = []
        for layer in range(n_layers):
            kp, vp = assigned.get((layer, "k"), self.k), assigned.get((layer, "v"), self.v)
            out.append((full, full) if (layer, "skip") in assigned else (kp, vp))
        return out

    def check(self, n_layers: int, head_dim: int) -> None:
        """Raise SpecError unless every layer this spec names exists and every format fits rows
        of head_dim channels: what a model asks of a spec, checked before any slow work."""
        self.layer_parts(n_layers)
        for p in self.key_parts + self.value_parts:
            p.check(head_dim)

    def _resolve(self, i: int, n_layers: int, written: str) -> int:
        if not -n_layers <= i < n_layers:
            raise SpecError(f"bad KV spec {str(self)!r}: {written} is outside the model's "
                            f"{n_layers} layers")
        return i % n_layers

    def _assign(self, resolved: dict[int, int], skipped: set[int]) -> dict:
        """(layer, "k"|"v") -> the per-layer part's format, (layer, "skip") for skipped layers;
        a layer given two formats for K or V, or skipped and given one, is an error."""
        out: dict = {(layer, "skip"): None for layer in skipped}
        for lp in self.per_layer:
            for i in lp.layers:
                layer = resolved[i]
                for which in lp.which:
                    clash = (layer, which) in out or (layer, "skip") in out
                    if clash:
                        what = "skipped and given a part" if (layer, "skip") in out else \
                            f"given two {which} parts"
                        raise SpecError(f"bad KV spec {str(self)!r}: layer {i} is {what}")
                    out[(layer, which)] = lp.p
        return out


def layer_list(layers: tuple[int, ...]) -> str:
    """Layers as written in a spec: ':'-separated, a run of 3 or more ascending ones as A-B."""
    out, i = [], 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[i] >= 0 and layers[j + 1] == layers[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"{layers[i]}-{layers[j]}")
        else:
            out += [str(x) for x in layers[i:j + 1]]
        i = j + 1
    return ":".join(out)


def _parse_layers(s: str, item: str, text: str) -> tuple[int, ...]:
    """'0:1:5-9:-1' -> (0, 1, 5, 6, 7, 8, 9, -1); each layer once."""
    layers: list[int] = []
    for t in (t.strip() for t in text.split(":")):
        lo, dash, hi = t.partition("-")
        ok = lo.isascii() and lo.isdigit() and (not dash or (hi.isascii() and hi.isdigit()))
        if not lo and dash:  # a negative index: -1 is the last layer
            ok, lo, dash = hi.isascii() and hi.isdigit(), t, ""
        if not ok or (dash and int(hi) < int(lo)):
            raise spec_error(s, f"bad layers {t!r} (expected L, -L or A-B with A <= B, "
                             "joined by ':', e.g. 0:1:5-9:-1)", item)
        for layer in range(int(lo), int(hi) + 1) if dash else [int(lo)]:
            if layer in layers:
                raise spec_error(s, f"layer {layer} listed twice", item)
            layers.append(layer)
    return tuple(layers)


def _parse_layer_part(s: str, item: str, key: str, val: str) -> LayerPart:
    """k@LAYERS=FORMAT, v@LAYERS=FORMAT or @LAYERS=FORMAT."""
    which, _, layers = (t.strip() for t in key.partition("@"))
    if which not in ("", "k", "v") or not val:
        raise spec_error(s, "a per-layer part is k@LAYERS=FORMAT, v@LAYERS=FORMAT or "
                         "@LAYERS=FORMAT (e.g. k@0:1=int4:rot)", item)
    return LayerPart(which or "kv", _parse_layers(s, item, layers), QuantParams.parse(val, s))


def _parse_option(s: str, item: str, key: str, val: str) -> dict:
    """One OPTION of a spec (residual=N, sink=N, hot=DTYPE, skip=L:L, evict=POLICY:N) as KVSpec
    fields."""
    if key in ("residual", "sink"):
        if not (val.isascii() and val.isdigit()):
            raise spec_error(s, f"{key} needs an integer >= 0", item)
        return {key: int(val)}
    if key == "hot":
        if val not in HOT_DTYPES:
            raise spec_error(s, f"hot= takes {'|'.join(HOT_DTYPES)}", item)
        return {"hot": val}
    if key == "skip":
        return {"skip": _parse_layers(s, item, val)}
    if key == "evict":
        policy, _, n = (t.strip() for t in val.partition(":"))
        if policy not in EVICT_POLICIES:
            raise spec_error(s, f"unknown eviction policy {policy!r} (expected "
                             f"{'|'.join(EVICT_POLICIES)})", item)
        if not (n.isascii() and n.isdigit() and int(n) > 0):
            raise spec_error(s, "evict needs a token budget > 0, e.g. evict=snapkv:1024", item)
        return {"evict": policy, "budget": int(n)}
    raise spec_error(s, f"unknown option {key!r} (expected residual=N, sink=N, hot=DTYPE, "
                     "skip=L:L or evict=POLICY:N)", item)
