"""``hvd.SparseLoCo(density, bits)``: SparseLoCo's compressed average as a registry op.

Each tensor of the buffer gets its error fed back (kept per tensor name, as ``hvd.OneBit``
keeps its errors), then the top ``density`` of each chunk of ``chunk`` elements, quantised to
``bits`` bits, travels in one allgather of every rank's message; every rank decompresses the
ranks' messages and averages them (algorithms/sparseloco).  Made for DiLoCo's outer step,
``hvd.DiLoCo(opt, op=hvd.SparseLoCo(), outer_momentum=0.0, outer_lr=1.0)`` as in the paper,
where the error feedback with its decay takes the place of the outer momentum; any request may
use it (``hvd.allreduce(t, op=hvd.SparseLoCo(...), name=...)``), for quantities that tolerate
being sent a little at a time.

Hierarchical allreduce (HOROVOD_HIERARCHICAL_ALLREDUCE=1 with several nodes): the average
inside the node is exact, the compressed step runs across nodes on each rank's shard.

Name your requests: an unnamed call gets a fresh name, hence fresh (zero) errors, every time.
"""
from typing import List, Tuple

from horovod_ext.algorithms.sparseloco import ChunkTopK, ErrorFeedback, sparse_average_
from horovod_ext.backends import trace
from horovod_ext.backends.hierarchy import Span

from .base import Op, layer_overlap
from .registry import configured_op


class SparseLoCoOp(Op):
    """The compressed average of SparseLoCo (Sarfi et al., 2025): per chunk of ``chunk``
    elements of each tensor, its ``density`` largest values in magnitude, as ``bits``-bit codes
    and their positions in the chunk, with error feedback decayed by ``error_decay``."""
    floating_point_only = True
    # Errors are kept per tensor: requests must never share a fusion buffer.
    fuse_across_requests = False

    def __init__(self, density: float = 1 / 64, bits: int = 2, chunk: int = 4096,
                 error_decay: float = 0.95):
        if not 0 <= error_decay <= 1:
            raise ValueError(f"SparseLoCo error_decay must be in [0, 1], got {error_decay!r}")
        self.config = ChunkTopK(float(density), chunk, bits)
        self.error_decay = float(error_decay)
        self.name = op_name(self.config, self.error_decay)
        self.feedback = ErrorFeedback()

    def allreduce(self, buffer, layers, comms):
        flat = buffer.view(-1)

        def step(part, span: Span):
            pieces = _pieces(part, span.offset, layers)
            with trace.activity("SPARSELOCO_COMPRESSED_AVERAGE", trace.nbytes_of(part)):
                sparse_average_(pieces, self.feedback, span.comm, self.config, self.error_decay)
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


def _pieces(part, offset: int, layers) -> List[Tuple[tuple, object]]:
    """(key, view) of each layer's overlap with ``part`` = buffer[offset:...]; the key names the
    layer and the overlap, so that errors follow the tensor."""
    pieces = []
    for layer in layers or ():
        span = layer_overlap(layer, offset, part.numel())
        if span is not None:
            lo, hi = span
            pieces.append(((layer.name, lo - layer.offset, hi - layer.offset),
                           part[lo - offset:hi - offset]))
    return pieces or [(("", 0, part.numel()), part)]


def op_name(config: ChunkTopK, error_decay: float) -> str:
    return (f"sparseloco_d{config.density:g}_b{config.bits}_c{config.chunk}"
            f"_e{error_decay:g}")


def SparseLoCo(density: float = 1 / 64, bits: int = 2, chunk: int = 4096,
               error_decay: float = 0.95) -> SparseLoCoOp:
    """SparseLoCo's compressed average (see ``SparseLoCoOp``), registered under a name that
    holds its settings; the same object for the same settings, so every rank may call this
    wherever it needs the op.  Defaults: 1/64 of each 4096-element chunk (1.6%), 2-bit values,
    error decay 0.95, as in the paper."""
    return configured_op(SparseLoCoOp(density, bits, chunk, error_decay))
