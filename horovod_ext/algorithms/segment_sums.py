"""Sums over consecutive index ranges of a long tensor without a kernel per range: what the
fused kernels (``compiled``) use for per-segment sums (the 1-bit scales, Adasum's per-layer dot
products).

The values are summed over aligned rows of ``ROW`` elements (one reduction); the sum up to a
point is the sum of the whole rows before it, in float64, plus the part of its own row up to it
(one gathered row per point); a range's sum is the difference of the sums at its ends.  The
difference of two float64 prefixes loses about 1e-16 of the prefix, far below what a float32
segment sum resolves.
"""
import torch

ROW = 256


def prefix_at(values: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """[k, len(points)] float64: the sum of ``values[:, :p]`` (``values`` [k, n], n >= 1, rows
    summed in its dtype) at each int64 point p in [0, n]."""
    k, n = values.shape
    rows = n // ROW
    full = values[:, :rows * ROW].reshape(k, rows, ROW).sum(2).to(torch.float64)
    prefix = torch.cat([full.new_zeros(k, 1), full.cumsum(1)], dim=1)
    row = torch.div(points, ROW, rounding_mode="floor")
    cols = torch.arange(ROW, device=values.device)
    idx = ((row * ROW).unsqueeze(1) + cols).clamp(max=n - 1)
    inside = cols < (points - row * ROW).unsqueeze(1)
    part = torch.where(inside, values[:, idx], 0).sum(2).to(torch.float64)
    return prefix[:, row] + part
