"""Static calibration: observers against numpy, scales in quant.py's convention, static vs dynamic
perplexity, bit-exact files that refuse the wrong model or spec, and vLLM's export convention."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from test_cache import tiny
from test_evaluate import ppl, sample_text, sharp_tiny

from tinykv.cache import make_cache
from tinykv.calibrate import calibrate, record
from tinykv.evaluate import perplexity
from tinykv.observers import MSE_PERCENTILES, observe, parse_observer
from tinykv.plots import plot_channels
from tinykv.quant import quantize
from tinykv.scalefile import FORMAT, CalibrationError, fingerprint, load_scales, save_scales
from tinykv.spec import KVSpec, QuantParams
from tinykv.vllm_export import export_vllm

# Axes of (L, H, T, D) reduced per scale group, with keepdims.
AXES = {"tensor": (1, 2, 3), "head": (2, 3), "channel": (2,)}


def numpy_range(x: np.ndarray, gran: str, sym: bool,
                observer: str) -> tuple[np.ndarray, np.ndarray]:
    """What each observer claims to compute, written with numpy."""
    ax = AXES[gran]
    kind, arg = parse_observer(observer)
    mn, mx = x.min(ax, keepdims=True), x.max(ax, keepdims=True)
    if kind == "minmax":
        lo, hi = mn, mx
    elif kind == "percentile":
        if sym:
            hi = np.percentile(np.abs(x), arg, axis=ax, keepdims=True)
            return -hi, hi
        lo = np.percentile(x, 100 - arg, axis=ax, keepdims=True)
        hi = np.percentile(x, arg, axis=ax, keepdims=True)
    else:
        mean, std = x.mean(ax, keepdims=True), x.std(ax, keepdims=True)
        lo, hi = np.maximum(mean - arg * std, mn), np.minimum(mean + arg * std, mx)
    if sym:
        hi = np.maximum(np.abs(lo), np.abs(hi))
        lo = -hi
    return lo, hi


@pytest.fixture(scope="module")
def kv():
    """Recorded-like keys (L, H, T, D) with channel offsets and one outlier."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 200, 8, generator=g)
    x = x + torch.randn(1, 1, 1, 8, generator=g)  # channel offsets
    x[0, 1, 17, 5] = 40.0  # one outlier, which only minmax keeps
    return x


@pytest.mark.parametrize("observer", ["minmax", "percentile:99", "percentile:100", "meanstd:2"])
@pytest.mark.parametrize("gran", ["tensor", "head", "channel"])
@pytest.mark.parametrize("sym", [True, False])
def test_observers_match_numpy(kv, observer, gran, sym):
    p = QuantParams("int8", gran, sym=sym, static=True)
    lo, hi = observe(kv, p, observer)
    want_lo, want_hi = numpy_range(kv.numpy(), gran, sym, observer)
    heads = 1 if gran == "tensor" else 3
    groups = 8 if gran == "channel" else 1
    assert lo.shape == hi.shape == (2, heads, 1, groups)
    np.testing.assert_allclose(lo.numpy(), want_lo, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hi.numpy(), want_hi, rtol=1e-5, atol=1e-6)


def test_clipping_observers_clip_the_outlier(kv):
    p = QuantParams("int8", "head", static=True)
    full = observe(kv, p, "minmax")[1][0, 1].item()
    assert full == 40.0
    assert observe(kv, p, "percentile:99.9")[1][0, 1].item() < 10
    assert observe(kv, p, "meanstd:3")[1][0, 1] < 10


def numpy_round_trip_error(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, p: QuantParams,
                           ax: tuple[int, ...]) -> np.ndarray:
    """Squared error per scale group of storing x in the integer format p with range (lo, hi):
    sym levels (c - offset) * hi / qmax, asym (c - round(-lo / s)) * s with s = (hi - lo) / qmax,
    codes rounded to nearest and clipped."""
    if p.sym:
        scale, shift = hi / p.qmax, p.offset
    else:
        scale = (hi - lo) / p.qmax
        shift = np.round(-lo / scale)
    codes = np.clip(np.round(x / scale + shift), p.qmin + p.offset, p.qmax + p.offset)
    return np.square((codes - shift) * scale - x).sum(ax, keepdims=True)


@pytest.mark.parametrize("fmt", ["int2", "int2:asym", "int4", "int8"])
@pytest.mark.parametrize("gran", ["tensor", "head", "channel"])
def test_mse_observer_keeps_the_range_of_least_error(fmt, gran):
    """Per scale group, no percentile range mse tries loses less than the one it chose; at 2
    bits on heavy-tailed values it clips (far less error than minmax), at 8 bits it loses no more
    than minmax."""
    g = torch.Generator().manual_seed(1)
    signs = torch.randint(0, 2, (2, 3, 400, 8), generator=g) * 2.0 - 1
    x = torch.empty(2, 3, 400, 8).exponential_(generator=g) * signs  # Laplace: heavy tails
    x = x + torch.randn(1, 1, 1, 8, generator=g)  # channel offsets
    p = QuantParams.parse(f"{fmt}:{gran}:static")
    lo, hi = observe(x, p, "mse")
    heads, groups = (1 if gran == "tensor" else 3), (8 if gran == "channel" else 1)
    assert lo.shape == hi.shape == (2, heads, 1, groups)
    xs, ax = x.numpy().astype(np.float64), AXES[gran]
    chosen = numpy_round_trip_error(xs, lo.numpy(), hi.numpy(), p, ax)
    for percentile in MSE_PERCENTILES:
        tried = numpy_range(x.numpy(), gran, p.sym, f"percentile:{percentile}")
        assert (chosen <= numpy_round_trip_error(xs, *tried, p, ax) * (1 + 1e-4)).all()
    whole = numpy_round_trip_error(xs, *numpy_range(x.numpy(), gran, p.sym, "minmax"), p, ax)
    if fmt.startswith("int2"):
        assert (chosen < 0.7 * whole).all()
        seen = x.abs() if p.sym else x
        assert (hi.numpy() < seen.numpy().max(ax, keepdims=True)).all()


@pytest.mark.parametrize("bad", ["max", "percentile", "percentile:0", "percentile:101",
                                 "meanstd:-1", "minmax:3", "mse:3"])
def test_bad_observer(bad):
    with pytest.raises(CalibrationError, match="bad observer"):
        parse_observer(bad)


def test_scales_follow_quant_convention():
    """sym: absmax / qmax (fp8: / 448); asym: (max - min) / qmax, integer zero =
    round(-min / scale)."""
    m = tiny()
    toks = list(range(0, 128, 3)) * 2
    rec = record(m, toks, window=40)
    K, V = rec.stacked("k"), rec.stacked("v")  # (L, H, T, D)
    spec = KVSpec.parse("k=fp8:head:static,v=int4:channel:asym:static")
    scales = calibrate(m, toks, spec, window=40)
    assert all(t.dtype == torch.float32 for t in scales.values())
    k_absmax = K.abs().amax((2, 3), keepdim=True)
    torch.testing.assert_close(scales["k_scale"], k_absmax / 448, rtol=2e-7, atol=0)
    mn, mx = V.amin(2, keepdim=True), V.amax(2, keepdim=True)
    torch.testing.assert_close(scales["v_scale"], (mx - mn) / 15, rtol=1e-6, atol=0)
    assert torch.equal(scales["v_zero"], (-mn / scales["v_scale"]).round())
    # minmax scales hold every value seen: storing the calibration data itself clips nothing
    stored = ((K, spec.k, scales["k_scale"], None),
              (V, spec.v, scales["v_scale"], scales["v_zero"]))
    for x, p, scale, zero in stored:
        assert quantize(x, p, scale, zero)[1] == 0
    s8 = calibrate(m, toks, KVSpec.parse("int8:tensor:static"), window=40)
    v_absmax = V.abs().amax((1, 2, 3), keepdim=True)
    torch.testing.assert_close(s8["v_scale"], v_absmax / 127, rtol=2e-7, atol=0)


def test_static_tensor_matches_dynamic_tensor():
    """Scales calibrated on the evaluation text itself: static per-tensor int8 ~ dynamic per-tensor
    int8."""
    m = sharp_tiny()
    toks = sample_text(m, 256)
    spec = KVSpec.parse("int8:tensor:static")
    scales = calibrate(m, toks, spec, window=128)
    cache = make_cache(m.cfg, spec, tokens=128, max_seqs=1, max_step_tokens=32, scales=scales)
    static = perplexity(m, cache, toks, 128, 32).ppl
    dynamic, exact = ppl(m, toks, "int8:tensor"), ppl(m, toks, "fp32")
    assert static == pytest.approx(dynamic, rel=1e-3) and static == pytest.approx(exact, rel=1e-3)


@pytest.fixture
def saved(tmp_path):
    """A scale file of a tiny model: (model, spec, scales, path)."""
    m = tiny()
    spec = KVSpec.parse("k=int8:channel:static,v=int4:head:asym:static")
    scales = calibrate(m, list(range(100)), spec, "percentile:99.5", window=64)
    path = tmp_path / "s.safetensors"
    save_scales(path, scales, m.cfg, spec, "percentile:99.5", 100)
    return m, spec, scales, path


def test_file_round_trips_bit_exactly(saved):
    m, spec, scales, path = saved
    back = load_scales(path, m.cfg, spec)
    assert back.keys() == scales.keys() == {"k_scale", "v_scale", "v_zero"}
    assert all(torch.equal(back[n], scales[n]) and back[n].dtype == torch.float32 for n in scales)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert meta["spec"] == str(spec) and meta["observer"] == "percentile:99.5"
    assert meta["tokens"] == "100"
    shape = (meta["n_layers"], meta["n_kv_heads"], meta["head_dim"], meta["model_type"])
    assert shape == ("2", "2", "64", "llama")
    # a spec whose static parts agree may differ elsewhere (residual, a dynamic K)
    other = KVSpec.parse("k=int8,v=int4:head:asym:static,residual=32")
    assert load_scales(path, m.cfg, other).keys() == {"v_scale", "v_zero"}


@pytest.mark.parametrize("model,spec,why", [
    (dict(n_kv=3, n_heads=6), None, "n_kv_heads 2 != 3"),
    (dict(seed=0, model_type="qwen2"), None, "model_type llama != qwen2"),
    (dict(hd=80, n_heads=6, n_kv=2), None, "head_dim 64 != 80"),
    (None, "k=int8:head:static,v=int4:head:asym:static", "holds scales for k=int8:channel:static"),
    (None, "k=int8:channel:static,v=int4:head:static", "holds scales for v=int4:head:asym:static"),
    (None, "int8", "has no static, centered or smoothed part"),
    (None, "k=int8:center,v=int4:head:asym:static", "holds no means for k"),
])
def test_mismatched_file_is_a_clear_error(saved, model, spec, why):
    m, good_spec, _, path = saved
    cfg = tiny(**model).cfg if model else m.cfg
    with pytest.raises(CalibrationError, match=why) as e:
        load_scales(path, cfg, KVSpec.parse(spec) if spec else good_spec)
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


def test_same_shapes_other_config_is_refused(saved):
    m, spec, _, path = saved
    other = tiny().cfg
    other.vocab_size = 50  # same shapes, another model: only the config hash tells
    with pytest.raises(CalibrationError, match="config_hash"):
        load_scales(path, other, spec)


def test_missing_or_foreign_file(tmp_path, saved):
    m, spec, _, _ = saved
    with pytest.raises(CalibrationError, match="not found"):
        load_scales(tmp_path / "nope.safetensors", m.cfg, spec)
    (tmp_path / "junk.safetensors").write_bytes(b"not a tensor file")
    with pytest.raises(CalibrationError, match="not a safetensors file"):
        load_scales(tmp_path / "junk.safetensors", m.cfg, spec)
    from safetensors.torch import save_file

    save_file({"k_scale": torch.ones(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(CalibrationError, match="not a tinykv scale file"):
        load_scales(tmp_path / "other.safetensors", m.cfg, spec)
    # a file that claims the format and the model but names no spec, or a malformed one
    for meta in ({}, {"spec": "int9"}):
        meta = {"format": FORMAT, **fingerprint(m.cfg), **meta}
        save_file({"k_scale": torch.ones(1)}, str(tmp_path / "bare.safetensors"), metadata=meta)
        with pytest.raises(CalibrationError, match="no valid KV spec"):
            load_scales(tmp_path / "bare.safetensors", m.cfg, spec)


@pytest.mark.parametrize("gran", ["tensor", "head"])
@pytest.mark.parametrize("dtype,qmax,kind", [("fp8", 448, "float"), ("int8", 127, "int")])
def test_vllm_export(tmp_path, gran, dtype, qmax, kind):
    m = tiny(n_heads=6, n_kv=3)
    toks = list(range(90))
    spec = KVSpec.parse(f"{dtype}:{gran}:static")
    scheme = export_vllm(calibrate(m, toks, spec, window=90), spec, tmp_path / "kv.safetensors")
    want = {"num_bits": 8, "type": kind, "strategy": "tensor" if gran == "tensor" else "attn_head",
            "dynamic": False, "symmetric": True}
    assert scheme == want
    written = json.loads((tmp_path / "kv.kv_cache_scheme.json").read_text())
    assert written == {"kv_cache_scheme": want}
    K = record(m, toks, window=90).stacked("k")  # (L, H, T, D)
    with safe_open(str(tmp_path / "kv.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names == {f"model.layers.{i}.self_attn.{n}_scale" for i in range(2) for n in "kv"}
        for i in range(2):
            t = f.get_tensor(f"model.layers.{i}.self_attn.k_scale")
            if gran == "tensor":
                shape, amax = (1,), K[i].abs().amax()
            else:
                shape, amax = (3, 1, 1), K[i].abs().amax((1, 2))
            assert t.dtype == torch.float32 and t.shape == shape
            want_scale = (amax / qmax).flatten().float()
            torch.testing.assert_close(t.flatten(), want_scale, rtol=1e-6, atol=0)


@pytest.mark.parametrize("spec", ["int8:channel:static", "int8:tensor:asym:static",
                                  "k=fp8:static,v=int8:tensor:static", "int4:tensor:static",
                                  "k=fp8:static,v=fp16"])
def test_vllm_export_refuses_what_it_cannot_express(tmp_path, spec):
    with pytest.raises(CalibrationError, match="vLLM"):
        export_vllm({}, KVSpec.parse(spec), tmp_path / "x.safetensors")


def test_plot_channels(tmp_path):
    pytest.importorskip("matplotlib")
    rec = record(tiny(), list(range(50)), window=50)
    plot_channels(rec.stacked("k"), rec.stacked("v"), tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_levels_used_finds_scales_far_too_large():
    """Scales from the text itself use most of int8's range; a thousand times larger, 99.9% of
    the values sit within a fraction of a step of zero (and nothing clips to tell)."""
    from tinykv.calibrate import levels_used

    m = tiny()
    spec = KVSpec.parse("k=int8:channel:static,v=int8:head:asym:static")
    tokens = list(range(100))
    scales = calibrate(m, tokens, spec, window=64)
    fit = levels_used(m, tokens, spec, scales)
    assert fit.keys() == {"k", "v"} and min(fit.values()) > 20
    big = {name: s * 1000 if name.endswith("scale") else s for name, s in scales.items()}
    assert max(levels_used(m, tokens, spec, big).values()) < 0.2
