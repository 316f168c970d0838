"""llama.cpp as a peer, `python -m tinykv bench peers`: the same weights, prompts and threads.

- The weights: the default model's folder holds the GGUF that fetch.py converted (Q4_1, its
  embedding Q8_0). Every tensor is dequantized and written back as an F32 GGUF
  (`write_f32_gguf`), with its metadata and llama.cpp's own Q/K row order, into a temporary
  folder removed after the run. fetch.py's converter reads that F32 GGUF back, and each tensor
  must equal model.safetensors exactly (`same_weights`): both engines multiply the same numbers.
- With --packed-weights both engines read the GGUF's own 4- and 8-bit blocks: llama.cpp the GGUF
  itself (checked as above: its blocks dequantize to model.safetensors exactly), tinykv every
  linear layer packed from those numbers (packed.py keeps a layer only where its codes give back
  every weight bit for bit). Each engine's roofline counts the weight bytes it reads.
- Speed: per context, the same prompt (cut from the text) is prefilled once by every engine
  (tinykv per KV spec, llama.cpp per cache type), then decoded for `rounds` rounds of `new` greedy
  tokens, the engines taking turns in a rotated order, so drift hits each alike; one decode step
  after the prefill is untimed in both. Decode tok/s is the median round.
- Quality: perplexity with each llama.cpp cache type on the same text and windows, from its logits
  through llama-cpp-python, beside tinykv's specs of the same bits.

Without llama-cpp-python (the `peers` extra) the llama.cpp columns say how to get them.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import inspect
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from .. import evaluate
from ..cache import make_cache
from ..generate import Engine, Sampling
from ..model import Transformer
from ..outputs import write_text
from .peer_weights import check_packed, gguf_weight_bytes, same_weights, source_gguf, write_f32_gguf

HOW_TO_GET = "pip install -e '.[peers]'"
# llama.cpp's cache types (ggml type ids) and the tinykv spec of about the same bits
LLAMA_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}
SAME_BITS = {"f16": "fp16", "q8_0": "int8", "q4_0": "int4"}
# bytes per stored element: q8_0 keeps 32 int8 codes and an fp16 scale per block, q4_0 32 nibbles
LLAMA_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
Tick = Callable[[str], None]


def llama_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


# ---- llama.cpp -----------------------------------------------------------------------------------
def load_llama(path: Path, cache: str, n_ctx: int, threads: int, logits_all: bool = False):
    """A llama-cpp-python model with a `cache` KV type. Flash attention is on for the quantized
    types (a quantized V cache needs it) and off for f16, the binding's default (on, f16 decoded
    at half the speed here at 4096 tokens). Quantized weights skip AMX (without_amx)."""
    from llama_cpp import Llama

    kw = dict(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
              n_threads_batch=threads, type_k=LLAMA_TYPES[cache], type_v=LLAMA_TYPES[cache],
              logits_all=logits_all, verbose=False)
    params = inspect.signature(Llama.__init__).parameters
    flash = flash_attn(cache)
    if "flash_attn" in params:
        kw["flash_attn"] = flash
    else:  # newer bindings name it by llama.cpp's enum (0: disabled, 1: enabled)
        kw["flash_attn_type"] = int(flash)
    with without_amx(path):
        return Llama(**kw)


@contextlib.contextmanager
def without_amx(path: Path):
    """While a Llama loads a quantized GGUF where llama.cpp was built with AMX: its extra buffer
    types off (AMX, repacked weights), as the binding has no flag for them. On an Intel Xeon with
    AMX its AMX copy of the Q4_1 weights crashed the first eval (a segfault); F32 weights never
    go there. The binding reads the default model parameters through its module at each load."""
    import gguf
    import llama_cpp

    f32 = gguf.LlamaFileType.ALL_F32
    quantized = gguf.GGUFReader(path).fields["general.file_type"].contents() != f32
    default = llama_cpp.llama_cpp.llama_model_default_params
    if not (quantized and amx_built()):
        yield
        return

    def params():
        p = default()
        p.use_extra_bufts = False
        return p
    llama_cpp.llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = default


def amx_built() -> bool:
    """Whether the installed llama.cpp uses AMX on this CPU (its system info says AMX_INT8 = 1)."""
    import llama_cpp

    return b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info()


def flash_attn(cache: str) -> bool:
    """Whether llama.cpp runs a `cache` KV type with flash attention (load_llama)."""
    return cache != "f16"


class LlamaRunner:
    """One llama.cpp context holding one prompt: prefill, then greedy decode steps."""

    def __init__(self, path: Path, cache: str, prompt: list[int], *, n_ctx: int, threads: int):
        self.llm = load_llama(path, cache, n_ctx, threads)
        self.new_ids: list[int] = []
        t0 = time.perf_counter()
        self.llm.eval(prompt)
        self.prefill_s = time.perf_counter() - t0
        self.step()  # the first decode step, untimed

    def step(self) -> None:
        logits = self.llm._ctx.get_logits_ith(-1)  # the last evaluated row (n_vocab floats)
        row = np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),))
        self.new_ids.append(int(row.argmax()))
        self.llm.eval(self.new_ids[-1:])


class TinyRunner:
    """One tinykv engine holding one prompt under one spec: prefill, then greedy decode steps."""

    def __init__(self, model: Transformer, spec: str, prompt: list[int], new: int):
        self.cache = make_cache(model.cfg, spec, tokens=len(prompt) + new + 8, max_seqs=1)
        self.eng = Engine(model, self.cache, max_batch=1)
        self.rid = self.eng.add(prompt, Sampling(temperature=0, max_new_tokens=new + 4))
        while self.eng.stats.decode_tokens == 0:
            self.eng.step()  # the prompt in chunks, then one decode step (untimed)
        self.prefill_s = self.eng.stats.prefill_s
        self.bytes_per_token = self.cache.bytes_per_token

    def step(self) -> None:
        self.eng.step()

    @property
    def new_ids(self) -> list[int]:
        return self.eng.requests[self.rid].new_ids


# ---- speed ---------------------------------------------------------------------------------------
def time_context(model: Transformer, gguf: Path | None, prompt: list[int], cfg: dict,
                 tick: Tick) -> list[dict]:
    """Rows (engine, kv, prefill_s, decode tok/s per round) at one context; gguf None: tinykv
    only. Engines take turns, a round each, in an order rotated every round."""
    specs, threads, rounds, new = cfg["specs"], cfg["threads"], cfg["rounds"], cfg["new"]
    runners: dict[tuple[str, str], object] = {}
    for spec in specs:
        runners["tinykv", spec] = TinyRunner(model, spec, prompt, rounds * new + 2)
        tick(f"{len(prompt)} tokens: tinykv {spec} prefill")
    n_ctx = len(prompt) + rounds * new + 8
    for cache in cfg["llama_kv"] if gguf is not None else []:
        runners["llama.cpp", cache] = LlamaRunner(gguf, cache, prompt, n_ctx=n_ctx,
                                                  threads=threads)
        tick(f"{len(prompt)} tokens: llama.cpp {cache} prefill")
    order = list(runners)
    speeds: dict[tuple[str, str], list[float]] = {name: [] for name in order}
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            t0 = time.perf_counter()
            for _ in range(new):
                runners[name].step()
            speeds[name].append(new / (time.perf_counter() - t0))
        tick(f"{len(prompt)} tokens: round {r + 1} of {rounds}")
    rows = []
    for (engine, kv), runner in runners.items():
        per_token = getattr(runner, "bytes_per_token", None)
        if per_token is None:
            per_token = 2 * model.cfg.n_layers * model.cfg.n_kv_heads * model.cfg.head_dim \
                * LLAMA_BYTES[kv]
        rows.append({"engine": engine, "kv": kv, "context": len(prompt),
                     "prefill_s": runner.prefill_s,
                     "decode_tok_s": statistics.median(speeds[engine, kv]),
                     "decode_tok_s_all": speeds[engine, kv], "kv_bytes_per_token": per_token,
                     "kv_tokens_mean": len(prompt) + 1 + rounds * new / 2,
                     "new_ids": runner.new_ids[:new]})
        if engine == "tinykv":
            runner.cache.close()
    return rows


def add_roofline(rows: list[dict], weight_bytes: dict[str, int], bandwidth: float) -> None:
    """Each row's roofline: tok/s if a step read its engine's weights (weight_bytes by engine) and
    its mean KV bytes at the measured bandwidth, and the share of it the engine reached."""
    for r in rows:
        step_bytes = weight_bytes[r["engine"]] + r["kv_tokens_mean"] * r["kv_bytes_per_token"]
        r["roofline_tok_s"] = bandwidth * 1e9 / step_bytes
        if r["decode_tok_s"] is not None:
            r["pct_roofline"] = 100 * r["decode_tok_s"] / r["roofline_tok_s"]


def ratios(rows: list[dict]) -> list[dict]:
    """Per context, each tinykv spec over each llama.cpp cache type (decode tok/s), and each
    engine's prefill time over its own 16-bit cache's."""
    out = []
    for ctx in dict.fromkeys(r["context"] for r in rows):
        at = {(r["engine"], r["kv"]): r for r in rows if r["context"] == ctx}
        row = {"context": ctx}
        for (engine, kv), r in at.items():
            if engine != "tinykv" or r["decode_tok_s"] is None:
                continue
            for (other, cache), p in at.items():
                if other == "llama.cpp" and p["decode_tok_s"]:
                    row[f"{kv} / llama {cache}"] = r["decode_tok_s"] / p["decode_tok_s"]
        ours, theirs = at.get(("tinykv", "fp16")), at.get(("llama.cpp", "f16"))
        if ours and theirs and theirs.get("new_ids"):  # greedy, 16-bit caches: the same tokens?
            pairs = list(zip(ours["new_ids"], theirs["new_ids"]))
            row["same greedy tokens (fp16, f16)"] = next(
                (i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
        for (engine, kv), r in at.items():
            base = at.get((engine, "fp16" if engine == "tinykv" else "f16"))
            if base and r["prefill_s"] and base["prefill_s"]:
                row[f"prefill {engine} {kv} / 16-bit"] = r["prefill_s"] / base["prefill_s"]
        out.append(row)
    return out


# ---- quality -------------------------------------------------------------------------------------
def ppl_llama(gguf: Path, cache: str, tokens: list[int], window: int, threads: int) -> float:
    """llama.cpp's perplexity over non-overlapping windows of `tokens` with a `cache` KV type: each
    window evaluated from an empty cache, every position's next token scored from its logits."""
    llm = load_llama(gguf, cache, window, threads, logits_all=True)
    nll, n = 0.0, 0
    for start in range(0, len(tokens) - 1, window):
        win = tokens[start:start + window]
        if len(win) < 2:
            break
        llm.reset()
        llm.eval(win)
        logits = torch.from_numpy(np.array(llm.scores[:len(win) - 1], dtype=np.float32))
        nll += torch.nn.functional.cross_entropy(logits, torch.tensor(win[1:]),
                                                 reduction="sum").item()
        n += len(win) - 1
    return math.exp(nll / n)


def quality(model: Transformer, gguf: Path | None, tokens: list[int], cfg: dict,
            tick: Tick) -> dict:
    """Perplexity per llama.cpp cache type and per tinykv spec of the same bits, same windows."""
    window, chunk, threads = cfg["window"], cfg["chunk"], cfg["threads"]
    rows = []
    for cache in cfg["llama_kv"]:
        spec = SAME_BITS[cache]
        with make_cache(model.cfg, spec, tokens=window, max_seqs=1,
                        max_step_tokens=chunk) as kv:
            r = evaluate.perplexity(model, kv, tokens, window, chunk)
        rows.append({"engine": "tinykv", "kv": spec, "ppl": r.ppl})
        tick(f"perplexity tinykv {spec}")
        ppl = None if gguf is None else ppl_llama(gguf, cache, tokens, window, threads)
        rows.append({"engine": "llama.cpp", "kv": cache, "ppl": ppl})
        tick(f"perplexity llama.cpp {cache}")
    return {"tokens": len(tokens), "window": window, "chunk": chunk, "rows": rows}


# ---- the whole run -------------------------------------------------------------------------------
def missing_rows(contexts: list[int], cfg, caches: list[str]) -> list[dict]:
    """The llama.cpp rows without the extra: no numbers, and how to get them."""
    per_token = {c: 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * b
                 for c, b in LLAMA_BYTES.items()}
    return [{"engine": "llama.cpp", "kv": cache, "context": ctx, "prefill_s": None,
             "decode_tok_s": None, "decode_tok_s_all": [], "kv_bytes_per_token": per_token[cache],
             "kv_tokens_mean": ctx, "note": HOW_TO_GET}
            for ctx in contexts for cache in caches]


def collect(model: Transformer, weights: Path, ids: list[int], cfg: dict,
            tick: Tick) -> dict:
    """Every measurement of a run (cfg: contexts, specs, threads, rounds, new, ppl_tokens, window,
    chunk, ppl), llama.cpp's where llama-cpp-python is installed."""
    from .ceilings import measure_bandwidth, weight_bytes

    have = llama_available()
    out = {"config": {**cfg, "llama_cpp": _version() if have else None,
                      "llama_amx_off": amx_built() and cfg["packed"] if have else None,
                      "flash_attn": {c: flash_attn(c) for c in cfg["llama_kv"]},
                      "how_to_get": None if have else HOW_TO_GET}}
    # Weight bytes a step reads: float32 in both engines, or each its own packing of the blocks
    out["weight_bytes"] = weight_bytes(model)
    out["llama_weight_bytes"] = out["weight_bytes"]
    src = source_gguf(weights) if have or cfg["packed"] else None
    if cfg["packed"]:
        out["llama_weight_bytes"] = gguf_weight_bytes(src)
    with tempfile.TemporaryDirectory(prefix="tinykv-peers-") as tmp:
        gguf = None
        if have:
            if cfg["packed"]:  # llama.cpp reads the blocks tinykv packed
                gguf = src
                out["gguf"] = {"source": src.name, "packed": True}
            else:
                gguf = Path(tmp) / "model-f32.gguf"
                out["gguf"] = {"source": src.name, "tensors": write_f32_gguf(src, gguf)}
            out["gguf"].update(same_weights(gguf, weights))
            tick(f"{gguf.name} checked against {weights}")
            if not out["gguf"]["all_equal"]:
                raise ValueError(f"the tensors of {gguf.name} differ from {weights}: "
                                 f"{out['gguf']}")
        for spec in cfg["specs"]:  # compile the kernels (numba) before anything is timed
            TinyRunner(model, spec, ids[:40], 2).cache.close()
        out["bandwidth"] = measure_bandwidth(cfg.get("bw_mib", 512), 3)
        rows = []
        for ctx in cfg["contexts"]:
            rows += time_context(model, gguf, ids[:ctx], cfg, tick)
        if not have:
            rows += missing_rows(cfg["contexts"], model.cfg, cfg["llama_kv"])
        engine_bytes = {"tinykv": out["weight_bytes"], "llama.cpp": out["llama_weight_bytes"]}
        add_roofline(rows, engine_bytes, out["bandwidth"]["gb_s"])
        out["rows"], out["ratios"] = rows, ratios(rows)
        if cfg["ppl"]:
            tokens = ids[cfg["offset"]:cfg["offset"] + cfg["ppl_tokens"]]
            out["quality"] = quality(model, gguf, tokens, cfg, tick)
    return out


def _version() -> str:
    return importlib.metadata.version("llama_cpp_python")


def _cell(x: float | None, fmt: str, missing: str = "-") -> str:
    return missing if x is None else format(x, fmt)


def _ratio(x: float | int | None) -> str:
    """A ratio as '1.23x'; a count (the same greedy tokens) as is; '-' where none."""
    if x is None:
        return "-"
    return str(x) if isinstance(x, int) else f"{x:.2f}x"


def render(res: dict) -> str:
    """The tables: decode tok/s and prefill per engine and context, the ratios, perplexity."""
    from .common import md_table

    bw, packed = res["bandwidth"], res["config"].get("packed")
    weights = f"{res['weight_bytes'] / 1e6:.0f} MB (float32, both engines)"
    if packed:
        weights = (f"tinykv {res['weight_bytes'] / 1e6:.0f} MB (packed), llama.cpp "
                   f"{res['llama_weight_bytes'] / 1e6:.0f} MB (the GGUF's blocks)")
    out = [f"`{res.get('command', 'bench peers')}`: {res['machine']['cpu']}, "
           f"{res['config']['threads']} thread(s); read bandwidth {bw['gb_s']:.1f} GB/s; "
           f"weights read per step {weights}.", ""]
    if "gguf" in res:
        g = res["gguf"]
        read = f"{g['source']} itself" if packed else f"an F32 GGUF of {g['source']}"
        out += [f"llama.cpp {res['config']['llama_cpp']} on {read}: {g['equal']} of "
                f"{g['in_gguf']} tensors equal to model.safetensors.", ""]
    rows = [[f"{r['engine']} `{r['kv']}`", r["context"],
             _cell(r["decode_tok_s"], ".1f", r.get("note", "-")),
             _cell(r.get("pct_roofline"), ".0f") + ("%" if r.get("pct_roofline") else ""),
             _cell(r["prefill_s"], ".2f")] for r in res["rows"]]
    if rows:  # none with --no-speed
        out += md_table(["engine / KV", "context", "decode tok/s", "% roofline", "prefill s"], rows)
    names = list(dict.fromkeys(k for r in res["ratios"] for k in r if k != "context"))
    decode = [k for k in names if not k.startswith("prefill ")]  # tok/s ratios, token check
    for keys in (decode, [k for k in names if k.startswith("prefill ")]):
        if keys:
            rat = [[r["context"]] + [_ratio(r.get(k)) for k in keys] for r in res["ratios"]]
            out += [""] + md_table(["context"] + keys, rat)
    if "quality" in res:
        q = res["quality"]
        ppl = [[f"{r['engine']} `{r['kv']}`", _cell(r["ppl"], ".3f", HOW_TO_GET)]
               for r in q["rows"]]
        out += ["", f"Perplexity over {q['tokens']} tokens, windows of {q['window']} (tinykv "
                f"fed in chunks of {q['chunk']}):", ""]
        out += md_table(["engine / KV", "perplexity"], ppl)
    return "\n".join(out)


def chart(res: dict, path: Path) -> str | None:
    """Decode tok/s as grouped bars per context, each bar's roofline marked."""
    from .charts import grouped_bars

    contexts = list(dict.fromkeys(r["context"] for r in res["rows"]))
    if not contexts:  # perplexity only (--no-speed): no speed to chart
        return None
    series = {}
    for r in res["rows"]:
        name = f"{r['engine']} {r['kv']}"
        series.setdefault(name, {})[r["context"]] = r
    bars = [(name, [by.get(c, {}).get("decode_tok_s") for c in contexts],
             [by.get(c, {}).get("roofline_tok_s") for c in contexts])
            for name, by in series.items()]
    title = f"decode, batch 1, {res['config']['threads']} thread(s), {res['machine']['cpu']}"
    if res["config"].get("packed"):
        title += "; both engines on the GGUF's 4-/8-bit weights"
    return grouped_bars(path, [f"context {c}" for c in contexts], bars, "decode tokens/s", title)


def run(model: Transformer, weights: Path, text: str, contexts: list[int], specs: list[str],
        rounds: int, new: int, threads: int, ppl: bool, out: Path, command: str,
        window: int = 1024, offset: int = 0, ppl_tokens: int = 4096, chunk: int = 16,
        llama_kv: list[str] | None = None, packed: bool = False) -> dict:
    """The whole peer benchmark; writes the JSON (under a temporary name, then renamed) and the
    chart beside it, prints the tables. Contexts are cut so that the decode rounds fit the
    model; perplexity reads ppl_tokens tokens of the text from `offset`. packed: every linear
    layer must read packed codes (--packed-weights), and llama.cpp reads the source GGUF."""
    import json
    import sys

    from ..tokenizer import Tokenizer
    from .common import machine_info, repeat_to

    out = Path(out)
    if packed:
        check_packed(model)
    room = model.cfg.max_seq_len - rounds * new - 8
    if room < 2:
        raise ValueError(f"{rounds} rounds of {new} tokens leave no room for a prompt in the "
                         f"model's {model.cfg.max_seq_len}-token context")
    contexts = list(dict.fromkeys(min(c, room) for c in contexts))
    ids = repeat_to(Tokenizer.from_dir(weights).encode(text[:2_000_000]),
                    max(contexts + [offset + ppl_tokens]))

    def tick(what: str) -> None:
        print(f"[peers] {what}", file=sys.stderr, flush=True)

    cfg = dict(contexts=contexts, specs=specs, threads=threads, rounds=rounds, new=new,
               ppl=ppl, offset=offset, ppl_tokens=ppl_tokens, window=window, chunk=chunk,
               llama_kv=llama_kv or list(LLAMA_TYPES), packed=packed)
    res = {"command": command, "machine": machine_info(torch.device("cpu")),
           "weights": str(weights)}
    res.update(collect(model, Path(weights), ids, cfg, tick))
    res["chart"] = chart(res, out.with_suffix(".png"))
    write_text(out, json.dumps(res, indent=1), make_folders=True)
    print(render(res))
    print(f"[tinykv] results in {out}" + (f", {res['chart']}" if res["chart"] else ""))
    return res
