"""The one hierarchical skeleton: reduce inside the node, a step across nodes, share the result
inside the node.

Every hierarchical reduction (the elementwise ops, Adasum, 1-bit, random-k, PowerSGD, the
1-bit optimizers' warm-up) is this skeleton with its own cross-node step plugged in, as
Horovod's hierarchical Adasum and NCCL's hierarchical allreduce are.  A step is written once for
both forms: it receives the part of the buffer it reduces and a ``Span`` saying among whom
(the world when flat; the ranks with the same local rank on every node when hierarchical) and
where the part starts, so an op needs no hierarchy code of its own.
"""
import contextlib
from typing import Callable, NamedTuple, Optional, Tuple

import torch

from . import trace
from .base import Communicator, ReduceOp, split_sizes
from .topology import Topology


class Span(NamedTuple):
    """Where a step runs: among ``comm``, on the part of the whole buffer that starts at
    ``offset``."""
    comm: Communicator
    offset: int
    topology: Topology

    @property
    def hierarchical(self) -> bool:
        return self.comm is not self.topology.world


# step(part, span) -> the reduced part (the same tensor or a new one of the same size)
Step = Callable[[torch.Tensor, Span], torch.Tensor]


def node_transport(topology: Topology, tensor: torch.Tensor) -> str:
    """What carries the in-node steps of ``tensor`` (for the timeline)."""
    return "SHM" if topology.in_node(tensor) is not None else topology.local.transport(tensor)


def hierarchical_(flat: torch.Tensor, topology: Topology, step: Step,
                  op: ReduceOp = ReduceOp.SUM, node_average: bool = False,
                  share: Optional[Tuple[int, int]] = None,
                  activity: Optional[str] = "CROSS_STEP") -> torch.Tensor:
    """Reduce the 1-D ``flat`` inside the node with ``op`` (divided by the ranks of the node
    with ``node_average``), run ``step`` across nodes on this rank's part, and give every rank
    of the node every part; in place, returns ``flat``.

    The parts are ``split_sizes`` shards (reduce-scatter, then all-gather).  ``share`` =
    (start, end) makes this rank's part that range instead, for steps that need whole layers
    (PowerSGD's matrices): the node then reduces the whole buffer and joins the parts by a
    second sum.  ``activity`` names the step on the timeline (None: the step records
    itself).  Every rank runs the step, on an empty part too (a buffer with fewer elements
    than the node has ranks): a step may make collective calls among the node's ranks (Adasum
    sums its dot products over them), which a rank that skipped it would leave waiting, and
    the ranks of one cross communicator share a local rank, hence the same part's size."""
    node = node_transport(topology, flat) if trace.recorder is not None else ""
    if share is None:
        counts = split_sizes(flat.numel(), topology.local_size)
        offset = sum(counts[:topology.local_rank])
        with trace.activity(f"{node}_NODE_REDUCESCATTER", trace.nbytes_of(flat)):
            part = topology.node_reduce_scatter(flat, op)
    else:
        offset = share[0]
        with trace.activity(f"{node}_NODE_ALLREDUCE", trace.nbytes_of(flat)):
            topology.node_allreduce(flat, op)
        part = flat[share[0]:share[1]]
    if node_average:
        part.div_(topology.local_size)
    with (trace.activity(activity, trace.nbytes_of(part)) if activity
          else contextlib.nullcontext()):
        out = step(part, Span(topology.cross, offset, topology))
    if out.data_ptr() != part.data_ptr():
        part.copy_(out)
    if share is None:
        with trace.activity(f"{node}_NODE_ALLGATHER", trace.nbytes_of(flat)):
            topology.node_allgather(flat, part)
        return flat
    flat[:share[0]].zero_()
    flat[share[1]:].zero_()
    with trace.activity(f"{node}_NODE_ALLGATHER", trace.nbytes_of(flat)):
        topology.node_allreduce(flat, ReduceOp.SUM)
    return flat


def run_step(flat: torch.Tensor, topology: Topology, step: Step, hierarchical: bool,
             node_average: bool = True, share: Optional[Tuple[int, int]] = None,
             activity: str = "CROSS_STEP") -> torch.Tensor:
    """``step`` over the whole world: on all of ``flat`` among every rank (flat), or through
    ``hierarchical_`` when ``hierarchical`` (asked for, and the topology allows it); in
    place."""
    if hierarchical:
        return hierarchical_(flat, topology, step, node_average=node_average, share=share,
                             activity=activity)
    out = step(flat, Span(topology.world, 0, topology))
    return flat if out.data_ptr() == flat.data_ptr() else flat.copy_(out)
