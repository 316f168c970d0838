"""End to end: the real model's greedy tokens with the Triton kernels equal those with the torch
reference.

Without a GPU the kernels run through Triton's interpreter (conftest sets TRITON_INTERPRET=1).
"""

import pytest
import torch

from tinykv.cache import make_cache
from tinykv.generate import Engine, Sampling
from tinykv.model import Transformer
from tinykv.spec import KVSpec

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def model(smollm2_dir):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return Transformer.from_pretrained(smollm2_dir, device=device)


# The interpreter is slow: two specs that between them cover packed codes, per-token and
# per-channel scales, asymmetry and the full-precision residual merge (the kernel unit tests cover
# every format).
@pytest.mark.parametrize("spec", ["int4", "k=int4:channel:asym,v=int8:g32:asym,residual=16"])
def test_triton_tokens_equal_torch(model, spec):
    # "The history of the Roman Empire begins with"
    prompt = [504, 1463, 282, 260, 4469, 7057, 5634, 351]
    weight = next(model.parameters())
    out = []
    for attention in ("torch", "triton"):
        cache = make_cache(model.cfg, KVSpec.parse(spec), blocks=16, block_size=16,
                           attention=attention, device=weight.device, dtype=weight.dtype)
        eng = Engine(model, cache)
        rid = eng.add(prompt, Sampling(temperature=0, max_new_tokens=5))
        list(eng.run())
        out.append(eng.requests[rid].new_ids)
    assert out[0] == out[1]
