"""Chunked top-k with quantised values, as one byte string per tensor.

A tensor of n elements is cut into chunks of ``chunk`` elements (the last one padded with
zeros; a tensor smaller than a chunk is one chunk of its own size), and in each chunk the k
elements largest in magnitude are kept, k = max(1, round(density * chunk)).  The message of a
tensor holds, for all its chunks in turn:

- two float32 magnitudes per chunk (below);
- the k positions inside each chunk, as the smallest unsigned type that holds them (uint8 up to
  256 elements a chunk, 16 bits up to 65536): not int64 indices into the tensor;
- the k values as ``bits``-bit codes, packed 8 / bits to a byte: a sign bit and bits - 1 bits
  of magnitude, on 2^(bits-1) levels spread evenly between the chunk's smallest and largest kept
  magnitude (the centre of each level's interval is what comes out);
- zeros up to a multiple of 4 bytes (so that messages laid end to end stay aligned).

Its length depends only on (n, chunk, density, bits), so every rank's message for the same
tensor has the same length.  ``decompress`` is exact about what ``compress`` kept: the sender
feeds back ``x - decompress(compress(x))`` and every receiver reconstructs the same values.
At chunk 4096, density 1/64 and 2 bits a chunk costs 8 + 64 * 2 + 16 = 152 bytes against 16384
in float32: 108x fewer (54x against float16).
"""

from dataclasses import dataclass
from typing import Tuple

import torch
import torch.nn.functional as F

from horovod_ext.algorithms.codes import ByteCompressor, pack_codes, unpack_codes

BITS = (2, 4, 8)


@dataclass(frozen=True)
class ChunkTopK(ByteCompressor):
    density: float = 1 / 64
    chunk: int = 4096
    bits: int = 2

    def __post_init__(self):
        if not 0 < self.density <= 1:
            raise ValueError(f"SparseLoCo density must be in (0, 1], got {self.density!r}")
        if not isinstance(self.chunk, int) or not 1 <= self.chunk <= 1 << 16:
            raise ValueError(f"SparseLoCo chunk must be an integer from 1 to 65536, got "
                             f"{self.chunk!r}")
        if self.bits not in BITS:
            raise ValueError(f"SparseLoCo bits must be one of {BITS}, got {self.bits!r}")

    # --- the message's layout --------------------------------------------------------------
    def layout(self, numel: int) -> Tuple[int, int, int]:
        """(elements a chunk, chunks, kept a chunk) for a tensor of ``numel`` elements."""
        size = max(1, min(self.chunk, numel))
        return size, -(-numel // size), max(1, min(size, round(self.density * size)))

    def _index_bytes(self, size: int) -> int:
        return 1 if size <= 1 << 8 else 2

    def nbytes(self, numel: int) -> int:
        """The length of the message of a tensor of ``numel`` elements."""
        if numel == 0:
            return 0
        return sum(self._parts(numel))

    def _parts(self, numel: int) -> Tuple[int, int, int, int]:
        """Bytes of the message's scales, positions, codes and padding."""
        size, chunks, k = self.layout(numel)
        parts = (chunks * 8, chunks * k * self._index_bytes(size), -(-chunks * k * self.bits // 8))
        return parts + (-sum(parts) % 4,)

    # --- compress and decompress -----------------------------------------------------------
    def compress(self, x: torch.Tensor) -> torch.Tensor:
        """The uint8 message of the 1-D float tensor ``x`` (on its device)."""
        if x.numel() == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        size, chunks, k = self.layout(x.numel())
        rows = F.pad(x.float(), (0, chunks * size - x.numel())).view(chunks, size)
        magnitude, where = rows.abs().topk(k, dim=1, sorted=False)
        negative = rows.gather(1, where) < 0
        low = magnitude.min(dim=1).values
        high = magnitude.max(dim=1).values
        levels = 1 << (self.bits - 1)
        step = (high - low) / levels
        level = ((magnitude - low[:, None]) / step.clamp_min(1e-30)[:, None]).floor()
        codes = level.clamp_(0, levels - 1).to(torch.uint8) | (negative.to(torch.uint8)
                                                               << (self.bits - 1))
        index = where.to(torch.uint8 if self._index_bytes(size) == 1 else torch.int16)
        padding = torch.zeros(self._parts(x.numel())[3], dtype=torch.uint8, device=x.device)
        return torch.cat([torch.stack([low, high], dim=1).reshape(-1).view(torch.uint8),
                          index.reshape(-1).view(torch.uint8),
                          pack_codes(codes.view(-1), self.bits),
                          padding])

    def _dense(self, message: torch.Tensor, numel: int) -> torch.Tensor:
        size, chunks, k = self.layout(numel)
        scale_bytes, index_bytes, code_bytes, _ = self._parts(numel)
        scales = message[:scale_bytes].view(torch.float32).view(chunks, 2)
        index = message[scale_bytes:scale_bytes + index_bytes]
        index = (index.long() if self._index_bytes(size) == 1
                 else index.view(torch.int16).long() & 0xFFFF).view(chunks, k)
        codes = unpack_codes(message[scale_bytes + index_bytes:][:code_bytes], self.bits,
                             chunks * k)
        low, high = scales[:, :1], scales[:, 1:]
        levels = 1 << (self.bits - 1)
        magnitude = low + ((codes & (levels - 1)).float().view(chunks, k) + 0.5) * (
            (high - low) / levels)
        values = torch.where((codes >> (self.bits - 1)).view(chunks, k).bool(), -magnitude,
                             magnitude)
        rows = torch.zeros(chunks, size, dtype=torch.float32, device=message.device)
        rows.scatter_(1, index, values)
        return rows.view(-1)[:numel]

