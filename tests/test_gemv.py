"""The decode-time GEMV (tinykv/gemv.py) against float64, with the error bound of a float32 dot
product: |computed - exact| <= gamma_K * sum_k |w_k x_k|, gamma_K = K u / (1 - K u), u = 2^-24,
for any order of summation (so for any vector width or CPU), plus the output's own rounding."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tinykv import gemv, gemv_layer
from tinykv.kernels.layout import CACHE_LINE
from tinykv.model import REFERENCES, Transformer, apply_rope, fused_linear

pytestmark = pytest.mark.skipif(not gemv.AVAILABLE, reason="numba is not installed")
U32 = 2.0**-24
ROUNDING = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def bound(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The largest error a float32-accumulated x @ w.T may carry, per output, then rounded to
    out_dtype."""
    k = x.shape[-1]
    gamma = k * U32 / (1 - k * U32)
    exact = x.double() @ w.double().T
    return gamma * (x.double().abs() @ w.double().abs().T) + ROUNDING[out_dtype] * exact.abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# Each loop has its rows here: sliced up to SLICED_MAX_ROWS (and half weights up to SMALL_BATCH),
# the float32 tiles from there (to TILE_MAX_ROWS with AVX-512, then the eight-row loop; the narrow
# tiles at any number with AVX2), torch past TILE_BATCH
@pytest.mark.parametrize("rows", [1, 2, 3, 5, gemv.SMALL_BATCH, gemv.SMALL_BATCH + 3, 13,
                                  gemv.TILE_BATCH // 2 + 1, gemv.TILE_BATCH, gemv.TILE_BATCH + 1])
def test_linear_cpu_within_the_float32_bound(dtype, rows, threads):
    if dtype == torch.float16 and not gemv.F16C:
        pytest.skip("float16 weights need F16C for the GEMV")
    gen = torch.Generator().manual_seed(rows)
    n, k = gemv.ROWS * 5 + 3, 200  # output rows not a multiple of ROWS: the tail path runs too
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(1, rows, k, generator=gen).to(dtype)  # (1, rows, K): leading dims kept
    bias = torch.randn(n, generator=gen).to(dtype)
    y = gemv.linear_cpu(x, w, bias, reference=fused_linear)
    assert y.shape == (1, rows, n) and y.dtype == dtype
    exact = x.double() @ w.double().T + bias.double()
    err = (y.double() - exact).abs()
    limit = bound(x, w, dtype) + ROUNDING[dtype] * bias.double().abs()
    assert bool((err <= limit).all()), float((err - limit).max())
    # and as close to F.linear as two products within the bound can be
    ref = F.linear(x.float(), w.float(), bias.float()).double()
    assert bool(((y.double() - ref).abs() <= 2 * limit).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, gemv.SLICED_MAX_ROWS, gemv.SLICED_MAX_ROWS + 1, 9, 16,
                                  gemv.TILE_MAX_ROWS + 1])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 17, 131])
@pytest.mark.parametrize("k", [40, 64, 1040])
def test_every_output_row_in_every_loop(dtype, rows, n, k, threads):
    """Each loop's blocks write every output row once, at any row count: the sliced loop's 8
    slices of ceil(n / 8) rows leave the last ones short or empty (n = 9: slices of 2, the fifth
    holds row 8 alone, the last three none), the tiles' and the eight-row loop's last block is
    short; with AVX-512, 9 and 16 rows take the tiles of 8 by 2 (gemv_tiles), whose two groups
    overlap at 9, where the rows fit in L1 (k = 40, 64), else the tiles of 4 by 4 (k = 1040: 65
    KiB at 16 rows); with AVX2, every row count from SLICED_MAX_ROWS + 1 the narrow tiles.
    k = 64 channels, a multiple of 16, has no tail channels: full tiles write their sums
    straight out (gemv_tiles), short ones take the general path."""
    gen = torch.Generator().manual_seed(n * 100 + rows + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    y = gemv.linear_cpu(x, w, reference=fused_linear)
    exact = x.double() @ w.double().T
    err = (y.double() - exact).abs()
    assert bool((err <= bound(x, w, dtype)).all()), float(err.max())


def test_tiles_of_8_by_2_only_while_the_activation_rows_fit_in_l1():
    """9 to 16 activation rows go in tiles of 8 by 2 only while all of them fit in a core's L1
    data cache (each pair of weight rows goes through them all): 16 rows of 576 float32 channels
    (36 KiB) on a 48 KiB L1, not on a 32 KiB one, where 14 (31.5 KiB) still do."""
    from tinykv.gemv_tiles import l1_data_bytes, tile_rows

    assert tile_rows(16, 576, 48 * 1024) == 2 and tile_rows(16, 576, 32 * 1024) == 4
    assert tile_rows(14, 576, 32 * 1024) == 2 and tile_rows(15, 576, 32 * 1024) == 4
    assert tile_rows(8, 64, 48 * 1024) == 4 and tile_rows(17, 64, 48 * 1024) == 4
    assert 16 * 1024 <= l1_data_bytes() <= 1024 * 1024 and gemv.L1_DATA_BYTES == l1_data_bytes()


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 16, 17, 64])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 23, 25, 49])
@pytest.mark.parametrize("k", [5, 8, 40, 1043])
def test_narrow_tiles_write_every_output_row(rows, n, k):
    """gemv_narrow's tiles of 4 activation rows by 3 weight rows, called as the GEMV calls them
    on AVX2 (blocks of NARROW_ROWS output rows; here on any CPU, the 8-lane accumulators compile
    for either): every output within the float32 bound, where the last group of activation rows
    and the last tile of weight rows are short (repeated rows, sums dropped), where a block ends
    inside a tile (n = 25, 49), and with tail channels past the last multiple of 8 (k = 5, 1043;
    k = 5 has no whole step at all)."""
    from tinykv.gemv_narrow import NARROW_ROWS, narrow_block

    gen = torch.Generator().manual_seed(n * 1000 + rows * 10 + k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    y = torch.full((rows, n), float("nan"))  # every output written, or NaN stays
    for block in range(-(-n // NARROW_ROWS)):
        narrow_block(x.numpy(), w.numpy(), y.numpy(), block * NARROW_ROWS, NARROW_ROWS)
    err = (y.double() - x.double() @ w.double().T).abs()
    assert bool((err <= bound(x, w, torch.float32)).all()), float(err.max())


def test_narrow_tiles_leave_the_other_blocks_alone():
    """A block writes its own output rows only: a tile past the block's end repeats its last row
    and drops those sums, so threads that share a matrix never write each other's rows."""
    from tinykv.gemv_narrow import narrow_block

    gen = torch.Generator().manual_seed(7)
    w, x = torch.randn(30, 64, generator=gen), torch.randn(6, 64, generator=gen)
    y = torch.zeros(6, 30)
    narrow_block(x.numpy(), w.numpy(), y.numpy(), 8, 7)  # rows 8 .. 14: tiles 8-10, 11-13, 14
    exact = x.double() @ w.double().T
    assert bool((y[:, :8] == 0).all()) and bool((y[:, 15:] == 0).all())
    assert bool(((y[:, 8:15].double() - exact[:, 8:15]).abs()
                 <= bound(x, w[8:15], torch.float32)).all())


@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
def test_fused_linear_within_the_float32_bound(swiglu, threads):
    """Norm, product, SwiGLU and residual in one call against float64 from the same normalized
    rows: the product's bound, carried through silu(g) * u (|silu'| < 1.1), plus the roundings
    of silu, the product and the residual add."""
    gen = torch.Generator().manual_seed(7)
    n, k, rows = 2 * (gemv.ROWS * 3 + 2), 96, 3
    w, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = 3 * torch.randn(rows, k, generator=gen)
    norm = torch.nn.RMSNorm(k, eps=1e-5)
    torch.nn.init.normal_(norm.weight, generator=gen)
    out_n = n // 2 if swiglu else n
    residual = torch.randn(rows, out_n, generator=gen)
    with torch.no_grad():
        y = gemv.linear_cpu(x, w, bias, norm, residual, swiglu, reference=fused_linear)
        xn = gemv.rms_norm_cpu(x, [k], norm.weight, norm.eps)  # what the fused norm computes
    exact = xn.double() @ w.double().T + bias.double()  # (rows, n)
    limit = bound(xn, w, torch.float32) + 2 * U32 * bias.double().abs()
    if swiglu:
        g, u = exact.chunk(2, dim=-1)
        lg, lu = limit.chunk(2, dim=-1)
        silu = g * torch.sigmoid(g)
        exact = silu * u
        limit = 1.1 * lg * (u.abs() + lu) + (silu.abs() + 1.1 * lg) * lu + 8 * U32 * exact.abs()
    exact = exact + residual.double()
    limit = limit + U32 * exact.abs()
    assert y.shape == (rows, out_n)
    assert bool(((y.double() - exact).abs() <= limit).all())


def test_fused_linear_takes_no_rows():
    """A prefill chunk whose logits nobody wants reaches the head with no rows."""
    w, norm = torch.randn(8, 16), torch.nn.RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        y = gemv.linear_cpu(torch.randn(0, 16), w, None, norm, reference=fused_linear)
    assert y.shape == (0, 8)


def test_rope_cpu_is_apply_rope():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, 64, generator=gen)
    cos, sin = torch.randn(5, 1, 64, generator=gen), torch.randn(5, 1, 64, generator=gen)
    y = gemv_layer.rope_cpu(x, cos, sin, reference=apply_rope)
    want = apply_rope(x, cos, sin)  # two products and a sum, each rounded once
    rolled = x.roll(32, -1)
    limit = 2 * U32 * ((x * cos).abs() + (rolled * sin).abs())
    assert bool(((y - want).abs() <= limit).all())
    for args in [(x.double(), cos.double(), sin.double()), (x[None], cos[None], sin[None])]:
        torch.testing.assert_close(gemv_layer.rope_cpu(*args, reference=apply_rope),
                                   apply_rope(*args))  # other shapes and dtypes: the reference


def test_gemv_is_used_for_a_few_rows_and_torch_beyond():
    w = torch.randn(8, 16)
    assert gemv.fits(torch.randn(1, 16), w) and gemv.fits(torch.randn(gemv.TILE_BATCH, 16), w)
    assert not gemv.fits(torch.randn(gemv.TILE_BATCH + 1, 16), w)
    half = w.to(torch.bfloat16)  # half weights widen one by one: fewer rows pay
    assert gemv.fits(torch.randn(gemv.SMALL_BATCH, 16), half)
    assert not gemv.fits(torch.randn(gemv.SMALL_BATCH + 1, 16), half)
    assert not gemv.fits(torch.randn(1, 16), w.t().contiguous().t())  # columns stored first
    assert not gemv.fits(torch.randn(1, 16, dtype=torch.float64), w.double())


def test_the_model_decodes_through_the_gemv(small_model, monkeypatch):
    calls = []
    real = gemv._run_linear
    monkeypatch.setattr(gemv, "_run_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    tokens = torch.tensor([[5, 6, 7]])
    small_model.use_kernels()
    want = small_model(tokens)
    small_model.use_kernels(**gemv_layer.select_kernels("cpu", REFERENCES))
    try:
        got = small_model(tokens)
    finally:
        small_model.use_kernels()
    # (B, T) without a plan: the layers through their references, 2 layers x 4 products + the
    # head, each over the 3 rows of the prompt
    assert calls == [3] * (2 * 4 + 1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_from_pretrained_chooses_the_gemv_on_the_cpu(smollm2_dir):
    model = Transformer.from_pretrained(smollm2_dir, device="cpu", dtype=torch.float32)
    assert model.layers[0].attn.wqkv.product.func is gemv.linear_cpu
    assert model.lm_head.product.func is gemv.linear_cpu
    assert model.layers[0].attn.rope.func is gemv_layer.rope_cpu
    assert model.layers[0].attn.project.func is gemv_layer.project_cpu
    assert model.layers[0].finish.func is gemv_layer.finish_cpu


@pytest.mark.parametrize("shape", [(1, 576), (3, 200), (2, 5, 64)])
def test_rms_norm_cpu_within_its_float32_bound(shape):
    """One pass per row against float64: the sum of D squares carries at most gamma_(D+1) of
    relative error, halved by the square root; the mean, eps, root, reciprocal and two products
    add one rounding each (6u), and the output's own rounding one more."""
    gen = torch.Generator().manual_seed(len(shape))
    d = shape[-1]
    x = 3 * torch.randn(shape, generator=gen)
    w = torch.randn(d, generator=gen)
    eps = 1e-5
    y = gemv.rms_norm_cpu(x, [d], w, eps)
    assert y.shape == x.shape and y.dtype == torch.float32
    xd = x.double()
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    gamma = (d + 1) * U32 / (1 - (d + 1) * U32)
    limit = (gamma / 2 + 7 * U32) * exact.abs()
    assert bool(((y.double() - exact).abs() <= limit).all())
    torch.testing.assert_close(y, F.rms_norm(x, [d], w, eps), rtol=2 * limit.max().item(), atol=0)


def test_rms_norm_cpu_leaves_other_inputs_to_torch(monkeypatch):
    calls = []
    monkeypatch.setattr(gemv, "_rms_norm_rows", lambda *a: calls.append(a))
    x, w = torch.randn(2, 8), torch.randn(8)
    for args in [(x.bfloat16(), [8], w.bfloat16(), 1e-5), (x.t().contiguous().t(), [8], w, 1e-5),
                 (x, [8], None, 1e-5), (x, [8], w, None), (x.view(2, 2, 4), [2, 4], w.view(2, 4),
                                                          1e-5)]:
        torch.testing.assert_close(gemv.rms_norm_cpu(*args), F.rms_norm(*args))
    assert calls == []


HASWELL_FEATURES = ",".join("+" + f for f in (
    "sse2", "sse3", "ssse3", "sse4.1", "sse4.2", "popcnt", "cx16", "avx", "avx2", "fma", "f16c",
    "bmi", "bmi2", "lzcnt", "movbe", "xsave"))


def test_avx2_only_cpus(tmp_path):
    """The bound tests again, the kernels compiled for a Haswell (AVX2, no AVX-512)."""
    # A feature list of its own: NUMBA_CPU_NAME alone keeps the host's (AVX-512 where it has it)
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=HASWELL_FEATURES,
               NUMBA_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"{__file__}::test_linear_cpu_within_the_float32_bound",
                          f"{__file__}::test_rms_norm_cpu_within_its_float32_bound",
                          f"{__file__}::test_fused_linear_within_the_float32_bound"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:]  # 5 when no test ran, 1 when one failed


@pytest.mark.parametrize("rows, cols", [(16, 576), (1, 576), (3, 1536), (5, 7), (0, 64)])
def test_empty_lines_start_on_a_cache_line(rows, cols):
    """The kernels' own activation rows: numba starts an array on 32 bytes, so about half of them
    would start mid-line; many in one process, so a lucky allocator cannot pass."""
    arrays = [gemv.empty_lines(rows, cols) for _ in range(64)]
    for a in arrays:
        assert a.shape == (rows, cols) and a.dtype == np.float32 and a.flags.c_contiguous
        assert a.ctypes.data % CACHE_LINE == 0 or a.size == 0
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays if a.size)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no overlap


def test_exp_within_a_few_units_in_the_last_place():
    """cpu_numerics.exp (SwiGLU's e^x) against float64 over its whole range: r = x - k ln 2 is
    exact but for ln 2's own rounding (2e-9, times k), so the bound grows with |x|: at most 4
    units in the last place, plus |x| * 2e-9."""
    from numba import njit

    from tinykv.kernels.cpu_numerics import FAST, exp

    @njit(fastmath=FAST)
    def exps(x, out):
        for i in range(x.size):
            out[i] = exp(x[i])

    gen = np.random.default_rng(0)
    x = np.concatenate([gen.uniform(-87, 88, 100_000), np.linspace(-4, 4, 20_001),
                        [-87.0, 0.0, 88.0]]).astype(np.float32)
    out = np.empty_like(x)
    exps(x, out)
    exact = np.exp(x.astype(np.float64))
    assert (np.abs(out - exact) <= (4 * U32 + np.abs(x) * 2e-9) * exact).all()
    edges = np.array([np.nan, -np.inf, -1000.0, 1000.0, np.inf], np.float32)
    out = np.empty_like(edges)
    exps(edges, out)  # NaN stays NaN; beyond the range, the range's ends (no inf, no 0)
    assert np.isnan(out[0]) and (out[1:3] == out[1]).all() and (out[3:] == out[3]).all()
    assert 0 < out[1] < 1e-37 and 1e38 < out[3] < np.inf
