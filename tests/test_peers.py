"""llama.cpp as a peer (tinykv/bench/peers.py, peer_weights.py): the F32 GGUF of the same
weights, checked tensor by tensor (runs without llama.cpp); with --packed-weights the source GGUF's
own blocks, each engine's weight bytes, and llama.cpp's AMX left out; and the run without the
`peers` extra, whose llama.cpp columns say how to get them."""

import json
import sys
import types

import gguf
import numpy as np
import pytest
import torch
from hf_tiny import make_hf_model

from tinykv import packed
from tinykv.bench import ceilings, peer_weights, peers
from tinykv.model import Transformer


@pytest.fixture(scope="module")
def f32_gguf(smollm2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("peers") / "model-f32.gguf"
    n = peer_weights.write_f32_gguf(peer_weights.source_gguf(smollm2_dir), out)
    return out, n


def test_f32_gguf_keeps_metadata_order_and_rows(smollm2_dir, f32_gguf):
    path, n = f32_gguf
    src = gguf.GGUFReader(peer_weights.source_gguf(smollm2_dir))
    dst = gguf.GGUFReader(path)
    assert n == len(src.tensors) == len(dst.tensors)
    assert [t.name for t in dst.tensors] == [t.name for t in src.tensors]
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in dst.tensors)
    skip = ("GGUF.", "general.file_type")
    for key, field in src.fields.items():
        if not key.startswith(skip):
            assert dst.fields[key].contents() == field.contents(), key
    assert dst.fields["general.file_type"].contents() == gguf.LlamaFileType.ALL_F32
    # llama.cpp's own Q/K row order: the rows as the source stores them, not un-permuted
    by_name = {t.name: t for t in dst.tensors}
    for t in src.tensors:
        if t.name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.7.ffn_down.weight"):
            want = gguf.dequantize(t.data, t.tensor_type).reshape(-1)
            assert np.array_equal(np.asarray(by_name[t.name].data).reshape(-1), want)


def test_f32_gguf_equals_the_safetensors_and_a_change_shows(smollm2_dir, f32_gguf):
    path, _ = f32_gguf
    check = peer_weights.same_weights(path, smollm2_dir)
    assert check["all_equal"] and check["equal"] == check["tensors"] > 200
    tampered = gguf.GGUFReader(path, "r+")
    t = next(t for t in tampered.tensors if t.name == "blk.3.attn_k.weight")
    t.data[5, 7] += 1.0
    tampered.data.flush()
    del tampered, t
    check = peer_weights.same_weights(path, smollm2_dir)
    assert not check["all_equal"] and check["equal"] == check["tensors"] - 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("peers-llama")
    make_hf_model("llama", 4, 2, 64, d)
    return d, Transformer.from_pretrained(d, device="cpu")


def test_without_the_extra_the_llama_columns_say_how_to_get_them(tiny, monkeypatch, tmp_path):
    d, model = tiny
    monkeypatch.setattr(peers, "llama_available", lambda: False)
    ids = torch.randint(3, 256, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    cfg = dict(contexts=[40, 90], specs=["fp16", "int8"], threads=1, rounds=2, new=3, ppl=True,
               offset=0, ppl_tokens=100, window=50, chunk=16, bw_mib=8,
               llama_kv=list(peers.LLAMA_TYPES), packed=False)
    res = peers.collect(model, d, ids, cfg, lambda _: None)
    assert res["config"]["how_to_get"] == peers.HOW_TO_GET and "gguf" not in res
    rows = {(r["engine"], r["kv"], r["context"]): r for r in res["rows"]}
    assert len(rows) == 2 * (2 + 3)  # two contexts: two tinykv specs, three llama.cpp types
    for (engine, _, _), r in rows.items():
        assert r["roofline_tok_s"] > 0 and r["kv_bytes_per_token"] > 0
        if engine == "llama.cpp":
            assert r["decode_tok_s"] is None and r["note"] == peers.HOW_TO_GET
        else:
            assert r["decode_tok_s"] > 0 and r["prefill_s"] > 0
            assert len(r["decode_tok_s_all"]) == cfg["rounds"]
            assert len(r["new_ids"]) == cfg["new"]  # greedy tokens, for the check beside llama
            assert r["pct_roofline"] == pytest.approx(100 * r["decode_tok_s"]
                                                      / r["roofline_tok_s"])
    # bytes per token: tinykv's pool, llama.cpp's from its block formats
    c = model.cfg
    elements = 2 * c.n_layers * c.n_kv_heads * c.head_dim  # K and V, every layer, per token
    assert rows["tinykv", "fp16", 40]["kv_bytes_per_token"] == elements * 2
    assert rows["llama.cpp", "q8_0", 40]["kv_bytes_per_token"] == elements * 34 / 32
    assert [r["context"] for r in res["ratios"]] == [40, 90]
    assert "int8 / llama f16" not in res["ratios"][0]  # nothing to divide by
    assert "same greedy tokens (fp16, f16)" not in res["ratios"][0]
    assert res["ratios"][0]["prefill tinykv fp16 / 16-bit"] == 1.0
    quality = {(r["engine"], r["kv"]): r["ppl"] for r in res["quality"]["rows"]}
    assert quality["llama.cpp", "q4_0"] is None and quality["tinykv", "int4"] > 1
    res.update(command="bench peers", machine={"cpu": "test cpu"})
    text = peers.render(res)
    assert peers.HOW_TO_GET in text and "tinykv `int8`" in text
    json.dumps(res)  # every field is plain JSON
    assert peers.chart({**res, "rows": []}, tmp_path / "none.png") is None  # --no-speed
    no_speed = peers.render({**res, "rows": [], "ratios": []})
    assert "decode tok/s" not in no_speed and "| tinykv `int8`" in no_speed  # perplexity alone
    png = peers.chart(res, tmp_path / "peers.png")
    assert png is None or (tmp_path / "peers.png").stat().st_size > 0


def test_gguf_weight_bytes_count_the_embedding_only_where_it_is_the_output(tmp_path):
    def write(path, names):
        w = gguf.GGUFWriter(path, "llama")
        shapes = {"token_embd.weight": (6, 8), "output.weight": (4, 8), "blk.0.x.weight": (2, 8)}
        for name in names:
            w.add_tensor(name, np.zeros(shapes[name], np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path
    untied = write(tmp_path / "untied.gguf", ["token_embd.weight", "output.weight",
                                              "blk.0.x.weight"])
    tied = write(tmp_path / "tied.gguf", ["token_embd.weight", "blk.0.x.weight"])
    assert peer_weights.gguf_weight_bytes(untied) == (4 * 8 + 2 * 8) * 4  # rows gathered
    assert peer_weights.gguf_weight_bytes(tied) == (6 * 8 + 2 * 8) * 4  # read whole, as the head


def test_packed_peers_read_the_source_gguf_blocks(smollm2_dir, monkeypatch):
    """--packed-weights: the source GGUF's own blocks are the model's weights exactly, every
    linear layer packs from them, and each engine's roofline counts the bytes it reads (no
    llama.cpp needed)."""
    src = peer_weights.source_gguf(smollm2_dir)
    check = peer_weights.same_weights(src, smollm2_dir)
    assert check["all_equal"] and check["equal"] == check["tensors"] > 200
    model = Transformer.from_pretrained(smollm2_dir, device="cpu")
    float32_bytes = ceilings.weight_bytes(model)
    with pytest.raises(ValueError, match="0 of 121 linear layers"):
        peer_weights.check_packed(model)
    assert packed.pack_model(model) == 121
    peer_weights.check_packed(model)  # every one: no error
    monkeypatch.setattr(peers, "llama_available", lambda: False)
    ids = list(range(100, 160))
    cfg = dict(contexts=[30], specs=["int8"], threads=1, rounds=1, new=2, ppl=False, offset=0,
               ppl_tokens=0, window=50, chunk=16, bw_mib=8, llama_kv=["q8_0"], packed=True)
    res = peers.collect(model, smollm2_dir, ids, cfg, lambda _: None)
    in_gguf = sum(int(t.n_bytes) for t in gguf.GGUFReader(src).tensors)  # tied: all are read
    assert res["llama_weight_bytes"] == in_gguf < res["weight_bytes"] < float32_bytes / 3
    bw = res["bandwidth"]["gb_s"] * 1e9
    for r in res["rows"]:
        read = res["weight_bytes"] if r["engine"] == "tinykv" else in_gguf
        kv = r["kv_tokens_mean"] * r["kv_bytes_per_token"]
        assert r["roofline_tok_s"] == pytest.approx(bw / (read + kv))
    res.update(command="bench peers --packed-weights", machine={"cpu": "test cpu"})
    assert "(packed), llama.cpp" in peers.render(res)


def test_quantized_weights_load_without_amx_where_llama_cpp_has_it(smollm2_dir, f32_gguf,
                                                                    monkeypatch):
    """without_amx turns llama.cpp's extra buffer types off while a Llama loads the quantized
    GGUF, only where the binding reports AMX, and puts the default back (a stand-in binding:
    the `peers` extra is not installed here)."""
    class Params:
        use_extra_bufts = True
    inner = types.SimpleNamespace(llama_model_default_params=Params)
    binding = types.ModuleType("llama_cpp")
    binding.llama_cpp = inner
    monkeypatch.setitem(sys.modules, "llama_cpp", binding)
    quantized, f32 = peer_weights.source_gguf(smollm2_dir), f32_gguf[0]
    for info, path, extra in [(b"AVX512 = 1 | AMX_INT8 = 1 |", quantized, False),
                              (b"AVX512 = 1 | AMX_INT8 = 1 |", f32, True),
                              (b"AVX512 = 1 | AMX_INT8 = 0 |", quantized, True)]:
        binding.llama_print_system_info = lambda info=info: info
        with peers.without_amx(path):
            assert inner.llama_model_default_params().use_extra_bufts is extra
        assert inner.llama_model_default_params is Params  # put back
