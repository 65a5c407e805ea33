"""The torch code of 1-bit compression: what GPUs run, and CPUs where the C kernels are not built.

Bit ``i`` of byte ``k`` holds element ``8k + i``.  Everything is memory-bound, so the work runs
over blocks that stay in the CPU cache (``blocks.Plan``), several steps per block, with reused
scratch tensors.  Packing reads the sign bit of the float's bit pattern with an arithmetic shift
of its integer view (a float comparison into a bool tensor is several times slower in torch on
CPU), narrows the 0 / -1 flags to bytes, and gathers the 8 flags of an int64 word into its top
byte with one multiplication.  Unpacking looks every byte up in a 256 x 8 table of signs times
the scale.  The error update ``e - scale * sign(e)`` builds ``copysign(scale, e)`` from the sign
bit and the scale's bits with two integer operations.

Each phase function takes the plan and workspace that ``compression`` chose, and computes what
its namesake there documents.
"""
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .blocks import Plan, Workspace, packed_bytes, scale_dtype

# Flags f_i (0/1) at bits 8i of a word; times this constant, f_i lands on bit 56 + i and no two
# partial products share a bit, so the top byte is sum f_i 2^i (the product wraps mod 2^64).
_GATHER = 0x0102040810204080
_LOW_BITS = 0x0101010101010101
_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_TABLES: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}


def sign_table(dtype: torch.dtype, device) -> torch.Tensor:
    """[256, 8]: row ``b`` holds the 8 signs (+1/-1) that byte ``b`` encodes."""
    key = (dtype, torch.device(device))
    table = _TABLES.get(key)
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = (bits * 2 - 1).to(dtype=dtype, device=device).contiguous()
        _TABLES[key] = table
    return table


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


def _normalised(x: torch.Tensor, ws: Workspace) -> torch.Tensor:
    """``x + 0.0`` (turns -0.0 into +0.0, which encodes as +1) in a scratch tensor."""
    return torch.add(x, 0.0, out=ws.get("normalised", x.numel(), x.dtype, x.device))


def _add_decompressed_(e: torch.Tensor, lo: int, hi: int, pieces,
                       packed: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                       tables: Sequence[_Tables], ws: Workspace) -> None:
    """``e`` (block [lo, hi)) += the sum, in rank order and in the scale dtype, of that block
    of every decompressed ``packed`` part."""
    dtype = e.dtype
    sdtype = scale_dtype(dtype)
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


def settle_error_(error: torch.Tensor, scales: torch.Tensor, plan: Plan,
                  ws: Workspace) -> torch.Tensor:
    bits = _scale_bits(scales, error.dtype)
    for _, _, pieces in plan.blocks:
        for a, b, seg, _ in pieces:
            _apply_error_(error[a:b], bits[seg], ws)
    return error


def compensate_compress_(error: torch.Tensor, plan: Plan, out: torch.Tensor, ws: Workspace,
                         pending: Optional[torch.Tensor],
                         dense: Optional[torch.Tensor],
                         packed: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                         divisor: int) -> torch.Tensor:
    dtype = error.dtype
    sdtype = scale_dtype(dtype)
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
            _add_decompressed_(e, lo, hi, pieces, packed, tables, ws)
        for a, b, _, slot in pieces:
            _norms(error[a:b], norms[slot:])
        _pack_block(e, out[lo // 8:packed_bytes(hi)], ws)
    return _finish_scales(norms, plan, dtype)


def decompress_into(packed: torch.Tensor, scales: torch.Tensor, plan: Plan, out: torch.Tensor,
                    ws: Workspace) -> torch.Tensor:
    tables = _Tables(scales, out.dtype, out.device)
    for lo, hi, pieces in plan.blocks:
        _decompress_block(packed[lo // 8:packed_bytes(hi)], out[lo:hi], lo, pieces, tables, ws)
    return out


def pack_signs(x: torch.Tensor, plan: Plan, out: torch.Tensor, ws: Workspace) -> torch.Tensor:
    for lo, hi, _ in plan.blocks:
        _pack_block(_normalised(x[lo:hi], ws), out[lo // 8:packed_bytes(hi)], ws)
    return out


def segment_scales(x: torch.Tensor, plan: Plan, ws: Workspace) -> torch.Tensor:
    norms = ws.get("norms", plan.slots, scale_dtype(x.dtype), x.device)
    for _, _, pieces in plan.blocks:
        for a, b, _, slot in pieces:
            _norms(x[a:b], norms[slot:])
    return _finish_scales(norms, plan, x.dtype)


def compress(x: torch.Tensor, plan: Plan, out: torch.Tensor, ws: Workspace) -> torch.Tensor:
    """Packs the signs of ``x`` into ``out``; returns the per-segment scales."""
    norms = ws.get("norms", plan.slots, scale_dtype(x.dtype), x.device)
    for lo, hi, pieces in plan.blocks:
        block = _normalised(x[lo:hi], ws)
        for a, b, _, slot in pieces:
            _norms(block[a - lo:b - lo], norms[slot:])
        _pack_block(block, out[lo // 8:packed_bytes(hi)], ws)
    return _finish_scales(norms, plan, x.dtype)
