"""Triton kernels for the paged, quantized KV cache: fused dequant-attention and quantize-on-store.

Each kernel has a torch reference with the identical signature in kernels.py (read it first): the
reference says what is computed, the kernel how it is done fast on a GPU. `aot_compile` builds the
kernels ahead of time for a GPU target without a GPU: the CPU-only check that they compile.

Storage formats are one of three KINDs: 0 float (a plain cast), 1 integer codes of BITS bits
(8 // BITS per byte, the low bits holding the even channel), 2 fp8 e4m3, read as its uint8 bits so
that one code path serves every GPU, every Triton 3.x and the interpreter. Only core `tl` APIs are
used: the kernels run on older Triton 3.x and torch 2.4+ too.
"""

from __future__ import annotations

import inspect
import math
import os
import subprocess
import tempfile
from dataclasses import dataclass

import torch

from .kernels import PoolLayer, merge_stacked
from .quant import FP8_MAX, KVSpec, QuantParams

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is Linux-only: the torch references work without it
    triton = None


def _jit(fn):
    """triton.jit where Triton is installed; without it the kernels are plain, unused functions."""
    return fn if triton is None else triton.jit(fn)


def _i32(t: torch.Tensor) -> torch.Tensor:
    """Index tensors as the kernels read them: contiguous int32."""
    return t.to(torch.int32).contiguous()


# ---- pool descriptors ------------------------------------------------------------------------

@dataclass(frozen=True)
class PoolArgs:
    """One pool as a kernel reads it: its tensors, element strides and format, layout checked.

    Scale/zero strides are 0 on size-1 dims: that is how (NB|1, H|1, BS|1, G) broadcasts to
    (NB, H, BS, G), so per-token, per-group, per-block and static scales share one address formula.
    """
    data: torch.Tensor  # (NB, H, BS, D // per_byte) codes; fp8 viewed as uint8
    scale: torch.Tensor  # (NB|1, H|1, BS|1, G); `data` as a never-read stand-in for float formats
    zero: torch.Tensor  # like scale; `data` as a never-read stand-in when symmetric
    stride_block: int
    stride_head: int
    stride_token: int
    scale_stride_block: int  # 0 for static (per-layer) scales
    scale_stride_head: int  # 0 for per-tensor scales
    scale_stride_token: int  # 0 unless per-token or per-group scales
    scale_stride_group: int
    offset: float  # stored code of 0 for symmetric int4/int2 (their codes are unsigned)
    group_size: int  # channels sharing one scale
    kind: int  # 0 float, 1 integer codes, 2 fp8
    bits: int  # bits per code: 8 unless packed
    has_zero: bool
    static: bool  # one set of scales per layer (calibrated), shared by every block and token


def _broadcast_strides(t: torch.Tensor) -> list[int]:
    """Strides with 0 on size-1 dims: a shared scale is read at the same address for every index."""
    return [0 if n == 1 else st for n, st in zip(t.shape, t.stride(), strict=True)]


def _kind(p: QuantParams) -> int:
    """The KIND constexpr: 0 float, 1 integer codes, 2 fp8."""
    if p.is_float:
        return 0
    if p.dtype == "fp8":
        return 2
    return 1


def _pool_args(pool: PoolLayer, H: int, BS: int, D: int, what: str) -> PoolArgs:
    """The kernel arguments of one pool, after checking its layout (`what` names it in errors)."""
    p, data, s, z = pool.p, pool.data, pool.scale, pool.zero
    G = 1 if s is None else s.shape[-1]
    want = (H, BS, D // p.per_byte)
    assert data.dim() == 4 and tuple(data.shape[1:]) == want and D % G == 0, \
        f"{what}: data {tuple(data.shape)} is not (NB, {H}, {BS}, {D // p.per_byte})"
    assert data.stride(-1) == 1, f"{what}: channels must be contiguous"
    assert data.dtype == p.storage_dtype, f"{what}: {p} is stored as {p.storage_dtype}"
    assert (s is None) == p.is_float, f"{what}: a scale is needed exactly for quantized formats"
    assert (z is None) == (p.sym or p.is_float), f"{what}: a zero point is needed exactly for asym"
    full = (data.shape[0], H, BS, G)
    broadcasts = s is None or (s.dim() == 4 and all(
        n in (1, m) for n, m in zip(s.shape, full, strict=True)))
    assert broadcasts, f"{what}: scale {tuple(s.shape)} does not broadcast to {full}"
    ss = [0, 0, 0, 0] if s is None else _broadcast_strides(s)
    assert z is None or (z.shape == s.shape and _broadcast_strides(z) == ss), \
        f"{what}: zero is laid out unlike scale"
    if p.dtype == "fp8":
        data = data.view(torch.uint8)
    kind = _kind(p)
    return PoolArgs(
        data=data, scale=data if s is None else s, zero=data if z is None else z,
        stride_block=data.stride(0), stride_head=data.stride(1), stride_token=data.stride(2),
        scale_stride_block=ss[0], scale_stride_head=ss[1], scale_stride_token=ss[2],
        scale_stride_group=ss[3], offset=float(p.offset), group_size=D // G, kind=kind,
        bits=p.bits if kind == 1 else 8, has_zero=z is not None, static=p.static)


@_jit
def _dequant(data, scale, zero, blk, head, tok, elem, ch, key_ok,
             stride_block, stride_head, stride_token,
             scale_stride_block, scale_stride_head, scale_stride_token, scale_stride_group,
             offset, KIND: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr,
             GROUP_SIZE: tl.constexpr, STATIC: tl.constexpr, D: tl.constexpr):
    """x = (q - zero) * scale of channels ch (stored in element elem = ch // per_byte of the row)
    of tokens (blk, head, tok) -> a float32 tile.

    blk, tok and key_ok are shaped as the tile's keys, elem and ch as its channels ((1, KEYS) and
    (DP, 1) for K^T; (KEYS, 1) and (1, DP) for V); keys not ok and channels >= D read as 0. Scales
    are loaded in the shape they vary over (keys, channels or both), not once per element.
    """
    per_byte = 8 // BITS  # codes per stored element
    at = blk * stride_block + head * stride_head + tok * stride_token + elem  # (tile)
    raw = tl.load(data + at, mask=key_ok & (ch < D), other=0)  # (tile) stored elements
    if KIND == 2:
        # e4m3 bits moved into fp16's layout are the same number / 2^8, subnormals included.
        b = raw.to(tl.int32)  # (tile)
        fp16_bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)  # (tile)
        x = fp16_bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0  # (tile)
    elif per_byte > 1:
        shift = (ch % per_byte) * BITS  # (channels) channel c sits in bits shift.. of its byte
        x = ((raw.to(tl.int32) >> shift) & ((1 << BITS) - 1)).to(tl.float32)  # (tile)
    else:
        x = raw.to(tl.float32)  # (tile)
    if KIND != 0:
        if STATIC:  # one set per layer: every key reads the same scales, always in bounds
            s_at = tl.zeros_like(ch) + head * scale_stride_head  # (channels)
            s_ok = ch < D  # (channels)
        else:
            s_at = blk * scale_stride_block + head * scale_stride_head + tok * scale_stride_token
            s_ok = key_ok  # (keys), like s_at
        if GROUP_SIZE < D:  # several scales per key: one per group of channels
            s_at = s_at + (ch // GROUP_SIZE) * scale_stride_group  # (tile) or (channels)
            s_ok = s_ok & (ch < D)
        if HAS_ZERO:
            x = x - tl.load(zero + s_at, mask=s_ok, other=0).to(tl.float32)
        else:
            x = x - offset
        x = x * tl.load(scale + s_at, mask=s_ok, other=0).to(tl.float32)
    return x


# ---- paged attention -------------------------------------------------------------------------

@_jit
def _channel_order(DP: tl.constexpr, BITS: tl.constexpr):
    """The (DP,) positions of a tile's channels: (stored element, channel); channels >= D pad.

    Packed codes go phase-major: for int4 channels 0, 2, 4.. (the low nibbles of bytes 0, 1, 2..),
    then 1, 3, 5..; each run reads consecutive bytes, so its loads vectorize, where the natural
    order would read every byte twice in a row, one address per element.
    """
    c = tl.arange(0, DP)  # (DP,)
    per_byte = 8 // BITS
    if per_byte == 1:
        elem = c
        ch = c
    else:
        runs = DP // per_byte  # elements (bytes) per run
        elem = c % runs  # (DP,)
        ch = elem * per_byte + c // runs  # (DP,)
    return elem, ch


@_jit
def _attn_kernel(
        q, q_stride_n, q_stride_head, q_seq, q_pos, table, table_stride_row, ctx_lens,
        o, lse, n_queries, max_blocks, qk_scale,
        k_data, k_scale, k_zero, k_stride_block, k_stride_head, k_stride_token,
        k_scale_stride_block, k_scale_stride_head, k_scale_stride_token, k_scale_stride_group,
        k_offset,
        v_data, v_scale, v_zero, v_stride_block, v_stride_head, v_stride_token,
        v_scale_stride_block, v_scale_stride_head, v_scale_stride_token, v_scale_stride_group,
        v_offset,
        K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_HAS_ZERO: tl.constexpr,
        K_GROUP_SIZE: tl.constexpr, K_STATIC: tl.constexpr,
        V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_HAS_ZERO: tl.constexpr,
        V_GROUP_SIZE: tl.constexpr, V_STATIC: tl.constexpr,
        N_REP: tl.constexpr, R: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
        BS: tl.constexpr, BSP: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr,
        DOT_F32: tl.constexpr):
    """Query n, KV head h, split s: the KV head's group of query heads over the split's blocks.

    Each iteration reads KEYS = BLOCKS_PER_ITER * BSP keys (BSP: the block size rounded up to a
    power of two): with small blocks one block's tile is too small to keep loads in flight.
    R and DP are the query group and head dim rounded up to powers of two >= 16 (tl.dot's minimum).
    """
    n = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(q_seq + n)  # the query's row of the block table
    # Keys 0 .. n_keys - 1 are visible: the row's context, causally cut at the query's position.
    n_keys = tl.minimum(tl.load(q_pos + n) + 1, tl.load(ctx_lens + row))
    n_blk = tl.minimum(tl.cdiv(n_keys, BS), max_blocks)
    # Whole iterations per split, so that no iteration straddles two splits.
    per_split = tl.cdiv(tl.cdiv(n_blk, tl.num_programs(2)), BLOCKS_PER_ITER) * BLOCKS_PER_ITER
    first_blk = split * per_split
    end_blk = tl.minimum(first_blk + per_split, n_blk)
    r = tl.arange(0, R)  # (R,) query heads h * N_REP + r share KV head h; r >= N_REP pads
    # A dot product is the same in any order of channels as long as both sides agree: q is
    # loaded in the order of K's tile, o stored from V's (see _channel_order).
    k_elem, k_ch = _channel_order(DP, K_BITS)  # (DP,) stored element and channel of K^T's rows
    v_elem, v_ch = _channel_order(DP, V_BITS)  # (DP,) stored element and channel of V's columns
    key = tl.arange(0, BLOCKS_PER_ITER * BSP)  # (KEYS,) keys of one iteration
    slot = key // BSP  # (KEYS,) which of the iteration's blocks holds the key
    tok = key % BSP  # (KEYS,) token within its block; tok >= BS pads
    q_mask = (r[:, None] < N_REP) & (k_ch[None, :] < D)  # (R, DP)
    q_at = n * q_stride_n + (h * N_REP + r)[:, None] * q_stride_head + k_ch[None, :]  # (R, DP)
    qt = tl.load(q + q_at, mask=q_mask, other=0)  # (R, DP)
    if DOT_F32:  # else the dots run in q's half dtype on tensor cores, accumulating in float32
        qt = qt.to(tl.float32)
    m = tl.full((R,), float("-inf"), tl.float32)  # (R,) running max of the scores
    l = tl.zeros((R,), tl.float32)  # (R,) running sum of exp2(score - m)
    acc = tl.zeros((R, DP), tl.float32)  # (R, DP) running sum of p * v, channels v_ch
    for j in range(first_blk, end_blk, BLOCKS_PER_ITER):
        col = j + slot  # (KEYS,) block-table column of each key
        in_split = col < end_blk  # (KEYS,)
        # Each key loads its block's id: repeated addresses of one warp are one transaction.
        blk = tl.load(table + row * table_stride_row + col, mask=in_split, other=-1)  # (KEYS,)
        # (KEYS,) the visible keys of this pool: block id -1 means the block is held elsewhere
        ok = (tok < BS) & (blk >= 0) & (col * BS + tok < n_keys)
        blk = tl.maximum(blk, 0).to(tl.int64)  # (KEYS,) int64: a pool may pass 2^31 elements
        kt = _dequant(k_data, k_scale, k_zero, blk[None, :], h, tok[None, :], k_elem[:, None],
                      k_ch[:, None], ok[None, :], k_stride_block, k_stride_head, k_stride_token,
                      k_scale_stride_block, k_scale_stride_head, k_scale_stride_token,
                      k_scale_stride_group, k_offset,
                      K_KIND, K_BITS, K_HAS_ZERO, K_GROUP_SIZE, K_STATIC, D)  # (DP, KEYS) K^T
        s = tl.dot(qt, kt.to(qt.dtype), input_precision="ieee")  # (R, KEYS)
        s = s * qk_scale  # (R, KEYS) in log2 units: exp2 below
        s = tl.where(ok[None, :], s, float("-inf"))  # masked keys loaded as 0: never nan
        m_new = tl.maximum(m, tl.max(s, 1))  # (R,)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # (R,) no key yet: exp2 stays finite
        pr = tl.exp2(s - m_use[:, None])  # (R, KEYS)
        alpha = tl.exp2(m - m_use)  # (R,) rescales what was summed under the old max
        vt = _dequant(v_data, v_scale, v_zero, blk[:, None], h, tok[:, None], v_elem[None, :],
                      v_ch[None, :], ok[:, None], v_stride_block, v_stride_head, v_stride_token,
                      v_scale_stride_block, v_scale_stride_head, v_scale_stride_token,
                      v_scale_stride_group, v_offset,
                      V_KIND, V_BITS, V_HAS_ZERO, V_GROUP_SIZE, V_STATIC, D)  # (KEYS, DP)
        pv = tl.dot(pr.to(qt.dtype), vt.to(qt.dtype), input_precision="ieee")  # (R, DP)
        acc = acc * alpha[:, None] + pv
        l = l * alpha + tl.sum(pr, 1)
        m = m_new
    out_row = (split * n_queries + n) * (N_REP * tl.num_programs(1)) + h * N_REP + r  # (R,)
    seen = l > 0  # (R,) a query that saw no key: o = 0, lse = -inf
    l_use = tl.where(seen, l, 1.0)  # (R,)
    o_mask = (r[:, None] < N_REP) & (v_ch[None, :] < D)  # (R, DP)
    tl.store(o + out_row[:, None] * D + v_ch[None, :], acc / l_use[:, None], mask=o_mask)
    lse_row = tl.where(seen, (m + tl.log2(l_use)) * 0.6931471805599453, float("-inf"))  # ln units
    tl.store(lse + out_row, lse_row, mask=r < N_REP)


def _pow2_at_least_16(n: int) -> int:
    """Tile sizes: powers of two, and >= 16 as tl.dot's operands must be."""
    return max(16, triton.next_power_of_2(n))


def blocks_per_iter(block_size: int) -> int:
    """Blocks the decode kernel reads per loop iteration: enough for 64 keys (or one block).

    One 16-token block is a tile too small to keep loads in flight. In the compile report
    (bench/kernel.py `aot_report`) 64 keys spill in no variant and keep >= 2 programs per SM;
    128 keys would take 2-4x the shared memory of the pipelined loads for no more in flight.
    """
    return max(1, 64 // triton.next_power_of_2(block_size))


def _attn_args(q: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor, k: PoolLayer,
               v: PoolLayer, block_table: torch.Tensor, ctx_lens: torch.Tensor, sm_scale: float,
               num_splits: int, o: torch.Tensor, lse: torch.Tensor) -> dict:
    """Every argument of _attn_kernel, by name, layouts checked."""
    (N, Hq, D), (H, BS) = q.shape, k.data.shape[1:3]
    assert Hq % H == 0 and q.stride(-1) == 1, "q (N, Hq, D) with Hq a multiple of the KV heads"
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), f"q is {q.dtype}"
    assert q_seq.shape == q_pos.shape == (N,), "q_seq and q_pos are (N,)"
    assert ctx_lens.shape == block_table.shape[:1], "ctx_lens is (B,)"
    assert o.is_contiguous() and o.shape == (num_splits, N, Hq, D), "o (splits, N, Hq, D)"
    assert lse.is_contiguous() and lse.shape == (num_splits, N, Hq), "lse (splits, N, Hq)"
    table = _i32(block_table)
    ka = _pool_args(k, H, BS, D, "k")
    va = _pool_args(v, H, BS, D, "v")
    return dict(
        q=q, q_stride_n=q.stride(0), q_stride_head=q.stride(1), q_seq=_i32(q_seq),
        q_pos=_i32(q_pos), table=table, table_stride_row=table.stride(0), ctx_lens=_i32(ctx_lens),
        o=o, lse=lse, n_queries=N, max_blocks=table.shape[1],
        qk_scale=sm_scale * math.log2(math.e),  # scores in log2 units: the kernel uses exp2
        k_data=ka.data, k_scale=ka.scale, k_zero=ka.zero,
        k_stride_block=ka.stride_block, k_stride_head=ka.stride_head,
        k_stride_token=ka.stride_token,
        k_scale_stride_block=ka.scale_stride_block, k_scale_stride_head=ka.scale_stride_head,
        k_scale_stride_token=ka.scale_stride_token, k_scale_stride_group=ka.scale_stride_group,
        k_offset=ka.offset,
        v_data=va.data, v_scale=va.scale, v_zero=va.zero,
        v_stride_block=va.stride_block, v_stride_head=va.stride_head,
        v_stride_token=va.stride_token,
        v_scale_stride_block=va.scale_stride_block, v_scale_stride_head=va.scale_stride_head,
        v_scale_stride_token=va.scale_stride_token, v_scale_stride_group=va.scale_stride_group,
        v_offset=va.offset,
        K_KIND=ka.kind, K_BITS=ka.bits, K_HAS_ZERO=ka.has_zero, K_GROUP_SIZE=ka.group_size,
        K_STATIC=ka.static,
        V_KIND=va.kind, V_BITS=va.bits, V_HAS_ZERO=va.has_zero, V_GROUP_SIZE=va.group_size,
        V_STATIC=va.static,
        N_REP=Hq // H, R=_pow2_at_least_16(Hq // H), D=D, DP=_pow2_at_least_16(D),
        BS=BS, BSP=triton.next_power_of_2(BS), BLOCKS_PER_ITER=blocks_per_iter(BS),
        # The interpreter multiplies bf16 bit patterns as integers: bf16 dots run in fp32 there.
        DOT_F32=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and _interpreted()))


def paged_attention_triton(q: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor,
                           k: PoolLayer, v: PoolLayer, block_table: torch.Tensor,
                           ctx_lens: torch.Tensor, sm_scale: float, num_splits: int | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_attention_ref, fused: K/V are read once per query group and dequantized in registers.

    Flash-decoding: each (query, KV head) is split over `num_splits` programs taking equal shares
    of its blocks, merged afterwards; by default enough to fill the GPU at small batch, with
    >= 256 keys of the widest row each.
    """
    assert triton is not None, "paged_attention_triton needs Triton (Linux): use the reference"
    (N, Hq, D), (MB, H, BS) = q.shape, (block_table.shape[1], k.data.shape[1], k.data.shape[2])
    if num_splits is None:
        sms = 1
        if q.is_cuda:
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        by_occupancy = triton.cdiv(2 * sms, max(N * H, 1))
        num_splits = max(1, min(by_occupancy, triton.cdiv(MB * BS, 256)))
    # Every row of o and lse gets written, empty splits included.
    o = torch.empty(num_splits, N, Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_splits, N, Hq, dtype=torch.float32, device=q.device)
    args = _attn_args(q, q_seq, q_pos, k, v, block_table, ctx_lens, sm_scale, num_splits, o, lse)
    if N:
        _attn_kernel[(N, H, num_splits)](**args)
    if num_splits == 1:
        return o[0], lse[0]
    return merge_stacked(o, lse)


# ---- quantize-and-store ----------------------------------------------------------------------

@_jit
def _rint(x):
    """Round half to even like torch.round, from floor: exact, whatever the compiler's flags."""
    f = tl.floor(x)
    odd = f - 2.0 * tl.floor(f * 0.5) == 1.0
    up = (x - f > 0.5) | ((x - f == 0.5) & odd)
    return f + tl.where(up, 1.0, 0.0)


@_jit
def _cast_up(s, tiny, big, DT: tl.constexpr):
    """Positive float32 -> 16-bit float dtype DT, rounding up, never down, like quant.cast_up."""
    s = tl.minimum(tl.maximum(s, tiny), big)
    c = s.to(DT)  # nearest
    up = (c.to(tl.int16, bitcast=True) + 1).to(tl.int16).to(DT, bitcast=True)  # next larger
    return tl.where(c.to(tl.float32) < s, up, c)


@_jit
def _fp8_bits(v):
    """float32 in [-448, 448] -> e4m3fn bits (int32), rounding to nearest even like torch's cast."""
    u = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    # Round the mantissa to 3 bits (ties to even), then rebias the exponent from 127 to 7.
    normal = (((u & 0x7FFFFFFF) + 0x7FFFF + ((u >> 20) & 1)) >> 20) - (120 << 3)
    sub = _rint(a * 512.0).to(tl.int32)  # below 2^-6 e4m3 values are multiples of 2^-9
    sign = (u >> 24) & 0x80
    return tl.where(a < 0.015625, sub, normal) | sign


@_jit
def _store_kernel(
        x, x_stride_n, x_stride_head, blk_ids, offs, count,
        qmax, code_min, code_max, slack, zero_room, scale_tiny, scale_big,
        data, scale, zero, stride_block, stride_head, stride_token,
        scale_stride_block, scale_stride_head, scale_stride_token, scale_stride_group,
        offset,
        KIND: tl.constexpr, BITS: tl.constexpr, HAS_ZERO: tl.constexpr, DYNAMIC: tl.constexpr,
        GROUP_SIZE: tl.constexpr, PB: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
        D: tl.constexpr, CP: tl.constexpr):
    """Token i, head h: quantize one row of D channels and store its codes (and scales)."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.load(blk_ids + i).to(tl.int64)  # () the token's block; int64 for large pools
    tok = tl.load(offs + i)  # () its row within the block
    e = tl.arange(0, CP)  # (CP,) stored elements of the row (bytes of packed codes)
    j = tl.arange(0, PB)[None, :]  # (1, PB) code within a byte
    ch = e[:, None] * PB + j  # (CP, PB) channel
    in_row = ch < D  # (CP, PB)
    xv = tl.load(x + i * x_stride_n + h * x_stride_head + ch, mask=in_row, other=0)
    xv = xv.to(tl.float32)  # (CP, PB)
    dst = data + blk * stride_block + h * stride_head + tok * stride_token  # () the slot's row
    if KIND == 0:
        tl.store(dst + ch, xv.to(data.dtype.element_ty), mask=in_row)
    else:
        gid = ch // GROUP_SIZE  # (CP, PB) group of each channel
        # () the slot's scales; static ones have block and token strides 0
        s_at = blk * scale_stride_block + h * scale_stride_head + tok * scale_stride_token
        if DYNAMIC:  # quant.compute_scales for one token, op for op: codes match bit for bit
            g = tl.arange(0, GP)  # (GP,) groups; g >= G pads
            in_g = gid[None] == g[:, None, None]  # (GP, CP, PB)
            finite = tl.abs(xv) < float("inf")  # (CP, PB) NaN and Inf take no part in scales
            sel = in_g & in_row[None] & finite[None]  # (GP, CP, PB)
            if HAS_ZERO:
                mn = tl.min(tl.min(tl.where(sel, xv[None], float("inf")), 2), 1)  # (GP,)
                mx = tl.max(tl.max(tl.where(sel, xv[None], float("-inf")), 2), 1)  # (GP,)
                empty = mn > mx  # (GP,) no finite value: the range is [0, 0]
                mn = tl.where(empty, 0.0, mn)
                mx = tl.where(empty, 0.0, mx)
                span = tl.math.div_rn(mx, qmax) - tl.math.div_rn(mn, qmax)  # (GP,)
                reach = tl.maximum(tl.math.div_rn(mn, zero_room),
                                   tl.math.div_rn(-mn, qmax + zero_room))  # (GP,)
                s = tl.maximum(span, reach)  # (GP,)
            else:
                amax = tl.max(tl.max(tl.where(sel, tl.abs(xv)[None], 0.0), 2), 1)  # (GP,)
                s = tl.math.div_rn(amax, qmax)  # (GP,)
            sc = _cast_up(s, scale_tiny, scale_big, scale.dtype.element_ty)  # (GP,)
            tl.store(scale + s_at + g * scale_stride_group, sc, mask=g < G)
            s_el = tl.sum(tl.where(in_g, sc.to(tl.float32)[:, None, None], 0.0), 0)  # (CP, PB)
            if HAS_ZERO:
                z = _rint(tl.math.div_rn(-mn, sc.to(tl.float32)))  # (GP,)
                z = tl.minimum(tl.maximum(z, -zero_room), qmax + zero_room)  # (GP,)
                tl.store(zero + s_at + g * scale_stride_group, z.to(zero.dtype.element_ty),
                         mask=g < G)
                z_el = tl.sum(tl.where(in_g, z[:, None, None], 0.0), 0)  # (CP, PB)
        else:
            s_ptr = scale + s_at + gid * scale_stride_group  # (CP, PB)
            s_el = tl.load(s_ptr, mask=in_row, other=1.0).to(tl.float32)  # (CP, PB)
            if HAS_ZERO:
                z_ptr = zero + s_at + gid * scale_stride_group  # (CP, PB)
                z_el = tl.load(z_ptr, mask=in_row, other=0.0).to(tl.float32)  # (CP, PB)
        nan = xv != xv  # (CP, PB)
        # Divide, not multiply by the inverse: ties land exactly where torch's land.
        v = tl.math.div_rn(tl.where(nan, 0.0, xv), tl.where(in_row, s_el, 1.0))  # (CP, PB)
        if KIND == 1:  # not for fp8, where -0.0 + 0.0 would lose the sign torch's cast keeps
            if HAS_ZERO:
                v = v + z_el
            else:
                v = v + offset
        sat = (nan | (v < code_min - slack) | (v > code_max + slack)) & in_row  # (CP, PB)
        tl.atomic_add(count, tl.sum(tl.sum(sat.to(tl.int32), 1), 0))
        v = tl.minimum(tl.maximum(v, code_min), code_max)  # (CP, PB)
        if KIND == 2:
            codes = _fp8_bits(v)  # (CP, PB)
        else:
            codes = _rint(v).to(tl.int32)  # (CP, PB)
        if PB > 1:
            packed = tl.sum(codes << (j * BITS), 1).to(tl.uint8)  # (CP,) bytes
            tl.store(dst + e, packed, mask=e < D // PB)
        else:
            tl.store(dst + ch, codes.to(data.dtype.element_ty), mask=in_row)


def _store_args(x: torch.Tensor, p: QuantParams, data: torch.Tensor, scale: torch.Tensor | None,
                zero: torch.Tensor | None, blk: torch.Tensor, off: torch.Tensor,
                count: torch.Tensor) -> dict:
    """Every argument of _store_kernel, by name, layouts checked."""
    (n, H, D), BS = x.shape, data.shape[2]
    G = 1 if scale is None else scale.shape[-1]
    pa = _pool_args(PoolLayer(data, scale, zero, p), H, BS, D, "store")
    assert not p.block_wise, f"{p}: block-wise scales are computed when a block fills"
    assert x.stride(-1) == 1 and blk.shape == off.shape == (n,), "x (n, H, D), blk and off (n,)"
    per_slot = scale is None or (scale.shape[::2] == data.shape[::2] and scale.dtype.itemsize == 2)
    assert p.static or per_slot, "dynamic scales are stored per slot, (NB, H, BS, G), in 16 bits"
    fi = torch.finfo(torch.float16 if scale is None else scale.dtype)
    if p.dtype == "fp8":
        code_min, code_max = -FP8_MAX, FP8_MAX
    elif p.sym:
        code_min, code_max = p.qmin + p.offset, p.qmax + p.offset
    else:
        code_min, code_max = 0, p.qmax
    return dict(
        x=x, x_stride_n=x.stride(0), x_stride_head=x.stride(1), blk_ids=_i32(blk),
        offs=_i32(off), count=count, qmax=float(p.qmax),
        code_min=float(code_min), code_max=float(code_max),
        slack=0.0 if p.dtype == "fp8" else 0.5,  # saturated: more than half a step outside
        zero_room=float(min(round(2 / fi.eps), 2048) - p.qmax),  # as quant.compute_scales
        scale_tiny=fi.tiny, scale_big=fi.max,
        data=pa.data, scale=pa.scale, zero=pa.zero,
        stride_block=pa.stride_block, stride_head=pa.stride_head, stride_token=pa.stride_token,
        scale_stride_block=pa.scale_stride_block, scale_stride_head=pa.scale_stride_head,
        scale_stride_token=pa.scale_stride_token, scale_stride_group=pa.scale_stride_group,
        offset=pa.offset,
        KIND=pa.kind, BITS=pa.bits, HAS_ZERO=pa.has_zero, DYNAMIC=not p.static,
        GROUP_SIZE=pa.group_size, PB=p.per_byte, G=G, GP=triton.next_power_of_2(G), D=D,
        CP=triton.next_power_of_2(D // p.per_byte))


def quantize_store_triton(x: torch.Tensor, p: QuantParams, data: torch.Tensor,
                          scale: torch.Tensor | None, zero: torch.Tensor | None, blk: torch.Tensor,
                          off: torch.Tensor) -> torch.Tensor:
    """quantize_store_ref in one kernel launch: one program per (token, head)."""
    assert triton is not None, "quantize_store_triton needs Triton (Linux); use quantize_store_ref"
    count = torch.zeros((), dtype=torch.int32, device=x.device)
    args = _store_args(x, p, data, scale, zero, blk, off, count)
    if x.shape[0]:
        _store_kernel[(x.shape[0], x.shape[1])](**args)
    return count


# ---- ahead-of-time compilation ---------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    """One compiled form of a kernel: what its constexprs and pointer dtypes depend on."""
    kernel: str  # "attention" or "store"
    spec: str  # attention: a KV spec ("int8", "k=int4:channel:asym,v=fp16"); store: one format
    head_dim: int = 128
    block_size: int = 16
    n_rep: int = 1  # query heads per KV head (attention)
    dtype: str = "fp16"  # of q (attention) or of the stored x (store)

    def __str__(self) -> str:
        rep = f" n_rep={self.n_rep}" if self.kernel == "attention" else ""
        return f"{self.kernel} {self.spec} D={self.head_dim} BS={self.block_size}{rep} {self.dtype}"


_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_SIGNATURE_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                     torch.int8: "i8", torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64"}


def _interpreted() -> bool:
    """Whether the kernels were defined under TRITON_INTERPRET=1 (then they run on the CPU)."""
    return not isinstance(_attn_kernel, triton.runtime.JITFunction)


def _example_pool(p: QuantParams, H: int, BS: int, D: int) -> PoolLayer:
    """Two blocks laid out as the cache lays them out: fp16 dynamic, fp32 static scales."""
    data = torch.zeros(2, H, BS, D // p.per_byte, dtype=p.storage_dtype)
    if p.is_float:
        return PoolLayer(data, None, None, p)
    if p.static:
        scale = torch.ones(1, 1 if p.gran == "tensor" else H, 1, p.ngroups(D))
    else:
        scale = torch.ones(2, *p.scale_shape(H, BS, D), dtype=torch.float16)
    return PoolLayer(data, scale, None if p.sym else torch.zeros_like(scale), p)


def _example_args(variant: Variant) -> tuple[object, dict]:
    """(kernel, its arguments by name) for tiny CPU tensors laid out as a real launch's are."""
    H, D, BS = 2, variant.head_dim, variant.block_size
    dtype = _TORCH_DTYPES[variant.dtype]
    if variant.kernel == "attention":
        spec = KVSpec.parse(variant.spec)
        k = _example_pool(spec.k, H, BS, D)
        v = _example_pool(spec.v, H, BS, D)
        q = torch.zeros(1, H * variant.n_rep, D, dtype=dtype)
        o = torch.zeros(1, *q.shape)
        lse = torch.zeros(1, *q.shape[:2])
        index = torch.zeros(1, dtype=torch.int32)
        table = torch.zeros(1, 2, dtype=torch.int32)
        args = _attn_args(q, index, index, k, v, table, index, D**-0.5, 1, o, lse)
        return _attn_kernel, args
    p = QuantParams.parse(variant.spec)
    pool = _example_pool(p, H, BS, D)
    x = torch.zeros(1, H, D, dtype=dtype)
    index = torch.zeros(1, dtype=torch.int32)
    count = torch.zeros((), dtype=torch.int32)
    args = _store_args(x, p, pool.data, pool.scale, pool.zero, index, index, count)
    return _store_kernel, args


def _ast_source(fn, args: dict):
    """triton.compiler.ASTSource for these argument values, under each API of Triton 3.x.

    Pointers and integers divisible by 16 get the divisibility hint a launch would give them
    (where Triton takes hints as a dict, 3.3+), so the code is what a launch compiles.
    """
    from triton.backends import compiler as backend_compiler

    constexpr = {param.name for param in fn.params if param.is_constexpr}
    types = {}
    for name in fn.arg_names:
        value = args[name]
        if name in constexpr:
            types[name] = "constexpr"
        elif isinstance(value, torch.Tensor):
            types[name] = "*" + _SIGNATURE_DTYPES[value.dtype]
        elif isinstance(value, float):
            types[name] = "fp32"
        elif -2**31 <= value < 2**31:
            types[name] = "i32"
        else:
            types[name] = "i64"
    constants = {name: args[name] for name in constexpr}
    if "constexprs" not in inspect.signature(triton.compiler.ASTSource).parameters:
        # Triton 3.0/3.1: `constants`, and a signature without the constexprs.
        signature = {name: t for name, t in types.items() if t != "constexpr"}
        return triton.compiler.ASTSource(fn=fn, signature=signature, constants=constants)
    attrs = None
    if not hasattr(backend_compiler, "AttrsDescriptor"):  # 3.3+: hints as a dict
        attrs = {}
        for i, name in enumerate(fn.arg_names):
            value = args[name]
            aligned = isinstance(value, torch.Tensor) or (type(value) is int and value % 16 == 0)
            if types[name] != "constexpr" and aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compiler.ASTSource(fn=fn, signature=types, constexprs=constants, attrs=attrs)


def _resource_usage(cubin: bytes) -> dict:
    """Registers, shared memory and local (spill) bytes of a cubin, from cuobjdump (no GPU)."""
    from triton.tools.disasm import path_to_cuobjdump

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([path_to_cuobjdump(), "-res-usage", f.name], check=True,
                             capture_output=True, text=True).stdout
    fields = {}
    for line in out.splitlines():
        if "REG:" in line:
            for item in line.split():
                name, _, value = item.partition(":")
                if value.isdigit():
                    fields[name] = int(value)
    return fields


def aot_compile_one(variant: Variant, cap: int) -> dict:
    """Compile one variant for sm_{cap}: its cubin's registers, shared bytes and spills."""
    assert not _interpreted(), "unset TRITON_INTERPRET before importing triton to compile kernels"
    from triton.backends.compiler import GPUTarget

    fn, args = _example_args(variant)
    compiled = triton.compile(_ast_source(fn, args), target=GPUTarget("cuda", cap, 32))
    usage = _resource_usage(compiled.asm["cubin"])
    return {"variant": str(variant), "target": f"sm_{cap}", "kernel": fn.__name__,
            "n_regs": usage["REG"], "n_spills": usage.get("LOCAL", 0) // 4,
            "shared": compiled.metadata.shared, "ptx_chars": len(compiled.asm["ptx"]),
            "cubin_bytes": len(compiled.asm["cubin"])}


def aot_compile(variants: list[Variant], caps: tuple[int, ...] = (80, 90),
                jobs: int | None = None) -> list[dict]:
    """aot_compile_one for every variant and target, in `jobs` processes (default: the CPUs).

    n_spills counts 4-byte words of local memory, as Triton's launcher reports them on a GPU.
    """
    from concurrent.futures import ProcessPoolExecutor

    work = [(variant, cap) for variant in variants for cap in caps]
    jobs = jobs or os.cpu_count() or 1
    if jobs == 1:
        return [aot_compile_one(variant, cap) for variant, cap in work]
    with ProcessPoolExecutor(jobs) as pool:
        futures = [pool.submit(aot_compile_one, variant, cap) for variant, cap in work]
        return [f.result() for f in futures]
