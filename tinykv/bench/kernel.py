"""Kernel benchmarks: the fused Triton dequant-attention timed against the torch reference, and the
Triton kernels' ahead-of-time compile report. Library functions only; the CLI
(`python -m tinykv bench kernel [--quick] [--aot] [--kv ...] [--out FILE]`) parses and calls them.

`bench_kernel`: decode attention (one query per sequence) over a paged pool, for a grid of
batch x context on two layer shapes and several KV formats: time per call (median over runs, CUDA
events, L2 flushed in between) and effective bandwidth = bytes of K, V and their scales read per
call / time. Without a GPU the fused kernel runs only through Triton's interpreter
(TRITON_INTERPRET=1) on the tiny quick grid; otherwise only the torch reference is timed, and the
result says so.

`aot_report`: every kernel variant (`AOT_VARIANTS`: each storage format, head dims 64/80/128,
block sizes 16/32/64, fp16/bf16 queries) compiled for sm_80 and sm_90 without a GPU, with the
registers, shared memory and spills of each cubin: what the kernels cost before any launch.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch

from ..formats import bytes_per_token
from ..kernels.layout import PoolLayer
from ..kernels.reference import paged_attention_ref
from ..kernels.triton import triton
from ..kernels.triton_aot import Variant
from ..outputs import write_text
from ..quant import compute_scales, quantize
from ..spec import KVSpec, QuantParams

SHAPES = {"SmolLM2-135M": (9, 3, 64), "Llama-3-8B": (32, 8, 128)}  # query heads, KV heads, head dim
GRIDS = {"full": ((1, 8, 32), (1024, 4096, 16384)), "quick": ((1, 2), (32, 80))}  # batch, context
DEFAULT_SPECS = ("fp16", "int8", "int4")

# Each K/V storage format at least once (float, int8/4/2, fp8; sym/asym; static/dynamic; token,
# group, channel, head, tensor scales), on the head dims, block sizes and query dtypes in use.
AOT_VARIANTS = [
    Variant("attention", "k=fp16,v=bf16", head_dim=128, block_size=16, n_rep=4, dtype="bf16"),
    Variant("attention", "fp32", head_dim=64, block_size=16, n_rep=1, dtype="fp32"),
    Variant("attention", "int8", head_dim=128, block_size=16, n_rep=4),
    Variant("attention", "int4", head_dim=128, block_size=16, n_rep=4, dtype="bf16"),
    Variant("attention", "k=int4:channel:asym,v=int4:g32:asym", head_dim=64, block_size=64,
            n_rep=8, dtype="bf16"),
    Variant("attention", "k=int2:asym,v=int2:g16", head_dim=64, block_size=16, n_rep=3),
    Variant("attention", "k=fp8,v=fp8:token", head_dim=80, block_size=16, n_rep=4, dtype="bf16"),
    Variant("attention", "k=int8:head:static,v=int4:tensor:static:asym", head_dim=128,
            block_size=32, n_rep=1),
    Variant("attention", "k=int4:channel:static,v=fp16", head_dim=80, block_size=16, n_rep=8,
            dtype="bf16"),
    Variant("attention", "k=int8:g16:asym,v=fp8:head", head_dim=128, block_size=64, n_rep=3),
    Variant("attention", "k=int2:channel:asym,v=int8:asym", head_dim=80, block_size=32, n_rep=1,
            dtype="bf16"),
    Variant("attention", "k=fp8:tensor:static,v=int4", head_dim=64, block_size=16, n_rep=4),
    Variant("store", "fp16", head_dim=64),
    Variant("store", "bf16", head_dim=128, dtype="bf16"),
    Variant("store", "int8", head_dim=128),
    Variant("store", "int8:asym", head_dim=80, dtype="bf16"),
    Variant("store", "int8:head:static", head_dim=64),
    Variant("store", "int4:g32", head_dim=128),
    Variant("store", "int4:channel:static:asym", head_dim=80),
    Variant("store", "int2:g8:asym", head_dim=64, dtype="bf16"),
    Variant("store", "int2:g32:mse", head_dim=64),
    Variant("store", "int2:tensor:static", head_dim=128),
    Variant("store", "fp8:token", head_dim=80),
    Variant("store", "fp8:tensor:static", head_dim=64, dtype="bf16"),
]


def _pool(p: QuantParams, nb: int, H: int, BS: int, D: int, dev: str,
          gen: torch.Generator) -> PoolLayer:
    """nb blocks of random keys stored as the cache stores them (static scales: over the pool)."""
    x = torch.randn(nb, H, BS, D, generator=gen, device=dev)
    if p.is_float:
        return PoolLayer(x.to(p.storage_dtype), None, None, p)
    if p.static:
        s, z = compute_scales(x.transpose(0, 1).flatten(1, 2), p, torch.float32)
        s = s.unsqueeze(0)
        z = None if z is None else z.unsqueeze(0)
    else:
        s, z = compute_scales(x, p)
    return PoolLayer(quantize(x, p, s, z, count=False)[0], s, z, p)


def _time_ms(fn: Callable[[], object], reps: int, flush: torch.Tensor | None) -> float:
    """Median milliseconds of fn(); with `flush` (CUDA) by events, the L2 cache evicted first."""
    fn()  # warm-up, compiles
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()  # evict the pool from L2 so that bandwidth is DRAM bandwidth
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def bench_kernel(specs: list[str], block_size: int = 16, reps: int | None = None,
                 quick: bool = False, out: str | None = "bench/kernel.json") -> dict:
    """Time decode attention for each KV spec over the grid; print rows, save JSON to `out`.

    reps: timed calls per point (default 20 on a GPU, 2 on the CPU). quick: the tiny grid, the
    only one without a GPU. Returns the saved object: device, versions, notes and one row per point.
    """
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    q_dtype = torch.float16 if cuda else torch.float32
    quick = quick or not cuda
    fused = triton is not None and (cuda or (os.environ.get("TRITON_INTERPRET") == "1" and quick))
    notes = _notes(cuda, fused)
    batches, contexts = GRIDS["quick" if quick else "full"]
    BS = block_size
    reps = reps or (20 if cuda else 2)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=dev) if cuda else None
    gen = torch.Generator(dev).manual_seed(0)
    rows = []
    for model, shape in SHAPES.items():
        for spec_s in specs:
            spec = KVSpec.parse(spec_s)
            H, D = shape[1], shape[2]
            per_tok = bytes_per_token(spec.k, H, D, BS) + bytes_per_token(spec.v, H, D, BS)
            for B, ctx, a in _points(spec, shape, (batches, contexts), BS, q_dtype, gen):
                row = {"model": model, "kv": str(spec), "batch": B, "context": ctx,
                       "bytes": per_tok * B * ctx}
                rows.append(_time_point(row, a, reps, flush, fused))
                _print_row(row, header=len(rows) == 1)
    result = {"benchmark": "kernel", "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "triton": getattr(triton, "__version__", None),
              "q_dtype": str(q_dtype), "block_size": BS, "reps": reps, "fused_kernel": fused,
              "notes": notes, "rows": rows}
    for n in notes:
        print(f"[bench kernel] {n}")
    if out:
        write_text(out, json.dumps(result, indent=1), make_folders=True)
        print(f"[bench kernel] saved {out}")
    return result


def _points(spec: KVSpec, shape: tuple[int, int, int], grid: tuple[list[int], list[int]],
            BS: int, q_dtype: torch.dtype, gen: torch.Generator):
    """(batch, context, attention arguments) at each point of the grid for one spec and model
    shape (query heads, KV heads, head_dim): one pool per spec, each sequence's blocks drawn from
    it in shuffled order."""
    Hq, H, D = shape
    batches, contexts = grid
    dev = gen.device
    nb = max(batches) * -(-max(contexts) // BS)  # whole blocks: a block may pass ctx
    k = _pool(spec.k, nb, H, BS, D, dev, gen)  # (nb, H, BS, D) codes and their scales
    v = _pool(spec.v, nb, H, BS, D, dev, gen)
    for B in batches:
        for ctx in contexts:
            mb = -(-ctx // BS)
            ids = torch.randperm(nb, generator=gen, device=dev)[:B * mb].view(B, mb).int()
            q = torch.randn(B, Hq, D, generator=gen, device=dev).to(q_dtype)  # (B, Hq, D)
            q_seq = torch.arange(B, device=dev)
            q_pos = torch.full((B,), ctx - 1, device=dev)
            ctx_lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
            yield B, ctx, (q, q_seq, q_pos, k, v, ids, ctx_lens, D**-0.5)


def _notes(cuda: bool, fused: bool) -> list[str]:
    """What the reader must know about where and how the kernels ran."""
    notes = [] if cuda else ["no GPU: the quick grid only"]
    if not fused:
        notes.append("the fused kernel needs a GPU (or TRITON_INTERPRET=1 with quick): "
                     "torch reference only")
    elif not cuda:
        notes.append("fused kernel timed in Triton's CPU interpreter: correctness only, not speed")
    return notes


def _time_point(row: dict, a: tuple, reps: int, flush, fused: bool) -> dict:
    """The reference's time at one point and, where it runs, the fused kernel's, its bandwidth
    and its largest difference from the reference, added to `row`."""
    try:
        row["ref_ms"] = _time_ms(partial(paged_attention_ref, *a), reps, flush)
        o_ref = paged_attention_ref(*a)[0]
    except torch.cuda.OutOfMemoryError:
        row["ref_ms"] = None
        o_ref = None
        torch.cuda.empty_cache()
    if fused:
        from ..kernels.triton import paged_attention_triton

        row["fused_ms"] = _time_ms(partial(paged_attention_triton, *a), reps, flush)
        row["fused_GBps"] = row["bytes"] / row["fused_ms"] / 1e6
        if o_ref is not None:
            row["max_err"] = (paged_attention_triton(*a)[0] - o_ref).abs().max().item()
    if row["ref_ms"]:
        row["ref_GBps"] = row["bytes"] / row["ref_ms"] / 1e6
    return row


_BENCH_COLUMNS = [("model", 13, "{}"), ("kv", 6, "{}"), ("batch", 5, "{}"), ("context", 7, "{}"),
                  ("ref_ms", 9, "{:.3f}"), ("ref_GBps", 8, "{:.3g}"), ("fused_ms", 9, "{:.3f}"),
                  ("fused_GBps", 10, "{:.3g}"), ("max_err", 8, "{:.1e}")]


def _print_row(r: dict, header: bool) -> None:
    if header:
        print(" ".join(f"{c:>{w}}" for c, w, _ in _BENCH_COLUMNS))
    cells = []
    for c, w, f in _BENCH_COLUMNS:
        text = "-" if r.get(c) is None else f.format(r[c])
        cells.append(f"{text:>{w}}")
    print(" ".join(cells), flush=True)


# The compiling child: Triton picks its interpreter when a kernel is defined, so a process that
# set TRITON_INTERPRET=1 (tests without a GPU) cannot compile; a fresh one without it can.
_AOT_CHILD = """
import json, sys
from tinykv.kernels.triton_aot import Variant, aot_compile
job = json.load(sys.stdin)
rows = aot_compile([Variant(**v) for v in job["variants"]], tuple(job["caps"]), job["jobs"])
print(json.dumps(rows))
"""


def aot_report(caps: tuple[int, ...] = (80, 90), variants: list[Variant] | None = None,
               jobs: int | None = None, out: str | None = None,
               cache_dir: str | None = None) -> list[dict]:
    """Compile every variant (default AOT_VARIANTS) for each sm_{cap}, no GPU needed; print and
    return one row per (variant, target): n_regs, n_spills, shared (bytes), ptx/cubin sizes.

    Runs in a child process without TRITON_INTERPRET, over `jobs` processes (default: the CPUs).
    cache_dir: Triton's cache for the child (a fresh one really compiles). Raises RuntimeError
    with the compiler's message when a kernel does not compile.
    """
    variants = AOT_VARIANTS if variants is None else variants
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[2])  # the checkout holding tinykv/
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when it is unset
    if cache_dir:
        env["TRITON_CACHE_DIR"] = cache_dir
    job = {"variants": [asdict(v) for v in variants], "caps": list(caps), "jobs": jobs}
    proc = subprocess.run([sys.executable, "-c", _AOT_CHILD], input=json.dumps(job), env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"ahead-of-time compilation failed:\n{proc.stderr[-6000:]}")
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    print_aot_report(rows)
    if out:
        write_text(out, json.dumps(rows, indent=1), make_folders=True)
        print(f"[bench kernel] saved {out}")
    return rows


def print_aot_report(rows: list[dict]) -> None:
    """One line per (variant, target): registers, shared memory bytes, spilled 4-byte words."""
    width = max([len(r["variant"]) for r in rows] + [7])
    print(f"{'variant':<{width}} {'target':>6} {'regs':>4} {'shared':>6} {'spills':>6}")
    for r in rows:
        print(f"{r['variant']:<{width}} {r['target']:>6} {r['n_regs']:>4} {r['shared']:>6} "
              f"{r['n_spills']:>6}", flush=True)
