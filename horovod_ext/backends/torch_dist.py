"""Communicator over torch.distributed: Gloo for CPU tensors, NCCL for CUDA tensors.

One code path for both devices: each communicator holds a Gloo process group and, where CUDA and
NCCL are available and wanted, an NCCL group over the same ranks; a call picks the group from the
tensor's device.  CUDA tensors without NCCL are staged through pinned host memory over Gloo
(``staging``: an allreduce chunk by chunk, its copies overlapping the collective).  Before
its first NCCL collective a communicator checks, over Gloo, that no two of its ranks drive the
same GPU (``devices``), so that such a layout fails at once, saying what to change.

Gloo calls are issued asynchronously and waited for in slices: a thread blocked in one, waiting
for a peer that has failed elsewhere, is released by ``abort`` (faults, liveness.py) at once
rather than at the group's timeout.  A send or receive cannot be waited for in slices: a wait
that runs out ends it (Gloo closes the pair), so a long exchange would fail; its works are
waited for whole by a helper thread (``point_to_point``) while the caller waits in slices.  Gloo
cannot cancel the call itself, and destroying a group whose call still waits blocks until that
timeout (its destructor joins the waiting thread), so an aborted group is kept, unused, for the
life of the process; the next ``hvd.init()`` makes new ones, and the process's exit closes the old
one's sockets.
"""
import ctypes
import datetime
import functools
from typing import Sequence

import torch
import torch.distributed as dist

from . import devices, pair_exchange, point_to_point, staging
from .base import CommunicationError, Communicator, PeerClosedError, ReduceOp

# torch 2.13 renamed all_gather_into_tensor; keep working on releases either side of that.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_WAIT_SLICE = datetime.timedelta(milliseconds=100)   # how soon a blocked call sees an abort
_ABANDONED = []   # aborted Gloo groups, never destroyed (see the module's docstring)


_TORCH_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MIN: dist.ReduceOp.MIN,
              ReduceOp.MAX: dist.ReduceOp.MAX, ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT}


def _wrap_errors(fn):
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except CommunicationError:
            raise
        except RuntimeError as exc:  # Gloo/NCCL report timeouts and dead peers as RuntimeError
            raise CommunicationError(f"torch.distributed {fn.__name__.lstrip('_')} failed on "
                                     f"rank {self.rank} of {self.size}: {exc}") from exc
    wrapper.__name__ = fn.__name__
    return wrapper


class TorchCommunicator(Communicator):
    """Ranks ``global_ranks`` of the default torch.distributed world."""

    def __init__(self, global_ranks: Sequence[int], cpu_group, cuda_group=None,
                 timeout: datetime.timedelta = datetime.timedelta(seconds=60)):
        self.global_ranks = list(global_ranks)
        self.size = len(self.global_ranks)
        self.rank = self.global_ranks.index(dist.get_rank())
        self._cpu_group = cpu_group
        self._cuda_group = cuda_group
        self._timeout = timeout
        self._owns_groups = False
        self._gpu_error = None  # None: not checked yet; "": every rank has a GPU of its own
        self._aborted = None    # why waits end at once: a peer has failed (abort)
        self._p2p_waiter = None  # made at the first send/receive over Gloo
        self.pair = pair_exchange.PairExchange(self) if self.size == 2 else None

    @classmethod
    def world(cls, use_nccl: bool, timeout: datetime.timedelta) -> "TorchCommunicator":
        """The default process group (Gloo) plus, when asked, an NCCL group over all ranks."""
        cuda_group = dist.new_group(backend="nccl", timeout=timeout) if use_nccl else None
        return cls(range(dist.get_world_size()), dist.group.WORLD, cuda_group, timeout)

    # --- helpers ------------------------------------------------------------------------------
    def abort(self, reason: str):
        """End this communicator's Gloo waits, now and later, with ``reason``."""
        self._aborted = reason
        group = self._cpu_group
        if not any(g is group for g in _ABANDONED):
            _ABANDONED.append(group)
            # a reference nothing releases, not even the interpreter's exit
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))

    def _call(self, collective, *args, group, **kwargs):
        """``collective(*args, group=group, **kwargs)``, waited for by ``_wait``."""
        self._start(collective, *args, group=group, **kwargs)()

    def _start(self, collective, *args, group, **kwargs):
        """``collective(*args, group=group, **kwargs)`` started; returns what waits for it
        (``_wait``)."""
        return functools.partial(self._wait, collective(*args, group=group, async_op=True,
                                                        **kwargs), group)

    def _wait(self, work, group):
        """Over Gloo, in slices, so that ``abort`` ends the wait; NCCL's as it comes."""
        if group is self._cuda_group:
            return work.wait()
        while True:
            self._raise_if_aborted()
            try:
                work.wait(timeout=_WAIT_SLICE)
                return
            except RuntimeError:
                # The slice ran out, or the call failed; a call that completes between the two
                # checks is done: its own wait raises its error, if it has one.
                if work.is_completed():
                    work.wait()
                    return

    def _raise_if_aborted(self):
        if self._aborted is not None:
            raise CommunicationError(f"abandoned on rank {self.rank}: {self._aborted}")

    def _wait_point_to_point(self, works):
        """[(send/receive work, its group)]: Gloo's whole (see point_to_point), NCCL's as they
        come."""
        gloo = [work for work, group in works if group is not self._cuda_group]
        for work, group in works:
            if group is self._cuda_group:
                work.wait()
        if gloo:
            self._raise_if_aborted()
            self._waiter().wait(gloo, self._raise_if_aborted, _WAIT_SLICE.total_seconds())

    def _waiter(self) -> point_to_point.PointToPointWaiter:
        if self._p2p_waiter is None:
            self._p2p_waiter = point_to_point.PointToPointWaiter()
        return self._p2p_waiter

    def sendrecv_started(self, send, recv, peer: int) -> point_to_point.Batch:
        """Exchange contiguous host tensors with rank ``peer`` over Gloo, ``send`` for
        ``recv``, without waiting: the started works' batch, whose ``done`` the helper thread
        sets.  The receive is posted first, as in ``sendrecv``."""
        peer, group = self.global_ranks[peer], self._cpu_group
        return self._waiter().submit([dist.irecv(recv, peer, group=group),
                                      dist.isend(send, peer, group=group)])

    def _nccl_for(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda and self._cuda_group is not None

    def stages(self, tensor: torch.Tensor) -> bool:
        return staging.needed(tensor, self._nccl_for(tensor))

    def _group_for(self, tensor: torch.Tensor, collective: bool = True, fill: bool = True):
        """(group, tensor to pass, original to copy back into or None).  ``collective``: every
        rank of this communicator makes the same call now, so it may check the GPUs first (a
        send/receive involves two ranks only: it relies on an earlier collective's check).
        ``fill``: a staged tensor's host copy needs its contents (not so a receive buffer)."""
        if self._nccl_for(tensor):
            if self._gpu_error is None and collective:
                self._gpu_error = self.shared_gpu_error(devices.local_gpu(tensor.device)) or ""
            if self._gpu_error:
                raise devices.SharedGpuError(self._gpu_error,
                                             whole_job=self.size == dist.get_world_size())
            return self._cuda_group, tensor, None
        if staging.needed(tensor, device_readable=False):  # no NCCL: host memory over Gloo
            stager = staging.stager()
            host = (stager.to_host(tensor) if fill
                    else stager.host_empty(tensor.shape, tensor.dtype))
            return self._cpu_group, host, tensor
        return self._cpu_group, tensor, None

    def _host_empty(self, like: torch.Tensor, staged: bool, shape) -> torch.Tensor:
        """An output buffer beside ``like`` (the tensor passed to Gloo or NCCL): pinned when the
        call is staged, so that its copy to the device runs at full speed."""
        return staging.stager().host_empty(shape, like.dtype) if staged else like.new_empty(shape)

    def shared_gpu_error(self, gpu) -> str:
        """Every rank's ``gpu`` (``devices.Gpu``) gathered over Gloo: the error to raise when
        ranks of this communicator share a GPU, "" when none do."""
        if self.size == 1:
            return ""
        gpus = self.allgather_object(tuple(gpu))
        return devices.shared_gpu_message(gpus, self.global_ranks) or ""

    # --- collectives --------------------------------------------------------------------------
    # Neither Gloo nor NCCL knows int16: it moves as float16 bits and is reduced as int32
    # (the same result modulo 2**16, which is what an int16 sum wraps to).
    @_wrap_errors
    def _allreduce(self, tensor, op):
        if tensor.dtype == torch.int16:
            carrier = tensor.to(torch.int32)
            self._allreduce(carrier, op)
            tensor.copy_(carrier)
            return
        if staging.needed(tensor, self._nccl_for(tensor)):
            # chunk by chunk, several in flight, each chunk's copies overlapping its
            # neighbours' collectives
            group, torch_op = self._cpu_group, _TORCH_OPS[op]
            staging.stager().allreduce(
                tensor, lambda chunk: self._start(dist.all_reduce, chunk, op=torch_op,
                                                  group=group),
                in_flight=staging.GLOO_IN_FLIGHT)
            return
        group, t, _ = self._group_for(tensor)
        if group is self._cpu_group and self._exchanges(t, op):
            return self.pair.sum(t)
        self._call(dist.all_reduce, t, op=_TORCH_OPS[op], group=group)

    def _exchanges(self, t, op) -> bool:
        """Whether a Gloo allreduce of ``t`` is two ranks' exchange of whole buffers rather
        than Gloo's ring (pair_exchange.py; the pair's first decision is collective: both
        ranks make it at the same agreed request)."""
        return self.size == 2 and op == ReduceOp.SUM and self.pair.takes(t)

    def allreduce_started(self, tensor, op, done) -> bool:
        """Over Gloo, on host tensors, where Gloo's ring sums them (not where two ranks sum by
        exchanging whole buffers, pair_exchange.py).  Gloo runs calls in flight side by side,
        so that two buckets share the wire as DDP's do: at 4 ranks on 2 hosts over 1 Gbit/s,
        83 ms for 4.2 MB and 3.2 MB in flight together against 97 ms one after the other."""
        if (self.size < 2 or not tensor.is_floating_point() or self._aborted is not None
                or self._nccl_for(tensor) or staging.needed(tensor, device_readable=False)
                or self._exchanges(tensor, op)):
            return False
        work = dist.all_reduce(tensor, op=_TORCH_OPS[op], group=self._cpu_group, async_op=True)

        def ended(future):
            try:
                future.value()
            except Exception as exc:  # noqa: B902 - Gloo's timeouts and lost peers
                # most likely the symptom of a peer's failure, whose own report names it
                done(PeerClosedError(f"torch.distributed allreduce failed on rank "
                                     f"{self.rank} of {self.size}: {exc}"))
                return
            done(None)
        work.get_future().add_done_callback(ended)
        return True

    @_wrap_errors
    def _allgather(self, tensor, counts):
        if tensor.dtype == torch.int16:
            return self._allgather(tensor.view(torch.float16), counts).view(torch.int16)
        group, t, orig = self._group_for(tensor)
        rows = max(counts)
        if t.shape[0] != rows:  # uneven: pad every rank to the longest, trim afterwards
            padded = t.new_zeros((rows,) + tuple(t.shape[1:]))
            padded[:t.shape[0]] = t
            t = padded
        out = self._host_empty(t, orig is not None, (rows * self.size,) + tuple(t.shape[1:]))
        self._call(_all_gather_single, out, t, group=group)
        if any(c != rows for c in counts):
            out = torch.cat([out[i * rows:i * rows + c] for i, c in enumerate(counts)])
        return out.to(orig.device) if orig is not None else out

    @_wrap_errors
    def _alltoall(self, tensor, send_splits, recv_splits):
        if tensor.dtype == torch.int16:
            return self._alltoall(tensor.view(torch.float16), send_splits,
                                  recv_splits).view(torch.int16)
        group, t, orig = self._group_for(tensor)
        out = self._host_empty(t, orig is not None, (sum(recv_splits),) + tuple(t.shape[1:]))
        self._call(dist.all_to_all_single, out, t, output_split_sizes=list(recv_splits),
                   input_split_sizes=list(send_splits), group=group)
        return out.to(orig.device) if orig is not None else out

    @_wrap_errors
    def _broadcast(self, tensor, root):
        if tensor.dtype == torch.int16:
            return self._broadcast(tensor.view(torch.float16), root)
        group, t, orig = self._group_for(tensor, fill=self.rank == root)
        self._call(dist.broadcast, t, src=self.global_ranks[root], group=group)
        if orig is not None:
            orig.copy_(t)

    @_wrap_errors
    def reduce_scatter(self, tensor, counts, op=ReduceOp.SUM):
        flat = tensor.reshape(-1)
        if self.size == 1:
            return flat.clone()
        if flat.dtype == torch.int16:
            return self.reduce_scatter(flat.to(torch.int32), counts, op).to(torch.int16)
        if flat.dtype == torch.bool:
            return super().reduce_scatter(tensor, counts, op)
        if not self._nccl_for(flat):
            # Gloo's reduce_scatter is slower than its allreduce of the whole buffer
            # (benchmarks/allreduce.py), so reduce everything and keep this rank's block
            # (staged chunk by chunk, as any allreduce, where the buffer is on a GPU).
            whole = flat.clone()
            self._allreduce(whole, op)
            start = sum(counts[:self.rank])
            return whole[start:start + counts[self.rank]]
        group, t, _ = self._group_for(flat)
        out = t.new_empty(counts[self.rank])
        dist.reduce_scatter(out, list(torch.split(t, list(counts))), op=_TORCH_OPS[op],
                            group=group)
        return out

    @_wrap_errors
    def sendrecv(self, send, dst, recv, src):
        if (send is not None and send.dtype == torch.int16) or \
                (recv is not None and recv.dtype == torch.int16):
            def carry(t):
                return t.view(torch.float16) if t is not None and t.dtype == torch.int16 else t
            return self.sendrecv(carry(send), dst, carry(recv), src)
        # The receive is posted first: over Gloo, when both peers post their send first, the two
        # directions take turns, which doubles the time of a large exchange on a slow link.
        works, staged = [], None
        if recv is not None:
            group, staged, orig = self._group_for(recv, collective=False, fill=False)
            works.append((dist.irecv(staged, self.global_ranks[src], group=group), group))
        if send is not None:
            group, t, _ = self._group_for(send, collective=False)
            works.append((dist.isend(t.contiguous(), self.global_ranks[dst], group=group),
                          group))
        self._wait_point_to_point(works)
        if recv is not None and staged is not recv:
            recv.copy_(staged)

    @_wrap_errors
    def barrier(self):
        if self.size > 1:
            self._call(dist.barrier, group=self._cpu_group)

    def split(self, colour, key=None):
        entries = self.allgather_object((colour, self.rank if key is None else key, self.rank))
        members = sorted((k, r) for c, k, r in entries if c == colour)
        return self.subgroup([r for _, r in members])


    def subgroup(self, ranks):
        ranks = list(ranks)
        if self.rank not in ranks:
            return None
        global_ranks = [self.global_ranks[r] for r in ranks]
        if global_ranks != sorted(global_ranks):
            # torch.distributed orders a group's ranks by global rank; keep that order here too.
            raise ValueError(f"subgroup ranks must be in ascending order, got {ranks}")
        if global_ranks == self.global_ranks:
            return self
        # Only the members take part, so disjoint groups can be built at the same time.
        cpu = dist.new_group(global_ranks, timeout=self._timeout, backend="gloo",
                             use_local_synchronization=True)
        cuda = (dist.new_group(global_ranks, timeout=self._timeout, backend="nccl",
                               use_local_synchronization=True)
                if self._cuda_group is not None else None)
        return TorchCommunicator(global_ranks, cpu, cuda, self._timeout)

    def create_groups(self, groups):
        if self.global_ranks != list(range(dist.get_world_size())):
            raise ValueError("create_groups is collective over the whole torch.distributed "
                             "world: call it on the world communicator")
        # Every rank creates every group, in the same order: torch then names the groups by a
        # counter that advances alike on every rank.  (Groups made by members only are named
        # by a hash that counts this process's live groups, which differs between ranks once
        # they belong to different sets.)
        made = []
        for ranks in groups:
            ranks = list(ranks)
            cpu = dist.new_group(ranks, timeout=self._timeout, backend="gloo")
            cuda = (dist.new_group(ranks, timeout=self._timeout, backend="nccl")
                    if self._cuda_group is not None else None)
            if self.rank not in ranks:
                made.append(None)
                continue
            comm = TorchCommunicator(ranks, cpu, cuda, self._timeout)
            comm._owns_groups = True
            made.append(comm)
        return made

    def transport(self, tensor=None):
        if tensor is not None and tensor.is_cuda and self._cuda_group is not None:
            return "NCCL"
        return "GLOO"

    def close(self):
        if self._owns_groups and dist.is_initialized():
            for group in (self._cpu_group, self._cuda_group):
                if group is not None:
                    try:
                        dist.destroy_process_group(group)
                    except (RuntimeError, ValueError):
                        pass  # already gone with the default group
            self._owns_groups = False
