"""Random paged K/V pools and query batches, stored as the cache stores them (shared by kernel
tests)."""

import torch

from tinykv.kernels import PoolLayer
from tinykv.quant import compute_scales, quantize
from tinykv.spec import QuantParams

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NB = 24  # physical blocks per pool


def make_pool(spec: str, H: int, BS: int, D: int, gen: torch.Generator) -> PoolLayer:
    """A pool of NB random blocks stored as the cache stores them: per-token/group scales per slot,
    block-wise scales per block, static scales computed over the whole pool (shape
    (1, H|1, 1, G))."""
    p = QuantParams.parse(spec)
    channel_scale = 1 + torch.rand(1, 1, 1, D, generator=gen) * 3
    x = torch.randn(NB, H, BS, D, generator=gen) * channel_scale  # (NB, H, BS, D)
    x += torch.randn(1, H, 1, D, generator=gen)  # channel offsets, as real keys have
    if p.is_float:
        return PoolLayer(x.to(p.storage_dtype).to(DEV), None, None, p)
    if p.static:
        s, z = compute_scales(x.transpose(0, 1).flatten(1, 2), p, torch.float32)  # (H|1, 1, G)
        s, z = s.unsqueeze(0), None if z is None else z.unsqueeze(0)
    else:
        s, z = compute_scales(x, p)  # (NB, H|1, BS|1, G)
    q, _ = quantize(x, p, s, z)
    return PoolLayer(q.to(DEV), s.to(DEV), None if z is None else z.to(DEV), p)


def make_batch(BS: int, Hq: int, D: int, gen: torch.Generator, q_dtype=torch.float32):
    """Rows with context 1, BS-1, BS+1 (a causal chunk of 3 queries), 5 blocks with a -1 hole, and
    a row held entirely elsewhere (all -1). q is a strided view, as a slice of a fused qkv would
    be."""
    ctx = [1, BS - 1, BS + 1, 4 * BS + 5, 2 * BS]
    ids = torch.randperm(NB, generator=gen).tolist()
    table = torch.full((5, 5), -1, dtype=torch.int32)
    for b, n in enumerate(ctx[:4]):
        for j in range(-(-n // BS)):
            table[b, j] = ids.pop()
    table[3, 1] = -1
    q_seq = torch.tensor([0, 1, 2, 2, 2, 3, 4])
    q_pos = torch.tensor([0, BS - 2, BS - 2, BS - 1, BS, 4 * BS + 4, 2 * BS - 1])
    qkv = torch.randn(len(q_seq), 2 * Hq, D, generator=gen).to(q_dtype)
    return (qkv[:, :Hq].to(DEV), q_seq.to(DEV), q_pos.to(DEV), table.to(DEV),
            torch.tensor(ctx, dtype=torch.int32, device=DEV))


# (k spec, v spec, n_rep, head_dim, block size): every format, granularity and shape at least once.
ATTN_CASES = [
    ("fp32", "fp32", 1, 64, 16),
    ("fp16", "bf16", 3, 80, 32),
    ("int8", "int8", 4, 128, 16),  # per-token scales
    # KIVI: per-channel-per-block keys, group values
    ("int4:channel:asym", "int4:g32:asym", 8, 64, 64),
    ("int2:asym", "int2:g16", 3, 64, 16),
    ("fp8", "fp8:token", 4, 80, 16),  # block-wise (NB, 1, 1, 1) and per-token fp8 scales
    # static (1, H, 1, 1) and (1, 1, 1, 1)
    ("int8:head:static", "int4:tensor:static:asym", 1, 128, 32),
    ("int4:channel:static", "fp16", 8, 80, 16),
    ("int8:g16:asym", "fp8:head", 3, 128, 64),
    ("int2:channel:asym", "int8:asym", 1, 80, 32),
    ("fp8:tensor:static", "int4", 4, 64, 16),
]
