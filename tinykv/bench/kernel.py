"""Benchmarks. `kernel`: the fused Triton dequant-attention against the torch reference.

Decode attention (one query per sequence) over a paged pool, for a grid of batch x context on two layer
shapes and several KV formats: time per call (median over runs, CUDA events, L2 flushed in between) and
effective bandwidth = bytes of K, V and their scales read per call / time. Without a GPU the fused kernel
runs only through Triton's interpreter (TRITON_INTERPRET=1) on the tiny --quick grid; otherwise only the
torch reference is timed, and the output says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from .kernels import PoolLayer, paged_attention_ref
from .kernels_triton import triton
from .quant import KVSpec, QuantParams, bytes_per_token, compute_scales, quantize

SHAPES = {"SmolLM2-135M": (9, 3, 64), "Llama-3-8B": (32, 8, 128)}  # query heads, KV heads, head dim
GRIDS = {"full": ((1, 8, 32), (1024, 4096, 16384)), "quick": ((1, 2), (32, 80))}  # batches, contexts


def add_kernel_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="tiny grid (what Triton's CPU interpreter can run)")
    ap.add_argument("--out", default="bench/kernel.json", help="where to save the results as JSON")
    ap.add_argument("--kv", nargs="+", default=["fp16", "int8", "int4"], help="KV specs to time")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, help="timed calls per point (default 20 on a GPU, 2 on the CPU)")


def _pool(p: QuantParams, nb: int, H: int, BS: int, D: int, dev: str, gen: torch.Generator) -> PoolLayer:
    """nb blocks of random keys stored as the cache stores them (static scales: over the whole pool)."""
    x = torch.randn(nb, H, BS, D, generator=gen, device=dev)
    if p.is_float:
        return PoolLayer(x.to(p.storage_dtype), None, None, p)
    if p.static:
        s, z = compute_scales(x.transpose(0, 1).flatten(1, 2), p, torch.float32)
        s, z = s.unsqueeze(0), None if z is None else z.unsqueeze(0)
    else:
        s, z = compute_scales(x, p)
    return PoolLayer(quantize(x, p, s, z, count=False)[0], s, z, p)


def _time_ms(fn, reps: int, cuda: bool, flush: torch.Tensor | None) -> float:
    fn()  # warm-up, compiles
    times = []
    for _ in range(reps):
        if cuda:
            flush.zero_()  # evict the pool from L2 so that bandwidth is DRAM bandwidth
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
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
def bench_kernel(args: argparse.Namespace) -> dict:
    cuda = torch.cuda.is_available()
    dev, q_dtype = ("cuda", torch.float16) if cuda else ("cpu", torch.float32)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    quick = args.quick or not cuda
    fused = triton is not None and (cuda or (interp and quick))
    notes = [] if cuda else ["no GPU: the quick grid only"]
    if not fused:
        notes.append("the fused kernel needs a GPU (or TRITON_INTERPRET=1 with --quick): torch reference only")
    elif not cuda:
        notes.append("fused kernel timed in Triton's CPU interpreter: correctness only, not speed")
    if fused:
        from .kernels_triton import paged_attention_triton
    batches, contexts = GRIDS["quick" if quick else "full"]
    BS, reps = args.block_size, args.reps or (20 if cuda else 2)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=dev) if cuda else None
    gen = torch.Generator(dev).manual_seed(0)
    rows = []
    for model, (Hq, H, D) in SHAPES.items():
        for spec_s in args.kv:
            spec = KVSpec.parse(spec_s)
            nb = max(batches) * max(contexts) // BS
            k, v = (_pool(p, nb, H, BS, D, dev, gen) for p in (spec.k, spec.v))
            per_tok = bytes_per_token(spec.k, H, D, BS) + bytes_per_token(spec.v, H, D, BS)
            for B in batches:
                for ctx in contexts:
                    mb = -(-ctx // BS)
                    ids = torch.randperm(nb, generator=gen, device=dev)[:B * mb].view(B, mb).int()
                    q = torch.randn(B, Hq, D, generator=gen, device=dev).to(q_dtype)
                    a = (q, torch.arange(B, device=dev), torch.full((B,), ctx - 1, device=dev), k, v, ids,
                         torch.full((B,), ctx, dtype=torch.int32, device=dev), D**-0.5)
                    row = {"model": model, "kv": str(spec), "batch": B, "context": ctx, "bytes": per_tok * B * ctx}
                    try:
                        row["ref_ms"] = _time_ms(lambda a=a: paged_attention_ref(*a), reps, cuda, flush)
                        o_ref = paged_attention_ref(*a)[0]
                    except torch.cuda.OutOfMemoryError:
                        row["ref_ms"], o_ref = None, None
                        torch.cuda.empty_cache()
                    if fused:
                        row["fused_ms"] = _time_ms(lambda a=a: paged_attention_triton(*a), reps, cuda, flush)
                        row["fused_GBps"] = row["bytes"] / row["fused_ms"] / 1e6
                        if o_ref is not None:
                            row["max_err"] = (paged_attention_triton(*a)[0] - o_ref).abs().max().item()
                    if row["ref_ms"]:
                        row["ref_GBps"] = row["bytes"] / row["ref_ms"] / 1e6
                    rows.append(row)
                    _print_row(row, header=len(rows) == 1)
    result = {"benchmark": "kernel", "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "triton": getattr(triton, "__version__", None), "q_dtype": str(q_dtype),
              "block_size": BS, "reps": reps, "fused_kernel": fused, "notes": notes, "rows": rows}
    for n in notes:
        print(f"[bench kernel] {n}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"[bench kernel] saved {args.out}")
    return result


def _print_row(r: dict, header: bool) -> None:
    cols = [("model", 13, "{}"), ("kv", 6, "{}"), ("batch", 5, "{}"), ("context", 7, "{}"), ("ref_ms", 9, "{:.3f}"),
            ("ref_GBps", 8, "{:.3g}"), ("fused_ms", 9, "{:.3f}"), ("fused_GBps", 10, "{:.3g}"),
            ("max_err", 8, "{:.1e}")]
    if header:
        print(" ".join(f"{c:>{w}}" for c, w, _ in cols))
    print(" ".join(f"{'-' if r.get(c) is None else f.format(r[c]):>{w}}" for c, w, f in cols), flush=True)


def main(argv: list[str] | None = None) -> None:
    """`python -m tinykv.bench [--quick] ...` until cli.py registers `bench kernel`."""
    ap = argparse.ArgumentParser(prog="tinykv bench kernel", description=__doc__)
    add_kernel_args(ap)
    bench_kernel(ap.parse_args(argv))


if __name__ == "__main__":
    main()
