"""Observers: what range of the recorded keys or values each static scale group gets.

`minmax` (nothing seen clips), `percentile:P` (numpy's "linear" percentiles: rare outliers clip so
the rest get finer steps) and `meanstd:K` (mean -/+ K population std, within minmax); sym takes
the larger magnitude (of |x| for percentiles). `mse` picks, for each scale group apart, the clip
range (among the percentile ranges of MSE_PERCENTILES) whose round trip through the format has
the least squared error over what was seen: at 2 bits the best range clips far more than one
percentile suits every channel. calibrate.py turns the ranges into scales.
"""

from __future__ import annotations

import torch

from .quant import compute_scales, dequantize, quantize
from .scalefile import CalibrationError
from .spec import QuantParams

# The clip ranges `mse` tries, as the percentile each end is clipped at (100: nothing clips).
# Down to 70 because 2-bit channels of this project's default model chose 85-90.
MSE_PERCENTILES = (100, 99.9, 99.5, 99, 98, 97, 96, 95, 94, 92, 90, 88, 86, 84, 82, 80, 75, 70)


def parse_observer(s: str) -> tuple[str, float]:
    """'minmax' | 'percentile:P' (0 < P <= 100) | 'meanstd:K' (K > 0) | 'mse'
    -> (kind, parameter)."""
    kind, _, arg = s.partition(":")
    val = float(arg) if arg.replace(".", "", 1).isdigit() else -1.0
    valid = ((kind, arg) in (("minmax", ""), ("mse", ""))
             or (kind == "percentile" and 0 < val <= 100)
             or (kind == "meanstd" and val > 0))
    if valid:
        return kind, max(val, 0.0)
    raise CalibrationError(f"bad observer {s!r} (expected minmax, percentile:P with 0 < P <= 100, "
                           "meanstd:K with K > 0, or mse)")


def quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """numpy's default ('linear') quantile over the last dim (kthvalue: no size limit, no sorted
    copy)."""
    n = x.shape[-1]
    pos = q * (n - 1)  # between the i-th and the next smallest value
    i = int(pos)
    lo = x.kthvalue(i + 1, -1).values
    hi = x.kthvalue(min(i + 2, n), -1).values
    return lo + (hi - lo) * (pos - i)


def observe(x: torch.Tensor, p: QuantParams,
            observer: str = "minmax") -> tuple[torch.Tensor, torch.Tensor]:
    """Range (lo, hi) of x (L, H, T, D) per static scale group of p, each (L, H|1, 1, G); sym:
    lo = -hi."""
    kind, arg = parse_observer(observer)
    if kind == "mse":
        return least_error_range(x, p)
    L, H = x.shape[:2]
    rows = x.float().transpose(2, 3)  # (L, H, D, T): tokens are always reduced over
    if p.gran == "tensor":
        rows = rows.reshape(L, 1, 1, -1)
    elif p.gran == "head":
        rows = rows.reshape(L, H, 1, -1)
    if kind == "minmax":
        lo, hi = rows.amin(-1), rows.amax(-1)
    elif kind == "percentile" and p.sym:
        lo = hi = quantile(rows.abs(), arg / 100)
    elif kind == "percentile":
        lo, hi = quantile(rows, 1 - arg / 100), quantile(rows, arg / 100)
    else:
        mean, std = rows.mean(-1), rows.std(-1, correction=0)
        lo = torch.maximum(mean - arg * std, rows.amin(-1))
        hi = torch.minimum(mean + arg * std, rows.amax(-1))
    if p.sym:  # one bound, symmetric about 0
        bound = torch.maximum(lo.abs(), hi.abs())
        lo, hi = -bound, bound
    return lo.unsqueeze(2), hi.unsqueeze(2)


def least_error_range(x: torch.Tensor, p: QuantParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The `mse` observer: for each static scale group of p, the range (lo, hi), each
    (L, H|1, 1, G), among the percentile clips of MSE_PERCENTILES whose round trip through p
    (scales as static_scales makes them) loses the least squared error over x (L, H, T, D)."""
    x = x.float()
    best_lo = best_hi = best_error = None
    for percentile in MSE_PERCENTILES:
        lo, hi = observe(x, p, f"percentile:{percentile}")  # (L, H|1, 1, G) each
        scale, zero = compute_scales(torch.cat([lo, hi], 2), p, scale_dtype=torch.float32)
        codes, _ = quantize(x, p, scale, zero, count=False)
        error = (dequantize(codes, p, scale, zero) - x).square().sum(2, keepdim=True)  # (L,H,1,D)
        if lo.shape[1] == 1:  # per tensor: one range for every head
            error = error.sum(1, keepdim=True)
        error = error.unflatten(-1, (lo.shape[-1], -1)).sum(-1)  # (L, H|1, 1, G)
        if best_error is None:
            best_lo, best_hi, best_error = lo, hi, error
            continue
        better = error < best_error  # ties keep the wider range
        best_lo = torch.where(better, lo, best_lo)
        best_hi = torch.where(better, hi, best_hi)
        best_error = torch.where(better, error, best_error)
    return best_lo, best_hi
