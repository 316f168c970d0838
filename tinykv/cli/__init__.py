"""The command line, on top of the library: `python -m tinykv {generate,fetch,calibrate,eval,bench}`
(run.py is `generate`). It parses flags (parser.py), calls library functions with typed arguments
and prints (commands.py, bench.py); nothing in the library imports it."""

from __future__ import annotations

import sys

from .bench import cmd_bench
from .commands import cmd_calibrate, cmd_eval, cmd_fetch, cmd_generate
from .parser import build_parser

COMMANDS = {"generate": cmd_generate, "fetch": cmd_fetch, "calibrate": cmd_calibrate,
            "eval": cmd_eval, "bench": cmd_bench}


def is_user_error(e: BaseException) -> bool:
    """Errors that deserve one line, not a traceback: bad input, missing files, tinykv's own."""
    return isinstance(e, (ValueError, OSError, MemoryError)) or type(e).__module__.startswith(
        "tinykv.")


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        COMMANDS[args.cmd](args)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not is_user_error(e):
            raise
        lines = str(e).strip().splitlines()
        print(f"error: {lines[0] if lines else type(e).__name__}", file=sys.stderr)
        return 1
    return 0
