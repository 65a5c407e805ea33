"""What the compressors that send a tensor as one byte string (SparseLoCo's top-k, the chunked
quantiser) share: their ``decompress`` contract, and codes of 2, 4 or 8 bits packed 8 / bits to
a byte (the first in the lowest bits)."""
import torch
import torch.nn.functional as F


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The uint8 bytes of ``bits``-bit codes (uint8, each < 2^bits), 8 / bits to a byte."""
    per = 8 // bits
    if per == 1:
        return codes
    padded = F.pad(codes, (0, -len(codes) % per)).view(-1, per)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (padded << shifts).sum(dim=1, dtype=torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` codes of ``packed`` (``pack_codes``' output), as uint8."""
    per = 8 // bits
    if per == 1:
        return packed[:count]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed[:, None] >> shifts) & ((1 << bits) - 1)).view(-1)[:count]


class ByteCompressor:
    """A compressor whose message is a uint8 tensor; subclasses write ``compress(x)`` and
    ``_dense(message, numel)``, the float32 tensor a non-empty message stands for."""

    def _dense(self, message: torch.Tensor, numel: int) -> torch.Tensor:
        raise NotImplementedError

    def decompress(self, message: torch.Tensor, numel: int, out: torch.Tensor = None,
                   add: bool = False) -> torch.Tensor:
        """The float32 tensor of ``numel`` elements that ``message`` stands for; written into
        (``add``: added to) the 1-D ``out`` when given."""
        if numel == 0:
            return out if out is not None else torch.zeros(0, device=message.device)
        dense = self._dense(message, numel)
        if out is None:
            return dense
        dense = dense.to(out.dtype)
        return out.add_(dense) if add else out.copy_(dense)
