"""The end-to-end benchmark (tinykv/bench/e2e.py) on a tiny random model: its measuring functions,
the token check, the JSON it writes and the README section made from it. Fast; needs no real
weights or text."""

import json
import math

import pytest
import torch
from hf_tiny import make_hf_model

from tinykv.bench import e2e as be
from tinykv.cli import main
from tinykv.model import Transformer

# The shape of e2e.MODES, shrunk to a tiny model (512-token context) and a few seconds.
TINY = dict(lengths=[8, 24], new=4, reps=2, batches=[3], batch_lens=[5, 12], batch_new=3,
            ppl_tokens=64, window=32)
SPECS = ["fp32", "int8"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny ops are what these tests run: one thread is faster, and steady on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench-llama")
    hf = make_hf_model("llama", 4, 2, 64, d)
    return d, hf, Transformer.from_pretrained(d, device="cpu")


def ids(n: int, seed: int = 0) -> list[int]:
    """n random token ids of the tiny model's vocabulary (none of the first 3)."""
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_tokens_match_really_compares():
    assert be.tokens_match([5, 6, 7], [5, 6, 7]) == {"match": True, "first_diff": None}
    assert be.tokens_match([5, 6, 7], [5, 9, 7]) == {"match": False, "first_diff": 1}
    assert be.tokens_match([5, 6], [5, 6, 7]) == {"match": False, "first_diff": 2}


def test_time_functions_generate_exactly_n_tokens(tiny):
    _, hf, model = tiny
    prompt = ids(20)
    for r in (be.time_tinykv(model, prompt, "int4", 5), be.time_hf(hf, prompt, 5)):
        assert len(r["ids"]) == 5 and r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
    # greedy parity
    assert be.time_tinykv(model, prompt, "fp32", 5)["ids"] == be.time_hf(hf, prompt, 5)["ids"]


def test_e2e_flags_different_tokens(tiny, monkeypatch):
    """Feed the comparison transformers tokens that are off by one: the row must say they differ."""
    _, hf, model = tiny
    real = be.time_hf

    def shifted(*a, **k):
        r = real(*a, **k)
        return {**r, "ids": r["ids"][:2] + [(t + 1) % 256 for t in r["ids"][2:]]}

    monkeypatch.setattr(be, "time_hf", shifted)
    rows = be.bench_e2e(model, hf, ids(40), [16], 5, ["fp32"], 1, False)
    (row,) = [r for r in rows if r["engine"] == "tinykv"]
    assert row["match_vs_hf"] is False and row["first_diff_vs_hf"] == 2


def test_collect_structure(tiny):
    _, hf, model = tiny
    ticks = []
    res = be.collect(model, hf, ids(200), TINY, SPECS, batch_kv="int8", tick=ticks.append)
    json.dumps(res)  # everything serializable
    # what run() sizes its progress bar to
    assert len(ticks) == 3 * (1 + 2 * 2) + 2 + len(be.MEM_SPECS)
    engines = [("tinykv", "fp32"), ("tinykv", "int8"), ("transformers", "default")]
    assert {(r["prompt_len"], r["engine"], r["kv"]) for r in res["e2e"]} == {
        (L, e, kv) for L in (8, 24) for e, kv in engines}
    for r in res["e2e"]:
        assert r["runs"] == 2 and len(r["decode_tok_s_all"]) == 2 and len(r["ids"]) == 4
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
        if r["engine"] == "tinykv":
            assert r["decode_x_hf_default"] > 0 and isinstance(r["match_vs_hf"], bool)
            # an unquantized cache must give transformers' tokens
            assert r["match_vs_hf"] or r["kv"] != "fp32"
    (b,) = res["batch"]
    assert b["prompts"] == 3 and b["prompt_tokens"] >= 15
    assert b["speedup"] > 0 and b["same_tokens"] == 1.0
    mem = {r["kv"]: r for r in res["memory"]["rows"]}
    assert len(mem) == len(be.MEM_SPECS)
    L, H, D = model.cfg.n_layers, model.cfg.n_kv_heads, model.cfg.head_dim
    fp32 = mem["fp32"]
    assert fp32["bytes_per_token"] == fp32["formula_bytes_per_token"] == 2 * L * H * D * 4
    bpt = {kv: mem[kv]["bytes_per_token"] for kv in ("int4", "int8", "fp16")}
    assert bpt["int4"] < bpt["int8"] < bpt["fp16"]
    for r in mem.values():
        assert r["bytes_per_token"] == pytest.approx(r["formula_bytes_per_token"])
        held = r["max_context"] * r["bytes_per_token"] + r["hot_bytes_per_seq"]
        assert held <= be.BUDGET and r["max_batch"] > 0
    q = res["quality"]
    finite = all(math.isfinite(r["ppl"]) for r in q["rows"])
    assert "note" in q or (len(q["rows"]) == len(be.MEM_SPECS) and finite)


def test_cli_writes_json_charts_and_readme(tiny, tmp_path, monkeypatch, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    d, _, _ = tiny
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i}" for i in ids(300)))
    monkeypatch.setitem(be.MODES, "quick", TINY)
    out = tmp_path / "bench" / "results.json"
    args = ["bench", "--quick", "--weights", str(d), "--device", "cpu", "--text", str(text),
            "--out", str(out), "--kv", "int8", "--threads", "1"]
    assert main(args) == 0
    res = json.loads(out.read_text())
    assert res["machine"]["torch"] == torch.__version__ and res["machine"]["device"] == "cpu"
    assert res["config"]["lengths"] == [8, 24] and res["config"]["specs"] == ["int8"]
    for path in (v for k, v in res["charts"].items() if k != "note"):
        assert (tmp_path / "bench" / path.rsplit("/", 1)[-1]).stat().st_size > 0
    assert "| tinykv int8" in capsys.readouterr().out
    assert main(["bench", "--readme", str(out)]) == 0
    md = capsys.readouterr().out
    assert md.startswith("## Results") and "| tinykv int8" in md and "decode tok/s" in md
    assert main(["bench", "--text", str(tmp_path / "missing.txt"), "--out", str(out)]) == 1


@pytest.mark.parametrize("threads", [1, 2])
def test_profile_times_every_compiled_layer_call(tiny, threads, monkeypatch):
    """bench profile's linear part holds every compiled call a decode step's layers make (the
    serial or the parallel ones): each one the step calls runs inside a timer."""
    from tinykv import gemv_layer
    from tinykv.bench import profile as bp

    if not gemv_layer.AVAILABLE:
        pytest.skip("numba is not installed")
    _, _, model = tiny
    timed_calls, untimed = [], []

    def spy(name, real):
        def call(*args):
            if getattr(gemv_layer, name) is not call:  # the profile's timers are on, around it
                (timed_calls if "linear" in bp._RUNNING else untimed).append(name)
            return real(*args)
        return call

    for name in gemv_layer.LAYER_CALLS:
        monkeypatch.setattr(gemv_layer, name, spy(name, getattr(gemv_layer, name)))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bp.profile_tinykv(model, ids(20), "int8", 2)
    finally:
        torch.set_num_threads(before)
    assert untimed == [] and timed_calls


def test_profile_splits_a_decode_step(tiny):
    """bench profile: the parts are measured (nonzero, within the step's time) and the timers come
    off again."""
    import torch.nn.functional as F
    from torch.nn import RMSNorm

    from tinykv.bench import profile as bp
    from tinykv.bench.ceilings import linear_macs
    from tinykv.cache import PagedKVCache
    from tinykv.model import Linear
    from tinykv.pools import KVPools

    _, hf, model = tiny
    before = (F.linear, Linear.forward, RMSNorm.forward, torch.nn.LayerNorm.forward, KVPools.write,
              PagedKVCache.attend)
    r = bp.profile_tinykv(model, ids(20), "int8", 4)
    parts = [r[k] for k in bp.PARTS]
    assert all(ms > 0 for ms in parts) and sum(parts) < r["ms_per_token"]
    assert math.isclose(sum(parts) + r["rest"], r["ms_per_token"], rel_tol=1e-9)
    r = bp.profile_hf(hf, ids(20), 4)
    assert "cache.write" not in r and 0 < r["linear"] < r["ms_per_token"]
    assert math.isclose(r["linear"] + r["rest"], r["ms_per_token"], rel_tol=1e-9)
    assert (F.linear, Linear.forward, RMSNorm.forward, torch.nn.LayerNorm.forward, KVPools.write,
            PagedKVCache.attend) == before
    alone = bp.linear_alone(model, rows=(1, 3), reps=1)
    assert [(r["path"], r["rows"]) for r in alone] == [
        ("F.linear", 1), ("model (linear_cpu)", 1), ("F.linear", 3), ("model (linear_cpu)", 3)]
    assert all(r["ms"] > 0 and r["products"] == 2 * 4 + 1 for r in alone)
    macs = linear_macs(model)  # bench roofline's count: every matrix a step reads, from its params
    assert all(math.isclose(r["gfma_s"], r["rows"] * macs / r["ms"] / 1e6, rel_tol=1e-9)
               for r in alone)


def test_profile_times_packed_weights_beside_their_float32_selves(tiny):
    """With a packed matrix (--packed-weights), the linear layers alone also run the model's
    product on the float32 weights, and the packed path counts the bytes it reads."""
    import copy

    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from tinykv import gemv, packed
    from tinykv.bench import profile as bp

    if not gemv.AVAILABLE:
        pytest.skip("numba is not installed: nothing packs")
    model = copy.deepcopy(tiny[2])
    w = model.layers[0].mlp.w_in.weight
    kind = GGMLQuantizationType.Q4_1
    blocks = dequantize(quantize(w.detach().numpy(), kind), kind).reshape(w.shape)
    w.data = torch.from_numpy(blocks.astype("float32"))
    assert packed.pack_model(model) == 1
    alone = {r["path"]: r for r in bp.linear_alone(model, reps=1)}
    plain = alone["model (linear_cpu), float32 weights"]
    assert list(alone) == ["F.linear", "model (linear_cpu)", "model (linear_cpu), float32 weights"]
    assert plain["weight_bytes"] == alone["F.linear"]["weight_bytes"]
    saved = w.nbytes - packed.packed_bytes(w)
    assert alone["model (linear_cpu)"]["weight_bytes"] == plain["weight_bytes"] - saved > 0


def test_default_specs_a_model_cannot_take_are_left_out_and_named_once(capsys):
    """KIVI-style's value groups of 32 do not divide a head_dim of 80 or 16: the benchmarks run
    the other default specs on such a model and say which one they left out, and why."""
    from types import SimpleNamespace

    from tinykv.bench.common import specs_that_fit

    assert specs_that_fit(be.DEFAULT_SPECS, SimpleNamespace(n_layers=2, head_dim=64)) == \
        list(be.DEFAULT_SPECS)
    assert capsys.readouterr().err == ""
    left_out: set[str] = set()
    narrow = SimpleNamespace(n_layers=2, head_dim=80)
    assert specs_that_fit(be.DEFAULT_SPECS, narrow, left_out) == ["fp16", "int8", "int4"]
    assert specs_that_fit(be.MEM_SPECS, narrow, left_out) == [s for s in be.MEM_SPECS
                                                              if s != be.KIVI]
    err = capsys.readouterr().err
    assert err.count("left out") == 1 and "not a multiple of the group size 32" in err
    odd = SimpleNamespace(n_layers=2, head_dim=18)  # int2 packs 4 codes a byte
    assert "int2" not in specs_that_fit(be.MEM_SPECS, odd) and "int4" in specs_that_fit(
        be.MEM_SPECS, odd)


def test_bench_mode_fits_a_short_context(capsys):
    """A model whose context is shorter than the mode's longest prompt runs the lengths that fit
    (the others named), with batch prompts and the perplexity window within its context; one
    that fits none is refused before any run."""
    quick = be.MODES["quick"]
    mode = be.fit_context(dict(quick), 512)
    assert mode["lengths"] == [128] and "[1024] are left out" in capsys.readouterr().err
    assert mode["batch_lens"][1] + mode["batch_new"] < 512 and mode["window"] == 512
    assert be.fit_context(dict(quick), 100_000) == {**quick}
    with pytest.raises(ValueError, match="holds none of the prompt lengths"):
        be.fit_context(dict(quick), 128 + quick["new"])
