"""Shared pytest fixtures: the default model (SmolLM2-135M-Instruct) and its reference outputs.

The model is fetched once, into tinykv's default weights folder, so later runs (and `run.py`)
reuse it.
"""

import json
import os
from pathlib import Path

import pytest
import torch

# Triton picks its interpreter when a kernel is defined, so this must come before anything imports
# triton: without a GPU the kernel tests run through the interpreter, on the CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tinykv.fetch import DEFAULT_DIR, GGUF_NAME, fetch

GOLDENS = Path(__file__).resolve().parent / "goldens" / "smollm2.json"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted model folder (config.json, model.safetensors, tokenizer files, the GGUF
    copy)."""
    return fetch(DEFAULT_DIR)


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The original GGUF file, alone in a folder of its own (as a symlink).

    transformers' `from_pretrained(path.parent, gguf_file=path.name)` prefers a folder's own
    tokenizer_config.json / tokenizer.json to the GGUF's metadata; next to tinykv's converted files
    it would silently test tinykv against itself.
    """
    alone = tmp_path_factory.mktemp("gguf_alone") / GGUF_NAME
    alone.symlink_to(smollm2_dir / GGUF_NAME)
    return alone


@pytest.fixture(scope="session")
def smollm2_goldens() -> dict:
    """tests/goldens/smollm2.json, made by tests/make_goldens.py with transformers on the GGUF."""
    return json.loads(GOLDENS.read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def small_model():
    """A random two-layer model over SmolLM2's vocabulary: fast, and it never knows a passkey."""
    from tinykv.model import Config, Transformer

    torch.manual_seed(0)
    cfg = Config(vocab_size=49152, dim=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=128,
                 max_seq_len=512)
    return Transformer(cfg).eval()


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Torch's thread count, which the CPU kernels follow (2: the parallel kernels, work split
    between threads; numba's pool caps it, 1 where the run is pinned to one core)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
