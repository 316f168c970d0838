"""What every kernel reads: one layer's pool (`PoolLayer`), the description of its stored format
(`StoredFormat`) that the CPU and Triton kernels both derive their constants from, and the one
layout check every kernel wrapper calls before it launches (`check_layout`).

Pool layout of one layer (see pools.py): `data` (NB, H, BS, D // per_byte) codes;
`scale`/`zero` (NB|1, H|1, BS|1, G), where G groups split the D channels. A size-1 dim is shared:
its stride is read as 0, so one address formula serves per-token, per-group, per-block and
static scales, and one dequant formula `x = (code - zero) * scale` serves every granularity.
"""

from __future__ import annotations

import ctypes
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..spec import QuantParams

CACHE_LINE = 64  # bytes
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}  # sysfs cache sizes: "32K", "1024K"


def cpu_caches() -> list[tuple[int, str, int]]:
    """(level, type, bytes) of each cache of CPU 0 that Linux's sysfs describes ("Data",
    "Instruction" or "Unified"); none where it describes none."""
    caches = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind, size = ((index / name).read_text().strip()
                                 for name in ("level", "type", "size"))
        except OSError:
            continue
        digits = size.rstrip("KMG")
        if level.isdigit() and digits.isdigit() and size[len(digits):] in _UNITS:
            caches.append((int(level), kind, int(digits) * _UNITS[size[len(digits):]]))
    return caches


def empty_rows(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """np.empty(shape, dtype) starting on a cache line. numpy starts arrays 16 or 48 bytes into one,
    and with rows a whole number of lines long (576 or 1536 float32) every vector load of such an
    array then straddles two lines: twice the L1 reads where the CPU kernels are bound by them."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize  # np.prod costs many times np.empty
    raw = np.empty(nbytes + CACHE_LINE, np.uint8)
    # its address without .ctypes.data, which builds a ctypes object and a dict on every call
    start = -ctypes.addressof(ctypes.c_char.from_buffer(raw)) % CACHE_LINE
    return raw[start:start + nbytes].view(dtype).reshape(shape)


HUGE_PAGE = 2 << 20  # bytes: x86's large page
MADV_HUGEPAGE = 14  # Linux's madvise advice: back this range with huge pages where it can


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """nbytes uint8, not yet written, starting on a 2 MiB page that Linux is asked to back with
    huge pages (transparent huge pages on `madvise`, as this project's machines have them)."""
    buffer = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # untouched: no pages yet
    offset = -buffer.data_ptr() % HUGE_PAGE
    if sys.platform == "linux":  # before the first write, which is when Linux picks the pages
        ctypes.CDLL(None).madvise(ctypes.c_void_p(buffer.data_ptr() + offset),
                                  ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
    return buffer[offset:offset + nbytes]


def onto_huge_pages(tensors: list[torch.Tensor]) -> None:
    """Move CPU tensors into one allocation, each on a cache line, that Linux is asked to back
    with 2 MiB pages, and point them at it (tensor.data: a Parameter stays the same object, so
    tied weights stay tied). A decode step reads every weight once: on 4 KiB pages that is a TLB
    miss and a page walk every 64 lines, on 2 MiB pages one every 32,768. Where the kernel does
    not take the advice (transparent huge pages off, not Linux), the copy still puts every
    tensor on a cache line."""
    sizes = [-(-t.nbytes // CACHE_LINE) * CACHE_LINE for t in tensors]
    buffer, offset = huge_page_buffer(sum(sizes)), 0
    for t, size in zip(tensors, sizes):
        moved = buffer[offset:offset + t.nbytes].view(t.dtype).view(t.shape)
        moved.copy_(t)
        t.data = moved
        offset += size


# Families of stored formats: a plain float cast, integer codes of `bits` bits, fp8 e4m3 bits.
FLOAT, INT, FP8 = 0, 1, 2


@dataclass
class PoolLayer:
    """One layer's K (or V) storage: what a kernel needs to read it."""
    data: torch.Tensor  # (NB, H, BS, D // per_byte)
    scale: torch.Tensor | None  # (NB|1, H|1, BS|1, G) or None for float storage
    zero: torch.Tensor | None  # like scale; None when symmetric
    p: QuantParams


@dataclass(frozen=True)
class StoredFormat:
    """How one pool's codes are stored and turned back into floats.

    Integer codes are unsigned in storage except sym int8; `offset` is the stored code of 0 for
    sym int4/int2 (int2's is 1.5: midrise). Packed codes hold channel per_byte*i + j of a row at
    bit j * bits of byte i.
    """
    family: int  # FLOAT, INT or FP8
    bits: int  # bits per code: 8 unless packed, 16 or 32 for floats
    signed: bool  # codes stored as int8 (sym int8); else unsigned
    has_zero: bool  # asym: a zero point per scale
    offset: float  # stored code of the value 0 (sym packed formats)
    group_size: int  # channels sharing one scale
    static: bool  # one set of scales per layer (calibrated), shared by every block and token
    storage: torch.dtype  # dtype of the data tensor

    @property
    def per_byte(self) -> int:
        """Codes per stored element: int4 and int2 codes are packed into bytes."""
        return 8 // self.bits if self.family == INT else 1


@dataclass(frozen=True)
class ScaleStrides:
    """Element strides of scale (and zero) over (block, head, token, group); 0 where shared."""
    block: int  # 0 for static (per-layer) scales
    head: int  # 0 for per-tensor scales
    token: int  # 0 unless per-token or per-group scales
    group: int


def stored_format(p: QuantParams, head_dim: int) -> StoredFormat:
    """The stored format of QuantParams p for rows of head_dim channels."""
    family = FLOAT if p.is_float else FP8 if p.dtype == "fp8" else INT
    group_size = head_dim // max(p.ngroups(head_dim), 1)
    return StoredFormat(family=family, bits=p.bits, signed=p.storage_dtype == torch.int8,
                        has_zero=not (p.sym or p.is_float), offset=float(p.offset),
                        group_size=group_size, static=p.static, storage=p.storage_dtype)


def broadcast_strides(t: torch.Tensor) -> list[int]:
    """Strides with 0 on size-1 dims: a shared value is read at one address for every index."""
    return [0 if n == 1 else st for n, st in zip(t.shape, t.stride(), strict=True)]


def check_layout(pool: PoolLayer, H: int, BS: int, D: int, what: str) -> ScaleStrides:
    """Assert that `pool` is laid out as every kernel reads it (`what` names it in errors):
    data (NB, H, BS, D // per_byte) of the format's dtype with contiguous channels, scale and zero
    present exactly when the format needs them, broadcasting to (NB, H, BS, G) and laid out alike.
    Returns the scale strides."""
    p, data, s, z = pool.p, pool.data, pool.scale, pool.zero
    G = 1 if s is None else s.shape[-1]
    assert data.dim() == 4 and tuple(data.shape[1:]) == (H, BS, D // p.per_byte) and D % G == 0, \
        f"{what}: data {tuple(data.shape)} is not (NB, {H}, {BS}, {D // p.per_byte})"
    assert data.stride(-1) == 1, f"{what}: channels must be contiguous"
    assert data.dtype == p.storage_dtype, f"{what}: {p} is stored as {p.storage_dtype}"
    assert (s is None) == p.is_float, f"{what}: a scale is needed exactly for quantized formats"
    assert (z is None) == (p.sym or p.is_float), f"{what}: a zero point is needed exactly for asym"
    if s is None:
        return ScaleStrides(0, 0, 0, 0)
    full = (data.shape[0], H, BS, G)
    assert s.dim() == 4 and all(n in (1, m) for n, m in zip(s.shape, full, strict=True)), \
        f"{what}: scale {tuple(s.shape)} does not broadcast to {full}"
    assert s.dtype in (torch.float32, torch.float16, torch.bfloat16), f"{what}: scale {s.dtype}"
    strides = broadcast_strides(s)
    assert z is None or (z.shape == s.shape and z.dtype == s.dtype
                         and broadcast_strides(z) == strides), f"{what}: zero is unlike scale"
    return ScaleStrides(*strides)
