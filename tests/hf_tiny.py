"""Tiny randomly initialised Hugging Face models of every supported architecture, saved to disk.

Used by the parity tests: transformers is the independent reference, tinykv loads the same
safetensors files through its own code.
"""

from __future__ import annotations

from pathlib import Path

import torch

# (name, model_type, n_heads, n_kv_heads, head_dim)
ARCHS = [
    ("llama-mha-64", "llama", 4, 4, 64),
    ("llama-gqa-80", "llama", 6, 2, 80),
    ("llama-mqa-64", "llama", 4, 1, 64),
    ("llama3-rope-gqa", "llama3", 6, 2, 64),
    ("mistral-gqa-64", "mistral", 6, 2, 64),
    ("qwen2-gqa-80", "qwen2", 6, 2, 80),
    ("gpt2-mha-64", "gpt2", 4, 4, 64),
    ("gpt2-mha-80", "gpt2", 3, 3, 80),
    ("bigcode-mqa-64", "gpt_bigcode", 4, 1, 64),
]


def make_hf_model(kind: str, n_heads: int, n_kv: int, hd: int, out: Path,
                  seed: int = 0) -> torch.nn.Module:
    """Build, randomly initialise and save a tiny HF causal LM; returns the HF model (float32,
    eval)."""
    import transformers as tf

    torch.manual_seed(seed)
    dim, layers, vocab, ctx = n_heads * hd, 2, 256, 512
    if kind in ("llama", "llama3", "mistral", "qwen2"):
        common = dict(vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim + 32,
                      num_hidden_layers=layers, num_attention_heads=n_heads,
                      num_key_value_heads=n_kv, max_position_embeddings=ctx, rms_norm_eps=1e-5,
                      tie_word_embeddings=False)
        if kind == "llama":
            cfg = tf.LlamaConfig(head_dim=hd, rope_theta=10000.0, **common)
        elif kind == "llama3":
            rope_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                            "rope_theta": 500000.0}
            cfg = tf.LlamaConfig(head_dim=hd, rope_theta=500000.0, rope_scaling=rope_scaling,
                                 **common)
        elif kind == "mistral":
            cfg = tf.MistralConfig(head_dim=hd, sliding_window=None, **common)
        else:
            cfg = tf.Qwen2Config(**common)
        model = tf.AutoModelForCausalLM.from_config(cfg)
    elif kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=vocab, n_embd=dim, n_layer=layers, n_head=n_heads,
                            n_positions=ctx)
        model = tf.GPT2LMHeadModel(cfg)
    else:
        cfg = tf.GPTBigCodeConfig(vocab_size=vocab, n_embd=dim, n_layer=layers, n_head=n_heads,
                                  n_positions=ctx, multi_query=n_kv == 1)
        model = tf.GPTBigCodeForCausalLM(cfg)
    # Random init leaves norms at 1 and biases at 0: perturb them so they are really tested.
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model = model.float().eval()
    model.save_pretrained(out, safe_serialization=True)
    return model
