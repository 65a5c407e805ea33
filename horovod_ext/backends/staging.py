"""Staging device tensors through host memory, for transports that read host memory only (Gloo,
an MPI that is not CUDA-aware).

A plain ``tensor.cpu()``, the collective, then ``copy_`` back cost three times the collective of
the same CPU tensor (64 MiB at np=2 on an H200): a fresh pageable buffer to fault in, and two
synchronous copies through the driver's bounce buffer, neither overlapping the transfer.  Here:

- host buffers are pinned (page-locked: the device copies them by DMA, at full speed, without
  blocking the host) and kept between calls in a small cache (``HostBuffers``);
- an allreduce runs chunk by chunk (``CHUNK_BYTES``): every chunk's device-to-host copy is queued
  at once on a side CUDA stream, with an event per chunk; the host collective of a chunk starts
  as soon as its event has fired, while later chunks still cross, and each reduced chunk goes
  back on a second side stream while the next one is reduced.  Where the transport starts a
  chunk's collective without waiting for it (Gloo), several chunks are in flight at once
  (``GLOO_IN_FLIGHT``): one after the other, each chunk pays the collective's round trips
  again (over Gloo at np=2, 16 chunks of 4 MiB took 1.2-1.4x one call of 64 MiB; with three
  in flight, 0.9-1.1x; ``benchmarks/staging.py``).  A staged allreduce then costs about the
  collective plus one chunk's two copies.  Chunking is valid for the elementwise
  reductions only (Sum, Min, Max, Product; Average is a Sum divided afterwards), and every rank
  cuts the same chunks: they follow from the element count, the dtype and ``CHUNK_BYTES``,
  which a collective has the same on every rank;
- the other collectives (allgather, broadcast, alltoall, send/receive) make one copy each way,
  in pinned memory too (``Stager.to_host``, ``Stager.host_empty``).

The same code runs on CPU tensors, with plain copies that are done when they return:
``STAGE_HOST_TENSORS = True`` makes the communicators stage CPU tensors too, so that tests on a
machine without a GPU run the chunking, the cache and the communicators' staged call sites.
"""
import collections
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

#: Bytes per chunk of a staged allreduce.  It must be the same on every rank (chunks are
#: separate collectives); 4 MiB: a chunk's copy (~0.2 ms over PCIe) is short against its host
#: collective, and a chunk is large enough that a collective's fixed cost stays small.
CHUNK_BYTES = 4 << 20
#: Chunks of one staged allreduce whose Gloo collectives are in flight at once.  Gloo runs a
#: group's calls on two threads, so with one queued behind them neither waits for the caller
#: (MPI's calls block: its chunks go one at a time, and sequential 4 MiB chunks were no slower
#: than one call there).
GLOO_IN_FLIGHT = 3
#: Idle buffers one ``HostBuffers`` keeps, and their bytes in all, at most.
CACHE_ENTRIES = 4
CACHE_BYTES = 512 << 20
#: Smallest buffer allocated (smaller requests share it).
MIN_BUFFER_BYTES = 4096
#: Tests set it to True: CPU tensors are then staged as device tensors are (with plain copies),
#: so that a machine without a GPU runs the staged code.  Never set in production.
STAGE_HOST_TENSORS = False


def needed(tensor: torch.Tensor, device_readable: bool) -> bool:
    """Whether ``tensor`` travels through host memory: it is on a device that the transport
    cannot read (``device_readable`` False), or it is a CPU tensor and STAGE_HOST_TENSORS is on."""
    if tensor.device.type == "cpu":
        return STAGE_HOST_TENSORS
    return not device_readable


def chunk_bounds(numel: int, dtype: torch.dtype,
                 chunk_bytes: Optional[int] = None) -> List[Tuple[int, int]]:
    """[start, stop) element ranges cutting ``numel`` elements of ``dtype`` into consecutive
    chunks of ``chunk_bytes`` (CHUNK_BYTES by default; at least one element), the last one
    shorter.  A function of its arguments only, so that every rank cuts the same chunks."""
    per = max(1, (chunk_bytes or CHUNK_BYTES) // dtype.itemsize)
    return [(start, min(start + per, numel)) for start in range(0, numel, per)]


def _size_class(nbytes: int) -> int:
    """Bytes allocated for a request of ``nbytes``: the next power of two (torch's pinned
    allocator rounds so too), so that buffers of nearby sizes (fusion buffers) share one."""
    return max(MIN_BUFFER_BYTES, 1 << max(0, nbytes - 1).bit_length())


class HostBuffers:
    """Host buffers kept between staged calls, pinned where CUDA is available (``pin_memory``
    fails without CUDA), by size class in bytes (any dtype: a buffer is handed out as a view of
    the dtype asked).  ``take`` lends a buffer, which no other ``take`` gets until ``give``
    returns it; idle buffers are kept up to ``entries`` of them and ``max_bytes`` in all, the
    least recently returned dropped first (pinned memory then goes back to torch's pinned
    allocator, which reuses it for blocks of its size).  Thread-safe."""

    def __init__(self, pin: Optional[bool] = None, entries: int = CACHE_ENTRIES,
                 max_bytes: int = CACHE_BYTES):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.entries, self.max_bytes = entries, max_bytes
        self._idle: List[torch.Tensor] = []          # uint8 buffers, least recently returned first
        self._lent: Dict[int, torch.Tensor] = {}     # data_ptr -> the buffer lent out
        self._lock = threading.Lock()
        self.allocations = 0                         # buffers allocated, for tests and tuning
        self.takes = 0

    @property
    def idle_bytes(self) -> int:
        return sum(b.numel() for b in self._idle)

    @property
    def idle(self) -> int:
        return len(self._idle)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D host tensor of ``numel`` ``dtype`` elements (uninitialised), the caller's
        until ``give``."""
        nbytes = numel * dtype.itemsize
        size = _size_class(nbytes)
        with self._lock:
            self.takes += 1
            found = [i for i, b in enumerate(self._idle) if b.numel() == size]
            buffer = self._idle.pop(found[-1]) if found else None
        if buffer is None:  # allocated outside the lock: pinning 64 MiB takes milliseconds
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        with self._lock:
            if not found:
                self.allocations += 1
            self._lent[buffer.data_ptr()] = buffer
        return buffer[:nbytes].view(dtype)

    def discard(self, tensor: torch.Tensor) -> None:
        """Take back a tensor that ``take`` lent without keeping its buffer: a collective that
        failed may still write into it, so it is never lent again."""
        with self._lock:
            self._lent.pop(tensor.data_ptr())

    def give(self, tensor: torch.Tensor) -> None:
        """Return a tensor that ``take`` lent."""
        with self._lock:
            buffer = self._lent.pop(tensor.data_ptr())
            self._idle.append(buffer)
            total = self.idle_bytes
            while self._idle and (len(self._idle) > self.entries or total > self.max_bytes):
                total -= self._idle.pop(0).numel()


class _PlainCopies:
    """A staged allreduce's copies for a tensor without CUDA streams (a CPU tensor under
    STAGE_HOST_TENSORS, another device): plain copies, done when they return."""

    def __init__(self, flat: torch.Tensor, host: torch.Tensor):
        self.flat, self.host = flat, host

    def download(self, start: int, stop: int) -> None:
        self.host[start:stop].copy_(self.flat[start:stop])

    def arrived(self, index: int) -> None:
        pass

    def upload(self, start: int, stop: int) -> None:
        self.flat[start:stop].copy_(self.host[start:stop])

    def finish(self) -> None:
        pass


class _CudaCopies:
    """A staged allreduce's copies for a CUDA tensor: downloads on one side stream and uploads
    on another (the two directions use separate copy engines), asynchronous from and to the
    pinned host buffer, each download followed by an event the host waits on."""

    def __init__(self, flat: torch.Tensor, host: torch.Tensor, streams):
        self.flat, self.host = flat, host
        self.down, self.up = streams
        self.caller = torch.cuda.current_stream(flat.device)
        # The copies read and overwrite the tensor: after the work already queued on it.
        self.down.wait_stream(self.caller)
        self.up.wait_stream(self.caller)
        self.events: List[torch.cuda.Event] = []

    def download(self, start: int, stop: int) -> None:
        with torch.cuda.stream(self.down):
            self.host[start:stop].copy_(self.flat[start:stop], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.down)
        self.events.append(event)

    def arrived(self, index: int) -> None:
        self.events[index].synchronize()

    def upload(self, start: int, stop: int) -> None:
        with torch.cuda.stream(self.up):
            self.flat[start:stop].copy_(self.host[start:stop], non_blocking=True)

    def finish(self) -> None:
        # The caller's stream runs after the results land; the host waits for them too, so
        # that the call returns finished (as the unstaged one does: another thread, on another
        # stream, may read the tensor next) and the buffer is free for the next call.  After an
        # error, the downloads still queued must also end before the buffer is lent again.
        done = torch.cuda.Event()
        done.record(self.up)
        self.caller.wait_event(done)
        done.synchronize()
        if self.events:
            self.events[-1].synchronize()


class Stager:
    """Staging through host memory: buffers (``HostBuffers``) and side streams per device."""

    def __init__(self, buffers: Optional[HostBuffers] = None):
        self.buffers = buffers if buffers is not None else HostBuffers()
        self._streams: Dict[torch.device, Tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        self._lock = threading.Lock()

    def _copies(self, flat: torch.Tensor, host: torch.Tensor):
        if not flat.is_cuda:
            return _PlainCopies(flat, host)
        with self._lock:
            streams = self._streams.get(flat.device)
            if streams is None:
                streams = self._streams[flat.device] = (torch.cuda.Stream(flat.device),
                                                        torch.cuda.Stream(flat.device))
        return _CudaCopies(flat, host, streams)

    def allreduce(self, tensor: torch.Tensor, reduce_chunk: Callable,
                  chunk_bytes: Optional[int] = None, in_flight: int = 0) -> torch.Tensor:
        """``tensor`` reduced in place through host memory, chunk by chunk (``chunk_bounds``);
        returns ``tensor``.  ``reduce_chunk(host_chunk)`` is the host collective of one chunk,
        in place.  With ``in_flight`` 0 it has reduced the chunk when it returns; with
        ``in_flight`` n > 0 it starts the collective and returns a callable that waits until it
        has ended (raising its error), and up to n chunks are in flight at once.  For
        elementwise reductions only; collective: every rank passes a tensor of the same element
        count and dtype, so all cut the same chunks and start their collectives in one order."""
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        bounds = chunk_bounds(flat.numel(), flat.dtype, chunk_bytes)
        if not bounds:      # no elements: the same on every rank, so none calls the collective
            return tensor
        host = self.buffers.take(flat.numel(), flat.dtype)
        copies = self._copies(flat, host)
        started = collections.deque()   # (its wait or None, start, stop), the oldest first
        try:
            for start, stop in bounds:   # queued at once: they run ahead of the collectives
                copies.download(start, stop)
            for index, (start, stop) in enumerate(bounds):
                copies.arrived(index)
                ended = reduce_chunk(host[start:stop])
                started.append((ended if in_flight else None, start, stop))
                last = index == len(bounds) - 1
                while started and (last or len(started) >= max(1, in_flight)):
                    wait, begin, end = started[0]
                    if wait is not None:
                        wait()
                    started.popleft()    # only once ended: a failed wait leaves it in flight
                    copies.upload(begin, end)
        finally:
            copies.finish()
            if started:     # a collective may still be writing into the buffer
                self.buffers.discard(host)
            else:
                self.buffers.give(host)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
        return tensor

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor for a staged collective's output, pinned where CUDA is available (its
        copy to the device then runs at full speed).  The caller's: torch's pinned allocator
        reuses its memory once it is dropped."""
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=self.buffers.pin)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` (contiguous; pinned where CUDA is available), made after the
        work queued on the tensor's current stream: one staged copy, for the collectives that are
        not chunked."""
        return self.host_empty(tensor.shape, tensor.dtype).copy_(tensor)


_DEFAULT: Optional[Stager] = None
_DEFAULT_LOCK = threading.Lock()


def stager() -> Stager:
    """The process's stager, shared by every communicator (made at first use: pinning asks
    whether CUDA is available)."""
    global _DEFAULT
    if _DEFAULT is None:
        with _DEFAULT_LOCK:
            if _DEFAULT is None:
                _DEFAULT = Stager()
    return _DEFAULT
