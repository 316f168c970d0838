"""`:smooth`: a calibrated per-head map S on keys (S^-T on queries) that moves key quantization
error to where queries look least. Exactness through the cache, the map against its defining
equation and its objective, the error it saves with real quantization, and the scale file."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_cache import run_cached, tiny

from tinykv.cache import make_cache
from tinykv.calibrate import calibrate, record, smooth_maps, stored_attention
from tinykv.quant import compute_scales, dequantize, layer_transforms, quantize, rotation_matrix
from tinykv.scalefile import CalibrationError, load_scales, save_scales
from tinykv.spec import KVSpec, SpecError
from tinykv.vllm_export import export_vllm


def anisotropic(n: int, d: int, seed: int, decay: float) -> torch.Tensor:
    """n samples (n, d) whose channel energies fall off geometrically, in a random basis."""
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return (torch.randn(n, d, generator=g, dtype=torch.float64) * decay ** torch.arange(d)
            ) @ basis.T


def objective(kc: torch.Tensor, qc: torch.Tensor, s: torch.Tensor) -> float:
    """tr(Kc M) tr(Qc M^-1), M = S S^T: the expected score error up to a constant."""
    m = s @ s.T
    return float(torch.trace(kc @ m) * torch.trace(qc @ torch.linalg.inv(m)))


def test_smooth_map_is_the_geometric_mean_and_minimizes_the_score_error():
    d = 16
    k = anisotropic(4000, d, 0, 0.8)  # (T, D)
    q = anisotropic(4000, d, 1, 0.85)
    s = smooth_maps(k[None, None].float(), q[None, None].float(), ridge=0.0)[0, 0].double()
    kc, qc = k.T @ k / len(k), q.T @ q / len(q)
    m = s @ s.T
    # the defining equation of the geometric mean of Kc^-1 and Qc, up to S's free scale
    mkm = m @ kc @ m
    torch.testing.assert_close(mkm / mkm.trace(), qc / qc.trace(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.trace(kc @ m), torch.trace(kc), rtol=1e-5, atol=0)
    best = objective(kc, qc, s)
    assert best < 0.9 * objective(kc, qc, torch.eye(d, dtype=torch.float64))
    g = torch.Generator().manual_seed(2)
    for _ in range(20):  # no nearby map does better
        nudged = s + 0.02 * s.norm() / d * torch.randn(d, d, generator=g, dtype=torch.float64)
        assert objective(kc, qc, nudged) >= best * (1 - 1e-9)


def test_smoothing_lowers_the_score_error_of_int2_keys():
    """Real per-token int2 storage of rotated keys: q . k's error is smaller with S."""
    h, d = 2, 64
    k = torch.stack([anisotropic(2048, d, 3 + i, 0.93) for i in range(h)]).float()  # (H, T, D)
    q = torch.stack([anisotropic(2048, d, 9 + i, 0.9) for i in range(h)]).float()
    s = smooth_maps(k[None], q[None])[0]  # (H, D, D)
    p = KVSpec.parse("int2:g32:asym").k
    r = rotation_matrix(d, 0)

    def score_error(maps: torch.Tensor) -> float:
        qs = q @ torch.linalg.inv(maps).mT @ r  # (H, T, D)
        ks = k @ maps @ r
        sc, z = compute_scales(ks, p)
        back = dequantize(quantize(ks, p, sc, z)[0], p, sc, z)
        return float(((qs[:, :256] @ (back - ks).mT) ** 2).mean())
    plain = score_error(torch.eye(d).expand(h, d, d))
    assert score_error(s) < 0.8 * plain


def random_maps(m) -> dict[str, torch.Tensor]:
    """Well-conditioned maps (L, H, D, D), far from the identity and not symmetric (a
    calibrated S is; a file's need not be)."""
    g = torch.Generator().manual_seed(5)
    L, H, D = m.cfg.n_layers, m.cfg.n_kv_heads, m.cfg.head_dim
    return {"k_smooth": torch.eye(D) + 0.4 * torch.randn(L, H, D, D, generator=g) / D**0.5}


@pytest.mark.parametrize("spec", ["k=fp32:smooth,v=fp32", "k=fp32:rot:smooth,v=fp32:rot",
                                  "k=fp32:rot:center:smooth,v=fp32,skip=-1"])
def test_smoothing_with_exact_storage_changes_nothing(spec):
    """q S^-T . k S = q . k: a smoothed fp32 cache (GQA: 3 query heads per KV head) equals no
    cache, whatever the maps."""
    m = tiny()
    toks = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    scales = random_maps(m)
    scales["k_center"] = torch.randn(m.cfg.n_layers, m.cfg.n_kv_heads, m.cfg.head_dim)
    cache = make_cache(m.cfg, spec, blocks=16, block_size=8, scales=scales)
    got = run_cached(m, cache, {0: toks}, chunk=5)[0]
    torch.testing.assert_close(got, m(torch.tensor([toks]))[0], atol=1e-4, rtol=1e-4)
    t = layer_transforms(KVSpec.parse(spec), 2, 64, scales)[0]
    assert t.sk is not None and not torch.allclose(t.sk, torch.eye(64).expand_as(t.sk))


def test_smooth_spec_grammar():
    kv = KVSpec.parse("k=int2:g64:asym:smooth:center:rot,v=int2:g64:asym:rot")
    assert (kv.k.smooth, kv.v.smooth, kv.needs_scales) == (True, False, True)
    assert str(kv) == "k=int2:g64:asym:rot:center:smooth,v=int2:g64:asym:rot"
    with pytest.raises(SpecError, match="smooth is for keys only"):
        KVSpec.parse("int4:rot:smooth")
    with pytest.raises(SpecError, match="smooth given twice"):
        KVSpec.parse("k=int4:smooth:smooth,v=int4")
    with pytest.raises(SpecError, match="smooths k"):
        layer_transforms(KVSpec.parse("k=int4:smooth,v=int4"), 2, 64, {"k_center": None})


def test_calibrated_maps_load_and_a_bad_file_is_refused(tmp_path):
    m = tiny()
    toks = torch.randint(0, 128, (96,), generator=torch.Generator().manual_seed(3)).tolist()
    spec = KVSpec.parse("k=int4:rot:center:smooth,v=int4:rot")
    scales = calibrate(m, toks, spec, window=48)
    L, H, D = m.cfg.n_layers, m.cfg.n_kv_heads, m.cfg.head_dim
    assert scales["k_smooth"].shape == (L, H, D, D) and "k_center" in scales
    path = tmp_path / "s.safetensors"
    save_scales(path, scales, m.cfg, spec, "minmax", len(toks))
    loaded = load_scales(path, m.cfg, spec)
    torch.testing.assert_close(loaded["k_smooth"], scales["k_smooth"])
    cache = make_cache(m.cfg, spec, blocks=16, block_size=8, scales=loaded)
    got = run_cached(m, cache, {0: toks[:40]}, chunk=8)[0]
    assert (got - m(torch.tensor([toks[:40]]))[0]).abs().max() < 0.5  # int4 stays close
    with pytest.raises(CalibrationError, match="smoothing"):
        export_vllm(scales, spec, "/nonexistent/never-written.safetensors")
    # a file for the same spec without smoothing holds no maps
    plain_spec = KVSpec.parse("k=int4:rot:center,v=int4:rot")
    other = tmp_path / "plain.safetensors"
    save_scales(other, calibrate(m, toks, plain_spec, window=48), m.cfg, plain_spec, "minmax", 96)
    with pytest.raises(CalibrationError, match="holds no smoothing maps for k"):
        load_scales(other, m.cfg, spec)
    # maps fitted to centered keys do not fit uncentered ones
    with pytest.raises(CalibrationError, match="fitted to centered keys"):
        load_scales(path, m.cfg, KVSpec.parse("k=int4:rot:smooth,v=int4:rot"))
    # a singular map would change every score: refused on load
    tensors = load_file(path)
    tensors["k_smooth"][0, 0, :, 0] = 0.0
    bad = tmp_path / "bad.safetensors"
    with safe_open(str(path), framework="pt") as f:  # the same fingerprint and spec
        meta = f.metadata()
    save_file(tensors, bad, metadata=meta)
    with pytest.raises(CalibrationError, match="not invertible"):
        load_scales(bad, m.cfg, spec)


def test_stored_attention_is_the_attention_quantized_keys_receive():
    """Against torch's attention with one-hot values (its output rows are the probabilities)."""
    m = tiny()
    toks = torch.randint(0, 128, (50,), generator=torch.Generator().manual_seed(4)).tolist()
    rec = record(m, toks, window=32, keep_q=True)  # windows of 32 and 18 tokens
    sink, residual = 3, 5
    got = stored_attention(rec, sink, residual)  # (L, H, 50)
    H = m.cfg.n_kv_heads
    for layer in range(m.cfg.n_layers):
        start = 0
        for q, k in zip(rec.seen["q"][layer], rec.seen["k"][layer]):  # (Hq | H, n, D)
            n = k.shape[1]
            kk = k.repeat_interleave(q.shape[0] // H, 0)
            probs = torch.nn.functional.scaled_dot_product_attention(
                q[None], kk[None], torch.eye(n).expand(1, q.shape[0], n, n), is_causal=True)[0]
            i, j = torch.arange(n)[:, None], torch.arange(n)[None]
            want = (probs * ((j >= sink) & (i - j >= residual))).sum(1)  # (Hq, n)
            want = want.unflatten(0, (H, -1)).sum(1)  # (H, n)
            torch.testing.assert_close(got[layer, :, start:start + n], want, atol=1e-5, rtol=1e-4)
            start += n
    assert (got[:, :, :sink] == 0).all() and (got[:, :, 32 - residual:32] == 0).all()
    no_exact = stored_attention(rec, 0, 0).sum(-1)  # every query's probabilities sum to 1
    torch.testing.assert_close(no_exact, torch.full_like(no_exact, 50.0 * m.cfg.n_heads / H))


def test_weighted_maps_fit_the_weighted_keys():
    """Weights that select half the keys give the map of that half alone."""
    k = anisotropic(2000, 16, 6, 0.8).float()[None, None]  # (1, 1, T, D)
    q = anisotropic(2000, 16, 7, 0.9).float()[None, None]
    w = torch.zeros(1, 1, 2000)
    w[..., :1000] = 1.0
    half = smooth_maps(k[:, :, :1000], q)
    torch.testing.assert_close(smooth_maps(k, q, w), half, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(smooth_maps(k, q), half, atol=1e-3)
    zero = smooth_maps(k, q, torch.zeros(1, 1, 2000))  # nothing read quantized: all alike
    torch.testing.assert_close(zero, smooth_maps(k, q))
