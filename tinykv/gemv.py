"""Decode-time linear layers on the CPU: y = x W^T + b for a few rows of x, reading W once; and
the RMSNorm those layers read their rows from, in one pass.

A decode step multiplies one activation row per sequence by every weight matrix of the model, so
its linear layers are matrix-vector products bound by the bytes of W, not by arithmetic; torch's
`F.linear` reads the weights well below the machine's bandwidth there. The kernel here walks W in
blocks of output rows (the unit threads split), each read from memory once, in the loop that
suits the batch: for a few activation rows, and for half weights, sliced (a block's 8 rows from
8 slices of W: 8 sequential streams at once); float32 weights at more rows, up to `TILE_BATCH`,
in tiles of vector registers (gemv_tiles.py: 4 weight rows by 4 activation rows, or 2 by 8,
where vectors are 512 bits; gemv_narrow.py: 3 by 4 where they are 256); beyond, 8 contiguous rows
at once. Prefill chunks and large batches, bound by arithmetic, stay with torch.

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
from .gemv_narrow import NARROW_ROWS, narrow_block
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

ROWS = EIGHT_ROWS  # output rows a block: 8 weight streams, 8 accumulators (4: slower)
SMALL_BATCH = 8  # activation rows up to which the GEMV beats torch's matmul (bench profile)
TILE_BATCH = 64  # the same for float32 weights, read in tiles (gemv_tiles, gemv_narrow)
# With 256-bit vectors (AVX2) gemv_tiles' tiles spill (16 accumulators of two registers each, in
# 16 registers), so from this many rows float32 weights go in gemv_narrow's tiles of 4 by 3
# instead, in blocks of NARROW_ROWS output rows (`narrow`). Over the model's 210 layer matrices on
# a Zen 3, one thread, against the loops before them (sliced to 8 rows, eight-row beyond), in
# turn: 0.95-1.04x the time at 4 rows, 0.83-0.88x at 5, 0.62x at 8, 0.66x at 16, 0.65x at 64.
NARROW_MIN_ROWS = 4
# Up to this many activation rows (and for half weights, always) the sliced loop (_sliced): over
# the 121 matrices on a Sapphire Rapids, one thread, in turn with a loop that read one row's
# stream: float32 at 1 row 0.71x its time, bf16 0.74-0.84x at 1-8 rows, fp16 0.76-0.88x at 1-4;
# against the float32 tiles with AVX-512: 0.95-0.97x at 4 rows, 1.07x at 5, 1.28x at 8.
SLICED_MAX_ROWS = 4 if WIDE_VECTORS else NARROW_MIN_ROWS - 1
TILE_MAX_ROWS = TILE_BATCH  # with AVX-512, more rows than this: the eight-row loop
# Weight dtype -> the numpy type the kernel receives it as. The element type tells the kernel the
# format (gemv_tiles._widen): half weights travel as bits, bf16 as int16 and fp16 as uint16.
_AS_NUMPY = {torch.float32: np.float32, torch.bfloat16: np.int16, torch.float16: np.uint16}
_FASTMATH = {"reassoc", "contract", "arcp", "nsz"}  # sums may be reordered; nans still propagate


# prange's index may be unsigned, and int64 + uint64 is a float in numba: blocks go in as int64
@njit(inline="always", cache=True)
def _sliced(x, w, y, block):
    """_gemv_block's contract for a block of rows far apart: row `block` of each of ROWS slices
    of ceil(N / ROWS) rows, so a pass over the block's rows reads ROWS sequential streams at once
    (hardware prefetchers track a stream per 4 KiB page; SLICED_MAX_ROWS: what it gains)."""
    _eight_rows(x, w, y, np.int64(block), -(-w.shape[0] // ROWS))


def _gemv_block(x, w, y, block):
    """Output rows block*ROWS .. +ROWS (fewer at the end) of y (B, N) = x (B, K) @ w (N, K)^T:
    eight contiguous weight rows, each read from memory once for the whole batch."""
    _eight_rows(x, w, y, np.int64(block) * ROWS, 1)


# numba's disk cache watches only the file that defines a function: the linear kernels inline
# the GEMV's loop files too (and kernels/cpu_simd*.py, which kernel()'s key covers): all hashed
_SOURCES = hashlib.sha256(b"".join((Path(__file__).parent / name).read_bytes()
                                   for name in ("gemv.py", "gemv_tiles.py", "gemv_narrow.py",
                                                "gemv_packed.py")))
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


def narrow(n_rows):
    """Whether float32 weights go in gemv_narrow's tiles for this many activation rows."""
    return not WIDE_VECTORS and n_rows >= NARROW_MIN_ROWS


def blocks(x, w):
    """How many calls of _block cover a weight's output rows for activation rows x: blocks of
    ROWS rows (NARROW_ROWS for narrow tiles), or for a packed weight units of UNIT panels."""
    return -(-w.shape[0] // (NARROW_ROWS if narrow(x.shape[0]) else ROWS))


def in_cols(w):
    """K of a weight (N, K), as out_rows."""
    return w.shape[1]


def _block(x, w, y, block):
    """_gemv_block's contract, by the loop that reads these weights fastest for this many rows:
    sliced (_sliced) for half weights and up to SLICED_MAX_ROWS rows; float32 weights in tiles of
    registers from there (gemv_narrow.py with AVX2, gemv_tiles.py to TILE_MAX_ROWS rows with
    AVX-512); eight contiguous rows beyond."""
    _gemv_block(x, w, y, block)


if AVAILABLE:
    _eight_rows_block = njit(fastmath=_FASTMATH, cache=True)(_gemv_block)
    narrow = njit(inline="always", cache=True)(narrow)

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
    def _blocks_for(x, w):
        if isinstance(w, types.BaseTuple):
            return lambda x, w: -(-w.codes.shape[0] // UNIT)
        if w.dtype != types.float32:
            return lambda x, w: -(-w.shape[0] // ROWS)
        return lambda x, w: -(-w.shape[0] // (NARROW_ROWS if narrow(x.shape[0]) else ROWS))

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
            elif narrow(x.shape[0]):
                narrow_block(x, w, y, block * NARROW_ROWS, NARROW_ROWS)
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
        for block in prange(blocks(x, w)):
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
