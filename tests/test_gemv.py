"""The decode-time GEMV (tinykv/gemv.py) against float64, with the error bound of a float32 dot
product: |computed - exact| <= gamma_K * sum_k |w_k x_k|, gamma_K = K u / (1 - K u), u = 2^-24,
for any order of summation (so for any vector width or CPU), plus the output's own rounding."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tinykv import gemv
from tinykv.model import Transformer

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


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Torch's thread count, which the GEMV follows (2: the parallel kernel, rows split)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, gemv.SMALL_BATCH, gemv.SMALL_BATCH + 3])
def test_linear_cpu_within_the_float32_bound(dtype, rows, threads):
    if dtype == torch.float16 and not gemv.F16C:
        pytest.skip("float16 weights need F16C for the GEMV")
    gen = torch.Generator().manual_seed(rows)
    n, k = gemv.ROWS * 5 + 3, 200  # output rows not a multiple of ROWS: the tail path runs too
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(2, rows, k, generator=gen).to(dtype)  # (2, rows, K): leading dims kept
    bias = torch.randn(n, generator=gen).to(dtype)
    y = gemv.linear_cpu(x, w, bias)
    assert y.shape == (2, rows, n) and y.dtype == dtype
    exact = x.double() @ w.double().T + bias.double()
    err = (y.double() - exact).abs()
    limit = bound(x, w, dtype) + ROUNDING[dtype] * bias.double().abs()
    assert bool((err <= limit).all()), float((err - limit).max())
    # and as close to F.linear as two products within the bound can be
    ref = F.linear(x.float(), w.float(), bias.float()).double()
    assert bool(((y.double() - ref).abs() <= 2 * limit).all())


def test_gemv_is_used_for_a_few_rows_and_torch_beyond():
    w = torch.randn(8, 16)
    assert gemv.fits(torch.randn(1, 16), w) and gemv.fits(torch.randn(gemv.SMALL_BATCH, 16), w)
    assert not gemv.fits(torch.randn(gemv.SMALL_BATCH + 1, 16), w)
    assert not gemv.fits(torch.randn(1, 16), w.t().contiguous().t())  # columns stored first
    assert not gemv.fits(torch.randn(1, 16, dtype=torch.float64), w.double())


def test_the_model_decodes_through_the_gemv(small_model, monkeypatch):
    calls = []
    real = gemv.gemv
    monkeypatch.setattr(gemv, "gemv", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    tokens = torch.tensor([[5, 6, 7]])
    small_model.use_kernels(F.linear)
    want = small_model(tokens)
    small_model.use_kernels(gemv.linear_cpu, gemv.rms_norm_cpu)
    try:
        got = small_model(tokens)
    finally:
        small_model.use_kernels(F.linear)
    # 2 layers x 4 products + the head, each over the 3 rows of the prompt
    assert calls == [3] * (2 * 4 + 1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_from_pretrained_chooses_the_gemv_on_the_cpu(smollm2_dir):
    model = Transformer.from_pretrained(smollm2_dir, device="cpu", dtype=torch.float32)
    assert model.layers[0].attn.wqkv.product is gemv.linear_cpu
    assert model.lm_head.product is gemv.linear_cpu
    assert model.layers[0].norm1.normalize is gemv.rms_norm_cpu
    assert model.norm.normalize is gemv.rms_norm_cpu


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


def test_avx2_only_cpus(tmp_path):
    """The bound tests again, the kernels compiled for a Haswell (AVX2, no AVX-512)."""
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"{__file__}::test_linear_cpu_within_the_float32_bound",
                          f"{__file__}::test_rms_norm_cpu_within_its_float32_bound"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:]  # 5 when no test ran, 1 when one failed
