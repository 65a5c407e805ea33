"""The Adasum operator, per layer, on slices of fused buffers (paper section 3 and 4.4).

Adasum(a, b) = (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b, applied to each layer (tensor)
separately.  Where a and b stand for unequal numbers of ranks W_a and W_b (the tree over a count
that is not a power of two, see rvh.py) the 2 becomes the divisors d_a = (W_a + W_b) / W_a and
d_b = (W_a + W_b) / W_b: (1 - a.b / (d_a |a|^2)) a + (1 - a.b / (d_b |b|^2)) b, which still sums
orthogonal sides and gives the weighted mean (W_a a + W_b b) / (W_a + W_b) of parallel ones.  Equal
sides have d = 2.0 exactly, so the usual formula runs unchanged, bit for bit.

In recursive vector-halving a rank holds only a piece of each logical vector, so the work is
split in two: ``partial_dots`` gives a piece's share of [a.b, a.a, b.b] for every layer it
touches (summed over ranks by the caller), ``combine_`` applies the coefficients that follow.

Dot products and norms accumulate in float64 whatever the input dtype.  Tensors the fused kernels
serve (``compiled.used_for``: CUDA tensors by default) take those (``fused.py``: on an H200, 50x
faster than the torch code below).  float32 and float64 on the CPU go through C kernels
(``_kernels.c``, one call per piece, one pass over the data).  The torch code below serves the
rest (float16 and bfloat16 on the CPU, no compiler at install, HOROVOD_FUSED_KERNELS=off): it
converts slices chunk by chunk into a small float64 scratch (cache-sized, reused) rather than as
whole copies, which would cost a fresh allocation of twice the data.

The torch code runs on any device.  CPU tensors also take host-only shortcuts where they are
faster (the C kernels, numpy's reduceat, the C weights); ``HOST_CODE = False`` turns those off,
so that CPU tests run the code a CUDA tensor runs with the fused kernels off.
"""
import ctypes
from dataclasses import dataclass, field
from functools import cached_property
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from horovod_ext.backends import native
from horovod_ext.backends.scratch import Workspace

from .. import compiled
from . import fused

# Divisors (d_a, d_b) of two sides that stand for as many ranks each: the usual Adasum.
EQUAL = (2.0, 2.0)

# Elements converted to float64 at a time: two rows of this fit in L2 comfortably.
CHUNK = 1 << 16

# Whether CPU tensors may take the host-only code (C kernels, numpy, C weights).  Tests set it
# to False to run the device-generic torch code on CPU tensors: GPU tensors only ever take that
# code, and a machine without a GPU would otherwise never run it.
HOST_CODE = True


def _on_host(t: torch.Tensor) -> bool:
    return HOST_CODE and t.device.type == "cpu"


@dataclass(frozen=True)
class Segment:
    """Where layer ``layer`` overlaps a piece: elements [start, end) of the piece."""
    layer: int
    start: int
    end: int


class Piece:
    """The layers overlapping one range of a buffer: a (segments, 3) int64 table of
    [start, length, layer] relative to the range start, as the C kernels take it."""

    def __init__(self, table: np.ndarray, layer_count: int):
        self.table = np.ascontiguousarray(table, dtype=np.int64)
        self.layer_count = layer_count
        self.count = len(self.table)               # segments
        self.address = self.table.ctypes.data      # for the C kernels (numpy's is not free)

    @cached_property
    def segments(self) -> List[Segment]:
        return [Segment(int(layer), int(start), int(start + n)) for start, n, layer in self.table]

    @cached_property
    def items(self) -> List[Union[Segment, "Run"]]:
        return plan(self.segments)


class LayerMap:
    """Layer boundaries of a flat buffer, as sorted offsets, for slicing pieces quickly."""

    def __init__(self, bounds: Sequence[Tuple[int, int]]):
        """``bounds``: (offset, numel) per layer, in buffer order, back to back or with gaps."""
        table = np.asarray(bounds, dtype=np.int64).reshape(-1, 2)
        self.offsets = table[:, 0]
        self.ends = table[:, 0] + table[:, 1]
        self._pieces = {}
        self.plans = {}  # callers' per-buffer schedules (RVH levels), made once

    @property
    def count(self) -> int:
        return len(self.offsets)

    def piece(self, lo: int, hi: int) -> Piece:
        """The layers overlapping buffer range [lo, hi) (kept: the same ranges recur each step)."""
        found = self._pieces.get((lo, hi))
        if found is None:
            starts = np.maximum(self.offsets, lo)
            ends = np.minimum(self.ends, hi)
            keep = np.nonzero(ends > starts)[0]
            table = np.stack([starts[keep] - lo, ends[keep] - starts[keep], keep], axis=1)
            found = self._pieces[(lo, hi)] = Piece(table, self.count)
        return found

    def segments(self, lo: int, hi: int) -> List[Segment]:
        """The layers overlapping buffer range [lo, hi), as segments relative to ``lo``."""
        return self.piece(lo, hi).segments


_SEGMENTS_ARGS = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                  ctypes.c_void_p)
_LIB = native.load("horovod_ext.algorithms.adasum._kernels", {
    **{f"hx_adasum_{what}_{t}": _SEGMENTS_ARGS
       for what in ("dots", "combine") for t in ("f32", "f64")},
    "hx_adasum_coefficients": (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_double,
                               ctypes.c_double, ctypes.c_void_p)})
_KERNELS = {} if _LIB is None else {
    (what, dtype): getattr(_LIB, f"hx_adasum_{what}_{suffix}")
    for what in ("dots", "combine")
    for dtype, suffix in ((torch.float32, "f32"), (torch.float64, "f64"))}


def _kernel(what: str, a: torch.Tensor, b: torch.Tensor):
    """The C kernel for these tensors, or None where the torch code must run."""
    kernel = _KERNELS.get((what, a.dtype))
    return kernel if kernel is not None and HOST_CODE and native.takes(a.dtype, a, b) else None


class Kernels:
    """The C kernels of one dtype called on addresses: the hot loops of RVH and of the pair
    exchange run on pieces of one buffer, and every torch op (a slice, a small table) is slow
    right after a large transfer has evicted the caches: on mid-sized buffers those costs added
    up to more than the arithmetic.  Tables are numpy float64 arrays."""

    __slots__ = ("itemsize", "_dots", "_combine")

    def __init__(self, dtype: torch.dtype):
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self._dots = _KERNELS[("dots", dtype)]
        self._combine = _KERNELS[("combine", dtype)]

    def dots(self, a: int, b: int, piece: "Piece", out: int):
        """Adds [a.b, a.a, b.b] per layer of ``piece`` (vectors at addresses a and b) into the
        (layer_count, 3) float64 table at address ``out``."""
        if piece.count:
            self._dots(a, b, piece.address, piece.count, out)

    def combine(self, out: int, other: int, out_is_a: bool, dots: int, piece: "Piece",
                weights: int, divisors: Tuple[float, float] = EQUAL):
        """The vector at ``out`` becomes Adasum's weighted sum of it and the one at ``other``,
        per layer of ``piece``, from the (layer_count, 3) table at ``dots``; ``weights`` is a
        (layer_count, 2) float64 scratch table; ``divisors``: (d_a, d_b), see the module."""
        _LIB.hx_adasum_coefficients(dots, piece.layer_count, 0 if out_is_a else 1, *divisors,
                                    weights)
        if piece.count:
            self._combine(out, other, piece.address, piece.count, weights)


def kernels_for(t: torch.Tensor) -> Optional[Kernels]:
    """The C kernels for ``t`` (a contiguous CPU tensor of a dtype they handle), else None."""
    kernels = _KERNEL_OBJECTS.get(t.dtype)
    return kernels if kernels is not None and HOST_CODE and native.takes(t.dtype, t) else None


_KERNEL_OBJECTS = {dtype: Kernels(dtype) for (_, dtype) in _KERNELS}


# Segments shorter than this are handled together, a run of neighbours at a time, with a few
# vectorised ops per run instead of a few ops per segment (models have many small tensors).
SMALL = 4096


@dataclass(frozen=True)
class Run:
    """Consecutive small segments, [start, end) of the piece, handled as one."""
    start: int
    end: int
    layers: torch.Tensor    # layer index per segment
    lengths: torch.Tensor   # elements per segment
    # per device: the tables above there (copied once: a copy to a GPU per call and run would
    # cost more than the run's arithmetic), and the lengths repeated for the three product rows
    _on: dict = field(default_factory=dict, compare=False, repr=False)

    def on(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(layers, lengths, (3, segments) lengths) on ``device``."""
        found = self._on.get(device)
        if found is None:
            layers, lengths = self.layers.to(device), self.lengths.to(device)
            # segment_reduce takes lengths shaped like the data up to the reduced axis
            found = self._on[device] = (layers, lengths, lengths.expand(3, -1).contiguous())
        return found


def plan(segments: Sequence[Segment]) -> List[Union[Segment, Run]]:
    """Big segments alone; neighbouring small ones grouped into runs of at most CHUNK."""
    items: List[Union[Segment, Run]] = []
    group: List[Segment] = []

    def close():
        if len(group) == 1:
            items.append(group[0])
        elif group:
            items.append(Run(group[0].start, group[-1].end,
                             torch.tensor([g.layer for g in group]),
                             torch.tensor([g.end - g.start for g in group])))
        group.clear()

    for seg in segments:
        small = seg.end - seg.start < SMALL
        if not small or (group and (group[-1].end != seg.start
                                    or seg.end - group[0].start > CHUNK)):
            close()
        if small:
            group.append(seg)
        else:
            items.append(seg)
    close()
    return items


WORKSPACE = Workspace()


def _scratch(device, rows: int) -> torch.Tensor:
    """A (rows, CHUNK) float64 work area, reused from call to call."""
    return WORKSPACE.get("dots", rows * CHUNK, torch.float64, device).view(rows, CHUNK)


def _segment_sums(values: torch.Tensor, run: "Run") -> torch.Tensor:
    """(3, segments) sums of consecutive column ranges of ``values`` (3, m), on its device."""
    if _on_host(values):
        # numpy's reduceat, kept for the CPU: 1.7x faster than segment_reduce on runs of 8-element
        # segments, 5-7x on segments of 50 to 3000 elements (it sums pairwise, vectorised;
        # segment_reduce one element after the other)
        starts = (run.lengths.cumsum(0) - run.lengths).numpy()
        return torch.from_numpy(np.add.reduceat(values.numpy(), starts, axis=1))
    # each segment summed in order by one thread: the same bits on every rank and every run,
    # as the gather path needs (index_add_'s atomics on a GPU would not be); unsafe skips
    # validation that would cost two device syncs (plan() makes every length >= 1, summing to m)
    return torch.segment_reduce(values, "sum", lengths=run.on(values.device)[2], axis=1,
                                unsafe=True)


def partial_dots(a: torch.Tensor, b: torch.Tensor, piece: Piece) -> torch.Tensor:
    """[a.b, a.a, b.b] per layer (float64, shape (layer_count, 3)) over the segments of
    ``piece`` in the 1-D tensors ``a`` and ``b``; layers without a segment get zeros."""
    if compiled.used_for(a):
        return fused.partial_dots(a, b, piece)
    dots = torch.zeros(piece.layer_count, 3, dtype=torch.float64, device=a.device)
    if not len(piece.table):
        return dots
    kernel = _kernel("dots", a, b)
    if kernel is not None:
        kernel(a.data_ptr(), b.data_ptr(), piece.table.ctypes.data, len(piece.table),
               dots.data_ptr())
        return dots
    scratch = _scratch(a.device, 5)
    rows, products = scratch[:2], scratch[2:].reshape(-1)
    acc = torch.zeros(2, 2, dtype=torch.float64, device=a.device)
    for item in piece.items:
        if isinstance(item, Run):
            m = item.end - item.start
            x, y = rows[0, :m], rows[1, :m]
            x.copy_(a[item.start:item.end])
            y.copy_(b[item.start:item.end])
            run_products = products[:3 * m].view(3, m)  # contiguous: no copy for the sums
            torch.mul(x, y, out=run_products[0])
            torch.mul(x, x, out=run_products[1])
            torch.mul(y, y, out=run_products[2])
            dots[item.on(a.device)[0]] = _segment_sums(run_products, item).t()
            continue
        acc.zero_()
        for start in range(item.start, item.end, CHUNK):
            end = min(item.end, start + CHUNK)
            pair = rows[:, :end - start]
            pair[0].copy_(a[start:end])
            pair[1].copy_(b[start:end])
            # One pass over both rows gives all three products: [[aa, ab], [ab, bb]].
            acc.addmm_(pair, pair.t())
        dots[item.layer] = torch.stack([acc[0, 1], acc[0, 0], acc[1, 1]])
    return dots


def coefficients(dots: torch.Tensor, divisors: Tuple[float, float] = EQUAL) -> torch.Tensor:
    """(layer_count, 2) float64: the weights of a and of b, 1 - a.b / (d |side|^2) with
    ``divisors`` (d_a, d_b) (2.0 each for the usual Adasum, see the module).  A zero side weighs
    1, so the other side passes through unchanged and no NaN appears."""
    div_a, div_b = float(divisors[0]), float(divisors[1])
    if _LIB is not None and _on_host(dots):  # one call instead of ten small ops
        dots = dots.contiguous()
        weights = torch.empty(dots.shape[0], 2, dtype=torch.float64)
        _LIB.hx_adasum_coefficients(dots.data_ptr(), dots.shape[0], 0, div_a, div_b,
                                    weights.data_ptr())
        return weights
    ab, aa, bb = dots[:, 0], dots[:, 1], dots[:, 2]
    one = torch.ones_like(ab)
    ca = torch.where(aa > 0, 1.0 - ab / (div_a * aa.clamp_min(1e-300)), one)
    cb = torch.where(bb > 0, 1.0 - ab / (div_b * bb.clamp_min(1e-300)), one)
    return torch.stack([ca, cb], dim=1)


def combine_(out: torch.Tensor, other: torch.Tensor, out_is_a: bool,
             coeffs: torch.Tensor, piece: Piece) -> torch.Tensor:
    """out = c_out * out + c_other * other on every segment, in place; ``out_is_a`` says whether
    ``out`` holds the a side (left neighbour's vector) or the b side."""
    if not out_is_a:
        coeffs = coeffs.flip(1)
    if compiled.used_for(out):
        return fused.combine_(out, other, coeffs, piece)
    kernel = _kernel("combine", out, other)
    if kernel is not None and len(piece.table):
        weights = coeffs.contiguous()
        kernel(out.data_ptr(), other.data_ptr(), piece.table.ctypes.data, len(piece.table),
               weights.data_ptr())
        return out
    weights = coeffs.tolist()  # one device sync for all layers
    low_precision = out.dtype in (torch.float16, torch.bfloat16)
    work_dtype = torch.float32 if low_precision else out.dtype
    for item in piece.items:
        if isinstance(item, Run):
            layers, lengths, _ = item.on(out.device)
            # output_size: without it a GPU would sync to learn the length
            per_element = torch.repeat_interleave(coeffs[layers].to(work_dtype), lengths, dim=0,
                                                  output_size=item.end - item.start)
            dst, src = out[item.start:item.end], other[item.start:item.end]
            mixed = (dst.to(work_dtype) * per_element[:, 0]).addcmul_(src.to(work_dtype),
                                                                       per_element[:, 1])
            dst.copy_(mixed)
            continue
        c_out, c_other = weights[item.layer]
        # chunk by chunk, so that the second pass finds the chunk in cache
        for start in range(item.start, item.end, CHUNK):
            end = min(item.end, start + CHUNK)
            dst, src = out[start:end], other[start:end]
            if low_precision:  # one rounding instead of two
                dst.copy_(dst.float().mul_(c_out).add_(src.float(), alpha=c_other))
            else:
                dst.mul_(c_out).add_(src, alpha=c_other)
    return out


def adasum_pair_(a: torch.Tensor, b: torch.Tensor, layers: LayerMap,
                 divisors: Tuple[float, float] = EQUAL) -> torch.Tensor:
    """Adasum of two whole flat vectors, per layer, written into ``a``; returns ``a``.
    ``divisors``: (d_a, d_b) where the two stand for unequal numbers of ranks (see the module)."""
    piece = layers.piece(0, a.numel())
    return combine_(a, b, True, coefficients(partial_dots(a, b, piece), divisors), piece)
