"""Tests for tinykv/quant.py: error bounds, packing, edge cases and the KV spec grammar."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinykv.formats import bytes_per_token
from tinykv.quant import (
    FIT_STEPS,
    MSE_CLIPS,
    cast_up,
    compute_scales,
    dequantize,
    pack,
    quantize,
    unpack,
)
from tinykv.spec import KVSpec, QuantParams, SpecError

INTS = ("int8", "int4", "int2")
GRANS = ("token", "g4", "channel", "head", "tensor")
FAST = settings(max_examples=60, deadline=None)


def expand(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A scale/zero of shape (..., H|1, T|1, G) broadcast to x's (..., H, T, D), per element."""
    return t.float().repeat_interleave(x.shape[-1] // t.shape[-1], -1).expand_as(x)


def group_reduce(x: torch.Tensor, gran: str, fn) -> torch.Tensor:
    """Reference reduction of x (..., H, T, D) over each element's scale group, per element."""
    if gran.startswith("g"):
        n = int(gran[1:])
        groups = x.unflatten(-1, (-1, n))  # (..., H, T, G, n)
        return fn(groups, -1, keepdim=True).expand(*x.shape[:-1], -1, n).flatten(-2)
    dims = {"token": (-1,), "channel": (-2,), "head": (-2, -1), "tensor": (-3, -2, -1)}[gran]
    return fn(x, dims, keepdim=True).expand_as(x)


def roundtrip(x, p, **kw):
    """Dynamic scales, quantize, dequantize: (scale, zero, stored, n_saturated, dequantized)."""
    scale, zero = compute_scales(x, p, **kw)
    stored, n_sat = quantize(x, p, scale, zero)
    return scale, zero, stored, n_sat, dequantize(stored, p, scale, zero)


@st.composite
def tensors(draw, finite=True):
    """Small (B?, H, T, D) tensors: hypothesis floats (ties, zeros, denormals, huge) or scaled
    randn."""
    batch = draw(st.sampled_from([(), (2,)]))
    shape = (*batch, draw(st.integers(1, 3)), draw(st.integers(1, 4)),
             draw(st.sampled_from([4, 8, 16])))
    n = torch.Size(shape).numel()
    if draw(st.booleans()):
        vals = draw(st.lists(st.floats(-1e4, 1e4, width=32), min_size=n, max_size=n))
        return torch.tensor(vals).reshape(shape)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    mag = draw(st.sampled_from([1e-3, 1.0, 30.0, 1e4]))
    off = draw(st.sampled_from([0.0, 5.0, -300.0]))
    return torch.randn(shape, generator=g) * mag + off


@FAST
@given(x=tensors(), dtype=st.sampled_from(INTS), gran=st.sampled_from(GRANS), sym=st.booleans(),
       scale_dtype=st.sampled_from([torch.float16, torch.float32, torch.bfloat16]))
def test_int_error_within_half_step(x, dtype, gran, sym, scale_dtype):
    p = QuantParams.parse(f"{dtype}:{gran}:{'sym' if sym else 'asym'}")
    scale, zero, stored, n_sat, y = roundtrip(x, p, scale_dtype=scale_dtype)
    want_shape = (*x.shape[:-3], *p.scale_shape(*x.shape[-3:]))
    assert scale.dtype == scale_dtype and scale.shape == want_shape
    assert (scale > 0).all() and scale.float().isfinite().all()
    assert stored.dtype == p.storage_dtype and stored.shape[-1] == x.shape[-1] // p.per_byte
    assert n_sat == 0
    step = expand(scale, x)
    err = (x - y).abs()
    assert (err <= step / 2 * (1 + 1e-3)).all(), f"max err/step {(err / step).max():.4f}"
    # The scale is tight (else the bound above is easy): range / qmax rounded up, plus for asym
    # groups far from 0 the slack that keeps zero a small exact integer.
    mn, mx = group_reduce(x, gran, torch.amin), group_reduce(x, gran, torch.amax)
    tiny = torch.finfo(scale_dtype).tiny
    if sym:
        assert (step <= torch.maximum(mx, -mn) / p.qmax * (1 + 2**-6) + tiny).all()
    else:
        room = (256 if scale_dtype == torch.bfloat16 else 2048) - p.qmax
        slack = torch.maximum(mx.abs(), mn.abs()) / room * ((mn > 0) | (mx < 0))
        assert (step <= ((mx - mn) / p.qmax + slack) * (1 + 2**-6) + tiny).all()
        z = expand(zero, x)
        assert (z == z.round()).all()


@FAST
@given(x=tensors(), gran=st.sampled_from(GRANS))
def test_fp8_relative_error(x, gran):
    p = QuantParams.parse(f"fp8:{gran}")
    scale, _, stored, n_sat, y = roundtrip(x, p)
    assert stored.dtype == torch.float8_e4m3fn and n_sat == 0
    step = expand(scale, x)
    # e4m3: 3 mantissa bits -> half-ulp relative 2^-4 for normals; subnormal spacing 2^-9 * scale
    bound = x.abs() * 2**-4 + step * 2**-10
    assert ((x - y).abs() <= bound * (1 + 1e-3)).all()
    # the max maps near 448, not below
    assert (step <= x.abs().max() / 448 * (1 + 2**-9) + 6.2e-5).all()


def test_channel_asym_keeps_resolution_away_from_zero():
    # A KIVI-style key channel living in [5, 7]: the step must be ~2/15, not 7/15.
    x = torch.linspace(5, 7, 64).reshape(1, 64, 1).expand(2, 64, 8).contiguous()
    p = QuantParams.parse("int4:channel:asym")
    scale, zero, _, n_sat, y = roundtrip(x, p)
    assert scale.shape == (2, 1, 8) and n_sat == 0
    assert scale.float().max() <= 2 / 15 * 1.001
    assert (x - y).abs().max() <= 1 / 15 * 1.001


@pytest.mark.parametrize("per_byte", [2, 4])
@given(codes=st.lists(st.integers(0, 255), min_size=48, max_size=48))
def test_pack_roundtrip(per_byte, codes):
    c = (torch.tensor(codes, dtype=torch.uint8) % (1 << (8 // per_byte))).reshape(2, 3, 8)
    packed = pack(c, per_byte)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 8 // per_byte)
    assert torch.equal(unpack(packed, per_byte), c)


def test_pack_bit_order():
    assert pack(torch.tensor([1, 2], dtype=torch.uint8), 2).tolist() == [0x21]
    assert pack(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 4).tolist() == [1 | 2 << 2 | 3 << 4]
    # sym int4 stores q + 8: -7 -> 1 (low nibble), 7 -> 15 (high nibble)
    p = QuantParams.parse("int4")
    stored, _ = quantize(torch.tensor([[[-7.0, 7.0]]]), p, torch.ones(1, 1, 1), None)
    assert stored.tolist() == [[[0xF1]]]


def test_sym_int2_is_midrise():
    """Four levels, -1.5..1.5 steps, absmax on the outer ones: all four codes are used (a zero
    level would leave three)."""
    p = QuantParams.parse("int2")
    x = torch.tensor([[[-3.0, -1.0, 1.0, 3.0, 0.9, -0.1, 2.1, -2.9]]])  # (H, T, D)
    scale, zero = compute_scales(x, p)
    assert zero is None and scale.item() == 2.0  # absmax 3 is 1.5 steps
    stored, n_sat = quantize(x, p, scale, zero)
    assert unpack(stored, 4).tolist() == [[[0, 1, 2, 3, 2, 1, 3, 0]]] and n_sat == 0
    want = torch.tensor([[[-3.0, -1.0, 1.0, 3.0, 1.0, -1.0, 3.0, -3.0]]])
    assert torch.equal(dequantize(stored, p, scale, zero), want)


@pytest.mark.parametrize("spec", ["int8", "int4:asym", "int2:g4", "int8:channel:asym", "fp8",
                                  "int4:head"])
def test_all_zero_and_constant(spec):
    p = QuantParams.parse(spec)
    zeros = torch.zeros(2, 3, 8)
    scale, zero, _, n_sat, y = roundtrip(zeros, p)
    assert (scale > 0).all() and scale.float().isfinite().all() and n_sat == 0
    if p.qmax % 1:  # midrise (sym int2): no zero level, 0 comes back half a (tiny) step off
        assert (y.abs() == expand(scale, y).float() / 2).all() and (scale < 1e-4).all()
    else:
        assert torch.equal(y, zeros)
    for c in (3.7, -0.02, 1234.5):
        x = torch.full((2, 3, 8), c)
        scale, _, _, n_sat, y = roundtrip(x, p)
        within_half_step = ((y - c).abs() <= expand(scale, x) / 2 * 1.001).all()
        assert n_sat == 0 and (p.dtype == "fp8" or within_half_step)
        assert ((y - c).abs() <= abs(c) * 0.07).all()  # fp8 relative; integers are far closer


NAN_SPECS = ["int8", "int4:asym", "int2:g4:asym", "int8:channel", "fp8", "int4:head:asym"]


@pytest.mark.parametrize("spec", NAN_SPECS)
def test_nan_inf_ignored_for_scales(spec):
    p = QuantParams.parse(spec)
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(0))
    bad = x.clone()
    bad[0, 1, 2], bad[1, 3, 0], bad[1, 0, 5] = float("nan"), float("inf"), float("-inf")
    bad[0, 2] = float("nan")  # a whole token (group) with nothing finite
    scale, zero, stored, n_sat, y = roundtrip(bad, p)
    assert (scale > 0).all() and scale.float().isfinite().all()
    assert zero is None or zero.float().isfinite().all()
    assert n_sat == 8 + 3
    fin = bad.isfinite()
    assert ((bad - y).abs()[fin] <= expand(scale, bad)[fin] / 2 * 1.001).all() or spec == "fp8"
    assert y.isfinite().all()
    if p.sym:  # NaN is stored as the code of 0
        assert (y[bad.isnan()] == 0).all()


def test_huge_values_saturate_instead_of_inf_scale():
    p = QuantParams.parse("int8")
    x = torch.tensor([[[1e38, -1e38, 1.0, 0.0]]])
    scale, _, _, n_sat, y = roundtrip(x, p)
    assert scale.item() == torch.finfo(torch.float16).max and n_sat == 2
    assert y[0, 0, :2].tolist() == [127 * 65504.0, -127 * 65504.0]


@pytest.mark.parametrize("spec", ["int8:tensor:static", "int4:head:asym:static",
                                  "int2:channel:static"])
def test_static_scale_too_small_saturates(spec):
    p = QuantParams.parse(spec)
    x = torch.linspace(-10, 10, 64).reshape(1, 8, 8)
    scale = torch.full(p.scale_shape(1, 8, 8), 0.05, dtype=torch.float16)
    zero = None if p.sym else torch.full_like(scale, (p.qmax + 1) // 2)
    stored, n_sat = quantize(x, p, scale, zero)
    y = dequantize(stored, p, scale, zero)
    step = scale.float().flatten()[0].item()
    if p.sym:
        lo, hi = -p.qmax, p.qmax
    else:  # codes 0..qmax around the zero point (qmax + 1) // 2
        lo, hi = -((p.qmax + 1) // 2), p.qmax - (p.qmax + 1) // 2
    v = x / step
    assert n_sat == int(((v < lo - 0.5) | (v > hi + 0.5)).sum()) > 0
    assert torch.allclose(y, v.round().clamp(lo, hi) * step)


def test_dequantize_accepts_expanded_scales():
    p = QuantParams.parse("int4:channel:asym")
    x = torch.randn(3, 2, 16, 8, generator=torch.Generator().manual_seed(1))
    scale, zero, stored, _, y = roundtrip(x, p)
    wide = dict(scale=scale.expand(3, 2, 16, 8), zero=zero.expand(3, 2, 16, 8))
    assert wide["scale"].stride(-2) == 0
    assert torch.equal(dequantize(stored, p, **wide), y)
    assert dequantize(stored, p, scale, zero, torch.float16).dtype == torch.float16


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_float_dtypes_are_plain_casts(dtype):
    p = QuantParams.parse(dtype)
    x = torch.randn(2, 3, 8)
    assert compute_scales(x, p) == (None, None)
    stored, n = quantize(x, p, None, None)
    assert stored.dtype == p.storage_dtype and n == 0
    assert torch.equal(dequantize(stored, p, None, None), x.to(p.storage_dtype).float())


def test_params_properties():
    P = QuantParams.parse
    q = {spec: P(spec) for spec in ["int8", "int8:asym", "int4", "int4:asym", "int2", "int2:asym",
                                    "fp8"]}
    assert [(p.qmin, p.qmax, p.offset, p.per_byte, p.bits) for p in q.values()] == [
        (-127, 127, 0, 1, 8), (0, 255, 0, 1, 8), (-7, 7, 8, 2, 4), (0, 15, 0, 2, 4),
        (-1.5, 1.5, 1.5, 4, 2), (0, 3, 0, 4, 2), (-448, 448, 0, 1, 8)]  # sym int2: midrise
    storage = [torch.int8] + [torch.uint8] * 5 + [torch.float8_e4m3fn]
    assert [p.storage_dtype for p in q.values()] == storage
    assert q["fp8"].gran == "tensor" and q["int8"].gran == "token"
    assert P("int4:channel").block_wise and P("fp8").block_wise
    assert not P("int4:g32").block_wise and not P("int8:head:static").block_wise
    assert not P("fp16").block_wise and P("fp16").storage_dtype == torch.float16
    assert P("int4:g32").ngroups(128) == 4 and P("int4:channel").ngroups(64) == 64
    assert P("int4:g32").scale_shape(2, 5, 64) == (2, 5, 2)
    assert P("int8:head").scale_shape(2, 5, 64) == (2, 1, 1)
    assert P("int8:channel:static").scale_shape(2, 5, 64) == (2, 1, 64)
    assert P("fp8").scale_shape(2, 5, 64) == (1, 1, 1)
    assert P("fp32").scale_shape(2, 5, 64) is None
    assert QuantParams("fp16") == P("fp16") and QuantParams("int4") == P("int4:token:sym:dynamic")


def test_bytes_per_token():
    def bpt(spec: str, **kw) -> float:  # 2 KV heads of 64 channels
        return bytes_per_token(QuantParams.parse(spec), 2, 64, **kw)

    assert bpt("fp16") == 256 and bpt("fp32") == 512 and bpt("fp8") == 128
    assert bpt("int8") == 2 * 64 + 2 * 2  # data + one fp16 scale per head
    assert bpt("int4:g32:asym") == 2 * 32 + 2 * 2 * 2 * 2  # 2 groups x (scale + zero) x 2 bytes
    assert bpt("int2:g16", scale_dtype=torch.float32) == 2 * 16 + 2 * 4 * 4
    assert bpt("int4:channel:asym") == 64  # block-wise scales not counted without block_size
    assert bpt("int4:channel:asym", block_size=16) == 64 + 2 * 64 * 2 * 2 / 16
    assert bpt("int8:head:static", block_size=16) == 128
    assert bpt("fp8", block_size=32) == 128 + 2 / 32


# --- the KV spec --------------------------------------------------------------------------

def test_parse_examples():
    kv = KVSpec.parse("k=int4:channel:asym,v=int4:g32:asym,residual=64")
    assert kv.k == QuantParams("int4", "channel", 0, False, False)
    assert kv.v == QuantParams("int4", "group", 32, False, False)
    assert (kv.residual, kv.sink, kv.needs_scales, kv.is_float) == (64, 0, False, False)
    assert str(kv) == "k=int4:channel:asym,v=int4:g32:asym,residual=64"
    assert str(KVSpec.parse(" int8 : token : sym : dynamic ")) == "int8"
    assert str(KVSpec.parse("int8,v=fp16")) == "k=int8,v=fp16"
    assert str(KVSpec.parse("k=fp16, v=fp16, sink=4")) == "fp16,sink=4"
    assert KVSpec.parse("fp32").is_float and not KVSpec.parse("k=fp16,v=int8").is_float
    assert KVSpec.parse("k=int8:head:static,v=int8:head:static").needs_scales
    assert str(KVSpec.parse("fp8:tensor,residual=0")) == "fp8"
    assert str(KVSpec.parse("int4:static:head:asym")) == "int4:head:asym:static"
    kv = KVSpec.parse("k=int4:center:rot,v=int4:rot")
    assert (kv.k.rot, kv.k.center, kv.v.rot, kv.v.center) == (True, True, True, False)
    assert str(kv) == "k=int4:rot:center,v=int4:rot" and kv.needs_scales  # means from a file
    assert str(KVSpec.parse("fp16:center")) == "fp16:center"
    assert not KVSpec.parse("int4:rot").needs_scales


@st.composite
def parts(draw):
    """A valid PART string built from random choices (explicit defaults included at random)."""
    dtype = draw(st.sampled_from(["int8", "int4", "int2", "fp8", "fp32", "fp16", "bf16"]))
    transforms = [o for o in ("rot", "center") if draw(st.booleans())]
    if dtype.startswith(("fp3", "fp1", "bf")):
        return ":".join([dtype, *draw(st.permutations(transforms))])
    gran = draw(st.sampled_from(["", "tensor", "head", "channel", "token", "g8", "g32", "g128"]))
    sym = draw(st.sampled_from(["", "sym"] if dtype == "fp8" else ["", "sym", "asym"]))
    calibratable = gran in ("tensor", "head", "channel") or (gran == "" and dtype == "fp8")
    static = draw(st.sampled_from(["", "static", "dynamic"] if calibratable else ["", "dynamic"]))
    clips = dtype.startswith("int") and sym != "asym" and gran in ("", "token", "g8", "g32", "g128")
    mse = draw(st.sampled_from(["", "mse", "fit"])) if clips else ""
    opts = [o for o in (gran, sym, static, mse) if o] + transforms
    return ":".join([dtype, *draw(st.permutations(opts))])


# The prefixes of a spec's parts, in order ("" is a part without k=/v=).
LAYOUTS = [("",), ("", "k="), ("", "v="), ("", "k=", "v="), ("", "v=", "k="), ("k=", "v="),
           ("v=", "k=")]
OPTS = ["", "residual=0", "residual=64", "sink=4", "residual=8,sink=2", "sink=1,residual=3",
        "residual=64,sink=16,hot=fp16", "hot=bf16"]


def layout_lists(layout: tuple[str, ...]) -> st.SearchStrategy:
    """A layout as a strategy that draws it as a list."""
    return st.tuples(*[st.just(prefix) for prefix in layout]).map(list)


@given(st.sampled_from(LAYOUTS).flatmap(layout_lists),
       st.lists(parts(), min_size=3, max_size=3), st.sampled_from(OPTS), st.booleans())
def test_spec_roundtrip(layout, texts, opts, spaces):
    named = dict(zip(layout, texts[: len(layout)], strict=True))
    items = [prefix + text for prefix, text in named.items()] + ([opts] if opts else [])
    spec = (" , " if spaces else ",").join(items)
    kv = KVSpec.parse(spec)
    assert KVSpec.parse(str(kv)) == kv and str(KVSpec.parse(str(kv))) == str(kv)
    assert kv.k == QuantParams.parse(named.get("k=", named.get("")))
    assert kv.v == QuantParams.parse(named.get("v=", named.get("")))
    want = dict(o.split("=") for o in opts.split(",") if o)
    assert (kv.residual, kv.sink) == (int(want.get("residual", 0)), int(want.get("sink", 0)))
    assert kv.hot == want.get("hot", "")


@given(st.text(st.sampled_from(list("kv=,: intfpbsymachelokgdr0123468x\n")), max_size=30))
def test_spec_fuzz_only_raises_spec_error(text):
    try:
        kv = KVSpec.parse(text)
    except SpecError as e:
        assert "\n" not in str(e) and str(e).startswith(f"bad KV spec {text!r}")
        return
    assert KVSpec.parse(str(kv)) == kv


@pytest.mark.parametrize("spec, bad", [
    ("int9", "int9"), ("k=int8:foo,v=fp16", "foo"), ("int8:g0", "g0"),
    ("fp16:token", "fp16:token"), ("int8,residual=x", "residual=x"), ("fp8:asym", "fp8:asym"),
    ("", "empty"), ("k=int8", "v is never set"), ("int8,,v=fp16", "empty part"),
    ("int8:token:static", "int8:token:static"), ("int8,foo=3", "foo"),
    ("int8,residual=4,residual=5", "residual=5"), ("residual=4,int8", "int8"),
    ("k=int8,k=int4,v=fp16", "k=int4"),
    ("int8,int4", "int4"), ("int8:asym:sym", "int8:asym:sym"), ("int4:gx", "gx"),
    ("fp8:g", "fp8:g"), ("int8,sink=-1", "sink=-1"), ("int8\n,v=fp16:head", "v=fp16:head"),
    ("int8,bogus", "unknown dtype 'bogus'"), ("int4:center:center", "center given twice"),
    ("fp16:center:head", "fp16:center:head"),
    ("int2:asym:mse", "mse takes sym"), ("int4:channel:mse", "mse takes sym"),
    ("fp8:mse", "mse takes sym"), ("int2:mse:mse", "mse given twice"),
    ("int2:asym:fit", "fit takes sym"), ("int8:head:fit", "fit takes sym"),
    ("int2:fit:fit", "fit given twice"), ("int2:mse:fit", "mse and fit each choose the scale"),
    ("int8,hot=fp8", "hot= takes fp32|fp16|bf16"), ("int8,hot=fp16,hot=bf16", "hot given twice"),
])
def test_malformed_specs(spec, bad):
    with pytest.raises(SpecError) as e:
        KVSpec.parse(spec)
    msg = str(e.value)
    assert "\n" not in msg and bad in msg and msg.startswith("bad KV spec")


def test_check_head_dim():
    QuantParams.parse("int4:g32").check(64)
    for spec, hd in [("int4:g48", 64), ("int2", 6), ("int4", 7)]:
        with pytest.raises(SpecError, match=spec):
            QuantParams.parse(spec).check(hd)
    with pytest.raises(SpecError):
        QuantParams("int8", "group", 0)


@pytest.mark.parametrize("spec", ["int2:mse", "int2:g32:mse", "int4:g16:mse", "int8:mse"])
def test_mse_scale_is_the_clip_that_loses_least(spec):
    """Each group's mse scale is, among its absmax clipped by every MSE_CLIPS fraction and stored
    by the plain format's quantize, the one whose round trip loses least; clipping saturates
    nothing that counts; at 2 bits it loses far less than the absmax."""
    p = QuantParams.parse(spec)
    plain = QuantParams(p.dtype, p.gran, p.group)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 40, 64, generator=gen) * torch.logspace(-1, 1, 64)[torch.randperm(64,
                                                                            generator=gen)]
    x[0, 0, 3] = 30.0  # an outlier
    x[1, 2] = 0.0  # an all-zero group: every clip loses nothing, the first is kept
    G = p.ngroups(64)

    def lost(scale):  # (2, 40, G) squared error per group, in float64
        q, _ = quantize(x, plain, scale, None)
        y = dequantize(q, plain, scale, None)
        return (y.double() - x.double()).square().unflatten(-1, (G, -1)).sum(-1)

    absmax = x.abs().unflatten(-1, (G, -1)).amax(-1)  # (2, 40, G)
    each = torch.stack([lost(cast_up(absmax * torch.tensor(c) / p.qmax, torch.float16))
                        for c in MSE_CLIPS])  # (clips, 2, 40, G)
    scale, zero = compute_scales(x, p)
    assert zero is None and torch.equal(lost(scale), each.min(0).values)
    assert torch.equal(scale[1, 2], cast_up(absmax[1, 2] / p.qmax, torch.float16))
    assert quantize(x, p, scale, None)[1] == 0
    if p.dtype == "int2":  # rotated-like groups: ~60% of the absmax is the best 2-bit clip
        assert lost(scale).sum() < 0.7 * each[0].sum()


@pytest.mark.parametrize("spec", ["int2:fit", "int2:g32:fit", "int4:g16:fit", "int8:fit"])
def test_fit_scale_keeps_each_group_on_itself(spec):
    """A fit group's scale is its mse scale s0 fitted FIT_STEPS times (float64, here): s =
    sum(x^2) / sum(x * c), c the steps at the previous s, rounded up to fp16 (within one fp16 step
    of the ratio); where c is all zero the scale stays s0. At 2 bits the mse round trip of these
    skewed groups keeps ~70% of a group's inner product with itself; stored at s it loses under
    half of what mse loses."""
    p, mse = QuantParams.parse(spec), QuantParams.parse(spec.replace("fit", "mse"))
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 40, 64, generator=gen) * torch.logspace(-1, 1, 64)[torch.randperm(64,
                                                                            generator=gen)]
    x[0, 0, 3] = 30.0  # an outlier
    x[1, 2] = 0.0  # an all-zero group: no step, the mse scale kept
    G = p.ngroups(64)
    grouped = x.double().unflatten(-1, (G, -1))  # (2, 40, G, 64 // G)
    s0, _ = compute_scales(x, mse)
    s = s0
    for _ in range(FIT_STEPS):
        steps = dequantize(quantize(x, mse, s, None)[0], mse, torch.ones_like(s), None)
        along = (grouped * steps.double().unflatten(-1, (G, -1))).sum(-1)  # (2, 40, G)
        want = grouped.square().sum(-1) / along  # this step's ratio
        s = torch.where(along > 0, cast_up(want.float(), torch.float16), s)
    scale, zero = compute_scales(x, p)
    assert zero is None and quantize(x, p, scale, None)[1] == 0
    assert torch.equal(scale, s) and torch.equal(scale[1, 2], s0[1, 2])
    nonzero = along > 0
    fitted = scale.double()[nonzero]
    assert (fitted >= want[nonzero]).all()  # rounded up, never down
    assert torch.equal(scale[nonzero], cast_up(want[nonzero].float(), torch.float16))

    def kept(s, fmt):  # (2, 40, G) sum(x * stored x) / sum(x^2)
        y = dequantize(quantize(x, fmt, s, None)[0], fmt, s, None).double()
        return (grouped * y.unflatten(-1, (G, -1))).sum(-1)[nonzero] / (
            grouped.square().sum(-1)[nonzero])

    if p.dtype == "int2":
        assert kept(s0, mse).mean() < 0.95  # the least-error clip shrinks
        assert (kept(scale, p) - 1).abs().mean() < 0.5 * (1 - kept(s0, mse)).abs().mean()


def test_transform_maps_fold_its_steps():
    """quant.Transform's maps (each of queries, keys, values and output one affine map per head,
    folded in float64) do what its steps do one by one, in float64: center, smooth (S on keys,
    S^-T on each KV head's queries), rotate; the output turned back and the mean added."""
    from tinykv.quant import Transform, rotation_matrix
    gen = torch.Generator().manual_seed(0)
    H, R, D, N = 2, 3, 32, 4
    s = torch.eye(D, dtype=torch.float64) + 0.3 * torch.randn(H, D, D, generator=gen,
                                                              dtype=torch.float64) / D**0.5
    rk, rv = rotation_matrix(D, 0).double(), rotation_matrix(D, 1).double()
    mk, mv = (torch.randn(H, D, generator=gen, dtype=torch.float64) for _ in range(2))
    sq = torch.linalg.inv(s).transpose(-1, -2)
    t = Transform(rk=rk.float(), rv=rv.float(), mk=mk.float(), mv=mv.float(), sk=s.float(),
                  sq=sq.float())
    q, o = (torch.randn(N, H * R, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(N, H, D, generator=gen, dtype=torch.float64) for _ in range(2))
    want_q = torch.einsum("nhrd,hde->nhre", q.unflatten(1, (H, R)), sq).flatten(1, 2) @ rk
    want_k = torch.einsum("nhd,hde->nhe", k - mk, s) @ rk
    want_v, want_o = (v - mv) @ rv, o @ rv.T + mv.repeat_interleave(R, 0)
    for got, want in ((t.queries(q.float()), want_q), (t.keys(k.float()), want_k),
                      (t.values(v.float()), want_v), (t.output(o.float()), want_o)):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    # scores are unchanged: q S^-T R . (k - mu) S R = q . (k - mu)
    scores = t.queries(q.float()).unflatten(1, (H, R)) @ t.keys(k.float())[:, :, :, None]
    exact = q.unflatten(1, (H, R)) @ (k - mk)[:, :, :, None]
    torch.testing.assert_close(scores.double(), exact, atol=1e-3, rtol=1e-4)
    assert Transform().identity and Transform().keys(k) is k
