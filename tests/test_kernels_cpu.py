"""Tests for tinykv/kernels/cpu.py: the Numba kernels against their torch references
(kernels/reference.py) and, for attention, against float64 math (test_reference.attention_f64).

The first run compiles both kernels (~30 s on 2 cores); Numba caches them beside the module.
"""

import subprocess
import sys

import pytest
import torch
from pools import ATTN_CASES, make_batch, make_pool
from test_reference import attention_f64

from tinykv.kernels import cpu as kernels_cpu
from tinykv.kernels.reference import merge_partials, paged_attention_ref, quantize_store_ref
from tinykv.spec import QuantParams

if not kernels_cpu.AVAILABLE:
    pytest.skip(kernels_cpu.REASON, allow_module_level=True)

from tinykv.kernels.cpu import paged_attention_cpu, quantize_store_cpu  # noqa: E402

TOL = dict(atol=3e-5, rtol=3e-5)


def check(out, ref, f64):
    """out and ref (o, lse) both close to float64 math, and to each other; -inf where f64 is."""
    for got, want, exact in zip(out, ref, f64):
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(got.double(), exact, **TOL)


@pytest.mark.parametrize("kspec,vspec,n_rep,D,BS", ATTN_CASES)
def test_attention_matches_reference_and_float64(kspec, vspec, n_rep, D, BS):
    gen = torch.Generator().manual_seed(n_rep * 1000 + D + BS)
    H = 2
    k, v = make_pool(kspec, H, BS, D, gen), make_pool(vspec, H, BS, D, gen)
    q, q_seq, q_pos, table, ctx = make_batch(BS, H * n_rep, D, gen)  # decode rows + a 3-chunk
    ref = paged_attention_ref(q, q_seq, q_pos, k, v, table, ctx, D**-0.5)
    f64 = attention_f64(q, q_seq, q_pos, k, v, table, ctx, D**-0.5)
    assert torch.isinf(f64[1][-1]).all() and f64[1][:-1].isfinite().all()  # the last sees no key
    for splits in (None, 1, 3):  # 3 splits: some empty (context 1), some holding only the hole
        out = paged_attention_cpu(q, q_seq, q_pos, k, v, table, ctx, D**-0.5, splits)
        check(out, ref, f64)
        assert (out[0][-1] == 0).all() and torch.isneginf(out[1][-1]).all()


@pytest.mark.parametrize("spec,BS,D", [("int8", 16, 64), ("fp16", 128, 64), ("int4:asym", 32, 96),
                                       ("int2:g8:asym", 16, 128), ("fp8:token", 64, 80)])
def test_attention_long_rows_and_splits(spec, BS, D):
    """Rows over many blocks, in order and shuffled, of mixed lengths, split any number of ways;
    the n_rep = 3 heads of the default model."""
    gen = torch.Generator().manual_seed(BS + D)
    H, NB = 3, 24
    k, v = make_pool(spec, H, BS, D, gen), make_pool(spec, H, BS, D, gen)
    table = torch.stack([torch.arange(NB), torch.randperm(NB, generator=gen)]).int()
    table[1, 5] = -1  # a block held by another pool
    ctx = torch.tensor([NB * BS - 3, 7 * BS + 1], dtype=torch.int32)
    q, q_seq, q_pos = torch.randn(2, 3 * H, D, generator=gen), torch.arange(2), ctx.long() - 1
    ref = paged_attention_ref(q, q_seq, q_pos, k, v, table, ctx, D**-0.5)
    f64 = attention_f64(q, q_seq, q_pos, k, v, table, ctx, D**-0.5)
    for splits in (None, 2, 5, 64):
        check(paged_attention_cpu(q, q_seq, q_pos, k, v, table, ctx, D**-0.5, splits), ref, f64)


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
    out = paged_attention_cpu(q, q_seq, q_pos, k, v, table, ctx, D**-0.5)
    check(out, ref, f64)
    assert torch.isneginf(out[1][1:3]).all() and out[1][3:].isfinite().all()


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
    out = merge_partials([paged_attention_cpu(q, q_seq, q_pos, *kv, t, ctx, 0.125)
                          for kv, t in parts])
    for got, want in zip(out, ref):
        torch.testing.assert_close(got, want, **TOL)


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
