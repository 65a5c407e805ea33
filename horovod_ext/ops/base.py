"""The contract every reduction op fulfils: ``Op`` declares each hook the engine, the fusion
buffers and DistributedOptimizer may call, with its default, so nothing outside an op's own
module asks its type, its name or ``hasattr``.

An op receives one fused flat buffer, the per-tensor boundaries inside it (``Layer``) and the
collectives it may use (``backends.collectives.Collectives``: flat or hierarchical, the world
and the node).  Ops travel between ranks by name (``ops.registry``).
"""
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from horovod_ext.backends.base import ReduceOp
from horovod_ext.backends.collectives import Collectives


@dataclass(frozen=True)
class Layer:
    """One tensor inside a fusion buffer; ``name`` is stable across steps (the request's name,
    with ``.i`` appended for the i-th tensor of a grouped request), so stateful ops key their
    per-tensor state (error feedback) by it."""
    offset: int
    numel: int
    shape: Tuple[int, ...]
    name: str = ""


class Op:
    """Base class of reduction ops.  Subclasses set ``name`` and implement ``allreduce``; every
    other hook has a default that suits a stateless op."""

    name: str = ""
    # The elementwise reduction when the op is one (Sum, Min, ...): its ``allreduce`` is then
    # exactly ``comms.allreduce(buffer, reduce_op)`` followed by ``finish_``, which lets the
    # engine reduce in shared memory, through prepared calls and by reduce-scatter.  None for
    # ops with an algorithm of their own.
    reduce_op: Optional[ReduceOp] = None
    # An elementwise op whose result is divided by the number of ranks (Average; integer
    # tensors truncated toward zero, as Horovod does).
    averages: bool = False
    # False for ops that keep state per fusion buffer (error feedback): the engine then never
    # fuses separate requests, so each buffer holds the same tensors every step.
    fuse_across_requests: bool = True
    # True for ops that reduce a bucket's layers together (PowerSGD sends the factors of all a
    # bucket's matrices in one allreduce each, as DDP's hook does): DistributedOptimizer then
    # reduces its gradients in fixed groups of consecutive layers, DDP's buckets, one request
    # each with the tensors' boundaries, instead of one request per gradient.
    layer_buckets: bool = False
    # True for ops whose arithmetic needs real numbers (compression, dot products)
    floating_point_only: bool = False
    # The registered op whose result on inputs already divided by the number of ranks is this
    # op's result (Average: "sum"), or None: DistributedOptimizer may then divide each gradient
    # as it copies it into its bucket, as DDP does, instead of in a pass after the transfer.
    sum_of_divided: Optional[str] = None
    # True for ops whose step on one host reads every rank's whole buffer through shared memory
    # (Collectives.single_host_group, in-node Adasum): the engine then packs their fusion
    # buffers straight into the rank's slot, as it does an elementwise op's, skipping a copy.
    reads_whole_vectors_in_node: bool = False

    @property
    def elementwise(self) -> bool:
        return self.reduce_op is not None

    @property
    def timeline_name(self) -> str:
        """The operation's name on the timeline."""
        return "ALLREDUCE" if self.elementwise else self.name.upper()

    def allreduce(self, buffer: torch.Tensor, layers: Sequence[Layer],
                  comms: Collectives) -> torch.Tensor:
        """Reduce ``buffer`` (1-D, contiguous) over all ranks; return the result (may be the
        same tensor)."""
        raise NotImplementedError

    def finish_(self, tensor: torch.Tensor, count: int) -> torch.Tensor:
        """An elementwise op's last step after ``reduce_op`` over ``count`` ranks (Average
        divides); in place, returns ``tensor``."""
        return average_(tensor, count) if self.averages else tensor

    def check_dtype(self, dtype: torch.dtype) -> Optional[str]:
        """A reason this op cannot reduce ``dtype``, or None."""
        if self.floating_point_only and not dtype.is_floating_point:
            return (f"op {self.name} needs floating-point tensors, got "
                    f"{str(dtype).replace('torch.', '')}")
        if dtype == torch.bool:
            return f"op {self.name} does not support bool tensors"
        return None

    def wants_delta(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether DistributedOptimizer should step locally and reduce the parameters' change
        (Adasum's mode for optimizers with state) instead of the gradients."""
        return False

    def state_dict(self) -> Optional[dict]:
        """This rank's state (error feedback, factors) for a checkpoint, None when stateless."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""
        if state:
            raise ValueError(f"op {self.name} keeps no state, but was given some")

    def reset(self) -> None:
        """Forget all state: called when the world changes (an elastic re-initialisation with
        another size), since error feedback and factors belong to the old layout."""

    def __repr__(self):
        return f"<op {self.name}>"

    def __reduce__(self):  # ops travel by name: the registry on the other side has them
        from .registry import get_op
        return (get_op, (self.name,))


def layer_overlap(layer: Layer, offset: int, numel: int) -> Optional[Tuple[int, int]]:
    """[lo, hi) of ``layer`` inside buffer[offset:offset + numel], in the buffer's coordinates,
    or None where they do not meet (the part a hierarchical step reduces may cut layers)."""
    lo, hi = max(layer.offset, offset), min(layer.offset + layer.numel, offset + numel)
    return (lo, hi) if lo < hi else None


def average_(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """Divide in place by ``count``; integers divide exactly, truncating toward zero."""
    if count == 1:
        return tensor
    if tensor.is_floating_point():
        # A division, rounded once, as Horovod's float64 scaling is: multiplying by 1/count
        # rounds twice where 1/count is not a power of two (3, 5, 6 ranks) and then differs
        # from sum / count in the last bit for about a third of the elements.
        return tensor.div_(count)
    return tensor.copy_(torch.div(tensor, count, rounding_mode="trunc"))


def scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply in place by ``factor``; integer tensors are truncated toward zero."""
    if factor == 1.0:
        return tensor
    if tensor.is_floating_point():
        return tensor.mul_(factor)
    if tensor.dtype == torch.bool:
        raise TypeError("cannot scale a bool tensor (prescale/postscale/Average)")
    return tensor.copy_(torch.trunc(tensor.double() * factor).to(tensor.dtype))


def reduce_flat(op: Op, buffer: torch.Tensor, layers: Sequence[Layer], comms: Collectives,
                prescale: float = 1.0, postscale: float = 1.0) -> torch.Tensor:
    """``op`` over a flat buffer with Horovod's prescale and postscale factors; the result may
    be ``buffer`` itself (elementwise ops) or a new tensor."""
    scale_(buffer, prescale)
    return scale_(op.allreduce(buffer, layers, comms), postscale)
