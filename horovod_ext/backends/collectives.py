"""The collectives an op may use, flat or hierarchical.

``Collectives`` is what an op's ``allreduce`` receives: the topology, the switches
(HOROVOD_HIERARCHICAL_ALLREDUCE / _ALLGATHER), ``allreduce`` for the elementwise reductions and
``reduce`` for an op's own step, both flat or through the one hierarchical skeleton
(``backends.hierarchy``).  The in-node steps of CPU buffers go through shared memory
(backends/shm.py, reached through the topology) where the host allows it and
HOROVOD_SHARED_MEMORY is not 0, over the local communicator otherwise; elementwise ops pipeline
them with the cross-node step.  When every rank is on one host, elementwise allreduces from the
size where it pays (the communicator's ``shared_memory_from_bytes``) run through that shared
memory too, hierarchical or not.
"""
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from . import shm, shm_files, staging, trace
from .base import Communicator, ReduceOp
from .hierarchy import Span, Step, hierarchical_, run_step
from .partition import pipeline_chunk_bytes
from .topology import Topology

# cross_step(shard, shard_offset, topology) -> reduced shard (may be the same tensor): a user
# op's cross-node step for ``Collectives.allreduce``; ``reduce`` takes the general ``Step``.
CrossStep = Callable[[torch.Tensor, int, Topology], torch.Tensor]


class Collectives:
    def __init__(self, topology: Topology, hierarchical_allreduce: bool = False,
                 hierarchical_allgather: bool = False, chunk_bytes: int = 0):
        self.topology = topology
        self.world: Communicator = topology.world
        self.hierarchical_allreduce = hierarchical_allreduce
        self.hierarchical_allgather = hierarchical_allgather
        self._chunk_bytes = chunk_bytes

    def pack_target(self, numel: int, dtype: torch.dtype,
                    whole_vectors: bool = False) -> Optional[torch.Tensor]:
        """Where to pack a fusion buffer of ``numel`` ``dtype`` elements that an elementwise op
        (or, with ``whole_vectors``, an op whose step reads whole vectors in shared memory:
        ``single_host_group``) will reduce: this rank's shared-memory slot when the in-node
        steps run there (no copy in, none of its own shard out), None otherwise.  Collective
        over the local ranks, as the reduction that follows is."""
        empty = torch.empty(0, dtype=dtype)
        nbytes = numel * empty.element_size()
        if not (self._whole_vectors_in_node(nbytes) if whole_vectors
                else self.hierarchical or self._single_node(nbytes)):
            return None
        if self.world.stages(empty):
            # a staged buffer's chunks go through the slot themselves (_staged_in_node): the
            # buffer there would be overwritten before it is read
            return None
        in_node = self.topology.in_node(empty, nbytes)
        if in_node is None:
            return None
        # room for the tables a whole-vector step keeps beside the buffer (fits_in_node's
        # spare MiB), or reserving them would move the segment, and the buffer out of it
        return in_node.buffer(numel, dtype, shm_files.MIB if whole_vectors else 0)

    def _single_node(self, nbytes: int, slot_bytes: Optional[int] = None) -> bool:
        """Whether a whole elementwise allreduce of ``nbytes`` goes through shared memory: every
        rank is on this host, which allows it, the buffer is large enough for that to beat the
        world communicator (its ``shared_memory_from_bytes``) and its slot (``slot_bytes``,
        by default ``nbytes``) fits the room the local ranks agreed on."""
        t = self.topology
        return (t.num_nodes == 1 and t.local_size > 1 and t.shared_memory and shm.available()
                and nbytes >= self.world.shared_memory_from_bytes
                and t.fits_in_node(nbytes if slot_bytes is None else slot_bytes))

    def single_host_group(self, buffer: torch.Tensor) -> Optional[shm.SharedMemoryGroup]:
        """The shared-memory group of all ranks when every one is on this host, the host
        allows it, ``buffer`` can go through it and is large enough for that to beat the world
        communicator's exchanges (its ``whole_vector_steps_in_shared_memory_from_bytes``; the
        same answer on every rank); else None.  For ops whose own step reads every rank's
        vector (in-node Adasum)."""
        if not self._whole_vectors_in_node(buffer.numel() * buffer.element_size()):
            return None
        return self.topology.in_node(buffer.view(-1))

    def every_host_group(self, buffer: torch.Tensor) -> Optional[shm.SharedMemoryGroup]:
        """This node's shared-memory group when the world spans several hosts that hold the
        same number of consecutive ranks each (``Topology.hosts_in_blocks``), not
        hierarchically, and every host can take ``buffer`` through its segment and it is as
        large as ``single_host_group`` asks; else None on every rank.  For ops whose own step
        reads every rank's vector of a node there first and crosses hosts after."""
        t, nbytes = self.topology, buffer.numel() * buffer.element_size()
        if (self.hierarchical or t.num_nodes == 1 or t.local_size == 1 or not t.hosts_in_blocks
                or nbytes < self.world.whole_vector_steps_in_shared_memory_from_bytes):
            return None
        return t.in_every_node(buffer.view(-1))

    def _whole_vectors_in_node(self, nbytes: int) -> bool:
        """Whether a step that reads whole vectors (``single_host_group``) may run in shared
        memory for a buffer of ``nbytes``: the same answer on every rank."""
        return (not self.hierarchical and self.topology.num_nodes == 1
                and nbytes >= self.world.whole_vector_steps_in_shared_memory_from_bytes)

    def _staged_in_node(self, buffer: torch.Tensor) -> Optional[shm.SharedMemoryGroup]:
        """The shared-memory group for a whole allreduce of ``buffer`` when every rank is on
        this host and the world communicator would stage the buffer through host memory (a
        GPU buffer without NCCL or a CUDA-aware MPI); else None.  The same answer on every
        rank: it follows from the topology, the size and the kind of buffer."""
        nbytes = buffer.numel() * buffer.element_size()
        chunk = min(nbytes, staging.CHUNK_BYTES)     # what the slot holds: one staged chunk
        if (self.hierarchical or not self.world.stages(buffer)
                or not self._single_node(nbytes, chunk)):
            return None
        return self.topology.in_node(torch.empty(0, dtype=buffer.dtype), chunk)

    def reduces_on_world(self, buffer: torch.Tensor) -> bool:
        """Whether an elementwise allreduce of ``buffer`` is one plain call of the world
        communicator (not hierarchical, not through shared memory)."""
        if self.hierarchical:
            return False
        return not (shm.usable_for(buffer.view(-1))
                    and self._single_node(buffer.numel() * buffer.element_size()))

    def _chunk_elements(self, buffer: torch.Tensor) -> int:
        """Elements per pipeline chunk (partition.pipeline_chunk_bytes)."""
        chunk = pipeline_chunk_bytes(buffer.numel() * buffer.element_size(), self._chunk_bytes,
                                     self.topology.size)
        return max(1, chunk // buffer.element_size())

    @property
    def hierarchical(self) -> bool:
        """Whether allreduces go through the hierarchy: asked for, and the topology allows."""
        return self.hierarchical_allreduce and self.topology.hierarchy_applies

    def reduce(self, buffer: torch.Tensor, step: Step, node_average: bool = True,
               share: Optional[Tuple[int, int]] = None,
               activity: str = "CROSS_STEP") -> torch.Tensor:
        """An op's own reduction of ``buffer`` over every rank: ``step`` on the whole buffer
        among all ranks, or (hierarchical) on this rank's part of the node's sum (average with
        ``node_average``) among the nodes (``backends.hierarchy``); in place, returns it."""
        return run_step(buffer.view(-1), self.topology, step, self.hierarchical,
                        node_average, share, activity).view_as(buffer)

    def allreduce(self, buffer: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                  cross_step: Optional[CrossStep] = None) -> torch.Tensor:
        """In-place allreduce of a flat buffer; returns it."""
        if self.hierarchical:
            in_node = self.topology.in_node(buffer)
            if in_node is not None and cross_step is None:
                cross = self.topology.cross
                tracks = trace.current_tracks()   # the chunks may run on a helper thread

                def cross_allreduce(shard):
                    with trace.transfer(cross, "CROSS_ALLREDUCE", shard, tracks=tracks):
                        return cross.allreduce(shard, op)

                with trace.activity("SHM_HIERARCHICAL_ALLREDUCE", trace.nbytes_of(buffer)):
                    return in_node.pipelined_allreduce(buffer.view(-1), op, cross_allreduce,
                                                       self._chunk_elements(buffer))
            return _hierarchical_allreduce(buffer, self.topology, op, cross_step)
        if cross_step is not None:
            return buffer.copy_(cross_step(buffer, 0, self.topology))
        in_node = self._staged_in_node(buffer)
        if in_node is not None:
            # staged through host memory anyway: the host chunks go through shared memory, as
            # a CPU buffer would, instead of over the world communicator's transport
            with trace.activity("SHM_STAGED_ALLREDUCE", trace.nbytes_of(buffer)):
                staging.stager().allreduce(buffer, lambda chunk: in_node.allreduce(chunk, op))
            return buffer
        if not self.reduces_on_world(buffer):
            with trace.activity("SHM_ALLREDUCE", trace.nbytes_of(buffer)):
                self.topology.in_node(buffer.view(-1)).allreduce(buffer.view(-1), op)
            return buffer
        with trace.transfer(self.world, "ALLREDUCE", buffer):
            return self.world.allreduce(buffer, op)

    def allreduce_started(self, buffer: torch.Tensor, op: ReduceOp,
                          done: Callable[[Optional[BaseException]], None]) -> bool:
        """``allreduce`` started and left running where it is one call of the world
        communicator and its transport can (``Communicator.allreduce_started``)."""
        return self.reduces_on_world(buffer) and self.world.allreduce_started(buffer, op, done)

    def allgather(self, tensor: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        if self.hierarchical_allgather and self.topology.hierarchy_applies:
            return hierarchical_allgather(tensor, self.topology, counts)
        with trace.transfer(self.world, "ALLGATHER", tensor):
            return self.world.allgather(tensor, counts)


def _hierarchical_allreduce(buffer: torch.Tensor, topology: Topology, op: ReduceOp,
                            cross_step: Optional[CrossStep] = None) -> torch.Tensor:
    """``op`` through the hierarchical skeleton: a plain allreduce of each shard across nodes,
    or the user's ``cross_step``."""
    if cross_step is None:
        def step(shard: torch.Tensor, span: Span) -> torch.Tensor:
            with trace.transfer(span.comm, "CROSS_ALLREDUCE", shard):
                return span.comm.allreduce(shard, op)
        hierarchical_(buffer.view(-1), topology, step, op, activity=None)
        return buffer

    def user_step(shard: torch.Tensor, span: Span) -> torch.Tensor:
        return cross_step(shard, span.offset, span.topology)
    hierarchical_(buffer.view(-1), topology, user_step, op)
    return buffer


def hierarchical_allgather(tensor: torch.Tensor, topology: Topology,
                           counts: Sequence[int]) -> torch.Tensor:
    """Gather inside the node, then node blocks across nodes; rows come back in rank order."""
    node_of = topology.node_of
    members = [[r for r in range(len(node_of)) if node_of[r] == n]
               for n in range(topology.num_nodes)]
    mine = members[node_of[topology.rank]]
    with trace.activity("NODE_ALLGATHER", trace.nbytes_of(tensor)):
        block = topology.node_allgather_rows(tensor.contiguous(), [counts[r] for r in mine])
    node_rows = [sum(counts[r] for r in m) for m in members]
    # The cross communicator is ordered by global rank, which need not be node order.
    cross_members = topology.cross_members
    node_order = [node_of[r] for r in cross_members]
    with trace.transfer(topology.cross, "CROSS_ALLGATHER", block):
        everything = topology.cross.allgather(block, [node_rows[n] for n in node_order])
    starts: List[int] = [0] * len(node_of)
    pos = 0
    for n in node_order:
        for r in members[n]:
            starts[r] = pos
            pos += counts[r]
    order = torch.cat([torch.arange(starts[r], starts[r] + counts[r]) for r in range(len(node_of))])
    return everything.index_select(0, order.to(everything.device))
