"""Communicator over MPI through mpi4py.

CPU tensors are handed to MPI without copies (numpy views of the tensor memory).  float16 and
bfloat16 reductions are carried in float32, since MPI has no standard half-precision sum; where
they are only moved, MPI sees their bits as int16 (bfloat16 has no MPI type, and float16's is
optional: a CUDA-aware Open MPI refused it on device buffers with MPI_ERR_TYPE).  CUDA tensors go
straight to MPI when it is CUDA-aware and are staged through pinned host memory otherwise (an
allreduce chunk by chunk, its copies overlapping the reduction: ``staging``); ``handover`` makes
both decisions, for every device alike.
Calls are blocking (Open MPI's non-blocking collectives are far slower for large messages) and
run under a watchdog: a call that outlives the timeout aborts the job with a message naming the
operation and rank, so nothing hangs.  The engine's negotiation, which runs over its own control
plane, catches dead and silent peers before a data call is entered in almost every case.
"""
import logging
import threading
import time
import weakref
from typing import NamedTuple

import numpy as np
import torch

from . import staging
from .base import Communicator, ReduceOp


def _mpi():
    from mpi4py import MPI
    return MPI


class _Watchdog:
    """One thread watching the deadlines of the MPI calls in flight.  A call arms its
    ``_Deadline`` by setting the deadline's ``until`` (no lock, no allocation: a reduction
    pays ~0.1 us); the thread checks every registered deadline four times a second."""

    def __init__(self):
        self._lock = threading.Lock()
        self._deadlines = weakref.WeakSet()
        self._thread = None

    def register(self, deadline: "_Deadline"):
        with self._lock:
            self._deadlines.add(deadline)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, daemon=True,
                                                name="horovod_ext-mpi-watchdog")
                self._thread.start()

    def _watch(self):
        while True:
            time.sleep(0.25)
            now = time.monotonic()
            with self._lock:
                late = [d.message() for d in list(self._deadlines) if 0.0 < d.until < now]
            if late:
                _abort_job(late[0])


def _abort_job(message: str):
    logging.getLogger("horovod_ext").critical("%s", message)
    import sys
    sys.stderr.write(f"horovod_ext: {message}\n")
    sys.stderr.flush()
    _mpi().COMM_WORLD.Abort(1)


_WATCHDOG = _Watchdog()


class _Deadline:
    """The watchdog's view of one kind of blocking call of ``comm``: armed (``until`` > 0)
    while such a call runs.  One per communicator and kind of call, made once (calls of a
    communicator run one at a time: the engine's cycle lock)."""

    __slots__ = ("_comm", "_what", "until", "__weakref__")

    def __init__(self, comm: "MPICommunicator", what: str):
        self._comm, self._what, self.until = comm, what, 0.0
        _WATCHDOG.register(self)

    def __enter__(self):
        self.until = time.monotonic() + self._comm._timeout

    def __exit__(self, *exc_info):
        self.until = 0.0

    def call(self, fn, *args):
        """``fn(*args)`` under this deadline (one method call: cheaper than ``with``)."""
        self.until = time.monotonic() + self._comm._timeout
        try:
            return fn(*args)
        finally:
            self.until = 0.0

    def message(self) -> str:  # made only when the deadline has passed
        c = self._comm
        return (f"MPI {self._what} on rank {c.rank} of {c.size} did not finish within "
                f"{c._timeout:.0f} s: a peer has died or stopped answering; aborting the job")


def cuda_aware() -> bool:
    """True when the MPI library says it can read and write CUDA memory."""
    MPI = _mpi()
    query = getattr(MPI, "Query_cuda_support", None)
    try:
        return bool(query()) if query is not None else False
    except Exception:
        return False


class Handover(NamedTuple):
    staged: bool         # copied through host memory, and the result copied back
    dtype: torch.dtype   # what MPI is given: a view of the same bytes, or a widened copy


# MPI moves these as integers of the same width: only standard MPI types reach MPI, whatever
# the build supports (mpi4py maps float16 to MPI_SHORT_FLOAT, bfloat16 to nothing).
_MOVED_AS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.bool: torch.uint8}
# ... and adds these in float32 (one rounding back at the end; bool is the caller's: base.py).
_REDUCED_AS = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def handover(device_type: str, dtype: torch.dtype, cuda_aware: bool, reduce: bool) -> Handover:
    """How a buffer reaches MPI: staged through host memory unless it is on the CPU or on a GPU
    that a CUDA-aware MPI reads; as a dtype MPI can type (for ``reduce``: one it can also add).
    The same answer for CPU and CUDA buffers except for staging, so that the CPU tests cover the
    dtypes that a CUDA-aware MPI gets."""
    staged = device_type != "cpu" and not (device_type == "cuda" and cuda_aware)
    return Handover(staged, (_REDUCED_AS if reduce else _MOVED_AS).get(dtype, dtype))


class MPICommunicator(Communicator):
    def __init__(self, comm, timeout: float = 60.0):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._timeout = timeout
        self._cuda_aware = None
        self._guards = {}
        MPI = _mpi()
        self._ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN,
                     ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD}

    @classmethod
    def world(cls, timeout: float) -> "MPICommunicator":
        # A private duplicate, so user code on COMM_WORLD never interleaves with ours.
        return cls(_mpi().COMM_WORLD.Dup(), timeout)

    def end_job(self, reason: str) -> None:
        """MPI jobs cannot start afresh after their ranks diverged (a deadlock): end it, as the
        watchdog does, with the reason on every rank's stderr."""
        _abort_job(f"{reason}; aborting the job")

    # --- buffers ------------------------------------------------------------------------------
    def _handover(self, tensor: torch.Tensor, reduce: bool) -> Handover:
        if self._cuda_aware is None and tensor.is_cuda:  # asked once, and only with GPU buffers
            self._cuda_aware = cuda_aware()
        return handover(tensor.device.type, tensor.dtype, bool(self._cuda_aware), reduce)

    def stages(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type == "cpu":
            return staging.STAGE_HOST_TENSORS
        return self._handover(tensor, False).staged

    def _host(self, tensor: torch.Tensor):
        """(tensor MPI can touch, original to copy back into or None)."""
        if self.stages(tensor):
            return staging.stager().to_host(tensor), tensor
        return tensor, None

    @staticmethod
    def _array(tensor: torch.Tensor):
        """What MPI is given to move ``tensor``'s bytes (reductions widen first: _allreduce)."""
        carried = tensor.view(handover(tensor.device.type, tensor.dtype, cuda_aware=True,
                                       reduce=False).dtype)
        # CUDA-aware MPI reads __cuda_array_interface__ directly
        return carried if carried.is_cuda else carried.numpy()

    def _guard(self, what: str) -> "_Deadline":
        """Blocking MPI calls (libnbc's non-blocking ones are up to 3x slower for large
        messages here) under a watchdog: one that outlives the timeout aborts the job with a
        message, since an MPI call cannot be interrupted."""
        guard = self._guards.get(what)
        if guard is None:
            guard = self._guards[what] = _Deadline(self, what)
        return guard

    # --- collectives --------------------------------------------------------------------------
    def _allreduce(self, tensor, op):
        if self.stages(tensor):
            # chunk by chunk, each chunk's copies overlapping its neighbours' reductions
            staging.stager().allreduce(tensor, lambda chunk: self._allreduce_here(chunk, op))
        else:
            self._allreduce_here(tensor, op)

    def _allreduce_here(self, t, op):
        """``_allreduce`` of a tensor in memory that MPI reads."""
        # widened after any staging, so that a staged float16 crosses to the host at half size
        reduced_as = self._handover(t, True).dtype
        work = t if reduced_as == t.dtype else t.to(reduced_as)
        with self._guard("allreduce"):
            self.comm.Allreduce(_mpi().IN_PLACE, self._array(work), self._ops[op])
        if work is not t:
            t.copy_(work)

    def _allgather(self, tensor, counts):
        t, orig = self._host(tensor)
        row = int(np.prod(t.shape[1:], dtype=np.int64))
        out = t.new_empty((sum(counts),) + tuple(t.shape[1:]))
        elems = [c * row for c in counts]
        displs = np.cumsum([0] + elems[:-1]).tolist()
        with self._guard("allgather"):
            self.comm.Allgatherv(self._array(t), [self._array(out), (elems, displs)])
        return out.to(orig.device) if orig is not None else out

    def _alltoall(self, tensor, send_splits, recv_splits):
        t, orig = self._host(tensor)
        row = int(np.prod(t.shape[1:], dtype=np.int64))
        out = t.new_empty((sum(recv_splits),) + tuple(t.shape[1:]))
        scounts = [s * row for s in send_splits]
        rcounts = [s * row for s in recv_splits]
        sdispls = np.cumsum([0] + scounts[:-1]).tolist()
        rdispls = np.cumsum([0] + rcounts[:-1]).tolist()
        with self._guard("alltoall"):
            self.comm.Alltoallv([self._array(t), (scounts, sdispls)],
                                [self._array(out), (rcounts, rdispls)])
        return out.to(orig.device) if orig is not None else out

    def _broadcast(self, tensor, root):
        t, orig = self._host(tensor)
        with self._guard("broadcast"):
            self.comm.Bcast(self._array(t), root=root)
        if orig is not None:
            orig.copy_(t)

    def reduce_scatter(self, tensor, counts, op=ReduceOp.SUM):
        flat = tensor.reshape(-1)
        if self.size == 1:
            return flat.clone()
        if flat.dtype in (torch.bool, torch.float16, torch.bfloat16):
            return super().reduce_scatter(flat, counts, op)
        t, orig = self._host(flat.contiguous())
        out = t.new_empty(counts[self.rank])
        with self._guard("reduce_scatter"):
            self.comm.Reduce_scatter(self._array(t), self._array(out), list(counts),
                                     self._ops[op])
        return out.to(orig.device) if orig is not None else out

    def sendrecv(self, send, dst, recv, src):
        reqs, staged, orig = [], None, None
        if send is not None and recv is not None:  # one blocking call: less overhead
            s, _ = self._host(send.contiguous())
            staged, orig = self._host(recv)
            with self._guard("sendrecv"):
                self.comm.Sendrecv(self._array(s), dst, 17, self._array(staged), src, 17)
            if orig is not None:
                orig.copy_(staged)
            return
        if send is not None:
            s, _ = self._host(send.contiguous())
            reqs.append(self.comm.Isend(self._array(s), dest=dst, tag=17))
        if recv is not None:
            staged, orig = self._host(recv)
            reqs.append(self.comm.Irecv(self._array(staged), source=src, tag=17))
        if reqs:
            with self._guard("sendrecv"):
                _mpi().Request.Waitall(reqs)
        if orig is not None:
            orig.copy_(staged)

    # Open MPI's own shared-memory transport keeps up with shm.py while a buffer fits in the
    # caches (measured with benchmarks/allreduce.py --in-node-only: 16 MiB 0.9x, 32 MiB 2.4x).
    shared_memory_from_bytes = 32 << 20
    # Adasum (benchmarks/adasum.py as a script calls it, np = 2 and 4, four interleaved runs):
    # from 4 MiB the segment's whole tree, in 4 MiB chunks whose reads come from the caches,
    # beats the exchanges, products, combination and gather of a level over Open MPI (np = 2,
    # 8 MiB: 0.75-0.85x Sum's time against 1.08-1.47x; 4 MiB: 0.78-1.16x, median 0.82, against
    # 0.82-1.03x, median 0.98); at 1-2 MiB the exchanges, whose in-node transport copies once,
    # are as fast (1 MiB, np = 4: 0.97-1.11x against 1.05-1.25x through the segment).
    whole_vector_steps_in_shared_memory_from_bytes = 4 << 20

    # CPU buffers by address (contiguous, any dtype: point-to-point moves bytes).
    prepared_by_address = True

    def prepare_sendrecv(self, send, dst, recv, src):
        if send.is_cuda or recv.is_cuda or not (send.is_contiguous() and recv.is_contiguous()):
            return super().prepare_sendrecv(send, dst, recv, src)
        MPI = _mpi()
        sbuf = [MPI.buffer.fromaddress(send.data_ptr(), send.numel() * send.element_size()),
                MPI.BYTE]
        rbuf = [MPI.buffer.fromaddress(recv.data_ptr(), recv.numel() * recv.element_size()),
                MPI.BYTE]
        exchange, guarded = self.comm.Sendrecv, self._guard("sendrecv").call
        return lambda: guarded(exchange, sbuf, dst, 17, rbuf, src, 17)

    def prepare_allreduce(self, tensor, op=ReduceOp.SUM):
        return (self.prepare_allreduce_by_address(tensor, op)
                or super().prepare_allreduce(tensor, op))

    def prepare_allreduce_by_address(self, tensor, op=ReduceOp.SUM):
        if (tensor.is_cuda or not tensor.is_contiguous() or tensor.numel() == 0
                or tensor.dtype not in (torch.float32, torch.float64, torch.int32, torch.int64)):
            return None
        MPI = _mpi()
        array = np.frombuffer(MPI.buffer.fromaddress(tensor.data_ptr(),
                                                     tensor.numel() * tensor.element_size()),
                              dtype=tensor.numpy().dtype)
        reduce, mpi_op, in_place = self.comm.Allreduce, self._ops[op], MPI.IN_PLACE
        guarded = self._guard("allreduce").call
        return lambda: guarded(reduce, in_place, array, mpi_op)

    def barrier(self):
        with self._guard("barrier"):
            self.comm.Barrier()

    def split(self, colour, key=None):
        return MPICommunicator(self.comm.Split(colour, self.rank if key is None else key),
                               self._timeout)

    def subgroup(self, ranks):
        ranks = list(ranks)
        if self.rank not in ranks:
            return None
        group = self.comm.Get_group().Incl(ranks)
        return MPICommunicator(self.comm.Create_group(group), self._timeout)

    def create_groups(self, groups):
        # MPI_Comm_create_group is collective over the group's members only, so each rank
        # takes part in just the lists that name it, in the order given.
        made = []
        for tag, ranks in enumerate(groups):
            ranks = list(ranks)
            if self.rank not in ranks:
                made.append(None)
                continue
            group = self.comm.Get_group().Incl(ranks)
            made.append(MPICommunicator(self.comm.Create_group(group, tag), self._timeout))
            group.Free()
        return made

    def transport(self, tensor=None):
        return "MPI"

    def close(self):
        MPI = _mpi()
        if self.comm != MPI.COMM_NULL and not MPI.Is_finalized():
            self.comm.Free()
            self.comm = MPI.COMM_NULL
