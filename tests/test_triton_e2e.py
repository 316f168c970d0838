"""End to end: the real model through the Triton kernels gives the logits of the torch reference,
step by step, and therefore its greedy tokens wherever the choice is not a near tie.

Without a GPU the kernels run through Triton's interpreter (conftest sets TRITON_INTERPRET=1).
The Triton path is fed the reference's own tokens (teacher forcing), so both see the same text at
every step: a near tie that rounding breaks the other way (a quantized cache has some) cannot send
the two down different continuations and fail a correct kernel.
"""

import pytest
import torch

import tinykv.generate as gen_mod
from tinykv.cache import make_cache
from tinykv.generate import Engine, Sampling
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


# The interpreter is slow: two specs that between them cover packed codes, per-token and
# per-channel scales, asymmetry and the full-precision residual merge (the kernel unit tests cover
# every format). The prompt (8 tokens, blocks of 4) outgrows the residual window: the store and
# the window are both read.
@pytest.mark.parametrize("spec", ["int4", "k=int4:channel:asym,v=int8:g32:asym,residual=4"])
def test_triton_logits_equal_torch(model, prompt, spec):
    ids, want, moved_ref = step_logits(model, prompt, spec, "torch")  # (steps, V)
    _, got, moved = step_logits(model, prompt, spec, "triton", forced=ids)
    assert moved == moved_ref and (moved > 0) == ("residual" in spec)
    diff = (got - want).abs().max()
    # Both paths store the same codes (the store is bit-exact): what differs is the order of
    # float sums inside attention, ~1e-6 of a logit per layer, far below the 1e-2 allowed here. A
    # wrong block, scale or mask moves logits by whole units.
    assert diff < 1e-2, f"logits differ by {float(diff):.3g}"
    top2 = want.topk(2, dim=-1).values  # (steps, 2)
    clear = top2[:, 0] - top2[:, 1] > 2 * diff  # steps whose choice rounding cannot flip
    assert clear.any()
    assert torch.equal(got.argmax(-1)[clear], torch.tensor(ids)[clear])
