"""What every benchmark shares: the machine it ran on, Markdown tables, prompts cut from a
text, timing in turn."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def machine_info(device: torch.device) -> dict:
    """What the results were measured on: CPU, threads, GPU, library versions, date and load."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    names = (ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
    transformers = None
    if importlib.util.find_spec("transformers"):
        transformers = importlib.metadata.version("transformers")
    return {"cpu": next(names, platform.machine()), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "device": str(device),
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "transformers": transformers, "cpu_kernels": cpu_target()}


def cpu_target() -> str:
    """What the CPU kernels compile for: their vector width and numba's target CPU (the host's
    unless NUMBA_CPU_NAME names another, as the AVX2 test pass does)."""
    try:
        from numba import config

        from ..kernels.cpu_simd import HAS_F16C, WIDE_VECTORS
    except ImportError:
        return "none (numba is not installed)"
    width = "512-bit vectors (AVX-512)" if WIDE_VECTORS else "256-bit vectors or narrower"
    return f"{width}{', F16C' if HAS_F16C else ''}; numba target {config.CPU_NAME or 'host'}"


def md_table(head: list[str], rows: list[list], right: int = 1) -> list[str]:
    """A Markdown table padded to aligned columns (readable printed too); columns from `right` on
    align right."""
    cells = [head] + [[str(c) for c in r] for r in rows]
    width = [max(len(r[i]) for r in cells) for i in range(len(head))]

    def line(row: list[str]) -> str:
        padded = [c.rjust(width[i]) if i >= right else c.ljust(width[i]) for i, c in enumerate(row)]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (width[i] + 1) + (":" if i >= right else "-")
                          for i in range(len(head))) + "|"
    return [line(head), rule] + [line(r) for r in cells[1:]]


def repeat_to(ids: list[int], n: int) -> list[int]:
    """ids repeated until there are n: a short text still gives long prompts (speed does not
    depend on what the words are; perplexity is measured on the text's first tokens)."""
    if not ids:
        raise ValueError("the benchmark text is empty")
    reps = -(-n // len(ids))
    return (ids * reps)[:max(n, len(ids))]


def time_in_turn(steps_of: dict[str, Callable[[], None]],
                 held_of: dict[str, Callable[[], float]], steps: int) -> dict[str, tuple]:
    """name -> (seconds of each of `steps` calls of steps_of[name], the mean of held_of[name]()
    (KV bytes in the cache) after each), the names taken in turn every round, after one untimed
    call each (JIT, allocator)."""
    for step in steps_of.values():
        step()
    times = {name: [] for name in steps_of}
    kv_bytes = {name: [] for name in steps_of}
    for _ in range(steps):
        for name, step in steps_of.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
            kv_bytes[name].append(held_of[name]())
    return {name: (times[name], statistics.mean(kv_bytes[name])) for name in steps_of}


def specs_that_fit(names, cfg, left_out: set[str] | None = None) -> list[str]:
    """Those of a benchmark's default KV specs (names) that a model of config cfg takes (its
    layers, its head_dim: KIVI-style's groups of 32 channels do not divide a head_dim of 80).
    Each other one is named on stderr (once: left_out, where given, holds those named) and left
    out, so that a model of another shape still runs the rest; specs a user gives are checked
    whole instead (KVSpec.check raises)."""
    from ..spec import KVSpec, SpecError

    left_out = set() if left_out is None else left_out
    kept = []
    for name in names:
        try:
            KVSpec.parse(name).check(cfg.n_layers, cfg.head_dim)
        except SpecError as e:
            if name not in left_out:
                print(f"[tinykv] the default spec {name} is left out: {e}", file=sys.stderr)
            left_out.add(name)
            continue
        kept.append(name)
    return kept
