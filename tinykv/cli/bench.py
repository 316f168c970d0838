"""`python -m tinykv bench [kernel|profile]`: the benchmarks' flags to their library functions."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

from ..bench.common import specs_that_fit
from .commands import check_io, load_model, warn, window_of
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
        specs = given_specs(args, model)
        profile.run(model, path, text, args.prompt, args.new, specs,
                    transformers=not args.no_transformers, linear_rows=tuple(args.linear_rows))
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
    specs = given_specs(args, model)
    command = " ".join(["python -m tinykv bench", *map(shlex.quote, sys.argv[2:])])
    e2e.run(model, path, text, text_path, quick=args.quick, specs=specs, reps=args.reps,
            transformers=not args.no_transformers, out=args.out, command=command)
    return None


def given_specs(args, model) -> list[str] | None:
    """The --kv specs as strings, each checked against the model (its layers, its head_dim)
    before any slow work; None where none were given (the benchmark's defaults that fit)."""
    for spec in args.kv or []:
        spec.check(model.cfg.n_layers, model.cfg.head_dim)
    return [str(s) for s in args.kv] if args.kv else None


def cmd_bench_kernel(args) -> None:
    from ..bench import kernel

    given = {dest for _, dest, _ in given_flags(args)}
    if args.cpu:
        return cmd_bench_cpu_kernel(args, given)
    if given & {"thread_counts", "parts", "heads", "head_dim"}:
        raise UsageError("bench kernel: --threads, --parts, --heads and --head-dim go with --cpu")
    if args.aot:
        kernel.aot_report(out=args.out if "out" in given else None)
        return
    specs = [str(s) for s in args.kv] if args.kv else ["fp16", "int8", "int4"]
    for spec in args.kv or []:  # the grid's head dims: a group must divide each
        for _, _, head_dim in kernel.SHAPES.values():
            spec.k.check(head_dim)
            spec.v.check(head_dim)
    kernel.bench_kernel(specs, args.block_size, args.reps, args.quick, args.out)


def cmd_bench_cpu_kernel(args, given: set[str]) -> None:
    """bench kernel --cpu: bench/attention.py at the default model's shape (or --heads and
    --head-dim), one layer call (and with --parts, bench/parts.py)."""
    from ..bench import attention, parts

    if "aot" in given or "block_size" in given or "reps" in given:
        raise UsageError("bench kernel --cpu takes --kv, --quick, --threads, --parts, --heads, "
                         "--head-dim and --out")
    kv_heads, query_heads = args.heads or (attention.SHAPE["kv_heads"],
                                           attention.SHAPE["kv_heads"] * attention.SHAPE["n_rep"])
    if query_heads % kv_heads:
        raise UsageError(f"bench kernel --cpu: --heads {kv_heads} {query_heads}: the query heads "
                         "must be a multiple of the KV heads")
    attention.set_shape(kv_heads, query_heads // kv_heads,
                        args.head_dim or attention.SHAPE["head_dim"])
    head_dim = attention.SHAPE["head_dim"]
    for spec in args.kv or []:
        spec.k.check(head_dim)
        spec.v.check(head_dim)
    out = Path(args.out if "out" in given else "bench/attention-cpu.json")
    derived = {"the chart": out.with_suffix(".png")}
    if "out" not in given:  # --out (checked as given) otherwise names the JSON
        derived["the JSON"] = out
    check_io(args, derived)
    # the default specs that hold head_dim (KIVI-style's groups of 32 do not hold 80)
    specs = [str(s) for s in args.kv] if args.kv else specs_that_fit(
        attention.SPECS, SimpleNamespace(n_layers=1, head_dim=head_dim))
    attention.run(specs, threads=args.thread_counts, quick=args.quick, out=out,
                  parts=parts.where_time_goes if args.parts else None)


def cmd_bench_roofline(args) -> None:
    from ..bench import roofline

    args.device = args.device or "cpu"  # a CPU benchmark: never the default CUDA device
    from ..bench.charts import roofline_chart_paths

    pngs = roofline_chart_paths(Path(args.out).with_suffix(".png"), args.thread_counts)
    check_io(args, {f"the chart {p.name}": p for p in pngs})
    calibrated = [s for s in args.kv or [] if s.needs_scales]
    if calibrated and not args.kv_scales:
        raise UsageError(f"KV spec '{calibrated[0]}' takes scales, means or maps from "
                         "calibration: give --kv-scales FILE (tinykv calibrate makes it)")
    if args.kv_scales and not calibrated:
        raise UsageError("--kv-scales given but no KV spec has a static, centered or smoothed "
                         "part")
    model, path = load_model(args)
    from ..scalefile import load_scales
    for spec in calibrated:  # a file that does not fit a spec is refused before the runs
        load_scales(args.kv_scales, model.cfg, spec)
    specs = given_specs(args, model)
    command = " ".join(["python -m tinykv bench", *map(shlex.quote, sys.argv[2:])])
    roofline.run(model, path, quick=args.quick, threads=args.thread_counts, specs=specs,
                 transformers=not args.no_transformers, out=args.out, command=command,
                 shapes=args.shapes, steps=args.steps, scales=args.kv_scales)


def cmd_bench_quality(args) -> None:
    from ..bench import quality
    from ..evaluate import SAMPLE_TEXT, tokens_of
    from ..scalefile import TextSpan

    if args.replot:
        return replot(args)
    if args.no_ppl and args.no_passkey:
        raise UsageError("--no-ppl with --no-passkey leaves nothing to measure")
    check_calibration_args(args)
    named = [] if args.no_ppl else [(args.text or str(SAMPLE_TEXT), args.offset)]
    if args.second_text and not args.no_ppl:
        named.append((args.second_text, 0))
    texts = [(name, read_text(name, "bench quality"), offset) for name, offset in named]
    cal_text = None
    if args.calibration_text:
        cal_text = read_text(args.calibration_text, "bench quality --calibration-text")
    filler = read_text(args.filler, "bench quality --filler") if args.filler else None
    model, path = load_model(args)
    window = window_of(args, model)
    measured = []  # (label, tokens, span)
    for name, text, offset in texts:
        tokens = tokens_of(text, path, offset, args.max_tokens)
        span = TextSpan.of(text, offset, len(tokens))
        measured.append((f"{Path(name).name} tokens {offset}-{offset + len(tokens)}", tokens,
                         span))
    scales_for = held_out_scales(args, model, path, cal_text, [m[2] for m in measured], window)
    lengths = [] if args.no_passkey else args.lengths
    command = " ".join(["python -m tinykv bench", *map(shlex.quote, sys.argv[2:])])
    quality.run(model, path, args.kv, [(label, tokens) for label, tokens, _ in measured], window,
                args.chunk, lengths, args.depths, args.trials, scales_for, filler, args.out,
                command, args.context, plot=args.plot)


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
              llama_kv=args.llama_kv, packed=args.packed_weights)


def replot(args) -> None:
    """bench quality --replot JSON... --plot PNG: the chart of saved results, measuring nothing."""
    import json

    from ..bench import quality

    if not args.plot:
        raise UsageError("--replot needs --plot PNG")
    reports, earlier = [], []  # runs with texts (KL); older ones, perplexity alone
    for name in args.replot:
        try:
            report = json.loads(read_text(name, "bench quality --replot"))
        except json.JSONDecodeError as e:
            raise UsageError(f"--replot {name}: not JSON ({e.msg}, line {e.lineno})") from None
        runs = report.get("runs", [report]) if isinstance(report, dict) else []
        runs = [r for r in runs if isinstance(r, dict) and isinstance(r.get("rows"), list)]
        found = [r for r in runs if r.get("texts")]
        earlier += [r for r in runs if "texts" not in r and r.get("ppl_tokens")]
        if not found and not earlier:
            raise UsageError(f"--replot {name}: no bench quality report with texts in it")
        reports += found  # a report, or a collection of them under "runs"
    if not reports:
        raise UsageError("--replot: no bench quality report with texts (KL) among them")
    charted = quality.chart(reports, args.plot, earlier, _config(args) if earlier else None)
    print(f"[tinykv] {args.plot}: {charted} specs")


def _config(args):
    """The model's Config (its config.json alone), to count older runs' bits; None without it."""
    from ..fetch import DEFAULT_DIR
    from ..model import Config, ModelError
    from ..modelfiles import Fields, ModelFileError

    path = Path(args.weights or DEFAULT_DIR) / "config.json"
    try:
        return Config.from_hf(Fields.load(path, required=True))
    except (ModelError, ModelFileError) as e:
        warn(f"older runs (perplexity alone) left out of the chart: {path}: {e}")
        return None


def check_calibration_args(args) -> None:
    """A spec that takes scales, means or maps gets them from one place: a file or a text."""
    calibrated = [s for s in args.kv if s.needs_scales]
    if args.kv_scales and args.calibration_text:
        raise UsageError("give --kv-scales or --calibration-text, not both")
    if calibrated and not (args.kv_scales or args.calibration_text):
        raise UsageError(f"KV spec '{calibrated[0]}' takes scales, means or maps from "
                         "calibration: give --calibration-text FILE (calibrated here, on other "
                         "tokens than the measured ones) or --kv-scales FILE")
    if (args.kv_scales or args.calibration_text) and not calibrated:
        raise UsageError("--kv-scales or --calibration-text given but no KV spec has a static, "
                         "centered or smoothed part")


def held_out_scales(args, model, path, cal_text: str | None, spans: list, window: int):
    """scales_for(spec) -> (scales, what calibrated them), after refusing, before the slow part,
    a calibration whose tokens overlap a measured text's (held out by default)."""
    from ..calibrate import check_request, record, scales_from
    from ..evaluate import tokens_of
    from ..scalefile import TextSpan, load_scales, scale_source

    cal_tokens = None
    if cal_text is not None:
        cal_tokens = tokens_of(cal_text, path, args.calibration_offset, args.calibration_tokens)
        source = TextSpan.of(cal_text, args.calibration_offset, len(cal_tokens))
        label = f"{Path(args.calibration_text).name} {source}"
    elif args.kv_scales:
        source, label = scale_source(args.kv_scales), str(args.kv_scales)
        if source is None:
            warn(f"{args.kv_scales} does not say which tokens calibrated it (made by an older "
                 "tinykv): recalibrate it, or use --calibration-text, to be sure it is held out")
    if cal_text is not None or args.kv_scales:
        for span in spans:
            if source is not None and source.overlaps(span):
                raise UsageError(f"refusing to measure calibrated specs on their calibration "
                                 f"tokens: the measured {span} overlap the calibration's "
                                 f"{source.offset}-{source.offset + source.tokens} (measure "
                                 "other tokens: --offset, or another text)")

    recorded = []  # the calibration tokens recorded once, for every spec that takes scales

    def scales_for(spec):
        if not spec.needs_scales:
            return None, None
        if cal_tokens is None:
            return load_scales(args.kv_scales, model.cfg, spec), label
        check_request(spec, "minmax")
        if not recorded:
            recorded.append(record(model, cal_tokens, window, keep_q=True, progress=True))
        return scales_from(recorded[0], spec)[0], label

    return scales_for
