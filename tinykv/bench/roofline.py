"""Roofline benchmark, `python -m tinykv bench roofline`: how close decoding comes to memory speed.

For each torch thread count, in one run:
- bandwidth: the machine's read bandwidth, the best of torch's GEMV, tinykv's (gemv.py) and a sum
  over a large matrix;
- attention: KV bytes one decode token reads (slots x bytes_per_token, all layers) over the time
  of `cache.attend` in every layer, batch 1, per spec and context;
- decode: whole model decode steps at batch x context shapes, tinykv per spec (the specs' steps
  taken in turn, so their ratios come from the same moments) beside transformers' default and
  quanto int4 caches; % of roofline = (weight + KV bytes) / bandwidth / step time;
  then as many steps again with timers on tinykv's parts (linear layers, attention, the store and
  the rest), for the breakdown chart (the timers cost a little, so the plain steps give tok/s).
Caches are filled with synthetic keys and values, not a real prefill: decode speed does not
depend on what the cached values are, and a 32k-token prefill takes minutes per point on a CPU.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import torch

from ..cache import PagedKVCache, make_cache
from ..model import Config, Transformer
from ..outputs import write_text
from ..scalefile import load_scales
from ..spec import KVSpec
from . import attention
from .ceilings import (
    fma_peak,
    linear_macs,
    measure_bandwidth,
    packed_matrices,
    seconds,
    set_threads,
    weight_bytes,
)
from .charts import roofline_charts
from .common import machine_info, specs_that_fit, time_in_turn
from .e2e import DEFAULT_SPECS, HF_QUANT
from .roofline_report import PARTS, chart_label, ratios, render

MODES = {
    "full": dict(bw_mib=512, bw_reps=5, contexts=[1024, 4096, 8192], attn_reps=7,
                 shapes=[(1, 4096), (1, 8192), (16, 1024), (16, 2048), (64, 512)], steps=5,
                 quick_kernel=False),
    "quick": dict(bw_mib=64, bw_reps=2, contexts=[256, 512], attn_reps=3,
                  shapes=[(1, 512), (4, 256)], steps=2, quick_kernel=True),
}
FILL_CHUNK = 512  # tokens per synthetic fill step: what the cache's hot pool is sized for
Tick = Callable[[str], None]


def _progress(what: str) -> None:
    """The default Tick: one line on stderr per finished measurement (the tables go to stdout)."""
    print(f"[roofline] {what}", file=sys.stderr, flush=True)


def synthetic_kv(n: int, heads: int, dim: int, gen: torch.Generator) -> tuple:
    """Random k, v (n, heads, dim) shaped like real ones: keys carry a few large channel offsets
    (the outlier channels per-channel key scales exist for), values are plain normal."""
    offset = torch.zeros(heads, dim)  # (H, D)
    offset[:, :4] = 8.0 * torch.randn(heads, 4, generator=gen)
    k = torch.randn(n, heads, dim, generator=gen) + offset
    v = torch.randn(n, heads, dim, generator=gen)
    return k, v


def fill(cache: PagedKVCache, seq_ids: list[int], context: int, gen: torch.Generator) -> None:
    """Put `context` tokens of synthetic keys and values in each sequence, without the model: plan
    the slots, write every layer, commit (which quantizes finished full-precision blocks)."""
    cfg = cache.cfg
    for sid in seq_ids:
        cache.add_sequence(sid)
        done = 0
        while done < context:
            n = min(FILL_CHUNK, context - done)
            tokens = torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist()
            plan = cache.plan([sid], [tokens])
            k, v = synthetic_kv(n, cfg.n_kv_heads, cfg.head_dim, gen)  # (n, H, D)
            for layer in range(cfg.n_layers):  # the same values in every layer: speed is blind
                cache.pools.write(layer, k, v, plan.slots)
            cache.commit(plan)
            done += n


def scales_for(cfg: Config, spec: str, path: str | Path | None) -> dict | None:
    """The calibration a spec's cache needs (centers, smoothing maps, static scales) from the
    scale file at `path`, or None where it needs none."""
    kv = KVSpec.parse(spec)
    if path is None or not kv.needs_scales:
        return None
    return load_scales(path, cfg, kv)


@torch.inference_mode()
def bench_attention(cfg: Config, spec: str, context: int, reps: int, bandwidth: float,
                    scales: str | Path | None = None) -> dict:
    """ms of `cache.attend` over all layers for one decode token after `context` cached ones
    (scales: the scale file of a spec that needs one)."""
    gen = torch.Generator().manual_seed(context)
    with make_cache(cfg, spec, tokens=context + 1, max_seqs=1, device="cpu",
                    dtype=torch.float32, scales=scales_for(cfg, spec, scales)) as cache:
        fill(cache, [0], context, gen)
        filled = cache.slots(0)
        plan = cache.plan([0], [[5]])
        k, v = synthetic_kv(1, cfg.n_kv_heads, cfg.head_dim, gen)  # (1, H, D)
        for layer in range(cfg.n_layers):  # the decode token's own slot holds a real key
            cache.pools.write(layer, k, v, plan.slots)
        q = torch.randn(1, cfg.n_heads, cfg.head_dim, generator=gen)  # (1, Hq, D)

        def step() -> None:
            for layer in range(cfg.n_layers):
                cache.attend(layer, q, plan)

        t = statistics.median(seconds(step, reps))
        slots = cache.slots(0)
        kv_bytes = slots * cache.bytes_per_token
        return {"kv": spec, "context": context, "filled": filled, "slots": slots,
                "bytes_per_token": cache.bytes_per_token, "kv_bytes": kv_bytes, "ms": 1e3 * t,
                "gb_s": kv_bytes / t / 1e9, "pct_bandwidth": 100 * kv_bytes / t / 1e9 / bandwidth,
                "attention": cache.kernels.name}


def _row(engine: str, kv: str, batch: int, context: int, measured: tuple, w_bytes: int,
         bandwidth: float, linear: tuple = (0, 0.0)) -> dict:
    """A decode row from (step times, mean KV bytes, parts' ms per step or None): median step
    time, tok/s, the roofline's, and the share of it reached. linear: (multiply-adds a token,
    the FMA peak of the threads in GFMA/s): the linear layers' rate beside that peak, the bound
    their bytes give way to once a batch makes many multiply-adds of each weight (16x1024)."""
    times, kv_bytes, parts = measured
    t = statistics.median(times)
    roof = (w_bytes + kv_bytes) / (bandwidth * 1e9)  # seconds at the measured bandwidth
    row = {"engine": engine, "kv": kv, "batch": batch, "context": context, "ms": 1e3 * t,
           "ms_all": [1e3 * x for x in times], "tok_s": batch / t, "kv_bytes": kv_bytes,
           "weight_bytes": w_bytes, "roofline_ms": 1e3 * roof, "roofline_tok_s": batch / roof,
           "pct_roofline": 100 * roof / t}
    if parts is not None:
        row["parts_ms"] = parts
        macs, peak = linear
        if macs and peak and parts["linear"] > 0:
            row["linear_gfma_s"] = batch * macs / parts["linear"] / 1e6
            row["linear_pct_fma_peak"] = 100 * row["linear_gfma_s"] / peak
    return row


@torch.inference_mode()
def decode_tinykv(model: Transformer, specs: list[str], batch: int, context: int,
                  steps: int, scales: str | Path | None = None) -> dict:
    """spec -> (step seconds, mean KV bytes per step, the parts' ms per step): `steps` real decode
    steps (plan, model, commit; one more untimed first) of `batch` sequences holding `context`
    synthetic tokens, the specs' steps taken in turn so that a slow moment of a shared machine
    falls on all of them alike; then `steps` more per spec with the parts timed. scales: the
    scale file of the specs that need one."""
    seq_ids = list(range(batch))
    tokens = torch.full((batch,), 5, dtype=torch.long)  # (B,)
    with ExitStack() as stack:
        caches = {}
        for spec in specs:
            gen = torch.Generator().manual_seed(batch * context)  # the same tokens for each
            caches[spec] = stack.enter_context(make_cache(
                model.cfg, spec, tokens=batch * (context + 2 * steps + 1), max_seqs=batch,
                device="cpu", dtype=torch.float32, scales=scales_for(model.cfg, spec, scales)))
            fill(caches[spec], seq_ids, context, gen)

        def step(cache: PagedKVCache) -> None:
            plan = cache.plan(seq_ids, [[5]] * batch)
            model(tokens, plan)
            cache.commit(plan)

        def held(cache: PagedKVCache) -> float:
            return sum(cache.slots(s) for s in seq_ids) * cache.bytes_per_token

        times = time_in_turn({s: partial(step, c) for s, c in caches.items()},
                            {s: partial(held, c) for s, c in caches.items()}, steps)
        return {s: (*times[s], _time_parts(model, partial(step, caches[s]), steps))
                for s in specs}


def _time_parts(model: Transformer, step: Callable[[], None], steps: int) -> dict:
    """ms per step of the linear layers, attention, the store and the rest, over `steps` more
    steps with timers on (bench profile's)."""
    from .profile import time_parts

    acc: Counter = Counter()
    with ExitStack() as stack:
        time_parts(stack, model, acc, ("linear", "store", "attention"))
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        total = time.perf_counter() - t0
    parts = {k: 1e3 * acc[k] / steps for k in PARTS[:3]}
    return parts | {"rest": 1e3 * total / steps - sum(parts.values())}


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds; a wrapper subclass (quanto's packed codes) is the sum of its parts."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.nbytes


@torch.inference_mode()
def decode_hf(hf, batch: int, context: int, steps: int, quantized: bool) -> tuple:
    """Like decode_tinykv for transformers: its default (or quanto int4) cache given `context`
    synthetic tokens per layer through `update`, then forwards of one token per sequence; the
    cache grows by a token a step, as in generate()."""
    import transformers as tf

    c = hf.config
    gen = torch.Generator().manual_seed(batch * context)
    if quantized:
        cache = tf.QuantizedCache(HF_QUANT["backend"], c, nbits=HF_QUANT["nbits"])
    else:
        cache = tf.DynamicCache(config=c)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    k, v = synthetic_kv(batch * context, c.num_key_value_heads, head_dim, gen)  # (B*T, H, D)
    k = k.view(batch, context, -1, head_dim).transpose(1, 2).contiguous()  # (B, H, T, D)
    v = v.view(batch, context, -1, head_dim).transpose(1, 2).contiguous()
    for layer in range(c.num_hidden_layers):  # shared by every layer until its first step
        cache.update(k, v, layer)
    # transformers 5 names the argument `cache`; 4.x `past_key_values`
    params = inspect.signature(hf.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    ids = torch.full((batch, 1), 5, dtype=torch.long)  # (B, 1)
    taken = [0]  # steps so far: the next token's position past the context

    def step() -> None:
        pos = torch.full((batch, 1), context + taken[0], dtype=torch.long)  # (B, 1)
        hf(input_ids=ids, position_ids=pos, use_cache=True, **{cache_kw: cache})
        taken[0] += 1

    def held() -> float:
        out = 0
        for lay in cache.layers:  # full-precision states, and quanto's codes and scales
            for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
                if isinstance(getattr(lay, name, None), torch.Tensor):
                    out += tensor_bytes(getattr(lay, name))
        return out

    return (*time_in_turn({"hf": step}, {"hf": held}, steps)["hf"], None)


def kernel_table(specs: list[str], mode: dict, threads: int, tick: Tick) -> dict | None:
    """One layer call of the CPU attention kernel per spec and decode shape, beside the machine's
    ceilings and the touch of its exact layout (attention.py); None without numba."""
    if not attention.AVAILABLE:
        return None
    out = attention.collect(specs, mode["shapes"], [threads], mode["attn_reps"],
                            attention.budget_bytes(mode.get("quick_kernel", True)))  # else small
    tick(f"{threads} threads: the attention kernel beside its ceilings")
    return out


def collect(model: Transformer, hf, mode: dict, specs: list[str], threads: list[int],
            tick: Tick = _progress, scales: str | Path | None = None) -> dict:
    """Every measurement of `mode` (see MODES) at each thread count; hf None: tinykv only;
    scales: the scale file of the specs that need one."""
    hf_q = hf is not None and importlib.util.find_spec("optimum.quanto") is not None
    hf_kinds = [] if hf is None else [("default", False)]  # (name, quantized) caches timed
    if hf_q:
        hf_kinds.append(("quanto-int4", True))
    w_bytes, macs = weight_bytes(model), linear_macs(model)
    out = {"config": {**mode, "specs": specs, "threads": threads, "transformers": hf is not None,
                      "transformers_quantized": hf_q, "packed_weights": packed_matrices(model)},
           "weight_bytes": w_bytes, "runs": []}
    for n in threads:
        set_threads(n)
        bw = measure_bandwidth(mode["bw_mib"], mode["bw_reps"])
        # the threads' FMA loops at once: a shared host may give less than n times one's
        fma = fma_peak(threads=n) if attention.AVAILABLE else 0.0
        tick(f"{n} threads: bandwidth and FMA peak")
        # the kernel table's pools are synthetic, one format pair a spec: not per-layer specs
        kernel = kernel_table([s for s in specs if not KVSpec.parse(s).per_layer], mode, n,
                              tick)
        attn = []
        for spec in specs:
            for ctx in mode["contexts"]:
                attn.append(bench_attention(model.cfg, spec, ctx, mode["attn_reps"], bw["gb_s"],
                                            scales))
                tick(f"{n} threads: attention {spec} {ctx}")
        decode = []
        for batch, ctx in mode["shapes"]:
            # the decode steps (timed, then as many with timers) must fit in the model's context:
            # 8192 becomes 8192 - 2 * steps - 2
            ctx = min(ctx, model.cfg.max_seq_len - 2 * mode["steps"] - 2)
            measured = decode_tinykv(model, specs, batch, ctx, mode["steps"], scales)
            for spec in specs:
                decode.append(_row("tinykv", spec, batch, ctx, measured[spec], w_bytes,
                                   bw["gb_s"], (macs, fma)))
            tick(f"{n} threads: decode {' '.join(specs)} {batch}x{ctx}, in turn")
            for kind, quantized in hf_kinds:
                measured = decode_hf(hf, batch, ctx, mode["steps"], quantized)
                decode.append(_row("transformers", kind, batch, ctx, measured, w_bytes,
                                   bw["gb_s"]))
                tick(f"{n} threads: transformers {kind} {batch}x{ctx}")
        out["runs"].append({"threads": n, "bandwidth": bw, "fma_peak_gfma_s": fma,
                            "kernel": kernel, "attention": attn,
                            "decode": decode, "ratios": ratios(decode)})
    return out


def run(model: Transformer, weights: Path | None, quick: bool = False,
        threads: list[int] | None = None, specs: list[str] | None = None,
        transformers: bool = True, out: str | Path = "bench/roofline-new.json",
        command: str = "python -m tinykv bench roofline",
        shapes: list[tuple[int, int]] | None = None, steps: int | None = None,
        scales: str | Path | None = None) -> dict:
    """The whole roofline benchmark on `model` (on the CPU, float32; transformers loads the same
    `weights`); writes the JSON and the chart beside it, prints the tables, restores threads.
    `shapes` (batch, context) replace the mode's decode shapes, and their contexts its attention
    contexts; `steps` its timed decode steps; `scales` the scale file of the specs that need
    one (calibrated centers, smoothing maps or static scales)."""
    w = next(model.parameters())
    if w.device.type != "cpu" or w.dtype != torch.float32:
        raise ValueError("bench roofline measures the CPU: load the model with --device cpu "
                         "--dtype float32")
    hf = None
    if transformers and weights is not None and importlib.util.find_spec("transformers"):
        import transformers as tf

        tf.logging.set_verbosity_error()
        hf = tf.AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32).eval()
    before = torch.get_num_threads()
    res = {"command": command, "machine": machine_info(torch.device("cpu")),
           "weights": str(weights), "mode": "quick" if quick else "full"}
    mode = dict(MODES[res["mode"]])
    if shapes:
        mode.update(shapes=list(shapes), contexts=sorted({c for _, c in shapes}))
    if steps:
        mode["steps"] = steps
    try:
        res.update(collect(model, hf, mode, specs or specs_that_fit(DEFAULT_SPECS, model.cfg),
                           threads or [1, 2], _progress, scales))
    finally:
        set_threads(before)
    out = Path(out)
    res["charts"] = roofline_charts(res, out.with_suffix(".png"),
                                    chart_label)
    write_text(out, json.dumps(res, indent=1), make_folders=True)
    print(render(res))
    pngs = [p for made in res["charts"].values() for p in made if p]
    print(f"[tinykv] results in {out}" + "".join(f", {p}" for p in pngs))
    return res
