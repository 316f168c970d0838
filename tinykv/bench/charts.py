"""The benchmarks' charts (matplotlib, an optional extra, on a file-only backend): one panel per
shape, each with its own y axis, so a batch of 64 does not flatten a batch of 1.

- `grouped_bars`: a bar per engine and KV format in each panel, the bar's value printed on it and
  its roofline (the speed if the step read its bytes at the measured bandwidth) drawn as a black
  tick above it;
- `stacked_bars`: a bar per KV format in each panel, stacked by where the step's time goes.

Every number drawn is also in the benchmark's JSON.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from ..plots import save_figure

# Engine families keep their colors across charts: tinykv blue/green, llama.cpp orange/red,
# transformers grey.
_PALETTES = {"tinykv": ["#1f77b4", "#2ca02c", "#17becf", "#9467bd", "#8c564b"],
             "llama.cpp": ["#ff7f0e", "#d62728", "#e377c2"],
             "transformers": ["#7f7f7f", "#bcbd22"]}
PART_COLORS = {"linear": "#1f77b4", "attention": "#ff7f0e", "store": "#2ca02c",
               "rest": "#bbbbbb"}


def _pyplot():
    """matplotlib's pyplot on the Agg backend, or None where matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    return plt


def _colors(names: list[str]) -> dict[str, str]:
    """A color per series, by its engine (the name's first word)."""
    used: dict[str, int] = {}
    out = {}
    for name in names:
        family = name.split()[0]
        palette = _PALETTES.get(family, _PALETTES["transformers"])
        out[name] = palette[used.get(family, 0) % len(palette)]
        used[family] = used.get(family, 0) + 1
    return out


def _panels(plt, n: int, title: str):
    """A row of n panels, at most 4 a row."""
    cols = min(n, 4)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(max(5.0, 3.4 * cols + 0.6), 3.6 * rows + 0.9),
                             squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    return fig, list(axes.flat[:n])


ROOF_LABEL = "roofline: the bar's bytes at the read bandwidth"


def grouped_bars(path: Path, groups: list[str], series: list[tuple[str, list, list]],
                 ylabel: str, title: str, roof_label: str = ROOF_LABEL) -> str | None:
    """A panel per group; in each, a bar per series (name, values, rooflines: black ticks that
    the legend calls roof_label), a value of None drawn as 'not measured'. Returns the PNG's
    path, None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    colors = _colors([name for name, _, _ in series])
    fig, axes = _panels(plt, len(groups), title)
    for g, (ax, group) in enumerate(zip(axes, groups)):
        tops = []
        for i, (name, values, roofs) in enumerate(series):
            value, roof = values[g], roofs[g]
            if value is None:
                ax.text(i, 0, " not measured", ha="center", va="bottom", fontsize=7,
                        rotation=90)
                continue
            ax.bar(i, value, color=colors[name], width=0.8)
            ax.text(i, value, f"{value:.3g}", ha="center", va="bottom", fontsize=6)
            if roof:
                ax.plot([i - 0.4, i + 0.4], [roof, roof], color="black", lw=1.5)
                tops.append(roof)
            tops.append(value)
        ax.set_ylim(0, 1.12 * max(tops or [1]))
        ax.set_xlim(-0.6, len(series) - 0.4)
        ax.set_xticks(range(len(series)), [name for name, _, _ in series], rotation=60,
                      ha="right", fontsize=7)
        ax.set_title(group, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel(ylabel)
    if any(roof for _, _, roofs in series for roof in roofs):
        axes[0].plot([], [], color="black", lw=1.5, label=roof_label)
        fig.legend(loc="lower center", fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    save_figure(fig, path, make_folders=True, dpi=110)
    return str(path)


def stacked_bars(path: Path, groups: list[str], bars: list[list[tuple[str, dict]]],
                 ylabel: str, title: str) -> str | None:
    """A panel per group; bars[g] lists (bar name, {part: value}) stacked in PART_COLORS' order,
    the total printed on top. Returns the PNG's path, None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = _panels(plt, len(groups), title)
    for ax, group, stacks in zip(axes, groups, bars):
        for i, (_, parts) in enumerate(stacks):
            bottom = 0.0
            for part, color in PART_COLORS.items():
                height = parts.get(part, 0.0)
                ax.bar(i, height, bottom=bottom, color=color, width=0.7,
                       label=part if i == 0 else None)
                bottom += height
            ax.text(i, bottom, f"{bottom:.3g}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(stacks)), [name for name, _ in stacks], rotation=30, ha="right",
                      fontsize=7)
        ax.set_ylim(0, 1.15 * max([sum(p.values()) for _, p in stacks] or [1]))
        ax.set_title(group, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel(ylabel)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(PART_COLORS), fontsize=7,
               frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    save_figure(fig, path, make_folders=True, dpi=110)
    return str(path)


def roofline_chart_paths(path: Path, threads: list[int], first: bool = True) -> list[Path]:
    """The PNGs roofline_charts writes for these thread counts, in order: per thread count the
    bars (`path`, then `-2thr` and so on) and the step's parts (`-steps`)."""
    out = []
    for i, n in enumerate(threads):
        suffix = "" if first and i == 0 else f"-{n}thr"
        out += [path.with_name(path.stem + suffix + ".png"),
                path.with_name(path.stem + suffix + "-steps.png")]
    return out


def roofline_charts(results: dict, path: Path, label: Callable[[str], str] = str) -> dict:
    """bench roofline's charts, per thread count: decode tok/s as grouped bars per shape, each
    bar's roofline marked (`path`, then -2thr and so on), and tinykv's step time split into its
    parts (`-steps`); `label` shortens a KV spec for the ticks."""
    made = {}
    for i, run in enumerate(results["runs"]):
        shapes = list(dict.fromkeys((r["batch"], r["context"]) for r in run["decode"]))
        groups = [f"{b} x {c}" for b, c in shapes]
        names = list(dict.fromkeys((r["engine"], r["kv"]) for r in run["decode"]))
        at = {(r["engine"], r["kv"], r["batch"], r["context"]): r for r in run["decode"]}
        series = []
        for engine, kv in names:
            rs = [at.get((engine, kv, b, c)) for b, c in shapes]
            series.append((f"{engine} {label(kv)}",
                           [r and r["tok_s"] for r in rs], [r and r["roofline_tok_s"] for r in rs]))
        title = (f"decode tok/s (all sequences), {run['threads']} thread(s); read bandwidth "
                 f"{run['bandwidth']['gb_s']:.1f} GB/s")
        png_path, steps_path = roofline_chart_paths(path, [run["threads"]], first=i == 0)
        png = grouped_bars(png_path, groups, series, "decode tokens/s", title)
        stacks = [[(label(r["kv"]), r["parts_ms"]) for r in run["decode"]
                   if (r["batch"], r["context"]) == shape and "parts_ms" in r] for shape in shapes]
        steps = stacked_bars(steps_path, groups, stacks, "ms per decode step",
                             "where a tinykv decode step goes, "
                             f"{run['threads']} thread(s)")
        made[f"{run['threads']} threads"] = [png, steps]
    return made
