"""Charts as PNG files, on matplotlib's file-only backend; matplotlib is an optional extra
(`pip install 'tinykv[plot]'`), so a chart asked for without it is a one-line error."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from .outputs import written

if TYPE_CHECKING:
    import torch


class PlotError(ValueError):
    """A chart was asked for and matplotlib is missing."""


def pyplot() -> ModuleType:
    """matplotlib.pyplot on a file-only backend; a clear error when the optional extra is
    missing."""
    try:
        import matplotlib
    except ImportError:
        raise PlotError("--plot needs matplotlib: pip install 'tinykv[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def check_figure_path(name: str, path: str | Path) -> None:
    """Before the slow part: matplotlib is there and writes the format `path` names (its suffix;
    none is PNG)."""
    pyplot()
    from matplotlib.backend_bases import FigureCanvasBase

    fmt = Path(path).suffix.lstrip(".").lower()
    known = FigureCanvasBase.get_supported_filetypes()
    if fmt and fmt not in known:
        raise PlotError(f"{name} {path}: a chart is written as {', '.join(sorted(known))}, not "
                        f"{fmt!r}")


def save_figure(fig, path: str | Path, make_folders: bool = False, dpi: int = 100) -> None:
    """Write a figure to `path` whole (outputs.written) and close it."""
    try:
        with written(path, make_folders) as tmp:
            fig.savefig(tmp, dpi=dpi)
    finally:
        pyplot().close(fig)


def plot_channels(k: torch.Tensor, v: torch.Tensor, path: str | Path, n_layers: int = 4) -> None:
    """PNG of per-channel absmax of keys and values (L, H, T, D) for a few layers: key outlier
    channels (a few channels far above the rest) are why per-channel key scales beat per-token
    ones."""
    plt, L = pyplot(), k.shape[0]
    layers = sorted({round(i * (L - 1) / max(n_layers - 1, 1)) for i in range(n_layers)})
    fig, axes = plt.subplots(2, len(layers), figsize=(4 * len(layers), 6), squeeze=False)
    for col, layer in enumerate(layers):
        for row, (name, x) in enumerate((("keys", k), ("values", v))):
            amax = x[layer].abs().amax(1).flatten()  # (H * D,): channel c of head h at h * D + c
            ax = axes[row][col]
            ax.bar(range(amax.numel()), amax.numpy(), width=1.0)
            ax.set(title=f"layer {layer} {name}", xlabel="head * head_dim + channel",
                   ylabel="absmax")
    fig.tight_layout()
    save_figure(fig, path)


def plot_budget(choice, measured, path: str | Path) -> None:
    """PNG of `budget.choose`'s choice: per layer, the KL of every candidate (lines) and the one
    chosen (a ring), keys above, values below; `measured` is the spec's end-to-end EvalResult."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    n_layers = 1 + max(s.layer for s in choice.sens)
    for ax, which, name in zip(axes, "kv", ("keys", "values")):
        parts = sorted({s.part for s in choice.sens if s.which == which},
                       key=lambda p: next(s.bits for s in choice.sens if s.part == p))
        for p in parts:
            rows = sorted((s for s in choice.sens if (s.which, s.part) == (which, p)),
                          key=lambda s: s.layer)
            bits = rows[0].bits
            ax.plot([s.layer for s in rows], [max(s.kl, 1e-7) for s in rows], marker=".",
                    label=f"{p} ({bits:.2f} bits)")
        picked = [choice.chosen[(layer, which)] for layer in range(n_layers)]
        ax.scatter(range(n_layers), [max(s.kl, 1e-7) for s in picked], s=90,
                   facecolors="none", edgecolors="black", linewidths=1.5, label="chosen")
        ax.set(yscale="log", ylabel=f"KL when only its {name} are lowered (nats)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    axes[1].set_xlabel("layer")
    change = 100 * (measured.ppl / measured.ref_ppl - 1)
    fig.suptitle(f"{choice.bits:.2f} bits/element: summed KL {choice.predicted_kl:.4f}, "
                 f"measured {measured.kl:.4f} (perplexity {change:+.2f}%)", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
