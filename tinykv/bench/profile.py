"""`python -m tinykv bench profile`: where a decode step's time goes, tinykv beside transformers.

Wall time per decoded token (batch 1, greedy, after a prompt of --prompt tokens) split into the
linear layers (every `model.Linear`, and a layer's `project` and `finish` (gemv_layer.py), where
the weights are read once per token, with the norms, RoPE, SwiGLU and residual adds they fuse),
the cache's `write` (quantize on store) and `attend`, and the rest (sampling, Python);
transformers' step into its linear layers (F.linear) and the rest, from its first new token to its
last. Timers wrap those functions for the run only.

Then the linear layers alone: the model's weight matrices, with a few activation rows each
(--linear-rows), through F.linear and through the product the model chose (gemv.py), and where
weights are packed (--packed-weights) through that product on the float32 weights too,
interleaved, with the bytes each path reads, the read rate, and the multiply-adds a second
beside the FMA peak (bench/ceilings.py): one row is bound by the reads, many by the arithmetic.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from ..cache import PagedKVCache, make_cache
from ..generate import Engine, Sampling
from ..model import Linear, Transformer
from ..packed import packed_arrays, packed_bytes
from ..pools import KVPools
from .ceilings import fma_peak
from .common import specs_that_fit

PARTS = ["linear", "cache.write", "cache.attend"]
_RUNNING: set[str] = set()  # the keys `timing` is inside now


@contextmanager
def timing(owner: object, name: str, acc: Counter, key: str) -> Iterator[None]:
    """While inside, every call of owner.name adds its wall time to acc[key] (seconds), once: a
    call inside another timed under the same key (a Linear inside `finish`) is not added again."""
    fn, own = getattr(owner, name), name in vars(owner)  # not own: the class's, on an instance

    def timed(*a, **kw):
        if key in _RUNNING:
            return fn(*a, **kw)
        _RUNNING.add(key)
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            _RUNNING.discard(key)
            acc[key] += time.perf_counter() - t0

    setattr(owner, name, timed)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, fn)
        else:
            delattr(owner, name)


def time_linear(stack: ExitStack, model: Transformer, acc: Counter, key: str = "linear") -> None:
    """Timers (in `stack`) on every linear layer, with the norm, SwiGLU and residual it fuses
    (gemv.linear_cpu), and on each layer's two fused calls (gemv_layer: their norms and RoPE
    too), all into acc[key]."""
    stack.enter_context(timing(Linear, "forward", acc, key))
    for block in model.layers:
        stack.enter_context(timing(block.attn, "project", acc, key))
        stack.enter_context(timing(block, "finish", acc, key))


def time_parts(stack: ExitStack, model: Transformer, acc: Counter,
               keys: tuple[str, str, str] = ("linear", "cache.write", "cache.attend")) -> None:
    """Timers (in `stack`) on a step's linear layers, its K/V stores and its attention, into
    acc[keys[i]]: through the per-layer path (time_linear, KVPools.write, PagedKVCache.attend)
    and through the direct one (gemv_layer's compiled calls, DirectLayers' store and attend)."""
    from .. import gemv_layer

    linear, store, attend = keys
    time_linear(stack, model, acc, linear)
    if gemv_layer.AVAILABLE:
        from ..kernels.cpu_direct import DirectLayers

        for name in gemv_layer.LAYER_CALLS:
            stack.enter_context(timing(gemv_layer, name, acc, linear))
        stack.enter_context(timing(DirectLayers, "store", acc, store))
        stack.enter_context(timing(DirectLayers, "attend", acc, attend))
    stack.enter_context(timing(KVPools, "write", acc, store))
    stack.enter_context(timing(PagedKVCache, "attend", acc, attend))


def profile_tinykv(model: Transformer, prompt: list[int], kv: str, n_new: int) -> dict:
    """ms per decoded token, in all and per part, over n_new decode steps after the prompt."""
    weight = next(model.parameters())
    cache = make_cache(model.cfg, kv, tokens=len(prompt) + n_new + 2, max_seqs=1,
                       device=weight.device, dtype=weight.dtype)
    eng = Engine(model, cache, max_batch=1)
    eng.add(prompt, Sampling(temperature=0, max_new_tokens=n_new + 2))
    while eng.stats.decode_tokens == 0:  # the prompt, and one decode step to warm up
        eng.step()
    acc: Counter = Counter()
    with ExitStack() as stack:
        time_parts(stack, model, acc)
        t0, steps = time.perf_counter(), 0
        while eng.running:
            eng.step()
            steps += 1
        total = time.perf_counter() - t0
    return _row("tinykv", kv, len(prompt), total, acc, steps)


class _DecodeClock:
    """A streamer for transformers' generate(), which puts the prompt, then each new token: it
    timestamps each, and clears the timers once the first new token is out, so that they hold
    decode steps only."""

    def __init__(self, acc: Counter):
        self.acc = acc
        self.stamps: list[float] = []

    def put(self, _tokens) -> None:
        self.stamps.append(time.perf_counter())
        if len(self.stamps) == 2:
            self.acc.clear()

    def end(self) -> None:
        pass


def profile_hf(hf, prompt: list[int], n_new: int) -> dict:
    """ms per decoded token of transformers' greedy generate(), in all and in its linear layers."""
    x = torch.tensor([prompt], device=hf.device)
    acc: Counter = Counter()

    def generate(n: int, streamer: _DecodeClock | None = None) -> None:
        hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, streamer=streamer,
                    pad_token_id=hf.generation_config.pad_token_id or 0)

    generate(2)  # warm-up
    clock = _DecodeClock(acc)
    with timing(F, "linear", acc, "linear"):  # nn.Linear looks F.linear up at each call
        generate(n_new + 1, clock)
    decode_s = clock.stamps[-1] - clock.stamps[1]
    return _row("transformers", "default", len(prompt), decode_s, acc, n_new)


def _row(engine: str, kv: str, prompt: int, total: float, acc: Counter, steps: int) -> dict:
    """One printed row: ms per step in all, per timed part, and the rest."""
    ms = {k: acc[k] / steps * 1e3 for k in PARTS if k in acc}
    return {"engine": engine, "kv": kv, "prompt": prompt, "ms_per_token": total / steps * 1e3,
            **ms, "rest": (total - sum(acc.values())) / steps * 1e3}


def run(model: Transformer, weights: Path, text: str, prompts: list[int], n_new: int = 32,
        specs: list[str] | None = None, transformers: bool = True,
        linear_rows: tuple[int, ...] = (1,)) -> list[dict]:
    """Profile rows for each prompt length and spec (and transformers), printed as they come,
    after the linear layers alone at each of `linear_rows`."""
    from ..tokenizer import Tokenizer

    specs = specs or specs_that_fit(["fp16", "int8", "int4"], model.cfg)
    ids = Tokenizer.from_dir(weights).encode(text[:200_000])
    hf = None
    if transformers:
        import transformers as tf

        tf.logging.set_verbosity_error()
        hf = tf.AutoModelForCausalLM.from_pretrained(weights, dtype=model.embed.weight.dtype)
        hf = hf.eval()
    rows = []
    threads = torch.get_num_threads()
    peak = fma_peak(threads=threads)
    print(f"FMA peak {peak:.0f} GFMA/s (float32, {threads} thread{'s' * (threads > 1)})")
    for r in linear_alone(model, linear_rows):
        print(f"linear alone, {r['rows']:>2} rows: {r['path']:45} {r['products']} products, "
              f"{r['weight_bytes'] / 1e6:.0f} MB: {r['ms']:.1f} ms, {r['gb_s']:.1f} GB/s, "
              f"{r['gfma_s']:.1f} GFMA/s ({100 * r['gfma_s'] / peak:.0f}% of the peak)",
              flush=True)
    head = " ".join(f"{k:>12}" for k in PARTS + ["rest"])
    print(f"{'engine / KV':24} {'prompt':>6} {'ms/token':>9} {head}")
    engines = [*specs, *([None] if hf is not None else [])]  # None: transformers
    for n in prompts:
        if n >= len(ids):
            raise ValueError(f"the text has {len(ids)} tokens; --prompt {n} needs more")
        for kv in engines:
            if kv is None:
                r = profile_hf(hf, ids[:n], n_new)
            else:
                r = profile_tinykv(model, ids[:n], kv, n_new)
            rows.append(r)
            parts = " ".join(f"{r[k]:>12.1f}" if k in r else f"{'-':>12}"
                             for k in PARTS + ["rest"])
            print(f"{r['engine'] + ' ' + r['kv']:24} {n:>6} {r['ms_per_token']:>9.1f} {parts}",
                  flush=True)
    return rows


def linear_alone(model: Transformer, rows: tuple[int, ...] = (1,), reps: int = 5) -> list[dict]:
    """The model's linear layers (a decode step's products, the tied head once) with each count
    of activation rows, through F.linear and the model's own product, and, where some weights are
    packed, the model's product on the float32 weights too (a detached view carries no packed
    arrays), interleaved: best total ms of `reps`, the bytes each path reads and their rate, and
    the multiply-adds a second (G)."""
    layers = list(dict.fromkeys(m for m in model.modules() if isinstance(m, Linear)))
    product = layers[0].product
    name = getattr(product, "func", product).__name__  # a partial: the kernel it calls
    plain = {m: m.weight.detach() for m in layers}  # the float32 weights as they are
    as_loaded = {m: m.weight for m in layers}  # packed ones read packed
    float32_bytes = sum(m.weight.nbytes for m in layers)
    macs = sum(m.in_features * m.out_features for m in layers)  # a row's multiply-adds
    read = sum(packed_bytes(w) for w in as_loaded.values())
    paths = {"F.linear": (F.linear, plain, float32_bytes),
             f"model ({name})": (product, as_loaded, read)}
    if any(packed_arrays(w) is not None for w in as_loaded.values()):
        paths[f"model ({name}), float32 weights"] = (product, plain, float32_bytes)
    out = []
    for n in rows:
        xs = {m: torch.randn(n, m.in_features, dtype=m.weight.dtype) for m in layers}
        best = dict.fromkeys(paths, float("inf"))
        with torch.inference_mode():
            for rep in range(reps + 1):  # the first round warms up (JIT, allocator)
                for path, (fn, weights, _) in paths.items():
                    t0 = time.perf_counter()
                    for m in layers:
                        fn(xs[m], weights[m], m.bias)
                    if rep:
                        best[path] = min(best[path], time.perf_counter() - t0)
        out += [{"path": path, "rows": n, "products": len(layers), "weight_bytes": nbytes,
                 "ms": 1e3 * best[path], "gb_s": nbytes / best[path] / 1e9,
                 "gfma_s": n * macs / best[path] / 1e9}
                for path, (_, _, nbytes) in paths.items()]
    return out
