"""The command line, on top of the library: `python -m tinykv {generate,fetch,calibrate,eval,bench}`
(run.py is `generate`). It parses flags (parser.py), calls library functions with typed arguments
and prints (commands.py, bench.py); nothing in the library imports it."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# How long an idle OpenMP thread (torch's pool, numba's) spins before it sleeps. Sleeping at once
# (OMP_WAIT_POLICY=passive, as before) costs each parallel call a wake-up: ~90 us in the KVM guests
# measured, so two threads lost to one on every kernel of a decode step. Spinning long (libgomp's
# default, 300000 spins) lets one pool's idle threads starve the other's. 10000 spins keeps the
# threads awake between the calls of a step and is over soon after. Measured in one process
# each, 2 threads: attention over 8192 int4 keys 1.09x one thread's speed asleep, 2.2x spinning;
# `bench roofline --threads 2`, decode steps at 1x512 32.4 -> 21.8 ms, at 16x1024 68.8 ->
# 55.6 ms; a torch linear then the attention, in a loop: 682 -> 473 us a pair.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from .flags import ArgError, resolve_specs  # noqa: E402
from .inputs import INTERRUPTED, TERMINATED, Terminated, check_early  # noqa: E402
from .parser import build_parser  # noqa: E402


def is_user_error(e: BaseException) -> bool:
    """Errors that deserve one line, not a traceback: bad input, missing files, tinykv's own, and
    running out of memory (torch says so in a RuntimeError)."""
    if isinstance(e, (ValueError, OSError, MemoryError)):
        return True
    if isinstance(e, RuntimeError) and is_out_of_memory(str(e)):
        return True
    return type(e).__module__.startswith("tinykv.")


def is_out_of_memory(message: str) -> bool:
    return "out of memory" in message or "can't allocate memory" in message


def raise_terminated(signum: int, frame: object) -> None:
    # A raise that lands in a finalizer or a C callback (numba compiling through llvmlite) is
    # lost: the generate loop checks these events between tokens.
    TERMINATED.set()
    raise Terminated


def raise_interrupted(signum: int, frame: object) -> None:
    INTERRUPTED.set()
    raise KeyboardInterrupt


def quiet_unraisable(unraisable) -> None:
    """sys.unraisablehook: a signal's raise that Python could not deliver is raised again
    between tokens (the events above), so its traceback is noise; anything else is printed."""
    if issubclass(unraisable.exc_type, (KeyboardInterrupt, Terminated)):
        return
    sys.__unraisablehook__(unraisable)


def ignore_unraisable(unraisable) -> None:
    """sys.unraisablehook for the rest of an interrupted process: an object the signal left half
    built (llvmlite's, when it lands while numba compiles) can fail in its finalizer as the
    process ends, and that traceback would follow the one `error:` line."""


@contextmanager
def termination_raised() -> Iterator[None]:
    """SIGTERM raises Terminated, and Ctrl-C KeyboardInterrupt, while the block runs (where
    nobody else handles them), and both leave an event that outlives a swallowed raise."""
    mine = threading.current_thread() is threading.main_thread()
    term = mine and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    intr = mine and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if term:
        signal.signal(signal.SIGTERM, raise_terminated)
    if intr:
        signal.signal(signal.SIGINT, raise_interrupted)
    hook = sys.unraisablehook
    sys.unraisablehook = quiet_unraisable
    try:
        yield
    finally:
        sys.unraisablehook = hook
        if term:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if intr:
            signal.signal(signal.SIGINT, signal.default_int_handler)


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Hold Ctrl-C (and SIGTERM) back until the block ends. A signal that lands inside the import
    of a compiled extension (torch, numpy, numba) can leave it half loaded and surface later as
    an unrelated ImportError; held, it is raised right after the import."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not \
            threading.main_thread():
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def load_command(name: str) -> Callable:
    """The function that runs subcommand `name`; importing it imports torch and the library."""
    with interrupts_held():
        if name == "bench":
            from .bench import cmd_bench
            return cmd_bench
        from . import commands
    return {"generate": commands.cmd_generate, "fetch": commands.cmd_fetch,
            "calibrate": commands.cmd_calibrate, "eval": commands.cmd_eval}[name]


def main(argv: list[str] | None = None, generate_prog: str | None = None) -> int:
    """Run one command line; returns the exit status (0, 1 for an error, 2 for a bad flag,
    130 when interrupted, 143 when terminated). Errors are one `error:` line on stderr."""
    for stream in (sys.stdout, sys.stderr):  # a path given in another encoding prints as given
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="surrogateescape")
    try:
        with termination_raised():
            args = build_parser(generate_prog).parse_args(sys.argv[1:] if argv is None else argv)
            check_early(args)
            run = load_command(args.cmd)
            resolve_specs(args)
            run(args)
    except KeyboardInterrupt:
        close_progress_bars()
        print("error: interrupted", file=sys.stderr)
        sys.unraisablehook = ignore_unraisable
        return 130
    except Terminated:
        close_progress_bars()
        print("error: terminated", file=sys.stderr)
        sys.unraisablehook = ignore_unraisable
        return 143
    except ArgError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if not is_user_error(e):
            raise
        lines = str(e).strip().splitlines()
        close_progress_bars()
        print(f"error: {lines[0] if lines else type(e).__name__}", file=sys.stderr)
        return 1
    return 0


def close_progress_bars() -> None:
    """End the line of a progress bar an error cut short, so that the error line is a line of
    its own (and the last one)."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()
