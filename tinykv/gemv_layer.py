"""A Llama decode layer's linear parts in two compiled calls on the CPU, for a few float32 rows.

gemv.py makes each linear layer one call (its norm before, SwiGLU and residual after). A layer
still took four such calls plus RoPE, and each call pays a fixed cost in Python (arguments turned
into arrays, the dispatcher, the output wrapped), made dearer because every call's weights have
just swept the caches the interpreter runs from. Here the attention's inputs and everything after
the attention are one call each, with the weights' arrays looked up once:

    project  (model.project_qkv):  norm1, x Wqkv^T + b, RoPE of q and k     -> q|k heads, v
    finish   (model.finish_layer): h = x + o Wo^T + b; h + down(silu(gate) * up)(norm2(h))

Both run gemv's blocked GEMV (`gemv._block`) and epilogue; the compiled code is the readable
contract's steps in the same order, so only the summation order of each dot product differs.
Anything else (prefill chunks, more rows than the GEMV takes (`gemv.fits`), LayerNorm, half
activations, RoPE-less models) goes to the torch reference the function is given, as
gemv.linear_cpu does. `rope_cpu` is RoPE alone in one pass, for rows the fused calls do not take.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from . import gemv
from .gemv import AVAILABLE, SMALL_BATCH, TILE_BATCH, njit, prange
from .kernels.cpu_numerics import use_threads
from .kernels.layout import empty_rows

# numba's disk cache watches only the file that defines a function: these kernels inline gemv.py
# and its loops' files too, so their key hashes all of them
_SOURCES = hashlib.sha256(b"".join((Path(__file__).parent / name).read_bytes()
                                   for name in ("gemv_layer.py", "gemv.py", "gemv_tiles.py",
                                                "gemv_narrow.py", "gemv_packed.py")))
_SOURCES = f"{_SOURCES.hexdigest()} L1d {gemv.L1_DATA_BYTES}"  # as gemv._SOURCES

if AVAILABLE:
    @njit(cache=True)  # no fastmath: the reference's roundings, x * cos + rotated * sin
    def _rope_rows(x, cos, sin, out):
        """out (N, H, D) = x * cos + roll(x, D / 2) * sin, cos/sin (N, D) per row (apply_rope)."""
        half = x.shape[2] // 2
        for n in range(x.shape[0]):
            for h in range(x.shape[1]):
                for i in range(x.shape[2]):
                    j = i + half if i < half else i - half
                    out[n, h, i] = x[n, h, i] * cos[n, i] + x[n, h, j] * sin[n, i]

    @njit(fastmath=gemv._FASTMATH, inline="always", cache=True)
    def _rope_epilogue(y, bias, cos, sin, out_qk, out_v):
        """out_qk (B, R, hd) = RoPE of y's first R heads (+ bias), as model.apply_rope: y * cos +
        roll(y, hd / 2) * sin per head, cos/sin (B, hd) with sin's first half negated; out_v
        (B, V, hd) = the rest of y (+ bias)."""
        head_dim = out_qk.shape[2]
        half = head_dim // 2
        rotated = out_qk.shape[1] * head_dim  # columns of y that are q and k
        for b in range(y.shape[0]):
            for h in range(out_qk.shape[1]):
                for i in range(head_dim):
                    c = h * head_dim + i
                    partner = c + half if i < half else c - half
                    v, w = y[b, c], y[b, partner]
                    if bias.size:
                        v += bias[c]
                        w += bias[partner]
                    out_qk[b, h, i] = v * cos[b, i] + w * sin[b, i]
            for h in range(out_v.shape[1]):
                for i in range(head_dim):
                    c = rotated + h * head_dim + i
                    out_v[b, h, i] = y[b, c] + bias[c] if bias.size else y[b, c]

    def _project(x, norm_weight, eps, w, bias, cos, sin, out_qk, out_v):
        """out_qk, out_v = the RoPE'd q|k heads and v of norm(x) @ w^T + bias (_rope_epilogue)."""
        x = gemv._normalized(x, norm_weight, eps)
        y = gemv.empty_lines(x.shape[0], gemv.out_rows(w))  # (B, N)
        for block in prange(gemv.blocks(x, w)):
            gemv._block(x, w, y, block)
        _rope_epilogue(y, bias, cos, sin, out_qk, out_v)

    _project_serial, _project_parallel = gemv.serial_and_parallel(_project,
                                                                   ("gemv_layer", _SOURCES))

    def _finish(o, x, wo, bo, norm_weight, eps, w_in, b_in, w_out, b_out, out):
        """out (B, D) = h + (silu(gate) * up) @ w_out^T + b_out, [gate | up] = norm(h) @ w_in^T
        + b_in, h = x + o @ wo^T + bo: the rest of a layer after attention."""
        h = gemv.empty_lines(x.shape[0], x.shape[1])  # (B, D)
        for block in prange(gemv.blocks(o, wo)):
            gemv._block(o, wo, h, block)
        gemv._epilogue(h, bo, x, False, h)
        hn = gemv._normalized(h, norm_weight, eps)
        gate_up = gemv.empty_lines(x.shape[0], gemv.out_rows(w_in))  # (B, 2F)
        for block in prange(gemv.blocks(hn, w_in)):
            gemv._block(hn, w_in, gate_up, block)
        act = gemv.empty_lines(x.shape[0], gemv.in_cols(w_out))  # (B, F)
        gemv._epilogue(gate_up, b_in, x[:0], True, act)
        for block in prange(gemv.blocks(act, w_out)):
            gemv._block(act, w_out, out, block)
        gemv._epilogue(out, b_out, h, False, out)

    _finish_serial, _finish_parallel = gemv.serial_and_parallel(_finish, ("gemv_layer", _SOURCES))


def _rows(x: torch.Tensor) -> bool:
    """Whether x (N, K) is a decode step's rows the fused calls may take: a few contiguous float32
    rows on the CPU (at most TILE_BATCH; SMALL_BATCH unless the weights are float32: _prepared)."""
    return (x.dim() == 2 and 0 < x.shape[0] <= TILE_BATCH and x.dtype == torch.float32
            and x.is_contiguous() and x.is_cpu)


def _prepared(cache: dict, key: nn.Module, norm: nn.Module, params: Callable[[], list | None]):
    """(arrays, eps, most rows) for `key`: its parameters as the kernels read them (weights as
    gemv reads them, biases and norm weights as float32, an empty array for an absent bias), its
    RMSNorm's eps, and the most rows the GEMV takes with those weights (gemv.fits); made on the
    first call and kept while `norm` is the same module and the parameters keep their storage
    (a `.to()` moves them); None when something does not fit the kernels. Parameters replaced by
    new ones (load_state_dict(assign=True)) need `use_kernels` again: a new cache."""
    entry = cache.get(key)
    if entry is not None and entry[0] is norm and _unmoved(entry[1], entry[2]):
        return entry[3]
    tensors = params()
    eps = _rms_eps(norm)
    if eps is None or tensors is None or not all(_fits(t) for t in tensors):
        return None
    arrays = tuple(gemv._NONE_1D if t is None else
                   gemv._weight_array(t) if t.dim() == 2 else t.detach().numpy() for t in tensors)
    present = [t for t in tensors if t is not None]
    float32 = all(t.dtype == torch.float32 for t in present)
    prepared = arrays, eps, TILE_BATCH if float32 else SMALL_BATCH
    cache[key] = (norm, present, [t.data_ptr() for t in present], prepared)
    return prepared


def _unmoved(tensors: list[torch.Tensor], addresses: list[int]) -> bool:
    for t, address in zip(tensors, addresses):
        if t.data_ptr() != address:
            return False
    return True


def _fits(t: torch.Tensor | None) -> bool:
    """Whether the kernels read parameter t as it is: absent, or on the CPU and contiguous, a
    float32 vector (bias, norm weight) or a matrix in a format gemv reads."""
    if t is None:
        return True
    if not (t.is_cpu and t.is_contiguous()):
        return False
    if t.dim() == 1:
        return t.dtype == torch.float32
    return t.dtype in gemv._AS_NUMPY and (t.dtype != torch.float16 or gemv.F16C)


def _rms_eps(norm: nn.Module) -> np.float32 | None:
    """The eps of an RMSNorm with a weight and an eps, else None (LayerNorm: the reference)."""
    if isinstance(norm, nn.RMSNorm) and norm.weight is not None and norm.eps:
        return np.float32(norm.eps)
    return None


def _rope_tables(cache: dict, x: torch.Tensor, cos: torch.Tensor | None,
                 sin: torch.Tensor | None, head_dim: int):
    """cos, sin (N, 1, hd) as (N, hd) arrays, kept for the step's other layers (the same
    tensors); None when they do not fit the kernel (no RoPE, other shapes or dtypes)."""
    tables = cache.get("rope")
    if tables is not None and tables[0] is cos and tables[1] is sin:
        return tables[2:] if tables[2].shape[0] == x.shape[0] else None
    if cos is None or cos.shape != (x.shape[0], 1, head_dim) or sin.shape != cos.shape \
            or not all(t.dtype == torch.float32 and t.is_contiguous() and t.is_cpu
                       for t in (cos, sin)):
        return None
    tables = cache["rope"] = (cos, sin, cos.view(x.shape[0], head_dim).numpy(),
                              sin.view(x.shape[0], head_dim).numpy())
    return tables[2:]


def project_cpu(attn, x: torch.Tensor, norm: nn.Module, cos: torch.Tensor | None,
                sin: torch.Tensor | None, *, cache: dict,
                reference: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """model.project_qkv's contract in one compiled call for a decode step's rows (N, dim) with
    RoPE and an RMSNorm: returns q|k heads (N, n_heads + n_kv_heads, hd) rotated, v (N, n_kv, hd);
    `reference` for anything else."""
    cfg = attn.cfg
    tables = _rope_tables(cache, x, cos, sin, cfg.head_dim) if _rows(x) else None
    prepared = tables and _prepared(cache, attn, norm, lambda: [norm.weight, attn.wqkv.weight,
                                                                attn.wqkv.bias])
    if not prepared or x.shape[0] > prepared[2]:
        return reference(attn, x, norm, cos, sin)
    (norm_weight, w, bias), eps, _ = prepared
    rows = x.shape[0]
    out_qk = empty_rows((rows, cfg.n_heads + cfg.n_kv_heads, cfg.head_dim))
    out_v = empty_rows((rows, cfg.n_kv_heads, cfg.head_dim))
    threads = gemv._threads()
    if threads > 1:
        use_threads(threads)
    run = _project_parallel if threads > 1 else _project_serial
    run(x.numpy(), norm_weight, eps, w, bias, tables[0], tables[1], out_qk, out_v)
    return torch.from_numpy(out_qk), torch.from_numpy(out_v)


def finish_cpu(block, o: torch.Tensor, x: torch.Tensor, *, cache: dict,
               reference: Callable) -> torch.Tensor:
    """model.finish_layer's contract in one compiled call for a decode step's rows of a SwiGLU
    layer with an RMSNorm: o (N, q_size), x (N, dim) -> (N, dim); `reference` for anything
    else."""
    prepared = None
    if _rows(x) and _rows(o) and o.shape[0] == x.shape[0]:
        prepared = _prepared(cache, block, block.norm2, lambda: _finish_params(block))
    if not prepared or x.shape[0] > prepared[2]:
        return reference(block, o, x)
    (w_o, b_o, norm_weight, w_in, b_in, w_out, b_out), eps, _ = prepared
    out = empty_rows((x.shape[0], x.shape[1]))  # (N, dim)
    threads = gemv._threads()
    if threads > 1:
        use_threads(threads)
    run = _finish_parallel if threads > 1 else _finish_serial
    run(o.numpy(), x.numpy(), w_o, b_o, norm_weight, eps, w_in, b_in, w_out, b_out, out)
    return torch.from_numpy(out)


# The compiled calls layers_cpu makes per layer beside the cache's, by name (module globals,
# looked up at each step, so bench profile's timers can stand in for them).
LAYER_CALLS = ("_project_serial", "_finish_serial", "_project_parallel", "_finish_parallel")


def layers_cpu(model, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
               plan, *, cache: dict, reference: Callable) -> torch.Tensor:
    """model.run_layers' contract for a decode step, with numpy between the compiled calls:
    each layer's project, the cache's store and attention (the plan's `direct` calls:
    kernels.cpu_direct), finish; the same kernels on the same arrays and threads as the
    per-layer path, with no torch op between them. `reference` for anything else: other caches
    or steps (Plan.direct is None), rows or layers the fused calls do not take."""
    cfg = model.cfg
    direct = getattr(plan, "direct", None)  # calibrate's Recorder attends in torch
    if direct is None or not _rows(x):
        return reference(model, x, cos, sin, plan)
    tables = _rope_tables(cache, x, cos, sin, cfg.head_dim)
    layers = [_layer_arrays(cache, block, x.shape[0]) for block in model.layers] if tables \
        else [None]
    attend = all(layers) and direct()
    if not attend:
        return reference(model, x, cos, sin, plan)
    rows, Hq = x.shape[0], cfg.n_heads
    x_rows = x.numpy()  # (N, dim)
    # one set of arrays for every layer (an np.empty between two layers' weight reads runs with
    # cold caches); the layer's output alternates between two, as finish reads its input
    qk = empty_rows((rows, Hq + cfg.n_kv_heads, cfg.head_dim))  # q|k heads
    v = empty_rows((rows, cfg.n_kv_heads, cfg.head_dim))
    outs = (empty_rows(x_rows.shape), empty_rows(x_rows.shape))  # (N, dim) each
    q_heads, k_heads = qk[:, :Hq], qk[:, Hq:]  # views, made once: (N, Hq, hd), (N, n_kv, hd)
    threads = gemv._threads()
    project, finish_layer = _project_serial, _finish_serial
    if threads > 1:
        use_threads(threads)
        project, finish_layer = _project_parallel, _finish_parallel
    for layer, (((norm1, w_qkv, b_qkv), eps1, _), (finish, eps2, _)) in enumerate(layers):
        w_o, b_o, norm2, w_in, b_in, w_out, b_out = finish
        project(x_rows, norm1, eps1, w_qkv, b_qkv, tables[0], tables[1], qk, v)
        o = attend(layer, q_heads, k_heads, v)  # (N, Hq * hd)
        out = outs[layer % 2]
        finish_layer(o, x_rows, w_o, b_o, norm2, eps2, w_in, b_in, w_out, b_out, out)
        x_rows = out
    return torch.from_numpy(x_rows)


def _layer_arrays(cache: dict, block, rows: int) -> tuple | None:
    """A block's (project, finish) arrays as _prepared keeps them, or None where a fused call
    does not take the block or this many rows."""
    project = _prepared(cache, block.attn, block.norm1, lambda: [
        block.norm1.weight, block.attn.wqkv.weight, block.attn.wqkv.bias])
    finish = _prepared(cache, block, block.norm2, lambda: _finish_params(block))
    if not project or not finish or rows > min(project[2], finish[2]):
        return None
    return project, finish


def _finish_params(block) -> list | None:
    """The parameters finish_cpu reads, in its kernel's order; None for a GELU MLP."""
    wo, mlp = block.attn.wo, block.mlp
    if mlp.gpt2_style:
        return None
    return [wo.weight, wo.bias, block.norm2.weight, mlp.w_in.weight, mlp.w_in.bias,
            mlp.w_out.weight, mlp.w_out.bias]


def rope_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
             reference: Callable) -> torch.Tensor:
    """`reference`'s contract (model.apply_rope): x (N, H, D) with cos/sin (N, 1, D) in one
    kernel call for float32 rows; other shapes and dtypes through `reference`."""
    if (x.dim() != 3 or x.dtype != torch.float32 or x.stride(-1) != 1 or x.device.type != "cpu"
            or cos.shape != (x.shape[0], 1, x.shape[2]) or not gemv._float32_rows(cos)
            or not gemv._float32_rows(sin) or sin.shape != cos.shape):
        return reference(x, cos, sin)
    out = empty_rows(x.shape)  # (N, H, D)
    _rope_rows(x.numpy(), cos.view(x.shape[0], -1).numpy(), sin.view(x.shape[0], -1).numpy(),
               out)
    return torch.from_numpy(out)


def select_kernels(device: torch.device | str, references: dict[str, Callable]) -> dict:
    """The model's functions for `device` (use_kernels' arguments), chosen once, when it loads:
    on the CPU with numba the kernels of gemv.py and of this module, each falling back to its
    reference (model.REFERENCES: product fused_linear, rope apply_rope, project project_qkv,
    finish finish_layer, layers run_layers); elsewhere the references."""
    if not (torch.device(device).type == "cpu" and AVAILABLE):
        return dict(references)
    return {"product": partial(gemv.linear_cpu, reference=references["product"]),
            "rope": partial(rope_cpu, reference=references["rope"]),
            "project": partial(project_cpu, cache={}, reference=references["project"]),
            "finish": partial(finish_cpu, cache={}, reference=references["finish"]),
            "layers": partial(layers_cpu, cache={}, reference=references["layers"])}
