"""Static KV calibration: observe each layer's post-RoPE keys and values over a text and turn them
into the fixed scales of a `:static` KV spec (per tensor, head or channel), the means of `:center`
and the maps of `:smooth`, saved in a scale file (scalefile.py: safetensors, checked on load).

Observers (observers.py) give one range per scale group, keys and values apart. Scales follow
quant.compute_scales: sym absmax / qmax (fp8: / 448), asym (max - min) / qmax with the integer
zero round(-min / scale).

The vLLM export of the same scales is vllm_export.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tqdm import tqdm

from .model import Transformer
from .observers import observe, parse_observer, quantile
from .outputs import check_outputs
from .plots import check_figure_path, plot_channels
from .quant import Transform, compute_scales, layer_transforms
from .scalefile import CalibrationError, TextSpan, save_scales
from .spec import KVSpec
from .vllm_export import check_vllm, export_vllm, vllm_scheme_path


class Recorder:
    """A model step that records (model.KVStep): keeps each layer's exact post-RoPE q, k, v and
    answers with plain causal attention, so the model computes what it does uncached. A call is
    one sequence."""

    def __init__(self, model: Transformer, keep_q: bool = False):
        self.model, self.keep_q = model, keep_q
        self.seen = {w: [[] for _ in range(model.cfg.n_layers)] for w in "qkv"}  # (heads, N, D)
        self.stored = {}  # (sink, residual) -> stored_attention's result, made once

    def __call__(self, tokens: list[int]) -> None:
        dev = next(self.model.parameters()).device
        self.positions = torch.arange(len(tokens), device=dev)  # (N,)
        self.logits_idx = self.positions[-1:]  # one row: the vocab matmul is costly, unread
        self.model(torch.tensor(tokens, device=dev), self)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """q (N, Hq, D), k, v (N, H, D) -> o (N, Hq, D), recording all three as the model
        makes them (`as_cached` turns them into what a cache under a spec stores)."""
        kept = [("k", k), ("v", v)]
        if self.keep_q:
            kept.append(("q", q))
        for w, x in kept:
            self.seen[w][layer].append(x.float().transpose(0, 1).cpu())  # (heads, N, D)
        n_rep = q.shape[1] // k.shape[1]
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, heads, N, D) as uncached
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1), is_causal=True)
        return o[0].transpose(0, 1)  # (N, Hq, D)

    def stacked(self, which: str) -> torch.Tensor:
        """Everything recorded of 'q', 'k' or 'v': (L, heads, T, D) float32 on the CPU."""
        return torch.stack([torch.cat(pieces, 1) for pieces in self.seen[which]])


def record(model: Transformer, tokens: list[int], window: int = 1024, keep_q: bool = False,
           progress: bool = False) -> Recorder:
    """Run tokens through the model in independent windows (fresh positions 0..W-1 each) and
    record."""
    limit = model.cfg.max_seq_len
    if not tokens or not 1 <= window <= limit:
        raise CalibrationError(f"need tokens and a window in 1..{limit} "
                               f"(got {len(tokens)}, {window})")
    rec = Recorder(model, keep_q)
    starts = range(0, len(tokens), window)
    for start in tqdm(starts, desc="calibrate", unit="window", disable=not progress):
        rec(tokens[start:start + window])
    return rec


def centers_of(k: torch.Tensor, v: torch.Tensor, spec: KVSpec) -> dict[str, torch.Tensor]:
    """The per-channel means (L, H, D) of recorded keys and values (L, H, T, D) that the spec's
    `:center` parts subtract (quant.Transform): every layer's, when some layer centers."""
    out = {}
    for name, parts, x in (("k", spec.key_parts, k), ("v", spec.value_parts, v)):
        if any(p.center for p in parts):
            out[f"{name}_center"] = x.float().mean(2)
    return out


def _psd_power(m: torch.Tensor, power: float) -> torch.Tensor:
    """m^power of symmetric positive definite matrices m (..., D, D), by eigendecomposition."""
    w, u = torch.linalg.eigh(m)
    return u @ torch.diag_embed(w.clamp(min=torch.finfo(w.dtype).tiny) ** power) @ u.mT


def stored_attention(rec: Recorder, sink: int, residual: int) -> torch.Tensor:
    """(L, H, T): the attention each recorded key receives, from the queries of its window (and
    of its KV head), while a cache holds it quantized: once it is no sink and at least `residual`
    tokens behind the query. Exact keys cannot be hurt by quantizing, so they weigh nothing."""
    if (sink, residual) in rec.stored:  # made once for every spec with these sinks and window
        return rec.stored[(sink, residual)]
    L, H = len(rec.seen["k"]), rec.seen["k"][0][0].shape[0]
    out = []
    for layer in range(L):
        pieces = []
        for q, k in zip(rec.seen["q"][layer], rec.seen["k"][layer]):  # one window each
            n_rep, n, d = q.shape[0] // H, q.shape[1], q.shape[2]
            scores = q.unflatten(0, (H, n_rep)) @ k[:, None].mT / d**0.5  # (H, n_rep, n, n)
            i = torch.arange(n)[:, None]  # query position
            j = torch.arange(n)[None]  # key position
            probs = scores.masked_fill(j > i, float("-inf")).softmax(-1)
            quantized = (j >= sink) & (i - j >= residual)  # (n, n)
            pieces.append((probs * quantized).sum((1, 2)))  # (H, n)
        out.append(torch.cat(pieces, 1))
    rec.stored[(sink, residual)] = torch.stack(out)  # (L, H, T)
    return rec.stored[(sink, residual)]


def smooth_maps(k: torch.Tensor, q: torch.Tensor, weight: torch.Tensor | None = None,
                ridge: float = 0.1) -> torch.Tensor:
    """The `:smooth` map S (L, H, D, D) of each head from recorded keys (L, H, T, D), centered
    if the spec centers them, and queries (L, Hq, T, D); `weight` (L, H, T) weighs each key by
    how much its errors matter (stored_attention), uniform when None.

    Stored keys k S are quantized with error about as large in every stored channel (rotated,
    per-token scales), of a size set by |k S|. With Kc = E_w[k^T k] and Qc = E[q^T q] over the
    head's queries, and M = S S^T, the expected score error E[(q S^-T . err)^2] goes as
    tr(Kc M) * tr(Qc M^-1), which is smallest for the matrix geometric mean of Kc^-1 and Qc:
    M = Kc^-1/2 (Kc^1/2 Qc Kc^1/2)^1/2 Kc^-1/2 (the M with M Kc M = Qc). S = M^1/2, scaled so
    that keys keep their mean energy. A ridge of `ridge` times the mean eigenvalue keeps S
    well conditioned where keys or queries have (nearly) no energy, and shrinks it toward a plain
    rescaling where the statistics are least sure (README: 0.1 beat 0.001, 0.01 and 0.3)."""
    L, H, T, D = k.shape
    n_rep = q.shape[1] // H
    kd = k.double()
    qd = q.double().unflatten(1, (H, n_rep))  # (L, H, n_rep, T, D)
    w = torch.ones(L, H, T, dtype=torch.float64) if weight is None else weight.double()
    total = w.sum(-1, keepdim=True)  # 0 where no key is ever read quantized: weigh all alike
    w = torch.where(total > 0, w / total.clamp(min=1e-300), 1.0 / T)
    kc = (kd * w[..., None]).mT @ kd  # (L, H, D, D)
    qc = torch.einsum("lhrtd,lhrte->lhde", qd, qd) / (T * n_rep)  # (L, H, D, D)
    eye = torch.eye(D, dtype=torch.float64)
    for c in (kc, qc):
        c += ridge * c.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * eye
    kh, kih = _psd_power(kc, 0.5), _psd_power(kc, -0.5)
    m = kih @ _psd_power(kh @ qc @ kh, 0.5) @ kih  # (L, H, D, D)
    energy = kc.diagonal(dim1=-2, dim2=-1).sum(-1) / (kc * m).sum((-2, -1))  # tr Kc / tr(Kc M)
    return (_psd_power(m, 0.5) * energy.sqrt()[..., None, None]).float()


def as_cached(x: torch.Tensor, which: str, transforms: list[Transform]) -> torch.Tensor:
    """Recorded q, k or v (L, heads, T, D) as a cache with these per-layer transforms holds it
    (rotated, centered), so that static scales and attention errors fit what is stored."""
    out = []
    for layer, t in enumerate(transforms):
        y = x[layer].transpose(0, 1)  # (T, heads, D), the layout Transform takes
        y = {"q": t.queries, "k": t.keys, "v": t.values}[which](y)
        out.append(y.transpose(0, 1))
    return torch.stack(out)


def check_request(spec: KVSpec, observer: str, vllm: bool = False) -> None:
    """Fail fast, before the slow part, on what calibration (and the vLLM export) cannot do."""
    if not spec.needs_scales:
        raise CalibrationError(f"KV spec '{spec}' has no static, centered or smoothed part to "
                               "calibrate (e.g. int8:tensor:static or int4:rot:center)")
    parse_observer(observer)
    for name, parts in (("k", spec.key_parts), ("v", spec.value_parts)):
        static = {str(p.stored) for p in parts if p.static}
        if len(static) > 1:
            raise CalibrationError(f"KV spec '{spec}' has {len(static)} static {name} formats "
                                   f"({', '.join(sorted(static))}); a scale file holds one for "
                                   f"{name}: give its other layers dynamic formats")
    if vllm:
        check_vllm(spec)


def static_scales(k: torch.Tensor, v: torch.Tensor, spec: KVSpec,
                  observer: str = "minmax") -> dict[str, torch.Tensor]:
    """Scales for the static parts of spec from recorded keys and values (L, H, T, D):
    compute_scales over each group's two bounds, so the convention (qmax, rounding up, integer
    zero) is the dynamic one."""
    check_request(spec, observer)
    out = {}
    for name, parts, x in (("k", spec.key_parts, k), ("v", spec.value_parts, v)):
        static = [p.stored for p in parts if p.static]
        if not static:
            continue
        p = static[0]  # one per K and V (check_request): every layer's row, used or not
        lo, hi = observe(x, p, observer)
        bounds = torch.cat([lo, hi], 2)  # (L, H|1, 2, G): two "tokens" holding the range
        scale, zero = compute_scales(bounds, p, scale_dtype=torch.float32)  # (L, H|1, 1, G)
        if p.sym:
            # absmax / (absmax / qmax) may round a hair above qmax: one ulp up, so that nothing
            # seen clips.
            up = torch.nextafter(scale, torch.tensor(math.inf))
            scale = torch.where(hi / scale > p.qmax, up, scale)
        out[f"{name}_scale"] = scale
        if zero is not None:
            out[f"{name}_zero"] = zero
    return out


def calibrate(model: Transformer, tokens: list[int], spec: KVSpec, observer: str = "minmax",
              window: int = 1024, progress: bool = False) -> dict[str, torch.Tensor]:
    """Record the model's keys/values over tokens and return what spec calibrates: the means of
    its centered parts, the maps of its smoothed keys, then static scales of what the cache
    stores (centered, smoothed, rotated)."""
    return calibrated(model, tokens, spec, observer, window, progress)[0]


def calibrated(model: Transformer, tokens: list[int], spec: KVSpec, observer: str,
               window: int, progress: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor,
                                                     torch.Tensor]:
    """(the scale file's tensors, keys, values (L, H, T, D) as the cache stores them)."""
    check_request(spec, observer)
    keep_q = any(p.smooth for p in spec.key_parts)
    return scales_from(record(model, tokens, window, keep_q, progress), spec, observer)


def scales_from(rec: Recorder, spec: KVSpec, observer: str = "minmax"
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """What `calibrated` returns, from a recording (with queries when a key part smooths)."""
    k, v = rec.stacked("k"), rec.stacked("v")  # (L, H, T, D) each, as the model makes them
    out = centers_of(k, v, spec)
    if any(p.smooth for p in spec.key_parts):  # fitted to the keys as S meets them: centered
        centered = torch.stack([k[i] - out["k_center"][i, :, None] if kp.center else k[i]
                                for i, (kp, _) in enumerate(spec.layer_parts(len(k)))])
        weight = stored_attention(rec, spec.sink, spec.residual)  # (L, H, T)
        out["k_smooth"] = smooth_maps(centered, rec.stacked("q"), weight)
    L, D = k.shape[0], k.shape[-1]
    transforms = layer_transforms(spec, L, D, out)
    k, v = as_cached(k, "k", transforms), as_cached(v, "v", transforms)
    if any(p.static for p in spec.key_parts + spec.value_parts):
        out.update(static_scales(k, v, spec, observer))
    return out, k, v


def levels_used(model: Transformer, tokens: list[int], spec: KVSpec,
                scales: dict[str, torch.Tensor]) -> dict[str, float]:
    """How much of its format static scales let what the model stores for `tokens` use, per
    static part ('k', 'v'): the 99.9th percentile of |x| / scale over the stored values x (as
    the spec transforms them), in steps of the integer format (fp8: in its smallest normal
    steps, 2^-6). Below 2, nearly every value rounds to zero or one step: scales calibrated on
    far larger values (another model or text), which give garbage without clipping anything."""
    rec = record(model, tokens, window=len(tokens))
    transforms = layer_transforms(spec, model.cfg.n_layers, model.cfg.head_dim, scales)
    out = {}
    for name, p in (("k", spec.k), ("v", spec.v)):
        if not p.static:
            continue
        x = as_cached(rec.stacked(name), name, transforms)  # (L, H, T, D)
        steps = (x / scales[f"{name}_scale"]).abs().flatten()  # scale (L, H|1, 1, G)
        if p.dtype == "fp8":
            steps = steps * 2.0**6
        out[name] = float(quantile(steps[None], 0.999)[0])
    return out


def calibrate_to_file(model: Transformer, tokens: list[int], spec: KVSpec, out: str | Path,
                      observer: str = "minmax", window: int = 1024, vllm_out: str | None = None,
                      plot: str | None = None, progress: bool = True,
                      source: TextSpan | None = None) -> int:
    """Calibrate what the spec takes from a scale file (static scales, centers, key smoothing maps)
    on tokens and save it, with the span of text they are (`source`), and the vLLM export and the
    channel plot when asked; returns the number of tokens observed."""
    check_request(spec, observer, vllm=bool(vllm_out))
    vllm_scheme = vllm_scheme_path(vllm_out) if vllm_out else None
    check_outputs({"out": out, "vllm_out": vllm_out, "plot": plot},
                  derived={"vllm_out scheme": vllm_scheme})
    if plot:
        check_figure_path("plot", plot)
    scales, k, v = calibrated(model, tokens, spec, observer, window, progress)
    save_scales(out, scales, model.cfg, spec, observer, len(tokens), source)
    if vllm_out:
        export_vllm(scales, spec, vllm_out)
    if plot:
        plot_channels(k, v, plot)
    return len(tokens)
