"""1-bit compression: signs packed 8 per byte, one scale per segment; the public functions, which
run the C kernels where they can take the tensors and the torch code (``torch_code``) otherwise.

A segment of ``k`` values ``x`` compresses to its signs and the scale ``||x||_2 / sqrt(k)``, and
decompresses to ``sign * scale``, which has the same l2 norm as ``x`` (1-bit Adam section 4.3).
Zero encodes as +1 (bit set means ``x >= 0``), so a compressed value is never 0.  Scales are
rounded to the tensor's dtype (and carried as float32, float64 for float64 tensors), so that what
a receiver rebuilds is exactly what the sender subtracted into its error.

Bit ``i`` of byte ``k`` holds element ``8k + i``; the work runs over cache-sized blocks
(``blocks.Plan``) with reused scratch tensors (``blocks.Workspace``).  The torch code reads the
sign bit, which treats -0.0 as negative; the public functions add 0.0 first (-0.0 + 0.0 = +0.0),
and the compressed allreduce never produces -0.0 (its values are sums with +0.0-initialised
errors).

Contiguous float32 and float64 tensors on the CPU go through C kernels (``_kernels.c``: each
phase one call, one pass over the data) where setup.py could build them; they compute the same
values with the same IEEE operations, and the scales from float64 sums of squares (the torch code
combines float32 row norms in float64, so a scale may differ in its last bit between the two).
"""
import ctypes
from typing import Optional, Sequence, Tuple

import torch

from horovod_ext.backends import native

from . import fused, torch_code
from .. import compiled
from .blocks import BLOCK, Plan, Workspace, default_workspace, packed_bytes, scale_dtype

# BLOCK, Workspace, packed_bytes and scale_dtype are re-exported: callers size and reuse
# buffers for these functions
__all__ = ["BLOCK", "Workspace", "compensate_compress_", "compress", "decompress",
           "decompress_into", "default_workspace", "pack_signs", "packed_bytes", "scale_dtype",
           "segment_scales", "settle_error_", "unpack_signs"]

_P, _N = ctypes.c_void_p, ctypes.c_int64
_LIB = native.load("horovod_ext.algorithms.onebit._kernels", {
    **{f"hx_onebit_compress_{t}": (_P, _P, _N, _P, _N, _P, _P, _N, _P, _P, _N, _P, _P)
       for t in ("f32", "f64")},
    **{f"hx_onebit_decompress_{t}": (_P, _N, _P, _N, _P, _P) for t in ("f32", "f64")},
    **{f"hx_onebit_settle_{t}": (_P, _N, _P, _N, _P) for t in ("f32", "f64")}})
# (phase, dtype) -> kernel
_KERNELS = {} if _LIB is None else {
    (phase, dtype): getattr(_LIB, f"hx_onebit_{phase}_{t}")
    for phase in ("compress", "decompress", "settle")
    for dtype, t in ((torch.float32, "f32"), (torch.float64, "f64"))}


def _native(phase: str, data: Sequence[Optional[torch.Tensor]],
            packed: Sequence[torch.Tensor] = ()):
    """The C kernel of ``phase`` when it can take these tensors (``data``: float32 or float64
    like the first; ``packed``: bytes of signs), else None: the torch code runs."""
    kernel = _KERNELS.get((phase, data[0].dtype))
    if kernel is None or not (native.takes(data[0].dtype, *data)
                              and native.takes(torch.uint8, *packed)):
        return None
    return kernel


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def settle_error_(error: torch.Tensor, scales: torch.Tensor, lengths: Sequence[int],
                  ws: Optional[Workspace] = None) -> torch.Tensor:
    """Finish a deferred error update: ``error -= scale * sign(error)`` per segment, where
    ``error`` holds a compensated tensor that was compressed with ``scales``."""
    if compiled.used_for(error):
        return fused.settle_error_(error, scales, lengths)
    ws = ws or default_workspace()
    plan = ws.plan(error.numel(), lengths, error.device)
    kernel = _native("settle", [error])
    if kernel is None:
        return torch_code.settle_error_(error, scales, plan, ws)
    s = scales.to(error.dtype).contiguous()
    kernel(error.data_ptr(), error.numel(), plan.lengths_i64.data_ptr(), len(plan.lengths),
           s.data_ptr())
    return error


def compensate_compress_(error: torch.Tensor, lengths: Sequence[int], out: torch.Tensor,
                         ws: Workspace, pending: Optional[torch.Tensor] = None,
                         dense: Optional[torch.Tensor] = None,
                         packed: Sequence[Tuple[torch.Tensor, torch.Tensor]] = (),
                         divisor: int = 1) -> torch.Tensor:
    """One pass over blocks of the flat ``error`` (any floating dtype, no -0.0 in it):

    1. if ``pending`` (scales of the previous call), finish its deferred update
       ``error -= scale * sign(error)``;
    2. add ``dense`` (the input), and/or the sum, in rank order and in the scale dtype, of the
       decompressed ``packed`` = [(signs, scales)] with every scale divided by ``divisor``;
    3. pack the signs of the result (now the compensated tensor, left in ``error`` so that the
       error update is deferred to the next call or ``settle_error_``) into ``out``;

    returns the result's per-segment scales (``segment_scales``)."""
    if compiled.used_for(error) and error.numel():
        return fused.compensate_compress_(error, lengths, out, pending, dense, packed, divisor)
    plan = ws.plan(error.numel(), lengths, error.device)
    if _native("compress", [error, dense], [out, *(signs for signs, _ in packed)]) is not None:
        return _compress_native(error, error, plan, out, pending=pending, dense=dense,
                                packed=packed, divisor=divisor)
    return torch_code.compensate_compress_(error, plan, out, ws, pending, dense, packed, divisor)


def _compress_native(src: torch.Tensor, dst: Optional[torch.Tensor], plan: Plan,
                     out: torch.Tensor, pending: Optional[torch.Tensor] = None,
                     dense: Optional[torch.Tensor] = None,
                     packed: Sequence[Tuple[torch.Tensor, torch.Tensor]] = (),
                     divisor: int = 1, normalise: bool = False) -> torch.Tensor:
    """``compensate_compress_`` (or, with ``normalise`` and no ``dst``, ``compress``) in one C
    call; returns the per-segment scales."""
    dtype = src.dtype
    nseg = len(plan.lengths)
    pend = None if pending is None else pending.to(dtype).contiguous()
    parts = None
    signs = None
    if packed:
        # as the torch code: the scale divided by n in the scale dtype (= dtype here)
        parts = torch.stack([s.to(dtype) if divisor == 1 else (s / divisor).to(dtype)
                             for _, s in packed]).contiguous()
        signs = (ctypes.c_void_p * len(packed))(*[t.data_ptr() for t, _ in packed])
    sumsq = torch.zeros(nseg, dtype=torch.float64)
    _KERNELS[("compress", dtype)](
        src.data_ptr(), _ptr(dst), src.numel(), plan.lengths_i64.data_ptr(), nseg, _ptr(pend),
        _ptr(dense), len(packed), signs, _ptr(parts), int(normalise), out.data_ptr(),
        sumsq.data_ptr())
    return (sumsq.sqrt_() / plan.counts_f64.sqrt()).to(dtype).to(scale_dtype(dtype))


def decompress_into(packed: torch.Tensor, scales: torch.Tensor, lengths: Sequence[int],
                    out: torch.Tensor, ws: Workspace) -> torch.Tensor:
    """``sign * scale`` of the flat ``out`` (its dtype), segment ``i`` scaled by ``scales[i]``."""
    if compiled.used_for(out):
        return fused.decompress_into(packed, scales, lengths, out)
    plan = ws.plan(out.numel(), lengths, out.device)
    kernel = _native("decompress", [out], [packed])
    if kernel is None:
        return torch_code.decompress_into(packed, scales, plan, out, ws)
    s = scales.to(out.dtype).contiguous()
    kernel(packed.data_ptr(), out.numel(), plan.lengths_i64.data_ptr(), len(plan.lengths),
           s.data_ptr(), out.data_ptr())
    return out


def pack_signs(x: torch.Tensor, out: Optional[torch.Tensor] = None,
               ws: Optional[Workspace] = None) -> torch.Tensor:
    """Signs of the flat tensor ``x`` (1 bit each, set for ``x >= 0``) in ``ceil(numel / 8)``
    bytes, or in the first bytes of ``out``; unused bits of the last byte are set."""
    x = x.reshape(-1)
    ws = ws or default_workspace()
    if out is None:
        out = torch.empty(packed_bytes(x.numel()), dtype=torch.uint8, device=x.device)
    if compiled.used_for(x) and x.numel():
        return fused.pack_signs(x, out)
    plan = ws.plan(x.numel(), [x.numel()] if x.numel() else [], x.device)
    return torch_code.pack_signs(x, plan, out, ws)


def unpack_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype,
                 scale: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The first ``numel`` signs in ``packed`` as +1/-1 of ``dtype`` (times the 0-d ``scale``,
    rounded to ``dtype``, when given); written into ``out`` (flat, ``numel`` long) if given."""
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=packed.device)
    if numel == 0:
        return out
    scale = torch.ones((), dtype=dtype) if scale is None else scale
    return decompress_into(packed, scale.reshape(1), [numel], out, default_workspace())


def segment_scales(x: torch.Tensor, lengths: Sequence[int],
                   ws: Optional[Workspace] = None) -> torch.Tensor:
    """``||s||_2 / sqrt(len(s))`` of each consecutive segment ``s`` of the flat ``x`` (lengths
    > 0, summing to ``x.numel()``), rounded to x's dtype, as a tensor of ``scale_dtype``."""
    if compiled.used_for(x) and x.numel():
        return fused.segment_scales(x, lengths)
    ws = ws or default_workspace()
    plan = ws.plan(x.numel(), lengths, x.device)
    return torch_code.segment_scales(x, plan, ws)


def compress(x: torch.Tensor, lengths: Optional[Sequence[int]] = None,
             out: Optional[torch.Tensor] = None,
             ws: Optional[Workspace] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(packed signs, per-segment scales) of the flat ``x``; one segment unless ``lengths``;
    ``out`` as in ``pack_signs``.  One pass over cache-sized blocks."""
    x = x.reshape(-1)
    ws = ws or default_workspace()
    lengths = [x.numel()] if lengths is None else list(lengths)
    if out is None:
        out = torch.empty(packed_bytes(x.numel()), dtype=torch.uint8, device=x.device)
    if compiled.used_for(x) and x.numel():
        return out, fused.compress(x, lengths, out)
    plan = ws.plan(x.numel(), lengths, x.device)
    if _native("compress", [x], [out]) is not None:
        return out, _compress_native(x, None, plan, out, normalise=True)
    return out, torch_code.compress(x, plan, out, ws)


def decompress(packed: torch.Tensor, scales: torch.Tensor, lengths: Sequence[int],
               dtype: torch.dtype, out: Optional[torch.Tensor] = None,
               ws: Optional[Workspace] = None) -> torch.Tensor:
    """``sign * scale`` (in ``dtype``) of ``sum(lengths)`` elements, segment ``i`` scaled by
    ``scales[i]``; written into ``out`` when given."""
    lengths = list(lengths)
    if out is None:
        out = torch.empty(sum(lengths), dtype=dtype, device=packed.device)
    return decompress_into(packed, scales, lengths, out, ws or default_workspace())
