"""The checks of a command line that need no model and no torch: its files exist and read as
they should, its outputs can be written (tinykv.outputs), its flags fit together and none is
given to be ignored. `check_early` runs them right after parsing, so a wrong path answers at once,
before torch is even imported; it reads the prompts and texts once (stdin can be read only once)
and keeps them on args (`args.prompts`, `args.text_body`)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

from ..fetch import DEFAULT_DIR, check_dest
from ..outputs import check_outputs
from .flags import given_flags


class Terminated(BaseException):
    """SIGTERM, raised in the main thread like Ctrl-C so that the run cleans up after itself (a
    disk tier's file); a BaseException, so that no `except Exception` on the way swallows it."""


TERMINATED = threading.Event()  # SIGTERM arrived (the process's signal state, not the library's)
INTERRUPTED = threading.Event()  # Ctrl-C arrived (its raise too can land where it is lost)


class UsageError(ValueError):
    """Flags that do not fit together, found before the model loads."""


def check_early(args: argparse.Namespace) -> None:
    """Every check of this command that needs neither torch nor the model."""
    check_flags_apply(args)
    if args.cmd == "generate":
        args.prompts = read_prompts(args)
        if args.max_batch is not None and args.n > args.max_batch:
            # the samples of a prompt fork at once and run together: past --max-batch the
            # pool, sized for --max-batch sequences, thrashes
            raise UsageError(f"-n {args.n} is more than --max-batch {args.max_batch}: a prompt's "
                             "samples are decoded together (raise --max-batch)")
    if args.cmd in ("generate", "eval"):
        check_offload_args(args)
    weights = getattr(args, "weights", None)
    if weights and not Path(weights).is_dir():
        raise UsageError(f"--weights {weights}: weights directory not found")
    if args.cmd == "fetch" and args.dest:
        check_dest(args.dest)
    check_files(args)


def io_paths(args: argparse.Namespace) -> tuple[dict, dict]:
    """(outputs, inputs) of the run by flag: the files it writes, the files and folders it
    reads."""
    inputs = {"--weights": getattr(args, "weights", None) or DEFAULT_DIR}
    for dest in ("text", "kv_scales", "filler", "readme", "prompt_file", "batch",
                 "calibration_text", "second_text", "sensitivities_in"):
        inputs[f"--{dest.replace('_', '-')}"] = getattr(args, dest, None)
    outputs = {"--out": getattr(args, "out", None), "--plot": getattr(args, "plot", None),
               "--vllm-out": getattr(args, "vllm_out", None),
               "--sensitivities-out": getattr(args, "sensitivities_out", None)}
    if args.cmd == "bench" and args.readme and not args.bench_cmd:
        outputs["--out"] = None  # it only prints
    if args.cmd == "bench" and args.bench_cmd == "profile":
        outputs["--out"] = None  # the bench's own default; profile writes nothing
    return outputs, inputs


def check_files(args: argparse.Namespace) -> None:
    """The run's inputs read, and its outputs may be written: none of them an input or another
    output (tinykv.outputs), a chart in a format matplotlib writes."""
    outputs, inputs = io_paths(args)
    check_outputs(outputs, inputs, make_folders=args.cmd == "bench")
    if outputs["--plot"]:
        from ..plots import check_figure_path

        check_figure_path("--plot", outputs["--plot"])
    if args.cmd in ("calibrate", "eval") and not (args.cmd == "eval" and args.task == "passkey"):
        args.text_body = read_text(args.text, args.cmd)
    if args.cmd == "bench" and args.readme and not Path(args.readme).is_file():
        raise UsageError(f"--readme: results file not found: {args.readme}")


# Flags a run does not use, by what makes it skip them: (command, its setting) -> flags.
NOT_USED = [
    ("eval", lambda a: a.task == "passkey", "with --task passkey",
     ("offset", "max_tokens", "window", "chunk", "attn_error", "plot_specs")),
    ("eval", lambda a: a.task == "ppl", "without --task passkey",
     ("lengths", "depths", "trials", "seed")),
    ("bench kernel", lambda a: a.aot, "with --aot", ("quick", "kv", "reps", "block_size")),
    ("bench quality", lambda a: a.no_ppl, "with --no-ppl",
     ("text", "offset", "max_tokens", "window", "chunk")),
    ("bench quality", lambda a: a.no_passkey, "with --no-passkey",
     ("lengths", "depths", "trials", "filler")),
    ("bench", lambda a: a.readme and not a.bench_cmd, "with --readme",
     ("quick", "text", "out", "kv", "reps", "no_transformers", "weights", "device", "dtype",
      "threads")),
    ("bench peers", lambda a: a.no_speed, "with --no-speed",
     ("contexts", "rounds", "new")),
    ("bench peers", lambda a: a.no_ppl, "with --no-ppl", ("window", "offset", "max_tokens")),
    ("generate", lambda a: not a.host_blocks, "without --host-blocks", ("stage_blocks",)),
    ("eval", lambda a: not a.host_blocks, "without --host-blocks", ("stage_blocks",)),
    ("calibrate", lambda a: a.bits is None, "without --bits",
     ("candidates", "context", "probe_tokens", "sensitivities_out", "sensitivities_in")),
    ("bench quality", lambda a: a.no_ppl, "with --no-ppl", ("second_text",)),
]


def check_flags_apply(args: argparse.Namespace) -> None:
    """Refuse a flag the run would ignore: one given to `tinykv bench` before its subcommand
    (argparse would let the subcommand's default win), or one its other flags make unused."""
    command = " ".join(filter(None, (args.cmd, getattr(args, "bench_cmd", None))))
    for prog, dest, flag in given_flags(args):
        if prog != args.prog:
            raise UsageError(f"{flag} is an option of `{prog}`, which `{args.prog}` ignores: give "
                             "a subcommand's options after its name")
        for cmd, when, why, dests in NOT_USED:
            if cmd == command and dest in dests and when(args):
                raise UsageError(f"{flag} does not apply {why}")


def check_offload_args(args: argparse.Namespace) -> None:
    """The offload tiers' flags fit together, the disk tier's folder can be made, and a scale
    file is there."""
    if args.disk_blocks and not args.disk_dir:
        raise UsageError("--disk-blocks needs --disk-dir")
    if args.disk_dir and not args.disk_blocks:
        raise UsageError("--disk-dir needs --disk-blocks")
    if args.disk_blocks and not args.host_blocks:
        raise UsageError("the disk tier sits behind the host tier: give --host-blocks too")
    if args.disk_dir:
        check_folder(args.disk_dir, "--disk-dir")
    if args.kv_scales and not Path(args.kv_scales).is_file():
        raise UsageError(f"--kv-scales: file not found: {args.kv_scales}")


def check_folder(path: str, flag: str) -> None:
    """A folder the run may create or write into: its nearest existing part is a writable
    folder."""
    import os

    folder = Path(path).absolute()
    there = next(d for d in (folder, *folder.parents) if d.exists())
    if not there.is_dir():
        raise UsageError(f"{flag} {path}: {there} is a file, not a folder")
    if not os.access(there, os.W_OK):
        raise UsageError(f"{flag} {path}: {there} is not writable")


def read_text(path: str | None, what: str) -> str:
    """A UTF-8 text file (a leading byte order mark dropped, line endings read as \n); '-' is
    stdin, and so is any other file that is not a folder (/dev/stdin, a pipe)."""
    if path is None:
        raise UsageError(f"{what}: give --text FILE")
    if path == "-":
        data = sys.stdin.buffer.read()
    else:
        p = Path(path)
        if not p.exists():
            raise UsageError(f"{what}: text file not found: {path}")
        if p.is_dir():
            raise UsageError(f"{what}: {path} is a folder, not a text file")
        data = p.read_bytes()
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise UsageError(f"{what}: {path} is UTF-16 text (its byte order mark says so); save it "
                         "as UTF-8")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{what}: {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at "
                         f"offset {e.start})") from None
    # line endings are not content: CRLF and CR read as \n, as Python's text mode reads them, so
    # a text tokenizes (and measures) the same whichever system saved it; U+2028 stays text
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text.removeprefix("\ufeff")


def text_problem(text: str) -> str | None:
    """Why a prompt is not text a tokenizer takes (a lone surrogate: a byte of another encoding
    on the command line, or a \\ud800-style JSON escape), or None."""
    for i, ch in enumerate(text):
        if "\ud800" <= ch <= "\udfff":
            if "\udc80" <= ch <= "\udcff":  # how Python keeps a byte that is not UTF-8
                return f"byte 0x{ord(ch) - 0xdc00:02x} at character {i} is not UTF-8"
            return f"U+{ord(ch):04X} at character {i} is a lone surrogate, not a character"
    return None


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompt words as one prompt, a whole --prompt-file as one, or a --batch file's lines."""
    given = [bool(args.prompt), bool(args.prompt_file), bool(args.batch)]
    if sum(given) != 1:
        raise UsageError("give exactly one of PROMPT, --prompt-file FILE or --batch FILE")
    if args.prompt:
        prompts, where = [" ".join(args.prompt)], ["the prompt"]
    elif args.prompt_file:
        prompts, where = [read_text(args.prompt_file, "--prompt-file")], [args.prompt_file]
    else:
        prompts, where = read_batch(args.batch)
    for prompt, name in zip(prompts, where):
        if not prompt.strip():
            raise UsageError(f"{name}: the prompt is empty")
        problem = text_problem(prompt)
        if problem:
            raise UsageError(f"{name}: {problem}")
    return prompts


def read_batch(path: str) -> tuple[list[str], list[str]]:
    """(prompts, where each comes from): one prompt per non-empty line (lines end at \\n only:
    U+2028 or a form feed inside a prompt is its text); JSONL ({"prompt": ...} on every line)
    when the first line is a JSON object, and then a line that is not is an error."""
    lines = [(i, ln.removesuffix("\r")) for i, ln in
             enumerate(read_text(path, "--batch").split("\n"), 1)]
    lines = [(i, ln) for i, ln in lines if ln.strip()]
    if not lines:
        raise UsageError(f"--batch {path} holds no prompt")
    where = [f"--batch {path}: line {i}" for i, _ in lines]
    first, first_line = lines[0]
    if not is_json_object(first_line):
        return [ln for _, ln in lines], where
    prompts = []
    for i, ln in lines:
        try:
            obj = json.loads(ln)
        except json.JSONDecodeError as e:
            raise UsageError(f"--batch {path}: line {i} is not JSON ({e.msg}), and line "
                             f"{first} made this a JSONL batch") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise UsageError(f"--batch {path}: line {i} has no string \"prompt\" field")
        prompts.append(obj["prompt"])
    return prompts, where


def is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False
