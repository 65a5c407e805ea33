"""Adasum's per-layer dot products and combine as fused kernels (``compiled``: Triton on GPUs),
which ``operator`` calls for the tensors the fused kernels serve (CUDA tensors by default).  On an
H200 an Adasum of two 256 MiB vectors in 100 layers takes 1.5 ms this way against 79 ms in the
torch code (``benchmarks/gpu.py``'s ``adasum_pair`` rows); on CPU tensors the C kernels are
10-20x faster than these (the C++ backend), so CPU tensors take them only under
HOROVOD_FUSED_KERNELS=all, as the tests do.

``partial_dots``: [a.b, a.a, b.b] of each segment of a piece, in float64 as the torch code, from
``segment_sums.prefix_at`` (a segment is the difference of the sums at its end and start); they
match the torch code's to about 1e-12 relative (another order of summation; tests state it).
``combine_``: ``c_out * out + c_other * other`` on every segment, elements outside every segment
(gaps between layers) unchanged, float16 and bfloat16 computed in float32 and rounded once, as the
torch code does.
"""
from typing import Tuple

import torch

from .. import compiled
from ..segment_sums import prefix_at

def _segments_on(piece, device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(starts, ends, layers) of the piece's segments on ``device``, kept on the piece (pieces
    are kept by their LayerMap, and recur every step)."""
    made = piece.__dict__.setdefault("_fused_segments", {})
    found = made.get(device)
    if found is None:
        table = torch.from_numpy(piece.table)       # [start, length, layer]
        starts = table[:, 0].contiguous()
        found = made[device] = (starts.to(device), (starts + table[:, 1]).to(device),
                                table[:, 2].contiguous().to(device))
    return found


@compiled.kernel
def _dots(a: torch.Tensor, b: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
          layers: torch.Tensor, layer_count: int) -> torch.Tensor:
    x, y = a.to(torch.float64), b.to(torch.float64)
    at = prefix_at(torch.stack([x * y, x * x, y * y]), torch.cat([starts, ends]))
    count = starts.shape[0]
    sums = at[:, count:] - at[:, :count]
    return sums.new_zeros(layer_count, 3).index_copy(0, layers, sums.t())


@compiled.kernel
def _combine(out: torch.Tensor, other: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
             layers: torch.Tensor, coeffs: torch.Tensor) -> None:
    i = torch.arange(out.numel(), device=out.device)
    seg = (torch.bucketize(i, starts, right=True) - 1).clamp(min=0)
    inside = (i >= starts[seg]) & (i < ends[seg])
    work = torch.float32 if out.dtype in (torch.float16, torch.bfloat16) else out.dtype
    weights = coeffs.to(work)[layers[seg]]
    mixed = out.to(work) * weights[:, 0] + other.to(work) * weights[:, 1]
    out.copy_(torch.where(inside, mixed, out.to(work)).to(out.dtype))


def partial_dots(a: torch.Tensor, b: torch.Tensor, piece) -> torch.Tensor:
    """As ``operator.partial_dots``: (layer_count, 3) float64."""
    if not piece.count or a.numel() == 0:
        return torch.zeros(piece.layer_count, 3, dtype=torch.float64, device=a.device)
    starts, ends, layers = _segments_on(piece, a.device)
    return _dots(a, b, starts, ends, layers, piece.layer_count)


def combine_(out: torch.Tensor, other: torch.Tensor, coeffs: torch.Tensor,
             piece) -> torch.Tensor:
    """``out = coeffs[:, 0] * out + coeffs[:, 1] * other`` per segment's layer, in place."""
    if piece.count and out.numel():
        starts, ends, layers = _segments_on(piece, out.device)
        _combine(out, other, starts, ends, layers, coeffs.to(out.device))
    return out
