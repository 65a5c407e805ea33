"""The Adasum operator, per layer, on slices of fused buffers (paper section 3 and 4.4).

Adasum(a, b) = (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b, applied to each layer (tensor)
separately.  In recursive vector-halving a rank holds only a piece of each logical vector, so the
work is split in two: ``partial_dots`` gives a piece's share of [a.b, a.a, b.b] for every layer it
touches (summed over ranks by the caller), ``combine_`` applies the coefficients that follow.

Dot products and norms accumulate in float64 whatever the input dtype: slices are converted
chunk by chunk into a small float64 scratch (cache-sized, reused) rather than as whole copies,
which would cost a fresh allocation of twice the data.
"""
import bisect
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

# Elements converted to float64 at a time: two rows of this fit in L2 comfortably.
CHUNK = 1 << 16


@dataclass(frozen=True)
class Segment:
    """Where layer ``layer`` overlaps a piece: elements [start, end) of the piece."""
    layer: int
    start: int
    end: int


class LayerMap:
    """Layer boundaries of a flat buffer, as sorted offsets, for slicing pieces quickly."""

    def __init__(self, bounds: Sequence[Tuple[int, int]]):
        """``bounds``: (offset, numel) per layer, in buffer order, back to back or with gaps."""
        self.offsets = [int(o) for o, _ in bounds]
        self.ends = [int(o) + int(n) for o, n in bounds]

    @property
    def count(self) -> int:
        return len(self.offsets)

    def segments(self, lo: int, hi: int) -> List[Segment]:
        """The layers overlapping buffer range [lo, hi), as segments relative to ``lo``."""
        out = []
        i = max(0, bisect.bisect_right(self.offsets, lo) - 1)
        while i < len(self.offsets) and self.offsets[i] < hi:
            s, e = max(self.offsets[i], lo), min(self.ends[i], hi)
            if e > s:
                out.append(Segment(i, s - lo, e - lo))
            i += 1
        return out


def partial_dots(a: torch.Tensor, b: torch.Tensor, segments: Sequence[Segment],
                 layer_count: int) -> torch.Tensor:
    """[a.b, a.a, b.b] per layer (float64, shape (layer_count, 3)) over the given segments of
    the 1-D tensors ``a`` and ``b``; layers without a segment get zeros."""
    dots = torch.zeros(layer_count, 3, dtype=torch.float64, device=a.device)
    if not segments:
        return dots
    scratch = torch.empty(2, min(CHUNK, max(s.end - s.start for s in segments)),
                          dtype=torch.float64, device=a.device)
    for seg in segments:
        acc = torch.zeros(2, 2, dtype=torch.float64, device=a.device)
        for start in range(seg.start, seg.end, CHUNK):
            end = min(seg.end, start + CHUNK)
            rows = scratch[:, :end - start]
            rows[0].copy_(a[start:end])
            rows[1].copy_(b[start:end])
            # One pass over both rows gives all three products: [[aa, ab], [ab, bb]].
            acc.addmm_(rows, rows.t())
        dots[seg.layer, 0] = acc[0, 1]
        dots[seg.layer, 1] = acc[0, 0]
        dots[seg.layer, 2] = acc[1, 1]
    return dots


def coefficients(dots: torch.Tensor) -> torch.Tensor:
    """(layer_count, 2) float64: the weights of a and of b.  A zero side weighs 1, so the other
    side passes through unchanged and no NaN appears."""
    ab, aa, bb = dots[:, 0], dots[:, 1], dots[:, 2]
    one = torch.ones_like(ab)
    ca = torch.where(aa > 0, 1.0 - ab / (2.0 * aa.clamp_min(1e-300)), one)
    cb = torch.where(bb > 0, 1.0 - ab / (2.0 * bb.clamp_min(1e-300)), one)
    return torch.stack([ca, cb], dim=1)


def combine_(out: torch.Tensor, other: torch.Tensor, out_is_a: bool,
             coeffs: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
    """out = c_out * out + c_other * other on every segment, in place; ``out_is_a`` says whether
    ``out`` holds the a side (left neighbour's vector) or the b side."""
    weights = coeffs.tolist()  # one device sync for all layers
    low_precision = out.dtype in (torch.float16, torch.bfloat16)
    for seg in segments:
        ca, cb = weights[seg.layer]
        c_out, c_other = (ca, cb) if out_is_a else (cb, ca)
        dst, src = out[seg.start:seg.end], other[seg.start:seg.end]
        if low_precision:  # one rounding instead of two
            dst.copy_(dst.float().mul_(c_out).add_(src.float(), alpha=c_other))
        else:
            dst.mul_(c_out).add_(src, alpha=c_other)
    return out


def adasum_pair_(a: torch.Tensor, b: torch.Tensor, layers: LayerMap) -> torch.Tensor:
    """Adasum of two whole flat vectors, per layer, written into ``a``; returns ``a``."""
    segments = layers.segments(0, a.numel())
    coeffs = coefficients(partial_dots(a, b, segments, layers.count))
    return combine_(a, b, True, coeffs, segments)
