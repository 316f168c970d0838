"""The kernels a cache reads and writes through: one interface, three implementations.

Each implementation has the same two functions: paged dequant-attention (`attend`, the signature
of reference.paged_attention_ref) and quantize-on-store (`store`, reference.quantize_store_ref);
and a merge of attention partials over disjoint key sets (`merge`, reference.merge_partials).

    layout.py        PoolLayer, StoredFormat and check_layout: what every kernel reads
    reference.py     the torch references: what every kernel computes (read these first)
    cpu.py           the fused CPU kernels' entry (numba): CpuKernels; the attention kernel is
                     cpu_plain.py (readable) or its vector twin cpu_vector.py, the store
                     cpu_store.py (DESIGN.md lists the rest)
    triton.py        the fused GPU attention kernel; triton_store.py its store;
                     triton_aot.py their ahead-of-time compile for sm_80/sm_90

`select_kernels` picks one implementation per cache, once, when the cache is built.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..blocks import CacheError
from ..quant import head_map_ref
from .layout import PoolLayer, StoredFormat, check_layout, stored_format
from .reference import merge_partials, paged_attention_ref, quantize_store_ref

__all__ = ["Kernels", "PoolLayer", "StoredFormat", "check_layout", "select_kernels",
           "stored_format"]


@dataclass(frozen=True)
class Kernels:
    """The attention and store kernels a cache uses, and what they can do."""
    name: str  # torch | cpu | triton: for messages and reports, never to choose a code path
    attend: Callable  # paged_attention_ref's signature
    store: Callable  # quantize_store_ref's signature
    # The kernels read host memory as their own: offloaded blocks can join the resident ones in
    # one pass (no staging copies). False for a GPU kernel, even one the interpreter runs.
    reads_host_memory: bool
    merge: Callable = merge_partials  # merges attend's partials over disjoint key sets
    # A step's store and attention as numpy calls, layer by layer (cpu.CpuKernels.direct), or
    # None where the implementation has none: the cache then goes through store and attend.
    direct: Callable | None = None
    # quant.head_map_ref's contract: how a layer's transform (quant.Transform) meets the rows
    head_map: Callable = head_map_ref


def select_kernels(attention: str, device: torch.device) -> Kernels:
    """`auto` is Triton on CUDA and the fused CPU kernel elsewhere (the torch reference, with a
    note on stderr, when the CPU kernel's JIT is missing)."""
    if attention not in ("auto", "torch", "cpu", "triton"):
        raise CacheError(f"unknown attention {attention!r} (expected auto, torch, cpu or triton)")
    if attention == "auto":
        attention = "triton" if device.type == "cuda" else "cpu"
        if attention == "cpu" and not _cpu_kernels_available():
            print("[tinykv] the CPU kernel needs numba; using the torch reference", file=sys.stderr)
            attention = "torch"
    if attention == "triton":
        from . import triton as triton_kernels
        from . import triton_store
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU runs it, slowly
        if triton_kernels.triton is None or not (device.type == "cuda" or interpreted):
            raise CacheError("--attention triton needs Triton and a CUDA device "
                             "(or TRITON_INTERPRET=1 to run it on the CPU, slowly)")
        return Kernels("triton", triton_kernels.paged_attention_triton,
                       triton_store.quantize_store_triton, reads_host_memory=False)
    if attention == "cpu":
        if device.type != "cpu" or not _cpu_kernels_available():
            raise CacheError("--attention cpu needs numba and the model on the CPU")
        from . import cpu
        kernels = cpu.CpuKernels()  # one per cache: it keeps the arguments it converts
        return Kernels("cpu", kernels.attend, kernels.store, reads_host_memory=True,
                       merge=cpu.merge_partials_cpu, direct=kernels.direct,
                       head_map=cpu.head_map_cpu)
    return Kernels("torch", paged_attention_ref, quantize_store_ref,
                   reads_host_memory=device.type == "cpu")


def _cpu_kernels_available() -> bool:
    try:
        from . import cpu
    except ImportError:
        return False
    return cpu.AVAILABLE
