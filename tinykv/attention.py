"""Which attention and store kernels a cache uses: one signature each, three implementations
(the torch references, the fused CPU kernels, the Triton kernels), chosen once per cache."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import kernels_triton, kernels_triton_store
from .blocks import CacheError
from .kernels import paged_attention_ref, quantize_store_ref


@dataclass(frozen=True)
class Kernels:
    """The attention and store kernels a cache uses: one signature each, three implementations."""
    name: str  # torch | cpu | triton
    attend: Callable  # paged_attention_ref's signature
    store: Callable  # quantize_store_ref's signature


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
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # the CPU runs it, slowly
        if kernels_triton.triton is None or not (device.type == "cuda" or interpreted):
            raise CacheError("--attention triton needs Triton and a CUDA device")
        return Kernels("triton", kernels_triton.paged_attention_triton,
                       kernels_triton_store.quantize_store_triton)
    if attention == "cpu":
        if device.type != "cpu" or not _cpu_kernels_available():
            raise CacheError("--attention cpu needs numba and the model on the CPU")
        from . import kernels_cpu
        return Kernels("cpu", kernels_cpu.paged_attention_cpu, kernels_cpu.quantize_store_cpu)
    return Kernels("torch", paged_attention_ref, quantize_store_ref)


def _cpu_kernels_available() -> bool:
    try:
        from . import kernels_cpu
    except ImportError:
        return False
    return kernels_cpu.AVAILABLE
