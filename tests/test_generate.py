"""Generation (generate.py): sampling against the distributions it must draw from, and the engine's
schedule (preemption, forks, statistics, numerics) against runs of one request alone."""

import math

import pytest
import torch
from test_cache import cache_for, tiny

from tinykv.generate import Engine, NumericsError, Sampling, sample, saturation_warning
from tinykv.model import Config
from tinykv.spec import KVSpec

# probabilities 0.5, 0.3, 0.15, 0.05 for tokens 0..3
LOGITS = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()


def drawn(s: Sampling, n: int = 400) -> set[int]:
    gen = torch.Generator().manual_seed(0)
    return {sample(LOGITS, s, gen) for _ in range(n)}


def test_temperature_zero_is_greedy():
    assert sample(torch.tensor([0.1, 2.0, -1.0, 1.9]), Sampling(temperature=0), None) == 1


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-30])
def test_tiny_temperature_is_greedy_not_nan(temperature):
    """A positive temperature so small that logits / T overflow float32 (and float64 for the
    smallest) still samples: the likeliest token, every time."""
    logits = torch.tensor([1.0, 3.0, 2.0, -5.0])
    gen = torch.Generator().manual_seed(0)
    for top_k, top_p in ((0, 1.0), (2, 0.9)):
        s = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
        assert [sample(logits, s, gen) for _ in range(20)] == [1] * 20


def test_top_k_and_top_p_keep_the_tokens_they_must():
    assert drawn(Sampling(temperature=1.0)) == {0, 1, 2, 3}
    assert drawn(Sampling(temperature=1.0, top_k=2)) == {0, 1}
    # the smallest set whose mass reaches top_p: 0.5 < 0.7 <= 0.5 + 0.3
    assert drawn(Sampling(temperature=1.0, top_p=0.7)) == {0, 1}
    assert drawn(Sampling(temperature=1.0, top_p=0.4)) == {0}
    assert drawn(Sampling(temperature=1.0, top_k=3, top_p=0.9)) == {0, 1, 2}


def test_sampling_follows_the_probabilities():
    gen = torch.Generator().manual_seed(1)
    n = 4000
    counts = torch.bincount(torch.tensor([sample(LOGITS, Sampling(temperature=1.0), gen)
                                          for _ in range(n)]), minlength=4)
    want = torch.tensor([0.5, 0.3, 0.15, 0.05]) * n
    # within 5 standard deviations of a binomial count
    assert ((counts - want).abs() <= 5 * (want * (1 - want / n)).sqrt()).all(), counts


def run_alone(m, prompt: list[int], s: Sampling) -> list[int]:
    eng = Engine(m, cache_for(m, "fp32", blocks=12, block_size=8))
    rid = eng.add(prompt, s)
    list(eng.run())
    return eng.requests[rid].new_ids


def test_engine_preempts_and_recomputes():
    """A pool too small for all prompts at once: preemption, yet the same greedy tokens as alone."""
    m = tiny()
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (30, 12, 25, 5)]
    s = Sampling(temperature=0, max_new_tokens=12)
    eng = Engine(m, cache_for(m, "fp32", blocks=12, block_size=8, max_seqs=4), max_batch=4)
    rids = [eng.add(prompt, s) for prompt in prompts]
    list(eng.run())
    assert eng.stats.preemptions > 0
    for rid, prompt in zip(rids, prompts):
        assert eng.requests[rid].new_ids == run_alone(m, prompt, s)


def test_n_samples_fork_from_one_prefill():
    m = tiny()
    prompt = list(range(3, 20))
    s = Sampling(temperature=0, max_new_tokens=5)
    eng = Engine(m, cache_for(m, "fp32", blocks=12, block_size=8, max_seqs=3))
    rid = eng.add(prompt, s, n=3)
    list(eng.run())
    kids = [r for r in eng.requests.values() if r.parent == rid]
    assert len(kids) == 2 and eng.stats.prefill_tokens == len(prompt)  # the prompt, fed once
    want = run_alone(m, prompt, s)  # greedy: every sample is the one greedy continuation
    assert eng.requests[rid].new_ids == want and all(k.new_ids == want for k in kids)


def test_statistics_split_prefill_and_decode():
    m = tiny()
    eng = Engine(m, cache_for(m, "fp32", blocks=12, block_size=8))
    eng.add(list(range(1, 11)), Sampling(temperature=0, max_new_tokens=5))
    list(eng.run())
    # one step feeds the prompt and samples the first token; four more feed one token each
    st = eng.stats
    assert (st.steps, st.prefill_tokens, st.decode_tokens) == (5, 10, 4)
    assert st.prefill_s > 0 and st.decode_s > 0


def test_nan_logits_are_an_error():
    m = tiny()
    with torch.no_grad():
        m.norm.weight.fill_(float("nan"))
    eng = Engine(m, cache_for(m, "fp32", blocks=12, block_size=8))
    eng.add([1, 2, 3], Sampling(temperature=0, max_new_tokens=2))
    with pytest.raises(NumericsError, match="NaN/inf"):
        eng.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_are_finite_only_when_every_one_is(dtype):
    from tinykv.generate import _finite

    big = torch.finfo(dtype).max
    logits = torch.randn(2, 50).to(dtype)
    assert _finite(logits)
    assert _finite(torch.full((2, 50), big, dtype=dtype))  # finite, but their sum overflows
    for bad in (float("nan"), float("inf"), -float("inf")):
        spoilt = logits.clone()
        spoilt[1, 7] = bad
        assert not _finite(spoilt)
    spoilt = logits.clone()
    spoilt[0, 0], spoilt[1, 1] = float("inf"), -float("inf")  # a NaN sum
    assert not _finite(spoilt)


def test_saturation_warning_past_its_threshold():
    cfg = Config(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=32)
    spec = KVSpec.parse("fp16")
    stored = 100 * 2 * 2 * 2 * 16  # tokens * (K, V) * layers * KV heads * head_dim
    limit = math.floor(0.001 * stored)  # SATURATION_WARN
    assert saturation_warning(limit, 100, cfg, spec) is None
    msg = saturation_warning(limit + 1, 100, cfg, spec)
    assert msg.startswith(f"{limit + 1} of {stored} cached values") and "wider spec" in msg
    assert saturation_warning(0, 0, cfg, spec) is None
