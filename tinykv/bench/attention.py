"""The CPU attention kernel beside its ceilings, all measured in one run
(`python -m tinykv bench kernel --cpu`; `bench roofline` prints it too).

For each KV spec and decode shape (batch x context), on synthetic pools of the default model's
shape (3 KV heads of 3 query heads, head_dim 64, blocks of 16, in shuffled physical order):
- attention: one layer call of the fused CPU kernel (cpu.CpuKernels().attend, as a cache calls it);
  "in cache": the same call on one pool read again and again (it stays in the caches): the
  kernel's math alone, without waiting on DRAM;
- touch: the same call's K/V bytes and scales read in block-table order, with no math: the read
  ceiling of that exact layout and block order (touch.py: the faster of plain loads and loads
  with each block requested ahead), on as many threads as the call, each reading its share of
  every row's blocks. attention / touch is "x touch".
- % bandwidth: the call's bytes over its time, against the machine's read bandwidth (a pass over
  a large array, by as many threads at once as the call runs on: ceilings.reads_in_turn);
- cycles per key and KV head, at the clock measured here (a chain of dependent 1-cycle ops), and
  the FMA peak (a loop of independent vector FMAs; torch's matmul would measure its own kernel)
  and the share of it the call's FMAs (q . k and p * v) reach;
- the fixed cost of a call (`fixed_costs`): attention over one key, and the store of one token,
  in a loop (everything it touches stays in the caches) and right after COLD_BYTES are read (as
  in a decode step, where each layer's weights stream through the caches between its calls).
Every layer call reads its own pool (pseudo-layers cycled past the last-level cache), so K/V come
from DRAM as in a real decode step. Specs and the touch are interleaved, repetition by repetition,
so drift in the machine's speed hits them alike; each number is a median over repetitions, and a
speedup over one thread the median of the repetitions' paired ratios.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ..kernels.cpu_numerics import AVAILABLE, REASON
from ..outputs import write_text
from ..spec import KVSpec
from . import overlap
from .ceilings import clock_ghz, fma_peak, last_level_cache, reads_in_turn, set_threads
from .common import cpu_target
from .touch import SHAPE, TOUCH_AHEAD, make_pool, pseudo_layers

# Read before each "cold" call: about one decode layer's weights of the default model (14 MB),
# more than this class of CPU's L2 and the share of L3 a busy host leaves one guest.
COLD_BYTES = 16 * 2**20
MODES = {"full": dict(shapes=[(1, 4096), (1, 8192), (16, 1024)], reps=7),
         "quick": dict(shapes=[(1, 256), (2, 128)], reps=2)}
KIVI = "k=int4:channel:asym,v=int4:g32:asym"
SPECS = ["fp16", "int8", "int4", KIVI]


def set_shape(kv_heads: int, n_rep: int, head_dim: int) -> None:
    """The pools' shape for this process's measurements (bench kernel --cpu --heads, --head-dim):
    KV heads, query heads per KV head, channels a head."""
    SHAPE.update(kv_heads=kv_heads, n_rep=n_rep, head_dim=head_dim)


def timed(fn, *args) -> float:
    """Seconds fn(*args) takes, once."""
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


# ---- the measurement ------------------------------------------------------------------------

def decode_queries(batch: int, context: int) -> tuple:
    """(q, q_seq, q_pos, ctx_lens) of one decode step: a query per row, each at its last
    position."""
    H, R, D = SHAPE["kv_heads"], SHAPE["n_rep"], SHAPE["head_dim"]
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(batch, H * R, D, generator=gen)  # (B, Hq, D)
    ctx_lens = torch.full((batch,), context, dtype=torch.int32)
    return q, torch.arange(batch), torch.full((batch,), context - 1), ctx_lens


def measure_shape(specs: list[str], batch: int, context: int, reps: int, budget: int,
                  threads: tuple[int, ...] | list[int] = (1,)) -> dict:
    """(spec, thread count) -> median per-call seconds of attention, and of the touch on as many
    threads, the faster of its two reads (both kept): every spec, read and thread count in turn
    within each rep, so that a slow moment of a shared machine falls on all of them alike and
    their ratios hold."""
    from ..kernels.cpu import CpuKernels

    D = SHAPE["head_dim"]
    q, q_seq, q_pos, ctx_lens = decode_queries(batch, context)
    lens = ctx_lens.numpy().astype(np.int64)
    kernels = {s: CpuKernels() for s in specs}
    layers = {s: pseudo_layers(KVSpec.parse(s), batch, context, budget) for s in specs}

    def attend(spec: str) -> None:
        for x in layers[spec]:
            kernels[spec].attend(q, q_seq, q_pos, x.k, x.v, x.table, ctx_lens, D**-0.5)

    def touch(spec: str, ahead: int, workers: int) -> None:
        for x in layers[spec]:
            x.touch(lens, ahead, workers)

    reads = {"touch_plain": 0, "touch_ahead": TOUCH_AHEAD}
    times = {(s, what, n): [] for s in specs for what in ("attend", *reads) for n in threads}
    for n in threads:  # compile, start the threads, fault the pages in
        set_threads(n)
        for s in specs:
            attend(s)
            touch(s, 0, n)
            touch(s, TOUCH_AHEAD, n)
    for _ in range(reps):
        for s in specs:
            for n in threads:
                set_threads(n)
                for read, ahead in reads.items():
                    times[s, read, n].append(timed(touch, s, ahead, n) / len(layers[s]))
                times[s, "attend", n].append(timed(attend, s) / len(layers[s]))
    out = {}
    for s in specs:
        for n in threads:
            touches = {f"{read}_s": statistics.median(times[s, read, n]) for read in reads}
            out[s, n] = {"attend_s": statistics.median(times[s, "attend", n]),
                         "reps_s": times[s, "attend", n], "touch_s": min(touches.values()),
                         **touches, "bytes": layers[s][0].nbytes, "layers": len(layers[s])}
    return out


def fixed_costs(spec: str, calls: int = 300, rounds: int = 5) -> dict:
    """Microseconds per layer call that do not depend on the context (best of `rounds` loops of
    `calls` calls, and cold: _per_call_cold): attention over one key at batch 1; of it, the
    compiled kernel alone handed no work item (numba unboxing the arguments); the store of one
    token (quantize-and-store, a side without block-wise scales); and the same two as a decode
    step's direct layer path makes them (kernels.cpu_direct), where it takes the spec."""
    from ..kernels.cpu import CpuKernels

    H, R, D = SHAPE["kv_heads"], SHAPE["n_rep"], SHAPE["head_dim"]
    gen = torch.Generator().manual_seed(1)
    kv = KVSpec.parse(spec)
    k, v = make_pool(kv.k, 2, gen), make_pool(kv.v, 2, gen)
    q = torch.randn(1, H * R, D, generator=gen)  # (1, Hq, D)
    x = torch.randn(1, H, D, generator=gen)  # (1, H, D): one new token
    zero, one = torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32)  # (1, 1): block 0
    kernels = CpuKernels()
    out = _costs("attend", lambda: kernels.attend(q, zero, zero, k, v, table, one, D**-0.5),
                 calls, rounds)
    serial, _, k_arrays, v_arrays, *_ = kernels._call(k, v, H * R, D)
    step = kernels._step(zero, zero, table, one)
    empty = (q.numpy(), step.q_seq, step.q_pos, step.table, step.ctx_lens, k_arrays, v_arrays,
             H, SHAPE["block_size"], np.float32(0.125), np.empty((1, 1, H * R, D), np.float32),
             np.empty((1, 1, H * R), np.float32))
    out["dispatch_us"] = _per_call(lambda: serial(0, 0, *empty), calls, rounds)
    side, pool = (kv.k, k) if not kv.k.block_wise else (kv.v, v)
    if not side.block_wise:
        out |= _costs("store", lambda: kernels.store(x, side, pool.data, pool.scale, pool.zero,
                                                     zero, zero), calls, rounds)
    direct = kernels.direct(zero, zero, one, [(table, [(k, v)])], 0, zero, zero, H * R, D,
                            D**-0.5, lambda n: None)
    if direct is not None:
        q_rows, x_rows = q.numpy(), x.numpy()
        out |= _costs("direct_attend", lambda: direct.attend(0, q_rows), calls, rounds)
        out |= _costs("direct_store", lambda: direct.store(0, x_rows, x_rows), calls, rounds)
    return out


def _costs(name: str, fn, calls: int, rounds: int) -> dict:
    """{name_us: in a loop, name_cold_us: right after COLD_BYTES are read} of one call."""
    return {f"{name}_us": _per_call(fn, calls, rounds), f"{name}_cold_us": _per_call_cold(fn)}


def _per_call(fn, calls: int, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return 1e6 * best


def _per_call_cold(fn, calls: int = 30) -> float:
    """Median microseconds of a call right after COLD_BYTES are read: the code and data it
    touches (Python's, torch's, numba's, the pool's) come from memory again."""
    flush = np.ones(COLD_BYTES // 4, np.float32)
    fn()
    times = []
    for _ in range(calls):
        flush.sum()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def collect(specs: list[str], shapes: list[tuple[int, int]], threads: list[int], reps: int,
            budget: int) -> dict:
    """The machine's ceilings, then a row per thread count, shape and spec."""
    quick = budget <= 2**20  # a quick run: a token bandwidth and probe
    reads = reads_in_turn(16 if quick else 512, sorted({1, *threads}), reps=3)
    machine = {"read_gb_s": reads[1], "clock_ghz": clock_ghz(), "fma_g_s": fma_peak(),
               "cpu_kernels": cpu_target()}
    # What the threads get at once, measured: a thread count's "% FMA peak" and "% read bw" are
    # of its own peak and bandwidth, which a host's other guests share.
    machine["fma_g_s_threads"] = {str(n): fma_peak(threads=n) for n in threads if n > 1}
    machine["read_gb_s_threads"] = {str(n): reads[n] for n in threads if n > 1}
    machine["overlap"] = overlap.measure(budget, quick=quick)
    got, cached = {}, {}
    for batch, context in shapes:
        got[batch, context] = measure_shape(specs, batch, context, reps, budget, threads)
        # one layer: stays in cache
        cached[batch, context] = measure_shape(specs, batch, context, reps, 1, threads)
    rows = []
    for n in threads:
        for batch, context in shapes:
            for s in specs:
                rows.append(_row(s, batch, context, n, got[batch, context], machine))
                rows[-1]["cached_ms"] = 1e3 * cached[batch, context][s, n]["attend_s"]
    fixed = {s: fixed_costs(s) for s in specs}  # threads as the last count
    return {"machine": machine, "shape": SHAPE, "budget_bytes": budget, "reps": reps,
            "rows": rows, "fixed_us": fixed}


def _row(spec: str, batch: int, context: int, threads: int, got: dict, machine: dict) -> dict:
    """A table row from measure_shape's `got`: this spec beside fp16 and, past one thread,
    beside itself on one thread, both measured in turn with it."""
    g = got[spec, threads]
    t = g["attend_s"]
    keys = batch * context * SHAPE["kv_heads"]
    row = {"kv": spec, "batch": batch, "context": context, "threads": threads,
           "ms": 1e3 * t, "touch_ms": 1e3 * g["touch_s"], "x_touch": t / g["touch_s"],
           "touch_plain_ms": 1e3 * g["touch_plain_s"], "touch_ahead_ms": 1e3 * g["touch_ahead_s"],
           "gb_s": g["bytes"] / t / 1e9, "cycles_per_key": t * machine["clock_ghz"] * 1e9 / keys,
           "layers": g["layers"]}
    read = machine.get("read_gb_s_threads", {}).get(str(threads), machine["read_gb_s"])
    row["pct_bandwidth"] = 100 * row["gb_s"] / read
    fmas = keys * SHAPE["n_rep"] * SHAPE["head_dim"] * 2  # q . k and p * v, per query head
    peak = machine.get("fma_g_s_threads", {}).get(str(threads), machine["fma_g_s"])
    row["pct_fma_peak"] = 100 * fmas / t / 1e9 / peak
    if ("fp16", threads) in got:
        row["vs_fp16"] = t / got["fp16", threads]["attend_s"]
    if threads > 1 and (spec, 1) in got:  # rep by rep: the two were timed one after the other
        paired = [one / many for one, many in zip(got[spec, 1]["reps_s"], g["reps_s"])]
        row["speedup"] = statistics.median(paired)
        row["speedup_range"] = [min(paired), max(paired)]
    return row


def render(results: dict) -> str:
    """The table (Markdown), with the machine's ceilings above it."""
    m = results["machine"]
    head = ["KV spec", "threads", "batch x ctx", "attend ms", "in cache", "touch ms", "x touch",
            "GB/s",
            "% read bw", "% FMA peak", "vs fp16", "cycles/key/head", "vs 1 thread"]
    def at_once(key: str) -> str:
        return "".join(f"; {n} at once: {g:.0f}" for n, g in m.get(key, {}).items())

    lines = [f"Read bandwidth {m['read_gb_s']:.1f} GB/s (one thread{at_once('read_gb_s_threads')}"
             f"), clock {m['clock_ghz']:.2f} GHz, FMA peak {m['fma_g_s']:.0f} GFMA/s (float32, "
             f"one thread{at_once('fma_g_s_threads')}); kernels for {m.get('cpu_kernels', '?')}. "
             "Past one thread, % read bw and % FMA peak are of that many threads' own; vs 1 "
             "thread is the median over reps of the paired ratio (its range in brackets).", "",
             _render_shape(results["shape"]), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results["rows"]:
        name = "KIVI-style" if r["kv"].startswith(KIVI) else r["kv"]
        cells = [f"`{name}`", r["threads"], f"{r['batch']}x{r['context']}", f"{r['ms']:.3f}",
                 f"{r['cached_ms']:.3f}", f"{r['touch_ms']:.3f}", f"{r['x_touch']:.2f}",
                 f"{r['gb_s']:.1f}",
                 f"{r['pct_bandwidth']:.0f}%", f"{r['pct_fma_peak']:.1f}%",
                 _ratio(r.get("vs_fp16")), f"{r['cycles_per_key']:.0f}", _speedup(r)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines + _render_touches(results["rows"])
                     + _render_fixed(results.get("fixed_us", {}))
                     + overlap.render(m.get("overlap")))


def _render_touches(rows: list[dict]) -> list[str]:
    """Which of the touch's two reads set each ceiling, and by how much."""
    rows = [r for r in rows if "touch_ahead_ms" in r and r["threads"] == rows[0]["threads"]]
    if not rows:
        return []
    ratios = [r["touch_ahead_ms"] / r["touch_plain_ms"] for r in rows]
    faster = sum(ratio < 1 for ratio in ratios)
    return ["", f"Touch: the faster of plain loads and loads with each block requested "
                f"{TOUCH_AHEAD} blocks before; the requests were faster in {faster} of "
                f"{len(rows)} rows (their time {min(ratios):.2f}-{max(ratios):.2f}x the plain "
                "loads')."]


def _render_shape(shape: dict) -> str:
    """The pools' shape in words, and how the kernel takes its query heads."""
    from ..kernels.cpu_vector import head_share

    R, D = shape["n_rep"], shape["head_dim"]
    kv = shape["kv_heads"]
    line = (f"Pools of {kv} KV head{'s' * (kv > 1)}, {R} query head{'s' * (R > 1)} each, head_dim "
            f"{D}, blocks of {shape['block_size']} tokens")
    share = head_share(R, D)
    if share == 0:
        return line + "; the vector kernel takes no head_dim this wide (the plain one reads them)."
    if share < R:
        return line + (f"; the vector kernel reads a KV head's blocks {-(-R // share)} times, "
                       f"{share} of its query heads a pass.")
    return line + "."


def _render_fixed(fixed: dict) -> list[str]:
    """The per-call costs that do not depend on the context, one line per spec."""
    lines = ["", "Fixed cost per layer call (us, best loop): attention over 1 key (of it, the "
             "compiled kernel given no work), and the store of one token's K or V; then the "
             f"same right after {COLD_BYTES >> 20} MiB are read (median), as between a decode "
             "step's layers. Direct: the same as a decode step's direct layer path calls them "
             "(attention; the store of K and V together):", ""]
    for spec, f in fixed.items():
        name = "KIVI-style" if spec.startswith(KIVI) else spec
        us = {k: f"{f[k]:.1f}" if k in f else "-" for k in (
            "store_us", "direct_attend_us", "direct_store_us")}
        cold = {k: f"{f[k]:.0f}" if k in f else "-" for k in (
            "attend_cold_us", "store_cold_us", "direct_attend_cold_us", "direct_store_cold_us")}
        lines.append(f"- `{name}`: attend {f['attend_us']:.1f} (kernel {f['dispatch_us']:.1f}), "
                     f"store {us['store_us']}; cold: attend {cold['attend_cold_us']}, "
                     f"store {cold['store_cold_us']}; direct: attend {us['direct_attend_us']}, "
                     f"store K+V {us['direct_store_us']}; cold: attend "
                     f"{cold['direct_attend_cold_us']}, store K+V {cold['direct_store_cold_us']}")
    return lines if fixed else []


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _speedup(row: dict) -> str:
    """vs 1 thread: the median paired ratio and (where a JSON of this version has it) its range."""
    low, high = row.get("speedup_range", (None, None))
    span = f" ({low:.2f}-{high:.2f})" if low is not None else ""
    return _ratio(row.get("speedup")) + span


def chart(results: dict, path: Path) -> str | None:
    """ms per layer call per spec, a panel per thread count and shape, each bar's touch ceiling
    marked (charts.grouped_bars); None without matplotlib."""
    from .charts import grouped_bars

    rows = results["rows"]
    groups = list(dict.fromkeys((r["threads"], r["batch"], r["context"]) for r in rows))
    at = {(r["kv"], r["threads"], r["batch"], r["context"]): r for r in rows}
    series = []
    for kv in dict.fromkeys(r["kv"] for r in rows):
        got = [at.get((kv, *g)) for g in groups]
        name = "tinykv " + ("KIVI-style" if kv.startswith(KIVI) else kv)
        series.append((name, [r and r["ms"] for r in got], [r and r["touch_ms"] for r in got]))
    names = [f"{b} x {c}, {n} thread(s)" for n, b, c in groups]
    return grouped_bars(path, names, series, "ms per layer call",
                        "CPU attention, one layer call; black tick: the touch of its layout",
                        "touch: the call's K/V bytes read in its block order, on as many "
                        "threads, no math")


def budget_bytes(quick: bool) -> int:
    """Bytes of pseudo-layers per spec and shape: past the last-level cache (reads from DRAM),
    or 1 MiB for a quick run."""
    return 2**20 if quick else 2 * last_level_cache()


def run(specs: list[str] | None = None, shapes: list[tuple[int, int]] | None = None,
        threads: list[int] | None = None, quick: bool = False,
        out: str | Path | None = "bench/attention-cpu.json", parts=None) -> dict:
    """Measure, print the table, save the JSON (written beside, then renamed); restores threads.
    parts: None, or parts(specs, shapes, reps, clock GHz) -> (rows, table), run next on one
    thread, its table printed and its rows saved as "parts" (bench/parts.py's `where_time_goes`,
    which imports this module)."""
    if not AVAILABLE:
        raise RuntimeError(REASON)
    mode = MODES["quick" if quick else "full"]
    out = None if out is None else Path(out)
    before = torch.get_num_threads()
    budget = budget_bytes(quick)
    try:
        res = collect(specs or SPECS, shapes or mode["shapes"], threads or [1], mode["reps"],
                      budget)
        if parts is not None:
            set_threads(1)
            res["parts"], parts_table = parts(specs or SPECS, shapes or mode["shapes"],
                                              mode["reps"], res["machine"]["clock_ghz"])
    finally:
        set_threads(before)
    print(render(res))
    if parts is not None:
        print("\n" + parts_table)
    if out is not None:
        write_text(out, json.dumps(res, indent=1), make_folders=True)
        png = chart(res, out.with_suffix(".png"))
        print(f"[tinykv] results in {out}" + (f", {png}" if png else ""))
    return res
