"""Charts as PNG files, on matplotlib's file-only backend; matplotlib is an optional extra
(`pip install 'tinykv[plot]'`), so a chart asked for without it is a one-line error."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from .outputs import CHART_MARK, written

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
    # PNGs carry tinykv's mark, so that a later run may replace them (outputs.made_by_tinykv)
    marked = {"metadata": dict([CHART_MARK])} if Path(path).suffix.lower() == ".png" else {}
    try:
        with written(path, make_folders) as tmp:
            fig.savefig(tmp, dpi=dpi, **marked)
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
    fig, axes = plt.subplots(2, 1, figsize=(13, 7), sharex=True)
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
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the data
    axes[1].set_xlabel("layer")
    change = 100 * (measured.ppl / measured.ref_ppl - 1)
    fig.suptitle(f"{choice.bits:.2f} bits/element: summed KL {choice.predicted_kl:.4f}, "
                 f"measured {measured.kl:.4f} (perplexity {change:+.2f}%)", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


# ---- the quality chart: bits per element against perplexity and KL ----------------------------
FAMILIES = {  # technique -> colour, in the legend's order
    "float (fp16, fp8)": "tab:gray", "per-token / group scales": "tab:blue",
    "per-channel keys (KIVI)": "tab:purple", "rotated": "tab:orange",
    "rotated + smoothed keys": "tab:green", "per-layer budget (calibrate --bits)": "tab:red"}
MARKERS = {16: "D", 8: "s", 4: "o", 2: "^"}  # by the key format's bits (the most common one)


def family(kv: str) -> str:
    """The technique family a spec's point is coloured by."""
    from .spec import KVSpec  # torch: not at import (the command line checks --plot first)

    spec = KVSpec.parse(kv)
    if spec.per_layer:
        return "per-layer budget (calibrate --bits)"
    if spec.k.dtype in ("fp32", "fp16", "bf16", "fp8"):
        return "float (fp16, fp8)"
    if spec.k.smooth:
        return "rotated + smoothed keys"
    if spec.k.rot or spec.v.rot:
        return "rotated"
    return "per-channel keys (KIVI)" if spec.k.gran == "channel" else "per-token / group scales"


def _key_bits(kv: str) -> int:
    from .spec import KVSpec

    return KVSpec.parse(kv).k.bits


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both x and y (less is better), by x."""
    order = sorted(range(len(points)), key=lambda i: points[i])
    front, best = [], float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def plot_pareto(rows: list[dict], path: str | Path, note: str) -> None:
    """PNG: each spec's bits per element against its perplexity increase (symlog, %) and its
    mean KL (log), one colour per technique family, the frontier drawn, each point numbered and
    the numbers keyed below. rows: bench quality's JSON rows (with `texts`; a row whose KL is
    None is on the perplexity panel only)."""
    plt = pyplot()
    rows = [r for r in rows if r.get("texts")]
    key_lines = (len(rows) + 1) // 2
    fig = plt.figure(figsize=(13, 6.2 + 0.16 * key_lines), dpi=110)
    grid = fig.add_gridspec(2, 2, height_ratios=[6, 0.16 * key_lines + 0.2])
    axes = [fig.add_subplot(grid[0, i]) for i in range(2)]
    x = [r["bits_per_element"] for r in rows]
    change = [100 * (r["texts"][0]["ppl"] / r["texts"][0]["ref_ppl"] - 1) for r in rows]
    with_kl = [i for i, r in enumerate(rows) if r["texts"][0]["kl"] is not None]
    kl = [max(rows[i]["texts"][0]["kl"], 1e-6) for i in with_kl]  # older runs measured no KL
    panels = [(range(len(rows)), change), (with_kl, kl)]  # (which rows, their y)
    for ax, (which, y), goal in zip(axes, panels, (1, 0.01)):
        _pareto_panel(ax, [rows[i] for i in which], [x[i] for i in which], y)
        ax.axhline(goal, color="tab:red", ls=":", lw=1)
    axes[0].set_yscale("symlog", linthresh=1)  # linear within +-1%, logarithmic beyond
    ticks = [t for t in (-1, 0, 0.5, 1, 2, 5, 10, 20, 50, 100, 200) if t <= 2 * max(change)]
    axes[0].set_yticks(ticks, [f"{t:+g}%" if t else "0" for t in ticks])
    axes[0].set_ylim(min(-0.3, 1.2 * min(change)), 1.5 * max(change))
    axes[0].set_ylabel("perplexity over the model's own (uncached fp32)")
    axes[1].set_yscale("log")
    axes[1].set_ylim(min(0.5 * min(kl), 0.005), max(2 * max(kl), 0.02))  # the goal in view
    if len(kl) < len(rows):
        axes[1].set_title("older runs measured perplexity alone: left panel only", fontsize=8)
    axes[1].set_ylabel("mean KL(model || cache) per token, nats")
    _legend_and_key(fig, fig.add_subplot(grid[1, :]), rows, key_lines)
    fig.suptitle(note, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.93))  # room for the title and the legend above
    for ax, (which, y) in zip(axes, panels):  # placed once the layout has settled
        _number_points(fig, ax, [x[i] for i in which], y, [i + 1 for i in which])
    save_figure(fig, path, dpi=110)


def _pareto_panel(ax, rows: list[dict], x: list[float], y: list[float]) -> None:
    """The points, coloured by family and shaped by key bits, and the frontier under them."""
    front = pareto(list(zip(x, y)))
    ax.step([x[i] for i in front], [y[i] for i in front], where="post", color="black",
            alpha=0.35, lw=1.5, zorder=1)
    for i, r in enumerate(rows):
        bits = _key_bits(r["kv"])
        ax.scatter(x[i], y[i], color=FAMILIES[family(r["kv"])], s=55, zorder=3,
                   marker=MARKERS.get(bits, "o"), edgecolors="black", linewidths=0.5)
    ax.set_xscale("log", base=2)
    ticks = [2, 2.5, 3, 4, 5, 6, 8, 12, 16]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlim(1.9, 20)
    ax.set_xlabel("stored bits per element, all in (window and sinks counted)")
    ax.grid(alpha=0.3)


def _legend_and_key(fig, key, rows: list[dict], key_lines: int) -> None:
    """The legend above the panels; below them, each number's spec in two columns."""
    plt = pyplot()
    handles = [plt.Line2D([], [], color=c, marker="o", ls="", label=f) for f, c in
               FAMILIES.items() if any(family(r["kv"]) == f for r in rows)]
    handles += [plt.Line2D([], [], color="black", marker=m, ls="", mfc="none",
                           label=f"{bits}-bit keys") for bits, m in MARKERS.items()]
    handles.append(plt.Line2D([], [], color="black", alpha=0.35, label="frontier"))
    handles.append(plt.Line2D([], [], color="tab:red", ls=":", label="the goals at 3 bits"))
    fig.legend(handles=handles, fontsize=8, loc="upper center", ncol=6,
               bbox_to_anchor=(0.5, 0.965), frameon=False)
    key.axis("off")
    lines = [f"{i + 1:>2}  {_shortened(_labelled(r))}" for i, r in enumerate(rows)]
    for col, chunk in enumerate((lines[:key_lines], lines[key_lines:])):
        key.text(0.5 * col, 1, "\n".join(chunk), va="top", family="monospace", fontsize=7.5,
                 transform=key.transAxes)


def _labelled(row: dict) -> str:
    """A row's spec, led by its scale file's name where the chart has that spec with others."""
    return f"[{row['scales']}] {row['kv']}" if row.get("scales") else row["kv"]


def _shortened(kv: str, width: int = 84) -> str:
    """A spec cut to its half of the key (a per-layer spec runs long; the JSON holds it all)."""
    return kv if len(kv) <= width else kv[:width - 3] + "..."


def _number_points(fig, ax, x: list[float], y: list[float], numbers: list[int]) -> None:
    """Each point's number beside it, where it covers no other number nor point: the first
    free place of 24 around the point (nearest first), in display pixels."""
    fig.canvas.draw()
    dots = [ax.transData.transform((xi, yi)) for xi, yi in zip(x, y)]
    taken = [(px - 6, py - 6, px + 6, py + 6) for px, py in dots]  # (x0, y0, x1, y1)
    places = [(r * dx - (dx < 0) * 0.6, r * dy) for r in (1, 2, 3) for dx, dy in
              ((1, 0.3), (1, -1.3), (-1, 0.3), (-1, -1.3), (0, 1), (0, -2), (1, 1), (-1, 1))]
    for i, (px, py) in enumerate(dots):
        w, h = 7 * len(str(numbers[i])), 11
        for fx, fy in places + [(1, 0.3)]:  # crowded all round: the first place anyway
            dx, dy = 8 * fx - (w if fx < 0 else 0), 8 * fy
            box = (px + dx, py + dy, px + dx + w, py + dy + h)
            if all(box[2] < t[0] or box[0] > t[2] or box[3] < t[1] or box[1] > t[3]
                   for t in taken):
                break
        taken.append(box)
        ax.annotate(str(numbers[i]), (x[i], y[i]), xytext=(dx, dy), textcoords="offset pixels",
                    fontsize=7.5)
