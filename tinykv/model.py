"""Full definition of the tinykv decoder, all of it in this single file.

Two families share one Transformer: the Llama family (llama, mistral, qwen2: RMSNorm, RoPE,
SwiGLU) and the GPT-2 family (gpt2, gpt_bigcode: LayerNorm, learned positions, GELU). Multi-head,
multi-query and grouped-query attention all come from one number, `n_kv_heads`.

`Transformer.forward(tokens, plan=None)` runs plain causal attention over a (B, T) batch: the
reference every cached path is tested against. With a `plan` the tokens are a packed 1-D stream
of several sequences, and each layer hands its keys and values to the plan, which stores them and
attends (`KVStep` below: the whole contract between the model and any cache).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from .checkpoint import ModelError, convert_hf_state_dict, load_safetensors
from .kernels.layout import onto_huge_pages
from .modelfiles import Fields

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
GPT2_FAMILY = ("gpt2", "gpt_bigcode")


class KVStep(Protocol):
    """The model-cache protocol: what `Transformer.forward(tokens, plan)` needs from one step.
    The tokens are a packed stream of N tokens from one or more sequences. `cache.Plan` implements
    it over the paged cache, `calibrate.Recorder` by recording and attending plainly."""

    positions: torch.Tensor  # (N,) absolute position of each token (RoPE, learned positions)
    logits_idx: torch.Tensor | None  # rows whose logits are returned; None: all N

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this step's k, v (N, n_kv_heads, hd) of `layer`, then attend q (N, n_heads, hd)
        causally over every key and value the tokens' sequences hold: returns o (N, n_heads, hd)."""
        ...


@dataclass
class Config:
    """The decoder's shape and options; `from_hf` maps a checkpoint's config.json onto it."""

    model_type: str = "llama"
    vocab_size: int = 32000
    dim: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 8
    head_dim: int = 0  # 0: dim // n_heads
    ffn_dim: int = 1376
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    gelu_tanh: bool = True  # GPT-2's "gelu_new" is the tanh approximation
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.model_type not in LLAMA_FAMILY + GPT2_FAMILY:
            raise ModelError(f"unsupported architecture '{self.model_type}' "
                             f"(supported: {', '.join(LLAMA_FAMILY + GPT2_FAMILY)})")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                     "max_seq_len", "head_dim"):
            if name == "head_dim":  # derived from the sizes checked before it
                self.head_dim = self.head_dim or self.dim // self.n_heads
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelError(f"config: {name} = {value!r} must be a positive integer")
        if self.n_heads % self.n_kv_heads:
            raise ModelError(f"{self.n_heads} heads do not share {self.n_kv_heads} KV heads evenly")
        self.n_rep = self.n_heads // self.n_kv_heads
        self.gpt2_style = self.model_type in GPT2_FAMILY

    @classmethod
    def from_hf(cls, f: Fields) -> Config:
        """config.json's fields (each type-checked) onto Config: the one place HF names appear."""
        mt, eos, bos = f.str("model_type", ""), f.ids("eos_token_id"), f.int("bos_token_id", None)
        if mt in GPT2_FAMILY:
            dim, n_heads = f.int("n_embd"), f.int("n_head")
            act = f.str("activation_function", "gelu_new")
            if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
                raise ModelError(f"unsupported activation '{act}'")
            if f.bool("scale_attn_by_inverse_layer_idx", False) or \
                    not f.bool("scale_attn_weights", True):
                raise ModelError("unsupported attention scaling in config.json")
            return cls(model_type=mt, vocab_size=f.int("vocab_size"), dim=dim,
                       n_layers=f.int("n_layer"), n_heads=n_heads,
                       n_kv_heads=1 if f.bool("multi_query", False) else n_heads,
                       ffn_dim=f.int("n_inner", 4 * dim), max_seq_len=f.int("n_positions", 1024),
                       norm_eps=f.float("layer_norm_epsilon", 1e-5, positive=True),
                       tie_embeddings=True, qkv_bias=True, o_bias=True, mlp_bias=True,
                       gelu_tanh=act != "gelu", bos_token_id=bos, eos_token_id=eos)
        if mt not in LLAMA_FAMILY:
            raise ModelError(f"unsupported architecture '{mt or '?'}' "
                             f"(supported: {', '.join(LLAMA_FAMILY + GPT2_FAMILY)})")
        if f.str("hidden_act", "silu") != "silu":
            raise ModelError(f"unsupported activation '{f.str('hidden_act')}'")
        rope = f.section("rope_parameters") or f.section("rope_scaling") or Fields("", {})
        rtype = rope.str("rope_type", rope.str("type", "default"))
        if rtype not in ("default", "llama3"):
            raise ModelError(f"unsupported rope_scaling type '{rtype}'")
        attn_bias, n_heads = f.bool("attention_bias", False), f.int("num_attention_heads")
        return cls(model_type=mt, vocab_size=f.int("vocab_size"), dim=f.int("hidden_size"),
                   n_layers=f.int("num_hidden_layers"), n_heads=n_heads,
                   n_kv_heads=f.int("num_key_value_heads", 0) or n_heads,
                   head_dim=f.int("head_dim", 0, lo=1), ffn_dim=f.int("intermediate_size"),
                   norm_eps=f.float("rms_norm_eps", 1e-6, positive=True),
                   rope_theta=f.float("rope_theta", rope.float("rope_theta", 10000.0, True), True),
                   rope_scaling=rope.llama3_scaling() if rtype == "llama3" else None,
                   max_seq_len=f.int("max_position_embeddings", 2048),
                   tie_embeddings=f.bool("tie_word_embeddings", False),
                   qkv_bias=attn_bias or mt == "qwen2", o_bias=attn_bias,
                   mlp_bias=f.bool("mlp_bias", False), bos_token_id=bos, eos_token_id=eos)


def rope_tables(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (max_seq_len, head_dim), in float32, rotate-half layout; sin's first half is
    negated, so that rotating half the channels is a roll (apply_rope)."""
    even = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64)  # (hd / 2,)
    inv_freq = 1.0 / cfg.rope_theta ** (even / cfg.head_dim)
    if cfg.rope_scaling:
        # llama3: long wavelengths slowed by `factor`, short ones kept, smooth in between
        s = cfg.rope_scaling
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / lo, inv_freq / factor,
                               torch.where(wavelen < old_len / hi, inv_freq, mid))
    t = torch.arange(cfg.max_seq_len, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)  # (max_seq_len, hd / 2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (max_seq_len, hd)
    sign = torch.cat([-torch.ones_like(freqs), torch.ones_like(freqs)], -1)
    return emb.cos().float(), (emb.sin() * sign).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x (..., n, hd); cos/sin (..., 1, hd) in x's dtype. With rope_tables' signed sin: x * cos +
    # rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1) (Llama), in three ops (each a fixed cost).
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm=None,
                 residual: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
    """A linear layer with what surrounds it in a block: norm(x) W^T + b, then silu(gate) * up over
    the two halves of the outputs (swiglu), then + residual. One pass in the CPU's decode GEMV."""
    y = F.linear(x if norm is None else norm(x), weight, bias)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else residual + y


class Linear(nn.Linear):
    """nn.Linear through the product chosen at load (use_kernels): fused_linear or gemv's."""
    product: Callable = staticmethod(fused_linear)  # fused_linear's contract
    def forward(self, x: torch.Tensor, norm: nn.Module | None = None,
                residual: torch.Tensor | None = None, swiglu: bool = False) -> torch.Tensor:
        return self.product(x, self.weight, self.bias, norm, residual, swiglu)


def project_qkv(attn: Attention, x: torch.Tensor, norm: nn.Module, cos: torch.Tensor | None,
                sin: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's attention inputs: norm(x) Wqkv^T + b, as q and k heads (..., n_heads + n_kv_heads,
    hd), rotated when cos is given, and v (..., n_kv_heads, hd). One call in the CPU's decode."""
    qkv = attn.wqkv(x, norm=norm)  # split by views (split_with_sizes, view: one op each)
    qk, v = qkv.split_with_sizes([attn.q_size + attn.kv_size, attn.kv_size], dim=-1)
    qk = qk.view(*x.shape[:-1], -1, attn.cfg.head_dim)  # q, k rotate in one go
    qk = qk if cos is None else attn.rope(qk, cos, sin)
    return qk, v.view(*x.shape[:-1], -1, attn.cfg.head_dim)


def run_layers(model: Transformer, x: torch.Tensor, cos: torch.Tensor | None,
               sin: torch.Tensor | None, plan: KVStep | None) -> torch.Tensor:
    """The blocks in turn: x (..., dim) -> (..., dim). One call for a CPU decode step."""
    for block in model.layers:
        x = block(x, cos, sin, plan)
    return x


def finish_layer(block: Block, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A layer after its attention o (..., q_size): h = x + o Wo^T + b, then h + mlp(norm2(h)).
    One call in the CPU's decode."""
    h = block.attn.wo(o, residual=x)
    return block.mlp(h, block.norm2)


# The functions a model runs through unless use_kernels is given others (gemv_layer.py's)
REFERENCES = {"product": fused_linear, "rope": apply_rope, "project": project_qkv,
              "finish": finish_layer, "layers": run_layers}


class Attention(nn.Module):
    """Fused q/k/v projection and RoPE (`project`, chosen at load), attention (through the plan's
    cache, or plain causal); the output projection is in Block's `finish`."""
    rope: Callable = staticmethod(apply_rope)  # chosen when the model loads, like Linear.product
    project: Callable = staticmethod(project_qkv)  # likewise: project_qkv's contract

    def __init__(self, cfg: Config, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.q_size, self.kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.wqkv = Linear(cfg.dim, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.wo = Linear(self.q_size, cfg.dim, bias=cfg.o_bias)

    def forward(self, x: torch.Tensor, norm: nn.Module, cos: torch.Tensor | None,
                sin: torch.Tensor | None, plan: KVStep | None = None) -> torch.Tensor:
        """x (B, T, dim), or (N, dim) packed with a plan -> attention(norm(x)) before wo, (...,
        q_size)."""
        cfg, lead = self.cfg, x.shape[:-1]
        qk, v = self.project(self, x, norm, cos, sin)
        q, k = qk.split_with_sizes([cfg.n_heads, cfg.n_kv_heads], dim=-2)
        if plan is not None:  # packed (N, heads, hd): the cache stores and serves K/V
            o = plan.attend(self.layer, q, k, v)  # (N, n_heads, hd)
        else:  # reference: plain causal attention over (B, T)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, hd)
            k, v = (t.repeat_interleave(cfg.n_rep, dim=1) for t in (k, v))  # GQA: heads shared
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return o.reshape(*lead, self.q_size)


class MLP(nn.Module):
    """SwiGLU (Llama family) or GELU (GPT-2 family) feed-forward."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.gpt2_style, self.gelu = cfg.gpt2_style, "tanh" if cfg.gelu_tanh else "none"
        n_in = cfg.ffn_dim if cfg.gpt2_style else 2 * cfg.ffn_dim  # llama: gate and up fused
        self.w_in = Linear(cfg.dim, n_in, bias=cfg.mlp_bias)
        self.w_out = Linear(cfg.ffn_dim, cfg.dim, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        if self.gpt2_style:  # x + mlp(norm(x)): the norm, activation and residual in the products
            return self.w_out(F.gelu(self.w_in(x, norm=norm), approximate=self.gelu), residual=x)
        return self.w_out(self.w_in(x, norm=norm, swiglu=True), residual=x)


def make_norm(cfg: Config) -> nn.Module:
    """LayerNorm for the GPT-2 family, RMSNorm for the Llama family."""
    norm = nn.LayerNorm if cfg.gpt2_style else nn.RMSNorm
    return norm(cfg.dim, eps=cfg.norm_eps)


class Block(nn.Module):
    """One pre-norm residual layer: attention, then the MLP."""
    finish: Callable = staticmethod(finish_layer)  # chosen at load, like Linear.product

    def __init__(self, cfg: Config, layer: int):
        super().__init__()
        self.norm1, self.attn = make_norm(cfg), Attention(cfg, layer)
        self.norm2, self.mlp = make_norm(cfg), MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                plan: KVStep | None = None) -> torch.Tensor:
        o = self.attn(x, self.norm1, cos, sin, plan)  # attention(norm1(x)) before wo
        return self.finish(self, o, x)  # h = x + wo(o), then h + mlp(norm2(h))


class Transformer(nn.Module):
    """The decoder: embeddings, the blocks, the final norm and the LM head."""
    layers_fn: Callable = staticmethod(run_layers)  # chosen at load, like Linear.product

    def __init__(self, cfg: Config, init: bool = True):
        """init=False: the weights are left as torch.empty made them, for a checkpoint to replace,
        and no RoPE tables are made (from_pretrained builds on the meta device, where torch's
        normal_ and arange import torch._dynamo, a slow import no command needs)."""
        super().__init__()
        self.cfg = cfg

        def embedding(rows: int) -> nn.Embedding:
            if init:
                return nn.Embedding(rows, cfg.dim)
            return nn.Embedding(rows, cfg.dim, _weight=torch.empty(rows, cfg.dim))
        self.embed = embedding(cfg.vocab_size)
        self.pos_embed = embedding(cfg.max_seq_len) if cfg.gpt2_style else None
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        self.lm_head = Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        if not cfg.gpt2_style:  # without init, the caller computes them off the meta device
            cos, sin = rope_tables(cfg) if init else (None, None)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def use_kernels(self, product: Callable = fused_linear, rope: Callable = apply_rope,
                    project: Callable = project_qkv, finish: Callable = finish_layer,
                    layers: Callable = run_layers) -> None:
        """From now on: linear layers through `product` (norms fused in), RoPE through `rope`, a
        layer's q/k/v through `project` and its part after attention through `finish`, the
        blocks through `layers`."""
        self.layers_fn = layers
        for m in self.modules():
            if isinstance(m, Linear):
                m.product = product
            elif isinstance(m, Attention):
                m.rope, m.project = rope, project
            elif isinstance(m, Block):
                m.finish = finish

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, plan: KVStep | None = None) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V) without a plan; packed (N,) -> logits
        (len(plan.logits_idx), V), or (N, V) when plan.logits_idx is None."""
        positions = (plan.positions if plan is not None  # (N,), or (T,) for a (B, T) batch
                     else torch.arange(tokens.shape[-1], device=tokens.device))
        if positions.numel() and int(positions.max()) >= self.cfg.max_seq_len:
            raise ModelError("sequence longer than the model's context "
                             f"({self.cfg.max_seq_len} tokens)")
        x = self.embed(tokens)
        cos = sin = None
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        else:  # (..., T, 1, hd) broadcasts over heads
            cos = self.rope_cos[positions].unsqueeze(-2).to(x.dtype)
            sin = self.rope_sin[positions].unsqueeze(-2).to(x.dtype)
        x = self.layers_fn(self, x, cos, sin, plan)
        if plan is not None and plan.logits_idx is not None:
            x = x[plan.logits_idx]  # only the rows we sample from: the vocab matmul is costly
        return self.lm_head(x, norm=self.norm).float()

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device | None = None,
                        dtype: torch.dtype | None = None) -> Transformer:
        """Load config.json + *.safetensors (single file or sharded) from a directory."""
        path = Path(path)
        if not path.is_dir():
            raise ModelError(f"weights directory not found: {path}")
        try:
            cfg = Config.from_hf(Fields.load(path / "config.json", required=True))
        except ModelError as e:
            raise ModelError(f"{path / 'config.json'}: {e}") from None
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        hf = load_safetensors(path)
        with torch.device("meta"):
            model = cls(cfg, init=False)
        try:
            sd = convert_hf_state_dict(cfg, hf)
        except RuntimeError as e:  # torch.cat of tensors whose shapes disagree
            raise ModelError(f"checkpoint in {path} does not match its config.json: "
                             f"{str(e).splitlines()[0]}") from None
        expected = dict(model.named_parameters())
        for name, t in sd.items():
            if name in expected and tuple(t.shape) != tuple(expected[name].shape):
                raise ModelError(f"checkpoint in {path}: tensor {name} has shape {tuple(t.shape)}, "
                                 f"config.json implies {tuple(expected[name].shape)}")
        model.load_state_dict(sd, strict=False, assign=True)
        if cfg.tie_embeddings:
            model.lm_head.weight = model.embed.weight
        missing = [name for name, param in model.named_parameters() if param.is_meta]
        if missing:
            raise ModelError(f"checkpoint in {path} lacks tensors for: {', '.join(missing[:3])}")
        if not cfg.gpt2_style:
            model.rope_cos, model.rope_sin = rope_tables(cfg)
        model = model.to(device=device, dtype=dtype).eval()
        if device.type == "cpu":  # safetensors leaves tensors at their file offsets, mid-line
            onto_huge_pages(list(model.parameters()))
        from .gemv_layer import select_kernels  # numba loads with a model, not here
        model.use_kernels(**select_kernels(device, REFERENCES))  # chosen once
        return model
