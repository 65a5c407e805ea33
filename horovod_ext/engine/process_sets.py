"""Horovod's process sets: collectives over a subset of the ranks.

A ``ProcessSet`` names world ranks (or an mpi4py communicator).  Sets are registered either at
``hvd.init(process_sets=[...])`` or, with ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` (or
``hvd.init(process_sets="dynamic")``), later by ``hvd.add_process_set``; both are collective
calls on every rank, in the same order.  Each registered set runs its own engine over its own
communicators (runtime.py), so requests on disjoint sets never wait on each other, and every op
of the registry (Adasum, 1-bit, random-k, hierarchical) runs inside a set on the set's
communicators.  Ranks passed to a set's collectives (``root_rank``) are world ranks, as in
Horovod.
"""
from typing import List, Optional, Sequence, Union

from . import runtime
def _is_mpi_comm(obj) -> bool:
    # By the type's module: importing mpi4py.MPI here would initialise MPI.
    return any(c.__module__.startswith("mpi4py") and c.__name__ == "Comm"
               for c in type(obj).__mro__)


class ProcessSet:
    """A set of world ranks that run collectives together; pass it as ``process_set=``."""

    def __init__(self, ranks_or_comm: Union[Sequence[int], object]):
        self.process_set_id: Optional[int] = None
        self.ranks: Optional[List[int]] = None
        self.mpi_comm = None
        if _is_mpi_comm(ranks_or_comm):
            self.mpi_comm = ranks_or_comm
            return
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("ProcessSet takes a list of ranks or an mpi4py communicator, got "
                             f"{type(ranks_or_comm).__name__}") from None
        if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
            raise ValueError(f"ProcessSet ranks must be integers, got {ranks_or_comm!r}")
        self.ranks = ranks

    def size(self) -> Optional[int]:
        """Number of ranks in the set; None before it is registered."""
        if self.process_set_id is None or not runtime.is_initialized():
            return None
        return len(runtime.process_set_ranks(self.process_set_id) or [])

    def rank(self) -> Optional[int]:
        """This process's rank inside the set, -1 when it is not a member; None before the set
        is registered."""
        if self.process_set_id is None or not runtime.is_initialized():
            return None
        ranks = runtime.process_set_ranks(self.process_set_id) or []
        me = runtime.topology().rank
        return ranks.index(me) if me in ranks else -1

    def included(self) -> Optional[bool]:
        """Whether this process is in the set; None before the set is registered."""
        rank = self.rank()
        return None if rank is None else rank >= 0

    def _invalidate(self):
        self.process_set_id = None

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
_registered: List[ProcessSet] = []   # registered set objects, global one excluded


def _world_ranks_of(process_set: ProcessSet) -> List[int]:
    if process_set.ranks is not None:
        return process_set.ranks
    # An mpi4py communicator: its ranks as ranks of the job's world.
    from mpi4py import MPI
    comm = process_set.mpi_comm
    members = list(range(comm.Get_size()))
    world_group, group = MPI.COMM_WORLD.Get_group(), comm.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, members, world_group)
    finally:
        group.Free()
        world_group.Free()
    if any(r == MPI.UNDEFINED for r in ranks):
        raise ValueError("the communicator of this ProcessSet holds processes outside "
                         "MPI_COMM_WORLD")
    return sorted(ranks)


def _register(process_set: ProcessSet) -> ProcessSet:
    if process_set is global_process_set or process_set.process_set_id == 0:
        raise ValueError("the global process set is always registered")
    if process_set.process_set_id is not None:
        raise ValueError(f"{process_set} is registered already")
    ranks = _world_ranks_of(process_set)
    size = runtime.topology().size
    if not ranks:
        raise ValueError("a process set needs at least one rank")
    if len(set(ranks)) != len(ranks) or ranks[0] < 0 or ranks[-1] >= size:
        raise ValueError(f"process set ranks {ranks} must be distinct ranks in 0..{size - 1}")
    process_set.process_set_id = runtime.add_process_set(ranks)
    process_set.ranks = ranks
    _registered.append(process_set)
    return process_set


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a process set after ``hvd.init()`` and return it.  A collective call: every
    rank calls it with the same ranks, in the same order.  Needs
    ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` or ``hvd.init(process_sets="dynamic")``."""
    if not runtime.is_initialized():
        raise ValueError("horovod_ext has not been initialized; call hvd.init() first")
    if not _dynamic:
        raise ValueError("adding process sets after hvd.init() needs "
                         "HOROVOD_DYNAMIC_PROCESS_SETS=1 or hvd.init(process_sets='dynamic')")
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.mpi_comm is not None and process_set.ranks is None:
        raise NotImplementedError("process sets added after hvd.init() are given by ranks; "
                                  "pass communicator-based sets to hvd.init(process_sets=...)")
    return _register(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Stop and unregister ``process_set``; False for the global set or one not registered.
    A collective call on every rank."""
    if not runtime.is_initialized():
        raise ValueError("horovod_ext has not been initialized; call hvd.init() first")
    if not _dynamic:
        raise ValueError("removing process sets needs HOROVOD_DYNAMIC_PROCESS_SETS=1 or "
                         "hvd.init(process_sets='dynamic')")
    set_id = process_set.process_set_id
    if set_id is None or set_id == 0:
        return False
    removed = runtime.remove_process_set(set_id)
    for known in [s for s in _registered if s.process_set_id == set_id]:
        known._invalidate()
        _registered.remove(known)
    return removed


_dynamic = False


def start(process_sets=None):
    """After ``runtime.init``: register the sets given to ``hvd.init`` and note whether sets
    may be added later."""
    global _dynamic
    config = runtime.state.config
    _dynamic = bool(config.dynamic_process_sets) or process_sets == "dynamic"
    global_process_set.ranks = list(range(runtime.topology().size))
    if process_sets is None or process_sets == "dynamic":
        return
    if isinstance(process_sets, ProcessSet):
        process_sets = [process_sets]
    by_comm = []
    for process_set in process_sets:
        if not isinstance(process_set, ProcessSet):
            raise ValueError(f"hvd.init(process_sets=...) takes ProcessSet objects or "
                             f"'dynamic', got {process_set!r}")
        if process_set is global_process_set:
            continue
        if process_set.ranks is None:
            by_comm.append(process_set)
        else:
            _register(process_set)
    for position, process_set in enumerate(by_comm):
        _register_by_comm(process_set, position)


def _register_by_comm(process_set: ProcessSet, position: int):
    """Sets given by communicators differ between ranks (each rank passes the communicator it
    is in, as from ``COMM_WORLD.Split``): every distinct one is registered, in the order of its
    ranks, and each rank's object becomes the set it is in."""
    from mpi4py import MPI
    mine = None if process_set.mpi_comm == MPI.COMM_NULL else _world_ranks_of(process_set)
    everyone = runtime.allgather_object(mine, f"__process_set_comms__.{position}")
    for ranks in sorted({tuple(r) for r in everyone if r is not None}):
        if list(ranks) == mine:
            _register(process_set)
        else:
            _register(ProcessSet(list(ranks)))


def forget():
    """At shutdown: every registered set object becomes unregistered."""
    for process_set in _registered:
        process_set._invalidate()
    _registered.clear()


def set_id_of(process_set) -> int:
    """The registered id of ``process_set`` (a clear error for anything else)."""
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a hvd.ProcessSet, got "
                        f"{type(process_set).__name__}")
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered: pass it to "
                         f"hvd.init(process_sets=...) or hvd.add_process_set() first")
    return process_set.process_set_id
