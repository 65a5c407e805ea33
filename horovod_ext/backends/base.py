"""The one communicator interface that every algorithm in horovod_ext is written against.

A Communicator is a group of ranks that can exchange tensors.  Implementations exist for
torch.distributed (Gloo on CPU, NCCL on CUDA) and for MPI (mpi4py).  Algorithms (Adasum, 1-bit,
random-k) use only the methods declared here, the way Horovod's C++ ``Adasum<Comm>`` uses only a
handful of communicator methods.

Conventions: collectives work on contiguous tensors; ``allreduce``/``broadcast`` are in place,
the others return new tensors.  Every call finishes or raises ``CommunicationError`` within the
communicator's timeout.
"""
import enum
import pickle
from abc import ABC, abstractmethod
from typing import Callable, List, Optional, Sequence

import torch


class CommunicationError(RuntimeError):
    """A collective failed: a peer died, stopped answering, or the transport broke."""


class PeerClosedError(CommunicationError):
    """A peer closed its connection (it died or shut down): the symptom, not the cause, when the
    peer stopped because of a failure it reported on the heartbeat channel."""


class RefusedOnEveryRank(ValueError):
    """A call refused before any data moved, for a reason the ranks derived from the same
    gathered facts.  ``whole_job``: every rank of the job raises it alike, so only that request
    fails and the engine goes on (no peer is left waiting mid-collective); a refusal within a
    subgroup leaves the other ranks in the collective, so it stops the engine as any error."""

    def __init__(self, message: str, whole_job: bool):
        super().__init__(message)
        self.whole_job = whole_job


class ReduceOp(enum.Enum):
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


# bool has no arithmetic: OR for sum/max, AND for product/min, carried as uint8.
_BOOL_OPS = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.MAX: ReduceOp.MAX,
             ReduceOp.MIN: ReduceOp.MIN, ReduceOp.PRODUCT: ReduceOp.MIN}


def split_sizes(total: int, parts: int) -> List[int]:
    """Split ``total`` items into ``parts`` nearly equal counts, the first ones one larger."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def allreduce_average_(tensor: "torch.Tensor", comm: "Communicator") -> "torch.Tensor":
    """``tensor`` replaced in place by its full-precision average over ``comm``; returns it."""
    if comm.size > 1:
        comm.allreduce(tensor, ReduceOp.SUM).div_(comm.size)
    return tensor


class Communicator(ABC):
    """A group of ``size`` ranks; this process is ``rank`` in it."""

    rank: int
    size: int

    # --- collectives every implementation provides -------------------------------------------
    @abstractmethod
    def _allreduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """In-place allreduce of a contiguous non-bool tensor."""

    @abstractmethod
    def _allgather(self, tensor: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Concatenate along dim 0 the tensors of all ranks; rank i contributes counts[i] rows."""

    @abstractmethod
    def _alltoall(self, tensor: torch.Tensor, send_splits: Sequence[int],
                  recv_splits: Sequence[int]) -> torch.Tensor:
        """Send rows send_splits[i] to rank i; receive recv_splits[i] rows from rank i."""

    @abstractmethod
    def _broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """In-place broadcast from ``root``."""

    @abstractmethod
    def sendrecv(self, send: Optional[torch.Tensor], dst: Optional[int],
                 recv: Optional[torch.Tensor], src: Optional[int]) -> None:
        """Send ``send`` to ``dst`` while receiving into ``recv`` from ``src`` (either may be None)."""

    @abstractmethod
    def barrier(self) -> None:
        """Return once every rank has entered."""

    def abort(self, reason: str) -> None:
        """End this rank's waits in calls on this communicator, now and later, with a
        ``CommunicationError(reason)``: a peer has failed elsewhere (faults).  Where a blocked
        call cannot be left (MPI), the job ends instead (``end_job``)."""

    def end_job(self, reason: str) -> None:
        """End the whole job over ``reason``, where the transport's convention is that errors
        are fatal (MPI: a job cannot start afresh); elsewhere return, and the caller raises."""

    @abstractmethod
    def split(self, colour: int, key: Optional[int] = None) -> "Communicator":
        """Collective over this communicator: ranks with equal colour form a new communicator,
        ordered by (key, rank)."""

    @abstractmethod
    def subgroup(self, ranks: Sequence[int]) -> Optional["Communicator"]:
        """Communicator of the listed ranks (ranks of this communicator, in that order).  Called
        by the listed ranks only; returns None on a rank that is not listed."""

    @abstractmethod
    def create_groups(self, groups: Sequence[Sequence[int]]) -> List[Optional["Communicator"]]:
        """Collective over this communicator: every rank passes the same lists of ranks
        (ascending) and gets, for each list, the communicator of those ranks where it is
        listed and None elsewhere.  Safe to call again with lists seen before."""

    def close(self) -> None:
        """Release transport resources; the communicator is unusable afterwards."""

    def stages(self, tensor: torch.Tensor) -> bool:
        """Whether this communicator carries ``tensor`` through host memory (a device tensor
        that its transport cannot read); such an allreduce among the ranks of one host may as
        well go through the shared-memory group."""
        return False

    def transport(self, tensor: Optional[torch.Tensor] = None) -> str:
        """The name of what carries ``tensor`` here (MPI, GLOO, NCCL), for the timeline."""
        return type(self).__name__.replace("Communicator", "").upper()

    # --- the same call again and again --------------------------------------------------------
    #: From this many bytes, an allreduce among ranks of one host goes faster through the
    #: shared-memory group (shm.py) than through this communicator.  Gloo's loopback sockets
    #: lose at every size: a 1 KiB Sum took 474 us over them and 152 us through shared memory
    #: at 2 ranks, 4.8 ms and 0.6 ms at 4 ranks on 2 cores.
    shared_memory_from_bytes = 0
    #: From this many bytes, a step that reads every local rank's vector (in-node Adasum) goes
    #: faster through the shared-memory group than as exchanges over this communicator.
    whole_vector_steps_in_shared_memory_from_bytes = 0

    # Algorithms that repeat one exchange every step (Adasum's levels) can prepare it once.
    # Right after a large transfer has evicted the caches, each torch op on the way to the
    # transport (a slice, a tensor -> buffer conversion) costs more than the call itself.
    #: True when prepared calls hold no reference to the tensors, only their addresses: they
    #: stay valid for any later tensor with the same memory, and keeping them frees nothing late.
    prepared_by_address = False

    def prepare_sendrecv(self, send: torch.Tensor, dst: int, recv: torch.Tensor,
                         src: int) -> Callable[[], None]:
        """``sendrecv(send, dst, recv, src)`` as a function to call any number of times."""
        return lambda: self.sendrecv(send, dst, recv, src)

    def prepare_allreduce(self, tensor: torch.Tensor,
                          op: ReduceOp = ReduceOp.SUM) -> Callable[[], None]:
        """``allreduce(tensor, op)`` (in place) as a function to call any number of times."""
        return lambda: self.allreduce(tensor, op)

    def prepare_allreduce_by_address(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM
                                     ) -> Optional[Callable[[], None]]:
        """``prepare_allreduce`` holding only ``tensor``'s address (valid for any later tensor
        with the same memory, dtype and size), or None where this communicator cannot."""
        return None

    def allreduce_started(self, tensor: torch.Tensor, op: ReduceOp,
                          done: Callable[[Optional[BaseException]], None]) -> bool:
        """Start an in-place allreduce of a contiguous floating-point ``tensor`` that goes on
        while the caller does, where the transport can: True, and ``done(error or None)`` is
        called once, from another thread, when it has ended; False: nothing started (call
        ``allreduce``)."""
        return False

    # --- dtype handling shared by all implementations ----------------------------------------
    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """In-place allreduce; returns ``tensor``.  bool reduces as OR (sum, max) / AND."""
        if self.size == 1:
            return tensor
        if tensor.dtype == torch.bool:
            carrier = tensor.to(torch.uint8)
            self._allreduce(carrier, _BOOL_OPS[op])
            tensor.copy_(carrier.bool())
            return tensor
        self._allreduce(tensor, op)
        return tensor

    def allgather(self, tensor: torch.Tensor, counts: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Concatenation over ranks along dim 0; ``counts`` gives every rank's first dimension
        (uneven allowed).  Without counts the first dimensions are exchanged first."""
        tensor = tensor.contiguous()
        if tensor.dim() == 0:
            tensor = tensor.reshape(1)
        if counts is None:
            counts = self.allgather_counts(tensor.shape[0])
        if self.size == 1:
            return tensor.clone()
        return self._allgather(tensor, list(counts))

    def allgather_counts(self, count: int) -> List[int]:
        """Every rank's integer ``count``, in rank order."""
        if self.size == 1:
            return [count]
        mine = torch.tensor([count], dtype=torch.int64)
        return [int(c) for c in self._allgather(mine, [1] * self.size).tolist()]

    def alltoall(self, tensor: torch.Tensor, send_splits: Optional[Sequence[int]] = None,
                 recv_splits: Optional[Sequence[int]] = None) -> torch.Tensor:
        """All-to-all along dim 0.  Without splits dim 0 is divided evenly; without recv_splits
        they are exchanged first."""
        tensor = tensor.contiguous()
        if send_splits is None:
            if tensor.shape[0] % self.size:
                raise ValueError(f"alltoall: first dimension {tensor.shape[0]} is not divisible "
                                 f"by the number of ranks {self.size}; pass splits")
            send_splits = [tensor.shape[0] // self.size] * self.size
        if recv_splits is None:
            recv_splits = self.exchange_splits(send_splits)
        if self.size == 1:
            return tensor.clone()
        return self._alltoall(tensor, list(send_splits), list(recv_splits))

    def exchange_splits(self, send_splits: Sequence[int]) -> List[int]:
        """recv_splits[i] = rank i's send_splits[self.rank]."""
        if self.size == 1:
            return list(send_splits)
        table = self._allgather(torch.tensor(list(send_splits), dtype=torch.int64),
                                [self.size] * self.size).reshape(self.size, self.size)
        return [int(x) for x in table[:, self.rank].tolist()]

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """In-place broadcast from ``root``; returns ``tensor``."""
        if self.size > 1:
            self._broadcast(tensor, root)
        return tensor

    def reduce_scatter(self, tensor: torch.Tensor, counts: Sequence[int],
                       op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """Reduce a flat tensor over ranks; rank i receives the reduced elements of its block
        of ``counts[i]`` elements.  Default: all-to-all then a local reduction."""
        flat = tensor.reshape(-1)
        if self.size == 1:
            return flat.clone()
        parts = self._alltoall(flat, list(counts), [counts[self.rank]] * self.size)
        parts = parts.reshape(self.size, counts[self.rank])
        return _reduce_rows(parts, op)

    # --- object helpers (pickle over uint8 tensors) -------------------------------------------
    def broadcast_object(self, obj=None, root: int = 0):
        if self.size == 1:
            return obj
        payload = _dumps(obj) if self.rank == root else torch.empty(0, dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        self._broadcast(length, root)
        if self.rank != root:
            payload = torch.empty(int(length), dtype=torch.uint8)
        self._broadcast(payload, root)
        return obj if self.rank == root else _loads(payload)

    def allgather_object(self, obj) -> list:
        payload = _dumps(obj)
        if self.size == 1:
            return [obj]
        counts = self.allgather_counts(payload.numel())
        gathered = self._allgather(payload, counts)
        out, offset = [], 0
        for c in counts:
            out.append(_loads(gathered[offset:offset + c]))
            offset += c
        return out


def _reduce_rows(parts: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    if parts.dtype == torch.bool:
        op = _BOOL_OPS[op]
    if op is ReduceOp.SUM:
        return parts.sum(0, dtype=parts.dtype)
    if op is ReduceOp.MIN:
        return parts.min(0).values
    if op is ReduceOp.MAX:
        return parts.max(0).values
    return parts.prod(0, dtype=parts.dtype)


def _dumps(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _loads(payload: torch.Tensor):
    return pickle.loads(payload.numpy().tobytes())
