"""A decode layer in two compiled calls (tinykv/gemv_layer.py) against float64, stage by stage:
each product carries at most gamma_K * sum_k |w_k x_k| of error for any order of summation (so
for any vector width or CPU), each later stage carries the earlier stages' bounds through its own
sensitivity, and every rounding adds u = 2^-24 of the value rounded."""

import os
import subprocess
import sys

import pytest
import torch

from tinykv import gemv, gemv_layer
from tinykv.model import REFERENCES, Config, Transformer, apply_rope

pytestmark = pytest.mark.skipif(not gemv.AVAILABLE, reason="numba is not installed")
U = 2.0**-24


def gamma(k: int) -> float:
    return k * U / (1 - k * U)


def layer(bias: bool, dtype=torch.float32, seed=0) -> Transformer:
    """A random 2-layer Llama-family model, norms and biases perturbed; weights in `dtype`."""
    torch.manual_seed(seed)
    cfg = Config(vocab_size=64, dim=96, n_layers=2, n_heads=3, n_kv_heads=1, ffn_dim=80,
                 max_seq_len=64, qkv_bias=bias, o_bias=bias, mlp_bias=bias)
    m = Transformer(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
            elif "layers" in name:
                p.data = p.data.to(dtype)
    return m


def kernels() -> dict:
    return gemv_layer.select_kernels("cpu", REFERENCES)


def exact_norm(h: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in float64, and the bound of the fused norm's own error (tests/test_gemv.py: the
    sum of D squares, halved by the root, 7 more roundings) relative to each output."""
    d = h.shape[-1]
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
    return n, (gamma(d + 1) / 2 + 7 * U) * n.abs()


def product(x, w, bias, err_x) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ w^T + bias in float64, and its bound when x carries err_x: |w| err_x, the float32
    sum's gamma_K, the bias add's rounding."""
    w = w.double()
    y = x @ w.T + (0 if bias is None else bias.double())
    err = err_x @ w.abs().T + gamma(x.shape[-1] + 1) * ((x.abs() + err_x) @ w.abs().T)
    return y, err + (0 if bias is None else 2 * U * bias.double().abs())


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("rows", [1, 3, gemv.SMALL_BATCH, 17])
def test_project_within_the_float32_bound(bias, rows, threads):
    m = layer(bias)
    attn, norm = m.layers[0].attn, m.layers[0].norm1
    gen = torch.Generator().manual_seed(rows)
    x = 3 * torch.randn(rows, m.cfg.dim, generator=gen)
    pos = torch.randint(0, m.cfg.max_seq_len, (rows,), generator=gen)
    cos, sin = m.rope_cos[pos].unsqueeze(-2), m.rope_sin[pos].unsqueeze(-2)  # (N, 1, hd)
    qk, v = gemv_layer.project_cpu(attn, x, norm, cos, sin, cache={}, reference=_never)
    xn, err_n = exact_norm(x.double(), norm)
    y, err = product(xn, attn.wqkv.weight, attn.wqkv.bias, err_n)  # (N, q + 2 kv)
    y, err = y.view(rows, -1, m.cfg.head_dim), err.view(rows, -1, m.cfg.head_dim)
    r = qk.shape[1]
    c, s = cos.double(), sin.double()
    want = apply_rope(y[:, :r], c, s)
    half = m.cfg.head_dim // 2
    terms = (y[:, :r] * c).abs() + (y[:, :r].roll(half, -1) * s).abs()
    limit = err[:, :r] * c.abs() + err[:, :r].roll(half, -1) * s.abs() + 3 * U * terms
    assert qk.shape == (rows, m.cfg.n_heads + m.cfg.n_kv_heads, m.cfg.head_dim)
    assert bool(((qk.double() - want).abs() <= limit).all())
    assert v.shape == (rows, m.cfg.n_kv_heads, m.cfg.head_dim)
    assert bool(((v.double() - y[:, r:]).abs() <= err[:, r:] + U * y[:, r:].abs()).all())


def _never(*args):
    raise AssertionError("the kernel should have served this call")


def swiglu(gu, err_gu) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up in float64 and its bound (|silu'| < 1.1; 8 roundings)."""
    g, u = gu.chunk(2, dim=-1)
    eg, eu = err_gu.chunk(2, dim=-1)
    silu = g * torch.sigmoid(g)
    a = silu * u
    return a, 1.1 * eg * (u.abs() + eu) + (silu.abs() + 1.1 * eg) * eu + 8 * U * a.abs()


def norm_of_inexact(h, err_h, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of h known within err_h: n_i = g_i h_i / r moves by at most |g_i| (err_i / r +
    |h_i| |err|_2 / (sqrt(D) r^2)) (first order, 1% for the rest), plus the norm's own error."""
    n, err_n = exact_norm(h, norm)
    r = torch.sqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    drift = err_h.norm(dim=-1, keepdim=True) / h.shape[-1] ** 0.5
    moved = norm.weight.double().abs() * (err_h / r + h.abs() * drift / r**2)
    return n, 1.01 * moved + err_n * 1.01


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("rows", [1, 3, gemv.SMALL_BATCH, 17])
def test_finish_within_the_float32_bound(bias, rows, threads):
    m = layer(bias, seed=1)
    block = m.layers[1]
    gen = torch.Generator().manual_seed(rows)
    o = torch.randn(rows, m.cfg.n_heads * m.cfg.head_dim, generator=gen)
    x = 3 * torch.randn(rows, m.cfg.dim, generator=gen)
    got = gemv_layer.finish_cpu(block, o, x, cache={}, reference=_never)
    wo, mlp = block.attn.wo, block.mlp
    h, err_h = product(o.double(), wo.weight, wo.bias, torch.zeros_like(o, dtype=torch.float64))
    h = h + x.double()
    err_h = err_h + U * h.abs()
    n, err_n = norm_of_inexact(h, err_h, block.norm2)
    a, err_a = swiglu(*product(n, mlp.w_in.weight, mlp.w_in.bias, err_n))
    y, err_y = product(a, mlp.w_out.weight, mlp.w_out.bias, err_a)
    want = h + y
    limit = err_h + err_y + U * want.abs()
    assert got.shape == x.shape
    assert bool(((got.double() - want).abs() <= limit).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_weights_as_the_reference_reads_them(dtype):
    """Half weights are widened exactly: the fused calls then agree with the torch reference run
    on the same weights widened to float32, within two products' bounds (loose: 1e-4)."""
    if dtype == torch.float16 and not gemv.F16C:
        pytest.skip("float16 weights need F16C")
    m, wide = layer(True, dtype), layer(True)
    wide.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
    m.use_kernels(**kernels())
    got = m(*_packed(torch.tensor([3, 9])))
    want = wide(*_packed(torch.tensor([3, 9])))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


class _Plan:
    """Two sequences of one token each, attending to nothing but themselves: a KVStep."""

    def __init__(self, positions):
        self.positions, self.logits_idx = positions, None

    def attend(self, layer, q, k, v):
        return v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)  # softmax over one key


def _packed(positions: torch.Tensor) -> tuple[torch.Tensor, _Plan]:
    """A decode step of two sequences at `positions`: the tokens and the plan."""
    return torch.tensor([5, 7]), _Plan(positions)


def test_a_decode_step_is_two_calls_a_layer(monkeypatch):
    """With a plan and a few rows, each layer is one project and one finish call; with many rows
    (a prefill chunk) or no plan, every layer goes to the references."""
    m = layer(True)
    calls = []
    for name in ("_project_serial", "_finish_serial"):
        real = getattr(gemv_layer, name)
        monkeypatch.setattr(gemv_layer, name, lambda *a, real=real, name=name:
                            calls.append(name) or real(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the serial kernels
    try:
        want = m(*_packed(torch.tensor([3, 9])))
        m.use_kernels(**kernels())
        got = m(*_packed(torch.tensor([3, 9])))
    finally:
        torch.set_num_threads(before)
    assert calls == ["_project_serial", "_finish_serial"] * m.cfg.n_layers
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    calls.clear()
    m(torch.tensor([[1, 2, 3]]))  # (B, T): no plan, the references
    assert calls == []


def test_moved_parameters_are_read_again():
    """A parameter given new storage (.data replaced, as .to() does) is read again, not the old
    copy."""
    m = layer(False)
    m.use_kernels(**kernels())
    step = _packed(torch.tensor([1, 2]))
    before = m(*step)
    w = m.layers[0].mlp.w_out.weight
    w.data = 2 * w.data  # new storage
    after = m(*step)
    m.use_kernels()
    torch.testing.assert_close(after, m(*step), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(before, after)


def test_avx2_only_cpus(tmp_path):
    """The bound tests again, the kernels compiled for a Haswell (AVX2, no AVX-512)."""
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES="",
               NUMBA_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"{__file__}::test_project_within_the_float32_bound",
                          f"{__file__}::test_finish_within_the_float32_bound"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:]  # 5 when no test ran, 1 when one failed


@pytest.mark.parametrize("dtype, rows", [(torch.bfloat16, gemv.SMALL_BATCH + 1),
                                         (torch.float32, gemv.TILE_BATCH + 1)])
def test_more_rows_than_the_gemv_takes_go_to_the_references(dtype, rows, monkeypatch):
    m = layer(False, dtype)
    monkeypatch.setattr(gemv_layer, "_project_serial", _never)
    monkeypatch.setattr(gemv_layer, "_finish_serial", _never)
    monkeypatch.setattr(gemv_layer, "_project_parallel", _never)
    monkeypatch.setattr(gemv_layer, "_finish_parallel", _never)
    block, gen = m.layers[0], torch.Generator().manual_seed(rows)
    x, o = torch.randn(rows, m.cfg.dim, generator=gen), torch.randn(rows, 96, generator=gen)
    pos = torch.arange(rows) % m.cfg.max_seq_len
    cos, sin = m.rope_cos[pos].unsqueeze(-2), m.rope_sin[pos].unsqueeze(-2)
    refs = []
    gemv_layer.project_cpu(block.attn, x, block.norm1, cos, sin, cache={},
                           reference=lambda *a: refs.append("project"))
    gemv_layer.finish_cpu(block, o, x, cache={}, reference=lambda *a: refs.append("finish"))
    assert refs == ["project", "finish"]
