"""Perplexity through the cache: fp32 equals the uncached model, coarser specs score worse, the
attention-error report, and the `eval` / `calibrate` command lines on a tiny checkpoint."""

import json
import subprocess
import sys

import pytest
import torch
from test_cache import tiny

from tinykv.cache import make_cache
from tinykv.cli import main
from tinykv.evaluate import (
    as_stored,
    attention_error,
    compare,
    perplexity,
    reference_perplexity,
)
from tinykv.spec import KVSpec, QuantParams


def sharp_tiny(seed: int = 0):
    """A tiny random model with a peaked next-token distribution (random ones are near uniform)."""
    m = tiny(seed=seed)
    with torch.no_grad():
        m.lm_head.weight.mul_(6.0)
    return m


def sample_text(m, n: int, seed: int = 1) -> list[int]:
    """n tokens sampled from the model itself (through an fp32 cache, one token per step).

    On its own samples the exact model has the lowest expected cross-entropy (the excess is a
    KL divergence), so any perturbation of K/V raises perplexity beyond sampling noise.
    """
    g = torch.Generator().manual_seed(seed)
    cache = make_cache(m.cfg, KVSpec.parse("fp32"), tokens=n, max_seqs=1, max_step_tokens=1)
    cache.add_sequence(0)
    toks = [int(torch.randint(0, m.cfg.vocab_size, (1,), generator=g))]
    threads = torch.get_num_threads()
    # one-token steps: syncing threads costs more than they save (10x on a busy box)
    torch.set_num_threads(1)
    try:
        while len(toks) < n:
            plan = cache.plan([0], [toks[-1:]])
            logits = m(torch.tensor(toks[-1:]), plan)[0]
            cache.commit(plan)
            toks.append(int(torch.multinomial(logits.softmax(-1), 1, generator=g)))
    finally:
        torch.set_num_threads(threads)
    return toks


@pytest.fixture(scope="module")
def model_text():
    """A sharp tiny model and 256 tokens sampled from it."""
    m = sharp_tiny()
    return m, sample_text(m, 256)


def ppl(m, toks, spec: str, window=128, chunk=32, **kw) -> float:
    """Perplexity of toks under a spec, through a cache sized for one window."""
    cache = make_cache(m.cfg, KVSpec.parse(spec), tokens=window, max_seqs=1,
                       max_step_tokens=chunk, **kw)
    return perplexity(m, cache, toks, window, chunk).ppl


@pytest.mark.parametrize("window,chunk,block_size", [(128, 32, 16), (100, 7, 16), (256, 256, 8),
                                                    (48, 1, 16)])  # chunk 1: exact decode
def test_fp32_equals_no_cache(model_text, window, chunk, block_size):
    m, toks = model_text
    ref = reference_perplexity(m, toks, window)
    got = ppl(m, toks, "fp32", window, chunk, block_size=block_size)
    assert got == pytest.approx(ref, rel=1e-5)


def test_coarser_specs_score_worse(model_text):
    m, toks = model_text
    r = {spec: ppl(m, toks, spec) for spec in ["fp32", "int8", "int4", "int2"]}
    assert r["int8"] == pytest.approx(r["fp32"], rel=1e-3)  # int8 noise is below sampling noise
    assert r["int2"] > r["int4"] > r["fp32"] * (1 - 1e-3) and r["int2"] > r["int8"]


def test_result_fields(model_text):
    m, toks = model_text
    kivi = "k=int4:channel:asym,v=int4:g32:asym,residual=16"
    cache = make_cache(m.cfg, KVSpec.parse(kivi), tokens=100, max_seqs=1, max_step_tokens=32)
    res = perplexity(m, cache, toks[:250], window=100, chunk=32)
    # the first token of each window is not predicted
    assert res.windows == 3 and res.tokens == 99 + 99 + 49
    assert res.kv == kivi
    # the windows were freed
    assert res.kv_bytes_per_token == cache.bytes_per_token and cache.tables.used_blocks() == 0


def test_kl_and_top1_against_the_uncached_model(model_text):
    """KL(model || cache) and top-1 agreement of each prediction, checked against torch's kl_div
    over whole windows run uncached and through the cache (one chunk: the same predictions)."""
    m, toks = model_text
    toks = toks[:200]
    caches = [make_cache(m.cfg, KVSpec.parse(s), tokens=128, max_seqs=1, max_step_tokens=128)
              for s in ("fp32", "int4", "int2")]
    exact, int4, int2 = compare(m, caches, toks, window=128, chunk=128)
    assert exact.kl == pytest.approx(0, abs=1e-6) and exact.top1 == 1.0
    assert exact.ref_ppl == pytest.approx(exact.ppl, rel=1e-5) and exact.delta_se < 1e-5
    assert 0 < int4.kl < int2.kl and int2.top1 < 1.0
    want_kl = want_agree = 0.0
    with torch.inference_mode():
        for start in (0, 128):
            win = toks[start:start + 128]
            ref = m(torch.tensor([win]))[0][:-1].log_softmax(-1)  # (W - 1, V)
            cache = make_cache(m.cfg, KVSpec.parse("int2"), tokens=128, max_seqs=1,
                               max_step_tokens=128)
            cache.add_sequence(0)
            plan = cache.plan([0], [win], logits="all")
            got = m(torch.tensor(win), plan)[:-1].log_softmax(-1)
            want_kl += torch.nn.functional.kl_div(got, ref, log_target=True,
                                                  reduction="sum").item()
            want_agree += (got.argmax(-1) == ref.argmax(-1)).sum().item()
    assert int2.kl == pytest.approx(want_kl / int2.tokens, rel=1e-4)
    assert int2.top1 == want_agree / int2.tokens
    assert int2.ppl == perplexity(m, caches[2], toks, window=128, chunk=128).ppl  # same path
    # chunked: the same number of predictions, each compared with the model's
    chunked = compare(m, caches[1:2], toks, window=128, chunk=16)[0]
    assert chunked.tokens == int4.tokens and chunked.kl > 0


def test_as_stored_is_the_quantizer():
    x = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(as_stored(x, QuantParams.parse("fp32")), x)
    for spec, tol in [("int8", 0.02), ("int4:channel:asym", 0.3), ("fp8", 0.15)]:
        y = as_stored(x, QuantParams.parse(spec), bs=16)
        assert 0 < (y - x).abs().max() < tol
        # the partial tail block (tokens 32..39) has no scales yet
        if QuantParams.parse(spec).block_wise:
            assert torch.equal(y[:, 32:], x[:, 32:])


def test_attention_error_separates_k_and_v(model_text):
    m, toks = model_text
    exact = attention_error(m, toks[:96], KVSpec.parse("fp32"))
    assert len(exact) == m.cfg.n_layers
    # 1 - cos(x, x) rounds, so not exactly 0
    assert all(abs(v) < 1e-6 for e in exact for k, v in e.items() if k != "layer")
    v_only = attention_error(m, toks[:96], KVSpec.parse("k=fp32,v=int4"))
    assert all(e["kl_k"] == 0 and abs(e["cos_k"]) < 1e-6 and e["cos_v"] > 1e-5 for e in v_only)
    both = attention_error(m, toks[:96], KVSpec.parse("int4"))
    assert all(e["kl_k"] > 0 and e["cos_k"] > 0 and e["cos_kv"] > 0 for e in both)
    # every key kept exact by the residual window: keys are untouched
    res = attention_error(m, toks[:96], KVSpec.parse("k=int2:channel:asym,v=fp32,residual=96"))
    assert all(e["kl_k"] == 0 for e in res)


# ---- command line on a tiny Hugging Face-style checkpoint ----------------------------------------
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny llama checkpoint with a word-level tokenizer, and a text file of random words."""
    from hf_tiny import make_hf_model
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = tmp_path_factory.mktemp("tiny_llama")
    make_hf_model("llama", 4, 2, 64, d)
    vocab = {f"w{i}": i for i in range(255)} | {"[UNK]": 255}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    g = torch.Generator().manual_seed(2)
    words = torch.randint(0, 255, (300,), generator=g).tolist()
    (d / "text.txt").write_text(" ".join(f"w{i}" for i in words))
    return d


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    """`python -m tinykv ARGV` in a subprocess, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "tinykv", *argv], capture_output=True, text=True,
                          timeout=300)


def test_cli_eval_json(hf_dir):
    proc = run_cli("eval", "--weights", str(hf_dir), "--device", "cpu",
                   "--text", str(hf_dir / "text.txt"), "--kv", "int8", "--window", "64",
                   "--chunk", "16", "--max-tokens", "200", "--json", "--attn-error")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["kv"] == "int8" and out["tokens"] == 3 * 63 + 7 and out["ppl"] > 1
    assert out["kv_bytes_per_token"] > 0 and len(out["attn_error"]) == 2
    assert out["kl"] > 0 and 0 < out["top1"] <= 1 and out["ref_ppl"] > 1  # against the model


def test_cli_calibrate_then_eval(hf_dir, tmp_path, capsys):
    scales, text = tmp_path / "s.safetensors", str(hf_dir / "text.txt")
    common = ["--weights", str(hf_dir), "--device", "cpu", "--text", text, "--window", "64"]
    assert main(["calibrate", *common, "--kv", "fp8:head:static", "--out", str(scales),
                 "--vllm-out", str(tmp_path / "vllm.safetensors"),
                 "--observer", "percentile:99.9"]) == 0
    assert (tmp_path / "vllm.kv_cache_scheme.json").exists()
    capsys.readouterr()
    assert main(["eval", *common, "--kv", "fp8:head:static", "--kv-scales", str(scales),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv"] == "fp8:head:static"


def test_cli_calibrate_bits(hf_dir, tmp_path, capsys):
    """calibrate --bits: a spec within the budget, its per-layer table, the scale file it needs
    (held by its metadata and served to eval) and the chart."""
    pytest.importorskip("matplotlib")
    text = str(hf_dir / "text.txt")
    common = ["--weights", str(hf_dir), "--device", "cpu", "--text", text, "--window", "64"]
    out = tmp_path / "b.safetensors"
    assert main(["calibrate", *common, "--kv", "fp16,residual=16", "--bits", "4",
                 "--context", "1024", "--probe-tokens", "128", "--out", str(out),
                 "--candidates", "k=int2:g32:rot:center:smooth", "k=int8", "v=int2:g32:rot",
                 "v=int4", "--sensitivities-out", str(tmp_path / "s.json")]) == 0
    printed = capsys.readouterr().out
    spec = printed.split("tokens: ")[1].split()[0]
    kv = KVSpec.parse(spec)
    assert printed.count("\n") >= 4 + 2 and "KL@min" in printed  # a row per layer (4)
    # 16 fp32 window tokens of 1024, the formats in the rest: within 4 bits
    from tinykv.budget import bits_per_element
    from tinykv.model import Transformer
    cfg = Transformer.from_pretrained(hf_dir, device="cpu").cfg
    assert bits_per_element(cfg, kv, 1024) <= 4 + 1e-9 and kv.residual == 16
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["eval", *common, "--kv", spec, "--kv-scales", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv"] == spec
    assert main(["calibrate", *common, "--kv", "fp16,residual=16", "--bits", "2.2",
                 "--out", str(out)]) == 1
    assert "cannot hold even the cheapest candidates" in capsys.readouterr().err
    # the saved errors serve another budget without measuring them again: the same table
    reuse = ["calibrate", *common, "--context", "1024", "--probe-tokens", "128", "--out",
             str(tmp_path / "c.safetensors"), "--sensitivities-in", str(tmp_path / "s.json"),
             "--bits", "4"]
    assert main([*reuse, "--kv", "fp16,residual=16"]) == 0
    assert capsys.readouterr().out.split("\n")[:5] == printed.split("\n")[:5]
    assert main([*reuse, "--kv", "fp16,residual=32"]) == 1
    assert "measured with residual=16, sink=0" in capsys.readouterr().err
    # the chart goes beside --out as d.png: a d.png of the user's is refused and kept, unless
    # --plot names it
    theirs = tmp_path / "d.png"
    theirs.write_bytes(b"the user's picture")
    beside = [*reuse[:reuse.index("--out")], *reuse[reuse.index("--out") + 2:], "--out",
              str(tmp_path / "d.safetensors"), "--kv", "fp16,residual=16"]
    assert main(beside) == 1
    assert "is not one tinykv wrote" in capsys.readouterr().err
    assert theirs.read_bytes() == b"the user's picture"
    assert main([*beside, "--plot", str(theirs)]) == 0
    assert theirs.read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    # --bits' own flags without --bits would be ignored: refused before the model loads
    assert main(["calibrate", *common, "--kv", "int4:center", "--out", str(out),
                 "--probe-tokens", "128"]) == 1
    assert "--probe-tokens does not apply without --bits" in capsys.readouterr().err


@pytest.mark.parametrize("kv,scales,why", [
    ("int8:tensor:static", "garbage", "not a safetensors file"),
    ("int8:tensor:static", "missing", "not found"),
    ("int8:head:static", "tensor", "holds scales for k=int8:tensor:static"),
    ("int8", "tensor", "has no static, centered or smoothed part"),
    ("int4:center", "tensor", "holds no means for k"),
    ("int8:tensor:static", "other_model", "another model"),
])
def test_cli_bad_scale_file_exits_1(hf_dir, tmp_path, capsys, kv, scales, why):
    from tinykv.calibrate import calibrate
    from tinykv.model import Transformer
    from tinykv.scalefile import save_scales

    path = tmp_path / f"{scales}.safetensors"
    if scales == "garbage":
        path.write_bytes(b"\x00" * 64)
    elif scales in ("tensor", "other_model"):
        # other_model: same shapes as the checkpoint (2 layers, 2 KV heads of 64), another config;
        # tensor: this very checkpoint, but calibrated for another spec
        if scales == "other_model":
            m = tiny(n_heads=4, n_kv=2)
        else:
            m = Transformer.from_pretrained(hf_dir, device="cpu")
        spec = KVSpec.parse("int8:tensor:static")
        save_scales(path, calibrate(m, list(range(40)), spec, window=40), m.cfg, spec, "minmax", 40)
    code = main(["eval", "--weights", str(hf_dir), "--device", "cpu",
                 "--text", str(hf_dir / "text.txt"), "--kv", kv, "--kv-scales", str(path),
                 "--window", "64", "--max-tokens", "100"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: ") and why in err and err.count("\n") == 1, err


def test_cli_plots(hf_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    common = ["--weights", str(hf_dir), "--device", "cpu", "--text", str(hf_dir / "text.txt"),
              "--window", "64"]
    scales = str(tmp_path / "s.safetensors")
    assert main(["calibrate", *common, "--kv", "int8:channel:static", "--out", scales,
                 "--plot", str(tmp_path / "channels.png")]) == 0
    capsys.readouterr()
    assert main(["eval", *common, "--max-tokens", "128", "--kv", "int8",
                 "--plot-specs", "int4", "int8:channel:static", "--kv-scales", scales,
                 "--plot", str(tmp_path / "sweep.png"), "--json"]) == 0
    sweep = json.loads(capsys.readouterr().out)["sweep"]
    assert [r["kv"] for r in sweep] == ["int8", "int4", "int8:channel:static"]
    assert all((tmp_path / f).read_bytes()[:4] == b"\x89PNG" for f in ("channels.png", "sweep.png"))
