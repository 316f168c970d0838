"""vLLM / llm-compressor export of static KV scales: `model.layers.{i}.self_attn.k_scale` /
`v_scale`, float32, (1,) per tensor or (num_kv_heads, 1, 1) per head, x ~= q * scale, plus
config.json's `kv_cache_scheme` entry. It expresses only K and V alike, static, sym, tensor or head,
fp8 ("float", scale = absmax / 448) or int8 ("int", absmax / 127; vLLM itself serves fp8 KV caches
only); other specs are refused before anything is calibrated."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .outputs import write_text, written
from .scalefile import CalibrationError
from .spec import KVSpec


def check_vllm(spec: KVSpec) -> None:
    """Refuse, in one line, a spec vLLM's KV scale convention cannot express."""
    p = spec.k
    if (p.rot or spec.v.rot or p.center or spec.v.center or p.smooth or spec.skip
            or spec.per_layer):
        raise CalibrationError(f"vLLM cannot apply tinykv's rotation, centering, smoothing, "
                               f"skipped layers or per-layer formats (one KV format serves "
                               f"every layer there): '{spec}' has :rot, :center, :smooth, skip= "
                               "or a per-layer part (export a spec without them)")
    vllm_format = (p == spec.v and p.static and p.sym and p.gran in ("tensor", "head")
                   and p.dtype in ("fp8", "int8"))
    if not vllm_format:
        raise CalibrationError("vLLM's KV scale convention needs one static sym per-tensor or "
                               "per-head fp8/int8 format for K and V (e.g. fp8:tensor:static); "
                               f"'{spec}' is not one")


def export_vllm(scales: dict[str, torch.Tensor], spec: KVSpec, path: str | Path) -> dict:
    """Write scales in vLLM's names and shapes (module docstring); the kv_cache_scheme entry is
    returned and written beside them as NAME.kv_cache_scheme.json."""
    check_vllm(spec)
    p, out = spec.k, {}
    for name in ("k", "v"):
        for i, s in enumerate(scales[f"{name}_scale"]):  # s: (H|1, 1, 1)
            shape = (-1,) if p.gran == "tensor" else s.shape  # (1,) per tensor, (H, 1, 1) per head
            out[f"model.layers.{i}.self_attn.{name}_scale"] = s.float().reshape(shape)
    with written(path) as tmp:
        save_file({n: t.contiguous() for n, t in out.items()}, str(tmp))
    scheme = {"num_bits": 8, "type": "float" if p.dtype == "fp8" else "int",
              "strategy": "tensor" if p.gran == "tensor" else "attn_head", "dynamic": False,
              "symmetric": True}
    write_text(vllm_scheme_path(path), json.dumps({"kv_cache_scheme": scheme}, indent=2))
    return scheme


def vllm_scheme_path(path: str | Path) -> Path:
    """Where export_vllm puts the kv_cache_scheme entry beside its scales."""
    return Path(path).with_suffix(".kv_cache_scheme.json")
