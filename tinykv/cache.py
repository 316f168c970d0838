"""The paged, quantized KV cache: a block pool, per-sequence block tables, and attention through it.

A block holds `block_size` tokens of K and V for every layer. Two pools share one allocator design:
the *store* pool keeps blocks in the spec's storage format (int8, packed int4, fp8, fp16, ...), the
*hot* pool keeps blocks in full precision while they must stay so: the tail block while per-block
scales (channel/head/tensor, dynamic) cannot be computed yet, `sink` blocks at the start and
`residual` blocks at the end (both rounded up to whole blocks). `commit` moves a block from hot
to store (quantizing it) once none of those reasons holds.

Full store blocks are hashed by their tokens and the previous block's hash, so a new sequence with
a known prefix reuses them; freed blocks keep their contents and hash until reallocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .blocks import DISK, HOST, HOT, STORE, Allocator, PoolExhausted, SeqState
from .kernels import PoolLayer, merge_partials, paged_attention_ref, quantize_store_ref
from .kernels_triton import paged_attention_triton, quantize_store_triton
from .model import Config
from .offload import Offloader
from .quant import KVSpec, QuantParams, compute_scales, quantize


@dataclass
class Plan:
    """Everything one forward step needs to know about where its tokens live."""
    cache: PagedKVCache
    seq_ids: list[int]
    positions: torch.Tensor  # (N,) absolute position of every packed token
    q_seq: torch.Tensor  # (N,) row of the sequence each token belongs to
    ctx_lens: torch.Tensor  # (B,) sequence lengths after this step
    tables: dict[int, torch.Tensor]  # pool -> (B, MB) block ids, -1 where the block is in the other pool
    slots: dict[int, tuple]  # pool -> (token idx (a slice for all), block, offset) tensors
    logits_idx: torch.Tensor | None  # packed rows whose logits are wanted (None: all)
    offload_chunks: list = field(default_factory=list)  # staged chunks of offloaded blocks (offload.py)


class PagedKVCache:
    def __init__(self, cfg: Config, spec: KVSpec, num_blocks: int, block_size: int = 16, max_seqs: int = 16,
                 max_step_tokens: int = 512, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 static_scales: dict[str, torch.Tensor] | None = None, attention: str = "torch",
                 host_blocks: int = 0, disk_dir: str | None = None, disk_blocks: int = 0, stage_blocks: int = 64):
        for p in (spec.k, spec.v):
            p.check(cfg.head_dim)
            if p.static and static_scales is None:
                raise ValueError(f"KV spec '{spec}' has static scales: pass a calibration file (--kv-scales)")
        self.cfg, self.spec, self.bs, self.device, self.dtype = cfg, spec, block_size, torch.device(device), dtype
        self.attention = attention
        L, H, D = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
        self.store = {"k": self._make_pool(spec.k, num_blocks, "k", static_scales),
                      "v": self._make_pool(spec.v, num_blocks, "v", static_scales)}
        self._views = [self.layer_views(i, [t[i] for t in self.block_tensors()]) for i in range(L)]  # made once
        self.needs_tail = spec.k.block_wise or spec.v.block_wise
        self.sink_blocks = math.ceil(spec.sink / block_size)
        self.res_blocks = math.ceil(spec.residual / block_size)
        # Hot blocks: each sequence's sink, residual window and tail, plus the blocks one step may
        # fill before `commit` quantizes them.
        uses_hot = self.needs_tail or spec.sink or spec.residual
        per_seq = self.sink_blocks + self.res_blocks + 2
        self.n_hot = per_seq * max_seqs + max_step_tokens // block_size if uses_hot else 0
        self.hot = torch.zeros(2, L, self.n_hot, H, block_size, D, dtype=dtype, device=device)  # K, V
        hp = QuantParams({torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype])
        self._hot_views = [[PoolLayer(self.hot[i, layer], None, None, hp) for i in (0, 1)] for layer in range(L)]
        self.alloc = {STORE: Allocator(num_blocks), HOT: Allocator(self.n_hot)}
        self.seqs: dict[int, SeqState] = {}
        self._saturated = torch.zeros((), dtype=torch.int64, device=device)  # on device: counting needs no sync
        self.peak_blocks = 0
        self.offload = Offloader(self, host_blocks, disk_dir, disk_blocks, stage_blocks) if host_blocks else None

    def _make_pool(self, p: QuantParams, nb: int, kv: str, static: dict | None) -> dict:
        L, H, D, BS = self.cfg.n_layers, self.cfg.n_kv_heads, self.cfg.head_dim, self.bs
        data = torch.zeros(L, nb, H, BS, D // p.per_byte, dtype=p.storage_dtype, device=self.device)
        pool = {"p": p, "data": data, "scale": None, "zero": None}
        if p.is_float:
            return pool
        if p.static:  # one set per layer, shared by every block: (L, 1, H|1, 1, G)
            pool["scale"] = static[f"{kv}_scale"].to(self.device, torch.float32).unsqueeze(1)
            if not p.sym:
                pool["zero"] = static[f"{kv}_zero"].to(self.device, torch.float32).unsqueeze(1)
            return pool
        shape = (L, nb, *p.scale_shape(H, BS, D))
        pool["scale"] = torch.ones(shape, dtype=torch.float16, device=self.device)
        if not p.sym:
            pool["zero"] = torch.zeros(shape, dtype=torch.float16, device=self.device)
        return pool

    # ---- memory -----------------------------------------------------------------------------------
    def block_tensors(self) -> list[torch.Tensor]:
        """Store-pool tensors (L, NB, ...) whose dim 1 is the block: what moves when a block moves."""
        return [t for pool in self.store.values() for name in ("data", "scale", "zero")
                if (t := pool[name]) is not None and (name == "data" or not pool["p"].static)]

    def layer_views(self, layer: int, per_block: list[torch.Tensor] | None = None) -> list[PoolLayer]:
        """K and V of one layer as kernels read them; per-block tensors may come from a staging buffer."""
        if per_block is None:
            return self._views[layer]
        it, out = iter(per_block), []
        for pool in self.store.values():
            got = {n: None if pool[n] is None else pool[n][layer] if n != "data" and pool["p"].static else next(it)
                   for n in ("data", "scale", "zero")}
            out.append(PoolLayer(got["data"], got["scale"], got["zero"], pool["p"]))
        return out

    @property
    def saturated(self) -> int:
        """Values that static scales clipped (and NaNs) since the cache was made."""
        return int(self._saturated)

    @property
    def num_blocks(self) -> int:
        return self.store["k"]["data"].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.block_tensors())

    @property
    def bytes_per_token(self) -> float:
        return self.nbytes / (self.num_blocks * self.bs)

    @property
    def blocks_used(self) -> int:
        return self.num_blocks - len(self.alloc[STORE].free)

    @property
    def blocks_free(self) -> int:
        return len(self.alloc[STORE].free)

    @property
    def blocks_free_total(self) -> int:
        """Free blocks on every tier a sequence may occupy (device, host, disk)."""
        return sum(len(a.free) for p, a in self.alloc.items() if p != HOT)

    # ---- sequences --------------------------------------------------------------------------------
    def add_sequence(self, seq_id: int, prompt: list[int] | None = None) -> int:
        """Start a sequence; returns how many prompt tokens are already cached (shared prefix blocks)."""
        assert seq_id not in self.seqs, f"sequence {seq_id} exists"
        st = self.seqs[seq_id] = SeqState()
        if not prompt or self.sink_blocks:  # sink blocks are per-sequence full precision: nothing to share
            st.last_hash = None if self.sink_blocks else 0
            return 0
        al, h = self.alloc[STORE], 0
        for j in range((len(prompt) - 1) // self.bs):  # keep >= 1 prompt token to compute logits from
            toks = prompt[j * self.bs:(j + 1) * self.bs]
            h = hash((h, tuple(toks)))
            b = al.table.get(h)
            if b is None:
                break
            al.incref(b)
            st.blocks.append((STORE, b))
            st.tokens += toks
            st.done, st.last_hash = st.done + 1, h
        return len(st.tokens)

    def fork(self, src: int, dst: int) -> None:
        """dst shares all of src's blocks; the first write to a shared block copies it."""
        s = self.seqs[src]
        for pool, b in s.blocks:
            self.alloc[pool].incref(b)
        self.seqs[dst] = SeqState(list(s.blocks), list(s.tokens), s.done, s.last_hash)

    def free(self, seq_id: int) -> None:
        for pool, b in self.seqs.pop(seq_id).blocks:
            self.alloc[pool].decref(b)
            if pool in (HOST, DISK) and self.alloc[pool].ref[b] == 0:
                self.offload.counts["blocks_freed_offloaded"] += 1

    def length(self, seq_id: int) -> int:
        return len(self.seqs[seq_id].tokens)

    def blocks_needed(self, seq_id: int, n_new: int) -> int:
        """Store blocks a step of n_new tokens may allocate (upper bound, for the scheduler)."""
        n = len(self.seqs[seq_id].tokens) if seq_id in self.seqs else 0
        return math.ceil((n + n_new) / self.bs) - n // self.bs + 1

    def _pool_for(self, j: int) -> int:
        """Where logical block j starts its life."""
        return HOT if self.needs_tail or j < self.sink_blocks or self.res_blocks > 0 else STORE

    def _new_block(self, j: int) -> tuple[int, int]:
        pool = self._pool_for(j)
        return pool, self.alloc[pool].alloc("full-precision" if pool == HOT else "KV")

    def _copy_block(self, pool: int, src: int, dst: int) -> None:
        if pool == HOT:
            self.hot[:, :, dst] = self.hot[:, :, src]
        else:
            for t in self.block_tensors():
                t[:, dst] = t[:, src]

    # ---- one step ---------------------------------------------------------------------------------
    def plan(self, seq_ids: list[int], new_tokens: list[list[int]], logits: str | list[int] = "last") -> Plan:
        """Allocate slots for each sequence's new tokens and build the step's metadata.

        `logits`: "all" rows, the "last" row of every sequence, or the last row of the listed sequences.
        """
        self._check_room(seq_ids, new_tokens)
        pos, q_seq, slot_rows = [], [], {STORE: ([], [], []), HOT: ([], [], [])}
        n = 0
        for row, (sid, toks) in enumerate(zip(seq_ids, new_tokens)):
            st = self.seqs[sid]
            start = len(st.tokens)
            for i in range(len(toks)):
                p = start + i
                j, off = divmod(p, self.bs)
                if j == len(st.blocks):
                    st.blocks.append(self._new_block(j))
                elif i == 0:  # first write into an existing block: bring it home, copy it if shared
                    if self.offload:
                        self.offload.swap_in(st, j)
                    pool, b = st.blocks[j]
                    if self.alloc[pool].ref[b] > 1:
                        nb = self.alloc[pool].alloc("KV")
                        self._copy_block(pool, b, nb)
                        self.alloc[pool].decref(b)
                        st.blocks[j] = (pool, nb)
                pool, b = st.blocks[j]
                for lst, val in zip(slot_rows[pool], (n, b, off)):
                    lst.append(val)
                pos.append(p)
                q_seq.append(row)
                n += 1
            st.tokens += toks
        self.peak_blocks = max(self.peak_blocks, self.blocks_used)
        dev = self.device
        mb = max(len(self.seqs[s].blocks) for s in seq_ids)
        tables = {}
        for pool in (STORE, HOT):
            t = torch.full((len(seq_ids), mb), -1, dtype=torch.int32)
            for row, sid in enumerate(seq_ids):
                for j, (pl, b) in enumerate(self.seqs[sid].blocks):
                    if pl == pool:
                        t[row, j] = b
            if pool == STORE or self.n_hot:
                tables[pool] = t.to(dev)
        chunks = []
        if self.offload:
            self.offload.note_step(seq_ids)
            one_pass = self.attention != "triton" and self.device.type == "cpu"  # see Offloader.plan_chunks
            chunks = self.offload.plan_chunks(seq_ids, mb, one_pass)
        ctx = torch.tensor([len(self.seqs[s].tokens) for s in seq_ids], dtype=torch.int32, device=dev)
        last = torch.cumsum(torch.tensor([len(t) for t in new_tokens]), 0) - 1
        as_index = lambda x: torch.tensor(x, dtype=torch.long, device=dev)
        slots = {pool: (slice(None) if len(idx) == n else as_index(idx), as_index(blk), as_index(off))
                 for pool, (idx, blk, off) in slot_rows.items() if idx}  # all tokens in one pool: no gather
        return Plan(self, list(seq_ids), torch.tensor(pos, dtype=torch.long, device=dev),
                    torch.tensor(q_seq, dtype=torch.int32, device=dev), ctx, tables, slots,
                    None if logits == "all" else last[logits if logits != "last" else slice(None)].to(dev), chunks)

    def _check_room(self, seq_ids: list[int], new_tokens: list[list[int]]) -> None:
        """Raise PoolExhausted, before touching anything, if the step (and its commit) may not fit."""
        need = {STORE: 0, HOT: 0}
        for sid, toks in zip(seq_ids, new_tokens):
            st = self.seqs[sid]
            n0, n1 = len(st.tokens), len(st.tokens) + len(toks)
            if n0 % self.bs and st.blocks:  # copy-on-write of a shared tail block, or its swap-in
                pool, b = st.blocks[-1]
                need[STORE if pool != HOT else HOT] += self.alloc[pool].ref[b] > 1 or pool in (HOST, DISK)
            for j in range(st.done, math.ceil(n1 / self.bs)):
                pool = st.blocks[j][0] if j < len(st.blocks) else self._pool_for(j)
                need[pool] += j >= len(st.blocks)
                # commit will quantize this hot block into the store: full, not a sink, out of the window
                need[STORE] += pool == HOT and j >= self.sink_blocks and (j + 1) * self.bs <= n1 - self.spec.residual
        if self.offload and need[STORE] > self.blocks_free:
            self.offload.make_room(need[STORE] - self.blocks_free, seq_ids)
        for pool, what in ((STORE, "KV"), (HOT, "full-precision")):
            free = len(self.alloc[pool].free)
            if need[pool] > free:
                raise PoolExhausted(f"KV block pool exhausted: this step needs {need[pool]} {what} blocks, "
                                    f"{free} of {len(self.alloc[pool].ref)} are free", pool)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: Plan) -> None:
        """Store the step's new keys/values (N, H, D): quantized into store blocks, as-is into hot ones."""
        if HOT in plan.slots:
            idx, blk, off = plan.slots[HOT]
            for i, x in enumerate((k, v)):
                self.hot[i, layer, blk, :, off] = x[idx].to(self.dtype)
        if STORE in plan.slots:
            idx, blk, off = plan.slots[STORE]
            store = quantize_store_triton if self.attention == "triton" else quantize_store_ref
            for x, pl in zip((k, v), self.layer_views(layer)):
                n_sat = store(x[idx], pl.p, pl.data, pl.scale, pl.zero, blk, off)
                if not isinstance(n_sat, int) or n_sat:  # adding a Python 0 would still cost an op per layer
                    self._saturated += n_sat

    def attend(self, layer: int, q: torch.Tensor, plan: Plan) -> torch.Tensor:
        """Attention of the step's queries (N, Hq, D) over everything cached for their sequences."""
        sm = 1.0 / math.sqrt(self.cfg.head_dim)
        fn = paged_attention_triton if self.attention == "triton" else paged_attention_ref
        run = lambda k, v, table: fn(q, plan.q_seq, plan.positions, k, v, table, plan.ctx_lens, sm)
        one_pass = plan.offload_chunks and STORE in plan.offload_chunks[0][1]  # resident blocks ride along
        parts = [] if one_pass else [run(*self.layer_views(layer), plan.tables[STORE])]
        if plan.offload_chunks:
            parts += self.offload.attend_parts(layer, q, plan, fn, sm)
        if HOT in plan.tables:
            parts.append(run(*self._hot_views[layer], plan.tables[HOT]))
        return merge_partials(parts)[0].to(q.dtype)

    def commit(self, plan: Plan) -> None:
        """After a forward step: quantize hot blocks that no longer need full precision; hash full blocks."""
        for sid in plan.seq_ids:
            st = self.seqs[sid]
            n = len(st.tokens)
            while st.done < n // self.bs:  # blocks become final in order, oldest first
                j = st.done
                pool, b = st.blocks[j]
                if pool == HOT and j >= self.sink_blocks and (j + 1) * self.bs > n - self.spec.residual:
                    break  # still inside the residual window (or the tail awaiting its block scales)
                st.done += 1
                if j < self.sink_blocks:
                    continue  # sinks stay in full precision for good (and so nothing after them is shared)
                h = None if self.sink_blocks else hash((st.last_hash, tuple(st.tokens[j * self.bs:(j + 1) * self.bs])))
                if pool == HOT:
                    st.blocks[j] = (STORE, self._migrate(b, h))
                elif h is not None:
                    self.alloc[STORE].register(b, h)
                st.last_hash = h

    def _migrate(self, hot_b: int, h: int | None) -> int:
        """Quantize one hot block into the store pool (or reuse an identical block already there)."""
        al = self.alloc[STORE]
        b = None if h is None else al.table.get(h)
        if b is not None:
            al.incref(b)
        else:
            b = al.alloc("KV")
            for i, kv in enumerate("kv"):
                pool = self.store[kv]
                p, x = pool["p"], self.hot[i, :, hot_b]  # (L, H, BS, D): all layers at once
                if p.static:
                    scale, zero = pool["scale"][:, 0], None if pool["zero"] is None else pool["zero"][:, 0]
                elif p.is_float:
                    scale = zero = None
                else:
                    scale, zero = compute_scales(x, p)
                    pool["scale"][:, b] = scale
                    if zero is not None:
                        pool["zero"][:, b] = zero
                q, nsat = quantize(x, p, scale, zero, count=p.static)
                pool["data"][:, b] = q
                self._saturated += nsat
            if h is not None:
                al.register(b, h)
        self.alloc[HOT].decref(hot_b)
        return b
