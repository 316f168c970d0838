"""How much of a stream of prefetched reads one core hides under its work: the machine limit
behind the attention table's "x touch" (`bench kernel --cpu` prints it under the table).

The attention kernel asks for each row of a later block while it works on the current one, so
its time from DRAM is somewhere between the larger of its work and its reads (all hidden) and
their sum (none hidden). A probe measures where this machine puts it, one thread:
- work: steps of one 64-byte load of a 16 KiB array (it stays in L1) and WORK multiply-adds on
  it (four independent chains);
- reads: every `every` steps, one software prefetch into L2 (as the kernel's) of a line of an
  array as large as the pseudo-layers the table cycles through (past the last-level cache), its
  lines in runs of RUN_LINES (a KV head's block of int8 codes) in shuffled order, AHEAD ahead.
  The array is on 2 MiB pages: the kernel's pools of one layer fit the TLB's reach, and a page
  walk per run would be a cost of the probe, not of the kernel.
Work alone, reads alone and both are timed in turn, round by round; "both / larger" is 1.0
where the reads hide under the work entirely, and their sum over the larger (2.0 where the two
take the same time) where they add up.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from ..kernels.cpu_numerics import njit
from ..kernels.cpu_simd import load, prefetch_lines, splat, store
from ..kernels.cpu_vector_rows import LEVEL  # the attention kernel's: into L2
from ..kernels.layout import huge_page_buffer

RUN_LINES = 16  # lines read in a row: a KV head's 16-token block of 64 int8 channels
AHEAD = 64  # lines between the one asked for and the one a step is at: 4 runs, as the kernel
WORK = 4  # multiply-adds per chain and step: about the time of a line from DRAM, alone
LINE_FLOATS = 16
SMALL_FLOATS = 4096  # 16 KiB: stays in L1
EVERY = (1, 2, 4)  # steps per line read
MODES = {"full": dict(steps=2_000_000, rounds=5), "quick": dict(steps=20_000, rounds=1)}


@njit(cache=True)
def _steps(small, far, run_starts, first, steps, shift, with_reads, with_work):
    """`steps` steps of the probe; a line read every 2^shift steps where with_reads, from line
    `first` of the shuffled runs on."""
    a0, a1, a2, a3 = splat(0.0, 16), splat(0.0, 16), splat(0.0, 16), splat(0.0, 16)
    decay = splat(0.999, 16)
    last_run = run_starts.size - 1  # a power of two less one: the runs wrap by a mask
    for i in range(steps):
        if with_reads and (i & ((1 << shift) - 1)) == 0:
            line = first + (i >> shift) + AHEAD
            run = run_starts[(line // RUN_LINES) & last_run]
            prefetch_lines(far, run + line % RUN_LINES * LINE_FLOATS, 1, LEVEL)
        if with_work:
            v = load(small, i * LINE_FLOATS & (SMALL_FLOATS - 1), 16)
            for _ in range(WORK):
                a0 = a0 * decay + v
                a1 = a1 * decay + v
                a2 = a2 * decay + v
                a3 = a3 * decay + v
    out = np.empty(16, np.float32)
    store(out, 0, a0 + a1 + a2 + a3)  # kept: the work is not optimized away
    return out


def measure(budget: int, quick: bool = False) -> dict:
    """ns a step of the work alone, and per rate of reads (a line every 1, 2, 4 steps) the reads
    alone, both, and both over the larger alone; medians over rounds."""
    mode = MODES["quick" if quick else "full"]
    run_bytes = RUN_LINES * LINE_FLOATS * 4
    runs = 1 << max(0, (budget // run_bytes - 1).bit_length())  # a power of two >= budget
    far = huge_page_buffer(runs * run_bytes).view(torch.float32).numpy()
    far[:] = 1.0  # its pages made now, not in the timed steps
    small = np.ones(SMALL_FLOATS, np.float32)
    shuffled = np.random.default_rng(0).permutation(runs).astype(np.int64) * run_bytes // 4
    timings: dict[str, list[float]] = {}
    # Each timing reads lines that no timing has read since the whole array was: lines read
    # again soon after would come from the last-level cache.
    cursor = [0]

    def timed(key: str, shift: int, reads: bool, work: bool) -> None:
        _steps(small, far, shuffled, cursor[0], 1000, shift, reads, work)  # compiled, warm
        cursor[0] += (1000 >> shift) + AHEAD
        t0 = time.perf_counter()
        _steps(small, far, shuffled, cursor[0], mode["steps"], shift, reads, work)
        timings.setdefault(key, []).append((time.perf_counter() - t0) / mode["steps"] * 1e9)
        cursor[0] += (mode["steps"] >> shift) + AHEAD

    for _ in range(mode["rounds"]):
        timed("work", 0, False, True)
        for every in EVERY:
            shift = every.bit_length() - 1
            timed(f"reads_{every}", shift, True, False)
            timed(f"both_{every}", shift, True, True)
    ns = {key: statistics.median(values) for key, values in timings.items()}
    rates = [{"every": every, "reads_ns": ns[f"reads_{every}"], "both_ns": ns[f"both_{every}"],
              "both_over_larger": ns[f"both_{every}"] / max(ns["work"], ns[f"reads_{every}"])}
             for every in EVERY]
    return {"work_ns": ns["work"], "rates": rates, "run_lines": RUN_LINES, "ahead": AHEAD,
            "far_bytes": runs * run_bytes}


def render(got: dict | None) -> list[str]:
    """The probe's lines under the attention table; none where it was not run."""
    if not got:
        return []
    per = " / ".join(f"{r['reads_ns']:.1f}" for r in got["rates"])
    both = " / ".join(f"{r['both_ns']:.1f}" for r in got["rates"])
    ratio = " / ".join(f"{r['both_over_larger']:.2f}x" for r in got["rates"])
    every = " / ".join(str(r["every"]) for r in got["rates"])
    return ["", f"Reads beside work, one thread (bench/overlap.py: a line prefetched from "
            f"{got['far_bytes'] >> 20} MiB every {every} steps, runs of {got['run_lines']} "
            f"lines in shuffled order; each step a load from L1 and {4 * WORK} multiply-adds): "
            f"work alone {got['work_ns']:.1f} ns a step; reads alone {per}; both {both}: "
            f"{ratio} the larger alone (1.00x: the reads hide under the work; up to 2x: they "
            "add)."]
