"""Triton kernels for the paged, quantized KV cache: fused dequant-attention and quantize-on-store.

Each kernel has a torch reference with the identical signature in kernels.py (read it first): the
reference says what is computed, the kernel how it is done fast on a GPU.
"""

from __future__ import annotations

import math

import torch

from .kernels import PoolLayer, merge_stacked
from .quant import FP8_MAX, QuantParams

try:
    import triton
    import triton.language as tl
    _jit = triton.jit
except ImportError:  # Triton is Linux-only: the torch references work without it
    triton, _jit = None, lambda fn: fn


# ---- Triton: formats are KIND 0 (float, plain cast), 1 (BITS-bit int codes, 8 // BITS per byte, low bits =
# even channel) or 2 (fp8 e4m3 read as uint8 bits: one code path for every GPU, Triton 3.x and interpreter).
_i32 = lambda t: t.to(torch.int32).contiguous()


def _pool_args(t: PoolLayer, name: str, H: int, BS: int, D: int) -> dict:
    """Kernel arguments `{name}_...` describing one pool, after checking its layout. Scale/zero strides are
    0 on size-1 dims: how (NB|1, H|1, BS|1, G) broadcasts to (NB, H, BS, G)."""
    p, s, z, data, G = t.p, t.scale, t.zero, t.data, 1 if t.scale is None else t.scale.shape[-1]
    assert data.dim() == 4 and tuple(data.shape[1:]) == (H, BS, D // p.per_byte) and D % G == 0, \
        f"{name}: data {tuple(data.shape)} is not (NB, {H}, {BS}, {D // p.per_byte})"
    assert data.stride(-1) == 1 and data.dtype == p.storage_dtype, f"{name}: channels must be contiguous"
    assert (s is None) == p.is_float and (z is None) == (p.sym or p.is_float), f"{name}: scale/zero unlike {p}"
    full = (data.shape[0], H, BS, G)
    assert s is None or (s.dim() == 4 and all(a in (1, b) for a, b in zip(s.shape, full, strict=True))), \
        f"{name}: scale {tuple(s.shape)} does not broadcast to (NB, H, BS, G) = {full}"
    bstrides = lambda u: [0 if n == 1 else st for n, st in zip(u.shape, u.stride(), strict=True)]
    ss = [0] * 4 if s is None else bstrides(s)
    assert z is None or (z.shape == s.shape and bstrides(z) == ss), f"{name}: zero is laid out unlike scale"
    data = data.view(torch.uint8) if p.dtype == "fp8" else data
    kind = 0 if p.is_float else 2 if p.dtype == "fp8" else 1
    args = dict(data=data, scale=data if s is None else s, zero=data if z is None else z, sdb=data.stride(0),
                sdh=data.stride(1), sdt=data.stride(2), ssb=ss[0], ssh=ss[1], sst=ss[2], ssg=ss[3],
                off=float(p.offset), gs=D // G)
    return {**{f"{name}_{k}": v for k, v in args.items()}, f"{name.upper()}_KIND": kind,
            f"{name.upper()}_BITS": p.bits if kind == 1 else 8, f"{name.upper()}_ZERO": z is not None}


@_jit
def _dequant(data, scale, zero, blk, h, t, c, mask, sdb, sdh, sdt, ssb, ssh, sst, ssg, off, gs,
             KIND: tl.constexpr, BITS: tl.constexpr, ZERO: tl.constexpr):
    """x = (q - zero) * scale at pool elements (blk, h, t, c); t and c broadcast to the tile's shape."""
    PB = 8 // BITS  # codes per byte
    raw = tl.load(data + blk * sdb + h * sdh + t * sdt + c // PB, mask=mask, other=0)  # (tile) stored elements
    if KIND == 2:  # e4m3 bits moved into fp16's layout are the same number / 2^8, subnormals included
        b = raw.to(tl.int32)
        x = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    elif PB > 1:
        x = ((raw.to(tl.int32) >> (c % PB) * BITS) & ((1 << BITS) - 1)).to(tl.float32)
    else:
        x = raw.to(tl.float32)
    if KIND != 0:
        sp = blk * ssb + h * ssh + t * sst + c // gs * ssg  # (tile) offsets of the scale (and zero)
        x = x - (tl.load(zero + sp, mask=mask, other=0).to(tl.float32) if ZERO else off)
        x = x * tl.load(scale + sp, mask=mask, other=0).to(tl.float32)
    return x


@_jit
def _attn_kernel(q, sqn, sqh, q_seq, q_pos, table, stab, ctx_lens, o, lse, N, MB, qk_scale,
                 k_data, k_scale, k_zero, k_sdb, k_sdh, k_sdt, k_ssb, k_ssh, k_sst, k_ssg, k_off, k_gs,
                 v_data, v_scale, v_zero, v_sdb, v_sdh, v_sdt, v_ssb, v_ssh, v_sst, v_ssg, v_off, v_gs,
                 K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_ZERO: tl.constexpr, V_KIND: tl.constexpr,
                 V_BITS: tl.constexpr, V_ZERO: tl.constexpr, N_REP: tl.constexpr, R: tl.constexpr,
                 D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, BSP: tl.constexpr, DOT_F32: tl.constexpr):
    """One query n, KV head h, split s: attention of the KV head's query group over its share of blocks."""
    n, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = tl.load(q_seq + n)
    n_keys = tl.minimum(tl.load(q_pos + n) + 1, tl.load(ctx_lens + row))  # keys 0 .. n_keys-1 are visible
    n_blk = tl.minimum(tl.cdiv(n_keys, BS), MB)
    per = tl.cdiv(n_blk, tl.num_programs(2))  # blocks per split
    lo, hi = split * per, tl.minimum(split * per + per, n_blk)
    r = tl.arange(0, R)  # (R,) query heads h * N_REP + r share KV head h; rows >= N_REP are padding
    c = tl.arange(0, DP)  # (DP,) channels
    t = tl.arange(0, BSP)  # (BSP,) tokens of a block
    qmask = (r[:, None] < N_REP) & (c[None, :] < D)  # (R, DP)
    qt = tl.load(q + n * sqn + (h * N_REP + r)[:, None] * sqh + c[None, :], mask=qmask, other=0)  # (R, DP)
    if DOT_F32:  # else the dots run in q's half dtype on tensor cores, accumulating in float32
        qt = qt.to(tl.float32)
    m = tl.full((R,), float("-inf"), tl.float32)  # (R,) running max
    l = tl.zeros((R,), tl.float32)  # (R,) running sum of exp2(score - m)
    acc = tl.zeros((R, DP), tl.float32)  # (R, DP) running sum of p * v
    for j in range(lo, hi):
        blk = tl.load(table + row * stab + j)  # -1: not in this pool
        ok = (t < BS) & (t < tl.where(blk >= 0, n_keys - j * BS, 0))  # (BSP,) visible keys of the block
        blk = tl.maximum(blk, 0).to(tl.int64)
        kt = _dequant(k_data, k_scale, k_zero, blk, h, t[None, :], c[:, None], ok[None, :] & (c[:, None] < D), k_sdb,
                      k_sdh, k_sdt, k_ssb, k_ssh, k_sst, k_ssg, k_off, k_gs, K_KIND, K_BITS, K_ZERO)  # (DP, BSP) K^T
        s = tl.dot(qt, kt.to(qt.dtype), input_precision="ieee") * qk_scale  # (R, BSP) log2 units: use exp2
        s = tl.where(ok[None, :], s, float("-inf"))  # masked keys also load as 0 in K and V: never nan
        m_new = tl.maximum(m, tl.max(s, 1))  # (R,)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: keep exp2 free of nan
        pr = tl.exp2(s - m_use[:, None])  # (R, BSP)
        alpha = tl.exp2(m - m_use)  # (R,)
        vt = _dequant(v_data, v_scale, v_zero, blk, h, t[:, None], c[None, :], ok[:, None] & (c[None, :] < D), v_sdb,
                      v_sdh, v_sdt, v_ssb, v_ssh, v_sst, v_ssg, v_off, v_gs, V_KIND, V_BITS, V_ZERO)  # (BSP, DP)
        acc = acc * alpha[:, None] + tl.dot(pr.to(qt.dtype), vt.to(qt.dtype), input_precision="ieee")
        l = l * alpha + tl.sum(pr, 1)
        m = m_new
    head = (split * N + n) * (N_REP * tl.num_programs(1)) + h * N_REP + r  # (R,) row of (S, N, Hq)
    l_use = tl.where(l > 0, l, 1.0)  # (R,) a query that saw no key: o = 0, lse = -inf
    tl.store(o + head[:, None] * D + c[None, :], acc / l_use[:, None], mask=qmask)
    tl.store(lse + head, tl.where(l > 0, (m + tl.log2(l_use)) * 0.6931471805599453, float("-inf")), mask=r < N_REP)


def paged_attention_triton(q: torch.Tensor, q_seq: torch.Tensor, q_pos: torch.Tensor, k: PoolLayer,
                           v: PoolLayer, block_table: torch.Tensor, ctx_lens: torch.Tensor, sm_scale: float,
                           num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_attention_ref, fused: K/V are read once per query group and dequantized in registers.

    Flash-decoding: each (query, KV head) is split over `num_splits` programs taking equal shares of its blocks,
    merged afterwards; by default enough to fill the GPU at small batch, with >= 256 keys of the widest row each.
    """
    assert triton is not None, "paged_attention_triton needs Triton (Linux); use paged_attention_ref"
    (N, Hq, D), (B, MB), (H, BS) = q.shape, block_table.shape, k.data.shape[1:3]
    assert Hq % H == 0 and q.stride(-1) == 1 and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
    assert q_seq.shape == q_pos.shape == (N,) and ctx_lens.shape == (B,), "q_seq/q_pos (N,), ctx_lens (B,)"
    if num_splits is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        num_splits = max(1, min(triton.cdiv(2 * sms, max(N * H, 1)), triton.cdiv(MB * BS, 256)))
    o = torch.empty(num_splits, N, Hq, D, dtype=torch.float32, device=q.device)  # every row gets written
    lse = torch.empty(num_splits, N, Hq, dtype=torch.float32, device=q.device)
    if N:
        table = _i32(block_table)
        _attn_kernel[(N, H, num_splits)](
            q, q.stride(0), q.stride(1), _i32(q_seq), _i32(q_pos), table, table.stride(0), _i32(ctx_lens), o, lse,
            N, MB, sm_scale * math.log2(math.e), **_pool_args(k, "k", H, BS, D), **_pool_args(v, "v", H, BS, D),
            N_REP=Hq // H, R=max(16, triton.next_power_of_2(Hq // H)), D=D, DP=max(16, triton.next_power_of_2(D)),
            BS=BS, BSP=max(16, triton.next_power_of_2(BS)),
            # The interpreter multiplies bf16 bit patterns as integers: bf16 dots run in fp32 there.
            DOT_F32=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and not q.is_cuda))
    return (o[0], lse[0]) if num_splits == 1 else merge_stacked(o, lse)


@_jit
def _rint(x):
    """Round half to even like torch.round, from floor: exact, whatever the compiler's flags."""
    f = tl.floor(x)
    odd = f - 2.0 * tl.floor(f * 0.5) == 1.0
    return f + tl.where((x - f > 0.5) | ((x - f == 0.5) & odd), 1.0, 0.0)


@_jit
def _cast_up(s, tiny, big, DT: tl.constexpr):
    """Positive float32 -> 16-bit float dtype DT, rounding up, never down, like quant._cast_up."""
    s = tl.minimum(tl.maximum(s, tiny), big)
    c = s.to(DT)  # nearest
    up = (c.to(tl.int16, bitcast=True) + 1).to(tl.int16).to(DT, bitcast=True)  # the next larger value
    return tl.where(c.to(tl.float32) < s, up, c)


@_jit
def _fp8_bits(v):
    """float32 in [-448, 448] -> e4m3fn bits (int32), rounding to nearest even like torch's cast."""
    u = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    normal = (((u & 0x7FFFFFFF) + 0x7FFFF + ((u >> 20) & 1)) >> 20) - (120 << 3)  # rebias exponent 127 -> 7
    sub = _rint(a * 512.0).to(tl.int32)  # below 2^-6 values are multiples of 2^-9
    return tl.where(a < 0.015625, sub, normal) | ((u >> 24) & 0x80)  # | sign


@_jit
def _store_kernel(x, sxn, sxh, blk_ids, offs, count, qmax, lo, hi, slack, room, tiny, big,
                  s_data, s_scale, s_zero, s_sdb, s_sdh, s_sdt, s_ssb, s_ssh, s_sst, s_ssg, s_off, s_gs,
                  S_KIND: tl.constexpr, S_BITS: tl.constexpr, S_ZERO: tl.constexpr, DYNAMIC: tl.constexpr,
                  PB: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, CP: tl.constexpr):
    """Token i, head h: quantize one row of D channels and store its codes (and scales) in its slot."""
    i, h = tl.program_id(0), tl.program_id(1)
    blk, tok = tl.load(blk_ids + i).to(tl.int64), tl.load(offs + i)
    e = tl.arange(0, CP)  # (CP,) stored elements of the row (bytes of packed codes)
    j = tl.arange(0, PB)[None, :]  # (1, PB) code within a byte
    ch = e[:, None] * PB + j  # (CP, PB) channel
    cm = ch < D
    xv = tl.load(x + i * sxn + h * sxh + ch, mask=cm, other=0).to(tl.float32)  # (CP, PB)
    dst = s_data + blk * s_sdb + h * s_sdh + tok * s_sdt  # this slot's row of codes
    if S_KIND == 0:
        tl.store(dst + ch, xv.to(s_data.dtype.element_ty), mask=cm)
    else:
        gid = ch // s_gs  # (CP, PB) group of each channel
        sp = blk * s_ssb + h * s_ssh + tok * s_sst  # the slot's scales; static ones have s_ssb = s_sst = 0
        if DYNAMIC:  # quant.compute_scales for one token, op for op so that codes match bit for bit
            g = tl.arange(0, GP)  # (GP,)
            in_g = gid[None] == g[:, None, None]  # (GP, CP, PB)
            sel = in_g & cm[None] & (tl.abs(xv) < float("inf"))[None]  # finite members of each group
            if S_ZERO:
                mn = tl.min(tl.min(tl.where(sel, xv[None], float("inf")), 2), 1)  # (GP,)
                mx = tl.max(tl.max(tl.where(sel, xv[None], float("-inf")), 2), 1)  # (GP,)
                mn, mx = tl.where(mn > mx, 0.0, mn), tl.where(mn > mx, 0.0, mx)  # no finite value: 0
                s = tl.maximum(tl.math.div_rn(mx, qmax) - tl.math.div_rn(mn, qmax),
                               tl.maximum(tl.math.div_rn(mn, room), tl.math.div_rn(-mn, qmax + room)))
            else:
                s = tl.math.div_rn(tl.max(tl.max(tl.where(sel, tl.abs(xv)[None], 0.0), 2), 1), qmax)  # (GP,)
            sc = _cast_up(s, tiny, big, s_scale.dtype.element_ty)  # (GP,)
            tl.store(s_scale + sp + g * s_ssg, sc, mask=g < G)
            s_el = tl.sum(tl.where(in_g, sc.to(tl.float32)[:, None, None], 0.0), 0)  # (CP, PB)
            if S_ZERO:
                z = tl.minimum(tl.maximum(_rint(tl.math.div_rn(-mn, sc.to(tl.float32))), -room), qmax + room)
                tl.store(s_zero + sp + g * s_ssg, z.to(s_zero.dtype.element_ty), mask=g < G)
                z_el = tl.sum(tl.where(in_g, z[:, None, None], 0.0), 0)  # (CP, PB)
        else:
            s_el = tl.load(s_scale + sp + gid * s_ssg, mask=cm, other=1.0).to(tl.float32)  # (CP, PB)
            if S_ZERO:
                z_el = tl.load(s_zero + sp + gid * s_ssg, mask=cm, other=0.0).to(tl.float32)  # (CP, PB)
        nan = xv != xv
        v = tl.math.div_rn(tl.where(nan, 0.0, xv), tl.where(cm, s_el, 1.0))  # (CP, PB); divide: exact ties
        if S_KIND == 1:  # not for fp8, where -0.0 + 0.0 would lose the sign torch's cast keeps
            v = v + (z_el if S_ZERO else s_off)
        sat = (nan | (v < lo - slack) | (v > hi + slack)) & cm
        tl.atomic_add(count, tl.sum(tl.sum(sat.to(tl.int32), 1), 0))
        v = tl.minimum(tl.maximum(v, lo), hi)
        codes = _fp8_bits(v) if S_KIND == 2 else _rint(v).to(tl.int32)  # (CP, PB)
        if PB > 1:
            tl.store(dst + e, tl.sum(codes << (j * S_BITS), 1).to(tl.uint8), mask=e < D // PB)  # (CP,) bytes
        else:
            tl.store(dst + ch, codes.to(s_data.dtype.element_ty), mask=cm)


def quantize_store_triton(x: torch.Tensor, p: QuantParams, data: torch.Tensor, scale: torch.Tensor | None,
                          zero: torch.Tensor | None, blk: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """quantize_store_ref in one kernel launch: one program per (token, head)."""
    assert triton is not None, "quantize_store_triton needs Triton (Linux); use quantize_store_ref"
    (n, H, D), BS, G = x.shape, data.shape[2], 1 if scale is None else scale.shape[-1]
    args = _pool_args(PoolLayer(data, scale, zero, p), "s", H, BS, D)
    assert not p.block_wise and x.stride(-1) == 1 and blk.shape == off.shape == (n,)
    assert p.static or scale is None or (scale.shape[::2] == data.shape[::2] and scale.dtype.itemsize == 2), \
        "dynamic scales are stored per slot, (NB, H, BS, G), in a 16-bit float"
    count = torch.zeros((), dtype=torch.int32, device=x.device)
    fi, fp8 = torch.finfo(torch.float16 if scale is None else scale.dtype), p.dtype == "fp8"
    lo, hi = (-FP8_MAX, FP8_MAX) if fp8 else (p.qmin + p.offset, p.qmax + p.offset) if p.sym else (0, p.qmax)
    room = min(round(2 / fi.eps), 2048) - p.qmax  # as quant.compute_scales
    if n:
        _store_kernel[(n, H)](x, x.stride(0), x.stride(1), _i32(blk), _i32(off), count, float(p.qmax), float(lo),
                              float(hi), 0.0 if fp8 else 0.5, float(room), fi.tiny, fi.max, **args,
                              DYNAMIC=not p.static, PB=p.per_byte, G=G, GP=triton.next_power_of_2(G), D=D,
                              CP=triton.next_power_of_2(D // p.per_byte))
    return count
