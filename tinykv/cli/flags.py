"""The flag types of `python -m tinykv` (ranged integers and numbers, byte sizes, KV specs),
the argparse parser that answers in one line and notes which flags were given, and the groups of
flags several subcommands share. Nothing here imports torch."""

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


GIVEN = "given:"  # namespace attributes "given:PROG:DEST" note a flag typed on the command line


def recording(action: type[argparse.Action]) -> type[argparse.Action]:
    """`action`, also noting in the namespace which command's flag was given (argparse's own
    defaults cannot tell an omitted flag from one given its default value)."""
    class Recorded(action):
        def __call__(self, parser, namespace, values, option_string=None) -> None:
            super().__call__(parser, namespace, values, option_string)
            if option_string:
                setattr(namespace, f"{GIVEN}{parser.prog}:{self.dest}", option_string)
    return Recorded


def given_flags(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(command, dest, the flag as typed) of every flag given on the command line."""
    out = []
    for key, flag in vars(args).items():
        if key.startswith(GIVEN):
            prog, _, dest = key.removeprefix(GIVEN).rpartition(":")
            out.append((prog, dest, flag))
    return out


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (`error: ...` on stderr, exit status 2) that notes the flags
    given (`given_flags`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for name in (None, "store", "store_true"):
            self.register("action", name, recording(self._registry_get("action", name)))

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
    if not math.isfinite(n):
        raise argparse.ArgumentTypeError(f"byte size {s!r} is not a finite number of bytes")
    if n < 1:
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
    ap.add_argument("--packed-weights", action="store_true",
                    help="CPU decode: read float32 weights that came from 4- or 8-bit blocks "
                         "(the default model's Q4_1 and Q8_0) as those codes, the same weights "
                         "bit for bit")
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
