"""The paged cache against plain causal attention: fp32 is exact, batching and sharing change
nothing."""

import pytest
import torch

from tinykv.cache import PoolExhausted, make_cache
from tinykv.generate import Engine, Sampling
from tinykv.model import Config, Transformer
from tinykv.spec import KVSpec

SHAPES = [("llama", 4, 4, 64), ("llama", 6, 2, 80), ("qwen2", 4, 1, 64), ("gpt2", 4, 4, 64),
          ("gpt_bigcode", 4, 1, 64)]
SHAPE_IDS = [f"{s[0]}-{s[1]}q{s[2]}kv-{s[3]}" for s in SHAPES]


def tiny(model_type="llama", n_heads=6, n_kv=2, hd=64, seed=0) -> Transformer:
    """A random 2-layer model; norms and biases perturbed so that they are really tested."""
    torch.manual_seed(seed)
    cfg = Config(model_type=model_type, vocab_size=128, dim=n_heads * hd, n_layers=2,
                 n_heads=n_heads, n_kv_heads=n_kv, ffn_dim=96, max_seq_len=256,
                 qkv_bias=model_type != "llama", tie_embeddings=model_type.startswith("gpt"))
    m = Transformer(cfg).eval()
    with torch.no_grad():
        for param in m.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
    return m


def cache_for(m: Transformer, spec: str, **kw):
    """make_cache for model m under a spec string."""
    return make_cache(m.cfg, KVSpec.parse(spec), **kw)


def run_cached(m, cache, seqs: dict[int, list[int]], chunk: int) -> dict[int, torch.Tensor]:
    """Feed several sequences together, `chunk` tokens per sequence per step; all logits per
    sequence."""
    out = {s: [] for s in seqs}
    for s in seqs:
        cache.add_sequence(s)
    pos = dict.fromkeys(seqs, 0)
    while any(pos[s] < len(t) for s, t in seqs.items()):
        ids = [s for s in seqs if pos[s] < len(seqs[s])]
        feed = [seqs[s][pos[s]:pos[s] + chunk] for s in ids]
        plan = cache.plan(ids, feed, logits="all")
        logits = m(torch.tensor(sum(feed, [])), plan)
        cache.commit(plan)
        i = 0
        for s, f in zip(ids, feed):
            out[s].append(logits[i:i + len(f)])
            i += len(f)
            pos[s] += len(f)
    return {s: torch.cat(v) for s, v in out.items()}


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_fp32_paged_equals_no_cache(shape, block_size):
    m = tiny(*shape)
    g = torch.Generator().manual_seed(3)
    seqs = {i: torch.randint(0, 128, (n,), generator=g).tolist() for i, n in enumerate([37, 9, 70])}
    cache = cache_for(m, "fp32", blocks=200, block_size=block_size, max_seqs=3)
    got = run_cached(m, cache, seqs, chunk=5)
    for s, toks in seqs.items():
        ref = m(torch.tensor([toks]))[0]
        scale = max(1.0, ref.abs().max().item())  # float32 noise grows with the logits' magnitude
        torch.testing.assert_close(got[s], ref, atol=1e-5 * scale, rtol=1e-5)
    for s in seqs:
        cache.free(s)
    assert cache.blocks_free == cache.num_blocks


BATCH_SPECS = ["int8", "k=int4:channel:asym,v=int4:g32:asym,residual=20",
               "fp32,sink=4,residual=8", "k=int8:channel,v=fp16", "fp8,sink=3"]


def attend_synthetic(cache, seqs: dict[int, list[int]], chunk: int, table: torch.Tensor,
                     n_layers: int) -> dict[int, torch.Tensor]:
    """Drive the cache without a model: each token's q, k and v (every layer) are rows of
    `table` (V, L, Hq + 2H, D) picked by the token id, so a token's inputs are the same bits
    whatever else is in the step. Returns each sequence's attention outputs (T, L, Hq, D)."""
    hq = cache.cfg.n_heads
    h = cache.cfg.n_kv_heads
    out = {s: [] for s in seqs}
    for s in seqs:
        cache.add_sequence(s)
    pos = dict.fromkeys(seqs, 0)
    while any(pos[s] < len(t) for s, t in seqs.items()):
        ids = [s for s in seqs if pos[s] < len(seqs[s])]
        feed = [seqs[s][pos[s]:pos[s] + chunk] for s in ids]
        plan = cache.plan(ids, feed, logits="all")
        rows = table[torch.tensor(sum(feed, []))]  # (N, L, Hq + 2H, D)
        per_layer = []
        for layer in range(n_layers):
            q, k, v = rows[:, layer].split([hq, h, h], dim=1)
            per_layer.append(plan.attend(layer, q, k, v))  # (N, Hq, D)
        cache.commit(plan)
        o = torch.stack(per_layer, 1)  # (N, L, Hq, D)
        i = 0
        for s, f in zip(ids, feed):
            out[s].append(o[i:i + len(f)])
            i += len(f)
            pos[s] += len(f)
    return {s: torch.cat(v) for s, v in out.items()}


@pytest.mark.parametrize("spec", BATCH_SPECS)
def test_batched_equals_alone_same_inputs(spec):
    """What the cache guarantees: a sequence's keys and values, stored beside other sequences',
    are stored and read exactly as alone (same codes, same scales). Given the same inputs, the
    outputs differ only by the order the kernel sums in (it splits a query's blocks by how many
    queries there are), a few float32 ulps of the values' magnitude."""
    m = tiny()
    cfg = m.cfg
    g = torch.Generator().manual_seed(4)
    seqs = {i: torch.randint(0, 128, (n,), generator=g).tolist() for i, n in enumerate([41, 7, 23])}
    table = torch.randn(128, cfg.n_layers, cfg.n_heads + 2 * cfg.n_kv_heads, cfg.head_dim,
                        generator=g)
    batched = attend_synthetic(cache_for(m, spec, blocks=64, block_size=16, max_seqs=3), seqs,
                               3, table, cfg.n_layers)
    for s, toks in seqs.items():
        alone_cache = cache_for(m, spec, blocks=64, block_size=16, max_seqs=1)
        alone = attend_synthetic(alone_cache, {s: toks}, 3, table, cfg.n_layers)
        torch.testing.assert_close(batched[s], alone[s], atol=1e-5 * table.abs().max().item(),
                                   rtol=1e-5)


@pytest.mark.parametrize("spec", BATCH_SPECS)
def test_batched_equals_alone(spec):
    """Mixed-length sequences decoded in one batch give the logits each gives alone, under any
    spec. Batching changes the model's float32 rounding (a matmul over more rows sums in
    another order: ~1e-6 relative, CPU-dependent), so a stored value that sits on a rounding
    boundary of its format may take the next code: one step in a few values. Quantizing at all
    moves every stored value by up to half a step, so the batched-alone gap of a quantized spec
    is bounded by its whole quantization error (the alone run against the uncached model), plus
    float32 noise: all a float32 cache (or a sequence still inside its residual window) gets
    (2e-5 of the logits' scale: no tighter than atol=rtol=1e-5 on logits of magnitude >= 1)."""
    m = tiny()
    g = torch.Generator().manual_seed(4)
    seqs = {i: torch.randint(0, 128, (n,), generator=g).tolist() for i, n in enumerate([41, 7, 23])}
    batch_cache = cache_for(m, spec, blocks=64, block_size=16, max_seqs=3)
    batched = run_cached(m, batch_cache, seqs, chunk=3)
    for s, toks in seqs.items():
        alone_cache = cache_for(m, spec, blocks=64, block_size=16, max_seqs=1)
        alone = run_cached(m, alone_cache, {s: toks}, chunk=3)
        ref = m(torch.tensor([toks]))[0]
        scale = max(1.0, ref.abs().max().item())  # float32 noise grows with the logits
        quant_error = (alone[s] - ref).abs().max().item()  # float noise where nothing is quantized
        assert quant_error < 0.1 * scale  # so that the bound below means something
        gap = (batched[s] - alone[s]).abs().max().item()
        assert gap <= quant_error + 2e-5 * scale, (gap, quant_error)


def test_quantized_cache_is_close_but_not_exact():
    m = tiny()
    toks = torch.randint(0, 128, (50,), generator=torch.Generator().manual_seed(5)).tolist()
    ref = m(torch.tensor([toks]))[0]
    errs = {}
    for spec in ["int8", "int4", "int2"]:
        cache = cache_for(m, spec, blocks=16, block_size=16)
        got = run_cached(m, cache, {0: toks}, chunk=1)[0]
        errs[spec] = (got - ref).abs().max().item()
    assert 0 < errs["int8"] < errs["int4"] < errs["int2"]
    assert errs["int8"] < 0.05


@pytest.mark.parametrize("spec", ["fp32", "int8", "k=int4:channel:asym,v=int4:g32:asym"])
def test_prefix_sharing_same_outputs(spec):
    m = tiny()
    g = torch.Generator().manual_seed(6)
    system = torch.randint(0, 128, (40,), generator=g).tolist()
    a, b = system + [5, 6, 7], system + [9, 10]
    cache = cache_for(m, spec, blocks=32, block_size=8, max_seqs=2)
    eng = Engine(m, cache)
    ra = eng.add(a, Sampling(temperature=0, max_new_tokens=6))
    list(eng.run())
    used_after_a = cache.blocks_free
    rb = eng.add(b, Sampling(temperature=0, max_new_tokens=6))
    prefilled = eng.stats.prefill_tokens
    eng.step()  # b joins, and its uncached tokens are fed
    # five full blocks of the system prompt (40 tokens) were found, not recomputed
    assert eng.stats.prefill_tokens - prefilled == len(b) - 40
    list(eng.run())
    fresh = Engine(m, cache_for(m, spec, blocks=32, block_size=8, max_seqs=2))
    rb2 = fresh.add(b, Sampling(temperature=0, max_new_tokens=6))
    list(fresh.run())
    assert eng.requests[rb].new_ids == fresh.requests[rb2].new_ids
    assert eng.requests[ra].new_ids and used_after_a == cache.num_blocks


def test_fork_copy_on_write():
    m = tiny()
    cache = cache_for(m, "int8", blocks=16, block_size=4)
    toks = list(range(10))
    ref = run_cached(m, cache, {0: toks}, chunk=10)[0]
    cache.fork(0, 1)
    used = cache.tables.used_blocks()
    for sid, t in ((1, 77), (0, 55)):  # both write into the shared tail block
        plan = cache.plan([sid], [[t]])
        m(torch.tensor([t]), plan)
        cache.commit(plan)
    assert cache.tables.used_blocks() == used + 1  # one copy, the other writer keeps the original
    # seq 0 still sees its own tokens: its logits for one more token equal a fresh run's, to
    # within what int8 storage allows (fed in other chunks, a value may round to the next code:
    # the bound of test_batched_equals_alone), which is far from what seeing 77 would give
    fresh = cache_for(m, "int8", blocks=16, block_size=4)
    want = run_cached(m, fresh, {0: toks + [55, 3]}, chunk=12)[0][-1]
    plan = cache.plan([0], [[3]])
    got = m(torch.tensor([3]), plan)[0]
    exact = m(torch.tensor([toks + [55, 3]]))[0][-1]
    scale = max(1.0, exact.abs().max().item())
    bound = (want - exact).abs().max().item() + 2e-5 * scale
    assert (got - want).abs().max().item() <= bound
    wrong = m(torch.tensor([toks + [77, 3]]))[0][-1]
    assert (wrong - exact).abs().max().item() > 10 * bound
    assert ref.shape[0] == 10


def test_bytes_per_token_formula():
    cfg = Config(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536)

    def bpt(spec: str) -> float:
        return make_cache(cfg, KVSpec.parse(spec), blocks=4, block_size=16).bytes_per_token

    assert bpt("fp16") == 23040  # 30 layers * (K+V) * 3 heads * 64 * 2 bytes
    assert bpt("fp32") == 46080
    assert bpt("int8") == 11520 + 30 * 2 * 3 * 2  # + one fp16 scale per token, head, layer, K/V
    assert bpt("int8:asym") == 11520 + 30 * 2 * 3 * 4  # + zero points
    assert bpt("int4") == 5760 + 360
    assert bpt("k=int8,v=fp16") == 5760 + 180 + 11520
    # per-channel keys: one fp16 scale+zero per channel per block of 16 tokens
    kivi = 5760 + 30 * 3 * 64 * 4 / 16 + 30 * 3 * 2 * 4
    assert bpt("k=int4:channel:asym,v=int4:g32:asym") == kivi


def test_pool_exhausted_is_clear():
    m = tiny()
    cache = cache_for(m, "int8", blocks=2, block_size=4)
    cache.add_sequence(0)
    with pytest.raises(PoolExhausted, match="exhausted"):
        cache.plan([0], [list(range(20))])
    assert cache.blocks_free == 2  # a failed plan allocates nothing


def test_single_block_pool():
    """A pool of one block (block size covering the whole sequence) still attends correctly."""
    m = tiny()
    toks = list(range(1, 12))
    got = run_cached(m, cache_for(m, "fp32", blocks=1, block_size=16), {0: toks}, chunk=4)[0]
    torch.testing.assert_close(got, m(torch.tensor([toks]))[0], atol=1e-5, rtol=1e-5)


def test_plan_tensors_keep_version_counts_under_inference_mode():
    """A plan made under inference_mode holds normal tensors: their version counts let the CPU
    kernels keep a step's converted metadata across the layers (an inference tensor has none,
    so every layer call would convert it again)."""
    m = tiny()
    with torch.inference_mode(), cache_for(m, "int8", tokens=64) as cache:
        cache.add_sequence(0)
        plan = cache.plan([0], [[1, 2, 3]])
        tensors = [plan.positions, plan.q_slots, plan.q_seq, plan.ctx_lens, plan.logits_idx,
                   *plan.tables.values()]
        tensors += [t for index in plan.slots.values() for t in index if torch.is_tensor(t)]
        assert not any(t.is_inference() for t in tensors)
        m(torch.tensor([1, 2, 3]), plan)  # the model's own ops stay under inference_mode


def test_hot_pool_holds_its_dtype():
    """hot=fp16 holds the sinks, the window and filling blocks in fp16 (half the bytes of an fp32
    model's): with an fp16 store every key and value is then fp16, as in a windowless fp16
    cache, where the model's dtype in the hot pool gives other logits."""
    m = tiny()
    seq = {0: torch.randint(0, 128, (70,), generator=torch.Generator().manual_seed(3)).tolist()}
    want = run_cached(m, cache_for(m, "fp16", blocks=16), seq, chunk=7)[0]
    windowed = cache_for(m, "fp16,residual=16,sink=8,hot=fp16", blocks=16)
    assert windowed.pools.hot.dtype == torch.float16
    assert cache_for(m, "fp16,residual=16,sink=8", blocks=16).pools.hot.dtype == torch.float32
    got = run_cached(m, windowed, seq, chunk=7)[0]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    fp32_hot = run_cached(m, cache_for(m, "fp16,residual=16,sink=8", blocks=16), seq, chunk=7)[0]
    assert (fp32_hot - want).abs().max() > 1e-4  # the test can tell the hot pool's dtype
