"""A model folder's JSON files: every field is read with its type checked, so an odd file is a
one-line error naming the file and the field, never a KeyError or a TypeError."""

import json
from pathlib import Path

import pytest
from test_cli import tiny_config, tiny_tensors, write_model

from tinykv.model import Transformer
from tinykv.modelfiles import ModelFileError
from tinykv.tokenizer import Tokenizer

# (file, its fields merged over the good ones, the field the error must name)
ODD = [
    ("config.json", {"eos_token_id": [None]}, "eos_token_id"),
    ("config.json", {"eos_token_id": "2"}, "eos_token_id"),
    ("config.json", {"rms_norm_eps": "1e-5"}, "rms_norm_eps"),
    ("config.json", {"rms_norm_eps": -1.0}, "rms_norm_eps"),
    ("config.json", {"vocab_size": "256"}, "vocab_size"),
    ("config.json", {"num_hidden_layers": 2.5}, "num_hidden_layers"),
    ("config.json", {"hidden_size": None}, "hidden_size"),
    ("config.json", {"head_dim": -16}, "head_dim"),
    ("config.json", {"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ("config.json", {"rope_theta": [10000]}, "rope_theta"),
    ("config.json", {"rope_scaling": "linear"}, "rope_scaling"),
    ("config.json", {"rope_scaling": {"rope_type": "llama3"}}, "factor"),
    ("config.json", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                      "original_max_position_embeddings": "8192"}},
     "original_max_position_embeddings"),
    ("config.json", {"model_type": 3}, "model_type"),
    ("tokenizer_config.json", {"bos_token": {"lstrip": False}}, "bos_token"),
    ("tokenizer_config.json", {"eos_token": 2}, "eos_token"),
    ("tokenizer_config.json", {"chat_template": [{"name": "default"}]}, "chat_template"),
    ("tokenizer_config.json", {"chat_template": 5}, "chat_template"),
    ("tokenizer_config.json", {"add_bos_token": "true"}, "add_bos_token"),
    ("generation_config.json", {"eos_token_id": [1, None]}, "eos_token_id"),
]


def folder(tmp_path: Path, name: str, fields: dict | str) -> Path:
    """The tiny model with `name` holding the good fields and these (or this text)."""
    cfg = tiny_config()
    d = write_model(tmp_path / "model", cfg, tiny_tensors(cfg))
    if isinstance(fields, str):
        (d / name).write_text(fields)
    else:
        base = cfg if name == "config.json" else {}
        (d / name).write_text(json.dumps({**base, **fields}))
    return d


def load(d: Path) -> None:
    Transformer.from_pretrained(d, device="cpu")
    Tokenizer.from_dir(d)


@pytest.mark.parametrize("name, fields, field", ODD, ids=[f"{n}-{f}" for n, _, f in ODD])
def test_odd_field_is_one_line_naming_file_and_field(tmp_path, name, fields, field):
    d = folder(tmp_path, name, fields)
    with pytest.raises(ModelFileError) as e:
        load(d)
    message = str(e.value)
    assert "\n" not in message and name in message and repr(field) in message, message


@pytest.mark.parametrize("name, text, why", [
    ("tokenizer_config.json", "{not json", "not valid JSON"),
    ("generation_config.json", "[1, 2]", "not a JSON object"),
    ("config.json", b"\xff\xfe".decode("latin-1"), "not valid JSON"),
])
def test_unreadable_file_is_one_line(tmp_path, name, text, why):
    d = folder(tmp_path, name, text)
    with pytest.raises(ModelFileError, match=why) as e:
        load(d)
    assert "\n" not in str(e.value) and name in str(e.value)


def test_the_shapes_hugging_face_allows_load(tmp_path):
    """AddedToken-style tokens, named templates, lists of eos ids, null for absent, llama3
    RoPE scaling: read as transformers reads them."""
    cfg = tiny_config()
    cfg.update(eos_token_id=[1, 2], head_dim=None, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64})
    d = write_model(tmp_path / "model", cfg, tiny_tensors(tiny_config()))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "w5", "lstrip": False}, "eos_token": "w3",
        "chat_template": [{"name": "tool_use", "template": "tools"},
                          {"name": "default", "template": "{{ messages[0]['content'] }}"}],
        "add_bos_token": True, "pad_token": None}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    model = Transformer.from_pretrained(d, device="cpu")
    assert model.cfg.rope_scaling["factor"] == 8.0 and model.cfg.head_dim == 16
    tok = Tokenizer.from_dir(d)
    assert tok.eos_ids == {1, 2, 3, 4} and tok.encode("w1") == [5, 1]
    assert tok.apply_chat_template([{"role": "user", "content": "w7"}]) == "w7"
