"""bench quality: each row's bytes per token and bits per element follow the spec's layout, an
evicting spec holds its budget, perplexity, KL, top-1 and passkey counts are the ones eval
reports, the JSON and table say so, and a calibrated spec is never scored on its calibration
tokens."""

import json

import pytest
import torch
from test_evaluate import hf_dir  # noqa: F401  (the fixture)

from tinykv import plots
from tinykv.bench import quality
from tinykv.budget import bits_per_element
from tinykv.cache import make_cache
from tinykv.calibrate import calibrate
from tinykv.cli import main
from tinykv.evaluate import perplexity
from tinykv.model import Transformer
from tinykv.passkey import run_passkey
from tinykv.plots import family, pareto
from tinykv.scalefile import TextSpan, save_scales
from tinykv.spec import KVSpec
from tinykv.tokenizer import Tokenizer


def test_rows_match_eval_and_layout(small_model, smollm2_dir, tmp_path):
    specs = [KVSpec.parse(s) for s in ("fp16", "int4,residual=16", "fp16,sink=4,evict=snapkv:64")]
    texts = [("a", list(range(1000, 1300))), ("b", list(range(2000, 2150)))]
    out = tmp_path / "q.json"
    rows = quality.run(small_model, smollm2_dir, specs, texts, 128, 16, [200], 2, 1,
                       lambda spec: (None, None), None, out, "test", context=1024,
                       progress=lambda line: None)
    L, H, D = 2, 1, 32  # layers, KV heads, head_dim of the small model
    # fp16: K and V, 2 bytes each; int4 per token: half a byte each plus one fp16 scale per head
    assert [r.bytes_per_token for r in rows] == [L * 2 * H * D * 2, L * 2 * (H * D / 2 + H * 2),
                                                 L * 2 * H * D * 2]
    # int4: 16 fp32 window tokens of 1024, the rest at 4 bits and a 16-bit scale per 32 values
    assert rows[1].bits_per_element == pytest.approx(((1024 - 16) * 4.5 + 16 * 32) / 1024)
    assert rows[1].bits_per_element == bits_per_element(small_model.cfg, specs[1], 1024)
    assert [r.held_tokens for r in rows] == [200, 200, 64]
    tok = Tokenizer.from_dir(smollm2_dir)
    for spec, row in zip(specs, rows):
        for (label, tokens), res in zip(texts, row.texts):
            with make_cache(small_model.cfg, spec, tokens=128, max_step_tokens=16) as cache:
                with torch.inference_mode():
                    want = perplexity(small_model, cache, tokens, 128, 16, reference=True)
            assert (res.text, res.ppl, res.kl, res.top1) == (label, want.ppl, want.kl, want.top1)
            assert res.ref_ppl == want.ref_ppl
        res = run_passkey(small_model, tok, spec, [200], 2, 1)
        assert (row.passkey_found, row.passkey_trials) == (sum(t.found for t in res.trials), 2)
    assert abs(rows[0].texts[0].kl) < rows[1].texts[0].kl / 10  # fp16 is nearly the model
    report = json.loads(out.read_text())
    assert [r["kv"] for r in report["rows"]] == [str(s) for s in specs]
    assert report["rows"][1]["texts"][1]["kl"] == rows[1].texts[1].kl
    text = quality.table(rows)
    assert text.count("\n") == 6 and "| 64 |" in text and "text 2: b" in text


def test_text_spans_overlap():
    a = TextSpan.of("some text", 0, 100)
    assert a.overlaps(TextSpan.of("some text", 99, 5)) and not a.overlaps(a.__class__(
        a.sha256, 100, 5))
    assert not a.overlaps(TextSpan.of("other text", 0, 100))


def test_calibrated_specs_are_held_out(hf_dir, tmp_path, capsys):  # noqa: F811
    """A scale file calibrated on the measured tokens is refused before anything is measured;
    on other tokens it is used, and --calibration-text calibrates each spec itself."""
    text = str(hf_dir / "text.txt")
    m = Transformer.from_pretrained(hf_dir, device="cpu")
    tokens = Tokenizer.from_dir(hf_dir).encode((hf_dir / "text.txt").read_text())
    spec = KVSpec.parse("int4:center")
    path = tmp_path / "s.safetensors"
    source = TextSpan.of((hf_dir / "text.txt").read_text(), 0, 100)
    save_scales(path, calibrate(m, tokens[:100], spec, window=64), m.cfg, spec, "minmax", 100,
                source)
    common = ["bench", "quality", "--weights", str(hf_dir), "--device", "cpu", "--text", text,
              "--window", "64", "--no-passkey", "--kv", "fp16", "int4:center",
              "--out", str(tmp_path / "q.json")]
    code = main([*common, "--kv-scales", str(path)])
    err = capsys.readouterr().err
    assert code == 1 and "refusing to measure calibrated specs" in err and err.count("\n") == 1
    assert not (tmp_path / "q.json").exists()
    assert main([*common, "--kv-scales", str(path), "--offset", "100"]) == 0
    held_out = json.loads((tmp_path / "q.json").read_text())["rows"][1]
    assert held_out["calibration"] == str(path)
    capsys.readouterr()
    cal = ["--calibration-text", text, "--calibration-tokens", "100"]
    assert main([*common, *cal]) == 1
    assert "overlap the calibration's 0-100" in capsys.readouterr().err
    assert main([*common, *cal, "--offset", "100"]) == 0
    row = json.loads((tmp_path / "q.json").read_text())["rows"][1]
    # The same calibration, the same numbers, to float32 rounding: two runs of one process can
    # differ in the last bits (seen once on an AMD EPYC: 5e-9 of the perplexity, 3e-6 of the
    # KL). Calibrating on one token fewer moves them by 6e-4 and 4e-2: far outside these bounds.
    same, ref = row["texts"][0], held_out["texts"][0]
    assert same["tokens"] == ref["tokens"]
    assert same["ppl"] == pytest.approx(ref["ppl"], rel=1e-6)
    assert same["kl"] == pytest.approx(ref["kl"], rel=1e-3)
    assert main([*common[:-5], "--kv", "int4:center", "--out", str(tmp_path / "q.json")]) == 1
    assert "give --calibration-text FILE" in capsys.readouterr().err


def test_pareto_front_against_brute_force():
    g = torch.Generator().manual_seed(3)
    points = [tuple(p) for p in torch.rand(40, 2, generator=g).tolist()]
    front = pareto(points)
    dominated = {i for i, (x, y) in enumerate(points)
                 if any(x2 <= x and y2 <= y and (x2, y2) != (x, y) for x2, y2 in points)}
    assert set(front) == set(range(len(points))) - dominated
    assert [points[i][0] for i in front] == sorted(points[i][0] for i in front)


@pytest.mark.parametrize("kv, want", [
    ("fp16", "float"), ("fp8", "float"), ("int4", "per-token"), ("int4:rot", "rotated"),
    ("k=int4:channel:asym,v=int4:g32:asym", "KIVI"), ("k=int2:g32:rot:smooth,v=int2", "smoothed"),
    ("int2:g32,k@0=int4", "per-layer")])
def test_families(kv, want):
    assert want in family(kv)


def test_replot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows = [{"kv": kv, "bits_per_element": bits, "texts": [{"ppl": ppl, "ref_ppl": 10.0,
                                                             "kl": kl}]}
            for kv, bits, ppl, kl in (("fp16", 16, 10.0, 1e-7), ("int4:rot", 4.25, 10.6, 0.02),
                                      ("int2:g32,k@0=int4", 2.6, 11.0, 0.04))]
    report = {"texts": ["t tokens 0-100"], "window": 64, "chunk": 16, "context": 8192,
              "rows": rows}
    (tmp_path / "q.json").write_text(json.dumps(report))
    (tmp_path / "bad.json").write_text("{")
    png = str(tmp_path / "q.png")
    assert main(["bench", "quality", "--replot", str(tmp_path / "q.json"), "--plot", png]) == 0
    assert (tmp_path / "q.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["bench", "quality", "--replot", str(tmp_path / "bad.json"), "--plot", png]) == 1
    assert "not JSON" in capsys.readouterr().err
    assert main(["bench", "quality", "--replot", str(tmp_path / "q.json")]) == 1
    assert "--replot needs --plot PNG" in capsys.readouterr().err
    # a collection (bench/quality.json): runs without perplexity (passkey only) are passed over
    passkey_only = {**report, "texts": [], "rows": [{"kv": "fp16", "texts": []}]}
    other_text = {**report, "texts": ["u tokens 0-50"], "rows": [{**rows[1], "kv": "int8"}]}
    (tmp_path / "runs.json").write_text(json.dumps({"runs": [passkey_only, report,
                                                             other_text]}))
    assert main(["bench", "quality", "--replot", str(tmp_path / "runs.json"), "--plot", png]) == 0
    assert "3 specs" in capsys.readouterr().out
    (tmp_path / "none.json").write_text(json.dumps({"runs": [passkey_only]}))
    assert main(["bench", "quality", "--replot", str(tmp_path / "none.json"), "--plot", png]) == 1
    assert "no bench quality report with texts" in capsys.readouterr().err


def test_older_runs_join_the_perplexity_panel(hf_dir, tmp_path, capsys):  # noqa: F811
    """Runs from before KL (perplexity alone) are charted when they measured the same tokens
    alike: their bits counted as new rows' are, perplexity against the model's own."""
    pytest.importorskip("matplotlib")
    cfg = Transformer.from_pretrained(hf_dir, device="cpu").cfg
    like = {"texts": ["text.txt tokens 0-512"], "window": 64, "chunk": 16, "context": 1024,
            "rows": [{"kv": "int4:rot,k@0=int8", "bits_per_element": 4.9,
                      "texts": [{"ppl": 11.0, "ref_ppl": 10.0, "kl": 0.01}]}]}
    old = {"command": "bench quality --text text.txt", "window": 64, "chunk": 16,
           "ppl_tokens": 512, "rows": [{"kv": "int4,residual=16", "ppl": 12.0},
                                        {"kv": "int8", "ppl": 10.5}]}
    rows = quality.legacy_rows(old, like, cfg)
    assert [r["kv"] for r in rows] == ["int4,residual=16", "int8"]
    want = bits_per_element(cfg, KVSpec.parse("int4,residual=16"), 1024)
    assert rows[0]["bits_per_element"] == want > 4.25  # the window counted at fp32
    assert rows[0]["texts"] == [{"ppl": 12.0, "ref_ppl": 10.0, "kl": None}]
    for other in ({"command": old["command"] + " --offset 512"}, {"window": 128},
                  {"ppl_tokens": 256}, {"command": "bench quality --text other.txt"}):
        assert quality.legacy_rows({**old, **other}, like, cfg) == []  # other tokens or setting
    assert quality.legacy_rows(old, like, None) == []  # no config: nothing to count bits with
    (tmp_path / "runs.json").write_text(json.dumps({"runs": [old, like]}))
    png = str(tmp_path / "q.png")
    assert main(["bench", "quality", "--replot", str(tmp_path / "runs.json"), "--plot", png,
                 "--weights", str(hf_dir)]) == 0
    assert "3 specs" in capsys.readouterr().out
    assert (tmp_path / "q.png").read_bytes()[:4] == b"\x89PNG"


def test_chart_keeps_a_point_per_scale_file(monkeypatch, tmp_path):
    """A spec measured again with the same scales: its newest row; with other scales (another
    observer): a point each, the scale file's name leading its key."""
    charted = []
    monkeypatch.setattr(quality, "plot_pareto", lambda rows, path, note: charted.extend(rows))

    def run(kv: str, scales: str | None, ppl: float) -> dict:
        row = {"kv": kv, "bits_per_element": 3.0,
               "texts": [{"ppl": ppl, "ref_ppl": 10.0, "kl": 0.01}]}
        if scales:
            row["calibration"] = scales
        return {"texts": ["t tokens 0-100"], "window": 64, "chunk": 16, "context": 8192,
                "rows": [row]}

    spec = "k=int2:channel:static,v=int2:g64"
    reports = [run("fp16", None, 10.0), run(spec, "/a/p97.safetensors", 11.0),
               run(spec, "/a/p97.safetensors", 11.5), run(spec, "mse.safetensors", 12.0)]
    assert quality.chart(reports, tmp_path / "q.png") == 3
    by_scales = {row.get("scales"): row["texts"][0]["ppl"] for row in charted}
    assert by_scales == {None: 10.0, "p97.safetensors": 11.5, "mse.safetensors": 12.0}
    assert plots._labelled(charted[1]) == f"[p97.safetensors] {spec}"
    assert plots._labelled(charted[0]) == "fp16"
