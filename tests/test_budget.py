"""calibrate --bits: what a spec costs all in, each layer's sensitivity (the simulated store
against the real cache), the knapsack against brute force, and the spec it writes."""

import itertools
import math

import pytest
import torch
from test_cache import run_cached, tiny

from tinykv import budget, sensitivity
from tinykv.budget import BudgetError
from tinykv.cache import make_cache
from tinykv.calibrate import check_request, record
from tinykv.model import Config
from tinykv.quant import layer_transforms
from tinykv.sensitivity import Sensitivity
from tinykv.spec import KVSpec, QuantParams

TOKENS = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(9)).tolist()
SMOLLM2 = Config(n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, dim=576)


@pytest.mark.parametrize("spec, want", [
    ("fp16", 16.0), ("int4", 4.25), ("int2:g32", 2.5), ("k=int2:g64:asym,v=int2:g32", 2.5),
    # 16 sink tokens and 64 window tokens of 8192 at fp32, the rest at 4.25 bits
    ("int4:rot,residual=64,sink=16", ((8192 - 80) * 4.25 + 80 * 32) / 8192),
    ("int4,sink=1", ((8192 - 16) * 4.25 + 16 * 32) / 8192),  # a sink rounds up to a block
    ("int4:rot,residual=64,sink=16,hot=fp16", ((8192 - 80) * 4.25 + 80 * 16) / 8192),
    # 2 of 30 layers' K at int8 (8.25 bits), the rest int2:g32
    ("int2:g32,k@0:29=int8", (58 * 2.5 + 2 * 8.25) / 60),
    ("int4,skip=0", (58 * 4.25 + 2 * 32) / 60),
    ("fp16,evict=snapkv:1024", 16.0),
])
def test_bits_per_element_all_in(spec, want):
    assert budget.bits_per_element(SMOLLM2, KVSpec.parse(spec), 8192) == pytest.approx(want)


def test_format_budget_leaves_the_exact_tokens_out():
    """format_budget inverts bits_per_element: the parts of a spec storing B bits per element
    all in sum to format_budget(B)."""
    for spec in ("int2:g32,residual=64,sink=16", "k=int4,v=int2:g64,residual=128,hot=bf16"):
        kv = KVSpec.parse(spec)
        bits = budget.bits_per_element(SMOLLM2, kv, 8192)
        parts = sum(sensitivity.part_bits(SMOLLM2, p) for pair in kv.layer_parts(30) for p in pair)
        assert budget.format_budget(SMOLLM2, kv, bits, 8192) == pytest.approx(parts)
    with pytest.raises(BudgetError, match="nothing for the formats"):
        budget.format_budget(SMOLLM2, KVSpec.parse("fp16,residual=64,sink=16"), 0.3, 8192)


def lowered_logits(m, spec: KVSpec, layer: int, which: str, p: QuantParams, resume: bool):
    step = sensitivity._Step(len(TOKENS), spec, 16, torch.device("cpu"))
    ref, inputs = sensitivity._exact_run(m, TOKENS, step)
    k, v = (p, QuantParams("fp32")) if which == "k" else (QuantParams("fp32"), p)
    probe = sensitivity.probe_spec(spec, which, p)
    t = layer_transforms(probe, m.cfg.n_layers, m.cfg.head_dim)[layer]
    step.lowered = sensitivity._Lowered(layer, t, k, v, {})
    with torch.inference_mode():
        if resume:
            return ref, sensitivity._resume(m, inputs[layer], layer, step)
        return ref, m(torch.tensor(TOKENS), step)


def test_exact_step_is_the_uncached_model():
    m = tiny()
    step = sensitivity._Step(len(TOKENS), KVSpec.parse("fp32"), 16, torch.device("cpu"))
    ref, inputs = sensitivity._exact_run(m, TOKENS, step)
    want = m(torch.tensor([TOKENS]))[0].log_softmax(-1)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)
    assert len(inputs) == m.cfg.n_layers


@pytest.mark.parametrize("layer, which, part", [(0, "k", "int4:rot"), (1, "v", "int2:g16"),
                                                (1, "k", "int2:g32:rot")])
def test_lowered_layer_is_the_real_cache(layer, which, part):
    """One layer stored in a format, simulated (resumed at that layer), equals a real cache whose
    other layers are fp32 (per-token formats store a token before it is read)."""
    m = tiny()
    p = QuantParams.parse(part)
    _, full = lowered_logits(m, KVSpec.parse("fp32"), layer, which, p, resume=False)
    _, resumed = lowered_logits(m, KVSpec.parse("fp32"), layer, which, p, resume=True)
    torch.testing.assert_close(resumed, full, atol=1e-5, rtol=1e-5)
    spec = f"fp32,{which}@{layer}={part}"
    cache = make_cache(m.cfg, spec, blocks=16, block_size=8)
    got = run_cached(m, cache, {0: TOKENS}, chunk=5)[0]
    torch.testing.assert_close(full, got, atol=2e-4, rtol=2e-4)
    exact = m(torch.tensor([TOKENS]))[0]
    assert (got - exact).abs().max() > 1e-3  # the lowering is really there


def test_a_window_and_sinks_lower_the_error():
    m = tiny()
    p = QuantParams.parse("int2")
    errs = []
    for spec in ("fp32", "fp32,residual=16", "fp32,residual=16,sink=16"):
        ref, logits = lowered_logits(m, KVSpec.parse(spec), 0, "k", p, resume=True)
        errs.append((ref.exp() * (ref - logits.log_softmax(-1))).sum(-1).mean().item())
    assert errs[0] > errs[1] > errs[2] > 0


def test_sensitivities_rank_formats():
    m = tiny()
    with torch.no_grad():
        m.lm_head.weight.mul_(6.0)  # peaked predictions: random ones are near uniform
    cands = budget.parse_candidates(["fp32", "k=int8", "k=int2", "v=int4:rot"])
    rec = record(m, TOKENS, window=32, keep_q=True)
    sens = sensitivity.sensitivities(m, rec, TOKENS, KVSpec.parse("fp32,residual=8"), cands,
                                window=32)
    assert len(sens) == m.cfg.n_layers * 5
    by = {(s.layer, s.which, str(s.part)): s for s in sens}
    for layer in range(m.cfg.n_layers):
        assert by[(layer, "k", "fp32")].kl == pytest.approx(0, abs=1e-7)
        assert by[(layer, "k", "int2")].kl > by[(layer, "k", "int8")].kl > 0
        assert by[(layer, "v", "int4:rot")].bits == 4.25  # 4 bits, an fp16 scale per 64


def test_sensitivity_nll_is_the_lowered_models_nll_increase():
    """A part's NLL increase is the mean, over the probe's predictions, of the lowered model's
    NLL of the next token less the exact model's (from lowered_logits, the real-cache-tested
    simulation), signed."""
    m = tiny()
    with torch.no_grad():
        m.lm_head.weight.mul_(6.0)
    cands = budget.parse_candidates(["k=int2", "v=int2:g16"])
    rec = record(m, TOKENS, window=len(TOKENS), keep_q=True)
    spec = KVSpec.parse("fp32,residual=8")
    sens = sensitivity.sensitivities(m, rec, TOKENS, spec, cands, window=len(TOKENS))
    nexts = torch.tensor(TOKENS[1:])[:, None]
    for s in sens:
        ref, logits = lowered_logits(m, spec, s.layer, s.which, s.part, resume=True)
        logp = logits.log_softmax(-1)
        want = (ref[:-1].gather(1, nexts) - logp[:-1].gather(1, nexts)).mean().item()
        assert s.nll == pytest.approx(want, rel=1e-4, abs=1e-7)
    assert any(s.nll != 0 for s in sens)


def brute_force(sens, n_layers, total):
    items = [(layer, w) for layer in range(n_layers) for w in "kv"]
    opts = [[s for s in sens if (s.layer, s.which) == it] for it in items]
    best = (math.inf, None)
    for combo in itertools.product(*opts):
        if sum(s.bits for s in combo) <= total + 1e-9:
            best = min(best, (sum(s.kl for s in combo), combo), key=lambda x: x[0])
    return best


@pytest.mark.parametrize("seed", range(6))
def test_allocation_is_the_best_within_the_budget(seed):
    g = torch.Generator().manual_seed(seed)
    parts = [(QuantParams.parse(f), b) for f, b in (("int2:g32", 2.5), ("int2:g64", 2.25),
                                                    ("int4", 4.25), ("int8", 8.25))]
    sens = [Sensitivity(layer=layer, which=w, part=p, bits=bits,
                        kl=float(torch.rand(1, generator=g)) / bits)
            for layer in range(3) for w in "kv" for p, bits in parts]
    total = 6 * 2.25 + float(torch.rand(1, generator=g)) * 12
    chosen = budget.allocate(sens, 3, total)
    want, combo = brute_force(sens, 3, total)
    assert sum(s.kl for s in chosen.values()) == pytest.approx(want)
    assert sum(s.bits for s in chosen.values()) <= total + 1e-9
    with pytest.raises(BudgetError, match="cheapest candidates need 2.250"):
        budget.allocate(sens, 3, 6 * 2.25 - 0.1)


def one_static_format_each(combo) -> bool:
    """A scale file holds one static format for K and one for V."""
    return all(len({s.part.stored for s in combo if s.which == w and s.part.static}) <= 1
               for w in "kv")


@pytest.mark.parametrize("seed", range(6))
def test_allocation_keeps_one_static_format_per_k_and_v(seed):
    """Two static formats per side are offered; the best allowed mix (one static format for K,
    one for V, any dynamic ones) is chosen, as brute force over the allowed mixes finds it, and
    the spec it writes can be calibrated."""
    g = torch.Generator().manual_seed(seed)
    parts = [(QuantParams.parse(f), b) for f, b in (
        ("int2:channel:static", 2.0), ("int4:channel:static", 4.0), ("int2:g64", 2.25),
        ("int4", 4.25))]
    sens = [Sensitivity(layer=layer, which=w, part=p, bits=bits,
                        kl=float(torch.rand(1, generator=g)) / bits)
            for layer in range(3) for w in "kv" for p, bits in parts]
    total = 6 * 2.0 + float(torch.rand(1, generator=g)) * 12
    chosen = budget.allocate(sens, 3, total)
    assert one_static_format_each(chosen.values())
    items = [[s for s in sens if (s.layer, s.which) == (layer, w)]
             for layer in range(3) for w in "kv"]
    want = min(sum(s.kl for s in combo) for combo in itertools.product(*items)
               if one_static_format_each(combo) and sum(s.bits for s in combo) <= total + 1e-9)
    assert sum(s.kl for s in chosen.values()) == pytest.approx(want)
    spec = budget.spec_of(KVSpec.parse("fp16"), chosen, 3)
    check_request(spec, "minmax")  # raises on two static formats for K or V


def test_spec_of_writes_each_layers_choice():
    base = KVSpec.parse("fp16,residual=64,sink=16")
    k2, k4 = QuantParams.parse("int2:g32:rot:center:smooth"), QuantParams.parse("int4:rot")
    v2, v8 = QuantParams.parse("int2:g32:rot"), QuantParams.parse("int8")
    picks = {0: (k4, v8), 1: (k2, v2), 2: (k2, v2), 3: (k4, v2), 4: (k2, v2), 5: (v8, v8),
             6: (v8, v8), 7: (k2, v2)}
    chosen = {(layer, w): Sensitivity(layer=layer, which=w, part=p, bits=0.0, kl=0.0)
              for layer, kv in picks.items() for w, p in zip("kv", kv)}
    spec = budget.spec_of(base, chosen, 8)
    assert str(spec) == ("k=int2:g32:rot:center:smooth,v=int2:g32:rot,k@0:3=int4:rot,"
                         "k@5:6=int8,v@0:5:6=int8,residual=64,sink=16")
    assert spec.layer_parts(8) == [picks[layer] for layer in range(8)]
    picks[0] = (k2, v2)  # K and V of layers 5 and 6 alike: one part for both
    chosen = {(layer, w): Sensitivity(layer=layer, which=w, part=p, bits=0.0, kl=0.0)
              for layer, kv in picks.items() for w, p in zip("kv", kv)}
    assert "k@3=int4:rot,@5:6=int8," in str(budget.spec_of(base, chosen, 8))
    assert KVSpec.parse(str(spec)) == spec


@pytest.mark.parametrize("texts, why", [(["k=int4:bogus"], "unknown option 'bogus'"),
                                        (["int4:smooth"], "smooth is for keys only"),
                                        (["k=int4"], "no candidate format for v"),
                                        (["q=int4", "int2"], "expected k=FORMAT")])
def test_bad_candidates(texts, why):
    with pytest.raises(BudgetError, match=why):
        budget.parse_candidates(texts)


def test_saved_sensitivities_keep_their_observer(tmp_path):
    """Static scales depend on the observer, so saved errors of static parts are refused under
    another one; dynamic parts' errors do not depend on it."""
    base = KVSpec.parse("fp16,residual=64,sink=16")
    static = Sensitivity(layer=0, which="k", part=QuantParams.parse("int2:channel:static"),
                         bits=2.0, kl=0.5)
    dynamic = Sensitivity(layer=0, which="v", part=QuantParams.parse("int2:g64"), bits=2.25,
                          kl=0.1, nll=-0.003)  # NLL increases are signed; static's unmeasured
    sensitivity.save(tmp_path / "s.json", [static, dynamic], base, "percentile:99")
    assert sensitivity.load(tmp_path / "s.json", base, "percentile:99") == [static, dynamic]
    with pytest.raises(ValueError, match="measured with --observer percentile:99, not minmax"):
        sensitivity.load(tmp_path / "s.json", base, "minmax")
    sensitivity.save(tmp_path / "d.json", [dynamic], base, "percentile:99")
    assert sensitivity.load(tmp_path / "d.json", base, "minmax") == [dynamic]
    with pytest.raises(ValueError, match="residual=64, sink=16"):
        sensitivity.load(tmp_path / "s.json", KVSpec.parse("fp16"), "percentile:99")
    with pytest.raises(ValueError, match="hot=the model dtype, not those"):
        sensitivity.load(tmp_path / "s.json", KVSpec.parse("fp16,residual=64,sink=16,hot=fp16"),
                         "percentile:99")
