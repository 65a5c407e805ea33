"""Sparse allreduce: reduce a sparse COO tensor by gathering every rank's entries.

Horovod's way for sparse gradients (nn.Embedding(sparse=True)): each rank's indices and values
are allgathered, and the result is a sparse tensor of the same shape holding all of them.
Entries at the same index are not summed here; the result is uncoalesced, as any COO tensor may
be, and ``to_dense()``, ``coalesce()`` or an optimizer's step add them up.  This beats densifying
when few rows are touched, since only those rows travel.
"""
import torch

from horovod_ext.engine import runtime
from horovod_ext.backends.base import ReduceOp
from horovod_ext.ops import Average, get_op
from .mpi_ops import allgather_async, global_process_set, synchronize


def _process_set_size(process_set) -> int:
    size = getattr(process_set, "size", None)
    return size() if callable(size) else runtime.topology().size


class SparseAllreduceHandle:
    """The handle ``sparse_allreduce_async`` returns: ``hvd.synchronize``/``hvd.poll`` accept
    it, and calling it waits too (Horovod's handle for sparse allreduce is a function)."""

    def __init__(self, tensor, indices_handle, values_handle, divisor):
        self._shape = tensor.shape
        self._dtype = tensor.dtype
        self._device = tensor.device
        self._indices = indices_handle
        self._values = values_handle
        self._divisor = divisor
        self._result = None

    def done(self) -> bool:
        return self._indices.done() and self._values.done()

    def wait(self) -> torch.Tensor:
        if self._result is None:
            indices = synchronize(self._indices).t()
            values = synchronize(self._values)
            if self._divisor == 1:
                result = self._sparse(indices, values)
            elif values.is_floating_point():
                result = self._sparse(indices, values / self._divisor)
            else:
                # integers: truncate each index's sum, as the dense Average does, so the
                # duplicates are added up first
                summed = self._sparse(indices, values).coalesce()
                result = self._sparse(summed.indices(), torch.div(
                    summed.values(), self._divisor, rounding_mode="trunc")).coalesce()
            self._result = result
        return self._result

    __call__ = wait

    def _sparse(self, indices, values):
        return torch.sparse_coo_tensor(indices, values, self._shape, dtype=self._dtype,
                                       device=self._device, check_invariants=False)


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Start reducing the sparse COO ``tensor`` over ``process_set`` with ``op`` (Average or
    Sum); ``hvd.synchronize(handle)`` (or ``handle()``) returns a sparse tensor of the same
    shape holding every rank's entries, values divided by the set's size for Average.

    ``name`` names the two allgathers (``<name>.indices``, ``<name>.values``); with None they
    are numbered, so unnamed calls must come in the same order on every rank."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        what = tensor.layout if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TypeError(f"sparse_allreduce expects a sparse COO torch.Tensor, got {what}; "
                        f"use hvd.allreduce for dense tensors")
    reduce_op = get_op(op)
    if reduce_op.reduce_op is not ReduceOp.SUM:
        raise ValueError(f"sparse_allreduce supports op Average or Sum, not {reduce_op.name}: "
                         f"it gathers entries rather than combining them element by element")
    reason = reduce_op.check_dtype(tensor.dtype)
    if reason:
        raise TypeError(f"sparse_allreduce: {reason}")
    divisor = _process_set_size(process_set) if reduce_op.averages else 1
    # allgather concatenates along dim 0, so entries go one per row: indices as (nnz, sparse_dim)
    indices = tensor._indices().t().contiguous()
    values = tensor._values().contiguous()
    indices_name = None if name is None else f"{name}.indices"
    values_name = None if name is None else f"{name}.values"
    indices_handle = allgather_async(indices, name=indices_name, process_set=process_set)
    values_handle = allgather_async(values, name=values_name, process_set=process_set)
    return SparseAllreduceHandle(tensor, indices_handle, values_handle, divisor)


def empty_sparse_like(p: torch.Tensor, sparse_dim: int) -> torch.Tensor:
    """A sparse COO tensor of ``p``'s shape, dtype and device with no entries."""
    return torch.sparse_coo_tensor(
        torch.zeros(sparse_dim, 0, dtype=torch.int64, device=p.device),
        torch.zeros((0,) + tuple(p.shape[sparse_dim:]), dtype=p.dtype, device=p.device),
        p.shape, check_invariants=False)


def sparse_allreduce(tensor, name=None, op=Average, process_set=global_process_set):
    """The sparse COO ``tensor`` reduced over ``process_set``: see ``sparse_allreduce_async``."""
    return synchronize(sparse_allreduce_async(tensor, name, op, process_set))
