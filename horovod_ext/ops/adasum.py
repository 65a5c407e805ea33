"""``hvd.Adasum``: the registry op that runs Adasum (adasum/) flat or hierarchically.

Flat: AdasumRVH over all ranks, the tree over ranks in rank order; when every rank is on one
host and shared memory is on, the same tree through the shared-memory segment
(adasum/shared_memory.py) instead.  Where the ranks span hosts that hold as many consecutive
ranks each, and that tree has each host's ranks as a subtree (powers of two), the same tree is
split at the hosts (``_by_host``): each host's subtree in its segment, the rest across hosts on
shards, so only the hosts' vectors cross the link and no exchange runs over the transport
inside a host.  Hierarchical
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

from horovod_ext.algorithms.adasum import (adasum_allreduce_, in_node_adasum_,
                                           splits_into_blocks)
from horovod_ext.backends import trace
from horovod_ext.backends.base import split_sizes
from horovod_ext.backends.hierarchy import Span
from horovod_ext.backends.shm import SharedMemoryGroup
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
        group = comms.every_host_group(buffer)
        if group is not None and splits_into_blocks(comms.topology.size,
                                                    comms.topology.local_size):
            _by_host(buffer.view(-1), bounds, group, comms.topology)
            return buffer

        def step(part: torch.Tensor, span: Span) -> torch.Tensor:
            if not span.hierarchical:
                return adasum_allreduce_(part, bounds, span.comm,
                                         remote=span.topology.other_hosts)
            return _across_nodes(part, bounds, span.topology, span.offset)

        return comms.reduce(buffer, step, node_average=True, activity="ADASUM_CROSS")

    def wants_delta(self, optimizer) -> bool:
        """Delta mode unless the optimizer is stateless SGD (no momentum)."""
        if isinstance(optimizer, torch.optim.SGD):
            return any(g.get("momentum", 0) for g in optimizer.param_groups)
        return True


def _by_host(flat: torch.Tensor, bounds, group: SharedMemoryGroup, topology: Topology):
    """The tree over the ranks in rank order, split at the hosts (each a block of consecutive
    ranks, a subtree of the tree): the host's subtree through its segment, after which every
    local rank holds the host's vector; the tree over the hosts on this rank's shard of it
    (``_across_nodes``, as the hierarchical step's); the shards gathered through the segment.
    In place."""
    with trace.activity("SHM_ADASUM", trace.nbytes_of(flat)):
        in_node_adasum_(flat, bounds, group)
    counts = split_sizes(flat.numel(), topology.local_size)
    offset = sum(counts[:topology.local_rank])
    part = flat[offset:offset + counts[topology.local_rank]]
    with trace.activity("ADASUM_CROSS", trace.nbytes_of(part)):
        _across_nodes(part, bounds, topology, offset)
    with trace.activity("SHM_NODE_ALLGATHER", trace.nbytes_of(flat)):
        group.allgather(flat, part)


def _across_nodes(part: torch.Tensor, bounds, topology: Topology, offset: int) -> torch.Tensor:
    """The tree over the nodes, in node order, on this rank's ``part`` (elements from
    ``offset`` of the buffer) among the ranks with its local rank, the per-layer dot products
    also summed over the local ranks so that they cover whole layers (paper 4.2.2)."""
    return adasum_allreduce_(part, bounds, topology.cross, order=_node_order(topology),
                             extra_reduce=topology.local.allreduce, offset=offset,
                             remote=range(topology.cross.size))


def _node_order(topology: Topology) -> Tuple[int, ...]:
    """Ranks of the cross communicator sorted by node, so the tree runs in node order."""
    members = topology.cross_members
    return tuple(sorted(range(len(members)), key=lambda i: topology.node_of[members[i]]))


Adasum = register_op(AdasumOp())
