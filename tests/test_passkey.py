"""The passkey task: the needle lands at the asked depth inside the asked length, keys are seeded,
answers are scored, results serialize and plot, and SmolLM2 finds the key through an fp16 cache."""

import json
import sys

import pytest
import torch

from tinykv import passkey as pk
from tinykv.model import Transformer
from tinykv.tokenizer import Tokenizer

CAT = "The cat sat on the mat."  # every sentence alike: the needle's depth is a count of cats


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.mark.parametrize("length", [300, 1000, 4000])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_at_depth(tok, length, depth):
    ids, (start, end) = pk.build_prompt(tok, CAT, length, depth, "68231")
    assert length - 12 <= len(ids) <= length  # filled to within about one sentence
    assert tok.decode(ids[start:end]) == " " * (depth > 0) + pk.NEEDLE.format(key="68231")
    before = tok.decode(ids[:start]).count("cat sat")
    after = tok.decode(ids[end:]).count("cat sat")
    n = before + after
    assert n * 7 > length - 120  # the filler (7 tokens a sentence) is most of the prompt
    assert abs(before / n - depth) <= 0.5 / n + 1e-9  # the nearest sentence boundary
    if depth == 0.0:
        assert before == 0
    if depth == 1.0:
        assert after == 0


@pytest.mark.parametrize("chat", [True, False])
def test_prompt_shape(tok, chat):
    ids, (start, end) = pk.build_prompt(tok, pk.DEFAULT_FILLER, 8000, 0.5, "12345", chat=chat)
    text = tok.decode(ids)
    assert 7950 <= len(ids) <= 8000
    assert text.endswith(pk.ANSWER)  # the answer is begun for the model
    assert ("<|im_start|>assistant\n" in text) == chat
    assert text.count("12345") == 2 and tok.decode(ids[start:end]).count("12345") == 2


def test_prompt_takes_the_chat_template_only_where_the_model_has_one(tok):
    """chat=None (the default): the instruct model's template; a base model (no template)
    reads the plain frame instead of failing for want of one."""
    import copy

    ids, _ = pk.build_prompt(tok, pk.DEFAULT_FILLER, 600, 0.5, "12345")
    assert "<|im_start|>assistant\n" in tok.decode(ids)
    base = copy.copy(tok)
    base.chat_template = None
    ids, (start, end) = pk.build_prompt(base, pk.DEFAULT_FILLER, 600, 0.5, "12345")
    text = base.decode(ids)
    assert "<|im_start|>" not in text and text.endswith(pk.ANSWER)
    assert base.decode(ids[start:end]).count("12345") == 2


def test_user_text_and_mistakes(tok):
    sentences = pk.split_sentences("One two.  Three!\nFour? five")
    assert sentences == ["One two.", "Three!", "Four?", "five"]
    text = "Rain fell on the town all night. " * 3 + "The bells rang twice at dawn!"
    ids, (start, end) = pk.build_prompt(tok, text, 500, 0.5, "55555")
    assert "bells rang" in tok.decode(ids) and "55555" in tok.decode(ids[start:end])
    with pytest.raises(pk.PasskeyError, match="cannot hold"):
        pk.build_prompt(tok, CAT, 40, 0.5, "55555")
    with pytest.raises(pk.PasskeyError, match="outside"):
        pk.build_prompt(tok, CAT, 500, 1.5, "55555")
    with pytest.raises(pk.PasskeyError, match="no sentences"):
        pk.build_prompt(tok, "  \n ", 500, 0.5, "55555")


def test_depths_keys_and_scoring():
    assert pk.depth_grid(5) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert pk.depth_grid(1) == [0.5]
    keys = pk.draw_keys(7, 20)
    assert keys == pk.draw_keys(7, 20) and keys != pk.draw_keys(8, 20)
    assert len(set(keys)) == 20 and all(len(k) == 5 and k.isdigit() for k in keys)
    assert pk.is_found(" 68231. Remember it.", "68231")
    assert pk.is_found(" 68,231", "68231") and pk.is_found("is 68 231", "68231")
    assert not pk.is_found(" 68213.", "68231")
    assert not pk.is_found(" 6823", "68231")
    assert not pk.is_found(" a magical object", "68231")


def test_run_structure(small_model, tok):
    r = pk.run_passkey(small_model, tok, "int8", [200, 300], depths=3, trials=2, seed=3,
                       max_new_tokens=4)
    assert r.kv == "int8" and r.lengths == [200, 300] and r.depths == [0.0, 0.5, 1.0]
    assert len(r.accuracy) == 3 and all(len(row) == 2 for row in r.accuracy)
    assert [t.key for t in r.trials] == pk.draw_keys(3, 12)  # (length, depth, trial) order
    assert [(t.length, t.depth) for t in r.trials[:3]] == [(200, 0.0), (200, 0.0), (200, 0.5)]
    assert all(t.tokens <= t.length and 0 < t.needle < t.tokens for t in r.trials)
    assert all(0 < len(tok.encode(t.answer)) <= 4 for t in r.trials)
    back = json.loads(r.to_json())
    assert back["trials"][5]["key"] == r.trials[5].key and back["accuracy"] == r.accuracy
    with pytest.raises(pk.PasskeyError, match="context"):
        pk.run_passkey(small_model, tok, "fp16", [510], depths=1, trials=1)


def test_heatmap(tmp_path, monkeypatch):
    trials = [pk.Trial(1024, 1020, 0.0, 50, "12345", " 12345.", True)]
    accuracy = [[1.0, 0.5], [1.0, 0.0], [1.0, 1.0]]
    r = pk.PasskeyResult("int4", [1024, 4096], [0.0, 0.5, 1.0], accuracy, 0.75, trials, 1.0)
    path = tmp_path / "heat.png"
    pk.plot_heatmap(r, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the extra were not installed
    with pytest.raises(ValueError, match="matplotlib"):
        pk.plot_heatmap(r, tmp_path / "none.png")


def test_smollm2_finds_the_key_fp16(smollm2_dir, tok):
    # Checked beforehand: at 400 tokens SmolLM2 finds the key at all five depths (10 of 10 keys),
    # fp16 cache and transformers alike.
    model = Transformer.from_pretrained(smollm2_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ten one-token steps: syncing threads costs more than they save
    try:
        r = pk.run_passkey(model, tok, "fp16", [400], depths=2, trials=1, seed=0)
    finally:
        torch.set_num_threads(threads)
    assert [t.depth for t in r.trials] == [0.0, 1.0]
    assert all(380 <= t.tokens <= 400 for t in r.trials)
    assert [t.found for t in r.trials] == [True, True], [t.answer for t in r.trials]
    assert r.accuracy == [[1.0], [1.0]] and r.overall == 1.0


def test_cli_passkey_json_and_heatmap(tmp_path, capsys):
    """`eval --task passkey` end to end on the real model: JSON per length x depth, a PNG."""
    from tinykv.cli import main

    png = tmp_path / "pk.png"
    code = main(["eval", "--task", "passkey", "--lengths", "300", "--depths", "2", "--kv",
                 "fp16", "--threads", "1", "--json", "--plot", str(png)])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["kv"] == "fp16" and out["lengths"] == [300]
    assert out["depths"] == [0.0, 1.0] and len(out["trials"]) == 2
    assert out["accuracy"] == [[1.0], [1.0]] and png.stat().st_size > 0
