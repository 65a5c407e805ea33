"""Which ranks share a node: the world, local (same host) and cross (same local rank) groups.

Hosts are told apart by host name (HOROVOD_HOSTNAME overrides it); nodes are numbered in the
order of their lowest rank, and local ranks follow global rank order inside a node.  The in-node
steps of hierarchical algorithms (``node_reduce_scatter``, ``node_allgather``,
``node_allgather_rows``) go through shared memory (shm.py) once the runtime has allowed it, over
the local communicator otherwise, and so does a buffer whose slot would not fit the room the
segment's directory left when the runtime allowed shared memory (``allow_shared_memory``).
"""
import logging
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import FrozenSet, List, Optional, Sequence

import torch

from . import shm, shm_files
from .base import Communicator, ReduceOp, split_sizes

log = logging.getLogger("horovod_ext")


def _layout(hostnames: Sequence[str]):
    """For processes 0..n-1 on ``hostnames``: (node of each, the processes of each node,
    the processes with each local rank (one per node that has that many), each one's local
    rank).  Nodes are numbered in the order of their lowest process."""
    nodes: List[str] = []
    for h in hostnames:
        if h not in nodes:
            nodes.append(h)
    node_of = [nodes.index(h) for h in hostnames]
    local_groups = [[q for q in range(len(hostnames)) if node_of[q] == n]
                    for n in range(len(nodes))]
    position = [local_groups[node_of[q]].index(q) for q in range(len(hostnames))]
    cross_groups = [[q for q in range(len(hostnames)) if position[q] == p]
                    for p in range(max(position) + 1)]
    return node_of, local_groups, cross_groups, position


def _on_one_host(comm: Communicator) -> None:
    """Tell a two-rank communicator whose ranks share a host (a Gloo pair that may sum by
    exchange) so, so that it never takes them for a far pair."""
    pair = getattr(comm, "pair", None)
    if pair is not None:
        pair.on_one_host()


def _fits(nbytes: int, room: Optional[int]) -> bool:
    """Whether a slot for ``nbytes``, with a MiB to spare for the tables some steps keep beside
    the buffer (in-node Adasum's), fits ``room`` (None: no limit)."""
    return room is None or shm_files.slot_bytes(nbytes) + shm_files.MIB <= room


@dataclass
class Topology:
    world: Communicator
    local: Communicator
    cross: Communicator
    hostnames: List[str]      # per world rank
    node_of: List[int]        # node index per world rank
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    is_homogeneous: bool
    # set by the runtime: whether the in-node steps may use shared memory, and their timeout
    shared_memory: bool = False
    timeout: float = 60.0
    # the largest slot the segment may have, as the local ranks agreed (None: no limit)
    shared_memory_room: Optional[int] = None
    # the smallest such room of any host, as the whole world agreed (None: no limit anywhere,
    # 0: some host has no segment): what a step that runs in every node's segment at once fits
    shared_memory_everywhere: Optional[int] = 0
    _in_node: Optional[shm.SharedMemoryGroup] = field(default=None, repr=False)
    _said_too_large: bool = field(default=False, repr=False)
    # communicators made over these ranks later (backends/lane.py), aborted and closed with them
    _attached: List[Communicator] = field(default_factory=list, repr=False)

    @property
    def hierarchy_applies(self) -> bool:
        """Whether hierarchical algorithms can run: several nodes, more than one process on
        each, and the same number on each."""
        return self.num_nodes > 1 and self.local_size > 1 and self.is_homogeneous

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def size(self) -> int:
        return self.world.size

    @property
    def num_nodes(self) -> int:
        return max(self.node_of) + 1

    @cached_property
    def other_hosts(self) -> FrozenSet[int]:
        """World ranks on other hosts than this rank's (node_of never changes)."""
        mine = self.node_of[self.rank]
        return frozenset(r for r, node in enumerate(self.node_of) if node != mine)

    @property
    def cross_members(self) -> List[int]:
        """World ranks in this rank's cross communicator, in that communicator's rank order
        (ascending world rank): the ranks with the same local rank, one per node."""
        return [r for r in range(len(self.node_of))
                if self.node_of[:r].count(self.node_of[r]) == self.local_rank]

    @classmethod
    def build(cls, world: Communicator, hostname: str) -> "Topology":
        hostnames = world.allgather_object(hostname)
        node_of, local_groups, cross_groups, position = _layout(hostnames)
        me = world.rank
        local_ranks = local_groups[node_of[me]]
        cross_members = cross_groups[position[me]]
        local = world if len(local_groups) == 1 else world.split(node_of[me])
        cross = world if len(cross_members) == world.size else world.split(position[me])
        _on_one_host(local)
        return cls(world=world, local=local, cross=cross, hostnames=hostnames, node_of=node_of,
                   local_rank=position[me], local_size=len(local_ranks),
                   cross_rank=cross_members.index(me), cross_size=len(cross_members),
                   is_homogeneous=len({len(g) for g in local_groups}) == 1)

    @classmethod
    def for_ranks(cls, parent: "Topology", ranks: Sequence[int]) -> Optional["Topology"]:
        """The topology of a subset of ``parent``'s world (ascending world ranks), with its own
        local and cross communicators.  Collective over the whole parent world (every rank
        passes the same ranks); None on ranks outside the subset."""
        ranks = list(ranks)
        hostnames = [parent.hostnames[r] for r in ranks]
        node_of, local_groups, cross_groups, position = _layout(hostnames)
        # as world ranks of the parent, for create_groups
        local_groups = [[ranks[i] for i in g] for g in local_groups]
        cross_groups = [[ranks[i] for i in g] for g in cross_groups]
        groups = [ranks]
        if len(local_groups) > 1:
            groups += local_groups
        if len(cross_groups) > 1:
            groups += cross_groups
        made = dict(zip(map(tuple, groups), parent.world.create_groups(groups)))
        if parent.rank not in ranks:
            return None
        me = ranks.index(parent.rank)
        world = made[tuple(ranks)]
        local_ranks = local_groups[node_of[me]]
        _on_one_host(made.get(tuple(local_ranks), world) if len(local_groups) > 1 else world)
        cross_members = cross_groups[position[me]]
        return cls(world=world, local=made.get(tuple(local_ranks), world),
                   cross=made.get(tuple(cross_members), world), hostnames=hostnames,
                   node_of=node_of, local_rank=position[me], local_size=len(local_ranks),
                   cross_rank=cross_members.index(parent.rank), cross_size=len(cross_members),
                   is_homogeneous=len({len(g) for g in local_groups}) == 1)

    # --- in-node steps of hierarchical algorithms ------------------------------------------
    def allow_shared_memory(self, allowed: bool, timeout: float) -> None:
        """Whether the in-node steps may use shared memory (HOROVOD_SHARED_MEMORY), their
        timeout, and the room a slot may have: local rank 0's reading of what the segment's
        directory leaves each local rank now, so that every local rank takes the same buffers
        through it.  Collective over the local ranks."""
        self.shared_memory, self.timeout = allowed, timeout
        usable = allowed and self.local_size > 1 and shm.available()
        if usable:
            room = (shm_files.room_per_rank(shm.SEGMENT_DIR, self.local_size)
                    if self.local_rank == 0 else None)
            self.shared_memory_room = self.local.broadcast_object(room, root=0)
        rooms = [self.shared_memory_room if usable else 0]
        if self.num_nodes > 1:
            rooms = self.world.allgather_object(rooms[0])
        limited = [r for r in rooms if r is not None]
        self.shared_memory_everywhere = min(limited) if limited else None

    @cached_property
    def hosts_in_blocks(self) -> bool:
        """Whether every host holds the same number of consecutive ranks (node_of never
        changes): then a tree over the ranks in rank order can start with one subtree per
        host."""
        return self.is_homogeneous and all(node == r // self.local_size
                                           for r, node in enumerate(self.node_of))

    def in_every_node(self, buffer: torch.Tensor) -> Optional[shm.SharedMemoryGroup]:
        """``in_node`` for a step that every node runs in its own segment at the same time,
        so that every rank must take the same way: this node's group where every host can
        take ``buffer`` (``shared_memory_everywhere``), else None on every rank."""
        if not _fits(buffer.numel() * buffer.element_size(), self.shared_memory_everywhere):
            return None
        return self.in_node(buffer)

    def in_node(self, buffer: torch.Tensor,
                nbytes: Optional[int] = None) -> Optional[shm.SharedMemoryGroup]:
        """The shared-memory group of this node's ranks for ``buffer``, or None (the local
        communicator then carries the in-node steps); ``nbytes``: the most any local rank
        puts in its slot, where that is not ``buffer``'s size.  Made at first use: a
        collective step of the local ranks, which reach it with the same buffer."""
        size = buffer.numel() * buffer.element_size() if nbytes is None else nbytes
        if (not self.shared_memory or self.local_size < 2 or not shm.available()
                or not shm.usable_for(buffer) or not self.fits_in_node(size)):
            return None
        if self._in_node is None:
            self._in_node = shm.SharedMemoryGroup(self.local, self.timeout)
        return self._in_node

    def fits_in_node(self, nbytes: int) -> bool:
        """Whether a slot for ``nbytes`` fits the agreed room, with a MiB to spare for the
        tables some steps keep beside the buffer (in-node Adasum's); says so once where not."""
        room = self.shared_memory_room
        if _fits(nbytes, room):
            return True
        if not self._said_too_large and self.local_rank == 0:
            log.warning(
                "horovod_ext: a buffer of %.0f MiB does not fit the in-node shared memory "
                "(%s left %.0f MiB for each of %d local ranks at start-up); such buffers "
                "are reduced through the transport, more slowly: give %s more room (docker run "
                "--shm-size=..., or --ipc=host)", nbytes / shm_files.MIB, shm.SEGMENT_DIR,
                room / shm_files.MIB, self.local_size, shm.SEGMENT_DIR)
        self._said_too_large = True
        return False

    def node_reduce_scatter(self, flat: torch.Tensor, op: ReduceOp = ReduceOp.SUM
                            ) -> torch.Tensor:
        """This rank's shard (``split_sizes`` over the local ranks) of ``flat`` reduced over the
        node; pass it, changed or not, to ``node_allgather`` next."""
        in_node = self.in_node(flat)
        if in_node is not None:
            return in_node.reduce_scatter(flat, op)
        return self.local.reduce_scatter(flat, split_sizes(flat.numel(), self.local_size), op)

    def node_allreduce(self, flat: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """``flat`` (1-D, contiguous) reduced over the node's ranks, in place; returns it."""
        in_node = self.in_node(flat)
        if in_node is not None:
            return in_node.allreduce(flat, op)
        return self.local.allreduce(flat, op)

    def node_allgather(self, flat: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        """``flat`` filled with every local rank's ``shard``; returns ``flat``."""
        in_node = self.in_node(flat)
        if in_node is not None:
            return in_node.allgather(flat, shard)
        return flat.copy_(self.local.allgather(shard, split_sizes(flat.numel(),
                                                                  self.local_size)))

    def node_allgather_rows(self, tensor: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Every local rank's ``tensor`` (``counts``: rows per local rank) along dim 0."""
        row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()   # alike on all
        in_node = (self.in_node(tensor.reshape(-1), max(counts) * row_bytes)
                   if tensor.is_contiguous() else None)
        if in_node is not None:
            return in_node.allgather_rows(tensor, list(counts))
        return self.local.allgather(tensor, counts)

    def abort_waits(self, reason: str):
        """End this rank's waits for its peers, in shared memory and in its communicators,
        with ``reason`` (a peer has failed, liveness.py)."""
        if self._in_node is not None:
            self._in_node.abort(reason)
        for comm in self._communicators():
            comm.abort(reason)

    def close(self):
        if self._in_node is not None:
            self._in_node.close()
            self._in_node = None
        for comm in self._communicators():
            comm.close()

    def attach(self, comm: Communicator) -> None:
        """Abort and close ``comm`` with this topology's communicators."""
        self._attached.append(comm)

    def _communicators(self):
        """The cross, local, world and attached communicators, each once (the first three may
        be one object)."""
        return {id(c): c for c in (self.cross, self.local, self.world, *self._attached)}.values()
