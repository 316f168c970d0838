"""Each layer's sensitivity: how far the model's next-token distributions move when only one
layer's keys (or values) are stored in a candidate format (budget.py turns these into a choice).

On calibration text the model runs exactly, except at the lowered layer: its keys and values
are transformed as the format asks (rot, center, smooth, calibrated on that text), quantized and
dequantized with that format's scales (evaluate.as_stored), and read exact where a cache keeps
them exact (the sink blocks, the residual window; a hot= dtype's rounding of them, which every
layer shares, is left to the end-to-end confirmation). The error is the mean per-token KL
divergence from the exact model's distributions, and beside it the mean increase of the probe's
own next tokens' negative log-likelihood (what perplexity reads; the two can part: clipped
2-bit keys halve the KL of absmax ones and double the NLL increase). Layers before the lowered
one compute what they computed exactly, so each run resumes there. That a lowered layer is what
a real cache with that layer in that format computes is a test (tests/test_budget.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .calibrate import Recorder, scales_from
from .evaluate import as_stored
from .formats import bytes_per_token
from .model import Config, Transformer
from .outputs import write_text
from .quant import Transform, layer_transforms
from .spec import KVSpec, QuantParams


@dataclass
class Sensitivity:
    """The error when only `layer`'s K or V is stored in `part`."""
    layer: int
    which: str  # "k" or "v"
    part: QuantParams
    bits: float  # stored bits per element of the part (data, scales, zero points)
    kl: float  # mean per-token KL(exact || lowered), nats
    nll: float | None = None  # mean increase of the next token's NLL, nats (signed); None: not
    # measured (saved before it was)


def part_bits(cfg: Config, p: QuantParams, block_size: int = 16) -> float:
    """Stored bits per element of one part (data, scales and zero points)."""
    return bytes_per_token(p, cfg.n_kv_heads, cfg.head_dim, block_size) * 8 / (
        cfg.n_kv_heads * cfg.head_dim)


def probe_spec(base: KVSpec, which: str, p: QuantParams) -> KVSpec:
    """Every layer's `which` in p, the other exact: what one candidate is calibrated with."""
    other = QuantParams("fp32")
    k, v = (p, other) if which == "k" else (other, p)
    return KVSpec(k, v, residual=base.residual, sink=base.sink, hot=base.hot)


@dataclass
class _Lowered:
    """One layer stored as a probe spec stores it."""
    layer: int
    transform: Transform
    k: QuantParams
    v: QuantParams
    scales: dict[str, torch.Tensor]  # the probe's static scales, rows per layer


class _Step:
    """A model step (model.KVStep) that attends exactly, as the uncached model does, except at
    the `lowered` layer: its keys and values are transformed and stored as its parts store
    them, exact where a cache keeps them exact (sink blocks, the residual window)."""

    def __init__(self, n: int, spec: KVSpec, block_size: int, device: torch.device):
        self.positions = torch.arange(n, device=device)  # (N,)
        self.logits_idx = None
        self.block_size = block_size
        self.lowered: _Lowered | None = None
        i, j = self.positions[:, None], self.positions[None]  # query, key positions
        self.causal = j <= i  # (N, N)
        sink_tokens = math.ceil(spec.sink / block_size) * block_size
        self.exact = (j < sink_tokens) | (i - j < spec.residual)  # keys a query reads exact

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """q (N, Hq, D), k, v (N, H, D) -> o (N, Hq, D)."""
        low = self.lowered
        n_rep = q.shape[1] // k.shape[1]
        if low is None or layer != low.layer:
            q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # (1, heads, N, D)
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1), is_causal=True)
            return o[0].transpose(0, 1)
        t = low.transform
        q, k, v = t.queries(q), t.keys(k), t.values(v)
        k_st, v_st = self._stored(k, low.k, "k"), self._stored(v, low.v, "v")  # (H, N, D)
        qh = q.transpose(0, 1)  # (Hq, N, D)
        kh, ksh, vh, vsh = (x.repeat_interleave(n_rep, 0) for x in  # (Hq, N, D) each
                            (k.transpose(0, 1), k_st, v.transpose(0, 1), v_st))
        scores = torch.where(self.exact, qh @ kh.mT, qh @ ksh.mT) / math.sqrt(q.shape[-1])
        probs = scores.masked_fill(~self.causal, float("-inf")).softmax(-1)  # (Hq, N, N)
        o = (probs * self.exact) @ vh + (probs * ~self.exact) @ vsh  # (Hq, N, D)
        return t.output(o.transpose(0, 1))

    def _stored(self, x: torch.Tensor, p: QuantParams, name: str) -> torch.Tensor:
        """x (N, H, D) as a cache stores it in p: (H, N, D)."""
        low = self.lowered
        scale, zero = low.scales.get(f"{name}_scale"), low.scales.get(f"{name}_zero")
        if p.static:
            scale = scale[low.layer]
            zero = None if zero is None else zero[low.layer]
        return as_stored(x.transpose(0, 1), p, self.block_size, scale, zero)


def _resume(model: Transformer, x: torch.Tensor, first: int, step: _Step) -> torch.Tensor:
    """The model from block `first` on, x (N, dim) that block's input -> logits (N, V): the
    tail of Transformer.forward, so that layers a lowering cannot change are not run again."""
    cos = sin = None
    if model.pos_embed is None:  # RoPE: (N, 1, hd) broadcasts over heads
        cos = model.rope_cos[step.positions].unsqueeze(-2).to(x.dtype)
        sin = model.rope_sin[step.positions].unsqueeze(-2).to(x.dtype)
    for block in model.layers[first:]:
        x = block(x, cos, sin, step)
    return model.lm_head(model.norm(x)).float()


def _exact_run(model: Transformer, win: list[int], step: _Step
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The exact model over one window: log-probabilities (N, V) and each block's input."""
    inputs = []  # (N, dim) each

    def keep_input(block: torch.nn.Module, args: tuple) -> None:
        inputs.append(args[0])

    hooks = [b.register_forward_pre_hook(keep_input) for b in model.layers]
    try:
        logits = model(torch.tensor(win, device=step.positions.device), step)  # (N, V)
    finally:
        for h in hooks:
            h.remove()
    return logits.float().log_softmax(-1), inputs


@torch.inference_mode()
def sensitivities(model: Transformer, rec: Recorder, probe: list[int], base: KVSpec,
                  candidates: list[tuple[str, QuantParams]], window: int = 1024,
                  block_size: int = 16, progress: bool = False,
                  observer: str = "minmax") -> list[Sensitivity]:
    """Every layer's error under every candidate (module docstring): transforms and static
    scales (by `observer`) calibrated on the recording `rec` (with queries), errors measured
    over the windows of `probe`."""
    L, D = model.cfg.n_layers, model.cfg.head_dim
    probes = []  # (which, part, transforms, scales)
    for which, p in candidates:
        spec = probe_spec(base, which, p)
        scales = scales_from(rec, spec, observer)[0] if spec.needs_scales else {}
        probes.append((which, p, layer_transforms(spec, L, D, scales), scales))
    dev = next(model.parameters()).device
    kl = np.zeros((L, len(probes)))
    nll = np.zeros((L, len(probes)))
    wins = [probe[s:s + window] for s in range(0, len(probe), window)]
    bar = tqdm(total=len(wins) * L * len(probes), desc="sensitivity", disable=not progress)
    for win in wins:
        step = _Step(len(win), base, block_size, dev)
        ref, inputs = _exact_run(model, win, step)
        nexts = torch.tensor(win[1:], device=dev)[:, None]  # (N - 1, 1) each prediction's token
        ref_next = ref[:-1].gather(1, nexts)  # (N - 1, 1) the exact model's log-probabilities
        for layer in range(L):
            for c, (which, p, transforms, scales) in enumerate(probes):
                k, v = (p, QuantParams("fp32")) if which == "k" else (QuantParams("fp32"), p)
                step.lowered = _Lowered(layer=layer, transform=transforms[layer], k=k, v=v,
                                        scales=scales)
                logp = _resume(model, inputs[layer], layer, step).log_softmax(-1)
                kl[layer, c] += (ref.exp() * (ref - logp)).sum(-1).sum().item()
                nll[layer, c] += (ref_next - logp[:-1].gather(1, nexts)).sum().item()
                bar.update()
        step.lowered = None
    bar.close()
    kl /= sum(len(w) for w in wins)
    nll /= max(1, sum(len(w) - 1 for w in wins))
    return [Sensitivity(layer=layer, which=which, part=p, bits=part_bits(model.cfg, p, block_size),
                        kl=float(kl[layer, c]), nll=float(nll[layer, c]))
            for layer in range(L) for c, (which, p, _, _) in enumerate(probes)]


def save(path: str | Path, sens: list[Sensitivity], base: KVSpec,
         observer: str = "minmax") -> None:
    """Sensitivities as JSON, with the sinks and window they were measured under and the
    observer of their static scales."""
    rows = [{"layer": s.layer, "which": s.which, "part": str(s.part), "bits": s.bits,
             "kl": s.kl, "nll": s.nll} for s in sens]
    text = json.dumps({"residual": base.residual, "sink": base.sink, "hot": base.hot,
                       "observer": observer, "sensitivities": rows})
    write_text(path, text + "\n")


def load(path: str | Path, base: KVSpec, observer: str = "minmax") -> list[Sensitivity]:
    """What `save` wrote, refused unless measured under base's sinks and window (they change
    every error) and, where a part is static, with this observer (it sets those scales)."""
    try:
        saved = json.loads(Path(path).read_text())
        sens = [Sensitivity(layer=r["layer"], which=r["which"], part=QuantParams.parse(r["part"]),
                            bits=r["bits"], kl=r["kl"], nll=r.get("nll"))
                for r in saved["sensitivities"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a sensitivities file ({e})") from None
    was_hot = saved.get("hot", "")
    if (saved["residual"], saved["sink"], was_hot) != (base.residual, base.sink, base.hot):
        raise ValueError(f"{path} was measured with residual={saved['residual']}, "
                         f"sink={saved['sink']}, hot={was_hot or 'the model dtype'}, not those "
                         f"of '{base}'")
    was = saved.get("observer", "minmax")
    if was != observer and any(s.part.static for s in sens):
        raise ValueError(f"{path}'s static parts were measured with --observer {was}, "
                         f"not {observer}")
    return sens
