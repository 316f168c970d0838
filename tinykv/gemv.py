"""Decode-time linear layers on the CPU: y = x W^T + b for a few rows of x, reading W once; and
the RMSNorm those layers read their rows from, in one pass.

A decode step multiplies one activation row per sequence by every weight matrix of the model, so
its linear layers are matrix-vector products bound by the bytes of W, not by arithmetic. Torch's
`F.linear` takes the general matmul path for them and reads the weights well below the machine's
bandwidth. The kernel here walks W in blocks of `ROWS` output rows (the unit threads split) and
reads each block from memory once. How it reads a block depends on the batch. For a few
activation rows, and for half weights, sliced: a block's 8 rows come from 8 slices of W, so 8
sequential streams are read at once, and each row is multiplied by every activation row while it
sits in L1. Float32 weights at more rows, up to `TILE_BATCH`, go 4 rows by 4 activation rows at
a time in vector registers (gemv_tiles.py; 2 by 8 from 9 to 16 activation rows of short rows);
beyond, 8 contiguous rows in parallel, each activation row multiplied by the block in L1. Half
weights widen element by element (`SMALL_BATCH`). Prefill chunks and large batches, where a
matmul is bound by arithmetic, stay with torch.

`gemv_layer.select_kernels(device, ...)` chooses once, when the model is loaded (model.py calls
it), like the attention kernels: `linear_cpu` where numba is installed and the weights are on the
CPU, else model.fused_linear (torch); gemv_layer.py builds a whole decode layer's two calls on the
same GEMV. Weights may be float32, bfloat16 or float16: half weights travel as integer bits and
are widened in registers (numba has no float16 on the CPU), accumulation is float32 either way;
weights packed from 4- or 8-bit blocks (packed.py) go through gemv_packed.py's loops.

torch's RMSNorm on the CPU is several small operations, each with a fixed cost; a decode step
runs two per layer on a few rows, where that cost is all there is. The norm is fused before the
GEMV; `rms_norm_cpu` is the same pass alone (float32 rows; anything else goes to torch).
"""

from __future__ import annotations

import hashlib
import platform
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from . import packed
from .gemv_packed import UNIT, panels_product
from .gemv_tiles import EIGHT_ROWS, L1_DATA_BYTES, _eight_rows, tiles_block
from .kernels.cpu_numerics import exp, kernel, use_threads
from .kernels.cpu_simd import HAS_F16C, WIDE_VECTORS
from .kernels.layout import CACHE_LINE, empty_rows

try:
    import numba
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.extending import intrinsic, overload

    AVAILABLE = True
    # LLVM widens half to float with one F16C instruction; without F16C it would call a runtime
    # function numba may not link, so float16 weights then stay with torch. Asked of the target
    # numba compiles for (NUMBA_CPU_FEATURES), as cpu_simd does.
    F16C = platform.machine() not in ("x86_64", "AMD64") or HAS_F16C
except ImportError:  # no numba: every product goes to torch
    AVAILABLE, F16C = False, False
    numba = ir = types = None
    prange = range

    def intrinsic(fn):
        return fn

    def njit(*_a, **_kw):
        return intrinsic

# output rows per block: per pass over x, 8 weight streams and 8 vector accumulators in the
# eight-row loop (4: slower, bench profile's linear alone)
ROWS = EIGHT_ROWS
SMALL_BATCH = 8  # activation rows up to which the GEMV beats torch's matmul (bench profile)
TILE_BATCH = 64  # the same for float32 weights, read in tiles (gemv_tiles.py)
# Up to this many activation rows (and for half weights, always) the sliced loop (_sliced): the
# eight-row loop's arithmetic on 8 rows from 8 slices of W, 8 sequential streams far apart, where
# the earlier loop here read one row's stream (its rows requested 2 to 32 ahead, into any cache
# level: 9.4-10.4 GB/s on rows of 576 floats; 4 streams a quarter of W apart 17.9). Over the 121
# matrices on a Sapphire Rapids, one thread, outputs preallocated, the two loops timed in turn:
# float32 at 1 row 0.71x that loop's time, bf16 0.74x at 1 row to 0.84x at 8, fp16 0.76x to 0.88x
# at 4. Against the float32 tiles with AVX-512, the weights on huge pages: 0.95-0.97x at 4 rows,
# 1.07x at 5, 1.28x at 8; with AVX2 code (NUMBA_CPU_NAME=haswell, same machine, before huge
# pages) 0.65x at 2 rows to 0.86x at 8, so there the tiles are not used.
SLICED_MAX_ROWS = 4 if WIDE_VECTORS else 8
# More rows than this: the eight-row loop. With 256-bit vectors (AVX2) a tile's 16 accumulators
# are 32 registers' worth in 16: per step of 16 channels its hot loop does 32 multiply-adds and
# stores 18 vectors to the stack and reloads 22 (with AVX-512: 16, 9.5 and 11.5; read from the
# assembly), so there they are slower than the eight-row loop from 12 rows (measured over the
# model's matrices on a Zen 3: 16 rows 165 ms against 130, 64 rows 624 against 383) and than the
# sliced loop at 2 to 8 (above).
TILE_MAX_ROWS = TILE_BATCH if WIDE_VECTORS else 8
# Weight dtype -> the numpy type the kernel receives it as. The element type tells the kernel the
# format (gemv_tiles._widen): half weights travel as bits, bf16 as int16 and fp16 as uint16.
_AS_NUMPY = {torch.float32: np.float32, torch.bfloat16: np.int16, torch.float16: np.uint16}


_FASTMATH = {"reassoc", "contract", "arcp", "nsz"}  # sums may be reordered; nans still propagate


# prange's index may be unsigned, and int64 + uint64 is a float in numba: blocks go in as int64
@njit(inline="always", cache=True)
def _sliced(x, w, y, block):
    """_gemv_block's contract for a block of rows far apart: row `block` of each of ROWS slices
    of ceil(N / ROWS) rows, so a pass over the block's rows reads ROWS sequential streams at once,
    each in its own part of memory. A core's hardware prefetchers track streams by 4 KiB page,
    so streams in 8 pages at once likely keep more reads in flight than one (not counted here:
    no performance counters in the VM it was measured on; SLICED_MAX_ROWS: what it gains)."""
    _eight_rows(x, w, y, np.int64(block), -(-w.shape[0] // ROWS))


def _gemv_block(x, w, y, block):
    """Output rows block*ROWS .. +ROWS (fewer at the end) of y (B, N) = x (B, K) @ w (N, K)^T:
    eight contiguous weight rows, each read from memory once for the whole batch."""
    _eight_rows(x, w, y, np.int64(block) * ROWS, 1)


# numba's disk cache watches only the file that defines a function: the linear kernels inline
# the GEMV's loop files too (and kernels/cpu_simd*.py, which kernel()'s key covers): all hashed
_SOURCES = hashlib.sha256(b"".join((Path(__file__).parent / name).read_bytes()
                                   for name in ("gemv.py", "gemv_tiles.py", "gemv_packed.py")))
_SOURCES = f"{_SOURCES.hexdigest()} L1d {L1_DATA_BYTES}"  # compiled in as a constant


def serial_and_parallel(fn: Callable, variant: tuple) -> tuple:
    """fn, written with prange, compiled twice: for one thread (where numba runs prange as range)
    and with prange's iterations split between threads; disk-cached under `variant` (the sources
    it inlines) and which of the two it is."""
    return (kernel((*variant, "serial"), fastmath=_FASTMATH)(fn),
            kernel((*variant, "parallel"), fastmath=_FASTMATH, parallel=True)(fn))


def out_rows(w):
    """N of a weight (N, K): an array's, or a packed one's (packed.Packed)."""
    return w.shape[0]


def blocks(w):
    """How many calls of _block cover a weight's output rows: blocks of ROWS rows, or for a
    packed weight units of UNIT panels (gemv_packed.py)."""
    return -(-w.shape[0] // ROWS)


def in_cols(w):
    """K of a weight (N, K), as out_rows."""
    return w.shape[1]


def _block(x, w, y, block):
    """_gemv_block's contract, by the loop that reads these weights fastest for this many rows:
    sliced (_sliced) for half weights and up to SLICED_MAX_ROWS rows; float32 weights in tiles of
    registers (gemv_tiles.py) from there to TILE_MAX_ROWS rows; eight contiguous rows beyond."""
    _gemv_block(x, w, y, block)


if AVAILABLE:
    _eight_rows_block = njit(fastmath=_FASTMATH, cache=True)(_gemv_block)

    @overload(out_rows)
    def _out_rows_for(w):
        if isinstance(w, types.BaseTuple):
            return lambda w: w.rows
        return lambda w: w.shape[0]

    @overload(in_cols)
    def _in_cols_for(w):
        if isinstance(w, types.BaseTuple):
            return lambda w: w.codes.shape[1] * 2
        return lambda w: w.shape[1]

    @overload(blocks)
    def _blocks_for(w):
        if isinstance(w, types.BaseTuple):
            return lambda w: -(-w.codes.shape[0] // UNIT)
        return lambda w: -(-w.shape[0] // ROWS)

    @overload(_block)
    def _block_for(x, w, y, block):
        if isinstance(w, types.BaseTuple):  # packed.Packed: its loops read x by flat index
            if x.layout == "C":
                return lambda x, w, y, block: panels_product(x, w, y, np.int64(block))
            return lambda x, w, y, block: panels_product(np.ascontiguousarray(x), w, y,
                                                         np.int64(block))
        if w.dtype != types.float32:
            return lambda x, w, y, block: _sliced(x, w, y, block)

        def float32_block(x, w, y, block):
            if x.shape[0] <= SLICED_MAX_ROWS:
                _sliced(x, w, y, block)
            elif x.shape[0] <= TILE_MAX_ROWS:
                tiles_block(x, w, y, block * ROWS, ROWS, L1_DATA_BYTES)
            else:
                _eight_rows_block(x, w, y, block)
        return float32_block

    @njit(fastmath=_FASTMATH, cache=True)
    def _rms_norm_rows(x, weight, eps, out):
        """out (B, D) = x / sqrt(mean(x^2) + eps) * weight, row by row, in float32."""
        for b in range(x.shape[0]):
            squares = np.float32(0.0)
            for c in range(x.shape[1]):
                squares += x[b, c] * x[b, c]
            inv = np.float32(1.0) / np.sqrt(squares / np.float32(x.shape[1]) + eps)
            for c in range(x.shape[1]):
                out[b, c] = x[b, c] * inv * weight[c]

    @njit(inline="always", cache=True)
    def empty_lines(rows, cols):
        """np.empty((rows, cols), float32) on a cache line, as layout.empty_rows: numba starts
        arrays on 32 bytes, and a vector load of a line-long row that starts mid-line reads two."""
        raw = np.empty(rows * cols + CACHE_LINE // 4, np.float32)
        start = -raw.ctypes.data % CACHE_LINE // 4
        return raw[start:start + rows * cols].reshape((rows, cols))

    @njit(fastmath=_FASTMATH, inline="always", cache=True)
    def _normalized(x, norm_weight, eps):
        """x's rows through the RMSNorm of weight norm_weight, or x itself when it has none."""
        if norm_weight.size == 0:
            return x
        out = empty_lines(x.shape[0], x.shape[1])  # (B, K)
        _rms_norm_rows(x, norm_weight, eps, out)
        return out

    @njit(fastmath=_FASTMATH, inline="always", cache=True)
    def _epilogue(y, bias, residual, swiglu, out):
        """out (B, M) = act(y (B, N) + bias) + residual, bias added into y (out, or scratch): act
        silu(gate) * up of y's halves (M = N / 2) with swiglu, else none and y is out."""
        m = out.shape[1]
        for b in range(out.shape[0]):
            for j in range(y.shape[1] if bias.size else 0):
                y[b, j] += bias[j]
            if swiglu:  # F.silu(gate) * up, in a loop LLVM vectorizes: cpu_numerics' e^x, not
                for j in range(m):  # libm's, and a reciprocal, as / checks for a zero and branches
                    gate = y[b, j]
                    out[b, j] = gate * np.reciprocal(np.float32(1.0) + exp(-gate)) * y[b, j + m]
            if residual.size:
                for j in range(m):
                    out[b, j] = residual[b, j] + out[b, j]

    def _linear(x, norm_weight, eps, w, bias, residual, swiglu, out):
        """out = act(norm(x) @ w^T + bias) + residual (`_epilogue`), in one call."""
        x = _normalized(x, norm_weight, eps)
        y = empty_lines(x.shape[0], out_rows(w)) if swiglu else out  # (B, N)
        for block in prange(blocks(w)):
            _block(x, w, y, block)
        _epilogue(y, bias, residual, swiglu, out)

    _linear_serial, _linear_parallel = serial_and_parallel(_linear, ("gemv", _SOURCES))


_NONE_1D = np.empty(0, np.float32)  # an absent bias or norm weight, for the kernels
_NONE_2D = np.empty((0, 0), np.float32)  # an absent residual


def _threads() -> int:
    """Torch's thread count, within numba's (as cpu.py): the kernels follow torch's setting."""
    return min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)


def _weight_array(weight: torch.Tensor) -> np.ndarray:
    """(N, K) as the kernels read it: packed (packed.py) when pack_model packed it; float32 as
    is; half weights as bits (int16 for bf16, uint16 for fp16: what gemv_tiles._widen reads)."""
    arrays = packed.packed_arrays(weight)
    if arrays is not None:
        return arrays
    w = weight.detach()
    if weight.dtype == torch.float32:
        return w.numpy()
    return w.view(torch.int16).numpy().view(_AS_NUMPY[weight.dtype])


def _run_linear(x, norm_weight, eps, w, bias, residual, swiglu, out) -> None:
    """The fused kernel on torch's number of threads."""
    threads = _threads()
    if threads > 1:
        use_threads(threads)
        _linear_parallel(x, norm_weight, eps, w, bias, residual, swiglu, out)
    else:
        _linear_serial(x, norm_weight, eps, w, bias, residual, swiglu, out)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (B, K) float32 @ weight (N, K)^T -> (B, N) float32, by the numba kernel, on torch's
    number of threads."""
    y = empty_rows((x.shape[0], weight.shape[0]))  # (B, N)
    _run_linear(x.numpy(), _NONE_1D, np.float32(0.0), _weight_array(weight), _NONE_1D, _NONE_2D,
                False, y)
    return torch.from_numpy(y)


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the GEMV serves this product: a few rows, CPU tensors, a weight stored row by row
    in a format it reads."""
    batch = TILE_BATCH if weight.dtype == torch.float32 else SMALL_BATCH
    return (x.numel() <= batch * x.shape[-1] and weight.dtype in _AS_NUMPY
            and x.is_cpu and weight.is_contiguous()
            and (weight.dtype != torch.float16 or F16C))


def _float32_rows(t: torch.Tensor | None) -> bool:
    return t is not None and t.dtype == torch.float32 and t.is_contiguous()


def linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               norm: nn.Module | None = None, residual: torch.Tensor | None = None,
               swiglu: bool = False, *, reference: Callable) -> torch.Tensor:
    """`reference`'s contract (model.fused_linear: norm(x) W^T + b, silu(gate) * up with swiglu,
    + residual), x (..., K) -> (..., N or N / 2): one kernel call for a few float32 rows
    (the norm fused when it is an RMSNorm in float32), `reference` otherwise."""
    if not fits(x, weight):
        return reference(x, weight, bias, norm, residual, swiglu)
    if not (_float32_rows(x) and (bias is None or _float32_rows(bias))):
        return _in_float32(x, weight, bias, norm, residual, swiglu, reference)
    norm_weight, eps = _NONE_1D, np.float32(0.0)
    if norm is not None:
        if not (isinstance(norm, nn.RMSNorm) and _float32_rows(norm.weight) and norm.eps):
            return linear_cpu(norm(x), weight, bias, None, residual, swiglu, reference=reference)
        norm_weight, eps = norm.weight.detach().numpy(), np.float32(norm.eps)  # fused
    if residual is not None and not _float32_rows(residual):
        return residual + linear_cpu(x, weight, bias, norm, None, swiglu, reference=reference)
    n_out = weight.shape[0] // 2 if swiglu else weight.shape[0]
    rows = x.numel() // x.shape[-1]
    out = empty_rows((rows, n_out))  # (B, M)
    _run_linear(x.view(rows, x.shape[-1]).numpy(), norm_weight, eps, _weight_array(weight),
                _NONE_1D if bias is None else bias.detach().numpy(),
                _NONE_2D if residual is None else residual.view(rows, n_out).numpy(), swiglu, out)
    y = torch.from_numpy(out)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n_out)


def _in_float32(x, weight, bias, norm, residual, swiglu, reference) -> torch.Tensor:
    """linear_cpu for half activations or bias: the norm in x's dtype, the product in float32,
    rounded back to x's dtype, then the residual."""
    dtype = x.dtype
    x = (x if norm is None else norm(x)).to(torch.float32).contiguous()
    bias = None if bias is None else bias.to(torch.float32)
    y = linear_cpu(x, weight, bias, None, None, swiglu, reference=reference).to(dtype)
    return y if residual is None else residual + y


def rms_norm_cpu(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None = None,
                 eps: float | None = None) -> torch.Tensor:
    """F.rms_norm's contract over the last dim: one pass per row for contiguous float32 rows with
    a weight and an eps, F.rms_norm otherwise."""
    if (weight is None or eps is None or x.dtype != torch.float32 or len(normalized_shape) != 1
            or weight.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous()):
        return F.rms_norm(x, normalized_shape, weight, eps)
    flat = x.view(-1, x.shape[-1])  # (B, D)
    out = empty_rows(flat.shape)  # (B, D)
    _rms_norm_rows(flat.numpy(), weight.detach().numpy(), np.float32(eps), out)
    return torch.from_numpy(out).view(x.shape)
