"""The torch reference attention (kernels.paged_attention_ref), the CPU path, against plain float64 math.

paged_attention_ref takes shortcuts: decoding rows apply per-key scales to scores and probabilities
instead of dequantizing K and V, and multi-query rows go through torch's flash attention. Here every
block is dequantized whole (quant.dequantize) and each query attends in float64 with an explicit mask.
"""

import pytest
import torch
from pools import ATTN_CASES, make_batch, make_pool

from tinykv.kernels import PoolLayer, paged_attention_ref
from tinykv.quant import dequantize


def dense(pool: PoolLayer) -> torch.Tensor:
    """Every block of the pool dequantized in float64: (NB, H, BS, D)."""
    d = pool.data
    full = lambda t: None if t is None else t.expand(d.shape[0], d.shape[1], d.shape[2], t.shape[-1])
    return dequantize(d.cpu(), pool.p, *(None if t is None else full(t).cpu() for t in (pool.scale, pool.zero)),
                      out_dtype=torch.float64)


def attention_f64(q, q_seq, q_pos, k, v, table, ctx, sm):
    K, V = dense(k), dense(v)
    BS, n_rep = K.shape[2], q.shape[1] // K.shape[1]
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for i in range(q.shape[0]):
        b, p = int(q_seq[i]), int(q_pos[i])
        keys = [(int(table[b, t // BS]), t % BS) for t in range(min(p + 1, int(ctx[b]))) if table[b, t // BS] >= 0]
        if not keys:
            continue
        for h in range(q.shape[1]):
            kh = torch.stack([K[blk, h // n_rep, r] for blk, r in keys])  # (T, D)
            vh = torch.stack([V[blk, h // n_rep, r] for blk, r in keys])
            s = kh @ q[i, h].double() * sm
            lse[i, h] = torch.logsumexp(s, 0)
            o[i, h] = torch.softmax(s, 0) @ vh
    return o, lse


@pytest.mark.parametrize("kspec,vspec,n_rep,D,BS", ATTN_CASES)
def test_reference_matches_float64(kspec, vspec, n_rep, D, BS):
    gen = torch.Generator().manual_seed(n_rep * 100 + D + BS)
    k, v = make_pool(kspec, 2, BS, D, gen), make_pool(vspec, 2, BS, D, gen)
    q, q_seq, q_pos, table, ctx = make_batch(BS, 2 * n_rep, D, gen)
    decode = torch.tensor([0, 1, 5, 6])  # rows 0, 1, 3, 4 have one query each: the all-decoding path alone
    cases = [(q, q_seq, q_pos, table, ctx),  # mixed: decoding rows beside a 3-query chunk
             (q[decode], torch.arange(4), q_pos[decode], table[[0, 1, 3, 4]], ctx[[0, 1, 3, 4]])]
    for args in cases:
        o, lse = paged_attention_ref(*args[:3], k, v, *args[3:], D**-0.5)
        o_ref, lse_ref = attention_f64(*args[:3], k, v, *args[3:], D**-0.5)
        assert o.dtype == torch.float32 and torch.isneginf(lse[-1]).all()
        torch.testing.assert_close(o.double(), o_ref, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse.double(), lse_ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("spec", ["fp16", "int8", "int4:asym", "fp8", "int2"])
def test_reference_reads_consecutive_blocks_in_place(spec):
    """A long run of consecutive blocks (one sequence in a fresh pool) is read as a slice of the pool."""
    gen = torch.Generator().manual_seed(5)
    BS, D = 16, 64
    k, v = make_pool(spec, 2, BS, D, gen), make_pool(spec, 2, BS, D, gen)
    for ids in (range(3, 23), range(20, 0, -1)):  # in order (read in place), and not
        table, ctx = torch.tensor([list(ids)], dtype=torch.int32), torch.tensor([20 * BS - 3], dtype=torch.int32)
        q, q_seq, q_pos = torch.randn(1, 6, D, generator=gen), torch.zeros(1, dtype=torch.long), ctx - 1
        o, lse = paged_attention_ref(q, q_seq, q_pos, k, v, table, ctx, D**-0.5)
        o_ref, lse_ref = attention_f64(q, q_seq, q_pos, k, v, table, ctx, D**-0.5)
        torch.testing.assert_close(o.double(), o_ref, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse.double(), lse_ref, atol=2e-5, rtol=2e-5)


def test_reference_chunk_that_sees_no_key_here():
    """A prefill chunk whose visible keys all live in the other pool (a sink block, say): o 0, lse -inf."""
    gen = torch.Generator().manual_seed(9)
    BS, D = 16, 64
    k, v = make_pool("int8", 2, BS, D, gen), make_pool("fp16", 2, BS, D, gen)
    table, ctx = torch.tensor([[-1, 4]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    q, q_seq = torch.randn(4, 4, D, generator=gen), torch.zeros(4, dtype=torch.long)
    q_pos = torch.tensor([0, 1, 16, 19])
    o, lse = paged_attention_ref(q, q_seq, q_pos, k, v, table, ctx, D**-0.5)
    o_ref, lse_ref = attention_f64(q, q_seq, q_pos, k, v, table, ctx, D**-0.5)
    assert torch.isneginf(lse[:2]).all() and (o[:2] == 0).all() and lse[2:].isfinite().all()
    torch.testing.assert_close(o.double(), o_ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), lse_ref, atol=2e-5, rtol=2e-5)
