"""Per-layer formats (`k@0:1=int4:rot`, `v@..`, `@..`): the grammar, what each layer stores, and
every kernel serving a cache whose layers differ."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_cache import run_cached, tiny
from test_quant import parts

from tinykv.cache import make_cache
from tinykv.calibrate import calibrate, check_request, record
from tinykv.pools import block_bytes
from tinykv.quant import compute_scales, dequantize, quantize
from tinykv.scalefile import CalibrationError, load_scales, save_scales
from tinykv.spec import KVSpec, QuantParams, SpecError, layer_list

TOKENS = torch.randint(0, 128, (45,), generator=torch.Generator().manual_seed(5)).tolist()


@st.composite
def layer_lists(draw):
    """Layers as a user writes them: indices (some negative) and ascending ranges."""
    items = draw(st.lists(st.one_of(st.integers(-8, 30), st.tuples(st.integers(0, 20),
                                                                    st.integers(0, 6))),
                          min_size=1, max_size=4))
    text, seen = [], set()
    for it in items:
        layers = [it] if isinstance(it, int) else list(range(it[0], it[0] + it[1] + 1))
        if seen & set(layers):
            continue
        seen |= set(layers)
        text.append(str(it) if isinstance(it, int) else f"{it[0]}-{it[0] + it[1]}")
    return ":".join(text) or "0"


@given(parts(), st.lists(st.tuples(st.sampled_from(["k", "v", ""]), layer_lists(), parts()),
                         max_size=3),
       st.sampled_from(["", ",residual=64", ",sink=4,skip=31:-9"]))
def test_per_layer_roundtrip(base, lparts, opts):
    text = ",".join([base] + [f"{w}@{ls}={p}" for w, ls, p in lparts]) + opts
    try:
        kv = KVSpec.parse(text)
    except SpecError as e:  # a layer listed by two parts, or a value part with :smooth
        assert "\n" not in str(e) and str(e).startswith(f"bad KV spec {text!r}")
        assert "given two" in str(e) or "smooth" in str(e) or "skipped and" in str(e)
        return
    assert KVSpec.parse(str(kv)) == kv and str(KVSpec.parse(str(kv))) == str(kv)
    assert len(kv.per_layer) == len(lparts)


@pytest.mark.parametrize("layers, text", [((0, 1, 2, 5), "0-2:5"), ((3, 1, 2), "3:1:2"),
                                          ((-1, 0, 1), "-1:0:1"), ((4, 5), "4:5"),
                                          ((7, 8, 9, 10, -2), "7-10:-2")])
def test_layer_list_writes_runs_as_ranges(layers, text):
    assert layer_list(layers) == text
    assert KVSpec.parse(f"int4,k@{text}=int8").per_layer[0].layers == layers


def test_layer_parts_resolve_each_layer():
    kv = KVSpec.parse("k=int2:g32:rot,v=int2:g32,k@0:-1=int4:rot,@2-3=int8,v@1=fp16,skip=4")
    got = [(str(k), str(v)) for k, v in kv.layer_parts(6, QuantParams("bf16"))]
    assert got == [("int4:rot", "int2:g32"), ("int2:g32:rot", "fp16"), ("int8", "int8"),
                   ("int8", "int8"), ("bf16", "bf16"), ("int4:rot", "int2:g32")]
    assert not kv.needs_scales and not kv.block_wise
    assert KVSpec.parse("int4,k@1=int8:channel").block_wise  # a per-layer part counts
    assert KVSpec.parse("int4,v@1=int8:center").needs_scales
    assert not KVSpec.parse("fp16,@0=int8").is_float


@pytest.mark.parametrize("spec, bad", [
    ("int4,k@0:x=int8", "bad layers 'x'"), ("int4,k@3-1=int8", "bad layers '3-1'"),
    ("int4,k@0:0=int8", "layer 0 listed twice"), ("int4,q@0=int8", "q@0=int8"),
    ("int4,k@0=", "k@0="), ("int4,k@0=int9", "unknown dtype 'int9'"),
    ("k@0=int8,int4", "per-layer parts (k@..., v@..., @...) come after"),
    ("int4,k@0=int8,k@0=int4", "layer 0 is given two k parts"),
    ("int4,@0=int8,v@0=int4", "layer 0 is given two v parts"),
    ("int4,k@0=int8,skip=0", "layer 0 is skipped and given a part"),
    ("int4,v@2=int4:smooth", "smooth is for keys only"), ("int4,k@-=int8", "bad layers '-'"),
    ("int4,residual=4,k@0=int8", "options must come after the parts"),
])
def test_malformed_per_layer_parts(spec, bad):
    with pytest.raises(SpecError) as e:
        KVSpec.parse(spec)
    msg = str(e.value)
    assert "\n" not in msg and bad in msg and msg.startswith(f"bad KV spec {spec!r}")


@pytest.mark.parametrize("spec, why", [("int4,k@2=int8", "k@2 is outside the model's 2 layers"),
                                       ("int4,@-3=int8", "@-3 is outside"),
                                       ("int4,k@-1:1=int8", "layer 1 is given two k parts")])
def test_layers_outside_the_model_are_an_error(spec, why):
    with pytest.raises(SpecError, match=why):
        make_cache(tiny().cfg, spec, blocks=4)


def test_every_layer_overridden_equals_the_uniform_spec():
    m = tiny()
    mixed = run_cached(m, make_cache(m.cfg, "int8,@0:1=int4:rot", blocks=16, block_size=8),
                       {0: TOKENS}, chunk=5)[0]
    uniform = run_cached(m, make_cache(m.cfg, "int4:rot", blocks=16, block_size=8),
                         {0: TOKENS}, chunk=5)[0]
    assert torch.equal(mixed, uniform)
    skip = run_cached(m, make_cache(m.cfg, "int4,skip=1", blocks=16, block_size=8),
                      {0: TOKENS}, chunk=5)[0]
    fp32_layer = run_cached(m, make_cache(m.cfg, "int4,@1=fp32", blocks=16, block_size=8),
                            {0: TOKENS}, chunk=5)[0]
    assert torch.equal(skip, fp32_layer)  # skip= is a per-layer part at the model's dtype


def roundtrip(x: torch.Tensor, p: QuantParams) -> torch.Tensor:
    """x (H, T, D) through quant's reference functions, per token or group."""
    scale, zero = compute_scales(x, p)
    return dequantize(quantize(x, p, scale, zero)[0], p, scale, zero)


@pytest.mark.parametrize("layer", [0, 1])
def test_each_layer_stores_its_own_format(layer):
    """One layer quantized K as int4 and V as int2:g16, the other exact: its inputs are the
    uncached model's, so what it stores is quant's round trip of the recorded keys/values."""
    m = tiny()
    spec = f"fp32,k@{layer}=int4,v@{layer}=int2:g16"
    cache = make_cache(m.cfg, spec, blocks=16, block_size=8)
    run_cached(m, cache, {0: TOKENS}, chunk=5)
    k, v = cache.seq_kv(0)  # (L, H, T, D)
    rec = record(m, TOKENS, window=len(TOKENS))
    want_k, want_v = rec.stacked("k"), rec.stacked("v")
    if layer == 0:  # the exact layer 1 sees the quantized layer 0's outputs: compare layer 0
        want_k[0], want_v[0] = roundtrip(want_k[0], QuantParams.parse("int4")), \
            roundtrip(want_v[0], QuantParams.parse("int2:g16"))
        torch.testing.assert_close(k[0], want_k[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v[0], want_v[0], atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(k[0], want_k[0], atol=1e-5, rtol=1e-5)  # exact
    torch.testing.assert_close(k[1], roundtrip(want_k[1], QuantParams.parse("int4")),
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v[1], roundtrip(want_v[1], QuantParams.parse("int2:g16")),
                               atol=1e-4, rtol=1e-4)
    H, D, BS = m.cfg.n_kv_heads, m.cfg.head_dim, 8
    int4_k, int2_v = H * (D / 2 + 2), H * (D / 4 + 2 * D / 16)  # codes + fp16 scales
    assert cache.bytes_per_token == 2 * H * D * 4 + int4_k + int2_v
    assert block_bytes(m.cfg, KVSpec.parse(spec), BS) == cache.bytes_per_token * BS


# Block-wise per-channel keys beside per-token, packed int2 groups, fp8 and a residual window:
# the kernels meet a different format in each layer.
MIXED = "k=int4:channel:asym,v=int8:g32:asym,k@1=int2:g16:rot,v@1=fp8,residual=8"


@pytest.mark.parametrize("attention", ["cpu", "triton"])
def test_every_kernel_serves_every_layers_format(attention):
    if attention == "triton":
        pytest.importorskip("triton")
    m = tiny()
    ref = run_cached(m, make_cache(m.cfg, MIXED, blocks=16, block_size=8, attention="torch"),
                     {0: TOKENS}, chunk=5)[0]
    got = run_cached(m, make_cache(m.cfg, MIXED, blocks=16, block_size=8, attention=attention),
                     {0: TOKENS}, chunk=5)[0]
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)
    uniform = run_cached(m, make_cache(m.cfg, "k=int4:channel:asym,v=int8:g32:asym,residual=8",
                                       blocks=16, block_size=8, attention="torch"),
                         {0: TOKENS}, chunk=5)[0]
    assert (uniform - ref).abs().max() > 1e-3  # layer 1's part really reaches the store


def test_scale_file_serves_per_layer_parts(tmp_path):
    """Centers and static scales of a per-layer spec: calibrated, saved, checked layer by layer."""
    m = tiny()
    spec = KVSpec.parse("k=int8:head:static,v=int4:rot,k@1=int4:rot:center,v@0=int4:center")
    scales = calibrate(m, TOKENS, spec, window=len(TOKENS))
    assert set(scales) == {"k_scale", "k_center", "v_center"}
    path = tmp_path / "mixed.safetensors"
    save_scales(path, scales, m.cfg, spec, "minmax", len(TOKENS))
    assert load_scales(path, m.cfg, spec).keys() == {"k_scale", "k_center", "v_center"}
    got = run_cached(m, make_cache(m.cfg, spec, blocks=16, block_size=8, scales=scales),
                     {0: TOKENS}, chunk=5)[0]
    assert (got - m(torch.tensor([TOKENS]))[0]).abs().max() < 0.5
    with pytest.raises(CalibrationError, match="holds no means for v at layer 1"):
        load_scales(path, m.cfg, KVSpec.parse("k=int8:head:static,v=int4:rot,k@1=int4:rot:center,"
                                              "v@1=int4:center"))
    with pytest.raises(CalibrationError, match="holds scales for k=int4:rot:center, not "
                                               "k=int8:head:static at layer 1"):
        load_scales(path, m.cfg, KVSpec.parse("k=int8:head:static,v=int4:rot"))
    with pytest.raises(CalibrationError, match="2 static k formats"):
        check_request(KVSpec.parse("int8:head:static,k@1=int8:tensor:static"), "minmax")
    with pytest.raises(CalibrationError, match="per-layer formats"):
        check_request(KVSpec.parse("fp8:tensor:static,@1=fp8:tensor:static"), "minmax", vllm=True)
