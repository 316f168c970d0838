"""End-to-end benchmark, `python -m tinykv bench`: tinykv beside Hugging Face transformers on the
same weights.

- e2e: batch-1 greedy prefill/decode tokens/s per prompt length, tinykv KV specs beside
  transformers' default and quantized (quanto int4) caches, engines alternating, medians, greedy
  tokens compared; decode tokens/s = (new - 1) / (first new token to last).
- batch: continuous batching vs one by one.
- memory: KV bytes/token and what 256 MiB holds.
- quality: perplexity per spec (tinykv.evaluate).

One JSON, PNG charts, and `render_readme` for the README.
"""

from __future__ import annotations

import importlib.util
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from itertools import zip_longest
from pathlib import Path

import torch

from .. import evaluate
from ..cache import hot_blocks, make_cache
from ..formats import bytes_per_token
from ..generate import Engine, Sampling
from ..model import Config, Transformer
from ..outputs import write_text
from ..plots import save_figure
from ..spec import KVSpec
from .charts import grouped_bars
from .common import machine_info, md_table, repeat_to, specs_that_fit

KIVI = "k=int4:channel:asym,v=int4:g32:asym,residual=64"
DEFAULT_SPECS = ("fp16", "int8", "int4", KIVI)
MEM_SPECS = ["fp32", "fp16", "fp8", "int8", "int4", "int2", KIVI]
BUDGET = 256 * 2**20  # KV bytes, for the memory part
# transformers' defaults otherwise: q_group_size 64, residual_length 128
HF_QUANT = {"backend": "quanto", "nbits": 4}
# e2e: prompt lengths, new tokens, repetitions; batch: batch sizes, the range of prompt lengths,
# new tokens; quality: perplexity tokens and window.
MODES = {
    "full": dict(lengths=[128, 1024, 4096], new=64, reps=3,
                 batches=[16, 64], batch_lens=[32, 512], batch_new=32,
                 ppl_tokens=8192, window=1024),
    "quick": dict(lengths=[128, 1024], new=32, reps=1,
                  batches=[16], batch_lens=[16, 128], batch_new=16,
                  ppl_tokens=2048, window=1024),
}
Tick = Callable[[str], None]  # progress: called once per finished measurement


def _nop(_: str) -> None:
    """The default Tick: no progress shown."""


# ---- measuring -----------------------------------------------------------------------------------
def run_engine(model: Transformer, prompts: list[list[int]], kv: str, n_new: int,
               max_batch: int = 1) -> tuple[Engine, float, list[list[int]]]:
    """Exactly n_new greedy tokens per prompt through one engine and the cache `generate --kv KV`
    would build -> (the engine, seconds, the new tokens of each prompt)."""
    weight = next(model.parameters())
    need = sum(len(x) + n_new for x in prompts)
    with make_cache(model.cfg, kv, tokens=need, max_seqs=min(len(prompts), max_batch),
                    device=weight.device, dtype=weight.dtype) as cache:
        eng = Engine(model, cache, max_batch=max_batch)
        rids = [eng.add(x, Sampling(temperature=0, max_new_tokens=n_new)) for x in prompts]
        t0 = time.perf_counter()
        list(eng.run())
    return eng, time.perf_counter() - t0, [eng.requests[r].new_ids for r in rids]


def time_tinykv(model: Transformer, prompt: list[int], kv: str, n_new: int) -> dict:
    """Batch-1 tokens/s from the engine's own prefill/decode split."""
    eng, _, (new,) = run_engine(model, [prompt], kv, n_new)
    stats = eng.stats
    return {"prefill_tok_s": stats.prefill_tokens / stats.prefill_s,
            "decode_tok_s": stats.decode_tokens / stats.decode_s, "ids": new}


class _Clock:
    """A streamer for transformers' generate() that only timestamps what it is given: the prompt,
    then each new token as it reaches the host."""

    def __init__(self):
        self.stamps: list[float] = []

    def put(self, _tokens) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def time_hf(hf, prompt: list[int], n_new: int, quantized: bool = False) -> dict:
    """transformers' greedy generate() of exactly n_new tokens, with its default or its quantized
    cache."""
    x = torch.tensor([prompt], device=hf.device)
    kw = {}
    if quantized:
        kw = {"cache_implementation": "quantized", "cache_config": dict(HF_QUANT)}
    clock = _Clock()
    t0 = time.perf_counter()
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n_new,
                      min_new_tokens=n_new, do_sample=False,
                      pad_token_id=hf.generation_config.pad_token_id or 0, streamer=clock, **kw)
    t = clock.stamps[1:]  # t[i]: new token i is on the host
    return {"prefill_tok_s": len(prompt) / (t[0] - t0),
            "decode_tok_s": (len(t) - 1) / (t[-1] - t[0]),
            "ids": out[0, len(prompt):].tolist()}


def tokens_match(ours: list[int], ref: list[int]) -> dict:
    """Greedy tokens compared one by one: match, and the first index where they differ (None if
    equal)."""
    pairs = enumerate(zip_longest(ours, ref))
    diff = next((i for i, (a, b) in pairs if a != b), None)
    return {"match": diff is None, "first_diff": diff}


def _interleaved_engines(specs: list[str], hf, hf_quant: bool) -> list[tuple[str, str]]:
    """(engine, kv) pairs in the order they run: tinykv, transformers, tinykv, ..."""
    ours = [("tinykv", s) for s in specs]
    theirs = []
    if hf is not None:
        theirs.append(("transformers", "default"))
        if hf_quant:
            theirs.append(("transformers", "quanto-int4"))
    order = []
    for i in range(max(len(ours), len(theirs))):
        order += ours[i:i + 1] + theirs[i:i + 1]
    return order


def _median_row(engine: str, kv: str, prompt_len: int, n_new: int, runs: list[dict]) -> dict:
    return {"prompt_len": prompt_len, "engine": engine, "kv": kv, "new_tokens": n_new,
            "runs": len(runs),
            "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
            "decode_tok_s_all": [r["decode_tok_s"] for r in runs],
            "ids": runs[0]["ids"]}


def _compare_to_hf(rows: list[dict]) -> None:
    """Each tinykv row gains: the same greedy tokens as transformers? how many times its speed?"""
    for r in rows:
        hf_rows = {x["kv"]: x for x in rows
                   if x["prompt_len"] == r["prompt_len"] and x["engine"] == "transformers"}
        if r["engine"] == "tinykv" and "default" in hf_rows:
            match = tokens_match(r["ids"], hf_rows["default"]["ids"])
            r.update({f"{k}_vs_hf": v for k, v in match.items()})
            for kv, x in hf_rows.items():
                r[f"decode_x_hf_{kv}"] = r["decode_tok_s"] / x["decode_tok_s"]


def bench_e2e(model: Transformer, hf, ids: list[int], lengths: list[int], n_new: int,
              specs: list[str], reps: int, hf_quant: bool, tick: Tick = _nop) -> list[dict]:
    """Rows (prompt_len, engine, kv) of median prefill/decode tokens/s; tinykv rows compared to
    transformers."""
    order = _interleaved_engines(specs, hf, hf_quant)

    def measure(engine: tuple[str, str], prompt: list[int], n: int) -> dict:
        name, kv = engine
        if name == "tinykv":
            return time_tinykv(model, prompt, kv, n)
        return time_hf(hf, prompt, n, quantized=kv != "default")

    for e in order:  # warm-up: first calls (allocators, quanto's kernels) are not what we measure
        measure(e, ids[:160], 3)
        tick(f"warm-up {e[0]} {e[1]}")
    rows = []
    for L in lengths:
        runs: dict = {e: [] for e in order}
        for rep in range(reps):
            shift = rep % len(order)
            for e in order[shift:] + order[:shift]:  # rotated: drift hits every engine
                runs[e].append(measure(e, ids[:L], n_new))
                tick(f"{L} tokens: {e[0]} {e[1]}")
        rows += [_median_row(engine, kv, L, n_new, rs) for (engine, kv), rs in runs.items()]
    _compare_to_hf(rows)
    return rows


def bench_batch(model: Transformer, prompts: list[list[int]], kv: str, n_new: int,
                tick: Tick = _nop) -> dict:
    """The prompts through Engine(max_batch=len(prompts)) and one by one: generated and total
    tokens/s."""
    _, t_b, ids_b = run_engine(model, prompts, kv, n_new, len(prompts))
    tick(f"{len(prompts)} prompts: continuous batching")
    alone = [run_engine(model, [prompt], kv, n_new) for prompt in prompts]
    t_s = sum(seconds for _, seconds, _ in alone)
    ids_s = [new for _, _, (new,) in alone]
    tick(f"{len(prompts)} prompts: one by one")
    new = sum(map(len, ids_b))
    prompt_tokens = sum(map(len, prompts))
    same = sum(a == b for a, b in zip(ids_b, ids_s))
    return {"prompts": len(prompts), "kv": kv, "new_tokens": n_new,
            "prompt_tokens": prompt_tokens, "batched_s": t_b, "sequential_s": t_s,
            "batched_gen_tok_s": new / t_b, "sequential_gen_tok_s": new / t_s,
            "batched_total_tok_s": (new + prompt_tokens) / t_b,
            "sequential_total_tok_s": (new + prompt_tokens) / t_s,
            "speedup": t_s / t_b, "same_tokens": same / len(prompts)}


def bench_memory(cfg: Config, specs: list[str], budget: int = BUDGET, context: int = 1024,
                 block_size: int = 16, dtype: torch.dtype = torch.float32) -> list[dict]:
    """Exact KV bytes/token per spec (the pool's tensors, and the formula), and what `budget`
    bytes hold."""
    rows = []
    for s in specs:
        spec = KVSpec.parse(s)
        cache = make_cache(cfg, spec, blocks=2, block_size=block_size, max_seqs=1,
                           max_step_tokens=block_size, dtype=dtype, attention="torch")
        # full-precision blocks a sequence holds (sink, residual window, tails awaiting scales)
        hot_seq = 0
        if cache.n_hot:
            hot_block = cache.pools.hot.nbytes // cache.n_hot
            hot_seq = hot_block * hot_blocks(spec, block_size, 1, 0)
        per_block = cache.bytes_per_token * block_size
        formula = cfg.n_layers * sum(bytes_per_token(qp, cfg.n_kv_heads, cfg.head_dim, block_size)
                                     for qp in (spec.k, spec.v))
        per_seq = -(-context // block_size) * per_block + hot_seq
        max_context = int((budget - hot_seq) // per_block) * block_size
        rows.append({"kv": str(spec), "bytes_per_token": cache.bytes_per_token,
                     "formula_bytes_per_token": formula, "hot_bytes_per_seq": hot_seq,
                     "max_context": max_context, "max_batch": int(budget // per_seq),
                     "batch_context": context})
    return rows


def bench_quality(model: Transformer, tokens: list[int], specs: list[str], window: int,
                  tick: Tick = _nop) -> dict:
    """Perplexity per spec through the cache (tinykv.evaluate)."""
    rows = []
    weight = next(model.parameters())
    for s in specs:
        with make_cache(model.cfg, s, tokens=window, max_seqs=1, max_step_tokens=256,
                        device=weight.device, dtype=weight.dtype) as cache:
            r = evaluate.perplexity(model, cache, tokens, window, 256)
        rows.append({"kv": r.kv, "ppl": r.ppl, "bytes_per_token": r.kv_bytes_per_token,
                     "tokens": r.tokens})
        tick(f"perplexity {s}")
    return {"window": window, "chunk": 256, "tokens": len(tokens), "rows": rows}


def collect(model: Transformer, hf, ids: list[int], m: dict, specs: list[str],
            batch_kv: str = "int8", hf_quant: bool = False, tick: Tick = _nop,
            mem_specs: list[str] | None = None) -> dict:
    """Every part of the benchmark in mode `m` (see MODES), prompts cut from the token ids `ids`;
    the memory and quality tables over mem_specs (default MEM_SPECS)."""
    mem_specs = MEM_SPECS if mem_specs is None else mem_specs
    need = needed_tokens(m)
    if len(ids) < need:
        raise ValueError(f"the text has {len(ids)} tokens; this benchmark needs {need}")
    if hf is None:
        hf_q = "skipped"
    elif hf_quant:
        hf_q = "quanto int4, q_group_size 64, residual_length 128"
    else:
        hf_q = "not installed (pip install optimum-quanto)"
    out = {"config": {**m, "specs": specs, "batch_kv": batch_kv, "transformers": hf is not None,
                      "transformers_quantized": hf_q}}
    out["e2e"] = bench_e2e(model, hf, ids, m["lengths"], m["new"], specs, m["reps"], hf_quant,
                           tick)
    rng, out["batch"] = random.Random(0), []
    for n in m["batches"]:  # prompts cut one after another from the text, after the e2e prompt
        lens = [rng.randint(*m["batch_lens"]) for _ in range(n)]
        starts = [max(m["lengths"]) + sum(lens[:i]) for i in range(n)]
        prompts = [ids[s:s + k] for s, k in zip(starts, lens)]
        out["batch"].append(bench_batch(model, prompts, batch_kv, m["batch_new"], tick))
    memory = bench_memory(model.cfg, mem_specs, dtype=model.embed.weight.dtype)
    out["memory"] = {"budget_bytes": BUDGET, "rows": memory}
    window = min(m["window"], m["ppl_tokens"])
    out["quality"] = bench_quality(model, ids[:m["ppl_tokens"]], mem_specs, window, tick)
    return out


# ---- reporting -----------------------------------------------------------------------------------
def _name(row: dict) -> str:
    return f"{row['engine']} {row['kv']}"


def _times(row: dict, key: str) -> str:
    """A speed ratio as '1.23x', or '-' where the row has none."""
    return f"{row[key]:.2f}x" if key in row else "-"


def tables(res: dict) -> list[str]:
    """The side-by-side tables: e2e (ratios, token check), batching, memory with perplexity."""
    quality, mem = res["quality"], res["memory"]
    ppl = {r["kv"]: f"{r['ppl']:.3f}" for r in quality["rows"]}
    e2e = [[_name(r), r["prompt_len"], f"{r['prefill_tok_s']:.1f}", f"{r['decode_tok_s']:.2f}",
            _times(r, "decode_x_hf_default"), _times(r, "decode_x_hf_quanto-int4"),
            r.get("match_vs_hf", "-")]
           for r in res["e2e"]]
    batch = [[f"{b['prompts']} prompts", b["kv"], b["new_tokens"],
              f"{b['batched_gen_tok_s']:.1f}", f"{b['sequential_gen_tok_s']:.1f}",
              f"{b['batched_total_tok_s']:.0f}", f"{b['speedup']:.2f}x"]
             for b in res["batch"]]
    memory = [[f"`{r['kv']}`", f"{r['bytes_per_token']:.0f}", r["max_context"], r["max_batch"],
               ppl.get(r["kv"], "-")]
              for r in mem["rows"]]
    e2e_head = ["engine / KV", "prompt", "prefill tok/s", "decode tok/s", "vs transformers",
                "vs transformers int4", "same tokens"]
    batch_head = ["batch", "KV", "new/prompt", "batched gen tok/s", "one by one",
                  "batched total tok/s", "speedup"]
    memory_head = ["KV spec", "bytes/token", f"longest context in {mem['budget_bytes'] >> 20} MiB",
                   f"batch of {mem['rows'][0]['batch_context']}-token seqs", "perplexity"]
    footer = (f"\nPerplexity over {quality['tokens']} tokens of the text, windows of "
              f"{quality['window']}, through the cache.")
    return (md_table(e2e_head, e2e) + [""]
            + md_table(batch_head, batch, right=2) + [""]
            + md_table(memory_head, memory)
            + [footer])


def charts(res: dict, out_dir: Path) -> dict:
    """PNG charts next to the JSON: decode tokens/s by prompt length, perplexity by KV
    bytes/token."""
    try:
        import matplotlib
    except ImportError:
        return {"note": "skipped: matplotlib is not installed (pip install 'tinykv[plot]')"}
    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    def save(fig, ax, key: str) -> str:
        ax.grid(alpha=0.3)
        fig.tight_layout()
        save_figure(fig, out_dir / f"{key}.png", make_folders=True)
        return str(out_dir / f"{key}.png")

    lengths = res["config"]["lengths"]
    series = []
    names = dict.fromkeys(_name(r) for r in res["e2e"])
    for name in sorted(names, key=lambda n: not n.startswith("tinykv")):  # tinykv's bars first
        speed = {r["prompt_len"]: r["decode_tok_s"] for r in res["e2e"] if _name(r) == name}
        series.append((name.replace(KIVI, "KIVI"), [speed.get(n) for n in lengths],
                       [None] * len(lengths)))
    made = {"decode": grouped_bars(out_dir / "decode_tok_s.png", [f"prompt {n}" for n in lengths],
                                   series, "decode tokens/s (batch 1, greedy)",
                                   "decode speed by prompt length, tinykv beside transformers")}
    if res["quality"]["rows"]:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in res["quality"]["rows"]:
            xy = (r["bytes_per_token"], r["ppl"])
            ax.scatter(*xy)
            ax.annotate(r["kv"], xy, fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set(xscale="log", yscale="log", xlabel="KV bytes per token", ylabel="perplexity")
        made["ppl"] = save(fig, ax, "ppl_vs_bytes")
    return made


def render_readme(results: dict | str | Path) -> str:
    """The README's Markdown "Results" section (tables, chart links, machine, command) from
    bench/results.json."""
    res = results if isinstance(results, dict) else json.loads(Path(results).read_text())
    m, c = res["machine"], res["config"]
    gpu = f", {m['gpu']}" if m.get("gpu") else ""
    head = (f"`{res['command']}` on {m['cpu']} ({m['cores']} cores, {m['device']}{gpu}), "
            f"torch {m['torch']}, transformers {m.get('transformers') or '-'}, {m['date']}. "
            f"Greedy, batch 1, {c['new']} new tokens, median of {c['reps']}; "
            f"transformers' quantized cache: {c['transformers_quantized']}.")
    links = [f"![{k}]({v})" for k, v in res.get("charts", {}).items() if k != "note"]
    return "\n".join(["## Results", "", head, ""] + tables(res) + [""] + links) + "\n"


# ---- running it ----------------------------------------------------------------------------------
def _load_transformers(weights: Path, like: torch.Tensor) -> tuple:
    """transformers' model of the same weights (dtype and device as `like`), and whether its
    quantized cache (optimum-quanto) is installed; (None, False) without transformers."""
    if not importlib.util.find_spec("transformers"):
        return None, False
    import transformers as tf

    tf.logging.set_verbosity_error()
    hf = tf.AutoModelForCausalLM.from_pretrained(weights, dtype=like.dtype)
    hf_quant = bool(importlib.util.find_spec("optimum")
                    and importlib.util.find_spec("optimum.quanto"))
    return hf.to(like.device).eval(), hf_quant


def run(model: Transformer, weights: Path, text: str, text_name: str, quick: bool = False,
        specs: list[str] | None = None, reps: int | None = None, transformers: bool = True,
        out: str | Path = "bench/results-new.json", command: str = "python -m tinykv bench",
        batch_kv: str = "int8") -> dict:
    """The whole benchmark on `model` (loaded from `weights`), prompts cut from `text`; writes the
    JSON and charts to `out` and prints the tables."""
    from tqdm import tqdm

    from ..tokenizer import Tokenizer

    left_out: set[str] = set()  # default specs this model's shape does not take
    specs = specs or specs_that_fit(DEFAULT_SPECS, model.cfg, left_out)
    mem_specs = specs_that_fit(MEM_SPECS, model.cfg, left_out)
    mode = fit_context(dict(MODES["quick" if quick else "full"]), model.cfg.max_seq_len)
    if reps:
        mode["reps"] = reps
    ids = Tokenizer.from_dir(weights).encode(text[:1_000_000])
    ids = repeat_to(ids, needed_tokens(mode))
    weight = next(model.parameters())
    hf, hf_quant = _load_transformers(weights, weight) if transformers else (None, False)
    n_eng = len(specs) + (hf is not None) + hf_quant
    total = n_eng * (1 + len(mode["lengths"]) * mode["reps"]) + 2 * len(mode["batches"])
    bar = tqdm(total=total + len(mem_specs), desc="bench", unit="run")

    def tick(what: str) -> None:
        bar.set_postfix_str(what)
        bar.update()

    res = {"command": command, "machine": machine_info(weight.device), "weights": str(weights),
           "text": text_name}
    res.update(collect(model, hf, ids, mode, specs, batch_kv, hf_quant, tick, mem_specs))
    bar.close()
    out = Path(out)
    res["charts"] = charts(res, out.parent)
    write_text(out, json.dumps(res, indent=1), make_folders=True)
    print("\n".join(tables(res)))
    charts_made = "".join(f", {v}" for k, v in res["charts"].items() if k != "note")
    print(f"[tinykv] results in {out}{charts_made}")
    return res


def fit_context(mode: dict, context: int) -> dict:
    """The mode within a model's context: prompt lengths whose prompt and new tokens do not fit
    it are left out (named on stderr), the batches' prompts and the perplexity window shortened
    to fit; a model too short for any length is refused before the slow part."""
    lengths = [n for n in mode["lengths"] if n + mode["new"] < context]
    if not lengths:
        raise ValueError(f"bench: the model's context of {context} tokens holds none of the "
                         f"prompt lengths {mode['lengths']} with {mode['new']} new tokens")
    if len(lengths) < len(mode["lengths"]):
        dropped = [n for n in mode["lengths"] if n not in lengths]
        print(f"[tinykv] prompt lengths {dropped} are left out: the model's context is "
              f"{context} tokens", file=sys.stderr)
    shortest, longest = mode["batch_lens"]
    longest = min(longest, context - mode["batch_new"] - 1)
    return {**mode, "lengths": lengths, "batch_lens": [min(shortest, longest), longest],
            "window": min(mode["window"], context)}


def needed_tokens(mode: dict) -> int:
    """Tokens the prompts of a mode are cut from: the longest e2e prompt, then the batches'."""
    return max(mode["lengths"]) + max(mode["batches"]) * mode["batch_lens"][1]
