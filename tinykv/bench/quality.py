"""`python -m tinykv bench quality`: what each KV spec costs in quality beside what it saves in
bytes. One row per spec: stored bytes per token, bits per element all in at a stated context
(data, scales, zero points, and the sink and window tokens held exact: budget.bits_per_element),
the tokens a sequence holds at the passkey length (an evicting spec holds its budget), and per
text, perplexity through the real cache beside the model's own (uncached fp32), the mean KL of
each next-token distribution from the model's and top-1 agreement; then passkey accuracy.
Perplexity averages over every token and hides a fact that is gone; the passkey column shows it.
Every spec sees the same tokens and the same prompts (seeded keys), and all specs run window by
window together, so the model's own distribution is computed once per window.

Held out by default: a spec that takes scales, means or maps from calibration is scored only on
tokens that did not calibrate it (the command line checks each scale file's recorded text span,
or calibrates on --calibration-text itself).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..budget import bits_per_element
from ..cache import make_cache
from ..evaluate import EvalResult, compare
from ..model import Config, Transformer
from ..outputs import write_text
from ..passkey import run_passkey
from ..plots import plot_pareto
from ..pools import block_bytes
from ..spec import KVSpec
from ..tokenizer import Tokenizer


@dataclass
class TextResult:
    """One spec on one text."""
    text: str  # which text and tokens
    tokens: int  # predicted tokens
    ppl: float
    ref_ppl: float  # the model's own, uncached, over the same windows
    kl: float  # mean KL(model || cache) per prediction, nats
    top1: float  # share of predictions whose likeliest token is the model's
    delta_se: float  # standard error of the mean per-token NLL change, nats

    @property
    def change(self) -> float:
        """Perplexity over the model's, in percent."""
        return 100 * (self.ppl / self.ref_ppl - 1)


@dataclass
class QualityRow:
    kv: str
    bytes_per_token: float  # K and V over all layers, scales included (the store's formula)
    bits_per_element: float  # all in at `context` tokens (budget.bits_per_element)
    held_tokens: int  # tokens a sequence of `passkey_length` keeps (its budget when evicting)
    texts: list[TextResult] = field(default_factory=list)  # empty when perplexity was skipped
    passkey_found: int | None = None
    passkey_trials: int | None = None
    calibration: str | None = None  # what calibrated its scales, means or maps

    @property
    def ppl(self) -> float | None:
        return self.texts[0].ppl if self.texts else None


Scales = tuple[dict | None, str | None]  # a spec's scales and what calibrated them


def bytes_of(model: Transformer, spec: KVSpec, block_size: int = 16) -> float:
    """Stored bytes per token under `spec`: the pool's formula (pools.block_bytes), no cache."""
    dtype = next(model.parameters()).dtype  # skipped layers store the model's dtype
    return block_bytes(model.cfg, spec, block_size, dtype) / block_size


def text_results(model: Transformer, specs: list[KVSpec], scales: list[dict | None],
                 label: str, tokens: list[int], window: int, chunk: int) -> list[TextResult]:
    """Every spec over one text, window by window together (module docstring)."""
    p = next(model.parameters())
    with ExitStack() as stack:
        caches = [stack.enter_context(make_cache(model.cfg, spec, tokens=window, scales=s,
                                                 max_step_tokens=chunk, device=p.device,
                                                 dtype=p.dtype))
                  for spec, s in zip(specs, scales)]
        with torch.inference_mode():
            results = compare(model, caches, tokens, window, chunk)
    return [_text_result(label, r) for r in results]


def _text_result(label: str, r: EvalResult) -> TextResult:
    return TextResult(text=label, tokens=r.tokens, ppl=r.ppl, ref_ppl=r.ref_ppl, kl=r.kl,
                      top1=r.top1, delta_se=r.delta_se)


def table(rows: list[QualityRow]) -> str:
    """Markdown: one row per spec; per text, perplexity, its change over the model's, KL and
    top-1 agreement."""
    labels = [t.text for t in rows[0].texts] if rows and rows[0].texts else []
    head = "| KV spec | bits/element | bytes/token | tokens held |"
    rule = "|---|---:|---:|---:|"
    for i, _ in enumerate(labels):
        head += f" ppl (text {i + 1}) | vs model | KL | top-1 |"
        rule += "---:|---:|---:|---:|"
    lines = [head + " passkey |", rule + "---:|"]
    for r in rows:
        cells = f"| {r.kv} | {r.bits_per_element:.3f} | {r.bytes_per_token:.0f} | {r.held_tokens} |"
        for t in r.texts:
            cells += f" {t.ppl:.3f} | {t.change:+.2f}% | {t.kl:.4f} | {t.top1:.3f} |"
        key = f"{r.passkey_found}/{r.passkey_trials}" if r.passkey_trials else ""
        lines.append(f"{cells} {key} |")
    lines += [f"text {i + 1}: {label}" for i, label in enumerate(labels)]
    return "\n".join(lines)


def run(model: Transformer, path: Path, specs: list[KVSpec],
        texts: list[tuple[str, list[int]]], window: int, chunk: int, lengths: list[int],
        depths: int, trials: int, scales_for: Callable[[KVSpec], Scales], filler: str | None,
        out: str | Path, command: str, context: int = 8192,
        progress: Callable[[str], None] = print, plot: str | None = None) -> list[QualityRow]:
    """Every spec's row over every (label, tokens) text, then passkey, printed as a table at the
    end; the JSON goes to `out`, the chart to `plot`."""
    for spec in specs:  # before any slow work
        spec.check(model.cfg.n_layers, model.cfg.head_dim)
    scales = [scales_for(spec) for spec in specs]
    dtype = next(model.parameters()).dtype
    longest = max(lengths) if lengths else window
    rows = [QualityRow(str(s), bytes_of(model, s), bits_per_element(model.cfg, s, context,
                                                                    dtype=dtype),
                       min(longest, s.budget) if s.evict else longest, calibration=cal)
            for s, (_, cal) in zip(specs, scales)]
    for label, tokens in texts:
        results = text_results(model, specs, [s for s, _ in scales], label, tokens, window,
                               chunk)
        for row, res in zip(rows, results):
            row.texts.append(res)
            progress(f"[tinykv] {row.kv} on {label}: {json.dumps(asdict(res))}")
    tok = Tokenizer.from_dir(path)
    for row, spec, (s, _) in zip(rows, specs, scales):
        if lengths:
            res = run_passkey(model, tok, spec, lengths, depths, trials, text=filler, scales=s)
            row.passkey_found = sum(t.found for t in res.trials)
            row.passkey_trials = len(res.trials)
            progress(f"[tinykv] {row.kv}: passkey {row.passkey_found}/{row.passkey_trials}")
    report = {"command": command, "window": window, "chunk": chunk, "context": context,
              "texts": [label for label, _ in texts], "passkey_lengths": lengths,
              "passkey_depths": depths, "passkey_trials": trials,
              "rows": [asdict(r) for r in rows]}
    write_text(out, json.dumps(report, indent=1) + "\n", make_folders=True)
    print(table(rows))
    if plot and texts:
        chart([report], plot)
    return rows


def chart(reports: list[dict], path: str | Path, earlier: list[dict] | None = None,
          cfg: Config | None = None) -> int:
    """The quality chart (plots.plot_pareto) of the rows of saved reports, measured alike (a spec
    measured twice with the same scales: its last row; with other scales: a point each, its
    scale file named in the key) on the first report's first text (the note names it, its
    window, chunk and context; reports on another text are left out). `earlier`: runs from
    before KL was measured (perplexity alone), charted on the perplexity panel when they fed the
    first text's tokens alike (legacy_rows). Returns the number of specs charted."""
    first = reports[0]
    reports = [r for r in reports if r["texts"][0] == first["texts"][0]]  # other texts: apart
    legacy = [row for run in earlier or [] for row in legacy_rows(run, first, cfg)]
    latest = {(row["kv"], row.get("calibration")): row for report in [{"rows": legacy}, *reports]
              for row in report["rows"]}  # one per spec and scales, the newest measurement
    specs = Counter(kv for kv, _ in latest)
    rows = [{**row, "scales": Path(scales).name} if specs[kv] > 1 and scales else row
            for (kv, scales), row in latest.items()]
    note = (f"{first['texts'][0]}: windows of {first['window']} fed {first['chunk']} tokens a "
            f"step; bits counted at a {first['context']}-token context")
    plot_pareto(rows, path, note)
    return len(rows)


def legacy_rows(run: dict, like: dict, cfg: Config | None) -> list[dict]:
    """The rows of an older run (perplexity only, no KL) as `like`'s rows, when it measured the
    same tokens alike (the first N of the same text file, same window and chunk): bits per
    element counted now, perplexity against the model's own over those windows (like's)."""
    text = like["texts"][0]
    same = (cfg is not None and run.get("ppl_tokens") and "--offset" not in run["command"]
            and text.endswith(f"tokens 0-{run['ppl_tokens']}") and text.split()[0] in
            run["command"] and (run.get("window"), run.get("chunk")) ==
            (like["window"], like["chunk"]))
    if not same:
        return []
    ref_ppl = like["rows"][0]["texts"][0]["ref_ppl"]
    return [{"kv": r["kv"], "bits_per_element": bits_per_element(cfg, KVSpec.parse(r["kv"]),
                                                                 like["context"]),
             "texts": [{"ppl": r["ppl"], "ref_ppl": ref_ppl, "kl": None}]}
            for r in run["rows"] if r.get("ppl")]
