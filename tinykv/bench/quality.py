"""`python -m tinykv bench quality`: what each KV spec costs in quality beside what it saves in
bytes. One row per spec: stored bytes per token, the tokens a sequence holds at the passkey
length (an evicting spec holds its budget), perplexity through the real cache, and passkey
accuracy. Perplexity averages over every token and hides a fact that is gone; the passkey
column shows it. Every spec sees the same tokens and the same prompts (seeded keys)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..cache import make_cache
from ..evaluate import perplexity
from ..model import Transformer
from ..outputs import write_text
from ..passkey import run_passkey
from ..pools import block_bytes
from ..spec import KVSpec
from ..tokenizer import Tokenizer


@dataclass
class QualityRow:
    kv: str
    bytes_per_token: float  # K and V over all layers, scales included (the store's formula)
    held_tokens: int  # tokens a sequence of `passkey_length` keeps (its budget when evicting)
    ppl: float | None  # None when perplexity was not asked for
    passkey_found: int | None
    passkey_trials: int | None


def bytes_of(model: Transformer, spec: KVSpec, block_size: int = 16) -> float:
    """Stored bytes per token under `spec`: the pool's formula (pools.block_bytes), no cache."""
    dtype = next(model.parameters()).dtype  # skipped layers store the model's dtype
    return block_bytes(model.cfg, spec, block_size, dtype) / block_size


def measure(model: Transformer, tok: Tokenizer, spec: KVSpec, tokens: list[int] | None,
            window: int, chunk: int, lengths: list[int], depths: int, trials: int,
            scales: dict | None, filler: str | None) -> QualityRow:
    """One spec's row: perplexity over `tokens` (None: skipped) and passkey over `lengths`
    (empty: skipped)."""
    p = next(model.parameters())
    ppl = None
    if tokens:
        with make_cache(model.cfg, spec, tokens=window, scales=scales, max_step_tokens=chunk,
                        device=p.device, dtype=p.dtype) as cache:
            with torch.inference_mode():
                ppl = perplexity(model, cache, tokens, window, chunk).ppl
    found = n_trials = None
    if lengths:
        res = run_passkey(model, tok, spec, lengths, depths, trials, text=filler, scales=scales)
        found = sum(t.found for t in res.trials)
        n_trials = len(res.trials)
    longest = max(lengths) if lengths else window
    held = min(longest, spec.budget) if spec.evict else longest
    return QualityRow(str(spec), bytes_of(model, spec), held, ppl, found, n_trials)


def table(rows: list[QualityRow]) -> str:
    """Markdown: one row per spec, perplexity also as a change from the first row's."""
    base = rows[0].ppl if rows else None
    lines = ["| KV spec | bytes/token | tokens held | perplexity | vs first | passkey |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ppl = rel = key = ""
        if r.ppl is not None:
            ppl = f"{r.ppl:.3f}"
            if base and r is not rows[0]:
                rel = f"{100 * (r.ppl / base - 1):+.1f}%"
        if r.passkey_trials:
            key = f"{r.passkey_found}/{r.passkey_trials}"
        lines.append(f"| {r.kv} | {r.bytes_per_token:.0f} | {r.held_tokens} | {ppl} | {rel} "
                     f"| {key} |")
    return "\n".join(lines)


def run(model: Transformer, path: Path, specs: list[KVSpec], tokens: list[int] | None,
        window: int, chunk: int, lengths: list[int], depths: int, trials: int,
        scales_for: Callable[[KVSpec], dict | None], filler: str | None, out: str | Path,
        command: str, progress: Callable[[str], None] = print) -> list[QualityRow]:
    """Every spec's row, printed as it comes and as a table at the end; the JSON goes to `out`."""
    tok = Tokenizer.from_dir(path)
    rows = []
    for spec in specs:
        row = measure(model, tok, spec, tokens, window, chunk, lengths, depths, trials,
                      scales_for(spec), filler)
        rows.append(row)
        progress(f"[tinykv] {json.dumps(asdict(row))}")
    report = {"command": command, "window": window, "chunk": chunk,
              "ppl_tokens": len(tokens) if tokens else 0, "passkey_lengths": lengths,
              "passkey_depths": depths, "passkey_trials": trials,
              "rows": [asdict(r) for r in rows]}
    write_text(out, json.dumps(report, indent=1) + "\n", make_folders=True)
    print(table(rows))
    return rows
