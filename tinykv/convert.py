"""Convert a llama-architecture GGUF file into a Hugging Face-style folder: `model.safetensors`
(float32), `config.json`, `tokenizer.json`, `tokenizer_config.json` and `generation_config.json`,
a folder that tinykv and `transformers` both load (fetch.py gets the default model's GGUF).
"""

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tqdm import tqdm


class ConvertError(RuntimeError):
    """A GGUF file this converter does not handle; the message is one line meant for the user."""


def _field(reader: GGUFReader, key: str, default=None):
    """One metadata value as a Python scalar, str or list (the reader keeps raw memmapped parts)."""
    field = reader.fields.get(key)
    if field is None:
        return default

    def value(kind: GGUFValueType, part: np.ndarray):
        if kind == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part[0].item()

    if field.types[0] == GGUFValueType.ARRAY:
        return [value(field.types[-1], field.parts[i]) for i in field.data]
    return value(field.types[0], field.parts[field.data[0]])


# The GGUF tensor name (after `blk.{i}.`) -> the Hugging Face Llama name (after
# `model.layers.{i}.`).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _hf_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    raise ConvertError(f"unsupported tensor {gguf_name!r} in GGUF "
                       "(only plain llama layouts convert)")


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation. Its converter reorders each head's rows from Hugging
    Face's half-split RoPE layout (rows (2, hd/2)) to interleaved pairs (rows (hd/2, 2)), which is
    what ggml's RoPE rotates. Swapping the two axes back restores the rows exactly (pure
    reindexing)."""
    rows, cols = w.shape
    per_head = w.reshape(n_heads, rows // n_heads // 2, 2, cols)  # (heads, hd/2, 2, cols)
    return per_head.transpose(1, 2).reshape(rows, cols)


# llama.cpp's `tokenizer.ggml.pre` names -> how text is split before BPE. The smollm family
# (StarCoder's tokenizer) isolates every digit, then applies the GPT-2 regex: llama.cpp's "\p{N}" +
# GPT-2 regex pair, and the Digits + ByteLevel pre-tokenizer of the original model's
# tokenizer.json.
_DIGIT_SPLIT = ("smollm", "starcoder", "refact", "codeshell")
_GPT2_SPLIT = ("default", "gpt2")


def _build_tokenizer(reader: GGUFReader) -> HFTokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from the vocabulary and merges stored in the GGUF."""
    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise ConvertError(f"unsupported GGUF tokenizer {_field(reader, 'tokenizer.ggml.model')!r} "
                           "(only byte-level BPE, 'gpt2', converts)")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    known = _DIGIT_SPLIT + _GPT2_SPLIT
    if pre not in known:
        raise ConvertError(f"unsupported GGUF pre-tokenizer {pre!r} (known: {known})")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    digits = pre_tokenizers.Digits(individual_digits=True)
    if pre in _DIGIT_SPLIT:
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    # Control tokens (type 3) must match whole and count as special; user-defined ones (type 4)
    # match whole but are plain text. Both already have ids in the vocabulary, so adding keeps
    # those ids.
    kinds = list(zip(tokens, types, strict=True))
    control = [AddedToken(t, special=True, normalized=False) for t, kind in kinds if kind == 3]
    user = [AddedToken(t, special=False, normalized=False) for t, kind in kinds if kind == 4]
    tok.add_special_tokens(control)
    tok.add_tokens(user)
    return tok


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a llama-architecture GGUF to model.safetensors (float32) + HF config and tokenizer
    files."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ConvertError(f"unsupported GGUF architecture {arch!r} in {gguf_path.name} "
                           "(only llama converts)")
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    has_freqs = any(t.name == "rope_freqs.weight" for t in reader.tensors)
    if scaling not in ("none", "") or has_freqs:
        raise ConvertError(f"{gguf_path.name} uses RoPE scaling, which this converter does not "
                           "handle")

    def hp(key: str, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ConvertError(f"{gguf_path.name} lacks metadata key {arch}.{key}")
        return value

    # Built before the slow part, so that an unsupported vocabulary fails fast.
    tokenizer = _build_tokenizer(reader)
    n_heads = hp("attention.head_count")
    state = _dequantized(reader, gguf_path.name, n_heads, hp("attention.head_count_kv", n_heads))
    config = _model_config(reader, hp, state)
    tok_config, gen_config = _tokenizer_configs(reader, config)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for name, obj in (("config.json", config), ("tokenizer_config.json", tok_config),
                      ("generation_config.json", gen_config)):
        text = json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
        (out_dir / name).write_text(text, encoding="utf-8")
    return out_dir


def _dequantized(reader: GGUFReader, name: str, n_heads: int,
                 n_kv_heads: int) -> dict[str, torch.Tensor]:
    """Every tensor in float32 under its Hugging Face name, q and k rows in HF's RoPE layout."""
    state: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"dequantizing {name}", unit="tensor"):
        # GGUF lists dims fastest-first; numpy/torch want them slowest-first.
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if ".attn_q." in t.name:
            w = _unpermute(w, n_heads)
        elif ".attn_k." in t.name:
            w = _unpermute(w, n_kv_heads)
        state[_hf_name(t.name)] = w.contiguous()
    return state


def _model_config(reader: GGUFReader, hp, state: dict[str, torch.Tensor]) -> dict:
    """config.json from the GGUF's hyperparameters (hp reads the architecture's, checked)."""
    n_heads, hidden = hp("attention.head_count"), hp("embedding_length")
    vocab = len(state["model.embed_tokens.weight"])
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": hp("feed_forward_length"),
        "num_hidden_layers": hp("block_count"), "num_attention_heads": n_heads,
        "num_key_value_heads": hp("attention.head_count_kv", n_heads),
        "head_dim": hp("attention.key_length", hidden // n_heads),
        "rms_norm_eps": hp("attention.layer_norm_rms_epsilon"),
        "rope_theta": hp("rope.freq_base", 10000.0),
        "max_position_embeddings": hp("context_length"), "vocab_size": hp("vocab_size", vocab),
        "tie_word_embeddings": "lm_head.weight" not in state,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32", "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    }


def _tokenizer_configs(reader: GGUFReader, config: dict) -> tuple[dict, dict]:
    """tokenizer_config.json and generation_config.json from the GGUF's tokenizer metadata."""
    tokens = _field(reader, "tokenizer.ggml.tokens") or []

    def token_id(key: str):
        return _field(reader, f"tokenizer.ggml.{key}")

    def name_of(key: str):
        i = token_id(key)
        return tokens[i] if i is not None and i < len(tokens) else None

    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name_of("bos_token_id"), "eos_token": name_of("eos_token_id"),
        "pad_token": name_of("padding_token_id"), "unk_token": name_of("unknown_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    # End-of-turn tokens (llama.cpp's eot) also end generation, so they join eos here.
    eos = [i for i in (config["eos_token_id"], token_id("eot_token_id")) if i is not None]
    eos_ids = sorted(set(eos)) if len(set(eos)) > 1 else config["eos_token_id"]
    gen_config = {"bos_token_id": config["bos_token_id"], "pad_token_id": config["pad_token_id"],
                  "eos_token_id": eos_ids}
    return tok_config, gen_config
