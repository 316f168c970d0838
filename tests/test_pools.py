"""Storage options of the pools: `:rot` rotations, `:center` means and `skip=` layers, against
plain attention."""

import pytest
import torch
from test_cache import run_cached, tiny
from test_offload import generate

from tinykv.blocks import CacheError
from tinykv.cache import make_cache
from tinykv.calibrate import calibrate, record
from tinykv.quant import compute_scales, dequantize, quantize, rotation_matrix
from tinykv.scalefile import CalibrationError
from tinykv.spec import KVSpec, SpecError
from tinykv.vllm_export import export_vllm


@pytest.mark.parametrize("n", [16, 64, 80, 128])
def test_rotation_is_orthogonal_and_seeded(n):
    r = rotation_matrix(n, 7)
    torch.testing.assert_close(r @ r.T, torch.eye(n), atol=1e-5, rtol=0)
    assert torch.equal(r, rotation_matrix(n, 7)) and not torch.equal(r, rotation_matrix(n, 8))
    if n & (n - 1) == 0:  # a randomized Hadamard: every entry +-1/sqrt(n)
        torch.testing.assert_close(r.abs(), torch.full((n, n), n**-0.5), atol=1e-6, rtol=0)


def test_rotation_spreads_an_outlier_channel():
    """Keys with one channel 20x the rest: per-token int4 loses far less after rotating."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, 64, generator=g)  # (H, T, D)
    x[..., 5] *= 20
    p = KVSpec.parse("int4").k
    r = rotation_matrix(64, 1)

    def err(y: torch.Tensor) -> float:
        s, z = compute_scales(y, p)
        back = dequantize(quantize(y, p, s, z)[0], p, s, z)
        return (back - y).norm().item() / y.norm().item()
    assert err(x @ r) < 0.5 * err(x)


@pytest.mark.parametrize("spec", ["fp32:rot", "k=fp32:rot,v=fp32", "k=fp32,v=fp32:rot"])
def test_rotation_with_exact_storage_changes_nothing(spec):
    """q R . k R = q . k and (p v R) R^T = p v: a rotated fp32 cache equals no cache."""
    m = tiny()
    toks = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    got = run_cached(m, make_cache(m.cfg, spec, blocks=16, block_size=8), {0: toks}, chunk=5)[0]
    torch.testing.assert_close(got, m(torch.tensor([toks]))[0], atol=1e-4, rtol=1e-4)


def test_rotation_changes_what_is_stored():
    m = tiny()
    toks = list(range(1, 30))
    plain = run_cached(m, make_cache(m.cfg, "int4", blocks=16, block_size=8), {0: toks}, chunk=4)[0]
    rotated = make_cache(m.cfg, "int4:rot", blocks=16, block_size=8)
    rot = run_cached(m, rotated, {0: toks}, chunk=4)[0]
    assert not torch.allclose(plain, rot)  # the rotation really reaches the stored codes


def test_skipped_layers_are_exact_and_sized():
    m = tiny()  # 2 layers, model dtype float32
    toks = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = m(torch.tensor([toks]))[0]
    all_skipped = make_cache(m.cfg, "int4,skip=0:-1", blocks=16, block_size=8)
    got = run_cached(m, all_skipped, {0: toks}, chunk=5)[0]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    one = make_cache(m.cfg, "int4,skip=-1", blocks=16, block_size=8)
    H, D = m.cfg.n_kv_heads, m.cfg.head_dim
    int4_layer = 2 * (H * D / 2 + H * 2)  # K and V: packed codes and an fp16 scale per head
    assert one.bytes_per_token == int4_layer + 2 * H * D * 4
    assert one.bytes_per_token < make_cache(m.cfg, "fp32", blocks=16).bytes_per_token
    err_one = (run_cached(m, one, {0: toks}, chunk=5)[0] - ref).abs().max()
    err_none = (run_cached(m, make_cache(m.cfg, "int4", blocks=16, block_size=8), {0: toks},
                           chunk=5)[0] - ref).abs().max()
    assert 0 < err_one < err_none


def test_skip_outside_the_model_is_an_error():
    m = tiny()
    with pytest.raises(SpecError, match="skip=2"):
        make_cache(m.cfg, "int8,skip=2", blocks=4)
    with pytest.raises(SpecError, match="skip=-3"):
        make_cache(m.cfg, "int8,skip=-3", blocks=4)


def test_skipped_layers_offload_like_the_rest():
    """Blocks of both storage groups move to the host tier and come back: the same tokens."""
    m = tiny()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (150, 90)]
    want, want_logits, _ = generate(m, "int4:rot,skip=0", prompts, num_blocks=64)
    got, logits, cache = generate(m, "int4:rot,skip=0", prompts, num_blocks=8, host_blocks=64,
                                  stage_blocks=5)
    assert cache.offload_stats()["blocks_read_staged"] > 0
    assert got == want
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)


def test_static_scales_of_a_rotated_spec():
    m = tiny()
    toks = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    spec = KVSpec.parse("int8:head:static:rot")
    scales = calibrate(m, toks, spec, window=64)
    plain = calibrate(m, toks, KVSpec.parse("int8:head:static"), window=64)
    assert not torch.allclose(scales["k_scale"], plain["k_scale"])  # observed after rotating
    cache = make_cache(m.cfg, spec, blocks=16, block_size=8, scales=scales)
    got = run_cached(m, cache, {0: toks}, chunk=8)[0]
    ref = m(torch.tensor([toks]))[0]
    assert cache.saturated == 0 and (got - ref).abs().max() < 0.05
    with pytest.raises(CalibrationError, match="rotation"):
        export_vllm(scales, spec, "/nonexistent/never-written.safetensors")


def random_centers(m, scale: float = 5.0) -> dict[str, torch.Tensor]:
    """Large per-channel means (L, H, D) for keys and values: far from what the model makes."""
    g = torch.Generator().manual_seed(12)
    shape = (m.cfg.n_layers, m.cfg.n_kv_heads, m.cfg.head_dim)
    return {"k_center": scale * torch.randn(shape, generator=g),
            "v_center": scale * torch.randn(shape, generator=g)}


@pytest.mark.parametrize("spec", ["fp32:center", "k=fp32:center,v=fp32", "k=fp32,v=fp32:center",
                                  "fp32:rot:center", "k=fp32:center:rot,v=fp32:rot,skip=0"])
def test_centering_with_exact_storage_changes_nothing(spec):
    """Softmax ignores q . mu_k, common to a query's scores, and sum p (v - mu) + mu = sum p v:
    a centered fp32 cache equals no cache, whatever the means."""
    m = tiny()
    toks = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = make_cache(m.cfg, spec, blocks=16, block_size=8, scales=random_centers(m))
    got = run_cached(m, cache, {0: toks}, chunk=5)[0]
    torch.testing.assert_close(got, m(torch.tensor([toks]))[0], atol=1e-4, rtol=1e-4)


def test_centering_stores_keys_minus_the_mean():
    m = tiny()
    toks = list(range(1, 30))
    centers = random_centers(m)
    plain = make_cache(m.cfg, "fp32", blocks=16, block_size=8)
    run_cached(m, plain, {0: toks}, chunk=4)
    centered = make_cache(m.cfg, "k=fp32:center,v=fp32", blocks=16, block_size=8, scales=centers)
    run_cached(m, centered, {0: toks}, chunk=4)
    (k0, v0), (k1, v1) = plain.seq_kv(0), centered.seq_kv(0)  # (L, H, T, D)
    torch.testing.assert_close(k1, k0 - centers["k_center"][:, :, None], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v1, v0)


def test_centering_needs_its_means():
    m = tiny()
    with pytest.raises(SpecError, match="centers k"):
        make_cache(m.cfg, "k=int4:center,v=int4", blocks=4, scales={"v_center": torch.zeros(1)})
    with pytest.raises(CacheError, match="calibration"):
        make_cache(m.cfg, "int4:center", blocks=4)


def test_calibrated_centers_and_scales_of_a_centered_spec():
    """The file's means are the recorded keys' means; static scales are observed on centered
    keys, and a cache with both follows the model."""
    m = tiny()
    toks = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    spec = KVSpec.parse("k=int8:head:static:center,v=int8:head:static")
    scales = calibrate(m, toks, spec, window=64)
    rec = record(m, toks, window=64)
    torch.testing.assert_close(scales["k_center"], rec.stacked("k").mean(2))
    assert "v_center" not in scales
    plain = calibrate(m, toks, KVSpec.parse("int8:head:static"), window=64)
    assert not torch.allclose(scales["k_scale"], plain["k_scale"])
    torch.testing.assert_close(scales["v_scale"], plain["v_scale"])
    cache = make_cache(m.cfg, spec, blocks=16, block_size=8, scales=scales)
    got = run_cached(m, cache, {0: toks}, chunk=8)[0]
    assert cache.saturated == 0 and (got - m(torch.tensor([toks]))[0]).abs().max() < 0.05
    with pytest.raises(CalibrationError, match="centering"):
        export_vllm(scales, spec, "/nonexistent/never-written.safetensors")


@pytest.mark.parametrize("spec", ["int4,residual=16", "k=int2:g32:mse,v=int8:asym,residual=16",
                                  "k=fp8:token,v=int4:g16,residual=16,hot=fp16",
                                  "k=int4:channel:asym,v=int2:g64:mse,residual=16"])
def test_a_full_hot_block_is_stored_as_the_reference_stores_its_tokens(spec):
    """pools.quantize_hot: a hot block's tokens go into the store block through the store
    kernel, layer by layer, bit for bit what quantize_store_ref makes of them; keys whose
    scales span the block (per channel) are made over the block in torch."""
    from tinykv.kernels.reference import quantize_store_ref

    m = tiny()
    cache = make_cache(m.cfg, spec, blocks=8, block_size=16)
    pools = cache.pools
    gen = torch.Generator().manual_seed(2)
    pools.hot.copy_(torch.randn(pools.hot.shape, generator=gen) * 3)
    hot_b, b = 1, 5
    pools.quantize_hot(hot_b, b)
    for layer in range(m.cfg.n_layers):
        for which, view in enumerate(pools.views[layer]):
            x = pools.hot[which, layer, hot_b].float()  # (H, BS, D)
            if view.p.block_wise:  # the block's own scales: its tokens within one step
                s, z = compute_scales(x, view.p)
                want = dequantize(quantize(x, view.p, s, z)[0], view.p, s, z)
                got = dequantize(view.data[b], view.p, view.scale[b], view.zero[b])
                torch.testing.assert_close(got, want)
                continue
            ref = [None if t is None else t.clone() for t in (view.data, view.scale, view.zero)]
            blk, off = torch.full((16,), b), torch.arange(16)
            quantize_store_ref(x.transpose(0, 1), view.p, *ref, blk, off)
            assert torch.equal(view.data[b].view(torch.uint8), ref[0][b].view(torch.uint8))
            for got, want in zip((view.scale, view.zero), ref[1:]):
                assert got is None or view.p.static or torch.equal(got[b], want[b])
