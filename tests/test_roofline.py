"""The roofline benchmark (tinykv/bench/roofline.py) in its quick mode, shrunk further to a tiny
random Llama: the synthetic fill, the bytes each row counts, the JSON, chart and tables. Speeds
are only checked to be finite and positive: tiny shapes live in the CPU's caches, so a share of
the roofline may pass 100%."""

import json
import math
import os

import pytest
import torch
from hf_tiny import make_hf_model

from tinykv.bench import ceilings
from tinykv.bench import roofline as rl
from tinykv.bench import roofline_report as report
from tinykv.bench.common import time_in_turn
from tinykv.cache import make_cache
from tinykv.model import Transformer

# The shape of roofline.MODES["quick"], within the tiny model's 512-token context.
TINY = dict(bw_mib=16, bw_reps=2, contexts=[64, 128], attn_reps=2, shapes=[(1, 128), (3, 64)],
            steps=2)
THREADS = [1, 2] if (os.cpu_count() or 1) >= 2 else [1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("roofline-llama")
    make_hf_model("llama", 4, 2, 64, d)
    return d, Transformer.from_pretrained(d, device="cpu")


@pytest.fixture(scope="module")
def results(tiny, tmp_path_factory):
    d, model = tiny
    out = tmp_path_factory.mktemp("roofline") / "bench" / "roofline.json"
    mp = pytest.MonkeyPatch()
    mp.setitem(rl.MODES, "quick", TINY)
    threads = torch.get_num_threads()
    try:
        res = rl.run(model, d, quick=True, threads=THREADS, out=out)
    finally:
        mp.undo()
    assert torch.get_num_threads() == threads  # run() gives the threads back
    return res, out


@pytest.mark.parametrize("spec", ["int8", report.KIVI])
def test_fill_puts_context_slots(tiny, spec):
    """Every sequence holds `context` slots of the synthetic keys, quantized where the spec says
    (KIVI: through the hot pool, quantized block by block at commit)."""
    _, model = tiny
    with make_cache(model.cfg, spec, tokens=400, max_seqs=2) as cache:
        rl.fill(cache, [0, 1], 150, torch.Generator().manual_seed(0))
        assert [cache.slots(0), cache.slots(1)] == [150, 150]
        k, v = cache.seq_kv(1)  # (L, H, 150, D)
    assert k.shape[2] == 150 and k.abs().sum() > 0 and v.abs().sum() > 0


def test_weight_bytes(tiny):
    """Every parameter but the embedding, unless the LM head shares it."""
    d, model = tiny
    total = sum(p.nbytes for p in model.parameters())
    assert ceilings.weight_bytes(model) == total - model.embed.weight.nbytes
    tied = Transformer.from_pretrained(d, device="cpu")
    tied.lm_head.weight = tied.embed.weight
    head = model.lm_head.weight.nbytes
    assert ceilings.weight_bytes(tied) == total - head  # read once, as the head


def test_linear_macs(tiny):
    """A token's multiply-adds in the linear layers, from the config: q, k, v, o and the three MLP
    matrices per layer, and the LM head (tied or not: the head reads the whole matrix)."""
    d, model = tiny
    c = model.cfg
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    layer = c.dim * (q + 2 * kv) + q * c.dim + 3 * c.dim * c.ffn_dim
    assert ceilings.linear_macs(model) == c.n_layers * layer + c.vocab_size * c.dim
    tied = Transformer.from_pretrained(d, device="cpu")
    tied.lm_head.weight = tied.embed.weight
    assert ceilings.linear_macs(tied) == ceilings.linear_macs(model)


def test_json_and_bytes(results, tiny):
    res, out = results
    _, model = tiny
    cfg = model.cfg
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    for n, (bars, steps) in zip(THREADS, res["charts"].values()):
        suffix = "" if n == THREADS[0] else f"-{n}thr"
        assert bars is None or bars == str(out.with_name(f"roofline{suffix}.png"))
        assert steps is None or steps == str(out.with_name(f"roofline{suffix}-steps.png"))
        assert all(p is None or os.path.getsize(p) > 0 for p in (bars, steps))
    assert [r["threads"] for r in res["runs"]] == THREADS
    specs = list(rl.DEFAULT_SPECS)
    fp32_token = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 4  # bytes
    for run in res["runs"]:
        bw = run["bandwidth"]
        probes = [v for k, v in bw.items() if k.endswith("_gb_s")]
        assert bw["bytes"] >= 16 * 2**20 and bw["gb_s"] == max(probes) and len(probes) >= 2
        assert math.isfinite(bw["gb_s"]) and bw["gb_s"] > 0
        assert math.isfinite(run["fma_peak_gfma_s"]) and run["fma_peak_gfma_s"] > 0
        attn = run["attention"]
        assert [(r["kv"], r["context"]) for r in attn] == [(s, c) for s in specs
                                                           for c in TINY["contexts"]]
        bpt = {}
        for r in attn:
            assert r["filled"] == r["context"] and r["slots"] == r["context"] + 1
            assert r["kv_bytes"] == r["slots"] * r["bytes_per_token"]
            assert math.isfinite(r["pct_bandwidth"]) and r["pct_bandwidth"] > 0
            bpt[r["kv"]] = r["bytes_per_token"]
        assert bpt["int4"] < bpt["int8"] < bpt["fp16"]
        steps = TINY["steps"]
        for r in run["decode"]:
            # after the untimed step a sequence holds context + 1; timed step i adds i more
            slots = r["batch"] * (r["context"] + 1 + (steps + 1) / 2)
            if r["engine"] == "tinykv":
                assert r["kv_bytes"] == pytest.approx(slots * bpt[r["kv"]])
            elif r["kv"] == "default":
                assert r["kv_bytes"] == pytest.approx(slots * fp32_token)
            else:  # quanto's 4-bit codes and scales
                assert 0 < r["kv_bytes"] < slots * fp32_token / 2
            assert len(r["ms_all"]) == steps and r["weight_bytes"] == res["weight_bytes"]
            assert r["tok_s"] == pytest.approx(r["batch"] / (r["ms"] / 1e3))
            assert math.isfinite(r["pct_roofline"]) and r["pct_roofline"] > 0
            assert r["roofline_tok_s"] == pytest.approx(r["batch"] / (r["roofline_ms"] / 1e3))
            if r["engine"] == "tinykv":  # the breakdown: four parts, all measured
                parts = r["parts_ms"]
                assert set(parts) == {"linear", "attention", "store", "rest"}
                assert all(parts[k] > 0 for k in ("linear", "attention", "store"))
                rate = r["batch"] * ceilings.linear_macs(model) / parts["linear"] / 1e6  # GFMA/s
                assert r["linear_gfma_s"] == pytest.approx(rate)
                assert r["linear_pct_fma_peak"] == pytest.approx(
                    100 * rate / run["fma_peak_gfma_s"])
            else:
                assert "parts_ms" not in r
        engines = {(r["engine"], r["kv"]) for r in run["decode"]}
        assert {("tinykv", s) for s in specs} | {("transformers", "default")} <= engines
        names = [name for name, _, _ in report.RATIOS]
        for r in run["ratios"]:
            assert set(names[:4]) <= set(r) and all(r[n] > 0 for n in names if n in r)
            # the bytes' ratio beside tinykv's pairs only: transformers' bytes are its own count
            assert {f"{n} bytes" for n in names[:3]} <= set(r) and "fp16/hf bytes" not in r
        assert [(r["batch"], r["context"]) for r in run["ratios"]] == TINY["shapes"]


def test_render(results):
    res, _ = results
    md = report.render(res)
    assert md.startswith("## Roofline")
    for text in ("Read bandwidth", "% bandwidth", "% roofline", "int4/fp16", "| 3x64",
                 "linear / attention / store / rest ms", "FMA peak",
                 "linear GFMA/s (% FMA peak)", "(bytes ", report.BYTES_NOTE):
        assert text in md
    if res["runs"][0].get("kernel"):  # the kernel table says what its kernels were built for
        assert f"kernels for {res['runs'][0]['kernel']['machine']['cpu_kernels']}." in md
    assert md.count("### ") == len(THREADS)


def test_cli(tiny, tmp_path, monkeypatch, capsys):
    from tinykv.cli import main

    d, _ = tiny
    monkeypatch.setitem(rl.MODES, "quick", TINY)
    out = tmp_path / "r.json"
    args = ["bench", "roofline", "--quick", "--weights", str(d), "--threads", "1", "--kv", "int8",
            "--no-transformers", "--out", str(out)]
    assert main(args) == 0
    res = json.loads(out.read_text())
    assert res["config"]["specs"] == ["int8"] and res["config"]["transformers"] is False
    assert {r["engine"] for r in res["runs"][0]["decode"]} == {"tinykv"}
    assert "| tinykv `int8`" in capsys.readouterr().out


def test_cli_times_calibrated_specs_with_their_scale_file(tiny, tmp_path, monkeypatch, capsys):
    """--kv-scales gives a centered, smoothed, rotated spec (and its per-layer parts) their
    calibration; a calibrated spec without the file, or the file without such a spec, is a
    one-line usage error before anything runs."""
    from tinykv.calibrate import calibrate
    from tinykv.cli import main
    from tinykv.scalefile import save_scales
    from tinykv.spec import KVSpec

    d, model = tiny
    spec = "k=int4:rot:center:smooth,v=int4:rot,k@1=int2:g32:center:smooth,residual=16,sink=4"
    tokens = torch.randint(0, model.cfg.vocab_size, (96,), generator=torch.Generator()
                           .manual_seed(0)).tolist()
    scales_file = tmp_path / "s.safetensors"
    kv = KVSpec.parse(spec)
    save_scales(scales_file, calibrate(model, tokens, kv, window=64), model.cfg, kv, "minmax", 96)
    monkeypatch.setitem(rl.MODES, "quick", TINY)
    out = tmp_path / "r.json"
    base = ["bench", "roofline", "--quick", "--weights", str(d), "--threads", "1",
            "--no-transformers", "--out", str(out)]
    assert main(base + ["--kv", "fp16", spec, "--kv-scales", str(scales_file)]) == 0
    res = json.loads(out.read_text())
    rows = [r for r in res["runs"][0]["decode"] if r["kv"] == spec]
    assert len(rows) == 2 and all(r["ms"] > 0 for r in rows)
    assert [r["kv"] for r in res["runs"][0]["kernel"]["rows"]
            if r["kv"] == spec] == []  # synthetic pools: one format pair, not per-layer parts
    capsys.readouterr()
    assert main(base + ["--kv", spec]) == 1
    assert "--kv-scales" in capsys.readouterr().err
    assert main(base + ["--kv", "int8", "--kv-scales", str(scales_file)]) == 1
    assert "no KV spec" in capsys.readouterr().err


def test_evicting_specs_are_timed_against_the_full_cache():
    rows = [{"engine": "tinykv", "kv": kv, "batch": 1, "context": 8000, "tok_s": t}
            for kv, t in [("int8", 10.0), ("int8,sink=4,evict=streaming:1024", 30.0),
                          ("fp16,evict=knorm:64", 5.0)]]
    (row,) = report.ratios(rows)
    assert row["int8,sink=4,evict=streaming:1024 / int8"] == 3.0
    assert not any(k.startswith("fp16,evict") for k in row)  # its full cache was not timed
    assert report.unevicted("int4:rot,residual=64,sink=4,evict=h2o:99") == "int4:rot,residual=64"
    assert report.unevicted("int8") is None


def test_ratios_give_the_bytes_ratio_beside_the_speed_ratio():
    # 500 MB of weights; fp16's KV 200 MB a step, int4's 50: int4 reads 700 / 550 fewer bytes
    rows = [{"engine": "tinykv", "kv": kv, "batch": 1, "context": 8000, "tok_s": t,
             "weight_bytes": 500e6, "kv_bytes": kv_mb * 1e6}
            for kv, t, kv_mb in [("fp16", 20.0, 200), ("int4", 24.0, 50)]]
    (row,) = report.ratios(rows)
    assert row["int4/fp16"] == pytest.approx(1.2)
    assert row["int4/fp16 bytes"] == pytest.approx(700 / 550)
    assert "int8/fp16" not in row and "int8/fp16 bytes" not in row  # int8 was not timed
    assert report._ratio(row, "int4/fp16") == "1.20x (bytes 1.27x)"
    assert report._ratio(row, "int8/fp16") == "-"


def test_decode_steps_taken_in_turn():
    """The specs' timed steps alternate, so a slow moment of the machine falls on all of them."""
    calls = []
    steps_of = {name: (lambda name=name: calls.append(name)) for name in ("fp16", "int8")}
    held_of = {"fp16": lambda: 2.0, "int8": lambda: 1.0}
    got = time_in_turn(steps_of, held_of, 3)
    assert calls == ["fp16", "int8"] * 4  # one untimed round, then 3 timed
    assert [len(got[n][0]) for n in ("fp16", "int8")] == [3, 3]
    assert got["fp16"][1] == 2.0 and got["int8"][1] == 1.0


def test_kernel_bench_pools_of_one_block():
    """A shape of one block a sequence (bench kernel --cpu --shapes 1x16): its pools' scales have
    one block's row, which the touch reads as that block's, not as a layer's one set; the pools
    are sized by what they hold, so making them ends."""
    from tinykv.bench import attention
    from tinykv.spec import KVSpec

    layers = attention.pseudo_layers(KVSpec.parse("int4"), 1, 16, budget=1)
    assert len(layers) == 1
    codes, scales = 3 * 16 * 32, 3 * 16 * 2  # (H, BS, D / 2) bytes, (H, BS, 1) fp16 scales
    assert layers[0].nbytes == codes * 2 + scales * 2
    got = attention.measure_shape(["int4"], 1, 16, reps=1, budget=1)
    assert got["int4", 1]["attend_s"] > 0 and got["int4", 1]["touch_s"] > 0


def test_touch_reads_every_word_of_the_visible_blocks_with_or_without_requests():
    """The touch's two reads (plain, and each block requested ahead), on any number of workers,
    fold the same words: those of every block a row's context reaches, K, V and scales, and no
    other block's."""
    import numpy as np

    from tinykv.bench import touch
    from tinykv.spec import KVSpec

    layer = touch.pseudo_layers(KVSpec.parse("int4"), 2, 80, budget=1)[0]  # 5 blocks a row
    lens = np.array([80, 33])  # row 1 reaches 3 of its 5 blocks
    table = layer.table.numpy()
    want = np.uint64(0)
    for row, n_blocks in ((0, 5), (1, 3)):
        for blk in table[row, :n_blocks]:
            for words in layer.words:
                if words.shape[1]:
                    want ^= np.bitwise_xor.reduce(words[blk])
    for ahead in (0, 1, 4, 9):
        for workers in (1, 2, 3, 7):  # runs of 0-3 blocks a row each
            got = touch._touch(table, lens, 16, ahead, workers, *layer.words)
            assert got == want, (ahead, workers)
    skipped = table[1, 3]  # a block past row 1's context: folding it in changes the answer
    assert np.bitwise_xor.reduce(layer.words[0][skipped]) != 0


def test_overlap_probe_reports_each_rate_beside_the_larger_alone():
    """bench/overlap.py: the work alone, and per rate of reads the reads alone and both, with
    both over the larger of the two; printed under the attention table."""
    from tinykv.bench import attention, overlap

    if not attention.AVAILABLE:
        pytest.skip("numba is not installed")
    got = overlap.measure(2**20, quick=True)
    assert [r["every"] for r in got["rates"]] == list(overlap.EVERY)
    assert got["work_ns"] > 0 and got["far_bytes"] == 2**20
    for r in got["rates"]:
        assert r["reads_ns"] > 0 and r["both_ns"] > 0
        assert r["both_over_larger"] == r["both_ns"] / max(got["work_ns"], r["reads_ns"])
    text = "\n".join(overlap.render(got))
    assert f"work alone {got['work_ns']:.1f} ns a step" in text
    assert f"{got['rates'][0]['both_over_larger']:.2f}x" in text
    assert overlap.render(None) == []


def test_huge_page_buffer_starts_on_a_huge_page():
    from tinykv.kernels.layout import HUGE_PAGE, huge_page_buffer

    buffer = huge_page_buffer(3 * 2**20 + 5)
    assert buffer.numel() == 3 * 2**20 + 5 and buffer.dtype == torch.uint8
    assert buffer.data_ptr() % HUGE_PAGE == 0


def test_kernel_bench_times_thread_counts_in_turn(monkeypatch):
    """Each thread count and spec is timed within the same reps (so a slow moment falls on all
    of them), and a row past one thread is its own one-thread time over its time."""
    from tinykv.bench import attention

    if not attention.AVAILABLE:
        pytest.skip("numba is not installed")
    order, real, before = [], attention.set_threads, torch.get_num_threads()
    monkeypatch.setattr(attention, "set_threads", lambda n: order.append(n) or real(n))
    try:
        got = attention.measure_shape(["fp16", "int4"], 1, 32, reps=3, budget=1, threads=[1, 2])
    finally:
        real(before)
    assert order[-4:] == [1, 2, 1, 2]  # the last rep: each spec at 1 thread, then 2
    machine = {"read_gb_s": 10.0, "clock_ghz": 3.0, "fma_g_s": 50.0,
               "read_gb_s_threads": {"2": 15.0}}
    one, two = (attention._row("int4", 1, 32, n, got, machine) for n in (1, 2))
    assert "speedup" not in one
    # rep by rep: rep i on one thread over rep i on two; the middle of the three, and the span
    paired = sorted(a / b for a, b in zip(got["int4", 1]["reps_s"], got["int4", 2]["reps_s"]))
    assert len(paired) == 3
    assert math.isclose(two["speedup"], paired[1])
    assert two["speedup_range"] == [paired[0], paired[2]]
    assert math.isclose(two["vs_fp16"], got["int4", 2]["attend_s"] / got["fp16", 2]["attend_s"])
    # each thread count's share of the bandwidth is of its own: 2 threads against 15 GB/s
    assert math.isclose(one["pct_bandwidth"], 100 * one["gb_s"] / 10.0)
    assert math.isclose(two["pct_bandwidth"], 100 * two["gb_s"] / 15.0)
    cell = attention._speedup(two)
    assert cell == f"{paired[1]:.2f}x ({paired[0]:.2f}-{paired[2]:.2f})"


def test_fma_peak_of_threads_at_once_restores_the_count():
    from tinykv.bench import attention

    if not attention.AVAILABLE:
        pytest.skip("numba is not installed")
    before = torch.get_num_threads()
    one, two = ceilings.fma_peak(200_000), ceilings.fma_peak(200_000, threads=2)
    assert one > 0 and two > 0  # two threads' sum: what a busy host gives is not asserted
    assert torch.get_num_threads() == before


def test_reads_in_turn_measures_each_thread_count_and_restores_it():
    from tinykv.bench import attention

    if not attention.AVAILABLE:
        pytest.skip("numba is not installed")
    before = torch.get_num_threads()
    got = ceilings.reads_in_turn(4, [1, 2], reps=2)
    assert sorted(got) == [1, 2]
    assert all(gb_s > 0 for gb_s in got.values())  # what a busy host gives 2 is not asserted
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("cpu, expected", [(None, "numba target host"),
                                           ("haswell", "256-bit vectors or narrower; numba "
                                                       "target haswell")])
def test_results_say_what_the_cpu_kernels_were_built_for(cpu, expected):
    """The machine record names the vector width and numba's target, read in a fresh process
    (both are fixed when the kernels' modules load)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU_")}
    if cpu:
        env.update(NUMBA_CPU_NAME=cpu, NUMBA_CPU_FEATURES="")
    code = "from tinykv.bench.common import cpu_target; print(cpu_target())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out.endswith(expected)
    if not cpu:
        from tinykv.kernels.cpu_simd import WIDE_VECTORS
        assert out.startswith("512-bit") == WIDE_VECTORS

