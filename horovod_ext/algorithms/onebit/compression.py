"""1-bit compression: signs packed 8 per byte, one scale per segment, with torch ops only.

A segment of ``k`` values ``x`` compresses to its signs and the scale ``||x||_2 / sqrt(k)``, and
decompresses to ``sign * scale``, which has the same l2 norm as ``x`` (1-bit Adam section 4.3).
Zero encodes as +1 (bit set means ``x >= 0``), so a compressed value is never 0.  Scales are
rounded to the tensor's dtype (and carried as float32, float64 for float64 tensors), so that what
a receiver rebuilds is exactly what the sender subtracted into its error.

Bit ``i`` of byte ``k`` holds element ``8k + i``.  Everything is memory-bound, so the work runs
over blocks that stay in the CPU cache, several steps per block, with reused scratch tensors
(on GPUs one block is the whole tensor).  Packing reads the sign bit of the float's bit pattern
with an arithmetic shift of its integer view (a float comparison into a bool tensor is several
times slower in torch on CPU), narrows the 0 / -1 flags to bytes, and gathers the 8 flags of an
int64 word into its top byte with one multiplication.  Unpacking looks every byte up in a
256 x 8 table of signs times the scale.  The error update ``e - scale * sign(e)`` builds
``copysign(scale, e)`` from the sign bit and the scale's bits with two integer operations.

The sign bit treats -0.0 as negative; the public functions add 0.0 first (-0.0 + 0.0 = +0.0), and
the compressed allreduce never produces -0.0 (its values are sums with +0.0-initialised errors).

Contiguous float32 and float64 tensors on the CPU go through C kernels (``_kernels.c``: each
phase one call, one pass over the data) where setup.py could build them; they compute the same
values with the same IEEE operations, and the scales from float64 sums of squares (the torch code
combines float32 row norms in float64, so a scale may differ in its last bit between the two).
"""
import ctypes
import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from horovod_ext.backends import native
from horovod_ext.backends.scratch import Workspace as SharedWorkspace

# Flags f_i (0/1) at bits 8i of a word; times this constant, f_i lands on bit 56 + i and no two
# partial products share a bit, so the top byte is sum f_i 2^i (the product wraps mod 2^64).
_GATHER = 0x0102040810204080
_LOW_BITS = 0x0101010101010101
# Elements per block on CPU: a block's float and integer scratch stays in L2.
BLOCK = 1 << 18
_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_TABLES: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}
_LOCAL = threading.local()


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


def packed_bytes(numel: int) -> int:
    return (numel + 7) // 8


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scales travel in: float64 for float64 tensors, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def sign_table(dtype: torch.dtype, device) -> torch.Tensor:
    """[256, 8]: row ``b`` holds the 8 signs (+1/-1) that byte ``b`` encodes."""
    key = (dtype, torch.device(device))
    table = _TABLES.get(key)
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = (bits * 2 - 1).to(dtype=dtype, device=device).contiguous()
        _TABLES[key] = table
    return table


class Workspace(SharedWorkspace):
    """Scratch tensors (reused, see horovod_ext.backends.scratch) plus cached block plans."""

    def __init__(self):
        super().__init__()
        self.plans: Dict[tuple, "Plan"] = {}

    def plan(self, numel: int, lengths: Sequence[int], device) -> "Plan":
        block = BLOCK if torch.device(device).type == "cpu" else max(8, numel)
        key = (numel, tuple(lengths), block)
        plan = self.plans.get(key)
        if plan is None:
            if len(self.plans) > 64:
                self.plans.clear()
            plan = self.plans[key] = Plan(numel, lengths, block)
        return plan


def default_workspace() -> Workspace:
    """This thread's workspace for the public functions."""
    ws = getattr(_LOCAL, "workspace", None)
    if ws is None:
        ws = _LOCAL.workspace = Workspace()
    return ws


class Plan:
    """Blocks of a flat tensor (multiples of 8 elements, so whole bytes) cut by segments:
    ``blocks`` holds (lo, hi, [(piece lo, piece hi, segment, first norm slot)]).  A piece's
    norm is taken over rows of ``ROW`` elements (one slot each, plus one for the rest): torch's
    float32 norm of a long vector is off by ~2e-5, of short rows by ~1e-7."""

    ROW = 256

    def __init__(self, numel: int, lengths: Sequence[int], block: int):
        bounds = [0]
        for length in lengths:
            bounds.append(bounds[-1] + length)
        if bounds[-1] != numel:
            raise ValueError(f"segment lengths sum to {bounds[-1]}, the tensor has {numel}")
        self.lengths = list(lengths)
        self.blocks: List[Tuple[int, int, List[Tuple[int, int, int, int]]]] = []
        slot_segs: List[int] = []
        seg = 0
        for lo in range(0, numel, block):
            hi = min(lo + block, numel)
            pieces = []
            while seg < len(lengths) and bounds[seg] < hi:
                a, b = max(bounds[seg], lo), min(bounds[seg + 1], hi)
                if a < b:
                    pieces.append((a, b, seg, len(slot_segs)))
                    slot_segs += [seg] * ((b - a) // self.ROW + ((b - a) % self.ROW > 0))
                if bounds[seg + 1] <= hi:
                    seg += 1
                else:
                    break
            self.blocks.append((lo, hi, pieces))
        self.slots = len(slot_segs)
        self.slot_segs = slot_segs
        self._segs: Dict[torch.device, torch.Tensor] = {}
        # for the C kernels: segment lengths, and the float64 counts the scales divide by
        self.lengths_i64 = torch.tensor(self.lengths, dtype=torch.int64)
        self.counts_f64 = self.lengths_i64.double()

    def slot_segments(self, device) -> torch.Tensor:
        t = self._segs.get(device)
        if t is None:
            t = self._segs[device] = torch.tensor(self.slot_segs, device=device)
        return t


def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT[t.element_size()])


def _sign_mask(t: torch.Tensor) -> int:
    return -(1 << (8 * t.element_size() - 1))


def _scale_bits(scales: torch.Tensor, dtype: torch.dtype):
    """Bit patterns of the scales rounded to ``dtype``: Python ints on CPU (cheaper operands),
    0-d tensors elsewhere (no device synchronisation)."""
    bits = scales.to(dtype).view(_INT[torch.finfo(dtype).bits // 8])
    return bits.tolist() if bits.device.type == "cpu" else list(bits)


def _pack_block(c: torch.Tensor, out: torch.Tensor, ws: Workspace) -> None:
    """Signs of the flat block ``c`` (no -0.0 in it) into ``out`` (``ceil(len / 8)`` bytes)."""
    m = c.numel()
    full = m - m % 8
    ci = _int_view(c)
    if full:
        flags = ws.get("flags", full, ci.dtype, c.device)
        torch.bitwise_right_shift(ci[:full], 8 * c.element_size() - 1, out=flags)  # 0 or -1
        octets = ws.get("octets", full, torch.uint8, c.device)
        octets.copy_(flags)  # narrowing: 0x00 or 0xFF
        words = octets.view(torch.int64)
        words.bitwise_and_(_LOW_BITS).mul_(_GATHER).bitwise_right_shift_(56).bitwise_xor_(0xFF)
        out[:full // 8].copy_(words)  # narrowing keeps the low byte
    if full < m:
        flags = torch.ones(8, dtype=torch.bool, device=c.device)
        flags[:m - full] = ci[full:] >= 0
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=c.device)
        out[full // 8] = (flags.to(torch.uint8) * weights).sum(dtype=torch.uint8)


def _unpack_block(packed: torch.Tensor, out: torch.Tensor, table: torch.Tensor,
                  ws: Workspace) -> None:
    """``table`` rows of the bytes ``packed`` into the flat block ``out``."""
    m = out.numel()
    full = m - m % 8
    nbytes = packed_bytes(m)
    index = ws.get("index", nbytes, torch.int32, out.device)
    index.copy_(packed[:nbytes])
    if full:
        torch.index_select(table, 0, index[:full // 8], out=out[:full].view(-1, 8))
    if full < m:
        out[full:].copy_(table[index[full // 8].long()][:m - full])


class _Tables:
    """Sign tables times ``factor * scales[segment]`` (in ``dtype``), made on first use."""

    def __init__(self, scales: torch.Tensor, dtype: torch.dtype, device, divisor: int = 1):
        s = scales.to(dtype)
        self.scales = s if divisor == 1 else (scales / divisor).to(dtype)
        self.unit = sign_table(dtype, device)
        self._made: Dict[int, torch.Tensor] = {}

    def __getitem__(self, seg: int) -> torch.Tensor:
        t = self._made.get(seg)
        if t is None:
            t = self._made[seg] = self.unit * self.scales[seg]
        return t


def _decompress_block(packed: torch.Tensor, out: torch.Tensor, lo: int,
                      pieces: List[Tuple[int, int, int]], tables: _Tables,
                      ws: Workspace) -> None:
    """Block ``out`` (starting at element ``lo``) of the decompressed tensor."""
    if len(pieces) == 1:
        _unpack_block(packed, out, tables[pieces[0][2]], ws)
        return
    _unpack_block(packed, out, tables.unit, ws)
    for a, b, seg, _ in pieces:   # a loop over layers, not elements
        out[a - lo:b - lo].mul_(tables.scales[seg])


def _apply_error_(e: torch.Tensor, bits, ws: Workspace) -> None:
    """``e -= copysign(scale, e)`` for a piece of one segment; ``bits``: the scale's bits."""
    tmp = ws.get("copysign", e.numel(), e.dtype, e.device)
    ti = _int_view(tmp)
    torch.bitwise_and(_int_view(e), _sign_mask(e), out=ti)
    ti.bitwise_or_(bits)
    e.sub_(tmp)


def _norms(piece: torch.Tensor, out: torch.Tensor) -> None:
    """Norms of the rows of ``Plan.ROW`` elements of ``piece`` (and of the rest) into ``out``."""
    rows, rest = divmod(piece.numel(), Plan.ROW)
    if rows:
        torch.linalg.vector_norm(piece[:rows * Plan.ROW].view(rows, Plan.ROW), dim=1,
                                 dtype=out.dtype, out=out[:rows])
    if rest:
        torch.linalg.vector_norm(piece[rows * Plan.ROW:], dtype=out.dtype, out=out[rows])


def _finish_scales(norms: torch.Tensor, plan: Plan, dtype: torch.dtype) -> torch.Tensor:
    """Per-segment ``||segment|| / sqrt(length)`` from the norms of its rows, rounded to
    ``dtype``."""
    sdtype = scale_dtype(dtype)
    total = torch.zeros(len(plan.lengths), dtype=torch.float64, device=norms.device)
    total.index_add_(0, plan.slot_segments(norms.device), norms.to(torch.float64).square())
    counts = torch.tensor(plan.lengths, dtype=torch.float64, device=norms.device)
    return (total.sqrt() / counts.sqrt()).to(dtype).to(sdtype)


def settle_error_(error: torch.Tensor, scales: torch.Tensor, lengths: Sequence[int],
                  ws: Optional[Workspace] = None) -> torch.Tensor:
    """Finish a deferred error update: ``error -= scale * sign(error)`` per segment, where
    ``error`` holds a compensated tensor that was compressed with ``scales``."""
    ws = ws or default_workspace()
    plan = ws.plan(error.numel(), lengths, error.device)
    kernel = _native("settle", [error])
    if kernel is not None:
        s = scales.to(error.dtype).contiguous()
        kernel(
            error.data_ptr(), error.numel(), plan.lengths_i64.data_ptr(), len(plan.lengths),
            s.data_ptr())
        return error
    bits = _scale_bits(scales, error.dtype)
    for _, _, pieces in plan.blocks:
        for a, b, seg, _ in pieces:
            _apply_error_(error[a:b], bits[seg], ws)
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
    dtype = error.dtype
    sdtype = scale_dtype(dtype)
    plan = ws.plan(error.numel(), lengths, error.device)
    if _native("compress", [error, dense], [out, *(signs for signs, _ in packed)]) is not None:
        return _compress_native(error, error, plan, out, pending=pending, dense=dense,
                                packed=packed, divisor=divisor)
    norms = ws.get("norms", plan.slots, sdtype, error.device)
    bits = _scale_bits(pending, dtype) if pending is not None else None
    tables = [_Tables(s, sdtype, error.device, divisor) for _, s in packed]
    for lo, hi, pieces in plan.blocks:
        e = error[lo:hi]
        if bits is not None:
            for a, b, seg, _ in pieces:
                _apply_error_(error[a:b], bits[seg], ws)
        if dense is not None:
            e.add_(dense[lo:hi])
        if packed:
            m, blo, bhi = hi - lo, lo // 8, packed_bytes(hi)
            total = ws.get("total", m, sdtype, e.device)
            part = ws.get("part", m, sdtype, e.device)
            for j, ((signs, _), t) in enumerate(zip(packed, tables)):
                _decompress_block(signs[blo:bhi], total if j == 0 else part, lo, pieces, t, ws)
                if j:
                    total.add_(part)
            if sdtype != dtype:
                narrow = ws.get("narrow", m, dtype, e.device)
                total = narrow.copy_(total)
            e.add_(total)
        for a, b, _, slot in pieces:
            _norms(error[a:b], norms[slot:])
        _pack_block(e, out[lo // 8:packed_bytes(hi)], ws)
    return _finish_scales(norms, plan, dtype)


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
    plan = ws.plan(out.numel(), lengths, out.device)
    kernel = _native("decompress", [out], [packed])
    if kernel is not None:
        s = scales.to(out.dtype).contiguous()
        kernel(
            packed.data_ptr(), out.numel(), plan.lengths_i64.data_ptr(), len(plan.lengths),
            s.data_ptr(), out.data_ptr())
        return out
    tables = _Tables(scales, out.dtype, out.device)
    for lo, hi, pieces in plan.blocks:
        _decompress_block(packed[lo // 8:packed_bytes(hi)], out[lo:hi], lo, pieces, tables, ws)
    return out


def _normalised(x: torch.Tensor, ws: Workspace) -> torch.Tensor:
    """``x + 0.0`` (turns -0.0 into +0.0, which encodes as +1) in a scratch tensor."""
    return torch.add(x, 0.0, out=ws.get("normalised", x.numel(), x.dtype, x.device))


def pack_signs(x: torch.Tensor, out: Optional[torch.Tensor] = None,
               ws: Optional[Workspace] = None) -> torch.Tensor:
    """Signs of the flat tensor ``x`` (1 bit each, set for ``x >= 0``) in ``ceil(numel / 8)``
    bytes, or in the first bytes of ``out``; unused bits of the last byte are set."""
    x = x.reshape(-1)
    ws = ws or default_workspace()
    if out is None:
        out = torch.empty(packed_bytes(x.numel()), dtype=torch.uint8, device=x.device)
    plan = ws.plan(x.numel(), [x.numel()] if x.numel() else [], x.device)
    for lo, hi, _ in plan.blocks:
        _pack_block(_normalised(x[lo:hi], ws), out[lo // 8:packed_bytes(hi)], ws)
    return out


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
    ws = ws or default_workspace()
    plan = ws.plan(x.numel(), lengths, x.device)
    norms = ws.get("norms", plan.slots, scale_dtype(x.dtype), x.device)
    for _, _, pieces in plan.blocks:
        for a, b, _, slot in pieces:
            _norms(x[a:b], norms[slot:])
    return _finish_scales(norms, plan, x.dtype)


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
    plan = ws.plan(x.numel(), lengths, x.device)
    if _native("compress", [x], [out]) is not None:
        return out, _compress_native(x, None, plan, out, normalise=True)
    norms = ws.get("norms", plan.slots, scale_dtype(x.dtype), x.device)
    for lo, hi, pieces in plan.blocks:
        block = _normalised(x[lo:hi], ws)
        for a, b, _, slot in pieces:
            _norms(block[a - lo:b - lo], norms[slot:])
        _pack_block(block, out[lo // 8:packed_bytes(hi)], ws)
    return out, _finish_scales(norms, plan, x.dtype)


def decompress(packed: torch.Tensor, scales: torch.Tensor, lengths: Sequence[int],
               dtype: torch.dtype, out: Optional[torch.Tensor] = None,
               ws: Optional[Workspace] = None) -> torch.Tensor:
    """``sign * scale`` (in ``dtype``) of ``sum(lengths)`` elements, segment ``i`` scaled by
    ``scales[i]``; written into ``out`` when given."""
    lengths = list(lengths)
    if out is None:
        out = torch.empty(sum(lengths), dtype=dtype, device=packed.device)
    return decompress_into(packed, scales, lengths, out, ws or default_workspace())
