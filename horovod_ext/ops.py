"""The reduction-op registry.

Every op is an object registered under a unique name, with one entry point that receives a fused
flat buffer, the per-tensor boundaries inside it, and the collectives it may use.  The engine
sends the op's name across ranks during negotiation and looks it up here, so a user's own op
works everywhere a built-in one does once it is registered on every rank.
"""
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple, Union

import torch

from .backends.base import ReduceOp
from .collectives import Collectives


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
    """Base class of reduction ops.  Subclasses set ``name`` and implement ``allreduce``."""

    name: str = ""
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

    def allreduce(self, buffer: torch.Tensor, layers: Sequence[Layer],
                  comms: Collectives) -> torch.Tensor:
        """Reduce ``buffer`` (1-D, contiguous) over all ranks; return the result (may be the
        same tensor)."""
        raise NotImplementedError

    def check_dtype(self, dtype: torch.dtype) -> Optional[str]:
        """A reason this op cannot reduce ``dtype``, or None."""
        if self.floating_point_only and not dtype.is_floating_point:
            return (f"op {self.name} needs floating-point tensors, got "
                    f"{str(dtype).replace('torch.', '')}")
        if dtype == torch.bool:
            return f"op {self.name} does not support bool tensors"
        return None

    def __repr__(self):
        return f"<op {self.name}>"

    def __reduce__(self):  # ops travel by name: the registry on the other side has them
        return (get_op, (self.name,))


class ElementwiseOp(Op):
    """Sum, Min, Max, Product: one allreduce, flat or hierarchical."""

    def __init__(self, name: str, reduce_op: ReduceOp, bool_ok: bool = True):
        self.name = name
        self.reduce_op = reduce_op
        self._bool_ok = bool_ok

    def allreduce(self, buffer, layers, comms):
        return comms.allreduce(buffer, self.reduce_op)

    def check_dtype(self, dtype):
        return None if self._bool_ok or dtype != torch.bool else super().check_dtype(dtype)


class AverageOp(ElementwiseOp):
    """Sum divided by the number of ranks (integer tensors: truncated, as Horovod does)."""

    def __init__(self):
        super().__init__("average", ReduceOp.SUM, bool_ok=False)

    def allreduce(self, buffer, layers, comms):
        buffer = comms.allreduce(buffer, ReduceOp.SUM)
        return average_(buffer, comms.world.size)


def average_(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """Divide in place by ``count``; integers divide exactly, truncating toward zero."""
    if count == 1:
        return tensor
    if tensor.is_floating_point():
        return tensor.mul_(1.0 / count)
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


_REGISTRY: Dict[str, Op] = {}


def register_op(op: Op, replace: bool = False) -> Op:
    """Register ``op`` under ``op.name`` on this rank; every rank must register it."""
    if not isinstance(op, Op) or not op.name:
        raise TypeError(f"register_op needs an Op instance with a name, got {op!r}")
    existing = _REGISTRY.get(op.name)
    if existing is not None and existing is not op and not replace:
        raise ValueError(f"an op named {op.name!r} is registered already; pass replace=True")
    _REGISTRY[op.name] = op
    return op


def get_op(op: Union[str, Op]) -> Op:
    if isinstance(op, Op):
        if _REGISTRY.get(op.name) is not op:
            raise ValueError(f"op {op.name!r} is not registered: call hvd.register_op(op) on "
                             f"every rank first")
        return op
    try:
        return _REGISTRY[op]
    except (KeyError, TypeError):
        raise ValueError(f"unknown reduction op {op!r}; registered ops: "
                         f"{sorted(_REGISTRY)}") from None


def registered_ops() -> Dict[str, Op]:
    return dict(_REGISTRY)


Sum = register_op(ElementwiseOp("sum", ReduceOp.SUM))
Average = register_op(AverageOp())
Min = register_op(ElementwiseOp("min", ReduceOp.MIN))
Max = register_op(ElementwiseOp("max", ReduceOp.MAX))
Product = register_op(ElementwiseOp("product", ReduceOp.PRODUCT))
