"""Ahead-of-time compilation of the Triton kernels for a GPU target without a GPU
(`triton.compile` with a `GPUTarget`): the CPU-only check that every kernel variant compiles, and
its resource usage (registers, shared memory) from the cubin."""

from __future__ import annotations

import inspect
import os
import subprocess
import tempfile
from dataclasses import dataclass

import torch

from ..spec import KVSpec, QuantParams
from .layout import PoolLayer
from .triton import _attn_args, _attn_kernel, _interpreted, triton
from .triton_store import _store_args, _store_kernel


@dataclass(frozen=True)
class Variant:
    """One compiled form of a kernel: what its constexprs and pointer dtypes depend on."""
    kernel: str  # "attention" or "store"
    spec: str  # attention: a KV spec ("int8", "k=int4:channel:asym,v=fp16"); store: one format
    head_dim: int = 128
    block_size: int = 16
    n_rep: int = 1  # query heads per KV head (attention)
    dtype: str = "fp16"  # of q (attention) or of the stored x (store)

    def __str__(self) -> str:
        rep = f" n_rep={self.n_rep}" if self.kernel == "attention" else ""
        return f"{self.kernel} {self.spec} D={self.head_dim} BS={self.block_size}{rep} {self.dtype}"


_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_SIGNATURE_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                     torch.int8: "i8", torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64"}


def _example_pool(p: QuantParams, H: int, BS: int, D: int) -> PoolLayer:
    """Two blocks laid out as the cache lays them out: fp16 dynamic, fp32 static scales."""
    data = torch.zeros(2, H, BS, D // p.per_byte, dtype=p.storage_dtype)
    if p.is_float:
        return PoolLayer(data, None, None, p)
    if p.static:
        scale = torch.ones(1, 1 if p.gran == "tensor" else H, 1, p.ngroups(D))
    else:
        scale = torch.ones(2, *p.scale_shape(H, BS, D), dtype=torch.float16)
    return PoolLayer(data, scale, None if p.sym else torch.zeros_like(scale), p)


def _example_args(variant: Variant) -> tuple[object, dict]:
    """(kernel, its arguments by name) for tiny CPU tensors laid out as a real launch's are."""
    H, D, BS = 2, variant.head_dim, variant.block_size
    dtype = _TORCH_DTYPES[variant.dtype]
    if variant.kernel == "attention":
        spec = KVSpec.parse(variant.spec)
        k = _example_pool(spec.k, H, BS, D)
        v = _example_pool(spec.v, H, BS, D)
        q = torch.zeros(1, H * variant.n_rep, D, dtype=dtype)
        o = torch.zeros(1, *q.shape)
        lse = torch.zeros(1, *q.shape[:2])
        index = torch.zeros(1, dtype=torch.int32)
        table = torch.zeros(1, 2, dtype=torch.int32)
        args = _attn_args(q, index, index, k, v, table, index, D**-0.5, 1, o, lse)
        return _attn_kernel, args
    p = QuantParams.parse(variant.spec)
    pool = _example_pool(p, H, BS, D)
    x = torch.zeros(1, H, D, dtype=dtype)
    index = torch.zeros(1, dtype=torch.int32)
    count = torch.zeros((), dtype=torch.int32)
    args = _store_args(x, p, pool.data, pool.scale, pool.zero, index, index, count)
    return _store_kernel, args


def _ast_source(fn, args: dict):
    """triton.compiler.ASTSource for these argument values, under each API of Triton 3.x.

    Pointers and integers divisible by 16 get the divisibility hint a launch would give them
    (where Triton takes hints as a dict, 3.3+), so the code is what a launch compiles.
    """
    from triton.backends import compiler as backend_compiler

    constexpr = {param.name for param in fn.params if param.is_constexpr}
    types = {}
    for name in fn.arg_names:
        value = args[name]
        if name in constexpr:
            types[name] = "constexpr"
        elif isinstance(value, torch.Tensor):
            types[name] = "*" + _SIGNATURE_DTYPES[value.dtype]
        elif isinstance(value, float):
            types[name] = "fp32"
        elif -2**31 <= value < 2**31:
            types[name] = "i32"
        else:
            types[name] = "i64"
    constants = {name: args[name] for name in constexpr}
    if "constexprs" not in inspect.signature(triton.compiler.ASTSource).parameters:
        # Triton 3.0/3.1: `constants`, and a signature without the constexprs.
        signature = {name: t for name, t in types.items() if t != "constexpr"}
        return triton.compiler.ASTSource(fn=fn, signature=signature, constants=constants)
    attrs = None
    if not hasattr(backend_compiler, "AttrsDescriptor"):  # 3.3+: hints as a dict
        attrs = {}
        for i, name in enumerate(fn.arg_names):
            value = args[name]
            aligned = isinstance(value, torch.Tensor) or (type(value) is int and value % 16 == 0)
            if types[name] != "constexpr" and aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compiler.ASTSource(fn=fn, signature=types, constexprs=constants, attrs=attrs)


def _resource_usage(cubin: bytes) -> dict:
    """Registers, shared memory and local (spill) bytes of a cubin, from cuobjdump (no GPU)."""
    from triton.tools.disasm import path_to_cuobjdump

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([path_to_cuobjdump(), "-res-usage", f.name], check=True,
                             capture_output=True, text=True).stdout
    fields = {}
    for line in out.splitlines():
        if "REG:" in line:
            for item in line.split():
                name, _, value = item.partition(":")
                if value.isdigit():
                    fields[name] = int(value)
    return fields


def aot_compile_one(variant: Variant, cap: int) -> dict:
    """Compile one variant for sm_{cap}: its cubin's registers, shared bytes and spills."""
    assert not _interpreted(), "unset TRITON_INTERPRET before importing triton to compile kernels"
    from triton.backends.compiler import GPUTarget

    fn, args = _example_args(variant)
    compiled = triton.compile(_ast_source(fn, args), target=GPUTarget("cuda", cap, 32))
    usage = _resource_usage(compiled.asm["cubin"])
    return {"variant": str(variant), "target": f"sm_{cap}", "kernel": fn.__name__,
            "n_regs": usage["REG"], "n_spills": usage.get("LOCAL", 0) // 4,
            "shared": compiled.metadata.shared, "ptx_chars": len(compiled.asm["ptx"]),
            "cubin_bytes": len(compiled.asm["cubin"])}


def aot_compile(variants: list[Variant], caps: tuple[int, ...] = (80, 90),
                jobs: int | None = None) -> list[dict]:
    """aot_compile_one for every variant and target, in `jobs` processes (default: the CPUs).

    n_spills counts 4-byte words of local memory, as Triton's launcher reports them on a GPU.
    """
    from concurrent.futures import ProcessPoolExecutor

    work = [(variant, cap) for variant in variants for cap in caps]
    jobs = jobs or os.cpu_count() or 1
    if jobs == 1:
        return [aot_compile_one(variant, cap) for variant, cap in work]
    with ProcessPoolExecutor(jobs) as pool:
        futures = [pool.submit(aot_compile_one, variant, cap) for variant, cap in work]
        return [f.result() for f in futures]
