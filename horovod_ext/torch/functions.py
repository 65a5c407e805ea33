"""Model and optimizer state helpers: broadcast_parameters, broadcast_optimizer_state."""
import collections.abc

import torch

from horovod_ext.engine import runtime
from .mpi_ops import broadcast_async_, broadcast_object, synchronize, global_process_set
from .sparse import empty_sparse_like


def broadcast_parameters(params, root_rank=0, prefix="broadcast_parameters",
                         process_set=global_process_set):
    """Copy ``root_rank``'s parameters into every rank's, in place.

    ``params`` is a ``state_dict()``, ``named_parameters()`` or a list of (name, tensor) pairs.
    """
    if isinstance(params, collections.abc.Mapping):
        items = sorted(params.items())
    elif isinstance(params, collections.abc.Iterable):
        items = list(params)
        if items and not all(isinstance(p, tuple) and len(p) == 2 for p in items):
            raise ValueError("broadcast_parameters expects a state_dict or (name, tensor) pairs")
    else:
        raise ValueError(f"broadcast_parameters: invalid params of type {type(params).__name__}")
    handles = []
    for name, p in items:
        if p is None or not isinstance(p, torch.Tensor):
            continue
        target = p.data if isinstance(p, torch.nn.Parameter) else p
        handles.append(broadcast_async_(target, root_rank, name=f"{prefix}.{name}",
                                        process_set=process_set))
    for h in handles:
        synchronize(h)


def broadcast_optimizer_state(optimizer, root_rank=0, process_set=global_process_set):
    """Make every rank's optimizer state (tensors, scalars, hyper-parameters) equal to
    ``root_rank``'s.  Works for any optimizer whose state_dict holds tensors and Python values."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state:
        _zero_missing_grads(optimizer)
    me = runtime.topology().rank
    state = None
    if me == root_rank:
        state = optimizer.state_dict()
        # an op's per-rank state (error feedback) stays each rank's own
        state.pop(getattr(optimizer, "_HVD_OP_STATE", None), None)
    state = broadcast_object(state, root_rank, name="broadcast_optimizer_state",
                             process_set=process_set)
    if me != root_rank:
        optimizer.load_state_dict(state)


def _zero_missing_grads(optimizer):
    """Horovod starts a new optimizer's state with a step on zero gradients and leaves those
    gradients behind; code written for it may read them.  The state itself needs no such step
    here (the whole state_dict travels), and one would move the parameters (weight decay) and
    shift Adam's step count, so only the gradients are made: zeros for trainable parameters that
    have none (empty sparse ones for SparseAdam, which takes only those)."""
    sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = empty_sparse_like(p, p.dim()) if sparse else torch.zeros_like(p)

