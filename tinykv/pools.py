"""The tensors of the paged KV cache: the store pool, in the spec's storage format, and the hot
pool, in full precision, with the two ways data enters them (quantize new tokens on store,
quantize a finished hot block) and the views the attention kernels read.

Store pool of K (and of V): `data` (L, NB, H, BS, D // per_byte) codes, plus `scale` and `zero`
(L, NB|1, H|1, BS|1, G) for integer and fp8 formats; a size-1 dim is shared, so one formula
`x = (q - zero) * scale` serves every granularity (quant.py). Static scales are one set per layer,
(L, 1, H|1, 1, G), and never move with a block. Hot pool: (2, L, NH, H, BS, D) K and V as is.

A *group* is a list of layers sharing one storage format (K and V), and L above is the group's
number of layers: layers a spec skips (`skip=`) keep their own store pools at the model's dtype,
and layers given their own part (`k@0:1=int4:rot`) store it in theirs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .blocks import HOT, STORE, CacheError
from .formats import bytes_per_token
from .kernels.layout import PoolLayer
from .kernels.reference import gather_dequant
from .model import Config
from .quant import compute_scales, quantize
from .spec import KVSpec, QuantParams
from .tables import SlotRows

_FLOAT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass
class StorePool:
    """K or V of every layer in one storage format."""
    p: QuantParams
    data: torch.Tensor  # (L, NB, H, BS, D // per_byte)
    scale: torch.Tensor | None  # (L, NB|1, H|1, BS|1, G); None for plain-cast formats
    zero: torch.Tensor | None  # like scale; None when symmetric

    def moving(self) -> list[torch.Tensor]:
        """Tensors whose dim 1 is the block: what moves when a block moves (static scales stay)."""
        out = [self.data]
        if not self.p.static:
            out += [t for t in (self.scale, self.zero) if t is not None]
        return out

    def layer(self, layer: int, moving: list[torch.Tensor] | None = None) -> PoolLayer:
        """One layer as kernels read it; the moving tensors may come from a staging buffer."""
        if moving is None:
            moving = [t[layer] for t in self.moving()]
        data = moving[0]
        if self.p.static:
            scale = None if self.scale is None else self.scale[layer]
            zero = None if self.zero is None else self.zero[layer]
        else:
            scale = moving[1] if self.scale is not None else None
            zero = moving[2] if self.zero is not None else None
        return PoolLayer(data, scale, zero, self.p)


def make_store_pool(cfg: Config, p: QuantParams, layers: list[int], num_blocks: int,
                    block_size: int, name: str, static: dict[str, torch.Tensor] | None,
                    device: torch.device) -> StorePool:
    """The store pool of K or V (`name`) for `layers`; static scales come from the file's rows
    of those layers."""
    L, H, D = len(layers), cfg.n_kv_heads, cfg.head_dim
    shape = (L, num_blocks, H, block_size, D // p.per_byte)
    data = torch.zeros(shape, dtype=p.storage_dtype, device=device)
    if p.is_float:
        return StorePool(p, data, None, None)
    if p.static:  # one set per layer, shared by every block: (L, 1, H|1, 1, G)
        scale = static[f"{name}_scale"][layers].to(device, torch.float32).unsqueeze(1)
        zero = None
        if not p.sym:
            zero = static[f"{name}_zero"][layers].to(device, torch.float32).unsqueeze(1)
        return StorePool(p, data, scale, zero)
    scale_shape = (L, num_blocks, *p.scale_shape(H, block_size, D))
    scale = torch.ones(scale_shape, dtype=torch.float16, device=device)
    zero = None if p.sym else torch.zeros(scale_shape, dtype=torch.float16, device=device)
    return StorePool(p, data, scale, zero)


StoreFn = Callable[..., "torch.Tensor | int"]  # the quantize_store_ref signature


class SlotIndex(NamedTuple):
    """Where a step writes the tokens that go to one pool, as tensors (tables.SlotRows)."""
    token: torch.Tensor | slice  # (n,) rows of the step's k and v; a slice when all go here
    block: torch.Tensor  # (n,) block ids in the pool
    offset: torch.Tensor  # (n,) slots within those blocks

    @classmethod
    def of(cls, rows: SlotRows, n_tokens: int, device: torch.device) -> SlotIndex:
        """The tables' rows of a step of n_tokens tokens, on the device."""
        def index(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=device)

        all_here = len(rows.token) == n_tokens  # every token goes to this pool: no gather
        token = slice(None) if all_here else index(rows.token)
        return cls(token=token, block=index(rows.block), offset=index(rows.offset))


@dataclass
class LayerGroup:
    """Layers stored in one format: their K and V store pools."""
    layers: list[int]
    k: StorePool
    v: StorePool

    def moving(self) -> list[torch.Tensor]:
        return self.k.moving() + self.v.moving()


class KVPools:
    """The store and hot pools of one cache, and the store kernel chosen with the cache."""

    def __init__(self, cfg: Config, spec: KVSpec, *, num_blocks: int, n_hot: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, static: dict[str, torch.Tensor] | None,
                 store_fn: StoreFn):
        self.store_fn = store_fn
        L, H, D = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
        full = QuantParams(_FLOAT_NAMES[dtype])  # skipped layers: the model's dtype
        formats: dict[tuple[QuantParams, QuantParams], list[int]] = {}  # (K, V) -> its layers
        for layer, kv in enumerate(spec.layer_parts(L, full)):
            formats.setdefault(kv, []).append(layer)
        self.groups = []
        for (kp, vp), layers in formats.items():
            k = make_store_pool(cfg, kp, layers, num_blocks, block_size, "k", static, device)
            v = make_store_pool(cfg, vp, layers, num_blocks, block_size, "v", static, device)
            self.groups.append(LayerGroup(layers, k, v))
        self.where = {}  # layer -> (group, index of the layer within it)
        for g in self.groups:
            for local, layer in enumerate(g.layers):
                self.where[layer] = (g, local)
        hot = hot_dtype(spec, dtype)
        self.hot = torch.zeros(2, L, n_hot, H, block_size, D, dtype=hot, device=device)  # K, V
        as_hot = QuantParams(_FLOAT_NAMES[hot])
        self.hot_views = [(PoolLayer(self.hot[0, i], None, None, as_hot),
                           PoolLayer(self.hot[1, i], None, None, as_hot)) for i in range(L)]
        self.views = []  # per layer (K, V) as kernels read them, made once
        for layer in range(L):
            g, local = self.where[layer]
            self.views.append((g.k.layer(local), g.v.layer(local)))
        self.dtype = dtype
        # clipped values and NaNs, counted on the device: counting needs no sync
        self._saturated = torch.zeros((), dtype=torch.int64, device=device)

    def moving(self) -> list[torch.Tensor]:
        """Store tensors (L, NB, ...) whose dim 1 is the block: what moves when a block moves."""
        return [t for g in self.groups for t in g.moving()]

    def layer_rows(self, layer: int) -> list[tuple[int, int]]:
        """(index into moving(), layer within that tensor) of the tensors that hold `layer`."""
        g, local = self.where[layer]
        first = 0
        for other in self.groups:
            if other is g:
                break
            first += len(other.moving())
        return [(first + i, local) for i in range(len(g.moving()))]

    def layer(self, layer: int, moving: list[torch.Tensor] | None = None) -> tuple[PoolLayer, ...]:
        """(K, V) of one layer of the store; `moving` (a staging buffer's rows, in layer_rows'
        order) replaces the pool's own tensors."""
        if moving is None:
            return self.views[layer]
        g, local = self.where[layer]
        n_k = len(g.k.moving())
        return g.k.layer(local, moving[:n_k]), g.v.layer(local, moving[n_k:])

    def add_saturated(self, n: int) -> None:
        """Count n more clipped values, from a store made outside `write` (kernels.cpu.direct)."""
        self._saturated += n

    @property
    def saturated(self) -> int:
        """Values that scales clipped (and NaNs) since the pools were made."""
        return int(self._saturated)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.moving())

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              slots: dict[int, SlotIndex]) -> None:
        """Store new keys/values k, v (N, H, D) at their slots (pool -> SlotIndex): quantized
        into store blocks, cast into hot ones, by the same store kernel (one compiled call where
        two indexed torch copies cost several times more)."""
        for pool, (idx, blk, off) in slots.items():
            every = isinstance(idx, slice)  # all the step's tokens: no copy (an op each)
            views = self.hot_views[layer] if pool == HOT else self.views[layer]
            for x, pl in zip((k, v), views):
                n_sat = self.store_fn(x if every else x[idx], pl.p, pl.data, pl.scale, pl.zero,
                                      blk, off)
                # hot blocks hold a plain cast, which no scale clips: not counted (an fp16
                # overflow to inf neither, as when they were torch copies)
                if pool != HOT and (not isinstance(n_sat, int) or n_sat):
                    self._saturated += n_sat  # (adding a Python 0 costs an op too)

    def read(self, layer: int, which: int, tables: dict[int, torch.Tensor],
             moving: list[torch.Tensor] | None = None) -> torch.Tensor:
        """K (which=0) or V (1) of one layer of one sequence, dequantized, from its blocks
        (tables: pool -> (1, MB) block ids, -1 where a block is elsewhere): (H, MB * BS, D).
        `moving` (blocks read from the offload tiers, as `layer` takes them) replaces the store's
        own tensors, tables[STORE] indexing them."""
        x = gather_dequant(self.layer(layer, moving)[which], tables[STORE])[0]  # (H, S, D)
        if HOT in tables:
            hot = gather_dequant(self.hot_views[layer][which], tables[HOT])[0]  # (H, S, D)
            block_size = self.hot.shape[-2]
            in_hot = (tables[HOT][0] >= 0).repeat_interleave(block_size)  # (S,)
            x = torch.where(in_hot[None, :, None], hot, x)
        return x

    def copy_within(self, pool: int, src: int, dst: int) -> None:
        """Copy one block to another slot of the same pool (copy on write)."""
        if pool == HOT:
            self.hot[:, :, dst] = self.hot[:, :, src]
            return
        for t in self.moving():
            t[:, dst] = t[:, src]

    def quantize_hot(self, hot_b: int, b: int) -> None:
        """Quantize hot block hot_b into store block b: its tokens through the store kernel, a
        layer at a time, as new tokens go (in torch `:mse`'s scale search cost tens of ms a
        block); formats whose scales span the block (block_wise) in torch."""
        block_size = self.hot.shape[-2]
        slots = (torch.full((block_size,), b, device=self.hot.device),  # each token's blk, off
                 torch.arange(block_size, device=self.hot.device))
        for g in self.groups:
            for i, pool in enumerate((g.k, g.v)):
                if pool.p.block_wise:
                    self._quantize_block(pool, self.hot[i, g.layers, hot_b], b)  # (L, H, BS, D)
                    continue
                count = pool.p.static or (pool.p.is_float and pool.p.dtype != "fp32")  # as torch
                for layer in g.layers:
                    x = self.hot[i, layer, hot_b].transpose(0, 1)  # (BS, H, D): its tokens
                    view = self.views[layer][i]  # made once: the kernels keep its arguments
                    n_sat = self.store_fn(x, view.p, view.data, view.scale, view.zero, *slots)
                    if count and (not isinstance(n_sat, int) or n_sat):
                        self._saturated += n_sat

    def _quantize_block(self, pool: StorePool, x: torch.Tensor, b: int) -> None:
        """x (L, H, BS, D) into block b of a pool whose scales span the block (block_wise:
        dynamic, neither static nor a plain cast, so nothing it stores is counted)."""
        scale, zero = compute_scales(x, pool.p)
        pool.scale[:, b] = scale
        if zero is not None:
            pool.zero[:, b] = zero
        pool.data[:, b] = quantize(x, pool.p, scale, zero, count=False)[0]


# ---- sizing: what a pool of a spec costs, and whether the machine holds it ---------------------
def store_blocks(cfg: Config, spec: KVSpec, *, tokens: int | None, blocks: int | None,
                 budget_bytes: int | None, block_size: int, max_seqs: int, max_step_tokens: int,
                 dtype: torch.dtype) -> int:
    """Blocks of the store pool: `blocks`, or as many as `budget_bytes` pays for (block_bytes), or
    enough for `tokens` tokens in all (fewer when every sequence holds at most an eviction
    budget)."""
    if sum(x is not None for x in (tokens, blocks, budget_bytes)) != 1:
        raise CacheError("size the cache by exactly one of tokens, blocks or budget_bytes")
    if blocks is None and budget_bytes is not None:
        per_block = block_bytes(cfg, spec, block_size, dtype)
        blocks = int(budget_bytes // per_block)
        if blocks < 1:
            raise CacheError(f"a KV budget of {budget_bytes} bytes holds no block of {block_size} "
                             f"tokens ({per_block:.0f} bytes under '{spec}')")
    if blocks is None and spec.evict not in ("", "snapkv"):  # a budget, a block, a step at most
        tokens = min(tokens, max_seqs * (spec.budget + 2 * block_size) + max_step_tokens)
    if blocks is None:
        blocks = max(8, math.ceil(tokens / block_size) + 2 * max_seqs)
    if blocks < 1:
        raise CacheError(f"the KV pool needs at least one block (got {blocks})")
    return blocks


def hot_dtype(spec: KVSpec, dtype: torch.dtype) -> torch.dtype:
    """What the hot pool holds its tokens in: the spec's hot= dtype, else the model's `dtype`."""
    return QuantParams(spec.hot).storage_dtype if spec.hot else dtype


def hot_blocks(spec: KVSpec, block_size: int, max_seqs: int, max_step_tokens: int) -> int:
    """Full-precision blocks a cache keeps: each sequence's sinks, residual window and tail, plus
    the blocks one step may fill before `commit` quantizes them, or, when larger, the blocks an
    eviction's compaction fills (it stores a whole budget again before quantizing it)."""
    uses_hot = spec.block_wise or spec.sink or spec.residual
    if not uses_hot:
        return 0
    per_seq = math.ceil(spec.sink / block_size) + math.ceil(spec.residual / block_size) + 2
    step = max_step_tokens // block_size
    if spec.evict:
        step = max(step, math.ceil(spec.budget / block_size) + 1)
    return per_seq * max_seqs + step


def block_bytes(cfg: Config, spec: KVSpec, block_size: int,
                dtype: torch.dtype = torch.float32) -> float:
    """Bytes of one store block, all layers, K and V (formats.bytes_per_token's formula); skipped
    layers store the model's dtype."""
    H, D = cfg.n_kv_heads, cfg.head_dim
    full = QuantParams(_FLOAT_NAMES[dtype])
    per_token = sum(bytes_per_token(p, H, D, block_size)
                    for kv in spec.layer_parts(cfg.n_layers, full) for p in kv)
    return per_token * block_size


def check_fits(cfg: Config, spec: KVSpec, *, blocks: int, n_hot: int, block_size: int,
               dtype: torch.dtype, device: torch.device, host_blocks: int) -> None:
    """Refuse, before allocating, a cache whose pools (the store and hot pools on the device, the
    host tier in CPU memory) the machine cannot hold."""
    per_block = block_bytes(cfg, spec, block_size, dtype)
    hot_bytes = (2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * block_size
                 * hot_dtype(spec, dtype).itemsize)
    check_memory(blocks * per_block + n_hot * hot_bytes, device)
    if host_blocks:  # the host tier lives in CPU memory
        check_memory(host_blocks * per_block, torch.device("cpu"))


def check_memory(need: float, device: torch.device) -> None:
    """Refuse, before allocating, a pool the machine cannot hold."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = available_memory()
    if free is not None and need > free:
        raise CacheError(f"the KV cache needs {need / 2**30:.1f} GiB but {free / 2**30:.1f} GiB "
                         f"of {device.type} memory is available; lower --device-blocks, "
                         "--kv-memory, residual= or sink=")


def available_memory() -> int | None:
    """Bytes of host memory available now (Linux' MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
