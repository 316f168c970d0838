"""Where a CPU attention call's time goes (`python -m tinykv bench kernel --cpu --parts`).

The vector kernel compiled with one half of its per-tile work left out (cpu_vector's `parts`):
- keys: the scores of a tile's keys (reading their codes and scales, the dot products, the
  transpose-and-add tree, the scales and zero points folded in);
- values: the value sums (reading each key's value codes, the weights times them, the
  accumulators; the next block's rows are asked for there too);
- the rest: what runs with both left out: the softmax of every tile (2^x, the running maximum,
  the sums of weights), the walk over the block table, each work item's start and end, and the
  call's fixed cost (bench/attention.py's fixed_costs).
Each is timed on one layer's pool read again and again, so it stays in the caches: this is the
math and the instructions alone, not the wait on DRAM (the main table's "in cache" column is the
whole kernel timed the same way). keys = (keys alone) - (the rest), values likewise; "overlap" is
the whole call less the three, negative where the halves run faster together than apart.
"in L1": the whole call again, every row's block table cycling over the same two blocks, so
that its K/V stay in L1 (two blocks of the benchmark's shape: 12 KiB as int8, 24 as fp16): the
work alone, without even the moves from L2 that "whole" pays where a pool outgrows L1.
One thread, every spec and part in turn within each repetition; medians.
"""

from __future__ import annotations

import statistics

import torch

from ..spec import KVSpec
from .attention import KIVI, SHAPE, decode_queries, make_pool, pseudo_layers, timed

IN_L1 = "in L1"  # the whole call on a table of two blocks (measure)


def _two_blocks(table: torch.Tensor) -> torch.Tensor:
    """A table (B, MB) of the same shape whose every row walks table[0, 0], table[0, 1] in turn:
    the same keys a row, from 2 blocks' bytes."""
    pick = table[0, torch.arange(table.shape[1]) % min(2, table.shape[1])]  # (MB,)
    return pick.expand_as(table).contiguous()


def _variants() -> dict[str, int]:
    from ..kernels.cpu_vector import ALL, KEYS, VALUES

    return {"whole": ALL, "keys": KEYS, "values": VALUES, "rest": 0}


def vector_takes(spec: str) -> bool:
    """Whether the vector kernel (the one with parts) reads this spec at the benchmark's shape."""
    from ..kernels.cpu_args import PoolArrays, pool_arrays
    from ..kernels.cpu_vector import head_share, takes

    H, R, D, BS = (SHAPE[k] for k in ("kv_heads", "n_rep", "head_dim", "block_size"))
    kv, gen = KVSpec.parse(spec), torch.Generator().manual_seed(0)
    kf, k_arrays = pool_arrays(make_pool(kv.k, 1, gen), H, BS, D)
    vf, _ = pool_arrays(make_pool(kv.v, 1, gen), H, BS, D)
    group = k_arrays[PoolArrays._fields.index("group_size")]  # a plain tuple in that order
    return takes(kf, vf, head_share(R, D), D, BS, D // group)


def measure(specs: list[str], batch: int, context: int, reps: int) -> dict:
    """(spec, part) -> median seconds of one in-cache layer call that runs only that part."""
    from ..kernels.cpu import CpuKernels

    D = SHAPE["head_dim"]
    q, q_seq, q_pos, ctx_lens = decode_queries(batch, context)
    layer = {s: pseudo_layers(KVSpec.parse(s), batch, context, 1)[0] for s in specs}
    kernels = {(s, name): CpuKernels(parts=parts) for s in specs
               for name, parts in _variants().items()}
    in_l1 = {s: _two_blocks(x.table) for s, x in layer.items()}
    kernels.update({(s, IN_L1): CpuKernels() for s in specs})

    def attend(key: tuple[str, str]) -> None:
        x = layer[key[0]]
        table = in_l1[key[0]] if key[1] == IN_L1 else x.table
        kernels[key].attend(q, q_seq, q_pos, x.k, x.v, table, ctx_lens, D**-0.5)

    for key in kernels:  # compile, fault the pages in
        attend(key)
    times = {key: [] for key in kernels}
    for _ in range(reps):
        for key in kernels:
            times[key].append(timed(attend, key))
    return {key: statistics.median(t) for key, t in times.items()}


def collect(specs: list[str], shapes: list[tuple[int, int]], reps: int, clock_ghz: float) -> list:
    """A row per shape and spec the vector kernel reads: ms of the whole call and its parts, and
    cycles per key and KV head of each."""
    specs = [s for s in specs if vector_takes(s)]
    rows = []
    for batch, context in shapes:
        got = measure(specs, batch, context, reps)
        keys = batch * context * SHAPE["kv_heads"]
        for s in specs:
            rest = got[s, "rest"]
            ms = {"whole": got[s, "whole"], "keys": got[s, "keys"] - rest,
                  "values": got[s, "values"] - rest, "rest": rest}
            ms["overlap"] = ms["whole"] - ms["keys"] - ms["values"] - rest
            ms["l1"] = got[s, IN_L1]
            rows.append({"kv": s, "batch": batch, "context": context,
                         **{f"{k}_ms": 1e3 * t for k, t in ms.items()},
                         **{f"{k}_cycles": t * clock_ghz * 1e9 / keys for k, t in ms.items()}})
    return rows


def render(rows: list[dict], kivi: str) -> str:
    """The table (Markdown): ms, then cycles per key and KV head in brackets."""
    heads = {p: p for p in ("whole", "keys", "values", "rest", "overlap")}  # part -> column
    heads["l1"] = "whole, K/V in L1"
    lines = ["Where a call's time goes, K/V in cache, one thread: ms (cycles per key and KV head)."
             " keys, values: that half's work alone less the rest's; the rest: the softmax, the"
             " block walk, each item's start and end, the call's fixed cost; overlap: the whole"
             " less the three; in L1: the whole call on two blocks' K/V (every row's table"
             " cycling over them).", "",
             "| KV spec | batch x ctx | " + " | ".join(heads.values()) + " |",
             "|---|---|" + "---|" * len(heads)]
    for r in rows:
        name = "KIVI-style" if r["kv"].startswith(kivi) else r["kv"]
        cells = [f"{r[p + '_ms']:.3f} ({r[p + '_cycles']:.0f})" for p in heads]
        lines.append(f"| `{name}` | {r['batch']}x{r['context']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def where_time_goes(specs: list[str], shapes: list[tuple[int, int]], reps: int,
                    clock_ghz: float) -> tuple[list, str]:
    """(rows, table): what bench/attention.run's `parts` asks for."""
    rows = collect(specs, shapes, reps, clock_ghz)
    return rows, render(rows, KIVI)
