"""The registry op ``hvd.OneBit``: error-compensated 1-bit average (1-bit SGD style).

``hvd.allreduce(t, op=hvd.OneBit, name="g")`` returns the 1-bit compressed average of ``t`` over
all ranks (``onebit.compressed_allreduce_``), with worker and server errors kept per request name
so that what one call loses is sent by the next call of the same name.  From
``DistributedOptimizer(op=hvd.OneBit)`` each gradient (or group) is one request, compressed with
one scale per layer.  With ``HOROVOD_HIERARCHICAL_ALLREDUCE=1`` and several nodes, the average
inside each node is exact and only the cross-node step is compressed.

Name your requests: an unnamed call gets a fresh name, hence fresh (zero) errors, every time.
"""
from typing import Dict, Tuple

from horovod_ext.algorithms.onebit.compressed_allreduce import ErrorFeedback, compressed_step

from .base import Op
from .registry import register_op


class OneBitOp(Op):
    """``hvd.OneBit``: the 1-bit compressed allreduce of 1-bit Adam (Tang et al., 2021): each
    tensor is sent as its signs and one scale (32x fewer bytes than float32), with the
    compression error fed back into the next call on both the worker and the server side.
    Meant for momentum or other smooth quantities; ``hvd.OnebitAdam`` and ``hvd.OnebitLamb`` use
    it after their warm-up."""
    name = "onebit"
    floating_point_only = True
    # Errors are kept per request: requests must never share a fusion buffer.
    fuse_across_requests = False

    def __init__(self):
        self._errors: Dict[Tuple[str, ...], ErrorFeedback] = {}


    def allreduce(self, buffer, layers, comms):
        key = tuple(layer.name for layer in layers)
        errors = self._errors.get(key)
        if errors is None:
            errors = self._errors[key] = ErrorFeedback()
        # Hierarchical: only the cross-node step is compressed, the node's average is exact.
        step = compressed_step(errors, buffer.numel(), [layer.numel for layer in layers])
        return comms.reduce(buffer, step, node_average=True)

    # --- inspection and checkpoints --------------------------------------------------------
    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent in compressed allreduces of this op, all names together."""
        return sum(e.bytes_sent for e in self._errors.values())

    def errors(self, name: str) -> ErrorFeedback:
        """The error state of the request ``name`` (a grouped request: its first tensor's name
        ``name.0``)."""
        for key, value in self._errors.items():
            if key[0] in (name, name + ".0"):
                return value
        raise KeyError(f"op onebit has no error state for {name!r}")

    def state_dict(self) -> dict:
        """This rank's errors for every name (save one file per rank)."""
        return {"errors": [(list(key), e.state_dict()) for key, e in self._errors.items()]}

    def load_state_dict(self, state: dict) -> None:
        self._errors = {}
        for names, value in state["errors"]:
            errors = ErrorFeedback()
            errors.load_state_dict(value)
            self._errors[tuple(names)] = errors

    def reset(self) -> None:
        """Forget every error (e.g. when the model changes)."""
        self._errors = {}


OneBit = register_op(OneBitOp())
