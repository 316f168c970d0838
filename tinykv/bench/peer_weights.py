"""The weights both engines of `bench peers` read (peers.py), and the checks that they are the
same numbers: the GGUF a model folder came from, its F32 copy for llama.cpp, each compared tensor by
tensor with model.safetensors, and with --packed-weights every linear layer packed from the
GGUF's blocks and the bytes each engine then reads a step.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from ..model import Linear, Transformer
from .ceilings import packed_matrices


def source_gguf(weights: Path) -> Path:
    """The GGUF in a model folder (fetch.py leaves the original beside the converted weights)."""
    found = sorted(Path(weights).glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf in {weights}: bench peers needs the GGUF the weights "
                                "came from (python -m tinykv fetch leaves it there)")
    return found[0]


def write_f32_gguf(src: Path, dst: Path) -> int:
    """Every tensor of GGUF `src` dequantized to float32 into a new GGUF `dst`: the metadata and
    the tensors' order, names and rows (llama.cpp's Q/K permutation included) as they were, the
    file type F32. Returns the number of tensors."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue  # the writer writes the header, the architecture and the file type itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        w = np.asarray(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32)
        writer.add_tensor(t.name, w.reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return len(reader.tensors)


def gguf_weight_bytes(path: Path) -> int:
    """Tensor bytes of a GGUF that llama.cpp's decode step reads: all of them, the token
    embedding only where it is the output matrix too (tied; else it gathers a row a token)."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def same_weights(gguf_path: Path, weights: Path) -> dict:
    """fetch.py's converter run on a GGUF (the F32 one, or the source's own blocks; Q/K rows
    un-permuted), tensor by tensor against the model folder's model.safetensors: counts of
    tensors and of exactly equal ones."""
    from safetensors.torch import load_file

    from ..convert import convert_gguf

    with tempfile.TemporaryDirectory(prefix="tinykv-peers-") as tmp:
        ours = load_file(str(Path(weights) / "model.safetensors"))
        theirs = load_file(str(convert_gguf(gguf_path, Path(tmp)) / "model.safetensors"))
    equal = [n for n, t in theirs.items() if n in ours and torch.equal(ours[n].float(), t)]
    return {"tensors": len(ours), "in_gguf": len(theirs), "equal": len(equal),
            "all_equal": len(equal) == len(ours) == len(theirs)}


def check_packed(model: Transformer) -> None:
    """Every linear layer packed, else a one-line error: llama.cpp would read the GGUF's blocks
    where tinykv reads float32."""
    total = sum(isinstance(m, Linear) for m in model.modules())
    packed = packed_matrices(model)
    if packed < total:
        raise ValueError(f"--packed-weights: {packed} of {total} linear layers "
                         "came from 4- or 8-bit blocks; bench peers needs every one packed to "
                         "compare with llama.cpp on the same GGUF")
