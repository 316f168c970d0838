"""The real model against goldens that transformers produced from the original GGUF
(tests/make_goldens.py).

This checks the conversion (fetch.py), the decoder, the tokenizer and the cached generation loop at
once.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinykv.cache import make_cache
from tinykv.generate import Engine, Sampling
from tinykv.model import Transformer
from tinykv.spec import KVSpec
from tinykv.tokenizer import Tokenizer

RUN = str(Path(__file__).resolve().parent.parent / "run.py")


@pytest.fixture(scope="module")
def model(smollm2_dir):
    return Transformer.from_pretrained(smollm2_dir, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return Tokenizer.from_dir(smollm2_dir)


def prompt_text(case, tok):
    """A golden case's prompt as text: the chat template applied, or the plain text."""
    return tok.apply_chat_template(case["messages"]) if case["chat"] else case["text"]


def test_prompt_ids_and_last_logits(model, tok, smollm2_goldens):
    for case in smollm2_goldens["cases"]:
        ids = tok.encode(prompt_text(case, tok))
        assert ids == case["prompt_ids"]
        logits = model(torch.tensor([ids]))[0, -1]
        want = case["last_logits"]
        top = torch.tensor(want["top_values"])
        torch.testing.assert_close(logits[want["top_ids"]], top, atol=1e-3, rtol=0)
        assert abs(torch.logsumexp(logits, 0).item() - want["logsumexp"]) < 1e-3


@pytest.mark.parametrize("spec", ["fp32", "fp16"])
def test_greedy_tokens_match_transformers(model, smollm2_goldens, spec):
    """All golden prompts decoded together (continuous batching) through the paged cache."""
    cases = smollm2_goldens["cases"]
    cache = make_cache(model.cfg, KVSpec.parse(spec), blocks=64, block_size=16,
                       max_seqs=len(cases))
    eng = Engine(model, cache, eos_ids={smollm2_goldens["eos_token_id"]}, max_batch=len(cases))
    greedy = Sampling(temperature=0, max_new_tokens=smollm2_goldens["max_new_tokens"])
    rids = [eng.add(c["prompt_ids"], greedy) for c in cases]
    list(eng.run())
    for rid, c in zip(rids, cases):
        assert eng.requests[rid].new_ids == c["new_ids"], c["text"] or c["messages"]


def test_run_py_greedy_json(smollm2_goldens):
    import json

    case = smollm2_goldens["cases"][0]
    out = subprocess.run([sys.executable, RUN, case["text"], "--temperature", "0",
                          "--max-new-tokens", "12", "--kv", "fp32", "--json"],
                         capture_output=True, text=True, check=True)
    d = json.loads(out.stdout)
    assert d["prompt_ids"] == case["prompt_ids"] and d["new_ids"] == case["new_ids"][:12]
    # 30 layers, K and V, 3 KV heads of 64 channels, 4 bytes
    assert d["stats"]["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 4
    assert d["stats"]["decode_tokens_per_s"] > 0


@pytest.mark.parametrize("args, message", [
    (["--weights", "/nonexistent"], "weights directory not found"),
    (["--kv", "int9"], "bad KV spec 'int9'"),
    (["--max-new-tokens", "1", "--device-blocks", "1", "--block-size", "1"],
     "the KV pool holds 1"),  # the prompt alone does not fit: refused before the run
    (["--max-new-tokens", "20", "--device-blocks", "3", "--block-size", "1", "--temperature",
      "0"], "exhausted"),  # the prompt fits, its continuation runs out of blocks (greedy: a
    # sampled one may end at the pool's last block and exit 0)
])
def test_cli_errors_are_one_line(args, message):
    out = subprocess.run([sys.executable, RUN, "hello there", *args], capture_output=True,
                         text=True)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


def test_prompt_longer_than_context(tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("word " * 9000)
    out = subprocess.run([sys.executable, RUN, "--prompt-file", str(long), "--whole-file"],
                         capture_output=True, text=True)
    assert out.returncode == 1 and "context is 8192" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
