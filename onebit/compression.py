"""1-bit compression: signs packed 8 per byte, one scale per segment, with torch ops only.

A segment of ``k`` values ``x`` compresses to its signs and the scale ``||x||_2 / sqrt(k)``, and
decompresses to ``sign * scale``, which has the same l2 norm as ``x`` (1-bit Adam section 4.3).
Zero encodes as +1 (bit set means ``x >= 0``), so a compressed value is never 0.  Scales are
rounded to the tensor's dtype (and carried as float32, float64 for float64 tensors), so that what
a receiver rebuilds is exactly what the sender subtracted into its error.

Bit ``i`` of byte ``k`` holds element ``8k + i``.  Packing compares into a bool tensor, reads it
as int64 words (8 flags each) and gathers the 8 flags of a word into its top byte with one
multiplication; unpacking looks every byte up in a 256 x 8 table of signs (already multiplied by
the scale when there is one scale).  Both run on CPU and CUDA alike.
"""
from typing import Dict, Optional, Sequence, Tuple

import torch

# Flags f_i (0/1) at bits 8i of a word; times this constant, f_i lands on bit 56 + i and no two
# partial products share a bit, so the top byte is sum f_i 2^i (the product wraps mod 2^64).
_GATHER = 0x0102040810204080
_TABLES: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}


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


def pack_signs(x: torch.Tensor, out: Optional[torch.Tensor] = None,
               mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Signs of the flat tensor ``x`` (1 bit each, set for ``x >= 0``) in ``ceil(numel / 8)``
    bytes, or in the first bytes of ``out``; unused bits of the last byte are set.  ``mask``: an
    optional bool workspace of at least ``numel`` elements (reusing one saves page faults)."""
    x = x.reshape(-1)
    n = x.numel()
    nbytes = packed_bytes(n)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    full = n - n % 8
    if full:
        flags = torch.ge(x[:full], 0) if mask is None else torch.ge(x[:full], 0, out=mask[:full])
        words = flags.view(torch.uint8).view(torch.int64)
        words.mul_(_GATHER).bitwise_right_shift_(56)
        out[:full // 8].copy_(words)  # narrowing keeps the low byte
    if full < n:
        flags = torch.ones(8, dtype=torch.bool, device=x.device)
        flags[:n - full] = x[full:] >= 0
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=x.device)
        out[full // 8] = (flags.to(torch.uint8) * weights).sum(dtype=torch.uint8)
    return out


def unpack_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype,
                 scale: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The first ``numel`` signs in ``packed`` as +1/-1 of ``dtype`` (times the 0-d ``scale``,
    rounded to ``dtype``, when given); written into ``out`` (flat, ``numel`` long) if given."""
    table = sign_table(dtype, packed.device)
    if scale is not None:
        table = table * scale.to(dtype)
    nbytes = packed_bytes(numel)
    index = packed[:nbytes].to(torch.int32)
    if out is not None and numel % 8 == 0:
        torch.index_select(table, 0, index, out=out.view(-1, 8))
        return out
    signs = table.index_select(0, index).view(-1)[:numel]
    if out is not None:
        return out.copy_(signs)
    return signs


def segment_scales(x: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """``||s||_2 / sqrt(len(s))`` of each consecutive segment ``s`` of the flat ``x`` (lengths
    > 0, summing to ``x.numel()``), rounded to x's dtype, as a tensor of ``scale_dtype``."""
    sdtype = scale_dtype(x.dtype)
    if len(lengths) == 1:
        norms = torch.linalg.vector_norm(x, dtype=sdtype).reshape(1)
    else:
        # one norm per layer: a loop over layers, not elements
        norms = torch.stack([torch.linalg.vector_norm(s, dtype=sdtype)
                             for s in torch.split(x, list(lengths))])
    counts = torch.tensor(list(lengths), dtype=sdtype, device=x.device)
    return (norms / counts.sqrt()).to(x.dtype).to(sdtype)


def compress(x: torch.Tensor, lengths: Optional[Sequence[int]] = None,
             out: Optional[torch.Tensor] = None,
             mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(packed signs, per-segment scales) of the flat ``x``; one segment unless ``lengths``;
    ``out`` and ``mask`` as in ``pack_signs``."""
    x = x.reshape(-1)
    lengths = [x.numel()] if lengths is None else list(lengths)
    return pack_signs(x, out, mask), segment_scales(x, lengths)


def decompress(packed: torch.Tensor, scales: torch.Tensor, lengths: Sequence[int],
               dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sign * scale`` (in ``dtype``) of ``sum(lengths)`` elements, segment ``i`` scaled by
    ``scales[i]``; written into ``out`` when given."""
    lengths = list(lengths)
    numel = sum(lengths)
    if len(lengths) == 1:
        return unpack_signs(packed, numel, dtype, scales[0], out)
    values = unpack_signs(packed, numel, dtype, None, out)
    for segment, scale in zip(torch.split(values, lengths), scales.to(dtype)):
        segment.mul_(scale)   # a loop over layers, not elements
    return values
