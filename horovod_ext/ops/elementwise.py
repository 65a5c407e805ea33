"""The elementwise ops: Sum, Average, Min, Max and Product, one allreduce each, flat or
hierarchical (``backends.collectives``)."""
import torch

from horovod_ext.backends.base import ReduceOp

from .base import Op
from .registry import register_op


class ElementwiseOp(Op):
    """Sum, Min, Max, Product: one allreduce, flat or hierarchical."""

    def __init__(self, name: str, reduce_op: ReduceOp, bool_ok: bool = True):
        self.name = name
        self.reduce_op = reduce_op
        self._bool_ok = bool_ok

    def allreduce(self, buffer, layers, comms):
        return self.finish_(comms.allreduce(buffer, self.reduce_op), comms.world.size)

    def check_dtype(self, dtype):
        return None if self._bool_ok or dtype != torch.bool else super().check_dtype(dtype)


class AverageOp(ElementwiseOp):
    """Sum divided by the number of ranks (integer tensors: truncated, as Horovod does)."""
    averages = True
    sum_of_divided = "sum"

    def __init__(self):
        super().__init__("average", ReduceOp.SUM, bool_ok=False)


Sum = register_op(ElementwiseOp("sum", ReduceOp.SUM))
Average = register_op(AverageOp())
Min = register_op(ElementwiseOp("min", ReduceOp.MIN))
Max = register_op(ElementwiseOp("max", ReduceOp.MAX))
Product = register_op(ElementwiseOp("product", ReduceOp.PRODUCT))
