"""How the fused CPU kernels receive a pool: what is fixed when a kernel compiles (`PoolFormat`,
derived from layout.StoredFormat) and what is passed at each call (`PoolArrays`, numpy views of
the pool's tensors and the scale strides), the conversions from torch they share, and how one
stored code becomes a number.

A kernel is compiled once per pair of K and V formats (cpu.py), so a format's branches are
resolved by the compiler, not per key. The runtime part is a plain tuple: numba dispatches a
tuple of arrays and ints in about a microsecond, a namedtuple in several.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .cpu_numerics import BFLOAT, FLOAT32, FP8, HALF, INTEGER, from_fp8, from_half, load_scale, njit
from .layout import FLOAT, INT, PoolLayer, check_layout, stored_format

# Where a pool's scales vary: nowhere (float formats), per token (token and gN scales: each key
# its own), or per block or layer (channel, head and tensor scales: one set for a block's keys,
# which the kernel folds into the query once per block).
NO_SCALES, TOKEN_SCALES, SHARED_SCALES = range(3)


class PoolFormat(NamedTuple):
    """What a compiled kernel fixes about one pool (K or V)."""
    code: int  # FLOAT32, HALF, BFLOAT, FP8 or INTEGER: how a stored element becomes a number
    bits: int  # bits per integer code: 8, 4 or 2 (packed little end first); 8 otherwise
    scales: int  # NO_SCALES, TOKEN_SCALES or SHARED_SCALES
    scale_code: int  # FLOAT32, HALF or BFLOAT: how scales and zero points are stored
    has_zero: bool  # asym: a zero point beside each scale
    offset: float  # the stored code of 0 when there is no zero point (sym int4 8, int2 1.5)


class PoolArrays(NamedTuple):
    """One pool at one call, as the kernels unpack it (passed as a plain tuple)."""
    codes: np.ndarray  # (NB * H * BS, groups, per): a row's D // per_byte stored elements, split
    # into the groups that share a per-token scale (one group for other formats); row
    # (block * H + head) * BS + token
    scales: np.ndarray  # flat; float32 or half bits; a 1-element stand-in for float formats
    zeros: np.ndarray  # like scales; a stand-in when symmetric
    block_stride: int  # scale element strides; 0 where a dim is shared (broadcast)
    head_stride: int
    token_stride: int
    group_stride: int
    group_size: int  # channels per scale


_BITS_AS = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.uint16), 4: (torch.float32, np.float32)}


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor as a numpy view, as bits where numpy lacks the dtype (half, bf16,
    fp8); sym int8 codes stay int8, so the kernels read them signed."""
    if t.dtype == torch.int8:
        return t.numpy()
    as_torch, as_np = _BITS_AS[t.element_size()]
    return t.view(as_torch).numpy().view(as_np)


def as_index(t: torch.Tensor, dtype: type) -> np.ndarray:
    """An index tensor as a C-contiguous numpy array (a view when it already is one): another
    layout or dtype would compile another kernel."""
    return np.ascontiguousarray(t.numpy(), dtype)


def pool_format(pool: PoolLayer, D: int, token_stride: int) -> PoolFormat:
    """The compile-time description of a pool whose scales have this token stride."""
    fmt = stored_format(pool.p, D)
    if fmt.family == FLOAT:
        code = {32: FLOAT32, 16: HALF if pool.p.dtype == "fp16" else BFLOAT}[fmt.bits]
    else:
        code = INTEGER if fmt.family == INT else FP8
    scales = NO_SCALES if pool.scale is None else TOKEN_SCALES if token_stride else SHARED_SCALES
    scale_code = FLOAT32
    if pool.scale is not None and pool.scale.dtype != torch.float32:
        scale_code = HALF if pool.scale.dtype == torch.float16 else BFLOAT
    return PoolFormat(code=code, bits=fmt.bits if fmt.family == INT else 8, scales=scales,
                      scale_code=scale_code, has_zero=fmt.has_zero, offset=fmt.offset)


def readable(fmt: PoolFormat, group_size: int) -> bool:
    """Whether the kernels read this format in place: per-token scales must not split the codes
    that share a byte (int4:g1, int2:g1, int2:g2 go to the reference)."""
    per_byte = 8 // fmt.bits if fmt.code == INTEGER else 1
    return fmt.scales != TOKEN_SCALES or group_size % per_byte == 0


def pool_arrays(pool: PoolLayer, H: int, BS: int, D: int) -> tuple[PoolFormat, tuple]:
    """(format, arrays) of one pool, after checking its layout (layout.check_layout) and that the
    kernels can read it in place (contiguous, on the CPU)."""
    what = str(pool.p)
    strides = check_layout(pool, H, BS, D, what)
    data, scale, zero = pool.data, pool.scale, pool.zero
    assert data.is_contiguous() and data.device.type == "cpu", \
        f"{what}: data must be contiguous, on the CPU"
    assert scale is None or scale.is_contiguous(), f"{what}: scale must be contiguous"
    fmt = pool_format(pool, D, strides.token)
    stand_in = np.zeros(1, np.float32 if fmt.scale_code == FLOAT32 else np.uint16)
    scales = stand_in if scale is None else as_numpy(scale).reshape(-1)
    zeros = stand_in if zero is None else as_numpy(zero).reshape(-1)
    groups = 1 if scale is None else scale.shape[-1]
    dot_groups = groups if fmt.scales == TOKEN_SCALES and readable(fmt, D // groups) else 1
    codes = as_numpy(data).reshape(-1, dot_groups, data.shape[-1] // dot_groups)
    arrays = PoolArrays(codes=codes, scales=scales, zeros=zeros, block_stride=strides.block,
                        head_stride=strides.head, token_stride=strides.token,
                        group_stride=strides.group, group_size=D // groups)
    return fmt, tuple(arrays)


# ---- reading one code (inlined into the kernels) ---------------------------------------------

@njit(forceinline=True)
def planes(fmt):
    """Codes per stored element."""
    return 8 // fmt.bits if fmt.code == INTEGER else 1


@njit(forceinline=True)
def int_code(codes, row, g, i, j, bits):
    """Integer code plane j of stored element (g, i) of a row, as int32."""
    if bits == 8:
        return np.int32(codes[row, g, i])
    mask = np.uint32((1 << bits) - 1)
    return np.int32((np.uint32(codes[row, g, i]) >> np.uint32(j * bits)) & mask)


@njit(forceinline=True)
def float_code(code, codes, row, g, i):
    """Stored element (g, i) of a row of a float or fp8 pool, as float32. Every branch is typed
    for every format (only the compiler drops the others): hence the casts."""
    if code == FLOAT32:
        return np.float32(codes[row, g, i])
    if code == FP8:
        return from_fp8(np.uint32(codes[row, g, i]))
    return from_half(np.uint32(codes[row, g, i]), code)


@njit(forceinline=True)
def number(fmt, codes, row, g, i, j):
    """Code plane j of element (g, i) of a quantized row as float32 (integer codes or fp8)."""
    if fmt.code == INTEGER:
        return np.float32(int_code(codes, row, g, i, j, fmt.bits))
    return float_code(fmt.code, codes, row, g, i)


@njit(forceinline=True)
def zero_point(fmt, zeros, at):
    """The stored code of 0 at scale element `at`: its zero point (asym) or the format's offset."""
    if fmt.has_zero:
        return load_scale(zeros, fmt.scale_code, at)
    return np.float32(fmt.offset)
