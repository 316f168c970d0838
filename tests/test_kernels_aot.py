"""Ahead-of-time compilation of every Triton kernel variant for sm_80 and sm_90, without a GPU.

The interpreter tests (test_kernels_triton.py) check what the kernels compute; this checks that
the same kernels, with the same arguments, compile for real GPUs: Triton's front end, its GPU
passes and ptxas. It runs in a child process, as TRITON_INTERPRET (set by conftest.py without a
GPU) must be unset when the kernels are defined.
"""

import pytest
from pools import ATTN_CASES

from tinykv.spec import KVSpec, QuantParams

pytest.importorskip("triton")

from tinykv.bench.kernel import AOT_VARIANTS, aot_report  # noqa: E402


def _formats(kernel: str) -> set[QuantParams]:
    """The storage formats AOT_VARIANTS compiles `kernel` for."""
    out = set()
    for v in AOT_VARIANTS:
        if v.kernel == kernel and kernel == "attention":
            spec = KVSpec.parse(v.spec)
            out |= {spec.k, spec.v}
        elif v.kernel == kernel:
            out.add(QuantParams.parse(v.spec))
    return out


def test_variants_cover_the_tested_formats():
    """Every K and V format the attention tests run is compiled too, and the store kernel is
    compiled for each dtype, sym/asym and static/dynamic it supports."""
    tested = {QuantParams.parse(s) for k, v, *_ in ATTN_CASES for s in (k, v)}
    assert tested <= _formats("attention")
    stored = _formats("store")
    ints = [p for p in stored if p.dtype.startswith("int")]
    for dtype in ("int8", "int4", "int2"):
        assert {p.sym for p in ints if p.dtype == dtype} == {True, False}, dtype
        assert {p.static for p in ints if p.dtype == dtype} == {True, False}, dtype
    assert len({(p.sym, p.static) for p in ints}) == 4  # each pairing, on some integer dtype
    assert {p.static for p in stored if p.dtype == "fp8"} == {True, False}
    assert any(p.is_float for p in stored)
    dims = {v.head_dim for v in AOT_VARIANTS}
    sizes = {v.block_size for v in AOT_VARIANTS if v.kernel == "attention"}
    assert {64, 80, 128} <= dims and {16, 32, 64} <= sizes
    assert {"fp16", "bf16"} <= {v.dtype for v in AOT_VARIANTS if v.kernel == "attention"}


def test_every_variant_compiles_for_sm80_and_sm90(tmp_path):
    rows = aot_report(caps=(80, 90), cache_dir=str(tmp_path / "triton-cache"))  # compile afresh
    assert len(rows) == 2 * len(AOT_VARIANTS)
    assert {(r["variant"], r["target"]) for r in rows} == \
        {(str(v), t) for v in AOT_VARIANTS for t in ("sm_80", "sm_90")}
    for r in rows:
        assert r["cubin_bytes"] > 0 and r["ptx_chars"] > 0, r
        assert 0 < r["n_regs"] <= 255, r
        assert r["n_spills"] == 0, f"{r['variant']} on {r['target']} spills {r['n_spills']} words"
