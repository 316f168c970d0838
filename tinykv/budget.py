"""Bits where they matter: each layer's K and V format chosen to a budget of bits per element.

1. What a spec costs (`bits_per_element`): everything a sequence of `context` tokens stores, per
   cached element (one channel of one token's K or V, in one KV head of one layer): each layer's
   data, scales and zero points, and the sink and residual tokens the cache holds in its hot
   pool (whole blocks, as it holds them, in the spec's hot= dtype or the model's). Static
   scales, stored once per layer, are not counted.
2. Sensitivity (sensitivity.py): the mean per-token KL divergence of the next-token
   distributions from the exact model's when only one layer's K (or V) is stored in a candidate
   format, measured on calibration text.
3. Allocation (`allocate`): errors are taken as additive over layers and K/V (first order: small,
   independent perturbations), and a multiple-choice knapsack picks one candidate per layer and
   K/V minimizing their sum within the budget, exactly, by dynamic programming over costs in
   1/64 bit. `confirm` then measures the chosen spec end to end, through the real cache.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from .calibrate import record, scales_from
from .model import Config, Transformer
from .pools import block_bytes, hot_dtype
from .sensitivity import Sensitivity, part_bits, sensitivities
from .spec import KVSpec, LayerPart, QuantParams, SpecError

UNIT = 64  # knapsack costs in 1/64 bit per element
# keys smoothed and centered, values rotated: the best 2- and 4-bit parts of the quality table
DEFAULT_CANDIDATES = ("k=int2:g32:rot:center:smooth", "k=int4:rot:center:smooth",
                      "v=int2:g32:rot", "v=int4:rot", "int8")


class BudgetError(ValueError):
    """A budget or candidate list that cannot be met or parsed; one line."""


def exact_tokens(spec: KVSpec, context: int, block_size: int = 16) -> int:
    """Tokens of a `context`-token sequence the cache holds unquantized (in its hot pool): the
    sink blocks and the residual window's blocks."""
    blocks = math.ceil(spec.sink / block_size) + math.ceil(spec.residual / block_size)
    return min(context, blocks * block_size)


def bits_per_element(cfg: Config, spec: KVSpec, context: int, block_size: int = 16,
                     dtype: torch.dtype = torch.float32) -> float:
    """Stored bits per cached element of a sequence of `context` tokens, all in (module
    docstring); an evicting spec holds its budget of tokens."""
    held = min(context, spec.budget) if spec.evict else context
    elements = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim  # per token
    stored = block_bytes(cfg, spec, block_size, dtype) / block_size * 8 / elements
    exact = exact_tokens(spec, held, block_size)
    return ((held - exact) * stored + exact * hot_dtype(spec, dtype).itemsize * 8) / held


def parse_candidates(texts: list[str]) -> list[tuple[str, QuantParams]]:
    """'k=FORMAT', 'v=FORMAT' or 'FORMAT' (both) -> (which, part) pairs, each once."""
    out = []
    for text in texts:
        which, eq, fmt = text.strip().partition("=")
        if not eq:
            which, fmt = "kv", text.strip()
        if which not in ("k", "v", "kv"):
            raise BudgetError(f"bad candidate {text!r}: expected k=FORMAT, v=FORMAT or FORMAT")
        try:
            p = QuantParams.parse(fmt)
        except SpecError as e:
            raise BudgetError(f"bad candidate {text!r}: {str(e).partition(': ')[2]}") from None
        if p.smooth and "v" in which:
            raise BudgetError(f"bad candidate {text!r}: smooth is for keys only (write k={fmt})")
        out += [(w, p) for w in which if (w, p) not in out]
    for w in "kv":
        if not any(which == w for which, _ in out):
            raise BudgetError(f"no candidate format for {w} (give k=FORMAT, v=FORMAT or FORMAT)")
    return out


def check_base(spec: KVSpec) -> None:
    """The spec --bits starts from gives the sinks and window; the formats are chosen here."""
    if spec.per_layer or spec.skip or spec.evict:
        raise BudgetError(f"calibrate --bits chooses every layer's formats: give --kv with "
                          f"residual=, sink= and hot= only, e.g. fp16,residual=64,sink=16 (not "
                          f"'{spec}')")


def format_budget(cfg: Config, base: KVSpec, bits: float, context: int, block_size: int = 16,
                  dtype: torch.dtype = torch.float32) -> float:
    """The summed bits per element that every layer's K and V parts may spend, so that the
    whole spec stores at most `bits` per element at `context` (module docstring)."""
    exact = exact_tokens(base, context, block_size)
    fixed = exact * hot_dtype(base, dtype).itemsize * 8 / context  # the exact tokens, per element
    if exact >= context or bits <= fixed:
        raise BudgetError(f"a budget of {bits} bits per element at {context} tokens leaves "
                          f"nothing for the formats: the sinks and window cost {fixed:.3f}")
    return (bits - fixed) * context / (context - exact) * 2 * cfg.n_layers


def allocate(sens: list[Sensitivity], n_layers: int, total_bits: float
             ) -> dict[tuple[int, str], Sensitivity]:
    """(layer, "k"|"v") -> the chosen candidate: the least summed KL whose summed bits stay
    within total_bits. A scale file holds one static format for K and one for V, so the choice
    is made for every such pair of static formats (or none) and the best kept."""
    def statics(which: str) -> list[QuantParams | None]:
        found = {s.part.stored for s in sens if s.which == which and s.part.static}
        return [None] + sorted(found, key=str)

    best, least, why = None, math.inf, None
    for k_static in statics("k"):
        for v_static in statics("v"):
            keep = {"k": k_static, "v": v_static}
            allowed = [s for s in sens if not s.part.static or s.part.stored == keep[s.which]]
            try:
                chosen = _knapsack(allowed, n_layers, total_bits)
            except BudgetError as e:
                why = why or e
                continue
            error = sum(s.kl for s in chosen.values())
            if error < least:
                best, least = chosen, error
    if best is None:
        raise why
    return best


def _knapsack(sens: list[Sensitivity], n_layers: int, total_bits: float
              ) -> dict[tuple[int, str], Sensitivity]:
    """allocate's choice among these candidates, all allowed together: a multiple-choice
    knapsack, solved exactly over costs in 1/64 bit."""
    items = [(layer, which) for layer in range(n_layers) for which in "kv"]
    options = {item: [s for s in sens if (s.layer, s.which) == item] for item in items}
    if not all(options.values()):
        raise BudgetError("every layer's K and V needs a candidate the others allow")
    cap = math.floor(total_bits * UNIT + 1e-6)
    cheapest = sum(min(s.bits for s in options[item]) for item in items)
    if cheapest * UNIT > cap + 1e-6:
        raise BudgetError(f"the cheapest candidates need {cheapest / (2 * n_layers):.3f} bits "
                          f"per element for the formats; the budget leaves "
                          f"{total_bits / (2 * n_layers):.3f}")
    best = np.zeros(cap + 1)  # least error of the items so far within each cost
    picks = []  # per item: (cap + 1,) the option taken at each cost
    for item in items:
        new, pick = np.full(cap + 1, np.inf), np.full(cap + 1, -1)
        for o, s in enumerate(options[item]):
            cost = math.ceil(s.bits * UNIT - 1e-6)
            if cost > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[cost:] = best[:cap + 1 - cost] + s.kl
            better = cand < new
            new[better], pick[better] = cand[better], o
        best = new
        picks.append(pick)
    out, c = {}, cap
    for item, pick in zip(reversed(items), reversed(picks)):
        s = options[item][pick[c]]
        out[item] = s
        c -= math.ceil(s.bits * UNIT - 1e-6)
    return out


def spec_of(base: KVSpec, chosen: dict[tuple[int, str], Sensitivity], n_layers: int) -> KVSpec:
    """The chosen formats as a spec: K's and V's most common part as the default, the other
    layers as per-layer parts (one for K and V together where they agree)."""
    defaults, groups = {}, {}  # which -> part; (which, part) -> layers
    for which in "kv":
        parts = [chosen[(layer, which)].part for layer in range(n_layers)]
        counts = Counter(parts)
        defaults[which] = max(counts, key=lambda p: (counts[p], -parts.index(p)))
        for layer, p in enumerate(parts):
            if p != defaults[which]:
                groups.setdefault((which, p), []).append(layer)
    per_layer = []
    for (which, p), layers in groups.items():
        if which == "v" and groups.get(("k", p)) == layers:
            continue  # written once, with K
        both = which == "k" and groups.get(("v", p)) == layers
        per_layer.append(LayerPart("kv" if both else which, tuple(layers), p))
    return KVSpec(defaults["k"], defaults["v"], residual=base.residual, sink=base.sink,
                  hot=base.hot, per_layer=tuple(per_layer))


def table(chosen: dict[tuple[int, str], Sensitivity], sens: list[Sensitivity],
          n_layers: int) -> str:
    """Per layer: K's and V's chosen part, its bits, KL and NLL increase, and the KL at the
    cheapest candidate (how sensitive the layer is)."""
    lines = [f"{'layer':>5}  {'K part':<28}{'bits':>5}{'KL':>9}{'NLL':>9}{'KL@min':>9}  "
             f"{'V part':<20}{'bits':>5}{'KL':>9}{'NLL':>9}{'KL@min':>9}"]
    for layer in range(n_layers):
        cells = []
        for which, width in (("k", 28), ("v", 20)):
            s = chosen[(layer, which)]
            low = min((x for x in sens if (x.layer, x.which) == (layer, which)),
                      key=lambda x: (x.bits, x.kl))
            nll = "" if s.nll is None else f"{s.nll:9.1e}"
            cells.append(f"{str(s.part):<{width}}{s.bits:5.2f}{s.kl:9.1e}{nll:>9}{low.kl:9.1e}")
        lines.append(f"{layer:5d}  " + "  ".join(cells))
    return "\n".join(lines)


@dataclass
class Choice:
    """What `choose` found: every candidate's error, the pick per layer and K/V, the spec."""
    sens: list[Sensitivity]
    chosen: dict[tuple[int, str], Sensitivity]
    spec: KVSpec
    scales: dict[str, torch.Tensor]  # what the spec takes from a scale file ({} if nothing)
    bits: float  # the spec's bits per element at the context, all in
    predicted_kl: float  # the summed KL of the chosen parts


def choose(model: Transformer, tokens: list[int], probe: list[int], base: KVSpec,
           candidates: list[tuple[str, QuantParams]], bits: float, context: int,
           window: int = 1024, block_size: int = 16, progress: bool = False,
           measured: list[Sensitivity] | None = None, observer: str = "minmax") -> Choice:
    """Each layer's K and V format within `bits` per element at `context` (module docstring),
    calibrated on `tokens`, measured on `probe` (or taken from `measured`, a saved measurement
    under the same sinks and window); fails before the slow part when the budget cannot hold
    the cheapest candidates."""
    check_base(base)
    cfg, dtype = model.cfg, next(model.parameters()).dtype
    for _, p in candidates:
        p.check(cfg.head_dim)
    total = format_budget(cfg, base, bits, context, block_size, dtype)
    cheapest = sum(min(part_bits(cfg, p, block_size) for w, p in candidates if w == which)
                   for which in "kv") * cfg.n_layers
    if cheapest > total + 1e-6:
        raise BudgetError(f"{bits} bits per element at {context} tokens cannot hold even the "
                          f"cheapest candidates ({cheapest / (2 * cfg.n_layers):.3f} bits) "
                          "beside these sinks and window")
    rec = record(model, tokens, window, keep_q=True, progress=progress)
    if measured is None:
        sens = sensitivities(model, rec, probe, base, candidates, window, block_size, progress,
                             observer)
    else:
        sens = _measured(measured, candidates, cfg.n_layers)
    chosen = allocate(sens, cfg.n_layers, total)
    spec = spec_of(base, chosen, cfg.n_layers)
    scales = scales_from(rec, spec, observer)[0] if spec.needs_scales else {}
    return Choice(sens=sens, chosen=chosen, spec=spec, scales=scales,
                  bits=bits_per_element(cfg, spec, context, block_size, dtype),
                  predicted_kl=sum(s.kl for s in chosen.values()))


def _measured(sens: list[Sensitivity], candidates: list[tuple[str, QuantParams]],
              n_layers: int) -> list[Sensitivity]:
    """The saved errors of these candidates, each layer's all there."""
    have = {(s.layer, s.which, s.part): s for s in sens}
    missing = [(w, p) for w, p in candidates
               if any((layer, w, p) not in have for layer in range(n_layers))]
    if missing:
        w, p = missing[0]
        raise BudgetError(f"the saved sensitivities lack {w}={p} for some layer: measure it")
    return [have[(layer, w, p)] for layer in range(n_layers) for w, p in candidates]
