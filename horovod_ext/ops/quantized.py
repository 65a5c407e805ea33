"""``hvd.Quantized(bits, chunk)``: the average of tensors sent as ``bits``-bit codes with one
float32 scale a chunk, as a registry op.

Made for DiLoCo's outer step: ``hvd.DiLoCo(opt, op=hvd.Quantized(bits=8))`` sends the
pseudo-gradient in int8 as INTELLECT-1 did, ``bits=4`` as Streaming DiLoCo's outer gradients.
Every rank's message travels in one allgather and every rank averages what the messages stand
for, in rank order, so all hold the same values (``ops.compressed``).  ``error_decay`` > 0 keeps
what rounding lost and adds it to the next call's tensor of the same name (0, the default,
keeps nothing: a pseudo-gradient's rounding error is small against the next one).
"""
from horovod_ext.algorithms.quantize import ChunkQuantize

from .compressed import CompressedAverageOp
from .registry import configured_op


class QuantizedOp(CompressedAverageOp):
    """The mean over ranks of each tensor quantised per chunk of ``chunk`` elements to
    ``bits``-bit codes on even levels up to the chunk's largest magnitude."""
    activity = "QUANTIZED_AVERAGE"

    def __init__(self, bits: int = 8, chunk: int = 256, error_decay: float = 0.0):
        super().__init__(ChunkQuantize(bits, chunk), error_decay)
        self.name = f"quantized_b{bits}_c{chunk}_e{self.error_decay:g}"


def Quantized(bits: int = 8, chunk: int = 256, error_decay: float = 0.0) -> QuantizedOp:
    """The quantised average (see ``QuantizedOp``), registered under a name that holds its
    settings; the same object for the same settings on every call.  ``bits`` is 2, 4 or 8;
    defaults: 8 bits, a scale every 256 elements (8.125 bits a value, 3.9x fewer bytes than
    float32), no error feedback."""
    return configured_op(QuantizedOp(bits, chunk, error_decay))
