"""``hvd.Adasum``: the registry op that runs Adasum (adasum/) flat or hierarchically.

Flat: AdasumRVH over all ranks, the tree over ranks in rank order; when every rank is on one
host and shared memory is on, the same tree through the shared-memory segment
(adasum/shared_memory.py) instead.  Hierarchical
(HOROVOD_HIERARCHICAL_ALLREDUCE=1 with several nodes, paper 4.2.2): average inside each node by a
reduce-scatter, so each local rank owns a shard; Adasum across nodes on the shards, in node order,
with the per-layer dot products also summed over the local ranks so that they cover whole layers;
all-gather inside the node.  The result is the tree Adasum over nodes of each node's average.

With DistributedOptimizer, ``wants_delta`` picks the mode of paper section 4.1: optimizers with
state (momentum, Adam, LAMB) step locally and the parameter change is combined (Figure 3);
plain SGD combines the gradients.
"""
from typing import Tuple

import torch

from horovod_ext.algorithms.adasum import adasum_allreduce_, in_node_adasum_
from horovod_ext.backends import trace
from horovod_ext.backends.hierarchy import Span
from horovod_ext.backends.topology import Topology

from .base import Op
from .registry import register_op


class AdasumOp(Op):
    """``hvd.Adasum``: the adaptive summation of Maleki et al. (2021).  Parallel gradients are
    averaged, orthogonal ones added, so the learning rate tuned for one process keeps working as
    processes are added.  With an optimizer it combines the local steps (delta mode).  Any rank
    count; hierarchical inside a node when HOROVOD_HIERARCHICAL_ALLREDUCE=1."""
    name = "adasum"
    floating_point_only = True
    reads_whole_vectors_in_node = True

    def allreduce(self, buffer, layers, comms):
        bounds = [(layer.offset, layer.numel) for layer in layers]
        group = comms.single_host_group(buffer)
        if group is not None:
            with trace.activity("SHM_ADASUM", trace.nbytes_of(buffer)):
                in_node_adasum_(buffer.view(-1), bounds, group)
            return buffer

        def step(part: torch.Tensor, span: Span) -> torch.Tensor:
            if not span.hierarchical:
                return adasum_allreduce_(part, bounds, span.comm,
                                         remote=span.topology.other_hosts)
            # Across nodes in node order, the per-layer dot products also summed over the
            # local ranks so that they cover whole layers (paper 4.2.2).
            topology = span.topology
            return adasum_allreduce_(part, bounds, span.comm, order=_node_order(topology),
                                     extra_reduce=topology.local.allreduce, offset=span.offset,
                                     remote=range(span.comm.size))

        return comms.reduce(buffer, step, node_average=True, activity="ADASUM_CROSS")

    def wants_delta(self, optimizer) -> bool:
        """Delta mode unless the optimizer is stateless SGD (no momentum)."""
        if isinstance(optimizer, torch.optim.SGD):
            return any(g.get("momentum", 0) for g in optimizer.param_groups)
        return True


def _node_order(topology: Topology) -> Tuple[int, ...]:
    """Ranks of the cross communicator sorted by node, so the tree runs in node order."""
    members = topology.cross_members
    return tuple(sorted(range(len(members)), key=lambda i: topology.node_of[members[i]]))


Adasum = register_op(AdasumOp())
