"""The scale file `tinykv calibrate` writes and every `--kv-scales` reads: float32 safetensors
(never pickle) holding static scales (`k_scale`, `k_zero`, ...), centers (`k_center`,
`v_center`, (L, H, D)) and key smoothing maps (`k_smooth`, (L, H, D, D)), with metadata naming
the format, the calibrated spec and the model's fingerprint. `load_scales` checks all of it
against the model and the spec it serves, with a one-line error for each mismatch."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .model import Config
from .outputs import written
from .spec import KVSpec, QuantParams, SpecError

FORMAT = "tinykv-kv-scales/1"  # metadata["format"] of a scale file


class CalibrationError(ValueError):
    """A user mistake around calibration (bad observer, wrong or missing file); one line."""


def fingerprint(cfg: Config) -> dict[str, str]:
    """What a scale file must agree on with the model: shapes, and a hash of the whole config."""
    blob = json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str).encode()
    return {"model_type": cfg.model_type, "n_layers": str(cfg.n_layers),
            "n_kv_heads": str(cfg.n_kv_heads), "head_dim": str(cfg.head_dim),
            "config_hash": hashlib.sha256(blob).hexdigest()[:16]}


@dataclass(frozen=True)
class TextSpan:
    """Which tokens of which text: a text's sha256 and a token range [offset, offset + tokens).
    A scale file records the span that calibrated it, so that a measurement can refuse to score
    a spec on its own calibration tokens."""
    sha256: str
    offset: int
    tokens: int

    @classmethod
    def of(cls, text: str, offset: int, tokens: int) -> TextSpan:
        return cls(hashlib.sha256(text.encode()).hexdigest(), offset, tokens)

    def overlaps(self, other: TextSpan) -> bool:
        same = self.sha256 == other.sha256
        return same and self.offset < other.offset + other.tokens and \
            other.offset < self.offset + self.tokens

    def __str__(self) -> str:
        return f"tokens {self.offset}-{self.offset + self.tokens} of text {self.sha256[:12]}"


def save_scales(path: str | Path, scales: dict[str, torch.Tensor], cfg: Config, spec: KVSpec,
                observer: str, tokens: int, source: TextSpan | None = None) -> None:
    """A scale file: the tensors as float32 safetensors, with what `load_scales` checks and the
    span of text that calibrated it."""
    meta = {"format": FORMAT, "spec": str(spec), "observer": observer, "tokens": str(tokens),
            **fingerprint(cfg)}
    if source is not None:
        meta.update(text_sha256=source.sha256, text_offset=str(source.offset))
    with written(path) as tmp:
        save_file({n: t.float().contiguous() for n, t in scales.items()}, str(tmp), metadata=meta)


def scale_source(path: str | Path) -> TextSpan | None:
    """The span of text a scale file was calibrated on; None when it does not say (older files)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError):
        return None
    if "text_sha256" not in meta:
        return None
    return TextSpan(meta["text_sha256"], int(meta["text_offset"]), int(meta["tokens"]))


def load_scales(path: str | Path, cfg: Config, spec: KVSpec) -> dict[str, torch.Tensor]:
    """The tensors of a scale file (static scales, centers, key smoothing maps), checked against
    the model and against what the spec needs from the file."""
    meta, tensors = _read(path)
    if meta.get("format") != FORMAT:
        raise CalibrationError(f"{path} is not a tinykv scale file (made by `tinykv calibrate`)")
    diff = [f"{k} {meta.get(k)} != {v}" for k, v in fingerprint(cfg).items() if meta.get(k) != v]
    if diff:
        raise CalibrationError(f"{path} was calibrated for another model "
                               f"({', '.join(diff)} of this one)")
    try:
        file_spec = KVSpec.parse(meta.get("spec", ""))
    except SpecError as e:
        raise CalibrationError(f"{path}: its metadata holds no valid KV spec ({e})") from None
    if not spec.needs_scales:
        raise CalibrationError(f"--kv-scales given but KV spec '{spec}' has no static, "
                               f"centered or smoothed part ({path}: '{file_spec}')")
    wanted: dict[str, QuantParams] = {}  # tensor group -> the part it serves
    layers = zip(spec.layer_parts(cfg.n_layers), file_spec.layer_parts(cfg.n_layers))
    for layer, (parts, file_parts) in enumerate(layers):
        # a per-layer spec (or file) names the layer whose part the file does not serve
        at = f" at layer {layer}" if spec.per_layer or file_spec.per_layer else ""
        for name, p, fp in zip("kv", parts, file_parts):
            _check_part(path, name, p, fp, file_spec, at)
            for group, asked in (("center", p.center), ("smooth", p.smooth),
                                 ("scale", p.static)):
                if asked:
                    wanted[f"{name}_{group}"] = p
    out: dict[str, torch.Tensor] = {}
    for group, p in wanted.items():
        if group.endswith("_center"):
            out[group] = _center_of(path, tensors, group, cfg)
        elif group == "k_smooth":
            out[group] = _smooth_of(path, tensors, cfg)
        else:
            out.update(_static_of(path, tensors, group[0], cfg, p))
    return out


def _read(path: str | Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """A safetensors file's metadata and tensors; a clear error when it is none."""
    if not Path(path).is_file():
        raise CalibrationError(f"scale file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}, {n: f.get_tensor(n) for n in f.keys()}
    except (SafetensorError, OSError) as e:
        first_line = str(e).splitlines()[0]
        raise CalibrationError(f"{path} is not a safetensors file: {first_line}") from None


def _check_part(path: str | Path, name: str, p: QuantParams, fp: QuantParams,
                file_spec: KVSpec, at: str) -> None:
    """The file's part `fp` of one layer's K or V holds what the spec's part `p` takes from it."""
    if p.center and not fp.center:
        raise CalibrationError(f"{path} holds no means for {name}{at} (it is for '{file_spec}'; "
                               f"calibrate a spec whose {name} part has :center)")
    if p.smooth and not fp.smooth:
        raise CalibrationError(f"{path} holds no smoothing maps for k{at} (it is for "
                               f"'{file_spec}'; calibrate a spec whose k part has :smooth)")
    if p.smooth and fp.center != p.center:
        fitted = "centered" if fp.center else "uncentered"
        raise CalibrationError(f"{path} holds smoothing maps fitted to {fitted} keys{at} (it is "
                               f"for '{file_spec}'); calibrate k={p}")
    if p.static and p != fp:
        raise CalibrationError(f"{path} holds scales for {name}={fp}, not {name}={p}{at} (it is "
                               f"for '{file_spec}')")


def _static_of(path: str | Path, tensors: dict[str, torch.Tensor], name: str, cfg: Config,
               p: QuantParams) -> dict[str, torch.Tensor]:
    """The file's static scales (and zero points) for K or V, (L, H|1, 1, G) each, checked."""
    shape = (cfg.n_layers, *p.scale_shape(cfg.n_kv_heads, 1, cfg.head_dim))
    out = {}
    for kind in ["scale"] if p.sym else ["scale", "zero"]:
        x = tensors.get(f"{name}_{kind}")
        valid = (x is not None and tuple(x.shape) == shape and bool(x.isfinite().all())
                 and not (kind == "scale" and bool((x <= 0).any())))
        if not valid:
            raise CalibrationError(f"{path}: tensor {name}_{kind} is missing, misshapen "
                                   f"(want {shape}) or invalid")
        out[f"{name}_{kind}"] = x.float()
    return out


def _center_of(path: str | Path, tensors: dict[str, torch.Tensor], group: str,
               cfg: Config) -> torch.Tensor:
    """The file's means (L, H, D) of K or V, checked."""
    x = tensors.get(group)
    shape = (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
    if x is None or tuple(x.shape) != shape or not bool(x.isfinite().all()):
        raise CalibrationError(f"{path}: tensor {group} is missing, misshapen (want "
                               f"{shape}) or invalid")
    return x.float()


def _smooth_of(path: str | Path, tensors: dict[str, torch.Tensor], cfg: Config) -> torch.Tensor:
    """The file's key smoothing maps (L, H, D, D), checked: finite and invertible."""
    x = tensors.get("k_smooth")
    shape = (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.head_dim)
    valid = x is not None and tuple(x.shape) == shape and bool(x.isfinite().all())
    if valid:  # a map the queries cannot undo would change every score
        valid = bool((torch.linalg.cond(x.double()) < 1e8).all())
    if not valid:
        raise CalibrationError(f"{path}: tensor k_smooth is missing, misshapen (want {shape}), "
                               "not finite or not invertible")
    return x.float()
