"""The torch reference attention (kernels.paged_attention_ref) against plain float64 math.

paged_attention_ref batches: decoding rows attend together through one matmul, and multi-query
rows (prefill chunks) go through torch's flash attention. Here every block is dequantized whole
(quant.dequantize) and each query attends alone, in float64, over an explicit list of keys.
"""

import pytest
import torch
from pools import ATTN_CASES, DEV, make_batch, make_pool

from tinykv.kernels import PoolLayer
from tinykv.kernels.reference import paged_attention_ref
from tinykv.quant import dequantize


def dense(pool: PoolLayer) -> torch.Tensor:
    """Every block of the pool dequantized in float64: (NB, H, BS, D)."""
    NB, H, BS, _ = pool.data.shape

    def full(t: torch.Tensor | None) -> torch.Tensor | None:
        """Scales (NB|1, H|1, BS|1, G) expanded to every block, head and row: (NB, H, BS, G)."""
        return None if t is None else t.expand(NB, H, BS, t.shape[-1]).cpu()

    return dequantize(pool.data.cpu(), pool.p, full(pool.scale), full(pool.zero),
                      out_dtype=torch.float64)


def attention_f64(q, q_seq, q_pos, k, v, table, ctx, sm):
    """paged_attention_ref's arguments -> (o, lse) in float64 on the CPU, one query and head at a
    time."""
    q, q_seq, q_pos, table, ctx = (t.cpu() for t in (q, q_seq, q_pos, table, ctx))
    K, V = dense(k), dense(v)
    BS, n_rep = K.shape[2], q.shape[1] // K.shape[1]
    o = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for i in range(q.shape[0]):
        b, pos = int(q_seq[i]), int(q_pos[i])
        visible = range(min(pos + 1, int(ctx[b])))  # causal, and within the row's context
        keys = [(int(table[b, t // BS]), t % BS) for t in visible if table[b, t // BS] >= 0]
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
    # queries 0, 1, 5, 6 are those of rows 0, 1, 3, 4, one each: the all-decoding path alone
    decode = torch.tensor([0, 1, 5, 6])
    rows = [0, 1, 3, 4]
    cases = [(q, q_seq, q_pos, table, ctx),  # mixed: decoding rows beside a 3-query chunk
             (q[decode], torch.arange(4, device=DEV), q_pos[decode], table[rows], ctx[rows])]
    for args in cases:
        o, lse = paged_attention_ref(*args[:3], k, v, *args[3:], D**-0.5)
        o_ref, lse_ref = attention_f64(*args[:3], k, v, *args[3:], D**-0.5)
        assert o.dtype == torch.float32 and torch.isneginf(lse[-1]).all()
        assert_close_f64(o, lse, o_ref, lse_ref)


def assert_close_f64(o, lse, o_ref, lse_ref):
    """The reference's outputs (on the pools' device) against attention_f64's."""
    torch.testing.assert_close(o.double().cpu(), o_ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double().cpu(), lse_ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("spec", ["fp16", "int8", "int4:asym", "fp8", "int2"])
def test_reference_long_runs_of_blocks(spec):
    """A long run of consecutive blocks (one sequence in a fresh pool), in order and reversed."""
    gen = torch.Generator().manual_seed(5)
    BS, D = 16, 64
    k, v = make_pool(spec, 2, BS, D, gen), make_pool(spec, 2, BS, D, gen)
    for ids in (range(3, 23), range(20, 0, -1)):
        table = torch.tensor([list(ids)], dtype=torch.int32, device=DEV)
        ctx = torch.tensor([20 * BS - 3], dtype=torch.int32, device=DEV)
        q = torch.randn(1, 6, D, generator=gen).to(DEV)
        q_seq, q_pos = torch.zeros(1, dtype=torch.long, device=DEV), ctx - 1
        o, lse = paged_attention_ref(q, q_seq, q_pos, k, v, table, ctx, D**-0.5)
        o_ref, lse_ref = attention_f64(q, q_seq, q_pos, k, v, table, ctx, D**-0.5)
        assert_close_f64(o, lse, o_ref, lse_ref)


def test_reference_chunk_that_sees_no_key_here():
    """A prefill chunk whose visible keys all live in the other pool (a sink block, say): o 0,
    lse -inf."""
    gen = torch.Generator().manual_seed(9)
    BS, D = 16, 64
    k, v = make_pool("int8", 2, BS, D, gen), make_pool("fp16", 2, BS, D, gen)
    table = torch.tensor([[-1, 4]], dtype=torch.int32, device=DEV)
    ctx = torch.tensor([20], dtype=torch.int32, device=DEV)
    q = torch.randn(4, 4, D, generator=gen).to(DEV)
    q_seq = torch.zeros(4, dtype=torch.long, device=DEV)
    q_pos = torch.tensor([0, 1, 16, 19], device=DEV)
    o, lse = paged_attention_ref(q, q_seq, q_pos, k, v, table, ctx, D**-0.5)
    o_ref, lse_ref = attention_f64(q, q_seq, q_pos, k, v, table, ctx, D**-0.5)
    assert torch.isneginf(lse[:2]).all() and (o[:2] == 0).all() and lse[2:].isfinite().all()
    assert_close_f64(o, lse, o_ref, lse_ref)
