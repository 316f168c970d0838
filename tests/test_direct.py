"""A CPU decode step's layers with numpy between the compiled calls (gemv_layer.layers_cpu, the
plan's `direct` store and attention: kernels.cpu_direct) against the same steps layer by layer
through torch tensors (model.run_layers, Plan.attend): the same kernels on the same arrays, so the
same logits bit for bit; and the steps and caches that must go layer by layer."""

import pytest
import torch

from tinykv import gemv, gemv_layer
from tinykv.cache import PagedKVCache, make_cache
from tinykv.kernels import cpu_direct
from tinykv.model import REFERENCES, Config, Transformer, run_layers
from tinykv.spec import KVSpec

pytestmark = pytest.mark.skipif(not gemv.AVAILABLE, reason="numba is not installed")

# stored in place by the direct calls (per-token scales or none; K and V apart; the plain kernel
# for fp8 and int2:g16, the vector kernel for the rest); hot blocks (a residual window, sinks,
# at the model's dtype or fp16) attended beside the store and merged; rotations; a store whose
# scales are made when a block fills (channel keys, block-wise fp8), read only: new tokens wait
# in hot blocks
DIRECT = ["fp16", "int8", "int4", "k=int4:g32:asym,v=int2:g16", "fp8:token", "k=int8,v=fp16",
          "k=int2:mse,v=int4:g16:mse", "k=int2:g32:fit:rot,v=int2:fit", "int4,residual=8,sink=4",
          "int4:rot",
          "k=int2:g32:rot,v=int4:rot,residual=16,sink=4,hot=fp16", "k=int4:rot,v=int8",
          "k=int4:channel:asym,v=int4:g32:asym,residual=16", "fp8"]
# needs more than a store and an attention call a layer: eviction's scores
LAYER_BY_LAYER = ["int8,evict=h2o:96"]


def model(seed: int = 0, n_heads: int = 4, n_kv_heads: int = 2, head_dim: int = 32,
          qkv_bias: bool = True) -> Transformer:
    """A random 2-layer Llama-family model, by default with GQA (4 query heads over 2 KV heads
    of 32)."""
    torch.manual_seed(seed)
    cfg = Config(vocab_size=128, dim=n_heads * head_dim, n_layers=2, n_heads=n_heads,
                 n_kv_heads=n_kv_heads, ffn_dim=96, max_seq_len=256, qkv_bias=qkv_bias)
    m = Transformer(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    m.use_kernels(**gemv_layer.select_kernels("cpu", REFERENCES))
    return m


def decode(m: Transformer, spec: str, layers, steps: int = 6, seqs: int = 2,
           threads_min_reads: int | None = None, scales: dict | None = None) -> tuple[list, int]:
    """Two sequences (or the first): a prompt each in chunks of 20 and 13 tokens, then `steps`
    decode steps of both together, through `layers` as the model's layer function; (logits of
    every step, values the cache counted as clipped). threads_min_reads: the CPU kernels' (0:
    attention shares every call among the threads); scales: the cache's calibration."""
    m.layers_fn = layers
    cache = make_cache(m.cfg, KVSpec.parse(spec), blocks=64, block_size=16, max_seqs=2,
                       scales=scales)
    if threads_min_reads is not None:
        cache.kernels.direct.__self__.threads_min_reads = threads_min_reads
    gen = torch.Generator().manual_seed(1)
    prompts = {0: torch.randint(0, 128, (20,), generator=gen).tolist(),
               1: torch.randint(0, 128, (13,), generator=gen).tolist()}
    prompts = {s: prompts[s] for s in range(seqs)}
    feeds = [list(prompts.values())]
    feeds += [[[int(t)] for t in torch.randint(0, 128, (seqs,), generator=gen)]
              for _ in range(steps)]
    for s in prompts:
        cache.add_sequence(s)
    logits = []
    for feed in feeds:
        plan = cache.plan(list(prompts), feed, logits="all")
        logits.append(m(torch.tensor(sum(feed, [])), plan))
        cache.commit(plan)
    return logits, cache.saturated


def counted(monkeypatch) -> list[int]:
    """Layers DirectLayers serves, one entry per call."""
    calls, real = [], cpu_direct.DirectLayers.__call__
    monkeypatch.setattr(cpu_direct.DirectLayers, "__call__",
                        lambda self, layer, *a: calls.append(layer) or real(self, layer, *a))
    return calls


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("spec", DIRECT)
def test_direct_layers_give_the_layer_by_layer_logits(spec, one_thread, monkeypatch):
    m = model()
    want, want_clipped = decode(m, spec, run_layers)
    calls = counted(monkeypatch)
    got, clipped = decode(m, spec, gemv_layer.select_kernels("cpu", REFERENCES)["layers"])
    assert calls == [0, 1] * 6  # every decode step, not the prompts' chunks
    assert clipped == want_clipped == 0  # dynamic scales clip nothing that counts (mse's clips)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("spec", ["k=int4:channel:asym,v=int4:g32:asym,residual=16", "fp8"])
def test_direct_reads_blocks_filled_meanwhile(spec, one_thread, monkeypatch):
    """Blocks whose scales are made when they fill (channel keys, block-wise fp8) leave the hot
    blocks for the store between direct steps; the next steps read them there."""
    m = model()
    want, _ = decode(m, spec, run_layers, steps=24)
    moved, real = [], PagedKVCache.quantize_hot
    monkeypatch.setattr(PagedKVCache, "quantize_hot",
                        lambda self, *blocks: moved.append(blocks) or real(self, *blocks))
    calls = counted(monkeypatch)
    got, _ = decode(m, spec, gemv_layer.select_kernels("cpu", REFERENCES)["layers"], steps=24)
    assert calls == [0, 1] * 24 and len(moved) >= 2
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("spec", ["k=int4:rot:center:smooth,v=int8:center:rot,residual=16,sink=4",
                                  "k=int2:g32:center:smooth,v=int4:center", "k=fp16:smooth,v=int8"])
def test_direct_layers_take_calibrated_transforms(spec, one_thread, monkeypatch):
    """Centered, smoothed and rotated layers (quant.Transform's maps, one compiled call each on
    both paths) give the layer by layer logits bit for bit."""
    m = model()
    L, H, D = m.cfg.n_layers, m.cfg.n_kv_heads, m.cfg.head_dim
    gen = torch.Generator().manual_seed(4)
    scales = {"k_center": torch.randn(L, H, D, generator=gen),
              "v_center": torch.randn(L, H, D, generator=gen),
              "k_smooth": torch.eye(D) + 0.3 * torch.randn(L, H, D, D, generator=gen) / D**0.5}
    want, _ = decode(m, spec, run_layers, scales=scales)
    calls = counted(monkeypatch)
    got, _ = decode(m, spec, gemv_layer.select_kernels("cpu", REFERENCES)["layers"],
                    scales=scales)
    assert calls == [0, 1] * 6
    for g, w in zip(got, want):
        assert torch.equal(g, w)


# (query heads, KV heads, head_dim): MHA, MQA, and GQA groups of 4 and 8, at the head sizes of
# common checkpoints
SHAPES = [(4, 4, 64, False), (8, 1, 80, True), (8, 2, 96, False), (16, 2, 128, True)]


@pytest.mark.parametrize("spec", ["fp16", "int4", "k=int8,v=int2:g16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv{s[2]}")
@pytest.mark.parametrize("seqs", [1, 2])
def test_direct_layers_take_every_head_layout(spec, shape, seqs, one_thread, monkeypatch):
    n_heads, n_kv_heads, head_dim, bias = shape
    m = model(n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, qkv_bias=bias)
    want, _ = decode(m, spec, run_layers, steps=3, seqs=seqs)
    calls = counted(monkeypatch)
    got, _ = decode(m, spec, gemv_layer.select_kernels("cpu", REFERENCES)["layers"], steps=3,
                    seqs=seqs)
    assert calls == [0, 1] * 3
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("spec", LAYER_BY_LAYER)
def test_caches_that_need_more_go_layer_by_layer(spec, one_thread, monkeypatch):
    m = model()
    calls = counted(monkeypatch)
    got, _ = decode(m, spec, gemv_layer.select_kernels("cpu", REFERENCES)["layers"])
    assert calls == []
    want, _ = decode(m, spec, run_layers)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("spec", ["int8", "int4:rot,residual=16,sink=4"])
@pytest.mark.parametrize("threads_min_reads", [None, 0], ids=["default", "shared"])
@pytest.mark.parametrize("shape", [(4, 2), (8, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("seqs", [1, 2])
def test_two_threads_take_the_direct_calls(spec, threads_min_reads, shape, seqs, monkeypatch):
    """With two threads the direct calls share each layer's products and attention among them
    as the per-layer path does: the same logits bit for bit. Shared (threads_min_reads 0): one
    sequence over one KV head has one work item, so each query's blocks split in two, merged
    by log-sum-exp; GQA's two KV heads (and two sequences) share evenly, unsplit. With hot
    blocks, the store's and the window's attention each split as they would alone."""
    n_heads, n_kv_heads = shape
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        m = model(n_heads=n_heads, n_kv_heads=n_kv_heads)
        want, _ = decode(m, spec, run_layers, steps=3, seqs=seqs,
                         threads_min_reads=threads_min_reads)
        calls = counted(monkeypatch)
        got, _ = decode(m, spec, gemv_layer.select_kernels("cpu", REFERENCES)["layers"],
                        steps=3, seqs=seqs, threads_min_reads=threads_min_reads)
    finally:
        torch.set_num_threads(before)
    assert calls == [0, 1] * 3
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("spec", ["int8", "int4:rot,residual=16,sink=4"])
@pytest.mark.parametrize("threads", [1, 2])
def test_long_queries_split_in_shares_on_the_direct_path(spec, threads, monkeypatch):
    """Shares of a query's blocks (kernels.cpu.SHARE_BYTES, set here to 6 keys' codes so that
    every decode step splits) are merged on one thread as on two: the same logits as the layer
    by layer path bit for bit, and within rounding of the unsplit steps. With hot blocks the
    window's attention splits too, each pool's shares merged before the pools are."""
    from tinykv.kernels import cpu as kernels_cpu
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        m = model()
        whole, _ = decode(m, spec, run_layers, steps=3)
        monkeypatch.setattr(kernels_cpu, "SHARE_BYTES", 6 * 2 * 2 * 32)  # 2 KV heads of 32
        want, _ = decode(m, spec, run_layers, steps=3)
        calls = counted(monkeypatch)
        got, _ = decode(m, spec, gemv_layer.select_kernels("cpu", REFERENCES)["layers"],
                        steps=3)
    finally:
        torch.set_num_threads(before)
    assert calls == [0, 1] * 3
    for g, w, u in zip(got, want, whole):
        assert torch.equal(g, w)
        torch.testing.assert_close(g, u)


def _sums(rows, out):
    """out[n] = the sum of rows[n] (N, H, D), read element by element (the layout matters)."""
    for n in range(rows.shape[0]):
        total = 0.0
        for h in range(rows.shape[1]):
            for d in range(rows.shape[2]):
                total += rows[n, h, d]
        out[n] = total


def test_resolved_keeps_a_version_per_layout():
    """cpu_direct.Resolved calls the compiled version the dispatcher chose for the first call,
    one per layout of the rows: a strided view after a contiguous array (one token's rows, then
    several) must not be read as the contiguous one."""
    import numba
    import numpy as np

    kernel = numba.njit(_sums)
    resolved = cpu_direct.Resolved(kernel, 0)
    base = np.arange(4 * 6 * 8, dtype=np.float32).reshape(4, 6, 8)  # (N, H, D)
    views = [base, base[:, 1:4], np.asfortranarray(base), base[:1, :1], base[:, ::2, ::2]]
    for rows in views + views:  # each layout first through the dispatcher, then straight
        out = np.zeros(rows.shape[0], np.float32)
        resolved(rows, out)
        np.testing.assert_array_equal(out, rows.sum(axis=(1, 2)))
    # flags C, Fortran, neither, both (base[:1, :1]: compiled as C): three compiled versions
    assert len(resolved.entries) == 4
    assert len({id(entry) for entry in resolved.entries.values()}) == 3
    layouts = {rows.flags.num & cpu_direct.TYPED_FLAGS: rows for rows in views}
    both, c_only = (next(key for key, rows in layouts.items() if rows.flags.c_contiguous
                         and rows.flags.f_contiguous == fortran) for fortran in (True, False))
    assert resolved.entries[both] is resolved.entries[c_only]
    assert all(entry is not kernel for entry in resolved.entries.values())
    read_only = base.copy()
    read_only.flags.writeable = False  # numba types it apart: a version of its own
    out = np.zeros(4, np.float32)
    resolved(read_only, out)
    np.testing.assert_array_equal(out, base.sum(axis=(1, 2)))
    assert len(resolved.entries) == 5


def _pair_sums(k_rows, v_rows, out):
    """out[n] = the sum of k_rows[n] + twice that of v_rows[n], element by element."""
    for n in range(k_rows.shape[0]):
        out[n] = 0.0
        for h in range(k_rows.shape[1]):
            for d in range(k_rows.shape[2]):
                out[n] += k_rows[n, h, d]
        for h in range(v_rows.shape[1]):
            for d in range(v_rows.shape[2]):
                out[n] += 2 * v_rows[n, h, d]


def test_resolved_keys_on_the_layout_of_every_rows_argument():
    """The store's Resolved takes K and V rows: a change in V's layout alone (K's the same) must
    reach a version compiled for it."""
    import numba
    import numpy as np

    resolved = cpu_direct.Resolved(numba.njit(_pair_sums), 0, 1)
    base = np.arange(4 * 6 * 8, dtype=np.float32).reshape(4, 6, 8)  # (N, H, D)
    k_rows = np.ascontiguousarray(base[:, :3])
    for v_rows in (np.ascontiguousarray(base[:, 3:]), base[:, 3:], base[:, 3:]):
        out = np.zeros(4, np.float32)
        resolved(k_rows, v_rows, out)
        np.testing.assert_array_equal(out, k_rows.sum(axis=(1, 2)) + 2 * v_rows.sum(axis=(1, 2)))
    assert len(resolved.entries) == 2


def test_direct_rows_must_be_float32_of_the_step_shape():
    import numpy as np

    with pytest.raises(TypeError, match="float32 rows"):
        cpu_direct._checked((1, 2, 4), torch.zeros(1, 2, 4, dtype=torch.float64).numpy())
    with pytest.raises(TypeError, match="float32 rows"):
        cpu_direct._checked((1, 2, 4), torch.zeros(2, 4).numpy())
    with pytest.raises(TypeError, match="float32 rows"):
        cpu_direct._checked((1, 2, 4), torch.zeros(1, 2, 4).numpy(), torch.zeros(2, 2, 4).numpy())
    with pytest.raises(TypeError, match="float32 rows"):  # big-endian float32
        cpu_direct._checked((1, 2, 4), np.zeros((1, 2, 4), ">f4"))
    described = np.dtype(np.float32, metadata={"from": "a test"})  # float32, another descriptor
    rows = np.arange(8, dtype=described).reshape(1, 2, 4)
    checked, = cpu_direct._checked((1, 2, 4), rows)
    assert checked.dtype is np.dtype(np.float32)
    np.testing.assert_array_equal(checked, rows)


def test_direct_calls_refuse_rows_the_step_did_not_bind(one_thread):
    """A step binds its outputs and arguments to its N queries: rows of another count, head
    count or dtype are refused before a kernel reads (or writes) past them."""
    from tests.pools import make_pool
    from tinykv.kernels.cpu import CpuKernels

    H, R, BS, D = 2, 2, 16, 32
    gen = torch.Generator().manual_seed(0)
    k, v = make_pool("int8", H, BS, D, gen), make_pool("fp16", H, BS, D, gen)
    zero, one = torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32)
    direct = CpuKernels().direct(zero, zero, one, [(table, [(k, v)])], 0, zero, zero, H * R, D,
                                 D**-0.5, lambda n: None)
    rows = torch.randn(1, H, D).numpy()  # (N, H, D)
    direct.store(0, rows, rows)
    o = direct.attend(0, torch.randn(1, H * R, D).numpy())
    assert o.shape == (1, H * R, D)
    bad_rows = [torch.randn(2, H, D).numpy(), torch.randn(1, H + 1, D).numpy(),
                torch.randn(1, H, D, dtype=torch.float64).numpy()]
    for bad in bad_rows:
        with pytest.raises(TypeError, match="float32 rows of shape"):
            direct.store(0, rows, bad)
    with pytest.raises(TypeError, match="float32 rows of shape"):
        direct.attend(0, torch.randn(2, H * R, D).numpy())
