"""``hvd.SparseLoCo(density, bits)``: SparseLoCo's compressed average as a registry op.

Each tensor of the buffer gets its error fed back, then the top ``density`` of each chunk of
``chunk`` elements, quantised to ``bits`` bits, travels in one allgather of every rank's message;
every rank decompresses the ranks' messages and averages them (``ops.compressed``).  Made for
DiLoCo's outer step, ``hvd.DiLoCo(opt, op=hvd.SparseLoCo(), outer_momentum=0.0, outer_lr=1.0)``
as in the paper, where the error feedback with its decay takes the place of the outer momentum;
any request may use it (``hvd.allreduce(t, op=hvd.SparseLoCo(...), name=...)``), for quantities
that tolerate being sent a little at a time.
"""
from horovod_ext.algorithms.sparseloco import ChunkTopK

from .compressed import CompressedAverageOp
from .registry import configured_op


class SparseLoCoOp(CompressedAverageOp):
    """The compressed average of SparseLoCo (Sarfi et al., 2025): per chunk of ``chunk``
    elements of each tensor, its ``density`` largest values in magnitude, as ``bits``-bit codes
    and their positions in the chunk, with error feedback decayed by ``error_decay``."""
    activity = "SPARSELOCO_COMPRESSED_AVERAGE"

    def __init__(self, density: float = 1 / 64, bits: int = 2, chunk: int = 4096,
                 error_decay: float = 0.95):
        super().__init__(ChunkTopK(float(density), chunk, bits), error_decay)
        self.name = op_name(self.config, self.error_decay)


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
