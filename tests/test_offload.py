"""Offload tiers: a device pool of a few blocks gives the same outputs as one large enough."""

import pytest
import torch
from test_cache import tiny

import tinykv.generate as gen_mod
from tinykv.cache import make_cache
from tinykv.generate import Engine, Sampling
from tinykv.kernels.reference import merge_partials
from tinykv.offload import DISK, HOST, STORE, OffloadConfig, OffloadError
from tinykv.spec import KVSpec


def generate(m, spec, prompts, num_blocks, attention="auto", **offload_kw):
    """Greedy tokens of each prompt, the logits of every sample (grouped by request, in order),
    and the cache (with the engine's preemption count)."""
    offload = OffloadConfig(**offload_kw) if offload_kw else None
    weight = next(m.parameters())
    cache = make_cache(m.cfg, KVSpec.parse(spec), blocks=num_blocks, block_size=8,
                       max_seqs=len(prompts), attention=attention, offload=offload,
                       device=weight.device, dtype=weight.dtype)
    # the same prefill chunks for every pool size
    eng = Engine(m, cache, max_batch=len(prompts), prefill_chunk=24)
    s = Sampling(temperature=0, max_new_tokens=10)
    rids = [eng.add(prompt, s) for prompt in prompts]
    rows = []  # the logits of every sample, in the order the engine samples
    orig_sample = gen_mod.sample

    def sample(row, *args):
        rows.append(row)
        return orig_sample(row, *args)

    gen_mod.sample = sample
    try:
        # the engine yields (request id, token) as it samples, so pairs[i] says whose rows[i] is
        pairs = list(eng.run())
    finally:
        gen_mod.sample = orig_sample
    who = [rid for rid, _ in pairs]
    order = sorted(range(len(rows)), key=lambda i: (who[i], i))
    logits = torch.stack([rows[i] for i in order])
    cache.preemptions = eng.stats.preemptions
    return [eng.requests[r].new_ids for r in rids], logits, cache


@pytest.mark.parametrize("spec", ["fp32", "int8", "int4",
                                  "k=int4:channel:asym,v=int4:g32:asym,residual=16"])
@pytest.mark.parametrize("disk", [False, True])
def test_small_device_pool_same_outputs(spec, disk, tmp_path):
    m = tiny()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (150, 90)]
    want_ids, want_logits, _ = generate(m, spec, prompts, num_blocks=64)
    if disk:
        kw = dict(host_blocks=8, disk_dir=str(tmp_path), disk_blocks=64)
    else:
        kw = dict(host_blocks=64)
    ids, logits, cache = generate(m, spec, prompts, num_blocks=8, stage_blocks=5, **kw)
    assert cache.preemptions == 0  # a recompute would change chunking, and with it float rounding
    assert ids == want_ids
    # exact up to float32 rounding: on the CPU the offloaded blocks are attended in one pass with
    # the resident ones (Offloader.plan_chunks' one_pass), over the same dequantized K/V, so no
    # quantized code flips
    tol = 1e-5
    torch.testing.assert_close(logits, want_logits, atol=tol, rtol=tol)
    st = cache.offload_stats()
    assert st["blocks_read_staged"] > 0 and st["peak_device_blocks"] <= 8
    if disk:
        assert st["blocks_host_to_disk"] > 0
    # counters add up: every block that left the device came back, is still out, or was freed out
    # there
    out = st.get("blocks_device_to_host", 0)
    back = st.get("blocks_host_to_device", 0) + st.get("blocks_disk_to_device", 0)
    still_out = st["host_blocks_used"] + st["disk_blocks_used"]
    assert out == back + still_out + st.get("blocks_freed_offloaded", 0)


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "knorm", "streaming"])
@pytest.mark.parametrize("disk", [False, True])
def test_eviction_reads_offloaded_blocks_where_they_lie(policy, disk, tmp_path):
    """Two prompts longer than the device pool: compaction reads a sequence whose blocks were
    offloaded where they lie (a full device has no room to take them back; snapkv compacts once
    the whole prompt is in), and scores the offloaded keys themselves: the same tokens and
    logits as a device pool that holds it all."""
    m = tiny()
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (150, 120)]
    spec = f"int8,sink=4,evict={policy}:40"  # two sequences' 40 exceed the device's 64 slots
    want_ids, want_logits, _ = generate(m, spec, prompts, num_blocks=64)
    kw = dict(host_blocks=8, disk_dir=str(tmp_path), disk_blocks=64) if disk else \
        dict(host_blocks=64)
    ids, logits, cache = generate(m, spec, prompts, num_blocks=8, stage_blocks=5, **kw)
    assert ids == want_ids
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)  # as above
    assert cache.offload_stats().get("blocks_device_to_host", 0) > 0


def test_roundtrip_bit_exact_and_tamper_detected(tmp_path):
    m = tiny()
    for spec in ["fp32", "bf16", "fp8", "int8:asym", "int4", "int2:g16:asym"]:
        offload = OffloadConfig(host_blocks=2, disk_dir=str(tmp_path), disk_blocks=2)
        cache = make_cache(m.cfg, KVSpec.parse(spec), blocks=4, block_size=8, offload=offload)
        for t in cache.pools.moving():
            if t.dtype == torch.float32:
                t.copy_(torch.randn(t.shape))
            else:
                t.copy_(torch.randint(0, 100, t.shape).to(t.dtype))
        before = [t[:, 1].clone() for t in cache.pools.moving()]
        h = cache.tables.tiers.move(STORE, 1, HOST)
        d = cache.tables.tiers.move(HOST, h, DISK)
        back = cache.tables.tiers.move(DISK, d, STORE)
        for t, b in zip(cache.pools.moving(), before):
            assert torch.equal(t[:, back].view(torch.uint8), b.view(torch.uint8)), spec
        cache.close()
    offload = OffloadConfig(host_blocks=1, disk_dir=str(tmp_path), disk_blocks=2)
    cache = make_cache(m.cfg, KVSpec.parse("int8"), blocks=4, block_size=8, offload=offload)
    d = cache.tables.tiers.move(STORE, 0, DISK)
    disk = cache.offload.tiers[DISK]
    with open(disk.path, "r+b") as f:  # flip one byte of the stored block
        f.seek(disk.offsets[0] + d * disk.row[0])
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(OffloadError, match="altered"):
        cache.tables.tiers.move(DISK, d, STORE)
    with open(disk.path, "r+b") as f:
        f.truncate(10)
    with pytest.raises(OffloadError, match="truncated"):
        disk.read_into(cache.pools.layer_rows(0), torch.tensor([d]),
                       [torch.empty_like(t[0, :1]) for t in cache.pools.moving()])


def test_lse_merge_equals_single_pass():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 40, 16, generator=g, dtype=torch.float64) for _ in range(3))
    s = q @ k.transpose(-1, -2)  # (3, 40 queries, 40 keys)
    full = torch.softmax(s, -1) @ v
    parts = []
    for sl in (slice(0, 7), slice(7, 30), slice(30, 40)):
        ss = s[..., sl]
        parts.append((torch.softmax(ss, -1) @ v[:, sl], torch.logsumexp(ss, -1)))
    o, lse = merge_partials(parts)
    torch.testing.assert_close(o, full, atol=1e-6, rtol=0)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=1e-6, rtol=0)


def test_staged_chunks_with_lse_merge_triton():
    """The GPU path: offloaded blocks staged in fixed-size chunks, merged by log-sum-exp (on a
    CUDA device where there is one, else through Triton's interpreter)."""
    pytest.importorskip("triton")
    m = tiny().to("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (40, 20)]
    want_ids, want_logits, _ = generate(m, "int8", prompts, num_blocks=64, attention="triton")
    ids, logits, cache = generate(m, "int8", prompts, num_blocks=6, stage_blocks=2,
                                  host_blocks=64, attention="triton")
    assert cache.offload_stats()["blocks_read_staged"] > 3  # more than one chunk
    assert ids == want_ids
    # the merge order differs: float noise
    torch.testing.assert_close(logits, want_logits, atol=1e-3, rtol=1e-3)


def test_disk_tier_that_fails_to_map_leaves_no_file(tmp_path, monkeypatch):
    from tinykv import offload

    def refuse(*args, **kwargs):
        raise OSError("mmap refused")
    monkeypatch.setattr(offload.np, "memmap", refuse)
    like = [torch.zeros(2, 4, 8)]  # (L, blocks, bytes of a block)
    with pytest.raises(OSError, match="mmap refused"):
        offload.DiskTier(like, 3, tmp_path)
    assert list(tmp_path.iterdir()) == []
