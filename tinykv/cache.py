"""The paged, quantized KV cache: `make_cache(...)` builds one; `plan()` gives a step's tokens their
slots; the model calls `plan.attend(layer, q, k, v)` in each layer; `commit()` finishes the step.

The cache joins parts each readable alone: the block tables (tables.py: integers), the pools
(pools.py: tensors), the offload tiers (offload.py), the eviction policy (evict.py) and a step's
`Plan` (plan.py). Here: the plan made; attention over the store pool, the hot blocks and offloaded
chunks, merged exactly by log-sum-exp; eviction's keeping. The kernels are chosen once, when the
cache is built (kernels/).
"""

from __future__ import annotations

import math

import torch

from . import evict
from .blocks import DISK, HOST, HOT, STORE, CacheError, PoolExhausted
from .kernels import Kernels, select_kernels
from .model import Config
from .offload import OffloadConfig, Offloader, is_one_pass
from .plan import Plan
from .pools import KVPools, SlotIndex, block_bytes, check_fits, hot_blocks, store_blocks
from .quant import layer_transforms
from .spec import KVSpec
from .tables import BlockTables, Slots

__all__ = ["CacheError", "Kernels", "PagedKVCache", "Plan", "PoolExhausted", "block_bytes",
           "hot_blocks", "make_cache", "select_kernels"]


class PagedKVCache:
    """One cache: tables, pools, kernels and the offload tiers, built by `make_cache`."""

    def __init__(self, cfg: Config, spec: KVSpec, *, num_blocks: int, block_size: int,
                 kernels: Kernels, max_seqs: int = 16, max_step_tokens: int = 512,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 scales: dict[str, torch.Tensor] | None = None,
                 offload: OffloadConfig | None = None):
        self.cfg, self.spec, self.bs, self.kernels = cfg, spec, block_size, kernels
        self.device, self.dtype = torch.device(device), dtype
        self.transforms = [t.to(self.device, dtype) for t in
                           layer_transforms(spec, cfg.n_layers, cfg.head_dim, scales)]
        self.n_hot = hot_blocks(spec, block_size, max_seqs, max_step_tokens)
        self.pools = KVPools(cfg, spec, num_blocks=num_blocks, n_hot=self.n_hot,
                             block_size=block_size, device=self.device, dtype=dtype,
                             static=scales, store_fn=kernels.store)
        offload_cfg = offload or OffloadConfig()
        disk_blocks = offload_cfg.disk_blocks if offload_cfg.disk_dir else 0
        self.tables = BlockTables(num_blocks=num_blocks, n_hot=self.n_hot, block_size=block_size,
                                  sink=spec.sink, residual=spec.residual,
                                  needs_tail=spec.block_wise, data=self,
                                  host_blocks=offload_cfg.host_blocks, disk_blocks=disk_blocks)
        self.offload = None
        if offload_cfg.host_blocks:
            self.offload = Offloader(self.pools.moving(), offload_cfg, self.device,
                                     self.pools.layer_rows)
        self.sm_scale = 1.0 / math.sqrt(cfg.head_dim)
        self.eviction = evict.Policy.from_spec(spec)  # None: the spec evicts nothing
        self.scores = None  # attention received, for the policies that keep what it went to
        if self.eviction is not None and self.eviction.scores_attention:
            self.scores = evict.Scores(self.eviction, cfg.n_layers, cfg.n_kv_heads)

    # ---- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the offload tiers (the disk tier's file is deleted)."""
        if self.offload is not None:
            self.offload.close()

    def __enter__(self) -> PagedKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- memory ---------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pools.groups[0].k.data.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the store pool's tensors (data, scales, zero points)."""
        return self.pools.nbytes

    @property
    def bytes_per_token(self) -> float:
        return self.nbytes / (self.num_blocks * self.bs)

    @property
    def blocks_free(self) -> int:
        return self.tables.free_blocks()

    @property
    def saturated(self) -> int:
        """Values that static scales clipped (and NaNs) since the cache was made."""
        return self.pools.saturated

    def offload_stats(self) -> dict:
        """Blocks and bytes moved between tiers, and the tiers' use now."""
        out = dict(self.tables.tiers.counts) | dict(self.offload.counts)
        out["peak_device_blocks"] = self.tables.peak_blocks
        out["host_blocks_used"] = self.tables.used_blocks(HOST)
        out["disk_blocks_used"] = self.tables.used_blocks(DISK) if DISK in self.tables.alloc else 0
        return out

    # ---- sequences (tables.py) ------------------------------------------------------------------
    def add_sequence(self, seq_id: int, prompt: list[int] | None = None) -> int:
        """Start a sequence; returns how many prompt tokens are already cached (shared prefix)."""
        return self.tables.add_sequence(seq_id, prompt)

    def fork(self, src: int, dst: int) -> None:
        self.tables.fork(src, dst)

    def free(self, seq_id: int) -> None:
        self.tables.free(seq_id)
        if self.scores is not None:
            self.scores.forget(seq_id)

    def slots(self, seq_id: int) -> int:
        """Cache slots a sequence holds: its length less what eviction dropped."""
        return self.tables.seqs[seq_id].slots

    # ---- BlockData: what the tables ask of the tensors ------------------------------------------
    def copy_block(self, src_tier: int, src: int, dst_tier: int, dst: int) -> None:
        if src_tier == dst_tier:
            self.pools.copy_within(src_tier, src, dst)
        else:
            self.offload.copy(src_tier, src, dst_tier, dst)

    def quantize_hot(self, hot_block: int, store_block: int) -> None:
        self.pools.quantize_hot(hot_block, store_block)

    # ---- one step -------------------------------------------------------------------------------
    def plan(self, seq_ids: list[int], new_tokens: list[list[int]],
             logits: str | list[int] = "last") -> Plan:
        """Slots for each sequence's new tokens, and the step's metadata as tensors: normal ones
        even under inference_mode, whose version counts let the kernels keep what they convert
        from them for the whole step. `logits`: "all" rows, the "last" row of every sequence, or
        the last row of listed ones."""
        with torch.inference_mode(False):
            slots = self.tables.assign(seq_ids, new_tokens)
            dev = self.device
            tables = self._tables(seq_ids)
            chunks = []
            if self.offload:
                one_pass = self.kernels.reads_host_memory
                tiers = (STORE, HOST, DISK) if one_pass else (HOST, DISK)
                entries = self.tables.placed(seq_ids, tiers)
                chunks = self.offload.plan_chunks(entries, len(seq_ids), tables[STORE].shape[1],
                                                  one_pass)
            lens = [self.tables.seqs[s].slots for s in seq_ids]
            last = torch.cumsum(torch.tensor([len(t) for t in new_tokens]), 0) - 1  # (B,)
            logits_idx = None
            sampled = [True] * len(seq_ids)
            if logits == "last":
                logits_idx = last.to(dev)
            elif logits != "all":
                logits_idx = last[logits].to(dev)
                sampled = [row in set(logits) for row in range(len(seq_ids))]
            step_slots = self._step_slots(slots)
            if self.scores is not None:
                for sid, toks in zip(seq_ids, new_tokens):
                    self.scores.prepare(sid, self.slots(sid), len(toks), self.device)
            positions = _index(slots.positions, dev)
            q_slots = positions
            if slots.q_slots != slots.positions:  # evicted tokens: slots lag positions
                q_slots = _index(slots.q_slots, dev)
            return Plan(cache=self, seq_ids=list(seq_ids), positions=positions, q_slots=q_slots,
                        q_seq=torch.tensor(slots.q_seq, dtype=torch.int32, device=dev),
                        ctx_lens=torch.tensor(lens, dtype=torch.int32, device=dev), tables=tables,
                        slots=step_slots, logits_idx=logits_idx, offload_chunks=chunks,
                        n_new=[len(t) for t in new_tokens], sampled=sampled)

    def _step_slots(self, slots: Slots) -> dict[int, SlotIndex]:
        """The tables' slots of a step as tensors, per pool that the step writes to."""
        return {pool: SlotIndex.of(rows, slots.n_tokens, self.device)
                for pool, rows in slots.rows.items() if rows.token}

    def _tables(self, seq_ids: list[int]) -> dict[int, torch.Tensor]:
        """pool -> (B, MB) block ids of these sequences, -1 where a block is elsewhere."""
        out = {}
        for tier in (STORE, HOT) if self.n_hot else (STORE,):
            rows = self.tables.table_rows(seq_ids, tier)
            out[tier] = torch.tensor(rows, dtype=torch.int32).to(self.device)
        return out

    def attend(self, layer: int, q: torch.Tensor, plan: Plan) -> torch.Tensor:
        """Attention of the step's queries (N, Hq, D) over everything cached for their sequences."""
        parts = []
        chunks = plan.offload_chunks
        if not is_one_pass(chunks):  # else resident blocks ride along in the one chunk
            k, v = self.pools.layer(layer)
            parts.append(self._attend_pool(q, plan, k, v, plan.tables[STORE]))
        if chunks:
            def attend_staged(bufs: list[torch.Tensor], table: torch.Tensor) -> tuple:
                k, v = self.pools.layer(layer, bufs)
                return self._attend_pool(q, plan, k, v, table)
            parts += self.offload.attend_parts(layer, chunks, attend_staged)
        if HOT in plan.tables:
            k, v = self.pools.hot_views[layer]
            parts.append(self._attend_pool(q, plan, k, v, plan.tables[HOT]))
        o = self.kernels.merge(parts)[0]  # (N, Hq, D) float32
        return o if o.dtype == q.dtype else o.to(q.dtype)  # `to` costs an op even as a no-op

    def _attend_pool(self, q, plan: Plan, k, v, table) -> tuple[torch.Tensor, torch.Tensor]:
        """(o, lse) of the queries over one pool's blocks `table` (B, MB)."""
        return self.kernels.attend(q, plan.q_seq, plan.q_slots, k, v, table, plan.ctx_lens,
                                   self.sm_scale)

    def commit(self, plan: Plan) -> None:
        """After a forward step: quantize hot blocks that no longer need full precision; hash;
        compact sequences over their eviction budget."""
        self.tables.commit(plan.seq_ids)
        if self.eviction is None:
            return
        for sid, n_new, sampled in zip(plan.seq_ids, plan.n_new, plan.sampled):
            if self.eviction.due(self.slots(sid), n_new, sampled, self.bs):
                self.compact(sid)

    # ---- eviction (evict.py decides, the cache keeps) -------------------------------------------
    def score_attention(self, layer: int, q: torch.Tensor, plan: Plan) -> None:
        """Add the attention the step's queries q (N, Hq, D) pay each cached slot of their
        sequence to its eviction scores, for the queries the policy scores."""
        start = 0
        for row, (sid, n_new) in enumerate(zip(plan.seq_ids, plan.n_new)):
            rows = self.eviction.scored_rows(start, n_new, plan.sampled[row])
            start += n_new
            if rows is None:
                continue
            n = int(plan.ctx_lens[row])
            tables = {tier: t[row:row + 1] for tier, t in plan.tables.items()}
            keys = self._read(layer, 0, sid, tables)[:, :n]  # (H, n, D)
            got = evict.attention_received(q[rows], plan.q_slots[rows], keys, self.sm_scale)
            self.scores.add(sid, layer, got)  # (H, n)

    def compact(self, seq_id: int) -> None:
        """Evict a sequence down to its budget now: the policy picks, keep_only keeps."""
        k, v = self.seq_kv(seq_id)  # (L, H, n, D)
        score = None if self.scores is None else self.scores.get(seq_id, k.shape[2])
        kept = self.eviction.keep(k, score)  # (L, H, budget)
        self.keep_only(seq_id, kept, (k, v))
        if self.scores is not None:
            self.scores.keep_only(seq_id, kept)

    def keep_only(self, seq_id: int, kept: torch.Tensor,
                  kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Keep only the slots `kept` (L, H, n_keep), ascending, of a sequence, per layer and KV
        head: stored again from slot 0 through the ordinary store path, the tables rewritten,
        every other block freed. kv: the sequence's seq_kv, when the caller has read it."""
        k, v = self.seq_kv(seq_id) if kv is None else kv  # (L, H, n, D)
        idx = kept[..., None].expand(-1, -1, -1, k.shape[-1])  # (L, H, n_keep, D)
        k, v = k.gather(2, idx), v.gather(2, idx)  # (L, H, n_keep, D)
        slots = self._step_slots(self.tables.rewrite(seq_id, kept.shape[-1]))
        for layer in range(k.shape[0]):
            self.pools.write(layer, k[layer].transpose(0, 1), v[layer].transpose(0, 1), slots)
        self.tables.commit([seq_id])

    def seq_kv(self, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's keys and values as stored, dequantized: (L, H, slots, D) each, float32."""
        tables, layers = self._tables([seq_id]), range(self.cfg.n_layers)
        k = torch.stack([self._read(layer, 0, seq_id, tables) for layer in layers])
        v = torch.stack([self._read(layer, 1, seq_id, tables) for layer in layers])
        return k[..., :self.slots(seq_id), :], v[..., :self.slots(seq_id), :]  # (L, H, slots, D)

    def _read(self, layer: int, which: int, seq_id: int, tables: dict) -> torch.Tensor:
        """pools.read of one sequence, whose offloaded blocks are read where they lie: the
        device that offloaded them may have no room to take them back (snapkv compacts a whole
        prompt longer than the device pool)."""
        if not (self.offload and self.tables.placed([seq_id], (HOST, DISK))):
            return self.pools.read(layer, which, tables)
        entries = self.tables.placed([seq_id], (STORE, HOST, DISK))
        table, rows = self.offload.read_blocks(layer, entries, tables[STORE].shape[1])
        return self.pools.read(layer, which, {**tables, STORE: table}, rows)


def _index(x: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.long, device=device)


def make_cache(cfg: Config, spec: KVSpec | str, *, tokens: int | None = None,
               blocks: int | None = None, budget_bytes: int | None = None,
               scales: dict[str, torch.Tensor] | None = None, attention: str = "auto",
               block_size: int = 16, max_seqs: int = 16, max_step_tokens: int = 512,
               offload: OffloadConfig | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> PagedKVCache:
    """The one way to build a cache. The store pool holds `blocks` blocks, or as many as
    `budget_bytes` pays for (the spec's formula), or enough for `tokens` tokens in all. Use it as a
    context manager (or call close()) so that a disk tier's file never outlives the run."""
    spec = KVSpec.parse(spec) if isinstance(spec, str) else spec
    device = torch.device(device)
    _check_request(cfg, spec, scales, block_size)
    blocks = store_blocks(cfg, spec, tokens=tokens, blocks=blocks, budget_bytes=budget_bytes,
                          block_size=block_size, max_seqs=max_seqs,
                          max_step_tokens=max_step_tokens, dtype=dtype)
    n_hot = hot_blocks(spec, block_size, max_seqs, max_step_tokens)
    check_fits(cfg, spec, blocks=blocks, n_hot=n_hot, block_size=block_size, dtype=dtype,
               device=device, host_blocks=offload.host_blocks if offload else 0)
    kernels = select_kernels(attention, device)
    return PagedKVCache(cfg, spec, num_blocks=blocks, block_size=block_size, kernels=kernels,
                        max_seqs=max_seqs, max_step_tokens=max_step_tokens, device=device,
                        dtype=dtype, scales=scales, offload=offload)


def _check_request(cfg: Config, spec: KVSpec, scales: dict[str, torch.Tensor] | None,
                   block_size: int) -> None:
    """A one-line CacheError (or SpecError) for a cache that cannot be built as asked."""
    spec.check(cfg.n_layers, cfg.head_dim)  # every layer it names exists; its formats fit
    if spec.needs_scales and scales is None:
        raise CacheError(f"KV spec '{spec}' has static scales, centers or smoothing maps: pass "
                         "a calibration file (--kv-scales)")
    if block_size < 1:
        raise CacheError(f"block size {block_size} must be >= 1")
    if spec.evict and spec.budget < spec.sink + spec.residual + 1:
        raise CacheError(f"evict budget {spec.budget} must exceed sink + residual "
                         f"({spec.sink + spec.residual}): they count against it")
