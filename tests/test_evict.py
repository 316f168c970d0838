"""Eviction (tinykv/evict.py and the cache's compaction): budgets per head, protected sinks and
windows, blocks freed, attention over the kept tokens equal to attention restricted to them."""

import math

import pytest
import torch
from test_cache import run_cached, tiny

from tinykv import evict
from tinykv.cache import CacheError, make_cache
from tinykv.model import Config
from tinykv.spec import KVSpec

CFG = Config(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=32, head_dim=16)
POLICIES = ["streaming", "knorm", "snapkv", "h2o"]


def fill(cache, sid: int, n: int, chunk: int = 8, seed: int = 0) -> torch.Tensor:
    """Write n tokens whose keys/values are random, through plan.attend with random queries, as
    the model would; returns every written key (L, H, n, D) in order."""
    g = torch.Generator().manual_seed(seed)
    H, D, Hq = CFG.n_kv_heads, CFG.head_dim, CFG.n_heads
    spread = 1 + 3 * torch.rand(n, 1, 1, generator=g)  # keys of different norms
    keys = torch.randn(CFG.n_layers, n, H, D, generator=g) * spread
    cache.add_sequence(sid)
    for s in range(0, n, chunk):
        m = min(chunk, n - s)
        plan = cache.plan([sid], [[1] * m])
        for layer in range(CFG.n_layers):
            k = keys[layer, s:s + m]  # (m, H, D)
            plan.attend(layer, torch.randn(m, Hq, D, generator=g), k, k * 2)
        cache.commit(plan)
    return keys.permute(0, 2, 1, 3)  # (L, H, n, D)


@pytest.mark.parametrize("policy", POLICIES)
def test_policies_keep_their_budget_sinks_and_window(policy):
    for n, budget, sink, res in [(100, 32, 4, 8), (70, 24, 0, 0), (50, 40, 3, 5)]:
        score = torch.rand(2, 3, n)
        keys = torch.randn(2, 3, n, 8)
        keep = evict.select(policy, n, budget, sink, res, keys=keys, score=score)
        keep = keep.expand(2, 3, -1)
        assert keep.shape[-1] == budget
        for row in keep.reshape(-1, budget).tolist():
            assert row == sorted(set(row)) and 0 <= row[0] and row[-1] < n  # distinct, ascending
            assert set(range(sink)) <= set(row)  # sinks never go
            assert set(range(n - res, n)) <= set(row)  # nor the residual window


def test_knorm_keeps_the_low_norm_keys_and_heads_differ():
    keys = torch.randn(1, 2, 60, 8)
    keep = evict.select("knorm", 60, 20, 0, 0, keys=keys)  # (1, 2, 20)
    norms = keys.norm(dim=-1)
    for h in range(2):
        kept = set(keep[0, h].tolist())
        dropped = [i for i in range(60) if i not in kept]
        assert norms[0, h, list(kept)].max() <= norms[0, h, dropped].min()
    assert not torch.equal(keep[0, 0], keep[0, 1])  # each head keeps its own tokens


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fmt", ["fp32", "int8", "k=int4:channel:asym,v=int4:g16:asym"])
def test_cache_holds_the_budget_and_frees_blocks(policy, fmt):
    spec = f"{fmt},sink=4,residual=8,evict={policy}:32"
    cache = make_cache(CFG, spec, blocks=40, block_size=8, max_seqs=2)
    fill(cache, 0, 120, chunk=16)
    slots = cache.slots(0)
    assert len(cache.tables.seqs[0].tokens) == 120
    assert 32 <= slots < 32 + 16 + 8  # the budget plus less than a block and a chunk
    # the store pool holds no more than the budget's blocks plus one
    assert cache.tables.used_blocks() <= math.ceil((32 + 8) / 8) + 1
    cache.compact(0)
    assert cache.slots(0) == 32
    cache.free(0)
    assert cache.blocks_free == cache.num_blocks


@pytest.mark.parametrize("policy", POLICIES)
def test_compacting_a_budget_larger_than_a_step(policy):
    """A block-wise format stores the kept tokens again through full-precision blocks before it
    quantizes them: a budget of many steps' tokens must still compact within the pool."""
    spec = f"k=int4:channel:asym,v=int4:g16:asym,residual=8,sink=4,evict={policy}:120"
    cache = make_cache(CFG, spec, tokens=300, block_size=8, max_seqs=1, max_step_tokens=16)
    fill(cache, 0, 300, chunk=16)
    cache.compact(0)
    assert cache.slots(0) == 120 and len(cache.tables.seqs[0].tokens) == 300


def test_keep_only_keeps_exactly_the_slots_asked():
    """The cache's one eviction operation: per layer and KV head the kept slots' keys and values,
    in order from slot 0; every other block freed."""
    cache = make_cache(CFG, "fp32", blocks=20, block_size=8)
    keys = fill(cache, 0, 40, chunk=16)  # (L, H, 40, D); values are 2 * keys
    g = torch.Generator().manual_seed(5)
    order = torch.rand(CFG.n_layers, CFG.n_kv_heads, 40, generator=g).argsort(-1)
    kept = order[..., :12].sort(-1).values  # (L, H, 12): each layer and head its own slots
    cache.keep_only(0, kept)
    k, v = cache.seq_kv(0)  # (L, H, 12, D)
    want = keys.gather(2, kept[..., None].expand(-1, -1, -1, CFG.head_dim))
    assert torch.equal(k, want) and torch.equal(v, 2 * want)
    assert cache.slots(0) == 12 and cache.tables.used_blocks() == 2


def test_attention_over_kept_tokens_is_attention_restricted_to_them():
    """fp32 storage: after compaction each head attends over exactly its kept keys (float64)."""
    spec = KVSpec.parse("fp32,sink=2,evict=knorm:24")
    cache = make_cache(CFG, spec, blocks=20, block_size=8)
    keys = fill(cache, 0, 60, chunk=60)  # one chunk: compaction happens after it, keys known
    keep = evict.select("knorm", 60, 24, 2, 0, keys=keys)  # (L, H, 24): what the cache kept
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, CFG.n_heads, CFG.head_dim, generator=g)
    k_new = torch.randn(1, CFG.n_kv_heads, CFG.head_dim, generator=g)
    plan = cache.plan([0], [[1]])
    o = plan.attend(0, q, k_new, 2 * k_new)[0]  # (Hq, D), layer 0
    n_rep = CFG.n_heads // CFG.n_kv_heads
    for h in range(CFG.n_heads):
        kv_h = h // n_rep
        kk = torch.cat([keys[0, kv_h, keep[0, kv_h]], k_new[:, kv_h]]).double()  # (25, D)
        p = torch.softmax(kk @ q[0, h].double() / math.sqrt(CFG.head_dim), 0)
        want = p @ (2 * kk)
        torch.testing.assert_close(o[h].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("policy", POLICIES)
def test_budget_above_the_context_changes_nothing(policy):
    m = tiny()
    toks = torch.randint(0, 128, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    plain = run_cached(m, make_cache(m.cfg, "fp32", blocks=16, block_size=8), {0: toks}, 7)[0]
    spec = f"fp32,evict={policy}:200"
    got = run_cached(m, make_cache(m.cfg, spec, blocks=16, block_size=8), {0: toks}, 7)[0]
    torch.testing.assert_close(got, plain, atol=0, rtol=0)


def test_eviction_with_forks_and_shared_prefixes():
    """A fork shares its parent's blocks; compacting one copies nothing into the other."""
    spec = "fp32,evict=streaming:24"
    cache = make_cache(CFG, spec, blocks=40, block_size=8, max_seqs=2)
    keys = fill(cache, 0, 30, chunk=30)  # 30 slots > 24: compacted after the chunk
    assert cache.slots(0) == 30 or cache.slots(0) == 24
    cache.compact(0)
    cache.fork(0, 1)
    before = cache.seq_kv(1)[0].clone()
    plan = cache.plan([0], [[1] * 20])  # seq 0 writes 20 more: copy on write of the shared tail
    for layer in range(CFG.n_layers):
        x = torch.ones(20, CFG.n_kv_heads, CFG.head_dim)
        plan.attend(layer, torch.zeros(20, CFG.n_heads, CFG.head_dim), x, x)
    cache.commit(plan)
    assert torch.equal(cache.seq_kv(1)[0], before)  # the fork still reads its own tokens
    kept = cache.seq_kv(1)[0]  # streaming keeps the most recent 24 of the 30
    torch.testing.assert_close(kept, keys[..., 6:, :])
    cache.free(0)
    cache.free(1)
    assert cache.blocks_free == cache.num_blocks


def test_budget_must_exceed_what_is_protected():
    with pytest.raises(CacheError, match="budget"):
        make_cache(CFG, "int8,sink=16,residual=16,evict=knorm:32", blocks=8)
