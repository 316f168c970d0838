"""Parity with Hugging Face transformers on tiny random models of every supported architecture."""

import pytest
import torch
from hf_tiny import ARCHS, make_hf_model

from tinykv.cache import make_cache
from tinykv.model import Transformer
from tinykv.spec import KVSpec


@pytest.fixture(scope="module", params=ARCHS, ids=[a[0] for a in ARCHS])
def pair(request, tmp_path_factory):
    """(transformers' model, tinykv's model loaded from the files transformers saved)."""
    name, kind, h, kv, hd = request.param
    d = tmp_path_factory.mktemp(name)
    hf = make_hf_model(kind, h, kv, hd, d)
    return hf, Transformer.from_pretrained(d, device="cpu")


def test_logits_no_cache(pair):
    hf, m = pair
    ids = torch.randint(0, 256, (2, 45), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(m(ids), ref, atol=1e-4, rtol=1e-4)


def test_weights_start_on_a_cache_line(pair):
    """safetensors' tensors lie at their file offsets; the CPU kernels' vector loads want every
    weight row on a cache line (rows here are whole lines), so loading moves the ones that are
    not, values unchanged."""
    hf, m = pair
    assert all(p.data_ptr() % 64 == 0 for p in m.parameters())
    for name, p in hf.named_parameters():
        if name.endswith("embed_tokens.weight") or name.endswith("wte.weight"):
            assert torch.equal(m.embed.weight, p)


def test_cached_decode_matches_hf_cache(pair):
    """Prefill 13 tokens, then decode one at a time through the paged fp32 cache, vs HF with its
    cache."""
    hf, m = pair
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = hf(ids[:, :13], use_cache=True)
        ref, past = [out.logits[0, -1]], out.past_key_values
        for t in range(13, 30):
            out = hf(ids[:, t:t + 1], past_key_values=past, use_cache=True)
            ref.append(out.logits[0, -1])
            past = out.past_key_values
    cache = make_cache(m.cfg, KVSpec.parse("fp32"), blocks=8, block_size=4)
    cache.add_sequence(0)
    toks = ids[0].tolist()
    got = []
    for chunk in [toks[:13]] + [[t] for t in toks[13:30]]:
        plan = cache.plan([0], [chunk])
        got.append(m(torch.tensor(chunk), plan)[0])
        cache.commit(plan)
    torch.testing.assert_close(torch.stack(got), torch.stack(ref), atol=1e-4, rtol=1e-4)


def test_bad_inputs(tmp_path):
    from tinykv.model import ModelError

    with pytest.raises(ModelError, match="not found"):
        Transformer.from_pretrained(tmp_path / "nope")
    (tmp_path / "config.json").write_text('{"model_type": "mamba"}')
    with pytest.raises(ModelError, match="unsupported architecture 'mamba'"):
        Transformer.from_pretrained(tmp_path)


def test_corrupt_safetensors(tmp_path):
    from tinykv.model import ModelError

    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "vocab_size": 8, "hidden_size": 8, '
        '"num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 8}')
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelError, match="corrupt safetensors"):
        Transformer.from_pretrained(tmp_path, device="cpu")


@pytest.mark.parametrize("kind, h, kv, hd", [("llama", 4, 2, 64), ("gpt2", 4, 4, 64)])
def test_loading_leaves_torch_dynamo_unimported(kind, h, kv, hd, tmp_path):
    """from_pretrained builds the model on the meta device without torch's initializers: normal_
    and arange there import torch._dynamo, a slow import at every command's start. The model that
    loads still matches transformers (the RoPE tables and embeddings come from the files)."""
    import subprocess
    import sys

    from safetensors.torch import save_file

    model_dir, io = tmp_path / "model", tmp_path / "io.safetensors"
    hf = make_hf_model(kind, h, kv, hd, model_dir)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        save_file({"ids": ids, "want": hf(ids).logits}, str(io))
    code = ("import sys, torch\nfrom safetensors.torch import load_file\n"
            "from tinykv.model import Transformer\n"
            f"m = Transformer.from_pretrained({str(model_dir)!r}, device='cpu')\n"
            "print('torch._dynamo' in sys.modules)\n"
            f"io = load_file({str(io)!r})\n"
            "torch.testing.assert_close(m(io['ids']), io['want'], atol=1e-4, rtol=1e-4)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False"], r.stderr
