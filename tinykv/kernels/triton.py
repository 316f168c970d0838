"""Triton kernels for the paged, quantized KV cache: fused dequant-attention here, quantize-on-store
in triton_store.py (triton_aot.py compiles both ahead of time without a GPU). Each has a torch
reference with the identical signature in reference.py (read it first): the reference says what is
computed, the kernel how it is done fast on a GPU.

A stored format's KIND is layout.StoredFormat's family: 0 float (a plain cast), 1 integer codes of
BITS bits (8 // BITS per byte, the low bits holding the even channel), 2 fp8 e4m3, read as its
uint8 bits so that one code path serves every GPU, every Triton 3.x and the interpreter. Only core
`tl` APIs are used: the kernels run on older Triton 3.x and torch 2.4+ too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .layout import FP8, PoolLayer, ScaleStrides, StoredFormat, check_layout, stored_format
from .reference import merge_stacked

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
    scale_strides: ScaleStrides
    fmt: StoredFormat

    def kernel_args(self, prefix: str = "") -> dict:
        """The kernels' arguments for this pool: `{prefix}_data` .. `{PREFIX}_STATIC` (unprefixed
        `data` .. `STATIC` for the store kernel, which reads one pool)."""
        ss, fmt = self.scale_strides, self.fmt
        args = dict(
            data=self.data, scale=self.scale, zero=self.zero, stride_block=self.stride_block,
            stride_head=self.stride_head, stride_token=self.stride_token,
            scale_stride_block=ss.block, scale_stride_head=ss.head, scale_stride_token=ss.token,
            scale_stride_group=ss.group, offset=fmt.offset,
            KIND=fmt.family, BITS=8 // fmt.per_byte, HAS_ZERO=fmt.has_zero,
            GROUP_SIZE=fmt.group_size, STATIC=fmt.static)
        if not prefix:
            return args
        return {(f"{prefix.upper()}_{name}" if name.isupper() else f"{prefix}_{name}"): value
                for name, value in args.items()}


def _pool_args(pool: PoolLayer, H: int, BS: int, D: int, what: str) -> PoolArgs:
    """The kernel arguments of one pool, after checking its layout (`what` names it in errors)."""
    scale_strides = check_layout(pool, H, BS, D, what)
    fmt = stored_format(pool.p, D)
    data = pool.data.view(torch.uint8) if fmt.family == FP8 else pool.data
    return PoolArgs(
        data=data, scale=data if pool.scale is None else pool.scale,
        zero=data if pool.zero is None else pool.zero,
        stride_block=data.stride(0), stride_head=data.stride(1), stride_token=data.stride(2),
        scale_strides=scale_strides, fmt=fmt)


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
    n_rep = Hq // H  # query heads per KV head (GQA)
    table = _i32(block_table)
    ka = _pool_args(k, H, BS, D, "k")
    va = _pool_args(v, H, BS, D, "v")
    return dict(
        q=q, q_stride_n=q.stride(0), q_stride_head=q.stride(1), q_seq=_i32(q_seq),
        q_pos=_i32(q_pos), table=table, table_stride_row=table.stride(0), ctx_lens=_i32(ctx_lens),
        o=o, lse=lse, n_queries=N, max_blocks=table.shape[1],
        qk_scale=sm_scale * math.log2(math.e),  # scores in log2 units: the kernel uses exp2
        **ka.kernel_args("k"), **va.kernel_args("v"),
        N_REP=n_rep, R=_pow2_at_least_16(n_rep), D=D, DP=_pow2_at_least_16(D),
        BS=BS, BSP=triton.next_power_of_2(BS), BLOCKS_PER_ITER=blocks_per_iter(BS),
        # The interpreter multiplies bf16 bit patterns as integers: bf16 dots run in fp32 there.
        DOT_F32=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and _interpreted()))


def _interpreted() -> bool:
    """Whether the kernels were defined under TRITON_INTERPRET=1 (then they run on the CPU)."""
    return not isinstance(_attn_kernel, triton.runtime.JITFunction)


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
