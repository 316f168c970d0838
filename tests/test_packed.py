"""Float32 weights that came from 4- or 8-bit blocks, read packed (tinykv/packed.py). The blocks
are made and dequantized by gguf's own Q4_1 and Q8_0 code (the reference for what fetch.py
converts): packing must give back every weight bit for bit, decline anything else, and the GEMV on
packed weights must stay within the float32 bound of tests/test_gemv_layer.py."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from test_gemv_layer import _packed as decode_step
from test_gemv_layer import gamma, layer

from tinykv import gemv, gemv_layer, packed
from tinykv.model import REFERENCES

pytestmark = pytest.mark.skipif(not gemv.AVAILABLE, reason="numba is not installed")


KINDS = [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0]


def from_blocks(weights: torch.Tensor, kind=GGMLQuantizationType.Q4_1) -> torch.Tensor:
    """`weights` (N, K) through gguf's quantizer and dequantizer, as float32."""
    raw = quantize(weights.numpy().astype(np.float32), kind)
    return torch.from_numpy(np.array(dequantize(raw, kind), np.float32).reshape(weights.shape))


def unpacked(p: packed.Packed) -> torch.Tensor:
    """The float32 matrix (rows, K) a Packed holds, read from its documented layout: panels of
    16 rows; per channel pair t, 4-bit codes as byte [p, t, j] = row 16p+j's codes at channels
    2t (low nibble) and 2t+1 (high), 8-bit codes as [p, t, j] at 2t and [p, t, 16 + j] at 2t+1."""
    codes = torch.from_numpy(p.codes)  # (P, K/2, 16) or (P, K/2, 32)
    if codes.dtype == torch.uint8:
        q = torch.stack([codes & 15, codes >> 4], 2).float()  # (P, K/2, 2, 16): channel 2t + i
    else:
        q = codes.view(codes.shape[0], codes.shape[1], 2, 16).float()
    q = q.flatten(1, 2).transpose(1, 2).flatten(0, 1)  # (P*16, K)
    scales = torch.from_numpy(p.scales).transpose(1, 2).flatten(0, 1)  # (P*16, K/32)
    rebuilt = scales.repeat_interleave(32, 1) * q  # (P*16, K)
    if codes.dtype == torch.uint8:
        mins = torch.from_numpy(p.mins).transpose(1, 2).flatten(0, 1)
        rebuilt = rebuilt + mins.repeat_interleave(32, 1)
    else:
        assert p.mins.size == 0
    assert not rebuilt[p.rows:].any()  # the last panel's padding rows are zeros
    return rebuilt[:p.rows]


def attached(w: torch.Tensor) -> torch.Tensor:
    """w as a parameter carrying its packed arrays, as pack_model leaves a model's weights."""
    p = torch.nn.Parameter(w.clone(), requires_grad=False)
    setattr(p, packed._ATTRIBUTE, (p.data_ptr(), packed.pack(p)))
    return p


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(13, 32), (100, 96), (576, 576), (40, 1536)])
def test_packing_gives_back_every_weight_bit_for_bit(shape, kind):
    torch.manual_seed(shape[0])
    w = from_blocks(torch.randn(shape) * torch.rand(shape[0], 1) + torch.randn(shape[0], 1), kind)
    if kind == GGMLQuantizationType.Q4_1:
        w[3 % shape[0], :32] = 0.25  # a block of one value: its scale can be anything
    w[4 % shape[0], -32:] = 0.0  # a block of zeros: d = 0
    assert (packed.pack(w).codes.dtype == np.uint8) == (kind == GGMLQuantizationType.Q4_1)
    assert torch.equal(unpacked(packed.pack(w)).view(torch.int32), w.view(torch.int32))
    # the kernel's own decode: x = one-hot rows pick columns, each a single product by 1.0
    p = attached(w)
    for col in (0, shape[1] // 2 + 5, shape[1] - 1):
        x = torch.zeros(1, shape[1])
        x[0, col] = 1.0
        assert torch.equal(gemv.gemv(x, p)[0].view(torch.int32), w[:, col].view(torch.int32))


@pytest.mark.parametrize("kind", KINDS)
def test_weights_that_did_not_come_from_blocks_stay_as_they_are(kind):
    torch.manual_seed(0)
    assert packed.pack(torch.randn(64, 64)) is None  # trained float32
    assert packed.pack(from_blocks(torch.randn(8, 64), kind).to(torch.bfloat16)) is None
    assert packed.pack(from_blocks(torch.randn(8, 64), kind)[:, :48].contiguous()) is None
    almost = from_blocks(torch.randn(8, 64), kind)
    almost[2, 7] = torch.nextafter(almost[2, 7], torch.tensor(9.0))  # one bit off
    assert packed.pack(almost) is None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 9, 16, 17, 64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(13, 64), (100, 96), (37, 608), (24, 1536)])
def test_packed_gemv_within_the_float32_bound(rows, threads, shape, kind):
    torch.manual_seed(rows)
    w = from_blocks(torch.randn(shape), kind)
    x = torch.randn(rows, shape[1])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = gemv.gemv(x, attached(w)).double()
    finally:
        torch.set_num_threads(before)
    want = x.double() @ w.double().T
    bound = gamma(shape[1]) * (x.double().abs() @ w.double().abs().T)
    assert ((got - want).abs() <= bound).all()


def test_a_packed_model_decodes_as_the_float32_one():
    """A model whose layers hold 4-bit-block weights and whose LM head holds 8-bit blocks:
    pack_model packs the matrices whose rows are whole blocks (not w_out: 80 inputs), and the
    decode step's output matches the float32 kernels'; a weight given new storage afterwards is
    read as it is, not from its old codes."""
    m = layer(True)
    with torch.no_grad():
        for block in m.layers:
            for lin in (block.attn.wqkv, block.attn.wo, block.mlp.w_in, block.mlp.w_out):
                if lin.weight.shape[1] % 32 == 0:
                    lin.weight.data = from_blocks(lin.weight.data)
        m.lm_head.weight.data = from_blocks(m.lm_head.weight.data, GGMLQuantizationType.Q8_0)
    m.use_kernels(**gemv_layer_kernels())
    step = decode_step(torch.tensor([3, 9]))
    want = m(*step)
    assert packed.pack_model(m) == 3 * m.cfg.n_layers + 1
    assert packed.packed_arrays(m.lm_head.weight).codes.dtype == np.int8
    assert packed.packed_arrays(m.layers[0].mlp.w_out.weight) is None
    torch.testing.assert_close(m(*step), want, rtol=1e-4, atol=1e-4)
    w = m.layers[1].mlp.w_in.weight
    w.data = 2 * w.data  # new storage: the codes are another matrix's now
    assert packed.packed_arrays(w) is None
    m.use_kernels(**gemv_layer_kernels())
    doubled = m(*step)
    m.use_kernels(**REFERENCES)
    torch.testing.assert_close(doubled, m(*step), rtol=1e-4, atol=1e-4)


def gemv_layer_kernels() -> dict:
    return gemv_layer.select_kernels("cpu", REFERENCES)
