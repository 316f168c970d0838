"""Checkpoints into tinykv's decoder: safetensors files read, Hugging Face tensor names mapped
onto model.py's (q/k/v and gate/up concatenated into its fused projections), and the error a user
sees when a checkpoint does not fit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

GATE_UP = ("gate", "up")  # the Llama MLP's two input projections, fused into one (model.MLP)


class ModelError(RuntimeError):
    """A user-facing problem with a checkpoint (missing, corrupt, unsupported)."""


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the *.safetensors files (one, or the shards) in a directory."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"no *.safetensors files in {path}")
    out = {}
    for f in files:
        try:
            out.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelError(f"corrupt safetensors file {f}: {str(e).splitlines()[0]}") from None
    return out


def convert_hf_state_dict(cfg, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face tensor names -> tinykv names: the one place the two naming schemes meet."""
    hf = {k.removeprefix("model.").removeprefix("transformer."): v for k, v in hf.items()}

    def get(name: str) -> torch.Tensor:
        if name not in hf:
            raise ModelError(f"checkpoint lacks tensor '{name}'")
        return hf[name].float()

    return _gpt2_tensors(cfg, get) if cfg.gpt2_style else _llama_tensors(cfg, get)


def _gpt2_tensors(cfg, get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    conv1d = cfg.model_type == "gpt2"  # Conv1D weights (in, out); gpt_bigcode's are (out, in)
    sd = {"embed.weight": get("wte.weight"), "pos_embed.weight": get("wpe.weight"),
          "norm.weight": get("ln_f.weight"), "norm.bias": get("ln_f.bias")}
    pairs = {"norm1": "ln_1", "norm2": "ln_2", "attn.wqkv": "attn.c_attn",
             "attn.wo": "attn.c_proj", "mlp.w_in": "mlp.c_fc", "mlp.w_out": "mlp.c_proj"}
    for i in range(cfg.n_layers):
        src, dst = f"h.{i}.", f"layers.{i}."
        for ours, theirs in pairs.items():
            w = get(src + theirs + ".weight")
            if conv1d and not ours.startswith("norm"):
                w = w.t().contiguous()
            sd[dst + ours + ".weight"] = w
            sd[dst + ours + ".bias"] = get(src + theirs + ".bias")
    return sd


def _llama_tensors(cfg, get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    sd = {"embed.weight": get("embed_tokens.weight"), "norm.weight": get("norm.weight")}
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = get("lm_head.weight")
    for i in range(cfg.n_layers):
        src = dst = f"layers.{i}."
        sd[dst + "norm1.weight"] = get(src + "input_layernorm.weight")
        sd[dst + "norm2.weight"] = get(src + "post_attention_layernorm.weight")
        attn = src + "self_attn."
        sd[dst + "attn.wqkv.weight"] = torch.cat([get(attn + f"{n}_proj.weight") for n in "qkv"])
        if cfg.qkv_bias:
            sd[dst + "attn.wqkv.bias"] = torch.cat([get(attn + f"{n}_proj.bias") for n in "qkv"])
        sd[dst + "attn.wo.weight"] = get(attn + "o_proj.weight")
        if cfg.o_bias:
            sd[dst + "attn.wo.bias"] = get(attn + "o_proj.bias")
        mlp = src + "mlp."
        sd[dst + "mlp.w_in.weight"] = torch.cat([get(mlp + f"{n}_proj.weight") for n in GATE_UP])
        sd[dst + "mlp.w_out.weight"] = get(mlp + "down_proj.weight")
        if cfg.mlp_bias:
            sd[dst + "mlp.w_in.bias"] = torch.cat([get(mlp + f"{n}_proj.bias") for n in GATE_UP])
            sd[dst + "mlp.w_out.bias"] = get(mlp + "down_proj.bias")
    return sd
