"""Tests for tinykv/kernels/triton.py: the Triton kernels against their torch references.

Without a GPU the kernels run in Triton's interpreter, so shapes are small and the grid of cases
is a curated list that covers every axis (formats, granularities, group sizes, head dims, block
sizes, context lengths, splits, holes, chunked prefill) without taking their full cross product.
That the same kernels compile for real GPUs is test_kernels_aot.py's part.
"""

import os
import sys

import torch

# Triton reads TRITON_INTERPRET when it decorates a kernel, its own library's included: before
# any import.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TOO_LATE = not torch.cuda.is_available() and "triton" in sys.modules and not INTERPRET
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")
if TOO_LATE:
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set: set it in the "
                "environment or a conftest.py to run the kernels on the CPU",
                allow_module_level=True)

from pools import ATTN_CASES, DEV, make_batch, make_pool  # noqa: E402

from tinykv.kernels.reference import merge_partials, paged_attention_ref, quantize_store_ref  # noqa: E402
from tinykv.kernels.triton import blocks_per_iter, paged_attention_triton  # noqa: E402
from tinykv.kernels.triton_store import quantize_store_triton  # noqa: E402
from tinykv.spec import QuantParams  # noqa: E402


@pytest.mark.parametrize("kspec,vspec,n_rep,D,BS", ATTN_CASES)
def test_attention_matches_reference(kspec, vspec, n_rep, D, BS):
    gen = torch.Generator().manual_seed(n_rep * 1000 + D + BS)
    H = 2
    k, v = make_pool(kspec, H, BS, D, gen), make_pool(vspec, H, BS, D, gen)
    q, q_seq, q_pos, table, ctx = make_batch(BS, H * n_rep, D, gen)
    o_ref, lse_ref = paged_attention_ref(q, q_seq, q_pos, k, v, table, ctx, D**-0.5)
    assert torch.isinf(lse_ref[-1]).all() and lse_ref[:-1].isfinite().all()  # the batch we meant
    for splits in (1, 3):  # 3 splits: some empty (context 1), some holding only the hole
        o, lse = paged_attention_triton(q, q_seq, q_pos, k, v, table, ctx, D**-0.5,
                                        num_splits=splits)
        assert o.dtype == lse.dtype == torch.float32
        assert o.shape == q.shape and lse.shape == q.shape[:2]
        torch.testing.assert_close(o, o_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse, lse_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kspec,vspec,BS", [("int4:asym", "int8", 8), ("fp16", "int2:g16", 24)])
def test_attention_small_and_odd_blocks(kspec, vspec, BS):
    """Blocks below 16 tokens or of no power of two: one iteration spans several padded blocks."""
    gen = torch.Generator().manual_seed(BS)
    k, v = make_pool(kspec, 2, BS, 64, gen), make_pool(vspec, 2, BS, 64, gen)
    q, q_seq, q_pos, table, ctx = make_batch(BS, 6, 64, gen)
    assert blocks_per_iter(BS) > 1
    o_ref, lse_ref = paged_attention_ref(q, q_seq, q_pos, k, v, table, ctx, 0.125)
    o, lse = paged_attention_triton(q, q_seq, q_pos, k, v, table, ctx, 0.125, num_splits=2)
    torch.testing.assert_close(o, o_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, lse_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.bfloat16])
def test_attention_half_queries(q_dtype):
    """Half-precision queries take tl.dot's tensor-core path: K, V and p round to q's dtype."""
    gen = torch.Generator().manual_seed(7)
    k, v = make_pool("int8", 2, 16, 64, gen), make_pool("int4:asym", 2, 16, 64, gen)
    q, q_seq, q_pos, table, ctx = make_batch(16, 8, 64, gen, q_dtype)
    o_ref, lse_ref = paged_attention_ref(q, q_seq, q_pos, k, v, table, ctx, 0.125)
    o, lse = paged_attention_triton(q, q_seq, q_pos, k, v, table, ctx, 0.125)  # default splits
    tol = 2.5e-2 if q_dtype == torch.bfloat16 else 2e-3  # K, V and p rounded to 8 or 11 bits
    assert (o - o_ref).abs().max() <= tol * o_ref.abs().max()
    assert torch.isneginf(lse[-1]).all() and (lse - lse_ref)[:-1].abs().max() <= 10 * tol


def test_two_pools_merge():
    """cache.attend's pattern: a quantized store pool and a full-precision hot pool with
    complementary tables, merged with merge_partials, equal the reference over everything."""
    gen = torch.Generator().manual_seed(3)
    BS, D, H = 16, 64, 2
    store = (make_pool("int4:g16:asym", H, BS, D, gen), make_pool("int8", H, BS, D, gen))
    hot = (make_pool("fp32", H, BS, D, gen), make_pool("fp32", H, BS, D, gen))
    q, q_seq, q_pos, table, ctx = make_batch(BS, H * 4, D, gen)
    in_hot = torch.rand(table.shape, generator=gen).to(DEV) < 0.5
    t_store, t_hot = table.masked_fill(in_hot, -1), table.masked_fill(~in_hot, -1)
    args = (q_seq, q_pos)
    ref = merge_partials([paged_attention_ref(q, *args, *store, t_store, ctx, 0.125),
                          paged_attention_ref(q, *args, *hot, t_hot, ctx, 0.125)])
    out = merge_partials([
        paged_attention_triton(q, *args, *store, t_store, ctx, 0.125, num_splits=2),
        paged_attention_triton(q, *args, *hot, t_hot, ctx, 0.125)])
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_attention_empty():
    gen = torch.Generator().manual_seed(0)
    k = make_pool("int8", 2, 16, 64, gen)
    q, q_seq, q_pos, table, ctx = make_batch(16, 4, 64, gen)
    for fn in (paged_attention_ref, paged_attention_triton):
        o, lse = fn(q[:0], q_seq[:0], q_pos[:0], k, k, table, ctx, 0.125)  # N = 0
        assert o.shape == (0, 4, 64) and lse.shape == (0, 4)
        o, lse = fn(q[-1:], q_seq[-1:], q_pos[-1:], k, k, table, ctx, 0.125)  # a row of -1 only
        assert (o == 0).all() and torch.isneginf(lse).all()


# ---- quantize-and-store -------------------------------------------------------------------------
STORE_CASES = [
    ("fp32", 64), ("fp16", 80), ("bf16", 128),
    ("int8", 64), ("int8:asym", 80), ("int4", 128), ("int4:asym", 64), ("int2", 80),
    ("int2:asym", 128),
    ("int4:g16", 64), ("int8:g16:asym", 80), ("int2:g8:asym", 64), ("int4:g32:asym", 128),
    ("fp8:token", 80), ("fp8:g16", 64),
    ("int8:head:static", 64), ("int4:channel:static:asym", 80), ("int2:tensor:static", 128),
    ("fp8:tensor:static", 64), ("int8:channel:static", 80), ("int4:head:static:asym", 64),
    ("int2:mse", 64), ("int2:g32:mse", 128), ("int4:g16:mse", 80), ("int8:mse", 64),
    ("int2:fit", 64), ("int2:g32:fit", 128), ("int4:g16:fit", 80), ("int8:fit", 64),
]


def store_inputs(p: QuantParams, D: int, gen: torch.Generator):
    n, H, BS = 9, 2, 16
    x = torch.randn(n, H, D, generator=gen) * torch.logspace(-3, 2, D)
    x[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    x[1, 1] = 0.0  # an all-zero token: smallest scale
    x[2] = torch.randint(-40, 40, (H, D), generator=gen) / 4  # ties, with power-of-two scales
    x[3, 0] = 1e6  # saturates static scales
    blk = torch.tensor([2, 0, 3, 2, 1, 0, 3, 1, 2])
    off = torch.tensor([5, 15, 0, 6, 9, 0, 15, 1, 7])
    data = torch.zeros(4, H, BS, D // p.per_byte, dtype=p.storage_dtype)
    scale = zero = None
    if p.static:
        shape = (1, 1 if p.gran == "tensor" else H, 1, p.ngroups(D))
        scale = 2.0 ** torch.randint(-3, 3, shape, generator=gen).float()
        zero = None if p.sym else torch.randint(-3, p.qmax + 3, shape, generator=gen).float()
    elif not p.is_float:
        scale = torch.zeros(4, *p.scale_shape(H, BS, D), dtype=torch.float16)
        zero = None if p.sym else torch.zeros_like(scale)
    if p.dtype == "fp16":
        x = x.half()
    elif p.gran == "group" and p.sym:
        x = x.bfloat16()
    return x.to(DEV), p, data.to(DEV), _to_dev(scale), _to_dev(zero), blk.to(DEV), off.to(DEV)


def _to_dev(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(DEV)


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, so that NaN and -0.0 compare exactly."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.dtype.itemsize])


@pytest.mark.parametrize("spec,D", STORE_CASES)
def test_quantize_store_matches_reference(spec, D):
    p = QuantParams.parse(spec)
    x, p, data, scale, zero, blk, off = store_inputs(p, D, torch.Generator().manual_seed(D))
    ref = (_clone(data), _clone(scale), _clone(zero))
    n_ref = quantize_store_ref(x, p, *ref, blk, off)
    n_sat = quantize_store_triton(x, p, data, scale, zero, blk, off)
    if p.dtype == "bf16" and INTERPRET:
        # The interpreter casts fp32 -> bf16 by truncation; GPUs round to nearest even, as torch.
        torch.testing.assert_close(data.float(), ref[0].float(), rtol=2**-7, atol=0,
                                   equal_nan=True)
    else:
        assert torch.equal(_bits(data), _bits(ref[0])), "codes differ"  # NaN and -0.0 included
    for got, want in zip((scale, zero), ref[1:], strict=True):
        assert got is None or torch.equal(got, want)
    assert int(n_sat) == int(n_ref)
