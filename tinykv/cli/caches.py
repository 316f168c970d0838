"""The KV cache the flags describe: its pool's size (--device-blocks, --kv-memory, or what the
requests need), its kernels and offload tiers (a disk tier's folder made for the run and removed
after it), its scale file, and the checks that a run fits before it starts."""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import torch

from ..cache import PagedKVCache, block_bytes, make_cache
from ..model import Transformer
from ..offload import OffloadConfig
from ..outputs import remove_empty
from ..spec import KVSpec
from .inputs import UsageError


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


def check_disk_space(model: Transformer, spec: KVSpec, args) -> None:
    """The disk tier fits on its disk. Asked before the cache is built: its block tables are sized
    by --disk-blocks, so a huge count would take minutes before the tier itself could refuse."""
    dtype = next(model.parameters()).dtype
    need = args.disk_blocks * block_bytes(model.cfg, spec, args.block_size, dtype)
    folder = Path(args.disk_dir).absolute()
    there = next(d for d in (folder, *folder.parents) if d.exists())
    free = shutil.disk_usage(there).free
    if need > free:
        raise UsageError(f"the disk tier needs {need / 2**30:.1f} GiB but {there} has "
                         f"{free / 2**30:.1f} GiB free; lower --disk-blocks")


def run_disk_dir(stack: ExitStack, disk_dir: str) -> str:
    """A folder of this run's own inside --disk-dir for the disk tier's file, removed with all it
    holds when `stack` closes, whatever ends the run; the folders above it that the run created
    are removed too when they are left empty."""
    root = Path(disk_dir).absolute()
    created = [d for d in (root, *root.parents) if not d.exists()]
    root.mkdir(parents=True, exist_ok=True)
    stack.callback(remove_empty, created)
    mine = tempfile.mkdtemp(prefix="tinykv-run-", dir=root)
    stack.callback(shutil.rmtree, mine, ignore_errors=True)
    return mine


def open_cache(stack: ExitStack, model: Transformer, args, spec: KVSpec, tokens: int,
               max_seqs: int, max_step_tokens: int) -> PagedKVCache:
    """The cache the flags describe, closed (its disk file deleted) when `stack` closes."""
    scales = scales_of(args, model, spec)
    p = next(model.parameters())
    cache = make_cache(model.cfg, spec, **pool_size(args, tokens), scales=scales,
                       **cache_options(stack, model, args, spec), max_seqs=max_seqs,
                       max_step_tokens=max_step_tokens, device=p.device, dtype=p.dtype)
    stack.enter_context(cache)
    check_evict_fits(cache)
    return cache


WARM_STEPS = 2  # the warm-up's decode steps


def warm_kernels(model: Transformer, args, spec: KVSpec) -> None:
    """A prompt of one block, then two decode steps, through a cache of its own in the run's KV
    format, block size and attention kernels: numba compiles those kernels here (a fresh
    install, a new format) or loads them from its cache, not inside the run's first steps,
    whose time the prefill and decode rates count. A full block is what per-channel keys need
    before their block is quantized."""
    from ..generate import Engine, Sampling

    p = next(model.parameters())
    prompt = max(1, min(args.block_size, model.cfg.max_seq_len - WARM_STEPS))
    cache = make_cache(model.cfg, spec, tokens=prompt + WARM_STEPS,
                       scales=scales_of(args, model, spec), attention=args.attention,
                       block_size=args.block_size, max_seqs=1, max_step_tokens=prompt,
                       device=p.device, dtype=p.dtype)
    with cache:
        eng = Engine(model, cache, max_batch=1, prefill_chunk=prompt)
        eng.add([model.cfg.bos_token_id or 0] * prompt,
                Sampling(temperature=0.0, max_new_tokens=WARM_STEPS))
        for _ in eng.run():
            pass


def scales_of(args, model: Transformer, spec: KVSpec) -> dict[str, torch.Tensor] | None:
    """The --kv-scales file's tensors for a spec that takes them."""
    if not (args.kv_scales and spec.needs_scales):
        return None
    from ..scalefile import load_scales

    return load_scales(args.kv_scales, model.cfg, spec)


def pool_size(args, tokens: int) -> dict[str, int]:
    """make_cache's size: --device-blocks, --kv-memory, or what `tokens` tokens need."""
    if args.device_blocks:
        return {"blocks": args.device_blocks}
    if args.kv_memory:
        return {"budget_bytes": args.kv_memory}
    return {"tokens": tokens}


def cache_options(stack: ExitStack, model: Transformer, args, spec: KVSpec) -> dict:
    """make_cache's attention, block size and offload tiers from the flags; a disk tier's folder
    is removed when `stack` closes."""
    disk_dir = None
    if args.disk_dir and args.disk_blocks:
        check_disk_space(model, spec, args)
        disk_dir = run_disk_dir(stack, args.disk_dir)
    # a staging buffer larger than the tiers it stages from would only take memory
    stage = min(args.stage_blocks, max(1, args.host_blocks + args.disk_blocks))
    offload = OffloadConfig(args.host_blocks, disk_dir, args.disk_blocks, stage)
    return {"attention": args.attention, "block_size": args.block_size, "offload": offload}


def check_evict_fits(cache: PagedKVCache) -> None:
    """Compaction stores a sequence's kept tokens on the device at once: the device pool must
    hold an evict= budget, whatever the offload tiers hold."""
    spec = cache.spec
    need = math.ceil(spec.budget / cache.bs)
    if spec.evict and cache.num_blocks < need:
        raise UsageError(f"evict={spec.evict}:{spec.budget} keeps {spec.budget} tokens per "
                         f"sequence on the device when it compacts ({need} blocks of "
                         f"{cache.bs}), but the device pool holds {cache.num_blocks}: raise "
                         "--device-blocks or --kv-memory, or lower the budget")


def check_fits(cache: PagedKVCache, args, n_tokens: int, what: str) -> None:
    """Refuse up front a sequence the pool and its offload tiers can never hold: `what` (a
    window, a prompt) of n_tokens fed whole. Counted leniently (full blocks past the sinks and
    the residual window, which may sit in full-precision blocks), so that nothing that would run
    is refused; eviction bounds a sequence, but for snapkv, which keeps a whole prompt first."""
    spec = cache.spec
    if spec.evict not in ("", "snapkv"):
        return
    tiers = cache.num_blocks + args.host_blocks + args.disk_blocks
    need = max(0, n_tokens - spec.sink - spec.residual) // cache.bs
    if tiers < need:
        raise UsageError(f"{what} needs {need} blocks of {cache.bs} tokens, but the KV pool "
                         f"holds {cache.num_blocks} (and the offload tiers "
                         f"{tiers - cache.num_blocks}): raise --device-blocks, --kv-memory or "
                         "--host-blocks")


def check_scale_use(model: Transformer, tokens: list[int], spec: KVSpec,
                    scales: dict[str, torch.Tensor] | None) -> None:
    """Warn when static scales leave nearly every stored value within a step or two of zero
    (calibrate.levels_used): too large a scale clips nothing, so no saturation count shows it."""
    if scales is None or not (spec.k.static or spec.v.static):
        return
    from ..calibrate import levels_used

    for name, steps in levels_used(model, tokens[:256], spec, scales).items():
        if steps < 2:
            warn(f"the static scales of {name} are far too large for this input: 99.9% of its "
                 f"values are within {steps:.2g} steps of zero, so they round away (recalibrate "
                 "on text like this, for this model)")
