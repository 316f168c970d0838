"""Tests for the fused CPU kernels (tinykv/kernels/cpu*.py): attention against the torch reference
(kernels/reference.py) and float64 math (test_reference.attention_f64), the store bit for bit
against its reference.

The first run compiles a kernel per pair of formats (about a minute on 2 cores); numba caches them
beside the modules.

Tolerances. float32 accumulation: TOL, as for the reference itself. Integer keys add one error,
derived here, not measured: the kernel dots the codes with the query rounded to int16, each
channel at most half a step off, step = max_c |q_c * s_c| / 32767 (s_c: a channel's scale where a
block shares it, else 1). A score sm * q . k moves by at most
    eps = sm * step / 2 * sum_c |k_c| / s_c
(times 1.01: the int32 dot's conversion to float32 adds at most 2^-24 of sum |q16| (|code| +
|zero|), under 1% of the rounding's own bound since |zero| <= 2048). With every score within eps,
the log-sum-exp moves by at most eps, and each probability by a factor within e^(+-2 eps), so an
output moves by at most (e^(2 eps) - 1) * 2 max_t |v_t|.
"""

import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from pools import ATTN_CASES, NB, make_batch, make_pool
from test_reference import attention_f64, dense

from tinykv import quant
from tinykv.kernels import cpu as kernels_cpu
from tinykv.kernels import cpu_vector
from tinykv.kernels.cpu_args import pool_arrays
from tinykv.kernels.cpu_simd import WIDE_VECTORS
from tinykv.kernels.cpu_vector import head_share, takes
from tinykv.kernels.reference import merge_partials, paged_attention_ref, quantize_store_ref
from tinykv.spec import QuantParams

if not kernels_cpu.AVAILABLE:
    pytest.skip(kernels_cpu.REASON, allow_module_level=True)

from tinykv.kernels.cpu import paged_attention_cpu, quantize_store_cpu  # noqa: E402

TOL = 3e-5
# Beyond pools.ATTN_CASES: head_dim 96, and group sizes and block sizes in new pairings.
MORE_CASES = [
    ("int8", "int4:g32", 3, 96, 32),
    ("int4:asym", "int8:asym", 8, 96, 16),
    ("int4:channel:asym", "fp16", 1, 96, 128),
    ("bf16", "int2:asym", 4, 128, 8),
    ("int2:g32", "int4:channel:asym", 3, 64, 16),
    ("int8", "int8:asym", 16, 32, 16),  # 16 heads a group: per-head reductions fill a piece
    # keys with per-token group scales (the vector kernel dequantizes them before the dots)
    ("int4:g32:asym", "int4:g32:asym", 3, 64, 16),
    ("int8:g32", "int2:g32", 2, 96, 32),
    ("int2:g16:asym", "fp16", 1, 128, 16),
    ("bf16", "fp16", 2, 64, 16),  # bf16 keys, widened as fp16 are
    # float32 pools (hot pools and skipped layers of a float32 model), beside quantized ones
    ("fp32", "int4:g32:asym", 3, 64, 16),
    ("int8", "fp32", 2, 96, 32),
    # int4 and int2 values with a scale a token read as fields of 32-bit words (DWORDS) by chunk
    ("int8", "int4:asym", 3, 128, 16),
    ("int4", "int2", 2, 128, 32),
    ("fp32", "fp32", 4, 128, 16),
    # more query heads a KV head than the vector kernel's 512 lanes: passes over its blocks
    ("int8", "fp16", 7, 128, 16),  # heads 0-3, then 3-6
    ("fp16", "int4:g32", 5, 256, 32),  # 0-1, 2-3, 3-4
]


def rounding_bound(q, q_seq, q_pos, k, v, table, ctx, sm):
    """(lse, o) bounds (N, Hq) on what rounding the query to int16 moves (module docstring)."""
    N, Hq, D = q.shape
    if k.p.is_float or k.p.dtype == "fp8":
        return torch.zeros(N, Hq), torch.zeros(N, Hq)
    K, V = dense(k), dense(v)  # (NB, H, BS, D) float64
    NB, H, BS, _ = K.shape
    s = torch.ones(NB, H, BS, D, dtype=torch.float64)  # the scale folded into the query
    if k.p.gran not in ("token", "group"):
        s = k.scale.double().expand(NB, H, BS, -1).repeat_interleave(D // k.scale.shape[-1], -1)
    lse_tol, o_tol = torch.zeros(N, Hq), torch.zeros(N, Hq)
    for n in range(N):
        b = int(q_seq[n])
        n_keys = min(int(q_pos[n]) + 1, int(ctx[b]))
        keys = [(int(table[b, t // BS]), t % BS) for t in range(n_keys) if table[b, t // BS] >= 0]
        for hq in range(Hq):
            h = hq // (Hq // H)
            eps = 0.0
            for blk, t in keys:
                step = (q[n, hq].double() * s[blk, h, t]).abs().max() / 32767
                eps = max(eps, float(sm * step / 2 * (K[blk, h, t] / s[blk, h, t]).abs().sum()))
            eps *= 1.01
            v_max = max([float(V[blk, h, t].abs().max()) for blk, t in keys], default=0.0)
            lse_tol[n, hq], o_tol[n, hq] = eps, math.expm1(2 * eps) * 2 * v_max
    return lse_tol, o_tol


def check(out, ref, f64, bound):
    """out (o, lse) within TOL + the rounding bound of float64 math, and of the reference (whose
    own distance from float64 is TOL); -inf exactly where float64 has it."""
    for got, want, exact, extra in zip(out, ref, f64, reversed(bound)):
        assert got.dtype == torch.float32 and got.shape == want.shape
        if got.dim() == 3:
            extra = extra[..., None]
        assert torch.equal(torch.isneginf(got), torch.isneginf(exact))
        finite = torch.isfinite(exact)
        tol = (TOL + TOL * exact.abs() + extra)[finite]
        assert ((got.double() - exact).abs()[finite] <= tol).all()
        assert ((got - want).double().abs()[finite] <= tol + TOL).all()


def with_threads(n: int):
    """torch's (and so the kernel's) thread count for one test, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    return before


@pytest.mark.parametrize("kspec,vspec,n_rep,D,BS,threads",
                         [c + (1,) for c in ATTN_CASES + MORE_CASES]
                         + [c + (2,) for c in (ATTN_CASES[3], MORE_CASES[0], ATTN_CASES[7])])
def test_attention_matches_reference_and_float64(kspec, vspec, n_rep, D, BS, threads):
    gen = torch.Generator().manual_seed(n_rep * 1000 + D + BS)
    H = 2
    k, v = make_pool(kspec, H, BS, D, gen), make_pool(vspec, H, BS, D, gen)
    q, q_seq, q_pos, table, ctx = make_batch(BS, H * n_rep, D, gen)  # decode rows + a 3-chunk
    sm = D**-0.5
    ref = paged_attention_ref(q, q_seq, q_pos, k, v, table, ctx, sm)
    f64 = attention_f64(q, q_seq, q_pos, k, v, table, ctx, sm)
    bound = rounding_bound(q, q_seq, q_pos, k, v, table, ctx, sm)
    assert torch.isinf(f64[1][-1]).all() and f64[1][:-1].isfinite().all()  # the last sees no key
    kernels = kernels_cpu.CpuKernels(threads_min_reads=0)  # threads however small the call
    before = with_threads(threads)
    try:
        for splits in (None, 1, 3):  # 3 splits: some empty (context 1), some holding only the hole
            out = kernels.attend(q, q_seq, q_pos, k, v, table, ctx, sm, splits)
            check(out, ref, f64, bound)
            assert (out[0][-1] == 0).all() and torch.isneginf(out[1][-1]).all()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("spec,BS,D", [("int8", 16, 64), ("fp16", 128, 64), ("int4:asym", 32, 96),
                                       ("int2:g8:asym", 16, 128), ("fp8:token", 64, 80),
                                       ("k=int4:channel:asym,v=int4:g32:asym", 16, 64)])
def test_attention_long_rows_and_splits(spec, BS, D):
    """Rows over many blocks, in order and shuffled, of mixed lengths, split any number of ways;
    the n_rep = 3 heads of the default model."""
    gen = torch.Generator().manual_seed(BS + D)
    H, NB = 3, 24
    kspec, vspec = spec.split(",v=") if ",v=" in spec else (spec, spec)
    k, v = make_pool(kspec.removeprefix("k="), H, BS, D, gen), make_pool(vspec, H, BS, D, gen)
    table = torch.stack([torch.arange(NB), torch.randperm(NB, generator=gen)]).int()
    table[1, 5] = -1  # a block held by another pool
    ctx = torch.tensor([NB * BS - 3, 7 * BS + 1], dtype=torch.int32)
    q, q_seq, q_pos = torch.randn(2, 3 * H, D, generator=gen), torch.arange(2), ctx.long() - 1
    sm = D**-0.5
    ref = paged_attention_ref(q, q_seq, q_pos, k, v, table, ctx, sm)
    f64 = attention_f64(q, q_seq, q_pos, k, v, table, ctx, sm)
    bound = rounding_bound(q, q_seq, q_pos, k, v, table, ctx, sm)
    for splits in (None, 2, 5, 64):
        check(paged_attention_cpu(q, q_seq, q_pos, k, v, table, ctx, sm, splits), ref, f64, bound)


def test_prefill_chunks_beside_decoding_rows():
    """Rows of more than CHUNK_MAX queries go to the reference, the rest to the kernel, merged in
    their packed order; with a -1 block that a chunk's first queries see nothing beyond."""
    gen = torch.Generator().manual_seed(11)
    BS, D, H = 16, 64, 3
    k, v = make_pool("int4:channel:asym", H, BS, D, gen), make_pool("int4:g32:asym", H, BS, D, gen)
    table = torch.tensor([[3, 4, 5, 6], [-1, 8, 9, -1], [10, 11, -1, -1]], dtype=torch.int32)
    ctx = torch.tensor([50, 40, 20], dtype=torch.int32)
    n = kernels_cpu.CHUNK_MAX + 3
    q_seq = torch.tensor([0] + [1] * n + [2])
    q_pos = torch.tensor([49, *range(40 - n, 40), 19])
    q_pos[1:3] = torch.tensor([3, 15])  # positions inside the -1 block: no visible key
    q = torch.randn(len(q_seq), 3 * H, D, generator=gen)
    ref = paged_attention_ref(q, q_seq, q_pos, k, v, table, ctx, D**-0.5)
    f64 = attention_f64(q, q_seq, q_pos, k, v, table, ctx, D**-0.5)
    bound = rounding_bound(q, q_seq, q_pos, k, v, table, ctx, D**-0.5)
    out = paged_attention_cpu(q, q_seq, q_pos, k, v, table, ctx, D**-0.5)
    check(out, ref, f64, bound)
    assert torch.isneginf(out[1][1:3]).all() and out[1][3:].isfinite().all()


def test_groups_within_a_byte_go_to_the_reference():
    """int4:g1 splits a byte's two codes between two per-token scales: not read in place."""
    gen = torch.Generator().manual_seed(5)
    k, v = make_pool("int4:g1", 2, 16, 64, gen), make_pool("int8", 2, 16, 64, gen)
    q, q_seq, q_pos, table, ctx = make_batch(16, 4, 64, gen)
    ref = paged_attention_ref(q, q_seq, q_pos, k, v, table, ctx, 0.125)
    out = paged_attention_cpu(q, q_seq, q_pos, k, v, table, ctx, 0.125)
    for got, want in zip(out, ref):
        assert torch.equal(got, want)


@pytest.mark.parametrize("by_chunk", [False, True], ids=["heads-together", "by-chunk"])
@pytest.mark.parametrize("kspec,vspec,n_rep,D,BS", ATTN_CASES + MORE_CASES)
def test_vector_kernel_matches_its_plain_twin(kspec, vspec, n_rep, D, BS, by_chunk):
    """Where the vector kernel takes the formats (cpu_vector.takes), it computes what the plain
    one does, in another order: both round the query to int16 alike, so only float32 sums differ.
    Both ways of summing values are checked on any CPU (each CPU's default is one of them)."""
    gen = torch.Generator().manual_seed(n_rep * 100 + D + BS)
    H = 2
    k, v = make_pool(kspec, H, BS, D, gen), make_pool(vspec, H, BS, D, gen)
    q, q_seq, q_pos, table, ctx = make_batch(BS, H * n_rep, D, gen)
    keep = [0, 1, 5, 6]  # the decoding rows (a chunk goes to the reference in both)
    args = (q[keep], torch.arange(4), q_pos[keep], k, v, table[[0, 1, 3, 4]], ctx[[0, 1, 3, 4]],
            D**-0.5)
    kf, k_arrays = pool_arrays(k, H, BS, D)
    vf, _ = pool_arrays(v, H, BS, D)
    if not takes(kf, vf, head_share(n_rep, D), D, BS, D // k_arrays[7]):
        pytest.skip(f"{kspec} / {vspec} at R={n_rep}, D={D}, BS={BS}: the plain kernel only")
    vec = kernels_cpu.CpuKernels(vector=True, by_chunk=by_chunk).attend(*args)
    plain = kernels_cpu.CpuKernels(vector=False).attend(*args)
    torch.testing.assert_close(vec[0], plain[0], atol=TOL, rtol=TOL)
    torch.testing.assert_close(vec[1], plain[1], atol=TOL, rtol=TOL)


@pytest.mark.parametrize("kspec,vspec", [("int8", "int8"), ("fp16", "bf16"),
                                         ("int4:channel:asym", "int4:g32:asym"),
                                         ("int4:asym", "int2:g32")])
def test_vector_kernel_parts_run_what_they_say(kspec, vspec):
    """The halves of the work that `bench kernel --cpu --parts` times alone (cpu_vector's parts):
    the keys alone make the whole kernel's log-sum-exp and no output; the values alone weigh every
    visible key alike, as float64 attention does for a query of zeros."""
    gen = torch.Generator().manual_seed(17)
    H, R, D, BS = 2, 3, 64, 16
    k, v = make_pool(kspec, H, BS, D, gen), make_pool(vspec, H, BS, D, gen)
    q, q_seq, q_pos, table, ctx = make_batch(BS, H * R, D, gen)
    keep = [0, 1, 5, 6]  # the decoding rows (a chunk goes to the reference)
    rows = (torch.arange(4), q_pos[keep], k, v, table[[0, 1, 3, 4]], ctx[[0, 1, 3, 4]])
    kf, k_arrays = pool_arrays(k, H, BS, D)
    assert takes(kf, pool_arrays(v, H, BS, D)[0], R, D, BS, D // k_arrays[7])
    whole = kernels_cpu.CpuKernels().attend(q[keep], *rows, D**-0.5)
    keys = kernels_cpu.CpuKernels(parts=cpu_vector.KEYS).attend(q[keep], *rows, D**-0.5)
    values = kernels_cpu.CpuKernels(parts=cpu_vector.VALUES).attend(q[keep], *rows, D**-0.5)
    torch.testing.assert_close(keys[1], whole[1], atol=TOL, rtol=TOL)
    assert not keys[0].any() and whole[0].abs().sum() > 0
    even = attention_f64(torch.zeros_like(q[keep]), *rows, D**-0.5)  # scores all 0
    no_bound = torch.zeros(len(keep), H * R)
    check(values, even, even, (no_bound, no_bound))


def test_vector_kernel_reads_bf16_scales_as_its_plain_twin():
    """Scales stored as bf16 (compute_scales' scale_dtype) go to the vector kernel too."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(NB, 2, 16, 64, generator=gen)  # (NB, H, BS, D)
    pools = []
    for spec in ("int4:asym", "int8:g32"):
        p = QuantParams.parse(spec)
        s, z = quant.compute_scales(x, p, torch.bfloat16)
        pools.append(kernels_cpu.PoolLayer(quant.quantize(x, p, s, z)[0], s, z, p))
    k, v = pools
    kf, k_arrays = pool_arrays(k, 2, 16, 64)
    vf, _ = pool_arrays(v, 2, 16, 64)
    assert takes(kf, vf, 3, 64, 16, 64 // k_arrays[7])
    q, _, q_pos, table, ctx = make_batch(16, 6, 64, gen)
    keep = [0, 1, 5, 6]  # the decoding rows
    args = (q[keep], torch.arange(4), q_pos[keep], k, v, table[[0, 1, 3, 4]], ctx[[0, 1, 3, 4]],
            0.125)
    vec = kernels_cpu.CpuKernels(vector=True).attend(*args)
    plain = kernels_cpu.CpuKernels(vector=False).attend(*args)
    torch.testing.assert_close(vec[0], plain[0], atol=TOL, rtol=TOL)
    torch.testing.assert_close(vec[1], plain[1], atol=TOL, rtol=TOL)


def test_vector_kernel_takes_the_default_model_formats():
    """The formats the benchmarks time, at the default model's shape, go to the vector kernel."""
    for spec in ("fp16", "int8", "int4", "int4:channel:asym", "int4:g32:asym", "int2:asym",
                 "int2:g32", "int2:g64", "fp32"):  # fp32: hot pools at the model's dtype
        pool = make_pool(spec, 3, 16, 64, torch.Generator().manual_seed(0))
        fmt, arrays = pool_arrays(pool, 3, 16, 64)
        assert takes(fmt, fmt, 3, 64, 16, 64 // arrays[7]), spec


def test_value_sums_stay_in_registers_only_where_they_fit():
    """All R x D value sums at once only with 512-bit vectors and up to 384 lanes (24 of the 32
    registers); a chunk of channels at a time past that, and always with 256-bit vectors."""
    shapes = [(3, 64), (3, 128), (4, 96), (4, 128), (8, 64), (5, 96)]  # 192 ... 384, 480 ... 512
    got = [cpu_vector.values_by_chunk(R, D) for R, D in shapes]
    assert got == ([False, False, False, True, True, True] if WIDE_VECTORS else [True] * 6)


def test_vector_kernel_takes_large_groups_in_passes():
    """A KV head's query heads past 512 lanes go in passes of as many as fit (the last pass
    ends at the group's end), and those pools to the vector kernel, not the plain one."""
    assert [head_share(R, D) for R, D in [(3, 64), (8, 64), (8, 128), (7, 128), (5, 256),
                                          (1, 512), (2, 1024)]] == [3, 8, 4, 4, 2, 1, 0]
    gen = torch.Generator().manual_seed(0)
    k, v = make_pool("int8", 2, 16, 128, gen), make_pool("fp16", 2, 16, 128, gen)
    kernels = kernels_cpu.CpuKernels()
    call = kernels._call(k, v, 2 * 8, 128)  # 8 query heads a KV head: two passes of 4
    (kf, k_arrays), (vf, v_arrays) = pool_arrays(k, 2, 16, 128), pool_arrays(v, 2, 16, 128)
    groups = (128 // k_arrays[7], 128 // v_arrays[7])
    assert call.serial is cpu_vector.vector_kernel(kf, vf, 4, 128, *groups, *kernels.variant)[0]


def _counts_in_loops(llvm_ir: str) -> list[str]:
    """The basic blocks of an LLVM module's functions that call NRT_incref or NRT_decref and
    lie on a cycle of branches (reach themselves): a reference counted once a loop's turn."""
    found = []
    for function in re.split(r"\ndefine ", llvm_ir)[1:]:
        blocks, label = {}, "entry"
        for line in function.splitlines()[1:]:
            start = re.match(r"^([\w.\-]+):", line)
            if start:
                label = start.group(1)
            blocks[label] = blocks.get(label, "") + line + "\n"
        after = {b: set(re.findall(r"label %([\w.\-]+)", text)) for b, text in blocks.items()}
        for b, text in blocks.items():
            if not re.search(r"call void @NRT_(incref|decref)", text):
                continue
            seen, todo = set(), list(after[b])
            while todo:
                nxt = todo.pop()
                if nxt not in seen:
                    seen.add(nxt)
                    todo.extend(after.get(nxt, ()))
            if b in seen:
                found.append(b)
    return found


def test_vector_kernel_counts_no_reference_in_its_loops(monkeypatch):
    """numba counts a reference to an array up and down where code takes it from a tuple or
    hands it to a function with branches, and such a pair left in the loop over blocks is two
    atomic adds a block to a count that every thread shares: the threads hand its cache line
    back and forth. The kernel compiled here (not from the disk cache: its IR is kept) counts
    its arrays on entry only."""
    from numba.core.caching import NullCache

    from tinykv.kernels import cpu_vector

    made = []

    def uncached(*args):
        kernels = cpu_vector.vector_kernel.__wrapped__(*args)
        for dispatcher in kernels:
            dispatcher._cache = NullCache()
        made.append(kernels)
        return kernels

    monkeypatch.setattr(kernels_cpu, "vector_kernel", uncached)
    gen = torch.Generator().manual_seed(3)
    k, v = make_pool("int4", 3, 16, 64, gen), make_pool("int4:g32:asym", 3, 16, 64, gen)
    q, q_seq, q_pos, table, ctx = make_batch(16, 9, 64, gen)
    keep = [0, 1, 5, 6]  # the decoding rows
    kernels_cpu.CpuKernels(vector=True).attend(q[keep], torch.arange(4), q_pos[keep], k, v,
                                               table[[0, 1, 3, 4]], ctx[[0, 1, 3, 4]], 0.125)
    llvm_ir = "\n".join(made[0][0].inspect_llvm().values())
    assert "call void @NRT_incref" in llvm_ir  # the counts on entry: what the search looks for
    assert _counts_in_loops(llvm_ir) == []


@pytest.mark.parametrize("name,dtype", [("HALF", torch.float16), ("BFLOAT", torch.bfloat16),
                                        ("FP8", torch.float8_e4m3fn)])
def test_widen_float_is_torch_for_every_bit_pattern(name, dtype):
    """The vector kernel's float codes widened to float32 (cpu_vector_rows.widen_float), every
    bit pattern against torch's own conversion: subnormals, infinities and NaNs included."""
    from tinykv.kernels import cpu_numerics
    from tinykv.kernels.cpu_simd import load, store
    from tinykv.kernels.cpu_vector_rows import widen_float

    code = getattr(cpu_numerics, name)
    size = torch.finfo(dtype).bits
    as_bits = {8: torch.uint8, 16: torch.int16}[size]
    bits = torch.arange(2**size, dtype=torch.int64).to(as_bits)  # every pattern, 16 a vector
    want = bits.view(dtype).float()

    @cpu_numerics.njit
    def widen_all(src, out):
        for i in range(0, src.shape[0], 16):
            store(out, i, widen_float(load(src, i, 16), code))

    got = np.empty(2**size, np.float32)
    widen_all(np.ascontiguousarray(bits.numpy().view({8: np.uint8, 16: np.uint16}[size])), got)
    torch.testing.assert_close(torch.from_numpy(got), want, rtol=0, atol=0, equal_nan=True)


def reads_every_chunk(reader, stored: torch.Tensor, want: torch.Tensor):
    """reader(first, lanes) -> read(flat codes, row, out): row 1 of the packed rows `stored`,
    each 16-lane chunk and the whole row, equals want (D,) lane for lane."""
    flat, D = np.ascontiguousarray(stored.numpy().reshape(-1)), want.shape[0]
    for first, lanes in [(c, 16) for c in range(0, D, 16)] + [(0, D)]:
        got = np.empty(lanes, np.float32)
        reader(first, lanes)(flat, 1, got)
        assert torch.equal(torch.from_numpy(got), want[first:first + lanes]), (first, lanes)


@pytest.mark.parametrize("bits,D", [(4, 64), (2, 64), (4, 128)])
def test_plane_lanes_reads_any_chunk_of_a_packed_row(bits, D):
    """cpu_simd.plane_lanes, which the value sums read a chunk of a packed row with: each 16-lane
    chunk, and the whole row, in stored order (lane j * width + i: field j of byte i), against
    the channels quant.unpack gives (channel per_byte * i + j)."""
    from tinykv.kernels import cpu_numerics
    from tinykv.kernels.cpu_simd import plane_lanes, store, to_float

    per_byte = 8 // bits
    width = D // per_byte  # bytes a row
    gen = torch.Generator().manual_seed(bits + D)
    codes = torch.randint(0, 2**bits, (3, D), generator=gen, dtype=torch.uint8)  # 3 rows
    stored = quant.pack(codes, per_byte)  # (3, width)
    lane = torch.arange(D)
    want = quant.unpack(stored, per_byte)[1, per_byte * (lane % width) + lane // width].float()

    def reader(first, lanes):
        @cpu_numerics.njit
        def read(src, row, out):
            store(out, 0, to_float(plane_lanes(src, row * width, first, lanes, bits, width)))
        return read

    reads_every_chunk(reader, stored, want)


@pytest.mark.parametrize("bits,D", [(4, 64), (4, 128), (2, 128)])
def test_dword_fields_read_any_chunk_of_a_packed_row(bits, D):
    """cpu_vector_rows.dword_fields, which int4 and int2 value sums read a chunk of a packed row
    with where they go by chunk: lane 8 j + i of a 32-byte chunk is field j of its little-endian
    32-bit word i (byte 4 i + j // per_byte, field j % per_byte of that byte), against the
    channels quant.unpack gives; and to_channel_order puts DWORDS lanes back in channel order."""
    from tinykv.kernels import cpu_numerics
    from tinykv.kernels.cpu_simd import load, store, to_float
    from tinykv.kernels.cpu_simd_ops import DWORDS, to_channel_order
    from tinykv.kernels.cpu_vector_rows import dword_fields

    per_byte, fields = 8 // bits, 32 // bits
    width = D // per_byte  # bytes a row
    gen = torch.Generator().manual_seed(bits + D + 1)
    codes = torch.randint(0, 2**bits, (3, D), generator=gen, dtype=torch.uint8)  # 3 rows
    stored = quant.pack(codes, per_byte)  # (3, width)
    lane = torch.arange(D)
    chunk, field, word = lane // (8 * fields), lane % (8 * fields) // 8, lane % 8
    byte = 32 * chunk + 4 * word + field // per_byte
    want = quant.unpack(stored, per_byte)[1, per_byte * byte + field % per_byte].float()

    def reader(first, lanes):
        @cpu_numerics.njit
        def read(src, row, out):
            store(out, 0, to_float(dword_fields(src, row * width, first, lanes, bits)))
        return read

    reads_every_chunk(reader, stored, want)

    @cpu_numerics.njit
    def back(src, out):
        store(out, 0, to_channel_order(load(src, 0, D), per_byte, D, DWORDS))
    in_order = np.empty(D, np.float32)
    back(np.ascontiguousarray(want.numpy()), in_order)
    assert torch.equal(torch.from_numpy(in_order), codes[1].float())


@pytest.mark.parametrize("dtype", [np.int32, np.float32])
def test_trees_over_16_and_8_lane_segments_sum_each_key(dtype):
    """cpu_simd_tree: 16 keys' partial sums (16 lanes for each of 3 heads) through the tree over
    16-lane segments (pair), and through the one over 8-lane segments that AVX2's tile scorer
    takes (each key folded by `half`, pair8, the two eights joined): each key's sum per head in a
    lane of its own, in key order, against numpy's."""
    from tinykv.kernels import cpu_numerics
    from tinykv.kernels.cpu_simd import load, store
    from tinykv.kernels.cpu_simd_tree import half, join, pair, pair8

    R, n = 3, 48  # heads; lanes a key

    @cpu_numerics.njit
    def wide(x, out):  # x: (16 keys x R x 16)
        def four(t):
            return pair(pair(load(x, t * n, n), load(x, (t + 1) * n, n), 16),
                        pair(load(x, (t + 2) * n, n), load(x, (t + 3) * n, n), 16), 8)
        store(out, 0, pair(pair(four(0), four(4), 4), pair(four(8), four(12), 4), 2))

    @cpu_numerics.njit
    def narrow(x, out):
        def one(t):
            v = load(x, t * n, n)
            return half(v, 0) + half(v, 1)

        def eight(t):
            return pair8(pair8(pair8(one(t), one(t + 1), 8), pair8(one(t + 2), one(t + 3), 8), 4),
                         pair8(pair8(one(t + 4), one(t + 5), 8), pair8(one(t + 6), one(t + 7), 8),
                               4), 2)
        store(out, 0, join(eight(0), eight(8)))

    rng = np.random.default_rng(5)
    x = rng.integers(-1000, 1000, (16, R, 16)).astype(dtype)
    want = x.astype(np.float64).sum(axis=2).T.reshape(-1)  # (R x 16): head r, key t
    for tree in (wide, narrow):
        got = np.empty(R * 16, dtype)
        tree(np.ascontiguousarray(x.reshape(-1)), got)
        np.testing.assert_array_equal(got.astype(np.float64), want, err_msg=tree.__name__)


def test_lane_max_rounding_and_int16_against_numpy():
    """cpu_simd_ops' max (vmax, segment_max, segment_absmax: a compare and select that LLVM
    lowers to one max instruction) and rint then to_int16 (the int16 query) against numpy,
    ties and halves included: max(a, a) is a, rint rounds halves to even."""
    from tinykv.kernels import cpu_numerics
    from tinykv.kernels.cpu_simd import load, store, to_int16
    from tinykv.kernels.cpu_simd_ops import rint, segment_absmax, segment_max, vmax

    n, seg = 64, 32

    @cpu_numerics.njit
    def lanes(a, b, pair_max, seg_max, seg_absmax, rounded, words):
        x, y = load(a, 0, n), load(b, 0, n)
        store(pair_max, 0, vmax(x, y))
        store(seg_max, 0, segment_max(x, seg))
        store(seg_absmax, 0, segment_absmax(x, seg))
        whole = rint(x)
        store(rounded, 0, whole)
        store(words, 0, to_int16(whole))

    rng = np.random.default_rng(7)
    a = (rng.integers(-60000, 60000, n) / 4).astype(np.float32)  # quarters: halves and ties
    a[:8] = [2.5, -2.5, 3.5, -1.5, 0.5, -0.5, 32767.0, -32767.0]
    b = np.where(rng.random(n) < 0.3, a, rng.normal(0, 5000, n)).astype(np.float32)
    a[40] = -32766.5  # the second segment's largest |x|: a negative lane, and a half
    outs = [np.empty(n, np.float32), np.empty(n // seg, np.float32),
            np.empty(n // seg, np.float32), np.empty(n, np.float32), np.empty(n, np.int16)]
    lanes(a, b, *outs)
    pair_max, seg_max, seg_absmax, rounded, words = outs
    np.testing.assert_array_equal(pair_max, np.maximum(a, b))
    np.testing.assert_array_equal(seg_max, a.reshape(-1, seg).max(axis=1))
    np.testing.assert_array_equal(seg_absmax, np.abs(a).reshape(-1, seg).max(axis=1))
    np.testing.assert_array_equal(rounded, np.rint(a))
    np.testing.assert_array_equal(words, np.rint(a).astype(np.int16))


def test_chunk_lanes_fit_the_registers():
    """The value sums' chunk where vectors are 256 bits: a multiple of 16 dividing D, as wide as
    16 registers of 8 floats allow (R x C sums at most 96 lanes, their C lanes beside)."""
    from tinykv.kernels.cpu_vector_values import chunk_lanes

    assert [chunk_lanes(R, 64) for R in (1, 2, 3, 4, 8)] == [64, 32, 16, 16, 16]
    assert [chunk_lanes(1, D) for D in (80, 96, 128)] == [80, 96, 64]
    assert chunk_lanes(2, 80) == 16


def test_two_pools_merge_and_half_queries():
    """cache.attend's pattern: a quantized pool and a full-precision one with complementary tables,
    merged by log-sum-exp, equal the reference over everything; fp16 queries are read as float."""
    gen = torch.Generator().manual_seed(3)
    BS, D, H = 16, 64, 2
    store = (make_pool("int4:g16:asym", H, BS, D, gen), make_pool("int8", H, BS, D, gen))
    hot = (make_pool("fp32", H, BS, D, gen), make_pool("fp32", H, BS, D, gen))
    q, q_seq, q_pos, table, ctx = make_batch(BS, H * 4, D, gen, torch.float16)
    in_hot = torch.rand(table.shape, generator=gen) < 0.5
    t_store, t_hot = table.masked_fill(in_hot, -1), table.masked_fill(~in_hot, -1)
    parts = [(store, t_store), (hot, t_hot)]
    ref = merge_partials([paged_attention_ref(q, q_seq, q_pos, *kv, t, ctx, 0.125)
                          for kv, t in parts])
    out = kernels_cpu.merge_partials_cpu([paged_attention_cpu(q, q_seq, q_pos, *kv, t, ctx,
                                                               0.125) for kv, t in parts])
    lse_tol, o_tol = rounding_bound(q.float(), q_seq, q_pos, *store, t_store, ctx, 0.125)
    assert (out[1] - ref[1]).abs()[ref[1].isfinite()].max() <= 2 * TOL + lse_tol.max()
    assert (out[0] - ref[0]).abs().max() <= 2 * TOL * (1 + ref[0].abs().max()) + o_tol.max()


def test_merge_equals_the_reference():
    """The compiled merge of 1-3 partials equals reference.merge_partials: rows where some parts
    saw no key (lse -inf, whatever their o holds) and rows where none did (o 0, lse -inf)."""
    gen = torch.Generator().manual_seed(6)
    for n_parts in (1, 2, 3):
        parts = []
        for i in range(n_parts):
            o, lse = torch.randn(5, 4, 16, generator=gen), 3 * torch.randn(5, 4, generator=gen)
            lse[i, :2] = -torch.inf  # row i: this part saw no key for two heads
            lse[4] = -torch.inf  # row 4: no part saw a key
            o[4] = 0.0  # as every kernel leaves a row with no key
            parts.append((o, lse))
        got, want = kernels_cpu.merge_partials_cpu(parts), merge_partials(parts)
        assert torch.equal(torch.isneginf(got[1]), torch.isneginf(want[1]))
        finite = want[1].isfinite()
        assert torch.allclose(got[1][finite], want[1][finite], rtol=1e-6, atol=1e-6)
        assert torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
        assert (got[0][4] == 0).all()


def test_kept_arguments_follow_the_tensors():
    """A CpuKernels converts a step's metadata once; an edited table (a new version) or another
    table is converted again, not served stale."""
    gen = torch.Generator().manual_seed(4)
    k = make_pool("int8", 2, 16, 64, gen)
    q, q_seq, q_pos, table, ctx = make_batch(16, 4, 64, gen)
    kernels = kernels_cpu.CpuKernels()
    first = kernels.attend(q, q_seq, q_pos, k, k, table, ctx, 0.125)
    table[3, 0] = -1  # in place: the same tensor, a new version
    edited = kernels.attend(q, q_seq, q_pos, k, k, table, ctx, 0.125)
    fresh = paged_attention_cpu(q, q_seq, q_pos, k, k, table, ctx, 0.125)
    assert not torch.equal(first[0][5], edited[0][5])  # query 5 reads row 3
    assert torch.equal(edited[0], fresh[0]) and torch.equal(edited[1], fresh[1])


def test_threads_only_where_the_reads_pay_for_them():
    """With 2 threads, a call of fewer (key, KV head) reads than the kernels' threshold runs the
    serial kernel; one of more runs the parallel one; both give the serial answer."""
    if kernels_cpu.numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba's pool has one thread (it follows the CPUs this process may use)")
    gen = torch.Generator().manual_seed(5)
    k = make_pool("int8", 2, 16, 64, gen)
    q, q_seq, q_pos, table, ctx = make_batch(16, 4, 64, gen)
    reads = 2 * int(torch.minimum(q_pos + 1, ctx[q_seq].long()).sum())  # 2 KV heads
    ran = []
    alone = kernels_cpu.CpuKernels().attend(q, q_seq, q_pos, k, k, table, ctx, 0.125, 1)
    before = with_threads(2)
    try:
        for threshold, want in ((reads + 1, "serial"), (reads, "parallel")):
            kernels = kernels_cpu.CpuKernels(threads_min_reads=threshold)
            call = kernels._call(k, k, 4, 64)
            kernels._calls[id(k), id(k), 4, 64] = (*kernels._calls[id(k), id(k), 4, 64][:2],
                call._replace(
                    serial=lambda *a, f=call.serial: ran.append("serial") or f(*a),
                    parallel=lambda *a, f=call.parallel: ran.append("parallel") or f(*a)))
            out = kernels.attend(q, q_seq, q_pos, k, k, table, ctx, 0.125, 1)
            assert ran.pop() == want and not ran
            assert torch.equal(out[0], alone[0]) and torch.equal(out[1], alone[1])
    finally:
        torch.set_num_threads(before)


def test_long_queries_split_in_shares_of_share_bytes(monkeypatch):
    """By default a query's blocks split in shares of at most SHARE_BYTES of codes (K and V, every
    KV head), rounded to a multiple of the threads where they split for balance; the answer is
    the reference's within rounding."""
    gen = torch.Generator().manual_seed(11)
    H, BS, D = 3, 16, 64  # NB blocks: 384 keys
    k, v = make_pool("fp16", H, BS, D, gen), make_pool("int8", H, BS, D, gen)
    key_bytes = H * D * 2 + H * D  # fp16 keys, int8 values
    table = torch.randperm(NB, generator=gen).int()[None]
    ctx = torch.tensor([NB * BS], dtype=torch.int32)
    q, q_seq, q_pos = torch.randn(1, 3 * H, D, generator=gen), torch.arange(1), ctx.long() - 1
    monkeypatch.setattr(kernels_cpu, "SHARE_BYTES", 60 * key_bytes)  # 384 keys: 7 shares
    kernels = kernels_cpu.CpuKernels(threads_min_reads=0)
    step = kernels._step(q_seq, q_pos, table, ctx)
    before = with_threads(1)
    try:
        assert kernels._share(step, H, key_bytes) == (1, 7)
        torch.set_num_threads(2)
        if kernels_cpu.numba.config.NUMBA_NUM_THREADS >= 2:  # 3 items: split for balance too
            assert kernels._share(step, H, key_bytes) == (2, 8)
        out = kernels.attend(q, q_seq, q_pos, k, v, table, ctx, D**-0.5)  # 2 threads, 8 shares
    finally:
        torch.set_num_threads(before)
    sm = D**-0.5
    ref = paged_attention_ref(q, q_seq, q_pos, k, v, table, ctx, sm)
    check(out, ref, attention_f64(q, q_seq, q_pos, k, v, table, ctx, sm),
          rounding_bound(q, q_seq, q_pos, k, v, table, ctx, sm))


def test_attention_empty_and_layout_checks():
    gen = torch.Generator().manual_seed(0)
    k = make_pool("int8", 2, 16, 64, gen)
    q, q_seq, q_pos, table, ctx = make_batch(16, 4, 64, gen)
    o, lse = paged_attention_cpu(q[:0], q_seq[:0], q_pos[:0], k, k, table, ctx, 0.125)  # N = 0
    assert o.shape == (0, 4, 64) and lse.shape == (0, 4)
    o, lse = paged_attention_cpu(q[-1:], q_seq[-1:], q_pos[-1:], k, k, table, ctx, 0.125)
    assert (o == 0).all() and torch.isneginf(lse).all()  # a row of -1 only
    strided = kernels_cpu.PoolLayer(k.data.transpose(1, 2).contiguous().transpose(1, 2), k.scale,
                                    None, k.p)
    with pytest.raises(AssertionError, match="contiguous"):
        paged_attention_cpu(q, q_seq, q_pos, strided, k, table, ctx, 0.125)


@pytest.mark.parametrize("groups,bias_heads", [(0, 2), (1, 0), (2, 2), (1, 2), (2, 0)])
def test_head_map_matches_torch(groups, bias_heads):
    """kernels.cpu_maps: a layer's folded transform on rows (a strided view, as the queries are
    of the projection's output) equals quant.head_map_ref's torch, maps shared by a group of
    heads, biases per KV head."""
    from tinykv.kernels.cpu_maps import head_map_cpu
    from tinykv.quant import HeadMap, head_map_ref

    gen = torch.Generator().manual_seed(groups * 10 + bias_heads)
    N, J, D = 3, 8, 64
    rows = torch.randn(N, J + 2, D, generator=gen)[:, 2:]  # (N, J, D), not contiguous
    m = HeadMap(torch.randn(groups, D, D, generator=gen) / D**0.5,
                torch.randn(bias_heads, D, generator=gen))
    got, want = head_map_cpu(rows, m), head_map_ref(rows, m)
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)
    exact = rows.double()
    if groups:
        exact = (exact.unflatten(1, (groups, -1)) @ m.maps.double()).flatten(1, 2)
    if bias_heads:
        exact = exact + m.bias.double().repeat_interleave(J // bias_heads, 0)
    torch.testing.assert_close(got.double(), exact, atol=TOL, rtol=TOL)


def test_module_imports_without_numba():
    code = ("import sys; sys.modules['numba'] = None; from tinykv.kernels import cpu as m; "
            "assert not m.AVAILABLE and 'numba' in m.REASON; print(m.REASON)")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


# ---- quantize-and-store ------------------------------------------------------------------------
STORE_CASES = [
    ("fp32", 64), ("fp16", 80), ("bf16", 128),
    ("int8", 64), ("int8:asym", 80), ("int4", 128), ("int4:asym", 64), ("int2", 80),
    ("int2:asym", 128), ("int4:g16", 64), ("int8:g16:asym", 80), ("int2:g8:asym", 64),
    ("int4:g32:asym", 128), ("fp8:token", 80), ("fp8:g16", 64),
    ("int8:head:static", 64), ("int4:channel:static:asym", 80), ("int2:tensor:static", 128),
    ("fp8:tensor:static", 64), ("int8:channel:static", 80), ("int4:head:static:asym", 64),
    ("int2:mse", 64), ("int2:g32:mse", 128), ("int4:g16:mse", 80), ("int8:mse", 64),
    ("int2:fit", 64), ("int2:g32:fit", 128), ("int4:g16:fit", 80), ("int8:fit", 64),
]


def store_inputs(p: QuantParams, D: int, gen: torch.Generator, scale_dtype: torch.dtype,
                 x_dtype: torch.dtype):
    """New tokens (9, 2, D) with NaN, +-Inf, -0.0, an all-zero token, exact ties and a value that
    saturates static scales (or overflows fp16), and an empty pool of 4 blocks of 16 for them."""
    n, H, BS = 9, 2, 16
    x = torch.randn(n, H, D, generator=gen) * torch.logspace(-3, 2, D)
    x[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    x[0, 1, 8:] = float("nan")  # NaN groups too (and an all-NaN group for g8 / g16)
    x[1, 1] = 0.0  # an all-zero token: the smallest scale
    x[2] = torch.randint(-40, 40, (H, D), generator=gen) / 4  # ties, with power-of-two scales
    x[3, 0, 5] = 1e6  # saturates static scales, overflows fp16
    blk = torch.tensor([2, 0, 3, 2, 1, 0, 3, 1, 2])
    off = torch.tensor([5, 15, 0, 6, 9, 0, 15, 1, 7])
    data = torch.zeros(4, H, BS, D // p.per_byte, dtype=p.storage_dtype)
    scale = zero = None
    if p.static:
        shape = (1, 1 if p.gran == "tensor" else H, 1, p.ngroups(D))
        scale = 2.0 ** torch.randint(-3, 3, shape, generator=gen).float()
        zero = None if p.sym else torch.randint(-3, p.qmax + 3, shape, generator=gen).float()
    elif not p.is_float:
        scale = torch.zeros(4, *p.scale_shape(H, BS, D), dtype=scale_dtype)
        zero = None if p.sym else torch.zeros_like(scale)
    return x.to(x_dtype), p, data, scale, zero, blk, off


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.dtype.itemsize])


@pytest.mark.parametrize("spec,D", STORE_CASES)
def test_quantize_store_matches_reference(spec, D):
    p = QuantParams.parse(spec)
    x_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    # fp16 scales with inputs of every dtype, and bf16 scales (their own rounding and room)
    for scale_dtype, x_dtype in ((torch.float16, x_dtypes[D % 3]), (torch.bfloat16, torch.float32)):
        if scale_dtype == torch.bfloat16 and (p.static or p.is_float):
            continue
        args = store_inputs(p, D, torch.Generator().manual_seed(D), scale_dtype, x_dtype)
        x, _, data, scale, zero, blk, off = args
        ref = [None if t is None else t.clone() for t in (data, scale, zero)]
        n_ref = quantize_store_ref(x, p, *ref, blk, off)
        n_sat = quantize_store_cpu(*args)
        assert torch.equal(bits(data), bits(ref[0])), "codes differ"  # NaN and -0.0 included
        for got, want in zip((scale, zero), ref[1:]):
            assert got is None or torch.equal(bits(got), bits(want)), "scales or zeros differ"
        assert isinstance(n_sat, int) and n_sat == n_ref
        assert (n_sat > 0) == (spec not in ("fp32", "bf16"))  # NaN, Inf, 1e6: all counted


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_fit_store_takes_the_steps_of_the_moment(steps, monkeypatch):
    """quant.FIT_STEPS reaches the compiled store as an argument: a kernel compiled (and cached
    on disk) for one count cannot keep storing with it. 0 steps store what `mse` stores."""
    monkeypatch.setattr(quant, "FIT_STEPS", steps)
    p = QuantParams.parse("int2:g32:fit")
    args = store_inputs(p, 64, torch.Generator().manual_seed(5), torch.float16, torch.float32)
    x, _, data, scale, zero, blk, off = args
    ref = [None if t is None else t.clone() for t in (data, scale, zero)]
    quantize_store_ref(x, p, *ref, blk, off)
    quantize_store_cpu(*args)
    assert torch.equal(bits(scale), bits(ref[1])) and torch.equal(bits(data), bits(ref[0]))
    mse = [None if t is None else t.clone() for t in (data, scale, zero)]
    quantize_store_ref(x, QuantParams.parse("int2:g32:mse"), *mse, blk, off)
    assert torch.equal(scale, mse[1]) == (steps == 0)


@pytest.mark.parametrize("spec", ["fp16", "int4", "int2:g32:asym", "int4:g16:mse", "fp8:token"])
def test_store_of_many_tokens_matches_reference(spec):
    """A prompt's store: more tokens than the kernel asks lines for at once (cpu_store
    TOKENS_AHEAD), in shuffled slots, bit for bit the reference's."""
    p, n, H, D, NB = QuantParams.parse(spec), 70, 2, 64, 6
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, H, D, generator=gen) * torch.logspace(-2, 1, D)  # (n, H, D)
    slots = torch.randperm(NB * 16, generator=gen)[:n]
    blk, off = slots // 16, slots % 16
    data = torch.zeros(NB, H, 16, D // p.per_byte, dtype=p.storage_dtype)
    scale = None if p.is_float else torch.zeros(NB, *p.scale_shape(H, 16, D), dtype=torch.float16)
    zero = None if scale is None or p.sym else torch.zeros_like(scale)
    want = [None if t is None else t.clone() for t in (data, scale, zero)]
    n_ref = quantize_store_ref(x, p, *want, blk, off)
    assert quantize_store_cpu(x, p, data, scale, zero, blk, off) == n_ref
    for got, ref in zip((data, scale, zero), want):
        assert got is None or torch.equal(bits(got), bits(ref))
    assert data.view(torch.uint8).any(), "the store wrote nothing"


def test_quantize_store_checks_layouts():
    p = QuantParams.parse("int4:asym")
    x, _, data, scale, zero, blk, off = store_inputs(p, 64, torch.Generator().manual_seed(1),
                                                     torch.float16, torch.float32)
    with pytest.raises(AssertionError, match="block-wise"):
        quantize_store_cpu(x, QuantParams.parse("int4:channel"), data, scale, None, blk, off)
    with pytest.raises(AssertionError, match="16-bit"):
        quantize_store_cpu(x, p, data, scale.float(), zero.float(), blk, off)
    with pytest.raises(AssertionError, match="contiguous"):
        quantize_store_cpu(x, p, data.transpose(1, 2).contiguous().transpose(1, 2), scale, zero,
                           blk, off)
    assert quantize_store_cpu(x[:0], p, data, scale, zero, blk[:0], off[:0]) == 0


def test_mse_store_takes_its_clips_as_an_argument():
    """The clips an mse store tries come with its arguments, not compiled in (a disk-cached
    kernel would keep old ones): given the absmax alone, it stores the plain format's scales."""
    p, plain = QuantParams.parse("int2:g16:mse"), QuantParams.parse("int2:g16")
    x, _, data, scale, _, blk, off = store_inputs(p, 64, torch.Generator().manual_seed(5),
                                                  torch.float16, torch.float32)
    args = kernels_cpu.store_args(p, data, scale, None)._replace(clips=np.ones(1, np.float32))
    kernels_cpu.store_rows(x, blk.numpy(), off.numpy(), args)
    want = [t.clone() for t in (data, scale)]
    quantize_store_ref(x, plain, *want, None, blk, off)
    assert torch.equal(bits(scale), bits(want[1])) and torch.equal(data, want[0])
    quantize_store_cpu(x, p, data, scale, None, blk, off)  # all of quant.MSE_CLIPS: others
    assert not torch.equal(bits(scale), bits(want[1]))



def test_use_threads_sets_numba_only_when_its_count_changes(monkeypatch):
    """use_threads skips numba.set_num_threads where it already gave numba that count in this
    Python thread; a change, or another Python thread (numba counts per thread), sets it."""
    import threading

    import numba

    from tinykv.kernels import cpu_numerics
    from tinykv.kernels.cpu_numerics import use_threads

    monkeypatch.setattr(cpu_numerics, "_GIVEN", threading.local())  # what earlier tests set
    calls, real = [], numba.set_num_threads
    monkeypatch.setattr(numba, "set_num_threads", lambda n: calls.append(n) or real(n))
    most = min(2, numba.config.NUMBA_NUM_THREADS)
    before = numba.get_num_threads()
    try:
        use_threads(1)
        use_threads(1)
        assert numba.get_num_threads() == 1
        use_threads(most)
        use_threads(most)
        assert numba.get_num_threads() == most
        other = []
        worker = threading.Thread(target=lambda: (use_threads(most),
                                                  other.append(numba.get_num_threads())))
        worker.start()
        worker.join()
        assert other == [most]
        assert calls[:2] == [1, most] and len(calls) == 3  # the third: the other thread's
    finally:
        use_threads(before)
