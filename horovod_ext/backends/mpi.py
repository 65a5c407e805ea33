"""Communicator over MPI through mpi4py.

CPU tensors are handed to MPI without copies (numpy views of the tensor memory).  float16 and
bfloat16 reductions are carried in float32, since MPI has no standard half-precision sum.  CUDA
tensors go straight to MPI when it is CUDA-aware and are staged through host memory otherwise.
Every call is issued non-blocking and waited on with a deadline, so a dead or silent peer becomes
a ``CommunicationError`` instead of a hang.
"""
import time
from typing import Optional, Sequence

import numpy as np
import torch

from .base import CommunicationError, Communicator, ReduceOp


def _mpi():
    from mpi4py import MPI
    return MPI


def cuda_aware() -> bool:
    """True when the MPI library says it can read and write CUDA memory."""
    MPI = _mpi()
    query = getattr(MPI, "Query_cuda_support", None)
    try:
        return bool(query()) if query is not None else False
    except Exception:
        return False


class MPICommunicator(Communicator):
    def __init__(self, comm, timeout: float = 60.0):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._timeout = timeout
        self._cuda_aware = None
        MPI = _mpi()
        self._ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.MIN: MPI.MIN,
                     ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD}

    @classmethod
    def world(cls, timeout: float) -> "MPICommunicator":
        # A private duplicate, so user code on COMM_WORLD never interleaves with ours.
        return cls(_mpi().COMM_WORLD.Dup(), timeout)

    # --- buffers ------------------------------------------------------------------------------
    def _host(self, tensor: torch.Tensor):
        """(tensor MPI can touch, original to copy back into or None)."""
        if tensor.is_cuda:
            if self._cuda_aware is None:
                self._cuda_aware = cuda_aware()
            if not self._cuda_aware:
                return tensor.cpu(), tensor
        return tensor, None

    @staticmethod
    def _array(tensor: torch.Tensor):
        if tensor.is_cuda:
            return tensor  # CUDA-aware MPI reads __cuda_array_interface__ directly
        if tensor.dtype == torch.bfloat16:
            return tensor.view(torch.int16).numpy()
        if tensor.dtype == torch.bool:
            return tensor.view(torch.uint8).numpy()
        return tensor.numpy()

    def _wait(self, requests, what: str):
        MPI = _mpi()
        if not isinstance(requests, list):
            requests = [requests]
        deadline = time.monotonic() + self._timeout
        spins, pause = 0, 0.0
        while not MPI.Request.Testall(requests):
            spins += 1
            if spins > 200:  # past the first microseconds, stop burning the core we share
                pause = min(max(pause * 2, 1e-5), 1e-3)
                time.sleep(pause)
                if time.monotonic() > deadline:
                    raise CommunicationError(
                        f"MPI {what} on rank {self.rank} of {self.size} did not finish within "
                        f"{self._timeout:.0f} s: a peer has died or stopped answering")

    # --- collectives --------------------------------------------------------------------------
    def _allreduce(self, tensor, op):
        t, orig = self._host(tensor)
        widened = t.dtype in (torch.float16, torch.bfloat16)
        work = t.float() if widened else t
        self._wait(self.comm.Iallreduce(_mpi().IN_PLACE, self._array(work), self._ops[op]),
                   "allreduce")
        if widened:
            t.copy_(work)
        if orig is not None:
            orig.copy_(t)

    def _allgather(self, tensor, counts):
        t, orig = self._host(tensor)
        row = int(np.prod(t.shape[1:], dtype=np.int64))
        out = t.new_empty((sum(counts),) + tuple(t.shape[1:]))
        elems = [c * row for c in counts]
        displs = np.cumsum([0] + elems[:-1]).tolist()
        self._wait(self.comm.Iallgatherv(self._array(t), [self._array(out), (elems, displs)]),
                   "allgather")
        return out.to(orig.device) if orig is not None else out

    def _alltoall(self, tensor, send_splits, recv_splits):
        t, orig = self._host(tensor)
        row = int(np.prod(t.shape[1:], dtype=np.int64))
        out = t.new_empty((sum(recv_splits),) + tuple(t.shape[1:]))
        scounts = [s * row for s in send_splits]
        rcounts = [s * row for s in recv_splits]
        sdispls = np.cumsum([0] + scounts[:-1]).tolist()
        rdispls = np.cumsum([0] + rcounts[:-1]).tolist()
        self._wait(self.comm.Ialltoallv([self._array(t), (scounts, sdispls)],
                                        [self._array(out), (rcounts, rdispls)]), "alltoall")
        return out.to(orig.device) if orig is not None else out

    def _broadcast(self, tensor, root):
        t, orig = self._host(tensor)
        self._wait(self.comm.Ibcast(self._array(t), root=root), "broadcast")
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
        self._wait(self.comm.Ireduce_scatter(self._array(t), self._array(out), list(counts),
                                             self._ops[op]), "reduce_scatter")
        return out.to(orig.device) if orig is not None else out

    def sendrecv(self, send, dst, recv, src):
        reqs, staged, orig = [], None, None
        if send is not None:
            s, _ = self._host(send.contiguous())
            reqs.append(self.comm.Isend(self._array(s), dest=dst, tag=17))
        if recv is not None:
            staged, orig = self._host(recv)
            reqs.append(self.comm.Irecv(self._array(staged), source=src, tag=17))
        if reqs:
            self._wait(reqs, "sendrecv")
        if orig is not None:
            orig.copy_(staged)

    def barrier(self):
        self._wait(self.comm.Ibarrier(), "barrier")

    def split(self, colour, key=None):
        return MPICommunicator(self.comm.Split(colour, self.rank if key is None else key),
                               self._timeout)

    def subgroup(self, ranks):
        ranks = list(ranks)
        if self.rank not in ranks:
            return None
        group = self.comm.Get_group().Incl(ranks)
        return MPICommunicator(self.comm.Create_group(group), self._timeout)

    def close(self):
        MPI = _mpi()
        if self.comm != MPI.COMM_NULL and not MPI.Is_finalized():
            self.comm.Free()
            self.comm = MPI.COMM_NULL
