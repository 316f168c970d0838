"""The vector CPU attention kernel: cpu_plain's algorithm, step for step, with each step written
as LLVM vector operations (cpu_simd.py) instead of loops that the compiler may or may not
vectorize. cpu_plain is its readable twin; the tests hold the two to each other.

What changes from the plain kernel, per tile of 16 keys of one KV head:
- Scores: each key's products with all R query heads are one wide vector (R x D lanes; integer
  codes: int16 products summed in pairs, which LLVM turns into vpdpwssd), summed down to 16 lanes
  per head; then a transpose-and-add tree (`pair`, four steps) turns 16 such vectors into one
  vector of 16 scores per head, so no key pays a horizontal sum.
- Scales, zero points, the softmax (max, 2^x, sums) act on those 16 scores at once.
- Values: each key's codes are widened once to D float lanes (minus the zero point, times the
  scale where scales are per group or per block), then one multiply-add per 16 lanes and head
  adds them into R x D accumulators that stay in registers for the whole work item.

It takes fp16, int8, int4 and int2 stores (per-token scales, or scales a block shares; per-token
groups for values), blocks of a multiple of 16 tokens, and R x D up to 512 (the accumulators fill
the register file at 512); other pools go to the plain kernel. One kernel is compiled per
(K format, V format, R, D, groups): the lane counts are compile-time constants.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from .cpu_args import SHARED_SCALES, TOKEN_SCALES, PoolFormat
from .cpu_numerics import BFLOAT, FAST, HALF, INTEGER, LN2, LOG2E, kernel, njit, prange
from .cpu_simd import (
    code_planes,
    half_to_float,
    load,
    prefetch_lines,
    splat,
    store,
    to_float,
    to_int16,
)
from .cpu_simd_ops import (
    exp2,
    first_keys,
    head_dots,
    keys_major,
    log2,
    pair,
    repeat,
    round_int16,
    segment_absmax,
    segment_max,
    segment_sum,
    spread,
    stored_order,
    to_channel_order,
    to_stored_order,
    vmax,
    where_positive,
)

Q16_MAX = np.float32(32767.0)  # the int16 query's largest code (as cpu_plain)
TILE = 16  # keys scored together: one lane each in the score vector of a head


def takes(kf: PoolFormat, vf: PoolFormat, R: int, D: int, BS: int, k_groups: int) -> bool:
    """Whether the vector kernel reads these pools (else the plain kernel does): fp16 or integer
    codes (16 stored elements a piece), key scales per token or shared by the block, value scales
    any way, D a multiple of 16 (32 for integer keys), blocks a multiple of 16 tokens."""
    def stored(fmt: PoolFormat) -> bool:
        if fmt.code == HALF:
            return True
        return fmt.code == INTEGER and fmt.scale_code != BFLOAT and D // _planes(fmt) % 16 == 0
    key_ok = kf.code == HALF or (D % 32 == 0 and (kf.scales == SHARED_SCALES or k_groups == 1))
    return stored(kf) and stored(vf) and key_ok and D % 16 == 0 and BS % TILE == 0 \
        and R * D <= 512


def _planes(fmt: PoolFormat) -> int:
    """Codes per stored element (cpu_plain.planes, for Python)."""
    return 8 // fmt.bits if fmt.code == INTEGER else 1


def _scale_loader(code: int):
    """load(values, at, n) -> n consecutive scales (or zeros) as float32 lanes."""
    if code == HALF:
        @njit(forceinline=True)
        def scales(values, at, n):
            return half_to_float(load(values, at, n))
    else:
        @njit(forceinline=True)
        def scales(values, at, n):
            return load(values, at, n) * np.float32(1.0)
    return scales


def _key_reader(fmt: PoolFormat, R: int, D: int):
    """key(codes, row, q_all): a key's products with R query heads, summed to 16 lanes a head
    (int32 for integer codes: exact; float32 for fp16)."""
    width, bits = D // _planes(fmt), fmt.bits
    if fmt.code == HALF:
        @njit(forceinline=True)
        def key(codes, row, q_all):
            x = half_to_float(load(codes, row * width, D))  # (D,)
            return head_dots(x, q_all, R)
    elif fmt.bits == 8:
        @njit(forceinline=True)
        def key(codes, row, q_all):
            c16 = to_int16(load(codes, row * width, width))  # (D,)
            return head_dots(c16, q_all, R)
    else:
        @njit(forceinline=True)
        def key(codes, row, q_all):
            c16 = code_planes(load(codes, row * width, width), bits)  # (D,) stored order
            return head_dots(c16, q_all, R)
    return key


def _value_reader(fmt: PoolFormat, D: int, groups: int):
    """value(codes, row, scales, zeros, at, scale, zero): a value row as D float32 lanes in stored
    order: its codes less zero times scale where scales are per group (at: the token's first
    scale) or per block (scale, zero: (D,) lanes), the raw codes where the scale is per token
    (it goes into the weight) or absent (fp16)."""
    n_planes, bits = _planes(fmt), fmt.bits
    width, per = D // n_planes, D // groups // n_planes  # per: a group's run in one plane
    load_scales = _scale_loader(fmt.scale_code)
    by_group = fmt.scales == TOKEN_SCALES and groups > 1
    by_block = fmt.scales == SHARED_SCALES
    offset, has_zero = np.float32(fmt.offset), fmt.has_zero
    if fmt.code == HALF:
        @njit(forceinline=True)
        def codes_of(codes, row):
            return half_to_float(load(codes, row * width, D))
    elif bits == 8:
        @njit(forceinline=True)
        def codes_of(codes, row):
            return to_float(to_int16(load(codes, row * width, width)))
    else:
        @njit(forceinline=True)
        def codes_of(codes, row):
            return to_float(code_planes(load(codes, row * width, width), bits))

    @njit(forceinline=True)
    def value(codes, row, scales, zeros, at, scale, zero):
        x = codes_of(codes, row)
        if by_block:
            return (x - zero) * scale
        if not by_group:
            return x
        s = repeat(spread(load_scales(scales, at, groups), per), n_planes)
        if has_zero:
            return (x - repeat(spread(load_scales(zeros, at, groups), per), n_planes)) * s
        return (x - offset) * s
    return value


@cache
def vector_kernel(kf: PoolFormat, vf: PoolFormat, R: int, D: int, k_groups: int,
                  v_groups: int) -> tuple:
    """(serial, parallel) vector kernels for one pair of formats and shape (R query heads a KV
    head, D channels, scale groups of K and V); the arguments and work items are
    cpu_plain.attention_kernel's."""
    RD, R16 = R * D, R * TILE  # lanes: R heads x D channels, R heads x 16 keys
    k_int, v_token = kf.code == INTEGER, vf.scales == TOKEN_SCALES
    k_token, k_shared = kf.scales == TOKEN_SCALES, kf.scales == SHARED_SCALES
    v_shared = vf.scales == SHARED_SCALES
    k_has_zero, k_offset = kf.has_zero, np.float32(kf.offset)
    v_has_zero, v_offset = vf.has_zero, np.float32(vf.offset)
    token_weights = vf.code == INTEGER and v_token and v_groups == 1  # p * scale per key
    key, value = _key_reader(kf, R, D), _value_reader(vf, D, v_groups)
    k_scales16, v_scales16 = _scale_loader(kf.scale_code), _scale_loader(vf.scale_code)
    k_row, v_row = D // _planes(kf), D // _planes(vf)  # stored elements a row
    k_planes, v_planes = _planes(kf), _planes(vf)
    k_gs, v_gs = D // k_groups, D // v_groups  # channels per scale

    @njit(forceinline=True)
    def fold(q_base, k_scales, k_zeros, at):
        """A block's shared key scales folded into the query, rounded to int16: (q16, step per
        head, q16 . zero per head), as cpu_plain.fold_scales."""
        s = stored_order(k_scales16(k_scales, at, k_groups), k_planes, k_gs, D)  # (D,)
        if k_has_zero:
            z = stored_order(k_scales16(k_zeros, at, k_groups), k_planes, k_gs, D)
        else:
            z = splat(k_offset, D)
        q_fold = q_base * repeat(s, R)  # (R x D)
        step = vmax(segment_absmax(q_fold, D) * np.float32(1 / 32767), splat(1e-30, R))
        q16 = round_int16(q_fold * spread(np.float32(1.0) / step, D))
        return q16, step, segment_sum(to_float(q16) * repeat(z, R), D)

    @njit(forceinline=True)
    def block_scales(v_scales, v_zeros, at):
        """A block's shared value scales and zero points, one per channel (stored order)."""
        s = stored_order(v_scales16(v_scales, at, v_groups), v_planes, v_gs, D)
        if v_has_zero:
            return s, stored_order(v_scales16(v_zeros, at, v_groups), v_planes, v_gs, D)
        return s, splat(v_offset, D)

    if k_int:
        @njit(forceinline=True)
        def query(ws, q):
            """The query as R x D lanes: int16 for integer keys."""
            return load(ws.q16, 0, RD)

        @njit(forceinline=True)
        def as_float(dots):
            return to_float(dots)
    else:
        @njit(forceinline=True)
        def query(ws, q):
            """The query as R x D float32 lanes, for fp16 keys."""
            return load(q, 0, RD)

        @njit(forceinline=True)
        def as_float(dots):
            return dots

    @njit(forceinline=True)
    def tile_scores(codes, row, q_all):
        """(R x 16) float32 dot products of the R heads with keys row .. row + 15, by the tree:
        four steps of `pair` turn 16 vectors of 16 partial sums into 16 sums."""
        a = pair(pair(pair(key(codes, row, q_all), key(codes, row + 1, q_all), 16),
                      pair(key(codes, row + 2, q_all), key(codes, row + 3, q_all), 16), 8),
                 pair(pair(key(codes, row + 4, q_all), key(codes, row + 5, q_all), 16),
                      pair(key(codes, row + 6, q_all), key(codes, row + 7, q_all), 16), 8), 4)
        b = pair(pair(pair(key(codes, row + 8, q_all), key(codes, row + 9, q_all), 16),
                      pair(key(codes, row + 10, q_all), key(codes, row + 11, q_all), 16), 8),
                 pair(pair(key(codes, row + 12, q_all), key(codes, row + 13, q_all), 16),
                      pair(key(codes, row + 14, q_all), key(codes, row + 15, q_all), 16), 8), 4)
        return as_float(pair(a, b, 2))

    @njit(forceinline=True)
    def query(q, at, sm_scale):
        """The R query heads from q's flat element `at`, scaled to base-2 scores and in K's
        stored order: (q_all, q_base, q_sum, q_step) as cpu_plain.begin_item makes them."""
        q_base = to_stored_order(load(q, at, RD) * (sm_scale * LOG2E), k_planes, D)
        if k_int:  # rounded to int16, each head at its own step
            step = segment_absmax(q_base, D) / Q16_MAX
            step = where_positive(step, step, splat(1.0, R))
            q16 = round_int16(q_base * spread(np.float32(1.0) / step, D))
            return q16, q_base, segment_sum(to_float(q16), D), step
        return q_base, q_base, splat(0.0, R), splat(1.0, R)

    @njit(forceinline=True)
    def attend_item(q, q_at, sm_scale, row, n_keys, lo, hi, h, H, BS, k, v, buf, o, o_at, lse,
                    lse_at):
        """cpu_plain._attend_item in vectors: q and o at flat elements q_at, o_at (R x D), lse
        at lse_at (R,); buf holds (16, R) weights then the (R x D) value sums."""
        k_codes, k_scales, k_zeros, kb_stride, kh_stride, kt_stride = k[:6]
        v_codes, v_scales, v_zeros, vb_stride, vh_stride, vt_stride = v[:6]
        q_all, q_base, q_sum, q_step = query(q, q_at, sm_scale)
        m, l = splat(-np.inf, R), splat(0.0, R)
        z_acc = splat(0.0, R)  # sum of p * scale * zero (per-token value scales)
        store(buf, R16, splat(0.0, RD))  # the value sums stay in memory between tiles: scoring
        bias = splat(0.0, R)  # a tile has every register, and a tile loads them once
        v_scale, v_zero = splat(1.0, D), splat(0.0, D)
        k_lines = (BS * k_row * k_codes.itemsize + 63) // 64  # cache lines of a block's head
        v_lines = (BS * v_row * v_codes.itemsize + 63) // 64
        folded = False
        for j in range(lo, hi):
            blk = row[j]
            if blk < 0:  # the block is in another pool
                continue
            nxt = row[j + 1] if j + 1 < hi else -1
            if nxt >= 0:  # the next block's K and V start coming while this one is read
                prefetch_lines(k_codes, (nxt * H + h) * BS * k_row, k_lines)
                prefetch_lines(v_codes, (nxt * H + h) * BS * v_row, v_lines)
            if k_shared and not (folded and kb_stride == 0):  # static: fold once
                q_all, q_step, bias = fold(q_base, k_scales, k_zeros,
                                           blk * kb_stride + h * kh_stride)
                folded = True
            if v_shared:
                v_scale, v_zero = block_scales(v_scales, v_zeros, blk * vb_stride + h * vh_stride)
            first_row = (blk * H + h) * BS
            for t0 in range(0, min(BS, n_keys - j * BS), TILE):
                nt = min(TILE, n_keys - j * BS - t0)
                score = tile_scores(k_codes, first_row + t0, q_all)  # (R x 16)
                if k_int and k_token:  # score = scale * (q . code - zero * sum q)
                    s_at = blk * kb_stride + h * kh_stride + t0 * kt_stride
                    z16 = k_scales16(k_zeros, s_at, TILE) if k_has_zero else \
                        splat(k_offset, TILE)
                    score = (score - repeat(z16, R) * spread(q_sum, TILE)) * \
                        repeat(k_scales16(k_scales, s_at, TILE), R)
                if k_int:
                    score = (score - spread(bias, TILE)) * spread(q_step, TILE)
                score = first_keys(score, nt, -np.inf)  # keys past the row's end weigh 0
                top = vmax(m, segment_max(score, TILE))
                alpha = exp2(m - top)
                p = exp2(score - spread(top, TILE))  # (R x 16)
                l = l * alpha + segment_sum(p, TILE)
                m = top
                z_acc = z_acc * alpha
                v_at = blk * vb_stride + h * vh_stride + t0 * vt_stride
                if token_weights:  # sum p (code - zero) scale = sum (p scale) code - ...
                    p = p * repeat(v_scales16(v_scales, v_at, TILE), R)
                    vz = repeat(v_scales16(v_zeros, v_at, TILE), R) if v_has_zero else \
                        splat(v_offset, R16)
                    z_acc = z_acc + segment_sum(p * vz, TILE)
                store(buf, 0, keys_major(p))  # (16, R): a key's weights, read back by key
                acc = load(buf, R16, RD) * spread(alpha, D)
                for t in range(nt):
                    x = value(v_codes, first_row + t0 + t, v_scales, v_zeros, v_at + t * vt_stride,
                              v_scale, v_zero)  # (D,)
                    acc = acc + spread(load(buf, t * R, R), D) * repeat(x, R)
                store(buf, R16, acc)
        out = (load(buf, R16, RD) - spread(z_acc, D)) * spread(np.float32(1.0) / l, D)
        store(o, o_at, where_positive(spread(l, D), to_channel_order(out, v_planes, D),
                                      splat(0.0, RD)))
        store(lse, lse_at, where_positive(l, (m + log2(l)) * LN2, splat(-np.inf, R)))

    @kernel((kf, vf, R, D, k_groups, v_groups), fastmath=FAST, error_model="numpy")
    def attend_items(first, last, q, q_seq, q_pos, table, ctx_lens, k, v, H, BS, sm_scale, o,
                     lse):
        n_split, N, Hq, _ = o.shape
        buf = np.empty(R16 + RD, np.float32)  # weights of a tile, value sums
        for item in range(first, last):
            n, h, split = item // (H * n_split), item // n_split % H, item % n_split
            b = q_seq[n]
            n_keys = min(q_pos[n] + 1, ctx_lens[b])  # causal: keys 0 .. n_keys-1 are visible
            n_blocks = min((n_keys + BS - 1) // BS, table.shape[1])
            per = (n_blocks + n_split - 1) // n_split
            lo, hi = split * per, min(split * per + per, n_blocks)
            heads = (split * N + n) * Hq + h * R  # the first of the item's query heads
            attend_item(q, (n * Hq + h * R) * D, sm_scale, table[b], n_keys, lo, hi, h, H, BS,
                        k, v, buf, o, heads * D, lse, heads)

    @kernel((kf, vf, R, D, k_groups, v_groups), parallel=True, error_model="numpy")
    def attend_parallel(workers, q, q_seq, q_pos, table, ctx_lens, k, v, H, BS, sm_scale, o,
                        lse):
        n_items = o.shape[0] * o.shape[1] * H
        per = (n_items + workers - 1) // workers
        for w in prange(workers):
            first = np.int64(w) * per  # parfors may hand out an unsigned index
            attend_items(first, min(first + per, n_items), q, q_seq, q_pos, table, ctx_lens, k,
                         v, H, BS, sm_scale, o, lse)

    return attend_items, attend_parallel
