"""The vector CPU attention kernel: cpu_plain's algorithm, step for step, with each step written
as LLVM vector operations (cpu_simd.py) instead of loops that the compiler may or may not
vectorize. cpu_plain is its readable twin; the tests hold the two to each other.

What changes from the plain kernel, per tile of 16 keys of one KV head:
- Scores (cpu_vector_rows.py): each key's products with all R query heads are one wide vector
  (integer codes: int16 products summed in pairs, which LLVM turns into vpmaddwd/vpdpwssd),
  summed down to 16 lanes per head; a transpose-and-add tree (`pair`) turns 16 such vectors into
  one vector of 16 scores per head, so no key pays a horizontal sum. Integer keys go two at a
  time as 16-bit words, which starts the tree one step in at the cost of one shift per word.
- Scales, zero points, the softmax (2^x, sums) act on those 16 scores at once. The running
  maximum is only moved when a score passes it by LAZY: most tiles skip the horizontal max and
  the rescaling of every sum. The sums of weights stay one per key lane until the end.
- Values (cpu_vector_values.py): each key's codes are widened to float lanes (minus the zero
  point, times the scale where scales are per group or per block), then one multiply-add per 16
  lanes and head, the key's weight broadcast from memory, adds them into accumulators: all R x D
  where they fit the registers (AVX-512), else a chunk of channels at a time (`values_by_chunk`).
- A later block's scales (where they change per block) are prefetched when this block starts, its
  codes a row per key this block reads, so the requests are spread over the work.

It takes float32 (hot pools and skipped layers at a float32 model's dtype), fp16, bf16, fp8,
int8, int4 and int2 stores (per-token scales, or scales a block shares; per-token groups too,
keys then dequantized before their dots: cpu_vector_rows), blocks of a multiple of 16 tokens,
and R x D up to 512 (the accumulators fill the register file at 512). Where a KV head has more
query heads than that (R = 8 at D = 128), a work item reads its blocks once per share of them
(`head_share`), the later passes from L2. Other pools go to the plain kernel. One kernel is
compiled per (K format, V format, R, D, groups): the lane counts are compile-time constants.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from .cpu_args import SHARED_SCALES, TOKEN_SCALES, PoolFormat
from .cpu_numerics import FAST, INTEGER, LN2, LOG2E, kernel, njit, prange
from .cpu_simd import load, splat, store, to_int16
from .cpu_simd_ops import (
    BYTES,
    WORDS,
    any_above,
    exp2,
    first_keys,
    log2,
    piece_copies,
    repeat,
    rint,
    segment_absmax,
    segment_max,
    segment_sum,
    spread,
    spread_loads,
    stored_order,
    to_channel_order,
    to_stored_order,
    vmax,
    where_positive,
)
from .cpu_vector_rows import (
    FLOAT_CODES,
    SCALED,
    grouped_keys,
    in_pairs,
    planes,
    prefetch_block,
    prefetch_row,
    prefetch_scales,
    row_bytes,
    scale_loader,
    tile_scorer,
)
from .cpu_vector_values import TILE, value_summer, values_by_chunk, weights_by_group

Q16_MAX = np.float32(32767.0)  # the int16 query's largest code (as cpu_plain)
# How far a score may pass the running maximum m before the sums are rescaled to a new one:
# weights 2^(score - m) stay below 2^LAZY (no float32 sum of them overflows), and most tiles
# skip the rescale (a horizontal max, 2^x and a multiply of every sum) altogether.
LAZY = np.float32(8.0)
# Blocks between the one read and the one prefetched: 1 is too close to hide DRAM, 2 hides less
# of it than 4 on an Intel Xeon, and 8 slows KIVI-style (the README's AVX-512 section).
AHEAD = 4
MAX_LANES = 512  # R x D: the query heads' lanes an item holds (the value sums' registers)


def head_share(R: int, D: int) -> int:
    """The query heads of a KV head one pass over its blocks takes: all R where R x D fits
    MAX_LANES, else as many as do (R = 7, D = 128: 4, then the last 4), 0 if D alone does not."""
    return min(R, MAX_LANES // D)


def takes(kf: PoolFormat, vf: PoolFormat, R: int, D: int, BS: int, k_groups: int) -> bool:
    """Whether the vector kernel reads these pools (else the plain kernel does): float32, fp16,
    bf16, fp8 or integer codes (16 stored elements a piece), key scales per token or shared by
    the block, value scales any way, or per token and group (dequantized), D a multiple of 16
    (32 for integer keys with one scale a row), blocks a multiple of 16 tokens."""
    def stored(fmt: PoolFormat) -> bool:
        return fmt.code in FLOAT_CODES or (fmt.code == INTEGER and D // planes(fmt) % 16 == 0)
    key_ok = kf.code in FLOAT_CODES or (D % 32 == 0 and (kf.scales == SHARED_SCALES
                                                      or k_groups == 1)) \
        or (grouped_keys(kf, k_groups) and D % (k_groups * planes(kf)) == 0)  # whole elements
    return stored(kf) and stored(vf) and key_ok and D % 16 == 0 and BS % TILE == 0 \
        and 0 < R * D <= MAX_LANES


# The two halves of a tile's work (vector_kernel's `parts`): a cache runs ALL; `bench kernel
# --cpu --parts` times each alone to show where a call's time goes. Without KEYS every key scores
# 0 (the weights are even); without VALUES the sums stay 0 (the softmax's sums are still made).
KEYS, VALUES = 1, 2
ALL = KEYS | VALUES


@cache
def vector_kernel(kf: PoolFormat, vf: PoolFormat, R: int, D: int, k_groups: int, v_groups: int,
                  by_chunk: bool | None = None, parts: int = ALL) -> tuple:
    """(serial, parallel) vector kernels for one pair of formats and shape (R query heads a KV
    head, D channels, scale groups of K and V); the arguments and work items are
    cpu_plain.attention_kernel's. by_chunk: values summed a chunk of channels at a time, or all D
    at once (None: as values_by_chunk says). parts: which halves of the work run (ALL, KEYS,
    VALUES)."""
    by_chunk = values_by_chunk(R, D) if by_chunk is None else by_chunk
    with_keys, with_values = bool(parts & KEYS), bool(parts & VALUES)
    RD, R16 = R * D, R * TILE  # lanes: R heads x D channels, R heads x 16 keys
    k_int, k_scaled = kf.code == INTEGER, kf.code in SCALED  # fp8: scaled, dots in float32
    k_token, k_shared = kf.scales == TOKEN_SCALES, kf.scales == SHARED_SCALES
    v_shared = vf.scales == SHARED_SCALES
    k_has_zero, k_offset = kf.has_zero, np.float32(kf.offset)
    v_has_zero, v_offset = vf.has_zero, np.float32(vf.offset)
    # Per-token value scales go into the weights: p * scale per key (and scale group: then a
    # key has a weight per head and group, each 16-lane piece of a value row in one group).
    token_weights = weights_by_group(vf, D, v_groups)
    G = v_groups if token_weights else 1  # weights per head and key
    G16, RG16 = G * TILE, R * G * TILE
    w_gs = D // G  # channels a weight covers
    tile_scores = tile_scorer(kf, R, D, k_groups)
    k_pairs = in_pairs(kf, D, k_groups)
    k_grouped = grouped_keys(kf, k_groups)  # dequantized before the dots, the query as floats
    k_order = WORDS if k_pairs else BYTES  # the order of the query's channels (cpu_simd_ops)
    zero_term = token_weights and (v_has_zero or vf.offset != 0)
    k_zero_term = k_has_zero or kf.offset != 0
    k_scales16, v_scales16 = scale_loader(kf.scale_code), scale_loader(vf.scale_code)
    k_row, v_row = D // planes(kf), D // planes(vf)  # stored elements a row
    k_planes, v_planes = planes(kf), planes(vf)
    k_row_bytes, v_row_bytes = row_bytes(kf, D), row_bytes(vf, D)
    k_gs = D // k_groups  # channels per scale

    @njit(forceinline=True)
    def prefetch_rows(k_codes, v_codes, k_at, v_at, t):
        """Row t of a later block's K and V codes (from flat elements k_at, v_at) asked for."""
        prefetch_row(k_codes, k_at, k_row, k_row_bytes, t)
        prefetch_row(v_codes, v_at, v_row, v_row_bytes, t)

    # buf: a tile's weights (R x G x 16), the value sums (R x D), a tile's value rows or, at the
    # end, the sums in head order, a block's value scales and zero points (2 x D)
    SUMS, ROWS = RG16, RG16 + RD
    SCALES = ROWS + max(TILE, R) * D
    add_tile, block_scales, rescale, head_sums, v_order = value_summer(
        vf, R, D, v_groups, by_chunk, SUMS, ROWS, SCALES, prefetch_rows)

    @njit(forceinline=True)
    def fold(q_base, k_scales, k_zeros, at, q_words, q_at):
        """A block's shared key scales folded into the query, rounded to int16: (q16, step per
        head, q16 . zero per head), as cpu_plain.fold_scales."""
        s = stored_order(k_scales16(k_scales, at, k_groups), k_planes, k_gs, D, k_order)
        if not k_int:  # fp8: the float query times the scales, nothing rounded, no zero points
            return q_base * repeat(s, R), splat(1.0, R), splat(0.0, R)
        if k_has_zero:
            z = stored_order(k_scales16(k_zeros, at, k_groups), k_planes, k_gs, D, k_order)
        else:
            z = splat(k_offset, D)
        q_fold = q_base * repeat(s, R)  # (R x D)
        step = vmax(segment_absmax(q_fold, D) * np.float32(1 / 32767), splat(1e-30, R))
        # The int16 query as whole floats: the zero points' dot takes them as they are, where
        # converting the int16 lanes back to float cost two instructions a register.
        q_whole = rint(q_fold * spread(np.float32(1.0) / step, D))  # (R x D)
        bias = segment_sum(q_whole * repeat(z, R), D)
        return key_query(to_int16(q_whole), q_words, q_at), step, bias

    if k_pairs:
        @njit(forceinline=True)
        def key_query(q16, q_words, q_at):
            """The int16 query as word_planes' dot partner, in memory from element q_at: each
            dot reads it there (an operand of the multiply-add) instead of spilling and
            rebuilding it per tile. Returns q_at, where the key reader finds it."""
            store(q_words, q_at, piece_copies(q16, 2))
            return q_at
    else:
        @njit(forceinline=True)
        def key_query(q16, q_words, q_at):
            return q16

    @njit(forceinline=True)
    def query(q, at, sm_scale, q_words):
        """The R query heads from q's flat element `at`, scaled to base-2 scores and in K's
        stored order: (q_all, q_base, q_sum, q_step) as cpu_plain.begin_item makes them."""
        q_base = to_stored_order(load(q, at, RD) * (sm_scale * LOG2E), k_planes, D, k_order)
        if k_int:  # rounded to int16, each head at its own step
            step = segment_absmax(q_base, D) / Q16_MAX
            step = where_positive(step, step, splat(1.0, R))
            q_whole = rint(q_base * spread(np.float32(1.0) / step, D))
            if k_grouped:
                return q_whole, q_base, splat(0.0, R), step
            return key_query(to_int16(q_whole), q_words, 0), q_base, segment_sum(q_whole, D), step
        return q_base, q_base, splat(0.0, R), splat(1.0, R)

    @njit(forceinline=True)
    def key_scores(k_codes, row, b_all, q_words, k_scales, k_zeros, s_at, kt_stride, q_sum,
                   b_bias, b_step):
        """(R x 16) base-2 scores of keys row .. row + 15 (scales from element s_at)."""
        if not with_keys:
            return splat(0.0, R16)
        score = tile_scores(k_codes, row, b_all, q_words, k_scales, k_zeros, s_at, kt_stride)
        if k_scaled and k_token and not k_grouped:  # scale * (q . code - zero * sum q)
            if k_zero_term:
                z16 = k_scales16(k_zeros, s_at, TILE) if k_has_zero else splat(k_offset, TILE)
                score = score - repeat(z16, R) * spread(q_sum, TILE)
            score = score * repeat(k_scales16(k_scales, s_at, TILE), R)
        if k_int:
            score = (score - spread(b_bias, TILE)) * spread(b_step, TILE)
        return score

    @njit(forceinline=True)
    def next_block(row, j, hi):
        """The first index from j on (hi where none) whose block is in this pool."""
        while j < hi and row[j] < 0:
            j += 1
        return j

    @njit(forceinline=True)
    def attend_item(q, q_at, sm_scale, row, n_keys, lo, hi, h, H, BS, k, v, buf, q_words, o,
                    o_at, lse, lse_at):
        """cpu_plain._attend_item in vectors: q and o at flat elements q_at, o_at (R x D), lse
        at lse_at (R,); buf as above."""
        k_codes, k_scales, k_zeros, kb_stride, kh_stride, kt_stride = k[:6]
        v_codes, v_scales, v_zeros, vb_stride, vh_stride, vt_stride = v[:6]
        q_all, q_base, q_sum, q_step = query(q, q_at, sm_scale, q_words)
        m = splat(-np.inf, R)
        # Sums of p (and of p * scale * zero, per-token value scales) per head and key lane,
        # added up once at the end: a tile pays a multiply-add, not a horizontal sum.
        l16, z16_acc = splat(0.0, R16), splat(0.0, RG16)
        store(buf, SUMS, splat(0.0, RD))  # the value sums stay in memory between tiles: scoring
        bias = splat(0.0, R)  # a tile has every register, and a tile loads them once
        if k_shared and with_keys:  # the first block's key scales folded into the query
            first = next_block(row, lo, hi)
            if first < hi:
                q_all, q_step, bias = fold(q_base, k_scales, k_zeros,
                                           row[first] * kb_stride + h * kh_stride, q_words, 0)
        q_at = 0  # where in q_words the next fold goes: the half this block's fold does not use
        for j in range(lo, min(lo + AHEAD, hi)):  # the first blocks, before the loop asks
            if row[j] >= 0:
                prefetch_block(k, row[j], h, H, BS, k_row, k_row_bytes, k_has_zero)
                prefetch_block(v, row[j], h, H, BS, v_row, v_row_bytes, v_has_zero)
        for j in range(lo, hi):
            blk = row[j]
            if blk < 0:  # the block is in another pool
                continue
            nxt = row[j + AHEAD] if j + AHEAD < hi else -1
            if nxt >= 0:  # a later block's scales now, its codes a row per key below
                prefetch_scales(k_scales, k_zeros, kb_stride, kh_stride, nxt, h, k_has_zero)
                prefetch_scales(v_scales, v_zeros, vb_stride, vh_stride, nxt, h, v_has_zero)
            k_next, v_next = (nxt * H + h) * BS * k_row, (nxt * H + h) * BS * v_row
            # Where scales change per block, the next block's are folded into the query now,
            # ahead of this block's work: a fold is a chain of dependent steps (a max over the
            # query, a reciprocal, rounding, a store the dots read back) that would otherwise
            # stall the block it serves. Static scales were folded once.
            b_all, b_step, b_bias = q_all, q_step, bias  # this block's
            if k_shared and kb_stride != 0 and with_keys:  # per-token, static: nothing to fold
                following = next_block(row, j + 1, hi)
                if following < hi:
                    q_at = 2 * RD - q_at
                    q_all, q_step, bias = fold(q_base, k_scales, k_zeros,
                                               row[following] * kb_stride + h * kh_stride,
                                               q_words, q_at)
            if v_shared and with_values:
                block_scales(buf, v_scales, v_zeros, blk * vb_stride + h * vh_stride)
            first_row = (blk * H + h) * BS
            for t0 in range(0, min(BS, n_keys - j * BS), TILE):
                nt = min(TILE, n_keys - j * BS - t0)
                s_at = blk * kb_stride + h * kh_stride + t0 * kt_stride
                score = key_scores(k_codes, first_row + t0, b_all, q_words, k_scales, k_zeros,
                                   s_at, kt_stride, q_sum, b_bias, b_step)  # (R x 16)
                score = first_keys(score, nt, -np.inf)  # keys past the row's end weigh 0
                if any_above(score, spread(m + LAZY, TILE)):  # rescale the sums to a new max
                    top = vmax(m, segment_max(score, TILE))
                    alpha = exp2(m - top)
                    l16 = l16 * spread(alpha, TILE)
                    z16_acc = z16_acc * spread(alpha, G16)
                    rescale(buf, alpha)
                    m = top
                p = exp2(score - spread(m, TILE))  # (R x 16), each at most 2^LAZY
                l16 = l16 + p
                if not with_values:
                    continue
                v_at = blk * vb_stride + h * vh_stride + t0 * vt_stride
                if token_weights:  # sum p (code - zero) scale = sum (p scale) code - ...
                    s_g = to_stored_order(v_scales16(v_scales, v_at, G16), G, G16, BYTES)
                    w = piece_copies(p, G) * repeat(s_g, R)  # (R x G x 16)
                    if zero_term:
                        z_g = to_stored_order(v_scales16(v_zeros, v_at, G16), G, G16, BYTES) \
                            if v_has_zero else splat(v_offset, G16)
                        z16_acc = z16_acc + w * repeat(z_g, R)
                    store(buf, 0, w)  # read back a key at a time, a broadcast per head, group
                else:
                    store(buf, 0, p)
                add_tile(buf, v_codes, first_row + t0, nt, v_scales, v_zeros, v_at, vt_stride,
                         k_codes, k_next + t0 * k_row if nxt >= 0 else -1, v_next + t0 * v_row)
        l = segment_sum(l16, TILE)
        store(buf, 0, segment_sum(z16_acc, TILE))  # (R x G): p scale zero summed
        out = (head_sums(buf) - spread_loads(buf, 0, 1, R, v_planes, w_gs, D, 0, D)) * \
            spread(np.float32(1.0) / l, D)
        store(o, o_at, where_positive(spread(l, D), to_channel_order(out, v_planes, D, v_order),
                                      splat(0.0, RD)))
        store(lse, lse_at, where_positive(l, (m + log2(l)) * LN2, splat(-np.inf, R)))

    @kernel((kf, vf, R, D, k_groups, v_groups, by_chunk, parts), fastmath=FAST,
            error_model="numpy")
    def attend_items(first, last, q, q_seq, q_pos, table, ctx_lens, k, v, H, BS, sm_scale, o,
                     lse):
        n_split, N, Hq, _ = o.shape
        group = Hq // H  # a KV head's query heads, R of them a pass over its blocks (head_share)
        buf = np.empty(SCALES + 2 * D, np.float32)
        # The query of keys read in pairs, twice: this block's fold and the next block's.
        q_words = np.empty(4 * RD, np.int16)
        for item in range(first, last):
            n, split, h = item // (n_split * H), item // H % n_split, item % H
            b = q_seq[n]
            n_keys = min(q_pos[n] + 1, ctx_lens[b])  # causal: keys 0 .. n_keys-1 are visible
            n_blocks = min((n_keys + BS - 1) // BS, table.shape[1])
            per = (n_blocks + n_split - 1) // n_split
            lo, hi = split * per, min(split * per + per, n_blocks)
            for p in range((group + R - 1) // R):  # the later passes find the blocks in L2
                # the last pass ends at the group's end: it may redo heads (the same numbers)
                first_head = h * group + min(p * R, group - R)
                heads = (split * N + n) * Hq + first_head  # ... in o and lse
                attend_item(q, (n * Hq + first_head) * D, sm_scale, table[b], n_keys, lo, hi, h,
                            H, BS, k, v, buf, q_words, o, heads * D, lse, heads)

    @kernel((kf, vf, R, D, k_groups, v_groups, by_chunk, parts), parallel=True,
            error_model="numpy")
    def attend_parallel(workers, q, q_seq, q_pos, table, ctx_lens, k, v, H, BS, sm_scale, o,
                        lse):
        n_items = o.shape[0] * o.shape[1] * H
        per = (n_items + workers - 1) // workers
        for w in prange(workers):
            first = np.int64(w) * per  # parfors may hand out an unsigned index
            attend_items(first, min(first + per, n_items), q, q_seq, q_pos, table, ctx_lens, k,
                         v, H, BS, sm_scale, o, lse)

    return attend_items, attend_parallel
