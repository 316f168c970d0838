"""Tests for tinykv/kernels/layout.py and kernels/__init__.py: the one description of a stored
format, the one layout check every kernel wrapper calls, and the choice of kernels by what they
can do."""

import os
import re
import sys

import numpy as np
import pytest
import torch

from tests.pools import make_pool
from tinykv.blocks import CacheError
from tinykv.kernels import PoolLayer, check_layout, select_kernels, stored_format
from tinykv.kernels.layout import CACHE_LINE, FLOAT, FP8, INT, empty_rows, onto_huge_pages
from tinykv.spec import QuantParams

# spec -> (family, bits, per_byte, signed, has_zero, offset, group size at D=64)
FORMATS = {
    "fp32": (FLOAT, 32, 1, False, False, 0.0, 64),
    "bf16": (FLOAT, 16, 1, False, False, 0.0, 64),
    "fp8": (FP8, 8, 1, False, False, 0.0, 64),
    "int8": (INT, 8, 1, True, False, 0.0, 64),
    "int8:asym": (INT, 8, 1, False, True, 0.0, 64),
    "int4:g32": (INT, 4, 2, False, False, 8.0, 32),
    "int4:channel:asym": (INT, 4, 2, False, True, 0.0, 1),
    "int2:g16": (INT, 2, 4, False, False, 1.5, 16),  # midrise: code 1.5 is the value 0
}


@pytest.mark.parametrize("spec", FORMATS)
def test_stored_format(spec):
    fmt = stored_format(QuantParams.parse(spec), 64)
    got = (fmt.family, fmt.bits, fmt.per_byte, fmt.signed, fmt.has_zero, fmt.offset,
           fmt.group_size)
    assert got == FORMATS[spec]
    assert fmt.storage == QuantParams.parse(spec).storage_dtype


@pytest.mark.parametrize("spec", ["int4:channel:asym", "int8:head:static", "fp16", "int2:g16"])
def test_check_layout_passes_pools_as_stored_and_returns_broadcast_strides(spec):
    pool = make_pool(spec, 3, 16, 64, torch.Generator().manual_seed(0))
    strides = check_layout(pool, 3, 16, 64, "k")
    if pool.scale is None:
        assert (strides.block, strides.head, strides.token, strides.group) == (0, 0, 0, 0)
        return
    for n, stride, got in zip(pool.scale.shape, pool.scale.stride(),
                              (strides.block, strides.head, strides.token, strides.group)):
        assert got == (0 if n == 1 else stride)


def test_check_layout_names_what_is_wrong():
    pool = make_pool("int4:asym", 3, 16, 64, torch.Generator().manual_seed(0))
    cases = {
        "is not (NB, 4, 16, 32)": (pool, 4),  # wrong head count
        "a zero point is needed": (PoolLayer(pool.data, pool.scale, None, pool.p), 3),
        "does not broadcast": (PoolLayer(pool.data, pool.scale[:, :, :2], pool.zero, pool.p), 3),
        "is stored as": (PoolLayer(pool.data.view(torch.int8), pool.scale, pool.zero, pool.p), 3),
    }
    for message, (bad, H) in cases.items():
        with pytest.raises(AssertionError, match=re.escape(message)):
            check_layout(bad, H, 16, 64, "k")


def test_select_kernels_by_capability():
    cpu = torch.device("cpu")
    assert select_kernels("torch", cpu).reads_host_memory
    with pytest.raises(CacheError, match="unknown attention"):
        select_kernels("fast", cpu)


@pytest.mark.parametrize("shape, dtype", [((16, 576), np.float32), ((1, 3, 5), np.float32),
                                          ((7,), np.int16), ((0, 4), np.float32)])
def test_empty_rows_start_on_a_cache_line(shape, dtype):
    """Many arrays in one process, so an allocator that lands on a line by luck cannot pass."""
    arrays = [empty_rows(shape, dtype) for _ in range(64)]
    for a in arrays:
        assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
        assert a.ctypes.data % CACHE_LINE == 0 or a.size == 0
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays if a.size)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no overlap


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span[1], 16) <= address < int(span[2], 16)
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_onto_huge_pages_moves_tensors_and_asks_for_huge_pages():
    """Values, shapes, dtypes and the tensor objects kept (a tied Parameter stays tied), each on a
    cache line, in one range the kernel was asked to back with huge pages (VmFlags "hg", set by
    madvise whatever the machine's THP setting; absent from kernels built without THP)."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(3 << 18, generator=gen)),  # 3 MiB
               torch.nn.Parameter(torch.randn(5, 7, generator=gen).to(torch.bfloat16)),
               torch.randn(0, 4, generator=gen), torch.randint(0, 9, (3, 3), generator=gen)]
    weights.append(torch.randn(100, generator=gen)[1:])  # a view that starts mid-line
    before = [(w, w.detach().clone()) for w in weights]
    onto_huge_pages(weights)
    for (w, copy), moved in zip(before, weights):
        assert moved is w and torch.equal(moved, copy) and moved.dtype == copy.dtype
        assert moved.data_ptr() % CACHE_LINE == 0 or moved.numel() == 0
    if sys.platform == "linux" and os.path.isdir("/sys/kernel/mm/transparent_hugepage"):
        assert "hg" in _vm_flags(weights[0].data_ptr())
