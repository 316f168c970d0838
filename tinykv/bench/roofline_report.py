"""What `bench roofline` reports from its measurements (roofline.py): the tok/s ratios per shape,
each with the ratio the bytes allow, and the tables it prints and the README quotes."""

from __future__ import annotations

import dataclasses

from ..spec import KVSpec, SpecError
from . import attention
from .common import md_table
from .e2e import KIVI

PARTS = ["linear", "attention", "store", "rest"]  # a decode step's breakdown
# tok/s ratios reported per shape: (name, numerator (engine, kv), denominator (engine, kv))
RATIOS = [("int8/fp16", ("tinykv", "int8"), ("tinykv", "fp16")),
          ("int4/fp16", ("tinykv", "int4"), ("tinykv", "fp16")),
          ("KIVI/fp16", ("tinykv", KIVI), ("tinykv", "fp16")),
          ("fp16/hf", ("tinykv", "fp16"), ("transformers", "default")),
          ("int4/hf-int4", ("tinykv", "int4"), ("transformers", "quanto-int4"))]
BYTES = " bytes"  # a ratio's name + this: the ratio the two steps' bytes allow


def ratios(rows: list[dict]) -> list[dict]:
    """Per shape, the tok/s ratios of RATIOS whose two engines were measured; beside each of two
    tinykv specs, name + BYTES: the inverse ratio of the bytes a step reads (weights and KV),
    the tok/s ratio the two would have at the same share of their rooflines."""
    out = []
    for batch, context in dict.fromkeys((r["batch"], r["context"]) for r in rows):
        here = {(r["engine"], r["kv"]): r for r in rows
                if (r["batch"], r["context"]) == (batch, context)}
        speed = {key: r["tok_s"] for key, r in here.items()}
        row = {"batch": batch, "context": context}
        for name, num, den in RATIOS:
            if num in speed and den in speed:
                row[name] = speed[num] / speed[den]
            if num in here and den in here and num[0] == den[0] == "tinykv":
                step_bytes = [here[k]["weight_bytes"] + here[k]["kv_bytes"] for k in (den, num)]
                row[name + BYTES] = step_bytes[0] / step_bytes[1]
        for (engine, kv), tok_s in speed.items():
            base = unevicted(kv) if engine == "tinykv" else None
            if base is not None and ("tinykv", base) in speed:
                row[f"{kv} / {base}"] = tok_s / speed[("tinykv", base)]
        out.append(row)
    return out


def unevicted(kv: str) -> str | None:
    """The spec an evicting spec is timed against: itself without evict= and its sinks (which
    only eviction needs); None for a spec that does not evict."""
    spec = KVSpec.parse(kv)
    if not spec.evict:
        return None
    return str(dataclasses.replace(spec, evict="", budget=0, sink=0))


def _parts(row: dict) -> str:
    """A step's breakdown as 'linear / attention / store / rest' ms, '-' where not measured."""
    parts = row.get("parts_ms")
    return " / ".join(f"{parts[k]:.3g}" for k in PARTS) if parts else "-"


def _linear_rate(row: dict) -> str:
    """The linear layers' 'GFMA/s (% of the FMA peak)', '-' where not measured."""
    if "linear_gfma_s" not in row:
        return "-"
    return f"{row['linear_gfma_s']:.3g} ({row['linear_pct_fma_peak']:.3g}%)"


BYTES_NOTE = ("In brackets: the ratio the bytes allow, fp16's bytes a step (weights and KV) over "
              "the spec's: the tok/s ratio at the same share of the roofline.")


def _ratio(row: dict, name: str) -> str:
    """A ratio cell: '1.22x', with the bytes' ratio beside it where there is one."""
    if name not in row:
        return "-"
    by_bytes = row.get(name + BYTES)
    return f"{row[name]:.2f}x" + (f" (bytes {by_bytes:.2f}x)" if by_bytes else "")


def render(results: dict) -> str:
    """The README section: per thread count, the bandwidth line and the attention, roofline and
    ratio tables."""
    packed = results["config"].get("packed_weights", 0)
    how = f", {packed} matrices of them packed (4- or 8-bit codes)" if packed else ""
    out = ["## Roofline", "", f"`{results.get('command', 'bench roofline')}`; weights read per "
           f"step: {results['weight_bytes'] / 1e6:.0f} MB{how}.", ""]
    for run in results["runs"]:
        bw = run["bandwidth"]
        out += [f"### {run['threads']} thread(s)", "",
                f"Read bandwidth {bw['gb_s']:.1f} GB/s, the best of torch's GEMV "
                f"{bw['gemv_gb_s']:.1f}, tinykv's {bw.get('tinykv_gemv_gb_s', 0):.1f} and a sum "
                f"{bw['sum_gb_s']:.1f}, over {bw['bytes'] / 2**20:.0f} MiB; FMA peak "
                f"{run.get('fma_peak_gfma_s', 0):.0f} GFMA/s (float32, a loop per thread).", ""]
        if run.get("kernel"):
            out += ["One layer call of the CPU attention kernel beside the touch of its exact "
                    "layout (bench/attention.py).", "", attention.render(run["kernel"]), ""]
        attn = [[f"`{r['kv']}`", r["context"], f"{r['kv_bytes'] / 1e6:.3g}", f"{r['ms']:.3g}",
                 f"{r['gb_s']:.3g}", f"{r['pct_bandwidth']:.3g}%"] for r in run["attention"]]
        out += md_table(["KV spec", "context", "KV MB", "attend ms", "GB/s", "% bandwidth"], attn)
        dec = [[f"{r['engine']} `{r['kv']}`", f"{r['batch']}x{r['context']}",
                f"{r['kv_bytes'] / 1e6:.3g}", f"{r['ms']:.3g}", f"{r['tok_s']:.3g}",
                f"{r['pct_roofline']:.3g}%", _parts(r), _linear_rate(r)] for r in run["decode"]]
        out += [""] + md_table(["engine / KV", "batch x ctx", "KV MB/step", "step ms", "tok/s",
                                "% roofline", "linear / attention / store / rest ms",
                                "linear GFMA/s (% FMA peak)"], dec)
        names = [name for name, _, _ in RATIOS]
        names += [k for k in dict.fromkeys(k for r in run["ratios"] for k in r)
                  if k not in names and k not in ("batch", "context")
                  and k.removesuffix(BYTES) not in names]  # those go in their ratio's cell
        rat = [[f"{r['batch']}x{r['context']}"] + [_ratio(r, k) for k in names]
               for r in run["ratios"]]
        out += [""] + md_table(["batch x ctx"] + names, rat) + ["", BYTES_NOTE, ""]
    return "\n".join(out)


def chart_label(kv: str) -> str:
    """A spec as the charts name it: KIVI-style by name, a spec with parts per layer by their
    count (its whole string is in the tables and the JSON)."""
    if kv == KIVI:
        return "KIVI"
    try:
        parts = KVSpec.parse(kv).per_layer
    except SpecError:  # a peer's cache (transformers' default, quanto's)
        return kv
    return f"per-layer spec ({len(parts)} parts)" if parts else kv
