"""``hvd.Adasum``: the registry op that runs Adasum (adasum/) flat or hierarchically.

Flat: AdasumRVH over all ranks, the tree over ranks in rank order.  Hierarchical
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

from horovod_ext.algorithms.adasum import adasum_allreduce_

from horovod_ext.backends import trace
from horovod_ext.backends.base import ReduceOp, split_sizes
from horovod_ext.backends.topology import Topology
from horovod_ext.backends.collectives import node_transport
from .base import Op, average_
from .registry import register_op

class AdasumOp(Op):
    name = "adasum"
    floating_point_only = True

    def allreduce(self, buffer, layers, comms):
        bounds = [(layer.offset, layer.numel) for layer in layers]
        if comms.hierarchical_allreduce and comms.hierarchy_applies:
            return hierarchical_adasum_(buffer, bounds, comms.topology)
        return adasum_allreduce_(buffer, bounds, comms.world)

    def wants_delta(self, optimizer) -> bool:
        """Delta mode unless the optimizer is stateless SGD (no momentum)."""
        if isinstance(optimizer, torch.optim.SGD):
            return any(g.get("momentum", 0) for g in optimizer.param_groups)
        return True


def _node_order(topology: Topology) -> Tuple[int, ...]:
    """Ranks of the cross communicator sorted by node, so the tree runs in node order."""
    members = topology.cross_members
    return tuple(sorted(range(len(members)), key=lambda i: topology.node_of[members[i]]))


def hierarchical_adasum_(buffer: torch.Tensor, bounds, topology: Topology) -> torch.Tensor:
    flat = buffer.view(-1)
    counts = split_sizes(flat.numel(), topology.local_size)
    offset = sum(counts[:topology.local_rank])
    node = node_transport(topology, flat) if trace.recorder is not None else ""
    with trace.activity(f"{node}_NODE_REDUCESCATTER", trace.nbytes_of(flat)):
        shard = average_(topology.node_reduce_scatter(flat, ReduceOp.SUM), topology.local_size)
    with trace.activity("ADASUM_CROSS", trace.nbytes_of(shard)):
        adasum_allreduce_(shard, bounds, topology.cross, order=_node_order(topology),
                          extra_reduce=topology.local.allreduce, offset=offset)
    with trace.activity(f"{node}_NODE_ALLGATHER", trace.nbytes_of(flat)):
        topology.node_allgather(flat, shard)
    return buffer


Adasum = register_op(AdasumOp())
