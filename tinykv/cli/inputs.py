"""The checks of a command line that need no model and no torch: its files exist and read as
they should, its outputs can be written, its offload flags fit together. `check_early` runs them
right after parsing, so a wrong path answers at once, before torch is even imported."""

from __future__ import annotations

import argparse
import json
import os
import threading
from pathlib import Path


class Terminated(BaseException):
    """SIGTERM, raised in the main thread like Ctrl-C so that the run cleans up after itself (a
    disk tier's file); a BaseException, so that no `except Exception` on the way swallows it."""


TERMINATED = threading.Event()  # SIGTERM arrived (the process's signal state, not the library's)
INTERRUPTED = threading.Event()  # Ctrl-C arrived (its raise too can land where it is lost)

class UsageError(ValueError):
    """Flags that do not fit together, found before the model loads."""


def check_early(args: argparse.Namespace) -> None:
    """Every check of this command that needs neither torch nor the model."""
    if args.cmd == "generate":
        read_prompts(args)
        if args.max_batch is not None and args.n > args.max_batch:
            # the samples of a prompt fork at once and run together: past --max-batch the
            # pool, sized for --max-batch sequences, thrashes
            raise UsageError(f"-n {args.n} is more than --max-batch {args.max_batch}: a prompt's "
                             "samples are decoded together (raise --max-batch)")
    if args.cmd == "calibrate":
        for path, flag in ((args.out, "--out"), (args.vllm_out, "--vllm-out"),
                           (args.plot, "--plot")):
            check_out_path(path, flag)
        read_text(args.text, "calibrate")
    if args.cmd == "eval":
        check_out_path(args.plot, "--plot")
        if args.plot_specs and not args.plot:
            raise UsageError("--plot-specs needs --plot PNG")
        if args.task == "ppl":
            read_text(args.text, "eval")
    if args.cmd in ("generate", "eval"):
        check_offload_args(args)
    weights = getattr(args, "weights", None)
    if weights and not Path(weights).is_dir():
        raise UsageError(f"--weights {weights}: weights directory not found")
    if args.cmd == "fetch" and args.dest:
        check_folder(args.dest, "--dest")
    if args.cmd == "bench":
        check_folder(str(Path(args.out).parent), "--out", args.out)  # written after the timing
        readme = getattr(args, "readme", None)
        if readme and not Path(readme).is_file():
            raise UsageError(f"--readme: results file not found: {readme}")


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


def check_folder(path: str, flag: str, given: str | None = None) -> None:
    """A folder the run may create or write into: its nearest existing part is a writable
    folder. `given` is what the user wrote, when path is derived from it."""
    folder = Path(path).absolute()
    there = next(d for d in (folder, *folder.parents) if d.exists())
    shown = given or path
    if not there.is_dir():
        raise UsageError(f"{flag} {shown}: {there} is a file, not a folder")
    if not os.access(there, os.W_OK):
        raise UsageError(f"{flag} {shown}: {there} is not writable")


def check_out_path(path: str | None, flag: str) -> None:
    """Fail before the slow part when an output cannot be written."""
    if path is None:
        return
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: folder {parent} does not exist")
    if Path(path).is_dir():
        raise UsageError(f"{flag} {path} is a folder")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{flag} {path}: folder {parent} is not writable")


def read_text(path: str | None, what: str) -> str:
    if path is None:
        raise UsageError(f"{what}: give --text FILE")
    if not Path(path).is_file():
        raise UsageError(f"{what}: text file not found: {path}")
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{what}: {path} is not UTF-8 text") from None


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompt words as one prompt, a whole --prompt-file as one, or a --batch file's lines."""
    given = [bool(args.prompt), bool(args.prompt_file), bool(args.batch)]
    if sum(given) != 1:
        raise UsageError("give exactly one of PROMPT, --prompt-file FILE or --batch FILE")
    if args.prompt:
        prompt = " ".join(args.prompt)
        if not prompt.strip():
            raise UsageError("the prompt is empty")
        return [prompt]
    if args.prompt_file:
        text = read_text(args.prompt_file, "--prompt-file")
        if not text.strip():
            raise UsageError(f"--prompt-file {args.prompt_file} is empty")
        return [text]
    return read_batch(args.batch)


def read_batch(path: str) -> list[str]:
    """One prompt per non-empty line; JSONL ({"prompt": ...} on every line) when the first line
    is a JSON object, and then a line that is not is an error, never a prompt."""
    lines = [(i, ln) for i, ln in enumerate(read_text(path, "--batch").splitlines(), 1)
             if ln.strip()]
    if not lines:
        raise UsageError(f"--batch {path} holds no prompt")
    first, first_line = lines[0]
    if not is_json_object(first_line):
        return [ln for _, ln in lines]
    prompts = []
    for i, ln in lines:
        try:
            obj = json.loads(ln)
        except json.JSONDecodeError as e:
            raise UsageError(f"--batch {path}: line {i} is not JSON ({e.msg}), and line "
                             f"{first} made this a JSONL batch") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise UsageError(f"--batch {path}: line {i} has no string \"prompt\" field")
        if not obj["prompt"].strip():
            raise UsageError(f"--batch {path}: the prompt on line {i} is empty")
        prompts.append(obj["prompt"])
    return prompts


def is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False
