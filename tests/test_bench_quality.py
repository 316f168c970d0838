"""bench quality: each row's bytes per token follow the spec's layout, an evicting spec holds its
budget, perplexity and passkey counts are the ones eval reports, and the JSON and table say so."""

import json

import torch

from tinykv.bench import quality
from tinykv.cache import make_cache
from tinykv.evaluate import perplexity
from tinykv.passkey import run_passkey
from tinykv.spec import KVSpec
from tinykv.tokenizer import Tokenizer


def test_rows_match_eval_and_layout(small_model, smollm2_dir, tmp_path):
    specs = [KVSpec.parse(s) for s in ("fp16", "int4", "fp16,sink=4,evict=snapkv:64")]
    tokens = list(range(1000, 1300))
    out = tmp_path / "q.json"
    rows = quality.run(small_model, smollm2_dir, specs, tokens, 128, 16, [200], 2, 1,
                       lambda spec: None, None, out, "test", progress=lambda line: None)
    L, H, D = 2, 1, 32  # layers, KV heads, head_dim of the small model
    # fp16: K and V, 2 bytes each; int4 per token: half a byte each plus one fp16 scale per head
    assert [r.bytes_per_token for r in rows] == [L * 2 * H * D * 2, L * 2 * (H * D / 2 + H * 2),
                                                 L * 2 * H * D * 2]
    assert [r.held_tokens for r in rows] == [200, 200, 64]
    tok = Tokenizer.from_dir(smollm2_dir)
    for spec, row in zip(specs, rows):
        with make_cache(small_model.cfg, spec, tokens=128, max_step_tokens=16) as cache:
            with torch.inference_mode():
                assert row.ppl == perplexity(small_model, cache, tokens, 128, 16).ppl
        res = run_passkey(small_model, tok, spec, [200], 2, 1)
        assert (row.passkey_found, row.passkey_trials) == (sum(t.found for t in res.trials), 2)
    report = json.loads(out.read_text())
    assert [r["kv"] for r in report["rows"]] == [str(s) for s in specs]
    text = quality.table(rows)
    assert text.count("\n") == 4 and "| 64 |" in text
