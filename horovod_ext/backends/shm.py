"""In-node reduce-scatter and all-gather through one shared-memory segment.

The ranks of one host map the same segment: a header of per-rank progress counters and process
ids, then one slot per rank.  A reduction of a flat buffer runs in three phases, each closed by
every rank raising its counter (no kernel call, no copy through sockets):

1. each rank copies its buffer into its slot, all but its own shard (which only it reads);
2. reduce-scatter: rank i reduces shard i of its buffer and of every other slot into shard i of
   its own slot, reading each byte of its shard once per rank;
3. all-gather: each rank copies every shard from the slot of the rank that reduced it.

The hierarchical allreduce puts the cross-node step between phases 2 and 3, on the shard alone.
The segment's file is unlinked as soon as every local rank has mapped it, so nothing is left in
/dev/shm however the job ends (kill -9 included).  A wait that outlives the timeout, or a local
rank whose process has gone, ends in ``CommunicationError`` naming the local rank.

Counters are plain int64 stores into the mapping, written after the data they publish: x86's
total store order makes the data visible first (this module is not used on other CPUs).
"""
import ctypes
import math
import mmap
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from . import shm_files
from .base import CommunicationError, Communicator, ReduceOp, split_sizes

_LINE = shm_files.LINE
_SPIN_S = 50e-6                   # busy-poll this long,
_YIELD_S = 2e-3                   # then give the core to other runnable processes this long,
_NAP_S = 20e-6                    # then nap between polls
_PID_CHECK_S = 0.1                # how often a waiting rank checks that its peers still live
SEGMENT_DIR = "/dev/shm"
# An in-node allreduce goes chunk by chunk: what one phase writes is read by the next from the
# caches (at 64 MiB, whole-buffer phases stream every byte through memory three times).
IN_NODE_CHUNK_BYTES = 4 << 20


def available() -> bool:
    """Shared memory is used on Linux x86-64 with a writable /dev/shm."""
    return (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
            and os.access(SEGMENT_DIR, os.W_OK))


class SharedMemoryGroup:
    """The ranks of ``local`` (one host) and a segment with room for ``capacity`` bytes per
    rank; grows (collectively) when a larger buffer comes."""

    def __init__(self, local: Communicator, timeout: float):
        self.comm, self.rank, self.size, self.timeout = local, local.rank, local.size, timeout
        self._mm: Optional[mmap.mmap] = None
        self._capacity, self._header = 0, 0   # bytes per rank's slot; counters before them
        self._phase = 0          # this rank's counter: phases completed so far
        self._pool: Optional[ThreadPoolExecutor] = None   # runs the cross-node steps
        self._aborted: Optional[str] = None   # why waits end at once (a peer has failed)
        self._table_at, self._table_room, self._table_area = 0, 0, 0   # sum_tables' areas

    # --- the segment --------------------------------------------------------------------------
    def _ensure(self, nbytes: int):
        """Collective over the local ranks (they all reduce buffers of the same size).  The
        first call makes the segment even for an empty buffer: its counters are the phases'."""
        if self._mm is not None and nbytes <= self._capacity:
            return
        if self._mm is not None:   # its pages go back before a larger segment takes room
            self._release()
            self.comm.barrier()
        capacity, header = shm_files.slot_bytes(nbytes), shm_files.header_bytes(self.size)
        name = failure = None
        if self.rank == 0:
            name, failure = shm_files.create(SEGMENT_DIR, header + capacity * self.size,
                                             self.size, capacity)
        name, failure = self.comm.broadcast_object((name, failure), root=0)
        if failure is not None:
            raise CommunicationError(failure)
        try:
            fd = os.open(name, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, header + capacity * self.size)
            finally:
                os.close(fd)
        finally:
            self.comm.barrier()       # everyone has mapped it (or failed): the name can go
            if self.rank == 0:
                os.unlink(name)
        self._mm, self._capacity, self._header, self._phase = mm, capacity, header, 0
        words = np.frombuffer(mm, dtype=np.int64, count=header // 8)
        self._counters = words[0:self.size * _LINE // 8:_LINE // 8]
        self._pids = words[self.size * _LINE // 8::_LINE // 8]
        self._pids[self.rank] = os.getpid()
        self._slots = [torch.frombuffer(mm, dtype=torch.uint8, count=capacity,
                                        offset=header + k * capacity) for k in range(self.size)]
        self._slot_addresses = [slot.data_ptr() for slot in self._slots]
        self.comm.barrier()           # pids written, counters at zero everywhere

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._release()

    def _release(self):
        if self._mm is not None:
            self._slots, self._slot_addresses, self._counters, self._pids = [], [], None, None
            try:
                self._mm.close()
            except BufferError:  # a tensor still views it: the mapping goes with that tensor
                pass
            self._mm, self._capacity = None, 0

    # --- phases -------------------------------------------------------------------------------
    def _arrive_and_wait(self, what: str):
        """Raise this rank's counter and wait until every local rank has raised its own."""
        self._phase += 1
        target = self._phase
        self._counters[self.rank] = target
        counters = self._counters
        if counters.min() >= target:
            return
        start = time.monotonic()
        deadline, next_check = start + self.timeout, start + _PID_CHECK_S
        while counters.min() < target:
            now = time.monotonic()
            if now - start > _YIELD_S:
                time.sleep(_NAP_S)
            elif now - start > _SPIN_S:
                # A nap lasts 80 us or more (the timer's granularity), while a peer is often
                # a few us away; a yield returns at once when nothing else waits for the core,
                # and lets a peer sharing it (more ranks than cores) run.
                os.sched_yield()
            if now > next_check:
                next_check = now + _PID_CHECK_S
                self._check_peers(target, what)
            if now > deadline:
                late = [k for k in range(self.size) if counters[k] < target]
                raise CommunicationError(
                    f"shared-memory {what}: local ranks {late} did not arrive within "
                    f"{self.timeout:.0f} s (local rank {self.rank} of {self.size})")

    def abort(self, reason: str):
        """Every wait, now and later, ends in ``CommunicationError(reason)``: a peer has failed
        elsewhere (liveness.py) and will not arrive.  Called from another thread."""
        self._aborted = reason

    def _check_peers(self, target: int, what: str):
        if self._aborted is not None:
            raise CommunicationError(f"shared-memory {what} abandoned: {self._aborted}")
        for k in range(self.size):
            if self._counters[k] < target and not shm_files.alive(int(self._pids[k])):
                raise CommunicationError(
                    f"shared-memory {what}: local rank {k} (pid {int(self._pids[k])}) has "
                    f"died (seen by local rank {self.rank})")

    def _view(self, k: int, flat: torch.Tensor) -> torch.Tensor:
        return self._slots[k][:flat.numel() * flat.element_size()].view(flat.dtype)

    def buffer(self, numel: int, dtype: torch.dtype, spare_bytes: int = 0) -> torch.Tensor:
        """This rank's slot as a flat ``dtype`` tensor: a buffer packed here skips phase 1's
        copy and phase 3's copy of its own shard.  Collective over the local ranks (the same
        size on each); valid until the next call of any method of this group, except the
        ``reserve`` of a step that fits in ``spare_bytes`` beside the buffer."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        self._ensure(nbytes + spare_bytes)
        return self._slots[self.rank][:nbytes].view(dtype)

    def reduce_scatter(self, flat: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        """Phases 1 and 2 for the contiguous 1-D CPU ``flat``: this rank's reduced shard (a
        view into shared memory, valid until ``allgather``); shards as ``split_sizes``."""
        n = flat.numel()
        self._ensure(n * flat.element_size())
        return self._reduce_range(flat, [self._view(k, flat) for k in range(self.size)],
                                  0, n, op)

    def _reduce_range(self, flat: torch.Tensor, views: List[torch.Tensor], a: int, b: int,
                      op: ReduceOp) -> torch.Tensor:
        """Phases 1 and 2 for ``flat[a:b]``: this rank's reduced shard of that range, in its
        slot.  Only the other ranks' shards are copied in (nobody else reads this rank's own
        shard): its reduction reads it straight from ``flat``."""
        own = views[self.rank]
        counts = split_sizes(b - a, self.size)
        start = a + sum(counts[:self.rank])
        stop = start + counts[self.rank]
        resident = own.data_ptr() == flat.data_ptr()
        if not resident:
            own[a:start].copy_(flat[a:start])
            own[stop:b].copy_(flat[stop:b])
        self._arrive_and_wait("reduce-scatter")
        others = [v[start:stop] for k, v in enumerate(views) if k != self.rank]
        _reduce_into(own[start:stop], flat[start:stop], others, op)
        return own[start:stop]

    def allgather(self, flat: torch.Tensor, shard: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Phase 3: ``flat`` gets every rank's shard (``shard``, when given, replaces this
        rank's own first, e.g. after the cross-node step); returns ``flat``."""
        counts = split_sizes(flat.numel(), self.size)
        start = sum(counts[:self.rank])
        mine = self._view(self.rank, flat)[start:start + counts[self.rank]]
        if shard is not None and shard.data_ptr() != mine.data_ptr():
            mine.copy_(shard)
        self._arrive_and_wait("all-gather")
        resident = flat.data_ptr() == self._view(self.rank, flat).data_ptr()
        offset = 0
        for k, n in enumerate(counts):
            if not (resident and k == self.rank):
                flat[offset:offset + n].copy_(self._view(k, flat)[offset:offset + n])
            offset += n
        # Nobody may refill its slot (the next phase 1) before every rank has read it.
        self._arrive_and_wait("all-gather")
        return flat

    # --- whole vectors, for steps that read every rank's buffer (in-node Adasum) -------------
    def reserve(self, nbytes: int, table_bytes: int = 0):
        """Room for a whole vector of ``nbytes`` in every slot, and two ``table_bytes`` areas
        for ``sum_tables``.  Collective; the slots are then filled by ``publish`` and read
        through ``slots_like`` or ``slot_address`` until the next call of this group."""
        self._table_at = -(-nbytes // _LINE) * _LINE
        self._table_room = -(-table_bytes // _LINE) * _LINE
        self._ensure(self._table_at + 2 * self._table_room)
        self._table_area = 0

    def publish(self, flat: torch.Tensor, ranges: Sequence[Tuple[int, int]]):
        """The elements [lo, hi) of each of ``ranges`` of ``flat`` (contiguous 1-D CPU) into
        this rank's slot at the same offsets, by address (cheaper than torch slices on small
        buffers), unless ``flat`` is the slot; then wait until every local rank has done so."""
        size = flat.element_size()
        mine, at = self.slot_address(self.rank), flat.data_ptr()
        if mine != at:
            for lo, hi in ranges:
                ctypes.memmove(mine + lo * size, at + lo * size, (hi - lo) * size)
        self._arrive_and_wait("publish")

    def slots_like(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """Every local rank's slot as a tensor like ``flat``."""
        return [self._view(k, flat) for k in range(self.size)]

    def slot_address(self, k: int) -> int:
        """Where local rank ``k``'s slot starts."""
        return self._slot_addresses[k]

    def sum_tables(self, table: np.ndarray) -> np.ndarray:
        """The sum over the local ranks of the float64 ``table`` (the same shape on each), added
        in local-rank order (the same bits everywhere), through the slots' table areas (at
        most ``publish``'s ``table_bytes``); areas alternate, so a rank writing the next table
        never meets one still read.  numpy, not torch: the tables are small, and per call a
        torch op's overhead exceeded the arithmetic."""
        table = np.ascontiguousarray(table, dtype=np.float64)
        nbytes = table.size * 8
        if nbytes > self._table_room:
            raise ValueError(f"a table of {nbytes} bytes in areas of {self._table_room}")
        at = self._table_at + self._table_area * self._table_room
        self._table_area ^= 1
        areas = [np.frombuffer(self._mm, dtype=np.float64, count=table.size,
                               offset=self._header + k * self._capacity + at)
                 for k in range(self.size)]
        areas[self.rank][:] = table.reshape(-1)
        self._arrive_and_wait("table sum")
        total = areas[0].copy()
        for area in areas[1:]:
            total += area
        return total.reshape(table.shape)

    def arrive(self, what: str):
        """Wait until every local rank has come this far (``what`` names the step in errors)."""
        self._arrive_and_wait(what)

    def allgather_rows(self, tensor: torch.Tensor, counts: List[int]) -> torch.Tensor:
        """Every local rank's contiguous CPU ``tensor`` (``counts[k]`` rows on local rank k,
        the same trailing shape everywhere) concatenated along dim 0 in local-rank order."""
        row = math.prod(tensor.shape[1:])
        self._ensure(max(counts) * row * tensor.element_size())
        flat = tensor.reshape(-1)
        self._slots[self.rank][:flat.numel() * flat.element_size()].view(flat.dtype).copy_(flat)
        self._arrive_and_wait("all-gather")
        out = torch.empty((sum(counts),) + tuple(tensor.shape[1:]), dtype=tensor.dtype)
        out_flat, offset = out.view(-1), 0
        for k, count in enumerate(counts):
            n = count * row
            out_flat[offset:offset + n].copy_(
                self._slots[k][:n * tensor.element_size()].view(tensor.dtype))
            offset += n
        # Nobody may refill its slot before every rank has read it.
        self._arrive_and_wait("all-gather")
        return out

    def allreduce(self, flat: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                  chunk_elements: int = 0) -> torch.Tensor:
        """In-node allreduce of the contiguous 1-D CPU ``flat``, in place; returns it.  Chunk by
        chunk (``chunk_elements``, by default IN_NODE_CHUNK_BYTES' worth), so that what a phase
        writes is still in the caches when the next one reads it."""
        chunk = chunk_elements or max(1, IN_NODE_CHUNK_BYTES // flat.element_size())
        return self.pipelined_allreduce(flat, op, None, chunk)

    def pipelined_allreduce(self, flat: torch.Tensor, op: ReduceOp,
                            cross: Optional[Callable[[torch.Tensor], object]],
                            chunk_elements: int) -> torch.Tensor:
        """Hierarchical allreduce of ``flat`` in chunks: ``cross(shard)`` (the cross-node
        allreduce of this rank's shard of a chunk, in place) runs on a worker thread while the
        next chunk is reduced in the node and the previous one gathered, so the whole costs
        about the larger of the in-node and cross-node times rather than their sum.  Without
        ``cross``, each chunk is gathered right after its reduction."""
        n = flat.numel()
        self._ensure(n * flat.element_size())
        views = [self._view(k, flat) for k in range(self.size)]
        resident = views[self.rank].data_ptr() == flat.data_ptr()
        edges = list(range(0, n, max(1, chunk_elements))) + [n]
        chunks = list(zip(edges, edges[1:]))
        if cross is not None and self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="horovod_ext-cross")
        pending = []

        def reduce_chunk(a: int, b: int):
            shard = self._reduce_range(flat, views, a, b, op)
            pending.append(None if cross is None else self._pool.submit(cross, shard))

        def gather_chunk(index: int):
            if pending[index] is not None:
                pending[index].result()
            self._arrive_and_wait("all-gather")
            a, b = chunks[index]
            for k, count in enumerate(split_sizes(b - a, self.size)):
                if not (resident and k == self.rank):
                    flat[a:a + count].copy_(views[k][a:a + count])
                a += count

        try:
            lag = 0 if cross is None else 1
            for index in range(len(chunks)):
                reduce_chunk(*chunks[index])
                if index >= lag:
                    gather_chunk(index - lag)
            if lag and chunks:       # an empty buffer has no chunks
                gather_chunk(len(chunks) - 1)
        finally:
            for future in pending:   # nothing may still write into the slot after a failure
                if future is not None:
                    future.exception()
        # Nobody may refill its slot (the next call) before every rank has read it.
        self._arrive_and_wait("all-gather")
        return flat


def _reduce_into(out: torch.Tensor, mine: torch.Tensor, others: List[torch.Tensor],
                 op: ReduceOp):
    """``out`` = ``mine`` reduced with every tensor of ``others`` (``mine`` may be ``out``)."""
    if out.dtype == torch.bool:
        out, mine = out.view(torch.uint8), mine.view(torch.uint8)
        others = [o.view(torch.uint8) for o in others]
        op = ReduceOp.MAX if op in (ReduceOp.SUM, ReduceOp.MAX) else ReduceOp.MIN
    combine = {ReduceOp.SUM: torch.add, ReduceOp.MIN: torch.minimum,
               ReduceOp.MAX: torch.maximum}.get(op, torch.mul)
    for other in others:
        combine(mine, other, out=out)
        mine = out


def usable_for(tensor: torch.Tensor) -> bool:
    return tensor.is_cpu and tensor.is_contiguous() and tensor.dim() == 1
