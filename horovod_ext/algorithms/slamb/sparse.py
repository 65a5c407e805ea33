"""Masked averaging with local error compensation: gather the selected values of many tensors
into one dense buffer, average it with one allreduce, scatter it back.

SLAMB's sync step (Algorithm 1, line 8) for one tensor is ``m = m * not(M) + mean_i(m_i * M)``:
the selected elements become the average over ranks, the others keep their local value (the
local error compensation: what was not sent stays in the local state instead of being lost).
Tensors that are synchronised in full (1-D tensors and small ones, as in SLAMB's reference code)
travel in the same buffer, so a step costs one allreduce whatever the number of layers.
"""
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from horovod_ext.backends import Communicator, ReduceOp, split_sizes, trace

# SLAMB's reference code (grad_size_thr) always synchronises tensors with fewer elements than
# this, and every 1-D tensor (biases, norms): they cost little and their statistics are noisy.
SMALL_TENSOR_NUMEL = 9000

# (flat 1-D tensor, sorted local indices of the selected elements, or None for all of them)
Entry = Tuple[torch.Tensor, Optional[torch.Tensor]]


def syncs_in_full(shape: Sequence[int], small_numel: int = SMALL_TENSOR_NUMEL) -> bool:
    """True for tensors that are averaged in full instead of masked: 1-D (or 0-d) tensors and
    those with fewer than ``small_numel`` elements."""
    numel = 1
    for s in shape:
        numel *= s
    return len(shape) <= 1 or numel < small_numel


def masked_average_(entries: Sequence[Entry], comm: Communicator, divisor: int,
                    shard_over: Optional[Communicator] = None,
                    allreduce: Optional[Callable[[torch.Tensor], object]] = None) -> int:
    """In place: the selected elements of every entry become their sum over ``comm`` divided by
    ``divisor``; the others are left alone.  One allreduce per dtype present (``allreduce(t)``,
    in place, when given: e.g. the node's shared-memory one, ``comm`` being the node).  Returns
    the number of payload bytes this rank contributed (0 alone).

    ``shard_over`` (the node, when ``comm`` is the cross-node group): ranks of that group hold
    the same values, so each reduces only its 1/size share across nodes and the node
    all-gathers the shares: a node sends its data across once, not once per rank."""
    label = "SHM_ALLREDUCE" if allreduce is not None else None  # the node's shared memory
    if allreduce is None:
        def allreduce(t):
            return comm.allreduce(t, ReduceOp.SUM)
    by_dtype: Dict[torch.dtype, List[Entry]] = {}
    for flat, idx in entries:
        by_dtype.setdefault(flat.dtype, []).append((flat, idx))
    sent = 0
    for group in by_dtype.values():
        with trace.activity("RANDOMK_GATHER"):
            parts = [flat if idx is None else flat.index_select(0, idx) for flat, idx in group]
            dense = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        if shard_over is not None and shard_over.size > 1:
            counts = split_sizes(dense.numel(), shard_over.size)
            start = sum(counts[:shard_over.rank])
            share = dense[start:start + counts[shard_over.rank]].clone()
            if comm.size > 1:
                with trace.transfer(comm, "ALLREDUCE", share):
                    comm.allreduce(share, ReduceOp.SUM)
                sent += share.numel() * share.element_size()
            with trace.transfer(shard_over, "ALLGATHER", share):
                dense = shard_over.allgather(share, counts)
        elif comm.size > 1:
            with (trace.activity(label, trace.nbytes_of(dense)) if label
                  else trace.transfer(comm, "ALLREDUCE", dense)):
                allreduce(dense)
            sent += dense.numel() * dense.element_size()
        with trace.activity("RANDOMK_SCATTER", trace.nbytes_of(dense)):
            if divisor != 1:
                dense.mul_(1.0 / divisor)
            for (flat, idx), piece in zip(group, dense.split([p.numel() for p in parts])):
                if idx is None:
                    flat.copy_(piece)
                else:
                    flat.index_copy_(0, idx, piece)
    return sent


def flat_average_(tensors: Sequence[torch.Tensor], comm: Communicator, divisor: int,
                  shard_over: Optional[Communicator] = None,
                  allreduce: Optional[Callable[[torch.Tensor], object]] = None) -> int:
    """Average whole tensors (any shapes) over ``comm`` in one fused allreduce per dtype; the
    payload bytes sent."""
    return masked_average_([(t.view(-1), None) for t in tensors], comm, divisor, shard_over,
                           allreduce)
