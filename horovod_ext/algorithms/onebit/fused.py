"""The 1-bit codec as fused kernels (``compiled``: Triton on GPUs): what CUDA tensors run.

The same values as ``torch_code``, computed over the flat index ``i`` in a few passes instead of
one kernel per step and segment: element ``i``'s segment is found by ``bucketize`` in the
segment bounds, its bit is bit ``i % 8`` of byte ``i // 8``.  Scales come from sums of squares per
segment (``segment_sums.prefix_at``: for float32 data the scale matches the torch code's to a few
units in the last place; tests state the tolerance).
"""
from typing import Dict, Optional, Sequence, Tuple

import torch

from .. import compiled
from ..segment_sums import prefix_at
from .blocks import packed_bytes, scale_dtype

_BOUNDS: Dict[tuple, Tuple[torch.Tensor, Optional[torch.Tensor]]] = {}


def bounds(lengths: Sequence[int], device) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """([0, l0, l0 + l1, ..., numel], the inner bounds or None for one segment) as int64 on
    ``device``, kept (callers repeat lengths).  The inner bounds are a tensor of their own, not
    a slice: Inductor's Triton bucketize misreads a boundaries tensor with a storage offset."""
    key = (tuple(lengths), torch.device(device))
    made = _BOUNDS.get(key)
    if made is None:
        if len(_BOUNDS) > 64:
            _BOUNDS.clear()
        b = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
        edges = b[1:-1].clone().to(device) if len(lengths) > 1 else None
        made = _BOUNDS[key] = (b.to(device), edges)
    return made


def _per_element(scales: torch.Tensor, n: int, edges: Optional[torch.Tensor]) -> torch.Tensor:
    """Each element's scale: ``scales[segment]``, the segment found in ``edges``."""
    if edges is None:
        return scales[0]
    return scales[torch.bucketize(torch.arange(n, device=scales.device), edges, right=True)]


def _bits(signs: torch.Tensor, n: int) -> torch.Tensor:
    """Bit ``i % 8`` of byte ``i // 8`` of ``signs`` for i < n, as bool: a broadcast over
    [bytes, 8], which the kernels index directly (a gather at ``i // 8`` would be an indirect,
    bounds-checked load)."""
    shifts = torch.arange(8, device=signs.device, dtype=torch.int32)
    bits = (signs[:(n + 7) // 8].to(torch.int32).unsqueeze(1) >> shifts) & 1
    return bits.bool().reshape(-1)[:n]


def _signed(bits: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.where(bits, s, -s)


def _scales(x: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per segment ``||x_seg|| / sqrt(len)`` rounded to ``dtype``, as the scale dtype."""
    at = prefix_at(x.to(scale_dtype(dtype)).square().unsqueeze(0), b)[0]
    sums = (at[1:] - at[:-1]).clamp(min=0)
    counts = (b[1:] - b[:-1]).to(torch.float64)
    return (sums.sqrt() / counts.sqrt()).to(dtype).to(scale_dtype(dtype))


def _pack(x: torch.Tensor) -> torch.Tensor:
    """Signs (bit set for x >= 0; -0.0 counts as +0.0) into bytes, unused bits of the last set."""
    n = x.numel()
    padded = torch.nn.functional.pad(x, (0, (-n) % 8), value=1.0)
    flags = (padded.view(-1, 8) >= 0).to(torch.int32)
    return (flags << torch.arange(8, device=x.device, dtype=torch.int32)).sum(1).to(torch.uint8)


@compiled.kernel
def _compress(x: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return _pack(x), _scales(x, b, x.dtype)


@compiled.kernel
def _decompress(signs: torch.Tensor, scales: torch.Tensor, edges: Optional[torch.Tensor],
                out: torch.Tensor) -> None:
    n = out.numel()
    out.copy_(_signed(_bits(signs, n), _per_element(scales.to(out.dtype), n, edges)))


@compiled.kernel
def _settle(error: torch.Tensor, scales: torch.Tensor, edges: Optional[torch.Tensor]) -> None:
    s = _per_element(scales.to(error.dtype), error.numel(), edges)
    error.sub_(torch.copysign(s, error))


def _compensate(error: torch.Tensor, b: torch.Tensor, edges: Optional[torch.Tensor],
                pending: Optional[torch.Tensor], dense: Optional[torch.Tensor],
                parts: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                divisor: int) -> Tuple[torch.Tensor, torch.Tensor]:
    n = error.numel()
    sdtype = scale_dtype(error.dtype)
    e = error
    if pending is not None:
        e = e - torch.copysign(_per_element(pending.to(error.dtype), n, edges), e)
    if dense is not None:
        e = e + dense
    if parts:
        total = None
        for signs, s in parts:   # in rank order, in the scale dtype, as the torch code
            s = s.to(sdtype) if divisor == 1 else (s / divisor).to(sdtype)
            term = _signed(_bits(signs, n), _per_element(s, n, edges))
            total = term if total is None else total + term
        e = e + total.to(error.dtype)
    error.copy_(e)
    return _pack(e), _scales(e, b, error.dtype)


_compensate_kernel = compiled.kernel(_compensate)


def compress(x: torch.Tensor, lengths: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """Signs of the flat ``x`` into ``out``; returns the per-segment scales."""
    packed, scales = _compress(x, bounds(lengths, x.device)[0])
    out[:packed.numel()].copy_(packed)
    return scales


def decompress_into(packed: torch.Tensor, scales: torch.Tensor, lengths: Sequence[int],
                    out: torch.Tensor) -> torch.Tensor:
    if out.numel():
        _decompress(packed, scales.to(out.device), bounds(lengths, out.device)[1], out)
    return out


def settle_error_(error: torch.Tensor, scales: torch.Tensor,
                  lengths: Sequence[int]) -> torch.Tensor:
    _settle(error, scales.to(error.device), bounds(lengths, error.device)[1])
    return error


def compensate_compress_(error: torch.Tensor, lengths: Sequence[int], out: torch.Tensor,
                         pending: Optional[torch.Tensor], dense: Optional[torch.Tensor],
                         parts: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                         divisor: int) -> torch.Tensor:
    b, edges = bounds(lengths, error.device)
    packed, scales = _compensate_kernel(error, b, edges, pending, dense,
                                        [tuple(p) for p in parts], divisor)
    out[:packed.numel()].copy_(packed)
    return scales


def segment_scales(x: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    return _segment_scales(x, bounds(lengths, x.device)[0])


@compiled.kernel
def _segment_scales(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _scales(x, b, x.dtype)


def pack_signs(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out[:packed_bytes(x.numel())].copy_(_pack_kernel(x))
    return out


_pack_kernel = compiled.kernel(_pack)
