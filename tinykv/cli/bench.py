"""`python -m tinykv bench [kernel|profile]`: the benchmarks' flags to their library functions."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from .commands import check_cache_args, check_io, load_model, window_of
from .flags import given_flags
from .inputs import UsageError, read_text

# what bench/e2e.py's charts() writes beside the results JSON
E2E_CHARTS = ("decode_tok_s.png", "ppl_vs_bytes.png")


def cmd_bench(args) -> None:
    from ..evaluate import SAMPLE_TEXT

    if args.bench_cmd == "kernel":
        return cmd_bench_kernel(args)
    if args.bench_cmd == "roofline":
        return cmd_bench_roofline(args)
    if args.bench_cmd == "quality":
        return cmd_bench_quality(args)
    if args.bench_cmd == "peers":
        return cmd_bench_peers(args)
    text_path = args.text or str(SAMPLE_TEXT)
    if args.bench_cmd == "profile":
        text = read_text(text_path, "bench profile")
        from ..bench import profile

        model, path = load_model(args)
        specs = [str(s) for s in args.kv] if args.kv else None
        profile.run(model, path, text, args.prompt, args.new, specs,
                    transformers=not args.no_transformers)
        return None
    from ..bench import e2e

    if args.readme:
        try:
            print(e2e.render_readme(args.readme), end="")
        except (KeyError, TypeError, IndexError, AttributeError, json.JSONDecodeError) as e:
            raise UsageError(f"--readme {args.readme} is not a results file of `tinykv bench` "
                             f"({type(e).__name__}: {e})") from None
        return None
    check_io(args, {f"the chart {name}": Path(args.out).parent / name for name in E2E_CHARTS})
    text = read_text(text_path, "bench")
    model, path = load_model(args)
    specs = [str(s) for s in args.kv] if args.kv else None
    command = " ".join(["python -m tinykv bench", *map(shlex.quote, sys.argv[2:])])
    e2e.run(model, path, text, text_path, quick=args.quick, specs=specs, reps=args.reps,
            transformers=not args.no_transformers, out=args.out, command=command)
    return None


def cmd_bench_kernel(args) -> None:
    from ..bench import kernel

    given = {dest for _, dest, _ in given_flags(args)}
    if args.aot:
        kernel.aot_report(out=args.out if "out" in given else None)
        return
    specs = [str(s) for s in args.kv] if args.kv else ["fp16", "int8", "int4"]
    for spec in args.kv or []:  # the grid's head dims: a group must divide each
        for _, _, head_dim in kernel.SHAPES.values():
            spec.k.check(head_dim)
            spec.v.check(head_dim)
    kernel.bench_kernel(specs, args.block_size, args.reps, args.quick, args.out)


def cmd_bench_roofline(args) -> None:
    from ..bench import roofline

    args.device = args.device or "cpu"  # a CPU benchmark: never the default CUDA device
    from ..bench.charts import roofline_chart_paths

    pngs = roofline_chart_paths(Path(args.out).with_suffix(".png"), args.thread_counts)
    check_io(args, {f"the chart {p.name}": p for p in pngs})
    model, path = load_model(args)
    specs = [str(s) for s in args.kv] if args.kv else None
    command = " ".join(["python -m tinykv bench", *map(shlex.quote, sys.argv[2:])])
    roofline.run(model, path, quick=args.quick, threads=args.thread_counts, specs=specs,
                 transformers=not args.no_transformers, out=args.out, command=command,
                 shapes=args.shapes, steps=args.steps)


def cmd_bench_quality(args) -> None:
    from ..bench import quality
    from ..evaluate import SAMPLE_TEXT, tokens_of
    from ..scalefile import load_scales

    if args.no_ppl and args.no_passkey:
        raise UsageError("--no-ppl with --no-passkey leaves nothing to measure")
    check_cache_args(args, args.kv)
    text = None if args.no_ppl else read_text(args.text or str(SAMPLE_TEXT), "bench quality")
    filler = read_text(args.filler, "bench quality --filler") if args.filler else None
    model, path = load_model(args)
    window = window_of(args, model)
    tokens = None if text is None else tokens_of(text, path, args.offset, args.max_tokens)

    def scales_for(spec):
        return load_scales(args.kv_scales, model.cfg, spec) if spec.needs_scales else None

    lengths = [] if args.no_passkey else args.lengths
    command = " ".join(["python -m tinykv bench", *map(shlex.quote, sys.argv[2:])])
    quality.run(model, path, args.kv, tokens, window, args.chunk, lengths, args.depths,
                args.trials, scales_for, filler, args.out, command)


def cmd_bench_peers(args) -> None:
    from ..bench import peers
    from ..evaluate import SAMPLE_TEXT

    args.device = args.device or "cpu"  # llama.cpp runs on the CPU: tinykv beside it too
    if args.device != "cpu" or (args.dtype or "float32") != "float32":
        raise UsageError("bench peers compares float32 weights on the CPU (--device cpu "
                         "--dtype float32)")
    if args.no_ppl and args.no_speed:
        raise UsageError("--no-ppl with --no-speed leaves nothing to measure")
    check_io(args, {"the chart": Path(args.out).with_suffix(".png")})
    text = read_text(args.text or str(SAMPLE_TEXT), "bench peers")
    model, path = load_model(args)
    window = window_of(args, model)
    specs = [str(s) for s in args.kv] if args.kv else ["fp16", "int8", "int4"]
    command = " ".join(["python -m tinykv bench", *map(shlex.quote, sys.argv[2:])])
    contexts = [] if args.no_speed else args.contexts
    peers.run(model, path, text, contexts, specs, args.rounds, args.new, args.threads,
              not args.no_ppl, args.out, command, window, args.offset, args.max_tokens,
              llama_kv=args.llama_kv)
