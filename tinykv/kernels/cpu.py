"""Fused CPU kernels for the paged, quantized KV cache, JIT-compiled with Numba: dequant-attention
here, quantize-on-store in kernels_cpu_store.py, their shared numerics in kernels_cpu_ops.py; the
signatures are the torch references' in kernels.py (read them first).

Attention reads each K/V block once, in its stored format, dequantizes 16 tokens at a time into an
L1 tile with the one formula x = (code - zero) * scale (`_dq`), and lets all n_rep query heads of
the KV head use the tile. Work items (query, KV head, split of its blocks) run in parallel (prange)
and merge by log-sum-exp, so one long sequence uses every thread. Numba has no float16 on the CPU:
fp16, bf16 and fp8 travel as integer bits, converted in-kernel. Formats are integers in a `meta`
array, so every format shares one compiled specialization per kernel: the first run compiles for
~13 s CPU (attention) and ~2 s (store); Numba caches the machine code beside this file.

Speed (2-vCPU Xeon, default model, 4k context, one layer): ~0.9 ms for fp16, int8 and int4 alike
(torch reference ~2 ms), so the formats' byte savings stop showing: the kernel is bound by float32
FMAs (3 query heads x (QK + PV) x 64 channels a key, 256-bit vectors) and per-key overheads (a
horizontal sum per score, D = 64 loops of 2 vector steps), not by memory.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .cpu_numerics import (
    _FM,
    AVAILABLE,
    BF16,
    F16,
    F32,
    FP8,
    I8,
    REASON,
    U4,
    U8,
    _c,
    _dq,
    _exp,
    _fp8,
    _half,
    _load,
    _pool,
    _prefetch,
    njit,
    numba,
    prange,
)
from .cpu_store import quantize_store_cpu  # noqa: F401  (the store, beside attention)
from .layout import PoolLayer
from .reference import merge_stacked, paged_attention_ref

TILE = 16  # tokens dequantized at a time: the K and V tiles stay in L1
# Rows with more queries (prefill chunks) go to the reference: measured at the default model's
# shapes, the kernel wins up to 4 queries at 1k context (8 at 4k), the reference's flash path
# beyond (64 queries at 4k: 87 ms here, 26 ms there), as it reads the row once for all queries.
CHUNK_MAX = 4


@njit(cache=True, fastmath=_FM, inline="always")  # a call would pay refcounts per tile
def _dequant(pool, blk, h, t0, nt, out, out3, srow, zrow):
    """Tokens t0 .. t0+nt of block blk, head h -> out (rows, D) float32, read in stored format;
    out3 is out as (rows, G, D // G); srow, zrow (D,) hold a scale row shared by the tokens.
    Every index runs from 0 up, so LLVM drops numba's negative-index fix-up and vectorizes."""
    d8, d16, d32, s16, s32, z16, z32, meta = pool  # data as rows (NB * H * BS, D // per_byte)
    fmt, kind, dp = meta[0], meta[1], meta[6]
    for t in range(nt):
        row = blk * meta[7] + h * meta[8] + t0 + t
        if fmt == F32:
            for c in range(dp):
                out[t, c] = d32[row, c]
        elif fmt == F16 or fmt == BF16:
            for c in range(dp):
                out[t, c] = _half(d16[row, c], fmt)
        elif fmt == FP8:
            for c in range(dp):
                out[t, c] = _fp8(d8[row, c])
        elif fmt == I8:
            for c in range(dp):
                out[t, c] = np.float32(np.int8(d8[row, c]))  # int8 codes arrive as uint8
        elif fmt == U8:
            for c in range(dp):
                out[t, c] = np.float32(d8[row, c])
        elif fmt == U4:  # element 2i + j of a row sits at bit 4j of byte i
            for c in range(dp):
                b = np.uint32(d8[row, c])
                out[t, 2 * c] = np.float32(b & 15)
                out[t, 2 * c + 1] = np.float32(b >> 4)
        else:
            for c in range(dp):
                b = np.uint32(d8[row, c])
                out[t, 4 * c] = np.float32(b & 3)
                out[t, 4 * c + 1] = np.float32((b >> 2) & 3)
                out[t, 4 * c + 2] = np.float32((b >> 4) & 3)
                out[t, 4 * c + 3] = np.float32(b >> 6)
    if fmt <= BF16:
        return
    G, gs, has_zero, offset = meta[4], meta[5], meta[2], np.float32(meta[3]) / np.float32(2)
    sb, sst, ssg = blk * meta[9] + h * meta[10] + t0 * meta[11], meta[11], meta[12]
    if sst == 0:  # one scale row for all tokens (block-wise, static): expand it per channel
        for g in range(G):
            s = _load(s16, s32, kind, sb + g * ssg)
            z = _load(z16, z32, kind, sb + g * ssg) if has_zero else offset
            for c in range(g * gs, g * gs + gs):
                srow[c] = s
                zrow[c] = z
        for t in range(nt):
            for c in range(out.shape[1]):
                out[t, c] = _dq(out[t, c], zrow[c], srow[c])
    else:  # per-token (and per-group) scales
        for t in range(nt):
            for g in range(G):
                s = _load(s16, s32, kind, sb + t * sst + g * ssg)
                z = _load(z16, z32, kind, sb + t * sst + g * ssg) if has_zero else offset
                for c in range(gs):
                    out3[t, g, c] = _dq(out3[t, g, c], z, s)


@njit(cache=True, fastmath=_FM)
def _attend(qh, row, n_keys, lo, hi, h, kp, vp, BS, sm_scale, acc, m, l):
    """The n_rep query heads qh (R, D) of KV head h over blocks lo..hi of table row `row`: online
    softmax into acc (R, D) (unnormalized), m (R,) running max and l (R,) sum of exp(score - m)."""
    R, D = qh.shape
    tile = min(BS, TILE)
    rows = (tile + 3) // 4 * 4  # keys go 4 at a time; rows past a tile's end hold zeros
    qs = np.empty((R, D), np.float32)  # queries times sm_scale
    for r in range(R):
        for d in range(D):
            qs[r, d] = qh[r, d] * sm_scale
    kb = np.zeros((rows, D), np.float32)  # keys of the tile
    vb = np.zeros((rows, D), np.float32)  # values of the tile
    kb3 = kb.reshape(rows, kp[7][4], D // kp[7][4])  # (rows, G, D // G) for group scales
    vb3 = vb.reshape(rows, vp[7][4], D // vp[7][4])
    sc = np.zeros((R, rows), np.float32)  # scores, then probabilities
    srow = np.empty(D, np.float32)
    zrow = np.empty(D, np.float32)
    for j in range(lo, hi):
        blk = row[j]
        if blk < 0:  # not in this pool
            continue
        nxt = row[j + 1] if j + 1 < hi else -1
        for w in range(2 if nxt >= 0 else 0):  # start reading the next block's K and V now
            d8, meta = (kp, vp)[w][0], (kp, vp)[w][7]  # d8: every pool's data as bytes
            first = (nxt * meta[7] + h * meta[8]) * d8.shape[1]
            for e in range(first, first + BS * d8.shape[1], 64):
                _prefetch(d8, e)
        for t0 in range(0, min(BS, n_keys - j * BS), tile):
            nt = min(tile, n_keys - j * BS - t0)
            n4 = (nt + 3) // 4 * 4
            for w in range(2):  # K, then V: one inlined copy of _dequant serves both
                _dequant((kp, vp)[w], blk, h, t0, nt, (kb, vb)[w], (kb3, vb3)[w], srow, zrow)
            for t in range(nt, n4):  # a partial tile: zero keys, values and (below) probabilities
                kb[t] = 0.0
                vb[t] = 0.0
            for r in range(R):
                for t in range(0, n4, 4):  # 4 keys per pass over q: independent sums, fewer loads
                    s0 = s1 = s2 = s3 = np.float32(0.0)
                    for d in range(D):
                        s0 += qs[r, d] * kb[t, d]
                        s1 += qs[r, d] * kb[t + 1, d]
                        s2 += qs[r, d] * kb[t + 2, d]
                        s3 += qs[r, d] * kb[t + 3, d]
                    sc[r, t], sc[r, t + 1], sc[r, t + 2], sc[r, t + 3] = s0, s1, s2, s3
                mx = m[r]
                for t in range(nt):
                    mx = max(mx, sc[r, t])
                alpha = _exp(m[r] - mx)
                psum = np.float32(0.0)
                for t in range(nt):
                    p = _exp(sc[r, t] - mx)
                    sc[r, t] = p
                    psum += p
                for t in range(nt, n4):
                    sc[r, t] = 0.0
                l[r] = l[r] * alpha + psum
                m[r] = mx
                if alpha != 1.0:
                    for d in range(D):
                        acc[r, d] *= alpha
                for t in range(0, n4, 4):  # the acc row is loaded and stored once per 4 values
                    p0, p1, p2, p3 = sc[r, t], sc[r, t + 1], sc[r, t + 2], sc[r, t + 3]
                    for d in range(D):
                        acc[r, d] += (p0 * vb[t, d] + p1 * vb[t + 1, d]
                                      + p2 * vb[t + 2, d] + p3 * vb[t + 3, d])

@njit(parallel=True, cache=True)
def _attn_kernel(q, q_seq, q_pos, table, ctx_lens, kp, vp, n_rep, BS, sm_scale, o, lse):
    """Work items (query n, KV head h, split sp) in parallel, each over the sp-th share of the
    query's visible blocks into o[sp, n] (S, N, Hq, D) and lse[sp, n] (S, N, Hq), as partials."""
    n_split, N, Hq, D = o.shape
    H = Hq // n_rep
    for item in prange(n_split * N * H):
        i = np.int64(item)  # parfors may hand out an unsigned index: keep the arithmetic signed
        n, h, sp = i // (H * n_split), i // n_split % H, i % n_split
        b = q_seq[n]
        n_keys = min(q_pos[n] + 1, ctx_lens[b])  # causal: keys 0 .. n_keys-1 are visible
        n_blk = min((n_keys + BS - 1) // BS, table.shape[1])
        per = (n_blk + n_split - 1) // n_split
        lo, hi = sp * per, min(sp * per + per, n_blk)
        acc = np.zeros((n_rep, D), np.float32)  # unnormalized sum of p * v
        m = np.full(n_rep, -np.inf, np.float32)  # max score
        l = np.zeros(n_rep, np.float32)  # sum of exp(score - m)
        if lo < hi:
            qh = q[n, h * n_rep:h * n_rep + n_rep]
            _attend(qh, table[b], n_keys, lo, hi, h, kp, vp, BS, sm_scale, acc, m, l)
        for r in range(n_rep):  # loops, not slice assignment: no broadcasting code to compile
            seen = l[r] > 0  # else no key: o 0, lse -inf
            lse[sp, n, h * n_rep + r] = m[r] + math.log(l[r]) if seen else -np.inf
            for d in range(D):
                o[sp, n, h * n_rep + r, d] = acc[r, d] / l[r] if seen else 0.0


def paged_attention_cpu(q: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor, k: PoolLayer,
                        v: PoolLayer, block_table: torch.Tensor, ctx_lens: torch.Tensor,
                        sm_scale: float, num_splits: int | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_attention_ref, fused on the CPU: K/V are read once per query group, dequantized in
    L1 tiles. A row with more than CHUNK_MAX queries (a prefill chunk) goes to the reference.
    num_splits: shares of a query's blocks taken by separate items (default: 4 items a thread)."""
    assert AVAILABLE, REASON
    (N, Hq, D), (B, MB), (H, BS) = q.shape, block_table.shape, k.data.shape[1:3]
    assert Hq % H == 0 and q_seq.shape == q_pos.shape == (N,) and ctx_lens.shape == (B,)
    seq = _c(q_seq, np.int64)
    counts = np.bincount(seq, minlength=B)  # queries per row
    if N and counts.max() > CHUNK_MAX:
        chunk = torch.from_numpy(counts[seq] > CHUNK_MAX)  # (N,) queries of prefill chunks
        rows = torch.from_numpy(counts > CHUNK_MAX)
        remap = torch.cumsum(rows, 0) - 1  # row of block_table[rows] for each chunk row
        o = torch.zeros(N, Hq, D)
        lse = torch.full((N, Hq), float("-inf"))
        o[chunk], lse[chunk] = paged_attention_ref(
            q[chunk], remap[q_seq[chunk].long()], q_pos[chunk], k, v, block_table[rows],
            ctx_lens[rows], sm_scale)
        if not bool(chunk.all()):
            o[~chunk], lse[~chunk] = paged_attention_cpu(
                q[~chunk], q_seq[~chunk], q_pos[~chunk], k, v, block_table, ctx_lens, sm_scale,
                num_splits)
        return o, lse
    # numba's pool follows torch's thread count (--threads), never every core
    numba.set_num_threads(min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if num_splits is None:  # items for every thread (a split costs a merge: none for 1 thread)
        threads = numba.get_num_threads()
        num_splits = 1 if threads == 1 else max(1, min(-(-4 * threads // max(N * H, 1)), MB))
    o = np.empty((num_splits, N, Hq, D), np.float32)
    lse = np.empty((num_splits, N, Hq), np.float32)
    _attn_kernel(q.float().contiguous().numpy(), seq, _c(q_pos, np.int64),
                 _c(block_table, np.int32), _c(ctx_lens, np.int64), _pool(k, H, BS, D),
                 _pool(v, H, BS, D), Hq // H, BS, np.float32(sm_scale), o, lse)
    o, lse = torch.from_numpy(o), torch.from_numpy(lse)
    if num_splits > 1:
        return merge_stacked(o, lse)
    return o[0], lse[0]
