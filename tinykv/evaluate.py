"""Quality of a KV spec: perplexity with every token attending to the cache as stored, and a
layer-by-layer attention-error report.

Perplexity: the tokens are cut into non-overlapping windows of W tokens (the last one may be
shorter). Each window is a fresh sequence in a real PagedKVCache, fed C tokens per step with
logits for every token, so each prediction attends to keys and values exactly as the cache holds
them at that moment (quantized, or still in full precision in a tail/residual/sink block). Within
a window, token i + 1 is predicted from tokens 0..i; the first token of each window is not
predicted. No context crosses a window boundary, so numbers are comparable between specs and with
`reference_perplexity` (same windows, no cache) but not with sliding-window perplexities. C = 1 is
exact decode; a larger C is faster, but a chunk's queries see its keys/values still unquantized in
hot blocks (optimistic for per-block specs). fp32 storage equals the uncached model to float
precision.

Attention error: on the first window, each layer's exact post-RoPE q, k, v are recorded from the
uncached model (so every layer sees exact inputs and the error is that layer's own). K and V are
then stored the way the cache holds them once the whole window is written: dynamic scales per
token or group, per block for tensor/head/channel (the partial tail block stays exact), static
scales from the file, sink and residual blocks exact. Per layer, averaged over heads and queries:
  kl_k    KL(p || p~) between attention probabilities with exact and stored keys
  cos_k   1 - cos(o, o~) between attention outputs with stored keys only (values exact)
  cos_v   the same with stored values only: probabilities are untouched, the error goes straight
          out
  cos_kv  both stored, as in the cache
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .cache import PagedKVCache
from .calibrate import as_cached, record
from .model import Transformer
from .plots import pyplot, save_figure
from .quant import Transform, compute_scales, dequantize, layer_transforms, quantize
from .spec import KVSpec, QuantParams

SAMPLE_TEXT = Path(__file__).resolve().parent / "data" / "sample.txt"  # shipped, our own prose


class EvalError(ValueError):
    """A user mistake in an evaluation request (missing text, bad window); one line."""


@dataclass
class EvalResult:
    """One perplexity measurement under one KV spec; with the model's own (uncached) predictions
    as reference, their KL divergence and top-1 agreement."""
    kv: str  # the spec, canonical
    ppl: float
    nll: float  # mean negative log-likelihood per predicted token, nats
    tokens: int  # predicted tokens
    windows: int
    window: int
    chunk: int
    # exact, from the pool's tensors; static scales (once per layer) are not counted
    kv_bytes_per_token: float
    saturated: int  # values clipped by static scales
    seconds: float
    kl: float | None = None  # mean KL(model || cache) per predicted token, nats
    top1: float | None = None  # share of predictions whose likeliest token is the model's
    ref_ppl: float | None = None  # the uncached model's perplexity over the same windows
    # standard error of the mean per-token NLL change from the reference, nats: ppl / ref_ppl is
    # exp(nll - ref_nll) within about exp(+-delta_se)
    delta_se: float | None = None


@dataclass
class _Tally:
    """Sums over one cache's predictions."""
    nll: float = 0.0
    n: int = 0
    kl: float = 0.0
    agree: int = 0
    ref_nll: float = 0.0
    delta_sq: float = 0.0  # sum of squared per-token NLL changes
    seconds: float = 0.0


def tokens_of(text: str, model_dir: str | Path, offset: int = 0,
              max_tokens: int | None = None) -> list[int]:
    """Tokenize a text with the model's tokenizer; keep tokens[offset:offset + max_tokens]."""
    from .tokenizer import Tokenizer

    ids = Tokenizer.from_dir(model_dir).encode(text)
    end = offset + max_tokens if max_tokens else None
    ids = ids[offset:end]
    if len(ids) < 2:
        raise EvalError(f"the text has {len(ids)} tokens after --offset/--max-tokens; "
                        "at least 2 are needed")
    return ids


def _windows(model: Transformer, tokens: list[int], window: int) -> list[list[int]]:
    """Non-overlapping windows of tokens; one too short to predict anything (< 2) is dropped."""
    limit = model.cfg.max_seq_len
    if not 2 <= window <= limit:
        raise EvalError(f"window {window} must be in 2..{limit} (the model's context)")
    windows = [tokens[start:start + window] for start in range(0, len(tokens), window)]
    return [w for w in windows if len(w) >= 2]


def _nll_sum(logits: torch.Tensor, targets: list[int]) -> float:
    """Summed negative log-likelihood of targets under the first len(targets) rows of logits."""
    t = torch.tensor(targets, dtype=torch.long, device=logits.device)  # may be empty (chunk 1)
    nll = F.cross_entropy(logits[:len(targets)].float(), t, reduction="none")
    return nll.double().sum().item()


def perplexity(model: Transformer, cache: PagedKVCache, tokens: list[int], window: int = 1024,
               chunk: int = 256, progress: bool = False, reference: bool = False) -> EvalResult:
    """Perplexity of tokens with every window fed through `cache` (see the module docstring);
    with `reference`, also KL and top-1 agreement against the uncached model."""
    return compare(model, [cache], tokens, window, chunk, progress, reference)[0]


def compare(model: Transformer, caches: list[PagedKVCache], tokens: list[int], window: int = 1024,
            chunk: int = 256, progress: bool = False, reference: bool = True) -> list[EvalResult]:
    """Perplexity under each cache, every one fed the same windows. With `reference`, each
    window also goes once through the uncached model (which an fp32 cache equals to float
    precision), and each prediction's next-token distribution is compared with the model's:
    KL(model || cache) and whether their likeliest tokens agree."""
    if chunk < 1:
        raise EvalError(f"chunk {chunk} must be >= 1")
    wins = _windows(model, tokens, window)
    dev = next(model.parameters()).device
    tallies = [_Tally() for _ in caches]
    bar = tqdm(total=len(caches) * sum(len(w) for w in wins), unit="tok", disable=not progress,
               desc=f"eval {', '.join(str(c.spec) for c in caches)}"[:60])
    for win in wins:
        ref = None
        if reference:
            ref = model(torch.tensor([win], device=dev))[0].float().log_softmax(-1)  # (W, V)
        for cache, tally in zip(caches, tallies):
            t0 = time.perf_counter()
            _feed(model, cache, win, chunk, ref, tally)
            tally.seconds += time.perf_counter() - t0
            bar.update(len(win))
    bar.close()
    return [_result(cache, t, len(wins), window, chunk, reference)
            for cache, t in zip(caches, tallies)]


def _feed(model: Transformer, cache: PagedKVCache, win: list[int], chunk: int,
          ref: torch.Tensor | None, tally: _Tally) -> None:
    """One window through the cache, C tokens a step; its predictions added to `tally`."""
    dev = next(model.parameters()).device
    cache.add_sequence(0)
    for start in range(0, len(win), chunk):
        feed = win[start:start + chunk]
        plan = cache.plan([0], [feed], logits="all")
        logits = model(torch.tensor(feed, device=dev), plan)  # (len(feed), V)
        cache.commit(plan)
        targets = win[start + 1:start + chunk + 1]  # the next token of each fed one, in the window
        tally.nll += _nll_sum(logits, targets)
        tally.n += len(targets)
        if ref is not None and targets:
            _against(logits[:len(targets)], ref[start:start + len(targets)], targets, tally)
    cache.free(0)


def _against(logits: torch.Tensor, ref: torch.Tensor, targets: list[int], tally: _Tally) -> None:
    """Compare predictions (n, V) with the model's log-probabilities ref (n, V)."""
    logp = logits.float().log_softmax(-1)  # (n, V)
    tally.kl += (ref.exp() * (ref - logp)).sum(-1).double().sum().item()
    tally.agree += int((ref.argmax(-1) == logp.argmax(-1)).sum())
    rows = torch.arange(len(targets))
    t = torch.tensor(targets, device=ref.device)
    delta = (ref[rows, t] - logp[rows, t]).double()  # (n,) NLL change of each prediction
    tally.ref_nll -= ref[rows, t].double().sum().item()
    tally.delta_sq += (delta * delta).sum().item()


def _result(cache: PagedKVCache, t: _Tally, windows: int, window: int, chunk: int,
            reference: bool) -> EvalResult:
    if not math.isfinite(t.nll):
        raise EvalError(f"perplexity under '{cache.spec}' is not finite: the cache overflowed or "
                        "its scales are unusable")
    out = EvalResult(kv=str(cache.spec), ppl=math.exp(t.nll / t.n), nll=t.nll / t.n,
                     tokens=t.n, windows=windows, window=window, chunk=chunk,
                     kv_bytes_per_token=cache.bytes_per_token, saturated=cache.saturated,
                     seconds=t.seconds)
    if reference:
        mean = (t.nll - t.ref_nll) / t.n
        var = max(t.delta_sq / t.n - mean * mean, 0.0)
        out.kl, out.top1 = t.kl / t.n, t.agree / t.n
        out.ref_ppl, out.delta_se = math.exp(t.ref_nll / t.n), math.sqrt(var / t.n)
    return out


def reference_perplexity(model: Transformer, tokens: list[int], window: int = 1024) -> float:
    """The same windows through the uncached model: what an fp32 cache must reproduce."""
    dev = next(model.parameters()).device
    nll, n = 0.0, 0
    for win in _windows(model, tokens, window):
        logits = model(torch.tensor([win], device=dev))[0]
        nll += _nll_sum(logits, win[1:])
        n += len(win) - 1
    return math.exp(nll / n)


# ---- attention error ----------------------------------------------------------------------------
def _exact_mask(T: int, spec: KVSpec, bs: int) -> torch.Tensor:
    """(T,) True where the cache still holds a token in full precision once T tokens are written."""
    j = torch.arange(T) // bs  # logical block of each token
    exact = j < math.ceil(spec.sink / bs)  # sink blocks
    if spec.residual:  # the blocks of the residual window
        exact |= (j + 1) * bs > T - spec.residual
    if spec.block_wise:  # the partial tail block, awaiting its scales
        exact |= j >= T // bs
    return exact


def as_stored(x: torch.Tensor, p: QuantParams, bs: int = 16, scale: torch.Tensor | None = None,
              zero: torch.Tensor | None = None) -> torch.Tensor:
    """x (H, T, D) quantized and dequantized as the cache's store pool would (ignoring hot
    blocks)."""
    if p.is_float:
        return x.to(p.storage_dtype).float()

    def roundtrip(y: torch.Tensor, s: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
        codes, _ = quantize(y, p, s, z, count=False)
        return dequantize(codes, p, s, z)

    if p.static:
        return roundtrip(x, scale, zero)
    if not p.block_wise:  # per token (or per group of a token): scales from the token alone
        return roundtrip(x, *compute_scales(x, p))
    H, T, D = x.shape
    nb = T // bs  # scales per full block; the partial tail has none yet (it stays exact)
    xb = x[:, :nb * bs].reshape(H, nb, bs, D).transpose(0, 1)  # (nb, H, bs, D)
    y = roundtrip(xb, *compute_scales(xb, p))
    y = y.transpose(0, 1).reshape(H, nb * bs, D)
    return torch.cat([y, x[:, nb * bs:]], 1)


def attention_error(model: Transformer, tokens: list[int], spec: KVSpec, block_size: int = 16,
                    static_scales: dict[str, torch.Tensor] | None = None
                    ) -> list[dict[str, float]]:
    """Per layer: kl_k, cos_k, cos_v, cos_kv over the first window `tokens` (see the module
    docstring)."""
    rec = record(model, tokens, window=len(tokens), keep_q=True)
    # Errors are measured on what the cache stores (rotated, centered: quant.Transform), and on
    # outputs turned back into the model's space.
    transforms = layer_transforms(spec, model.cfg.n_layers, model.cfg.head_dim, static_scales)
    Q, K, V = (as_cached(rec.stacked(w), w, transforms) for w in "qkv")  # (L, heads, T, D)
    parts = spec.layer_parts(model.cfg.n_layers)  # skipped layers: fp32, exact
    exact = _exact_mask(K.shape[2], spec, block_size)[None, :, None]  # (1, T, 1)
    scales = static_scales or {}
    out = []
    for layer in range(K.shape[0]):
        k_st, v_st = (torch.where(exact, x, _stored_layer(x, p, name, layer, block_size, scales))
                      for x, p, name in zip((K[layer], V[layer]), parts[layer], "kv"))
        errors = _layer_errors(Q[layer], (K[layer], V[layer]), (k_st, v_st), transforms[layer])
        out.append({"layer": layer, **errors})
    return out


def _stored_layer(x: torch.Tensor, p: QuantParams, name: str, layer: int, block_size: int,
                  scales: dict[str, torch.Tensor]) -> torch.Tensor:
    """One layer's keys or values x (H, T, D) as the store pool holds them (static scales, if
    any, from this layer's row of the file)."""
    scale, zero = scales.get(f"{name}_scale"), scales.get(f"{name}_zero")
    return as_stored(x, p, block_size, None if scale is None else scale[layer],
                     None if zero is None else zero[layer])


def _layer_errors(q: torch.Tensor, exact: tuple[torch.Tensor, torch.Tensor],
                  stored: tuple[torch.Tensor, torch.Tensor], t: Transform) -> dict[str, float]:
    """One layer's errors: queries q (Hq, T, D) against exact and stored (keys, values), each
    (H, T, D), repeated here for the query heads."""
    n_rep = q.shape[0] // exact[0].shape[0]
    k, v, k_st, v_st = (x.repeat_interleave(n_rep, 0) for x in (*exact, *stored))  # (Hq, T, D)
    causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool).tril()
    logp, logp_st = _causal_log_probs(q, k, causal), _causal_log_probs(q, k_st, causal)
    probs, probs_st = logp.exp(), logp_st.exp()  # (Hq, T, T)
    # (Hq, T); masked out where 0 * (-inf - -inf) is NaN
    kl = (probs * (logp - logp_st)).masked_fill(~causal, 0.0).sum(-1)
    o = probs @ v
    return {"kl_k": kl.mean().item(), "cos_k": _one_minus_cos(probs_st @ v, o, t),
            "cos_v": _one_minus_cos(probs @ v_st, o, t),
            "cos_kv": _one_minus_cos(probs_st @ v_st, o, t)}


def _causal_log_probs(q: torch.Tensor, k: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """Causal attention log-probabilities of q over k (Hq, T, D) each: (Hq, T, T)."""
    scores = (q @ k.transpose(1, 2)) / math.sqrt(k.shape[-1])
    return scores.masked_fill(~causal, float("-inf")).log_softmax(-1)


def _one_minus_cos(a: torch.Tensor, b: torch.Tensor, t: Transform) -> float:
    """Outputs (Hq, T, D) over stored values compared as the layer outputs them."""
    a, b = t.output(a.transpose(0, 1)), t.output(b.transpose(0, 1))  # (T, Hq, D)
    return (1 - F.cosine_similarity(a, b, dim=-1)).mean().item()


# ---- reporting ----------------------------------------------------------------------------------
def plot_sweep(results: list[EvalResult], path: str | Path) -> None:
    """PNG: perplexity against KV bytes per token, one labelled point per spec."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.scatter([r.kv_bytes_per_token for r in results], [r.ppl for r in results])
    for r in results:
        ax.annotate(r.kv, (r.kv_bytes_per_token, r.ppl), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    ax.set(xscale="log", xlabel="KV bytes per token",
           ylabel=f"perplexity (windows of {results[0].window})")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)
