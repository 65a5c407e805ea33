"""The synchronous collectives of the public API, differentiable.

For inputs that require grad (with grad mode on), each call runs as an autograd function whose
backward is the matching collective, with Horovod's conventions (its tests are the
specification):

- allreduce: the gradient is allreduced with the same op and scaling;
- allgather: the gradient is averaged over the set, and each rank keeps its own rows;
- broadcast: the gradient is averaged over the set and kept by the root only (zeros elsewhere);
- alltoall: the gradient goes back the way the data came (an alltoall with the received splits);
- reducescatter: the gradients are allgathered, times the set's size for Sum.

Otherwise the call goes straight to ``mpi_ops``.  The backward collectives are unnamed, so they
are matched across ranks by order, as autograd runs them.
"""
from typing import List

import torch

from . import mpi_ops
from horovod_ext.backends.base import ReduceOp
from horovod_ext.ops import Average, get_op
from horovod_ext.engine.process_sets import global_process_set
from .compression import Compression


def _needs_grad(tensors) -> bool:
    # Anything but a tensor goes on to mpi_ops, which names the problem.
    return torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)


def _set_rank(process_set) -> int:
    return mpi_ops.set_rank_of(mpi_ops.runtime.topology().rank, process_set, "this rank")


# --- allreduce --------------------------------------------------------------------------------
class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale, postscale, process_set):
        ctx.args = (average, op, prescale, postscale, process_set)
        return mpi_ops.allreduce(tensor, average, name, Compression.none, op, prescale,
                                 postscale, process_set)

    @staticmethod
    def backward(ctx, grad):
        average, op, prescale, postscale, process_set = ctx.args
        reduced = mpi_ops.allreduce(grad.contiguous(), average, None, Compression.none, op,
                                    prescale, postscale, process_set)
        return (reduced,) + (None,) * 6


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """A new tensor holding the reduction of ``tensor`` over the set (default: Average)."""
    if not _needs_grad([tensor]):
        return mpi_ops.allreduce(tensor, average, name, compression, op, prescale_factor,
                                 postscale_factor, process_set)
    wire, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(wire, average, name, op, prescale_factor, postscale_factor,
                               process_set)
    return compression.decompress(reduced, ctx)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, op, prescale, postscale, process_set, *tensors):
        ctx.args = (average, op, prescale, postscale, process_set)
        return tuple(mpi_ops.grouped_allreduce(list(tensors), average, name, Compression.none,
                                               op, prescale, postscale, process_set))

    @staticmethod
    def backward(ctx, *grads):
        average, op, prescale, postscale, process_set = ctx.args
        reduced = mpi_ops.grouped_allreduce([g.contiguous() for g in grads], average, None,
                                            Compression.none, op, prescale, postscale,
                                            process_set)
        return (None,) * 6 + tuple(reduced)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set) -> List[torch.Tensor]:
    """Reduce several tensors as one fused request; returns new tensors."""
    tensors = list(tensors)
    if not _needs_grad(tensors):
        return mpi_ops.grouped_allreduce(tensors, average, name, compression, op,
                                         prescale_factor, postscale_factor, process_set)
    packed = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor,
                                      process_set, *[w for w, _ in packed])
    return [compression.decompress(r, c) for r, (_, c) in zip(reduced, packed)]


# --- allgather --------------------------------------------------------------------------------
def _own_rows(grads, rows: List[int], process_set) -> List[torch.Tensor]:
    """Average ``grads`` (gathered layouts) over the set; this rank's rows of each."""
    averaged = mpi_ops.grouped_allreduce([g.contiguous() for g in grads], op=Average,
                                         process_set=process_set)
    everyone = mpi_ops.allgather(torch.tensor([rows], dtype=torch.int64),
                                 process_set=process_set)
    offsets = everyone[:_set_rank(process_set)].sum(0)
    return [g.narrow(0, int(offsets[i]), rows[i]) for i, g in enumerate(averaged)]


def _rows(tensor) -> int:
    return tensor.shape[0] if tensor.dim() else 1


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.shape, ctx.process_set = _rows(tensor), tensor.shape, process_set
        return mpi_ops.allgather(tensor, name, process_set)

    @staticmethod
    def backward(ctx, grad):
        (mine,) = _own_rows([grad], [ctx.rows], ctx.process_set)
        return mine.reshape(ctx.shape), None, None


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Concatenation of every rank's tensor along dim 0 (first dimensions may differ)."""
    if not _needs_grad([tensor]):
        return mpi_ops.allgather(tensor, name, process_set)
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows = [_rows(t) for t in tensors]
        ctx.shapes = [t.shape for t in tensors]
        ctx.process_set = process_set
        return tuple(mpi_ops.grouped_allgather(list(tensors), name, process_set))

    @staticmethod
    def backward(ctx, *grads):
        mine = _own_rows(grads, ctx.rows, ctx.process_set)
        return (None, None) + tuple(m.reshape(s) for m, s in zip(mine, ctx.shapes))


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> List[torch.Tensor]:
    """Allgather of each tensor of ``tensors``; the list of results."""
    tensors = list(tensors)
    if not _needs_grad(tensors):
        return mpi_ops.grouped_allgather(tensors, name, process_set)
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


# --- broadcast --------------------------------------------------------------------------------
class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return mpi_ops.broadcast(tensor, root_rank, name, process_set)

    @staticmethod
    def backward(ctx, grad):
        averaged = mpi_ops.allreduce(grad.contiguous(), op=Average,
                                     process_set=ctx.process_set)
        if mpi_ops.runtime.topology().rank != ctx.root_rank:
            averaged.zero_()
        return averaged, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """``root_rank``'s tensor (a world rank), as a new tensor on every rank of the set."""
    if not _needs_grad([tensor]):
        return mpi_ops.broadcast(tensor, root_rank, name, process_set)
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# --- alltoall ---------------------------------------------------------------------------------
class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        received, received_splits = mpi_ops.synchronize(
            mpi_ops.alltoall_async(tensor, splits, name, process_set, _wake=False))
        ctx.received_splits, ctx.process_set = received_splits, process_set
        ctx.mark_non_differentiable(received_splits)
        return received, received_splits

    @staticmethod
    def backward(ctx, grad, _):
        back, _ = mpi_ops.synchronize(mpi_ops.alltoall_async(
            grad.contiguous(), ctx.received_splits, process_set=ctx.process_set, _wake=False))
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rank i gets rows splits[i] of every rank's tensor: the received tensor, and with
    ``splits`` given also the received splits (as in Horovod)."""
    if not _needs_grad([tensor]):
        return mpi_ops.alltoall(tensor, splits, name, process_set)
    received, received_splits = _Alltoall.apply(tensor, splits, name, process_set)
    return received if splits is None else (received, received_splits)


# --- reducescatter ----------------------------------------------------------------------------
def _scatter_grads_back(grads, op, prescale, postscale, process_set) -> List[torch.Tensor]:
    reduce_op = get_op(op)
    if reduce_op.reduce_op is not ReduceOp.SUM:
        raise NotImplementedError(f"the gradient of reducescatter is defined for Sum and "
                                  f"Average, not {reduce_op.name}")
    gathered = mpi_ops.grouped_allgather([g.contiguous() for g in grads],
                                         process_set=process_set)
    scale = prescale * postscale
    if not reduce_op.averages:
        scale *= mpi_ops.runtime.set_topology(process_set.process_set_id).size
    return [g.mul_(scale) if scale != 1.0 else g for g in gathered]


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, prescale, postscale, process_set):
        ctx.args = (op, prescale, postscale, process_set)
        return mpi_ops.reducescatter(tensor, name, Compression.none, op, prescale, postscale,
                                     process_set)

    @staticmethod
    def backward(ctx, grad):
        (back,) = _scatter_grads_back([grad], *ctx.args)
        return (back,) + (None,) * 5


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduce over the set and keep this rank's block of dim 0 (earlier ranks get the extra
    rows)."""
    if not _needs_grad([tensor]):
        return mpi_ops.reducescatter(tensor, name, compression, op, prescale_factor,
                                     postscale_factor, process_set)
    wire, ctx = compression.compress(tensor)
    scattered = _Reducescatter.apply(wire, name, op, prescale_factor, postscale_factor,
                                     process_set)
    return compression.decompress(scattered, ctx)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, prescale, postscale, process_set, *tensors):
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(mpi_ops.grouped_reducescatter(list(tensors), name, Compression.none, op,
                                                   prescale, postscale, process_set))

    @staticmethod
    def backward(ctx, *grads):
        return (None,) * 5 + tuple(_scatter_grads_back(grads, *ctx.args))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          prescale_factor=1.0, postscale_factor=1.0,
                          process_set=global_process_set) -> List[torch.Tensor]:
    """Reducescatter of each tensor of ``tensors``; the list of results."""
    tensors = list(tensors)
    if not _needs_grad(tensors):
        return mpi_ops.grouped_reducescatter(tensors, name, compression, op, prescale_factor,
                                             postscale_factor, process_set)
    packed = [compression.compress(t) for t in tensors]
    scattered = _GroupedReducescatter.apply(name, op, prescale_factor, postscale_factor,
                                            process_set, *[w for w, _ in packed])
    return [compression.decompress(s, c) for s, (_, c) in zip(scattered, packed)]
