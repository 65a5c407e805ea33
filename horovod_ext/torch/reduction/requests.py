"""The requests a reducer starts and what finishing each does to the gradients: a dense
reduction (one gradient, a group, or a bucket's flat buffer, compressed on the wire) and a
sparse gradient gathered from every rank as Horovod does (sparse.py)."""
from typing import List, NamedTuple, Sequence, Tuple

import torch

from horovod_ext.backends.base import ReduceOp
from horovod_ext.engine import NEXT_CYCLE
from horovod_ext.ops import get_op
from ..buckets import Bucket
from ..mpi_ops import allreduce_async_, grouped_allreduce_async_, synchronize as wait
from ..sparse import empty_sparse_like, sparse_allreduce_async
from .state import Layout, Settings


class DenseReduction(NamedTuple):
    """An allreduce in flight; its result is written back into ``targets``."""
    handle: object
    params: List[torch.Tensor]
    targets: List[torch.Tensor]     # the gradients (or dense copies, or a bucket's buffer)
    wires: List[torch.Tensor]       # what was sent: the targets through compression
    contexts: list                  # compression's, one per wire
    # (parameter, dense target, sparse_dim): reduced dense, handed back sparse, since
    # optimizers such as SparseAdam take only sparse gradients
    resparse: List[Tuple[torch.Tensor, torch.Tensor, int]]

    def finish(self, compression) -> None:
        wait(self.handle)
        for target, wire, ctx in zip(self.targets, self.wires, self.contexts):
            if wire is not target:
                target.copy_(compression.decompress(wire, ctx))
        for p, dense, sparse_dim in self.resparse:
            p.grad = dense.to_sparse(sparse_dim)

    def settle(self) -> None:
        _settle(self.handle)


class SparseGather(NamedTuple):
    """A sparse gradient being gathered; the gathered tensor becomes the gradient."""
    handle: object
    params: List[torch.Tensor]      # the one parameter

    def finish(self, compression) -> None:
        self.params[0].grad = wait(self.handle)

    def settle(self) -> None:
        _settle(self.handle)


def zero_gradient(layout: Layout, p: torch.Tensor) -> torch.Tensor:
    """The gradient of a parameter that got none this step: zeros, sparse (and empty) for one
    whose gradients are sparse, so that every rank submits the same kind of request."""
    sparse_dim = layout.sparse.get(id(p))
    if sparse_dim is None:
        return torch.zeros_like(p)
    return empty_sparse_like(p, sparse_dim)


def reduce_gradients(settings: Settings, layout: Layout, params: Sequence[torch.Tensor],
                     name: str, grouped: bool):
    """Start the reduction of ``params``' gradients (zeros where a parameter has none): one
    request, grouped or for one tensor."""
    for p in params:
        if p.grad is None:
            p.grad = zero_gradient(layout, p)
    if not settings.sparse_as_dense and any(p.grad.is_sparse for p in params):
        return gather_sparse(settings, layout, params, name, grouped)
    targets, resparse = [], []
    for p in params:
        target = p.grad
        if target.is_sparse:
            target = target.to_dense()
            resparse.append((p, target, p.grad.sparse_dim()))
        targets.append(target)
    return _allreduce(settings, params, targets, name, grouped, resparse)


def bucket_name(bucket: Bucket) -> str:
    """The request name of ``bucket``'s reduction."""
    return f"DistributedOptimizer.bucket.{bucket.index}"


def reduce_bucket(settings: Settings, bucket: Bucket, divided: bool = False) -> DenseReduction:
    """Start the reduction of a bucket's flat buffer, in place; ``divided``: its gradients were
    divided by the number of ranks as they came (Settings.bucket_divisor), so it is summed."""
    op = get_op(settings.op.sum_of_divided) if divided else None
    # A bucket is a fused request already: waiting a cycle time for others to join it only
    # delays its transfer (DDP starts a bucket's allreduce in the hook that fills it).
    return _allreduce(settings, bucket.params, [bucket.flat], bucket_name(bucket), False, [],
                      op, wake=True)


def reduce_now(settings: Settings, flat: torch.Tensor, name: str) -> None:
    """Reduce ``flat`` in place as a bucket is reduced, and wait (bucket_timing's probe)."""
    _allreduce(settings, [], [flat], name, False, []).finish(settings.compression)


def _allreduce(settings: Settings, params, targets, name: str, grouped: bool,
               resparse, op=None, wake=NEXT_CYCLE) -> DenseReduction:
    compressed = [settings.compression.compress(t) for t in targets]
    wires = [wire for wire, _ in compressed]
    pre, post = settings.scales() if op is None else (1.0, 1.0)
    # NEXT_CYCLE: the engine starts a cycle one cycle time after the first gradient, so the
    # reductions overlap the rest of backward and gradients arriving close together are
    # fused; step() starts the last cycle at once.
    common = dict(name=name, op=op or settings.op, prescale_factor=pre, postscale_factor=post,
                  process_set=settings.process_set, _wake=wake)
    if grouped:
        handle = grouped_allreduce_async_(wires, **common)
    else:
        handle = allreduce_async_(wires[0], **common)
    return DenseReduction(handle, list(params), targets, wires, [c for _, c in compressed],
                          resparse)


def gather_sparse(settings: Settings, layout: Layout, params, name: str,
                  grouped: bool) -> SparseGather:
    """Reduce a sparse gradient as Horovod does: every rank's entries are gathered;
    compression and gradient_predivide_factor do not apply to them."""
    p = params[0]
    if grouped:
        sparse = [layout.names[id(q)] for q in params if q.grad.is_sparse]
        raise ValueError(f"sparse gradients for {sparse} cannot be reduced in a group: "
                         f"pass sparse_as_dense=True or leave them out of groups")
    if settings.op.reduce_op is not ReduceOp.SUM:
        raise ValueError(f"sparse gradient for {layout.names[id(p)]}: op {settings.op.name} "
                         f"cannot reduce sparse gradients (Average and Sum can); pass "
                         f"sparse_as_dense=True")
    handle = sparse_allreduce_async(p.grad, name=name, op=settings.op,
                                    process_set=settings.process_set)
    return SparseGather(handle, [p])


def drain(reductions) -> None:
    """Wait for every request, ignoring their errors: after a failed step nothing may be left
    in flight under a name the next step reuses."""
    for reduction in reductions:
        reduction.settle()


def _settle(handle) -> None:
    """Wait for ``handle``, ignoring its error (``drain``)."""
    try:
        wait(handle)
    except Exception:  # noqa: B902 - the first error is the one raised
        pass
