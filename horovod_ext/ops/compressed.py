"""The registry ops that average a buffer through a compressor with error feedback
(``algorithms.compressed_average``): what ``hvd.SparseLoCo`` and ``hvd.Quantized`` share.

Each tensor of the buffer is compressed on its own, with its error kept under the tensor's name
(so requests may share a fusion buffer: DiLoCo's per-parameter requests travel in one
allgather, not one round trip each), and every rank's messages travel in one allgather.  With
HOROVOD_HIERARCHICAL_ALLREDUCE=1 and several nodes the average inside the node is exact and the
compressed step runs across nodes on each rank's shard.

Name your requests: an unnamed call gets a fresh name, hence fresh (zero) errors, every time.
"""
from typing import List

from horovod_ext.algorithms.codes import ByteCompressor
from horovod_ext.algorithms.compressed_average import (ErrorFeedback, Piece,
                                                       compressed_average_)
from horovod_ext.backends import trace
from horovod_ext.backends.hierarchy import Span

from .base import Op, layer_overlap


class CompressedAverageOp(Op):
    """The mean over ranks of each tensor compressed by ``config``, its error decayed by
    ``error_decay`` (0: no error is kept).  Subclasses set ``name`` and ``activity`` (the
    timeline's name of the step)."""
    floating_point_only = True
    activity = "COMPRESSED_AVERAGE"

    def __init__(self, config: ByteCompressor, error_decay: float):
        if not 0 <= error_decay <= 1:
            raise ValueError(f"{type(self).__name__} error_decay must be in [0, 1], got "
                             f"{error_decay!r}")
        self.config = config
        self.error_decay = float(error_decay)
        self.feedback = ErrorFeedback()

    def allreduce(self, buffer, layers, comms):
        flat = buffer.view(-1)

        def step(part, span: Span):
            pieces = _pieces(part, span.offset, layers)
            with trace.activity(self.activity, trace.nbytes_of(part)):
                compressed_average_(pieces, self.feedback, span.comm, self.config,
                                    self.error_decay)
            return part

        return comms.reduce(flat, step, node_average=True).view_as(buffer)

    @property
    def bytes_sent(self) -> int:
        """Bytes of this rank's messages so far (each goes to every other rank)."""
        return self.feedback.bytes_sent

    def state_dict(self) -> dict:
        """This rank's errors for every tensor (save one file per rank)."""
        return self.feedback.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.feedback.load_state_dict(state)

    def reset(self) -> None:
        self.feedback = ErrorFeedback()


def _pieces(part, offset: int, layers) -> List[Piece]:
    """The piece of each layer that ``part`` = buffer[offset:...] holds (whole layers, unless
    a hierarchical step cut the buffer into shards), under the layer's name: its error follows
    the tensor whatever buffer it travels in."""
    pieces = []
    for layer in layers or ():
        span = layer_overlap(layer, offset, part.numel())
        if span is not None:
            lo, hi = span
            pieces.append((layer.name, layer.numel, lo - layer.offset,
                           part[lo - offset:hi - offset]))
    return pieces or [("", part.numel(), 0, part)]
