"""Every flag of `python -m tinykv`, with its type and range, in one place: a bad value is a one-line
error before the model loads, so a typo costs no load."""

from __future__ import annotations

import argparse
import math
import os
import sys

from ..quant import KVSpec, SpecError

DEFAULT_THREADS = max(1, (os.cpu_count() or 2) // 2)  # half the cores: steady on a shared machine


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `error: ...` on stderr, exit status 2."""

    def error(self, message: str) -> None:
        print(f"error: {self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)


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


def kv_spec(s: str) -> KVSpec:
    try:
        return KVSpec.parse(s)
    except SpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
        raise argparse.ArgumentTypeError(f"bad byte size {s!r} (expected e.g. 512M or 2G)") from None
    if not math.isfinite(n) or n < 1:
        raise argparse.ArgumentTypeError(f"byte size {s!r} must be at least 1 byte")
    return int(n)


def int_list(s: str) -> list[int]:
    """'1024,4096' -> [1024, 4096], each >= 2."""
    try:
        out = [int(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a comma-separated list of integers") from None
    if not out or min(out) < 2:
        raise argparse.ArgumentTypeError(f"{s!r}: every length must be >= 2")
    return out


POSITIVE = int_range(1)
NON_NEGATIVE = int_range(0)


def add_model_args(ap: argparse.ArgumentParser, threads: int = DEFAULT_THREADS) -> None:
    ap.add_argument("--weights", metavar="DIR",
                    help="model folder (config.json + *.safetensors); default: SmolLM2-135M, "
                         "fetched on first use")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="default: float32 on the CPU, bfloat16 on CUDA")
    ap.add_argument("--threads", type=int_range(1, os.cpu_count() or 1), default=threads,
                    help="torch CPU threads (default: %(default)s, half this machine's cores)")


def add_cache_args(ap: argparse.ArgumentParser, default_kv: str = "int8") -> None:
    ap.add_argument("--kv", type=kv_spec, default=KVSpec.parse(default_kv), metavar="SPEC",
                    help="KV cache spec, e.g. int8, int4:rot, k=int4:channel:asym,v=int4:g32:asym "
                         "(default: %(default)s)")
    ap.add_argument("--kv-scales", metavar="FILE", help="static scales from `tinykv calibrate`")
    ap.add_argument("--block-size", type=int_range(1, 4096), default=16,
                    help="tokens per cache block (default: %(default)s)")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--device-blocks", type=POSITIVE, metavar="N",
                      help="KV pool size in blocks (default: what the requests need)")
    size.add_argument("--kv-memory", type=byte_size, metavar="BYTES",
                      help="KV pool budget in bytes, e.g. 256M or 2G")
    ap.add_argument("--attention", default="auto", choices=["auto", "torch", "cpu", "triton"],
                    help="auto: Triton on CUDA, the fused CPU kernel on the CPU; torch: the "
                         "reference (default: %(default)s)")
    ap.add_argument("--host-blocks", type=NON_NEGATIVE, default=0, metavar="N",
                    help="offload tier in host memory, in blocks (default: none)")
    ap.add_argument("--disk-dir", metavar="DIR", help="folder for the disk offload tier")
    ap.add_argument("--disk-blocks", type=NON_NEGATIVE, default=0, metavar="N",
                    help="disk offload tier size in blocks (needs --disk-dir, --host-blocks)")
    ap.add_argument("--stage-blocks", type=POSITIVE, default=64, metavar="N",
                    help="device staging buffer for offloaded blocks (default: %(default)s)")


def add_text_args(ap: argparse.ArgumentParser, max_tokens: int | None) -> None:
    ap.add_argument("--text", metavar="FILE", help="UTF-8 text file")
    ap.add_argument("--offset", type=NON_NEGATIVE, default=0, help="skip this many tokens")
    ap.add_argument("--max-tokens", type=POSITIVE, default=max_tokens,
                    help="use at most this many tokens (default: %(default)s)")
    ap.add_argument("--window", type=int_range(2), default=1024,
                    help="tokens per independent window (default: %(default)s)")


def build_parser() -> Parser:
    ap = Parser(prog="tinykv", description="A decoder with a paged, quantized KV cache.",
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    g = sub.add_parser("generate", help="generate text", description=GENERATE_HELP)
    g.add_argument("prompt", nargs="*", help="the prompt (its words are one prompt)")
    g.add_argument("--prompt-file", metavar="FILE", help="a file whose whole text is one prompt")
    g.add_argument("--whole-file", action="store_true", help=argparse.SUPPRESS)  # the default now
    g.add_argument("--batch", metavar="FILE",
                   help="many prompts: one per line, or JSONL with a \"prompt\" field")
    g.add_argument("--max-new-tokens", type=POSITIVE, default=128, metavar="N",
                   help="tokens to generate per prompt (default: %(default)s)")
    g.add_argument("--temperature", type=float_range(0, 100), default=0.7, metavar="T",
                   help="0 is greedy (default: %(default)s)")
    g.add_argument("--top-k", type=NON_NEGATIVE, default=50, metavar="K",
                   help="sample from the K likeliest tokens; 0: all (default: %(default)s)")
    g.add_argument("--top-p", type=float_range(0, 1, lo_open=True), default=0.95, metavar="P",
                   help="nucleus sampling mass (default: %(default)s)")
    g.add_argument("--seed", type=NON_NEGATIVE, help="sampling seed")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    g.add_argument("-n", type=POSITIVE, default=1,
                   help="samples per prompt, forked from one prefill (default: %(default)s)")
    g.add_argument("--max-batch", type=POSITIVE, default=16, metavar="N",
                   help="sequences decoded together (default: %(default)s)")
    g.add_argument("--prefill-chunk", type=POSITIVE, default=512, metavar="N",
                   help="prompt tokens fed per step, all sequences (default: %(default)s)")
    g.add_argument("--json", action="store_true", help="print one JSON object: ids, text, stats")
    add_model_args(g)
    add_cache_args(g)
    f = sub.add_parser("fetch", help="download and convert the default model")
    f.add_argument("--dest", metavar="DIR", help="where to write it (default: weights/...)")
    f.add_argument("--force", action="store_true", help="fetch again even if it is there")
    c = sub.add_parser("calibrate", help="static KV scales from a text (for :static specs)")
    c.add_argument("--kv", type=kv_spec, required=True, metavar="SPEC",
                   help="spec with static parts, e.g. int8:tensor:static")
    c.add_argument("--out", required=True, metavar="FILE", help="scale file to write")
    c.add_argument("--observer", default="minmax", help="minmax | percentile:P | meanstd:K")
    c.add_argument("--vllm-out", metavar="FILE", help="also write the scales in vLLM's names")
    c.add_argument("--plot", metavar="PNG", help="per-channel key/value magnitudes")
    add_text_args(c, 8192)
    add_model_args(c)
    e = sub.add_parser("eval", help="perplexity, attention error or passkey retrieval under a spec")
    e.add_argument("--task", choices=["ppl", "passkey"], default="ppl")
    e.add_argument("--chunk", type=POSITIVE, default=16,
                   help="tokens fed per step; 1 is exact decode (default: %(default)s)")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.add_argument("--attn-error", action="store_true", help="per-layer attention error")
    e.add_argument("--plot", metavar="PNG", help="ppl against bytes/token, or passkey heatmap")
    e.add_argument("--plot-specs", type=kv_spec, nargs="+", metavar="SPEC",
                   help="more specs for the --plot chart")
    e.add_argument("--lengths", type=int_list, default=[1024, 4096], help="passkey prompt lengths")
    e.add_argument("--depths", type=int_range(1, 100), default=5, help="passkey depths")
    e.add_argument("--trials", type=POSITIVE, default=1, help="passkey trials per cell")
    e.add_argument("--seed", type=NON_NEGATIVE, default=0, help="passkey seed")
    add_cache_args(e, default_kv="fp16")
    add_text_args(e, None)
    add_model_args(e)
    add_bench_parsers(sub)
    return ap


GENERATE_HELP = ("Generate text. The words of PROMPT are one prompt; --prompt-file is one prompt; "
                 "--batch FILE is many. Greedy with --temperature 0.")


def add_bench_parsers(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks: end to end (default), kernel, profile")
    b.add_argument("--quick", action="store_true", help="a smaller grid (minutes)")
    b.add_argument("--text", metavar="FILE", help="text to cut prompts from (default: shipped)")
    b.add_argument("--out", default="bench/results-new.json",
                   help="results JSON; charts go beside it (default: %(default)s)")
    b.add_argument("--readme", metavar="JSON", help="print the README Results section and exit")
    b.add_argument("--kv", type=kv_spec, nargs="+", metavar="SPEC",
                   help="tinykv KV specs (default: fp16 int8 int4 KIVI-style)")
    b.add_argument("--reps", type=POSITIVE, help="repetitions per point (default: 3, quick: 1)")
    b.add_argument("--no-transformers", action="store_true", help="tinykv only")
    add_model_args(b, threads=1)
    bsub = b.add_subparsers(dest="bench_cmd", parser_class=Parser)
    k = bsub.add_parser("kernel", help="the fused kernels beside the torch reference")
    k.add_argument("--quick", action="store_true", help="tiny grid (what an interpreter can run)")
    k.add_argument("--aot", action="store_true", help="compile the Triton kernels for sm_80/sm_90")
    k.add_argument("--out", default="bench/kernel.json", help="results JSON")
    k.add_argument("--kv", type=kv_spec, nargs="+", metavar="SPEC", help="KV specs to time")
    k.add_argument("--block-size", type=int_range(1, 4096), default=16)
    k.add_argument("--reps", type=POSITIVE, help="timed calls per point")
    p = bsub.add_parser("profile", help="where a decode step's time goes")
    p.add_argument("--prompt", type=POSITIVE, nargs="+", default=[128, 1024], help="prompt lengths")
    p.add_argument("--new", type=POSITIVE, default=32, help="decode steps timed")
    p.add_argument("--kv", type=kv_spec, nargs="+", metavar="SPEC", help="tinykv KV specs")
    p.add_argument("--text", metavar="FILE", help="text to cut the prompt from (default: shipped)")
    p.add_argument("--no-transformers", action="store_true", help="tinykv only")
    add_model_args(p, threads=1)
