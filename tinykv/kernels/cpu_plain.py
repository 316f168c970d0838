"""The plain fused CPU attention kernel (numba): the readable statement of how the CPU reads a
paged, quantized KV pool in one pass, and the kernel for the formats the vector kernel does not
take. reference.paged_attention_ref says what is computed; cpu.py picks a kernel and shares work.

How a key's bytes become a score without a dequantized copy of the key:
- The scale comes out of the dot product: with x = (code - zero) * scale per token (or group),
  q . x = scale * (q . code - zero * sum(q)). The kernel dots the query with the raw codes.
- Integer codes dot an int16 copy of the query, so products and sums are exact integers (LLVM
  turns such loops into multiply-add-pairs instructions). Rounding the query to int16 is the one
  error this adds: at most half a step per channel, step = max |q| / 32767.
- Scales that a block's keys share (per-channel keys, as KIVI stores them; static scales) are
  folded into the query once per block instead: q . x = (q * scale) . code - (q * scale) . zero.
- Packed int4/int2 codes are read in stored order: byte i holds channels 2i and 2i+1 (int4), so
  the query is permuted once into code planes (even channels, odd channels) and plane j of the
  query dots bits 4j.. of the bytes.
- Values the same way: sum_t p_t x_t = sum_t (p_t scale_t) code_t - sum_t p_t scale_t zero_t.
- All query heads of a KV head use each key while it is in L1; the next block is prefetched.

Shapes: a row of codes is (groups, per) stored elements (a group shares a per-token scale; one
group for other formats); the query and value sums are (R, planes, groups, per): plane j of
element i of group g is channel planes * (g * per + i) + j. Indices run from 0 up, so LLVM can
drop numba's negative-index fix-up and vectorize the loops over i.

Scores are base 2 (the query is scaled by log2 e), the softmax online per block, so a query's
blocks can be split between threads and merged by log-sum-exp. One kernel is compiled per pair
of K and V formats (`attention_kernel`), each format's branches resolved then, never per key.
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import numpy as np

from .cpu_args import (
    SHARED_SCALES,
    TOKEN_SCALES,
    PoolFormat,
    float_code,
    int_code,
    number,
    planes,
    zero_point,
)
from .cpu_numerics import (
    FAST,
    INTEGER,
    LN2,
    LOG2E,
    exp2,
    kernel,
    load_scale,
    njit,
    prange,
    prefetch,
)

Q16_MAX = np.float32(32767.0)  # the int16 query's largest code


class Workspace(NamedTuple):
    """One worker's scratch, reused by its items. K side (R, planes, groups, per) as K's rows are
    stored; V side as V's."""
    q_base: np.ndarray  # the query heads times sm_scale * log2 e
    q_fold: np.ndarray  # q_base times a block's shared key scales
    q16: np.ndarray  # int16: q_base or q_fold rounded, for integer keys
    q_step: np.ndarray  # (R,) q ~ q16 * q_step
    q_group: np.ndarray  # (R, groups) the sum of q16 over each scale group
    k_bias: np.ndarray  # (R,) q16 . zero points of a block with shared key scales
    scores: np.ndarray  # (R, BS) a block's scores, then its probabilities
    acc: np.ndarray  # V side: sum of p * scale * code over the values seen
    z_acc: np.ndarray  # (R, groups of V) sum of p * scale * zero: subtracted at the end
    v_block: np.ndarray  # V side: sum of p * code over a block with shared value scales
    m: np.ndarray  # (R,) running max score
    l: np.ndarray  # (R,) sum of 2^(score - m)


@njit(forceinline=True)
def workspace(R, BS, k_shape, v_shape):
    """A worker's Workspace, for R query heads, blocks of BS and the two sides' shapes."""
    f32 = np.float32
    k_shape, v_shape = (R, *k_shape), (R, *v_shape)
    return Workspace(q_base=np.empty(k_shape, f32), q_fold=np.empty(k_shape, f32),
                     q16=np.empty(k_shape, np.int16), q_step=np.empty(R, f32),
                     q_group=np.empty((R, k_shape[2]), f32), k_bias=np.empty(R, f32),
                     scores=np.empty((R, BS), f32), acc=np.empty(v_shape, f32),
                     z_acc=np.empty((R, v_shape[2]), f32), v_block=np.zeros(v_shape, f32),
                     m=np.empty(R, f32), l=np.empty(R, f32))


# ---- the query: once per item, or once per block where a block's keys share their scales -----

@njit(forceinline=True)
def _query_planes(q_heads, factor, out):
    """out[r, j, g, i] = q[r, channel of (j, g, i)] * factor: the query in stored order."""
    R, pb, G, per = out.shape
    for r in range(R):
        for j in range(pb):
            for g in range(G):
                for i in range(per):
                    out[r, j, g, i] = q_heads[r, pb * (g * per + i) + j] * factor


@njit(forceinline=True)
def fold_scales(kf, k, blk, h, ws):
    """q_fold = q_base times the channel scales a block (or the layer) shares; for integer keys
    rounded to int16 too, with k_bias the part of each key's dot product its zero points make."""
    scales, zeros, block_stride, head_stride, group_stride, gs = k[1], k[2], k[3], k[4], k[6], k[7]
    R, pb, _, per = ws.q_base.shape  # one group: shared scales are no per-token groups
    at = blk * block_stride + h * head_stride
    for j in range(pb):
        for i in range(per):
            s = load_scale(scales, kf.scale_code, at + (pb * i + j) // gs * group_stride)
            for r in range(R):
                ws.q_fold[r, j, 0, i] = ws.q_base[r, j, 0, i] * s
    if kf.code != INTEGER:
        return
    _to_int16(ws.q_fold, ws.q16, ws.q_step)
    for r in range(R):
        bias = np.float32(0.0)
        for j in range(pb):
            for i in range(per):
                zero = zero_point(kf, zeros, at + (pb * i + j) // gs * group_stride)
                bias += np.float32(ws.q16[r, j, 0, i]) * zero
        ws.k_bias[r] = bias


@njit(forceinline=True)
def _to_int16(q_float, q16, q_step):
    """q_float ~ q16 * q_step[r]: each head rounded to int16 at its own step."""
    R = q_float.shape[0]
    for r in range(R):
        x, y = q_float[r].reshape(-1), q16[r].reshape(-1)
        amax = np.float32(0.0)
        for e in range(x.shape[0]):
            amax = max(amax, abs(x[e]))
        step = amax / Q16_MAX if amax > 0 else np.float32(1.0)
        q_step[r] = step
        inv = np.float32(1.0) / step  # as the vector kernel rounds: times the reciprocal
        for e in range(x.shape[0]):
            y[e] = np.int16(np.rint(x[e] * inv))


@njit(forceinline=True)
def _group_sums(q16, out):
    """out[r, g] = the sum of q16 over scale group g."""
    R, pb, G, per = q16.shape
    for r in range(R):
        for g in range(G):
            total = np.int32(0)
            for j in range(pb):
                for i in range(per):
                    total += np.int32(q16[r, j, g, i])
            out[r, g] = np.float32(total)


# ---- one block --------------------------------------------------------------------------------

@njit(forceinline=True)
def _key_scores(kf, k, first_row, blk, h, nt, ws):
    """ws.scores[r, t] = base-2 score of query head r on key t of the block."""
    codes, scales, zeros, block_stride, head_stride, token_stride, group_stride, _ = k
    R, pb, G, per = ws.q16.shape
    q = ws.q_fold if kf.scales == SHARED_SCALES else ws.q_base
    for t in range(nt):
        row = first_row + t
        s_at = blk * block_stride + h * head_stride + t * token_stride
        for r in range(R):
            score = np.float32(0.0)
            for g in range(G):
                if kf.code == INTEGER:
                    dot = np.int32(0)
                    for j in range(pb):
                        for i in range(per):
                            code = int_code(codes, row, g, i, j, kf.bits)
                            dot = np.int32(dot + np.int32(ws.q16[r, j, g, i]) * code)
                    if kf.scales == TOKEN_SCALES:
                        at = s_at + g * group_stride
                        x = np.float32(dot) - zero_point(kf, zeros, at) * ws.q_group[r, g]
                        score += load_scale(scales, kf.scale_code, at) * x
                    else:
                        score += np.float32(dot) - ws.k_bias[r]
                else:
                    dot = np.float32(0.0)
                    for i in range(per):
                        dot += q[r, 0, g, i] * float_code(kf.code, codes, row, g, i)
                    if kf.scales == TOKEN_SCALES:
                        dot *= load_scale(scales, kf.scale_code, s_at + g * group_stride)
                    score += dot
            ws.scores[r, t] = score * ws.q_step[r] if kf.code == INTEGER else score


@njit(forceinline=True)
def _softmax_block(nt, ws):
    """Scores of nt keys -> 2^(score - m) with m the running max; what was summed under the old
    max is scaled to the new one."""
    R = ws.m.shape[0]
    for r in range(R):
        top = ws.m[r]
        for t in range(nt):
            top = max(top, ws.scores[r, t])
        alpha = exp2(ws.m[r] - top)  # ~0 for the first block (m = -inf)
        total = np.float32(0.0)
        for t in range(nt):
            p = exp2(ws.scores[r, t] - top)
            ws.scores[r, t] = p
            total += p
        ws.l[r] = ws.l[r] * alpha + total
        ws.m[r] = top
        if alpha != 1.0:
            _, pb, G, per = ws.acc.shape
            for j in range(pb):
                for g in range(G):
                    for i in range(per):
                        ws.acc[r, j, g, i] *= alpha
            for g in range(G):
                ws.z_acc[r, g] *= alpha


@njit(forceinline=True)
def _add_values(vf, v, first_row, blk, h, nt, ws):
    """acc += sum_t p_t * value_t over the block's nt keys, the scales factored out."""
    codes, scales, zeros, block_stride, head_stride, token_stride, group_stride, gs = v
    R, pb, G, per = ws.acc.shape
    at = blk * block_stride + h * head_stride
    sums = ws.v_block if vf.scales == SHARED_SCALES else ws.acc  # shared scales: after the block
    for t in range(nt):
        row = first_row + t
        for r in range(R):
            p = ws.scores[r, t]
            for g in range(G):
                w = p
                if vf.scales == TOKEN_SCALES:
                    s_at = at + t * token_stride + g * group_stride
                    w = p * load_scale(scales, vf.scale_code, s_at)
                    ws.z_acc[r, g] += w * zero_point(vf, zeros, s_at)
                for j in range(pb):
                    for i in range(per):
                        sums[r, j, g, i] += w * number(vf, codes, row, g, i, j)
    if vf.scales != SHARED_SCALES:
        return
    for r in range(R):  # acc += scale * (sum p code - zero * sum p), once per block
        p_sum = np.float32(0.0)
        for t in range(nt):
            p_sum += ws.scores[r, t]
        for j in range(pb):
            for i in range(per):
                s_at = at + (pb * i + j) // gs * group_stride
                x = ws.v_block[r, j, 0, i] - zero_point(vf, zeros, s_at) * p_sum
                ws.acc[r, j, 0, i] += load_scale(scales, vf.scale_code, s_at) * x
                ws.v_block[r, j, 0, i] = 0.0


# ---- one work item: a query's KV head over a run of its blocks ------------------------------

@njit(forceinline=True)
def _prefetch_rows(codes, first_row, n_rows):
    width = codes.shape[1] * codes.shape[2]
    for e in range(first_row * width, (first_row + n_rows) * width, 64 // codes.itemsize):
        prefetch(codes, e)


@njit(forceinline=True)
def _attend_item(kf, vf, q_heads, sm_scale, row, n_keys, lo, hi, h, H, BS, k, v, ws, o, lse):
    """Query heads q_heads (R, D) of KV head h over blocks lo..hi of table row `row` (keys
    0..n_keys-1 visible) -> o (R, D) and lse (R,): attention over those keys alone."""
    _query_planes(q_heads, sm_scale * LOG2E, ws.q_base)
    if kf.code == INTEGER and kf.scales != SHARED_SCALES:  # one rounding serves every block
        _to_int16(ws.q_base, ws.q16, ws.q_step)
        _group_sums(ws.q16, ws.q_group)
    ws.m[:] = -np.inf
    ws.l[:] = 0.0
    ws.acc[:] = 0.0
    ws.z_acc[:] = 0.0
    folded = False
    for j in range(lo, hi):
        blk = row[j]
        if blk < 0:  # the block is in another pool
            continue
        if j + 1 < hi and row[j + 1] >= 0:  # start reading the next block while this one is
            _prefetch_rows(k[0], (row[j + 1] * H + h) * BS, BS)  # read
            _prefetch_rows(v[0], (row[j + 1] * H + h) * BS, BS)
        if kf.scales == SHARED_SCALES and not (folded and k[3] == 0):  # static: fold once
            fold_scales(kf, k, blk, h, ws)
            folded = True
        nt = min(BS, n_keys - j * BS)
        first_row = (blk * H + h) * BS
        _key_scores(kf, k, first_row, blk, h, nt, ws)
        _softmax_block(nt, ws)
        _add_values(vf, v, first_row, blk, h, nt, ws)
    R, pb, G, per = ws.acc.shape
    for r in range(R):  # a head that saw no key: o 0, lse -inf
        seen = ws.l[r] > 0
        lse[r] = (ws.m[r] + np.log2(ws.l[r])) * LN2 if seen else -np.inf
        for j in range(pb):
            for g in range(G):
                for i in range(per):
                    x = (ws.acc[r, j, g, i] - ws.z_acc[r, g]) / ws.l[r]
                    o[r, pb * (g * per + i) + j] = x if seen else 0.0


@cache
def attention_kernel(kf: PoolFormat, vf: PoolFormat) -> tuple:
    """(serial, parallel) kernels for one pair of K and V formats, compiled on first call.

    Work item (query n, split s, KV head h), numbered in that order, attends over the s-th share
    of its blocks into o[s, n, heads of h] (S, N, Hq, D) and lse[s, n, ...] (S, N, Hq): partials
    to merge. serial takes items first..last-1; parallel shares all items between `workers`
    threads. The heads are innermost so that one thread reads a share's blocks for every head
    in turn: a block holds all heads, so the lines read ahead past one head's rows are the next
    head's (a thread whose run held one head's whole sequence read the rest later, from DRAM
    again)."""

    @kernel((kf, vf), fastmath=FAST, error_model="numpy")
    def attend_items(first, last, q, q_seq, q_pos, table, ctx_lens, k, v, H, BS, sm_scale, o,
                     lse):
        n_split, N, Hq, D = o.shape
        R = Hq // H
        ws = workspace(R, BS, (planes(kf), k[0].shape[1], k[0].shape[2]),
                        (planes(vf), v[0].shape[1], v[0].shape[2]))
        for item in range(first, last):
            n, split, h = item // (n_split * H), item // H % n_split, item % H
            b = q_seq[n]
            n_keys = min(q_pos[n] + 1, ctx_lens[b])  # causal: keys 0 .. n_keys-1 are visible
            n_blocks = min((n_keys + BS - 1) // BS, table.shape[1])
            per = (n_blocks + n_split - 1) // n_split
            lo, hi = split * per, min(split * per + per, n_blocks)
            heads = slice(h * R, h * R + R)
            _attend_item(kf, vf, q[n, heads], sm_scale, table[b], n_keys, lo, hi, h, H, BS, k,
                         v, ws, o[split, n, heads], lse[split, n, heads])

    @kernel((kf, vf), parallel=True, error_model="numpy")
    def attend_parallel(workers, q, q_seq, q_pos, table, ctx_lens, k, v, H, BS, sm_scale, o,
                        lse):
        n_items = o.shape[0] * o.shape[1] * H
        per = (n_items + workers - 1) // workers
        for w in prange(workers):
            first = np.int64(w) * per  # parfors may hand out an unsigned index
            attend_items(first, min(first + per, n_items), q, q_seq, q_pos, table, ctx_lens, k,
                         v, H, BS, sm_scale, o, lse)

    return attend_items, attend_parallel
