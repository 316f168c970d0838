"""What a decode step may cost at best, measured or counted: the machine's read bandwidth, FMA
peak and clock (numba) and its last-level cache, the weights a step reads and the multiply-adds
its linear layers make (bench roofline, bench peers); and the thread count the measurements run
on."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from .. import gemv
from ..kernels.cpu_numerics import njit
from ..kernels.layout import cpu_caches
from ..model import Transformer
from ..packed import packed_arrays, packed_bytes


def set_threads(n: int) -> None:
    """torch's threads, and numba's where it is installed (the fused CPU kernels run on them).
    numba's first: starting its OpenMP pool resets the OpenMP thread count torch shares."""
    if importlib.util.find_spec("numba"):
        import numba

        from ..kernels.cpu_numerics import use_threads

        use_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    torch.set_num_threads(n)


def seconds(fn: Callable[[], object], reps: int) -> list[float]:
    """Wall seconds of `reps` calls of fn after an untimed one (JIT, allocator, page faults)."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


@njit(cache=True)
def _chain(n, x):
    """n iterations of two dependent 1-cycle integer ops (a shift, then an xor)."""
    for i in range(n):
        x = (x >> np.uint64(1)) ^ (x + np.uint64(i))
    return x


def clock_ghz(n: int = 50_000_000) -> float:
    """The core's clock: 2 cycles an iteration of `_chain` (best of 3)."""
    return 2 * n / min(seconds(lambda: _chain(n, np.uint64(12345)), 3)) / 1e9


def last_level_cache() -> int:
    """Bytes of the largest CPU cache (sysfs), 64 MiB where it cannot be read."""
    return max((size for _, _, size in cpu_caches()), default=64 * 2**20)


def measure_bandwidth(mib: int, reps: int) -> dict:
    """Read bandwidth in GB/s (1e9 bytes): torch's GEMV, tinykv's and a sum over a float32 matrix
    of `mib` MiB, best of `reps` each; `gb_s` is the highest (the closest to the memory's speed)."""
    cols = 4096
    a = torch.rand(mib * 2**20 // (4 * cols), cols)  # (R, C)
    x = torch.rand(cols)  # (C,)
    out = {"bytes": a.nbytes, "gemv_gb_s": a.nbytes / min(seconds(partial(torch.mv, a, x),
                                                                     reps)) / 1e9,
           "sum_gb_s": a.nbytes / min(seconds(a.sum, reps)) / 1e9}
    if gemv.AVAILABLE:
        product = partial(gemv.gemv, x[None], a)
        out["tinykv_gemv_gb_s"] = a.nbytes / min(seconds(product, reps)) / 1e9
    out["gb_s"] = max(v for k, v in out.items() if k.endswith("gb_s"))
    return out


def fma_peak(n: int = 20_000_000, threads: int = 1) -> float:
    """Float32 FMAs per second (G) of `threads` threads at once, each 8 independent chains of
    one-register multiply-adds (enough to fill two FMA units of 4 cycles' latency). A register
    is 16 lanes with AVX-512, 8 with AVX2: 16-lane chains there would be 16 registers and spill,
    measuring the stack instead. Past one thread it says what the machine gives the threads now:
    a host that runs other guests on the same cores gives less than the count times one."""
    from ..kernels.cpu_numerics import njit, prange
    from ..kernels.cpu_simd import WIDE_VECTORS, splat, store
    from ..kernels.cpu_simd_ops import fma

    lanes = 16 if WIDE_VECTORS else 8

    @njit(parallel=True)
    def fmas(out, n):
        for thread in prange(out.shape[0] // lanes):  # one chain set a thread
            a, b = splat(0.999, lanes), splat(0.5, lanes)
            x0, x1 = splat(1.0, lanes), splat(2.0, lanes)
            x2, x3 = splat(3.0, lanes), splat(4.0, lanes)
            x4, x5 = splat(5.0, lanes), splat(6.0, lanes)
            x6, x7 = splat(7.0, lanes), splat(8.0, lanes)
            for _ in range(n):  # llvm.fma: exactly one FMA each, never folded across iterations
                x0, x1, x2, x3 = fma(x0, a, b), fma(x1, a, b), fma(x2, a, b), fma(x3, a, b)
                x4, x5, x6, x7 = fma(x4, a, b), fma(x5, a, b), fma(x6, a, b), fma(x7, a, b)
            store(out, thread * lanes, x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7)

    before = torch.get_num_threads()
    set_threads(threads)
    try:
        out = np.zeros(threads * lanes, np.float32)
        best = min(seconds(partial(fmas, out, n), 3))
    finally:
        set_threads(before)
    return 8 * lanes * n * threads / best / 1e9


def reads_in_turn(mib: int, threads: list[int], reps: int = 5) -> dict[int, float]:
    """Thread count -> read bandwidth in GB/s of one pass over `mib` MiB by that many threads at
    once, each xor-ing its own slice (best of reps; the counts in turn within each rep). Past
    one thread it is what the memory gives the threads together now, which a host's other
    guests share: the ceiling a thread count's speedup meets where the reads are what binds."""
    from ..kernels.cpu_numerics import njit, prange

    @njit
    def xor_words(words):
        acc = np.uint64(0)
        for i in range(words.shape[0]):  # a loop of its own: LLVM vectorizes it (not in prange)
            acc ^= words[i]
        return acc

    @njit(parallel=True)
    def xor_slices(words, out):
        per = words.shape[0] // out.shape[0]
        for part in prange(out.shape[0]):  # one slice a thread
            out[part] = xor_words(words[part * per:part * per + per])

    words = np.ones(mib * 2**20 // 8, np.uint64)
    before = torch.get_num_threads()
    best = {}
    try:
        for rep in range(reps + 1):  # the first compiles and faults the pages in: untimed
            for n in threads:
                set_threads(n)
                out = np.zeros(n, np.uint64)
                t0 = time.perf_counter()
                xor_slices(words, out)
                took = time.perf_counter() - t0
                if rep > 0:
                    best[n] = min(best.get(n, np.inf), took)
    finally:
        set_threads(before)
    read = {n: words.shape[0] // n * n * words.itemsize for n in best}  # whole slices
    return {n: read[n] / t / 1e9 for n, t in best.items()}


def _unread_tables(model: Transformer) -> list[torch.Tensor]:
    """The embedding tables a decode step does not read whole (only its tokens' rows): all of
    them but one the LM head shares."""
    return [t.weight for t in (model.embed, model.pos_embed)
            if t is not None and t.weight is not model.lm_head.weight]


def weight_bytes(model: Transformer) -> int:
    """Parameter bytes a decode step reads: all of them (packed ones as packed: packed.py), less
    the embedding tables it does not read whole (a tied matrix is listed once, and read whole as
    the head)."""
    unread = _unread_tables(model)
    return sum(packed_bytes(p) for p in model.parameters() if not any(p is t for t in unread))


def packed_matrices(model: Transformer) -> int:
    """How many of the model's weights the decode GEMV reads packed (--packed-weights)."""
    return sum(packed_arrays(p) is not None for p in model.parameters())


def linear_macs(model: Transformer) -> int:
    """Multiply-adds of a decode token's linear layers: one per element of every weight matrix
    the step reads (the LM head's included)."""
    unread = _unread_tables(model)
    return sum(p.numel() for p in model.parameters()
               if p.dim() == 2 and not any(p is t for t in unread))
