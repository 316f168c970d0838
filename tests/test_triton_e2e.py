"""End to end: the real model through the Triton kernels, every kernel call held to the torch
reference on the same inputs, and the logits of a float32 cache equal to the reference's.

Without a GPU the kernels run through Triton's interpreter (conftest sets TRITON_INTERPRET=1).
The Triton path is fed the reference's own tokens (teacher forcing), so both see the same text at
every step.

Why each call is checked where it happens, not only the logits at the end: attention's float
sums run in another order on each path (and on each CPU under the interpreter: numpy's own loops),
~1e-7 of a value. Where a quantized value falls within that of a rounding boundary, the two paths
store a different code; every later layer then quantizes slightly different inputs, and int4
logits drift by whole units with no kernel at fault (an AMD Zen 4 showed 1.8 from one flipped
int4 value in layer 16). So each store is compared bit for bit with the reference's store of the
same rows into a copy of the same pool, and each attention call with the reference's attention
over the same pools, at float32's tolerance: a wrong block, scale or mask moves them by far more.
A float32 cache rounds nothing it stores, so its logits are compared end to end (a float16 cache
still has small cliffs: one flipped rounding moved them by 2e-3 on that Zen 4).
"""

import pytest
import torch

import tinykv.generate as gen_mod
from tinykv.cache import make_cache
from tinykv.generate import Engine, Sampling
from tinykv.kernels import reference, triton_store
from tinykv.kernels import triton as triton_kernels
from tinykv.model import Transformer
from tinykv.spec import KVSpec
from tinykv.tokenizer import Tokenizer

pytest.importorskip("triton")

PROMPT = "The history of the Roman Empire begins with"


@pytest.fixture(scope="module")
def model(smollm2_dir):
    # float32 on a GPU too (its default is bfloat16): in bfloat16 the torch path alone moves int4's
    # logits by up to ~8 against float32, noise that would hide a kernel's error.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return Transformer.from_pretrained(smollm2_dir, device=device, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompt(smollm2_dir):
    return Tokenizer.from_dir(smollm2_dir).encode(PROMPT)


def step_logits(model, prompt, spec, attention, forced=None):
    """Greedy decoding's tokens, the logits (steps, V) each was sampled from, and how many hot
    blocks left the residual window for the store; with `forced`, those tokens are fed back
    instead of the engine's own picks."""
    weight = next(model.parameters())
    cache = make_cache(model.cfg, KVSpec.parse(spec), blocks=16, block_size=4,
                       attention=attention, device=weight.device, dtype=weight.dtype)
    moved = []  # store blocks that took a hot block's tokens
    to_store = cache.quantize_hot

    def quantize_hot(hot_block, store_block):
        moved.append(store_block)
        to_store(hot_block, store_block)

    cache.quantize_hot = quantize_hot
    eng = Engine(model, cache)
    rid = eng.add(prompt, Sampling(temperature=0, max_new_tokens=4))
    rows = []
    greedy = gen_mod.sample

    def sample(row, *args):
        rows.append(row.float().cpu())
        return greedy(row, *args) if forced is None else forced[len(rows) - 1]

    gen_mod.sample = sample
    try:
        list(eng.run())
    finally:
        gen_mod.sample = greedy
    return eng.requests[rid].new_ids, torch.stack(rows), len(moved)


class Checked:
    """The Triton store and attention, each call also run by the torch reference on the same
    inputs (the store into a copy of the pool) and compared; counts the calls."""

    def __init__(self):
        self.stores, self.attends = 0, 0
        self.real_store = triton_store.quantize_store_triton
        self.real_attend = triton_kernels.paged_attention_triton

    def store(self, x, p, data, scale, zero, blk, off):
        copies = [None if t is None else t.clone() for t in (data, scale, zero)]
        want_count = reference.quantize_store_ref(x, p, *copies, blk, off)
        count = self.real_store(x, p, data, scale, zero, blk, off)
        for got, want in zip((data, scale, zero), copies):
            assert got is None or torch.equal(got, want), f"store of {p} differs from the torch's"
        assert int(count) == int(want_count)
        self.stores += 1
        return count

    def attend(self, q, q_seq, q_pos, k, v, table, ctx_lens, sm_scale):
        o, lse = self.real_attend(q, q_seq, q_pos, k, v, table, ctx_lens, sm_scale)
        want_o, want_lse = reference.paged_attention_ref(q, q_seq, q_pos, k, v, table, ctx_lens,
                                                         sm_scale)  # (N, Hq, D), (N, Hq)
        # float32 sums in another order: ~1e-6 here; a wrong key or scale moves them by ~1e-1
        torch.testing.assert_close(o, want_o, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)
        self.attends += 1
        return o, lse


# The interpreter is slow: float16 and two quantized specs that between them cover packed codes,
# per-token and per-channel scales, asymmetry and the full-precision residual merge (the kernel
# unit tests cover every format). The prompt (8 tokens, blocks of 4) outgrows the residual
# window: the store and the window are both read.
@pytest.mark.parametrize("spec", ["fp16", "int4", "k=int4:channel:asym,v=int8:g32:asym,residual=4"])
def test_triton_calls_equal_torch_on_the_real_model(model, prompt, spec, monkeypatch):
    ids, _, moved_ref = step_logits(model, prompt, spec, "torch")
    checked = Checked()
    monkeypatch.setattr(triton_store, "quantize_store_triton", checked.store)
    monkeypatch.setattr(triton_kernels, "paged_attention_triton", checked.attend)
    _, _, moved = step_logits(model, prompt, spec, "triton", forced=ids)
    assert moved == moved_ref and (moved > 0) == ("residual" in spec)
    L = model.cfg.n_layers
    # every layer stores K and V, and attends, at the prefill and at each of the 4 steps after it
    # (the residual spec's first steps find nothing to store: its tokens stay hot)
    assert checked.attends >= 4 * L and checked.stores >= 2 * L


def test_triton_logits_equal_torch_fp32(model, prompt):
    ids, want, _ = step_logits(model, prompt, "fp32", "torch")  # (steps, V)
    _, got, _ = step_logits(model, prompt, "fp32", "triton", forced=ids)
    diff = (got - want).abs().max()
    # The two paths differ only in the order of float sums inside attention: ~2e-5 of a logit
    # after 30 layers; a wrong block, scale or mask moves whole units.
    assert diff < 1e-3, f"logits differ by {float(diff):.3g}"
    top2 = want.topk(2, dim=-1).values  # (steps, 2)
    clear = top2[:, 0] - top2[:, 1] > 2 * diff  # steps whose choice rounding cannot flip
    assert clear.any()
    assert torch.equal(got.argmax(-1)[clear], torch.tensor(ids)[clear])
