"""Error-compensated 1-bit compressed allreduce (1-bit Adam section 6, Figure 3; 1-bit LAMB §5).

``compressed_allreduce_(x, comm, errors)`` replaces the flat tensor ``x`` by the compressed average
over the ranks of ``comm``, in three phases:

1. every rank (worker) adds its worker error to ``x``, compresses it (signs plus one scale per
   layer segment), keeps what was lost as its new worker error, sends the signs of chunk ``i`` to
   rank ``i`` (all-to-all) and all-gathers its scales;
2. every rank (server) averages the n decompressed copies of the chunk it owns, adds its server
   error, recompresses (one scale per layer part of the chunk) and keeps the new server error;
3. the packed chunks and their scales are all-gathered and decompressed everywhere.

Each phase is one pass over cache-sized blocks (``compression.compensate_compress_``); the
averaging divides the scales, not the values, by n; the error updates of a call are finished in
the first pass of the next call (see ``ErrorFeedback``).

The tensor is padded so that each chunk is a whole number of bytes; padding never enters a scale.
Every rank ends with the same values.  ``ErrorFeedback`` holds one tensor's errors on one rank and
counts the bytes this rank sends (each block counted once per receiving rank, as ring or direct
algorithms send them); compare with a float32 ring allreduce, ``2 (n-1)/n * 4 * numel``.

``hierarchical_compressed_allreduce_`` averages inside each node at full precision first and
compresses only across nodes (the papers' clusters did the same).
"""
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from horovod_ext.backends import trace
from horovod_ext.backends.base import Communicator, ReduceOp
from horovod_ext.backends.hierarchy import Span, Step, hierarchical_
from horovod_ext.backends.topology import Topology

from .compression import (Workspace, compensate_compress_, decompress_into, packed_bytes,
                          scale_dtype, settle_error_)


class ErrorFeedback:
    """Worker and server error of one tensor on this rank, plus the bytes this rank sent for it.

    The errors are created (zero) on the first call and must keep the same length and dtype;
    ``state_dict()`` / ``load_state_dict()`` carry them (per rank) across checkpoints.  To save
    a pass over the tensor, a call leaves the compensated tensor in the error buffer and the
    update ``error -= scale * sign`` is done by the next call in the same pass that adds the new
    input; reading ``worker`` or ``server`` finishes it first."""

    def __init__(self):
        self._worker: Optional[torch.Tensor] = None
        self._server: Optional[torch.Tensor] = None
        # deferred error updates: name -> (scales, segment lengths)
        self._pending: Dict[str, Tuple[torch.Tensor, List[int]]] = {}
        self.bytes_sent = 0
        self.last_bytes_sent = 0
        self.calls = 0
        self.workspace = Workspace()   # scratch, reused from call to call (not saved)

    def _settle(self, which: str) -> Optional[torch.Tensor]:
        error = getattr(self, "_" + which)
        pending = self._pending.pop(which, None)
        if pending is not None:
            scales, lengths = pending
            settle_error_(error[:sum(lengths)], scales, lengths, self.workspace)
        return error

    def _take(self, which: str) -> Optional[torch.Tensor]:
        """The scales of the deferred update of ``which``, which the caller now applies."""
        pending = self._pending.pop(which, None)
        return None if pending is None else pending[0]

    @property
    def worker(self) -> Optional[torch.Tensor]:
        return self._settle("worker")

    @property
    def server(self) -> Optional[torch.Tensor]:
        return self._settle("server")

    def ensure(self, numel: int, chunk: int, dtype: torch.dtype, device) -> None:
        if self._worker is not None:
            if (self._worker.numel(), self._worker.dtype) != (numel, dtype):
                raise ValueError(f"compressed allreduce: error state is for "
                                 f"{self._worker.numel()} {self._worker.dtype} elements, got "
                                 f"{numel} {dtype}; use one ErrorFeedback (one name) per tensor")
            if self._server.numel() != chunk:
                raise ValueError(f"compressed allreduce: server error has "
                                 f"{self._server.numel()} elements, the chunk of this rank needs "
                                 f"{chunk} (was the number of ranks changed?)")
            return
        self._worker = torch.zeros(numel, dtype=dtype, device=device)
        self._server = torch.zeros(chunk, dtype=dtype, device=device)

    def reset(self) -> None:
        self._worker = self._server = None
        self._pending = {}

    def state_dict(self) -> dict:
        return {"worker": self.worker, "server": self.server, "bytes_sent": self.bytes_sent,
                "calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        def copy(t):
            # + 0.0 turns a -0.0 into +0.0, which the sign-bit packing needs (zero encodes +1)
            return None if t is None else t.detach().clone().add_(0.0)
        self._worker, self._server = copy(state["worker"]), copy(state["server"])
        self._pending = {}
        self.bytes_sent, self.calls = int(state["bytes_sent"]), int(state["calls"])


def chunk_size(numel: int, size: int) -> int:
    """Elements per rank's chunk: ``numel`` split over ``size`` ranks, rounded up to bytes."""
    return 8 * -(-numel // (8 * size))


def _bounds(numel: int, lengths: Optional[Sequence[int]]) -> List[int]:
    """Segment boundaries [0, ..., numel] from layer lengths (empty layers dropped)."""
    if lengths is None:
        return [0, numel]
    if sum(lengths) != numel:
        raise ValueError(f"layer lengths sum to {sum(lengths)}, the tensor has {numel} elements")
    bounds = [0]
    for length in lengths:
        if length:
            bounds.append(bounds[-1] + length)
    return bounds


def _pieces(bounds: List[int], lo: int, hi: int) -> List[Tuple[int, int]]:
    """(layer index, length) of the parts of [lo, hi) cut by the layer boundaries."""
    out = []
    for i in range(len(bounds) - 1):
        a, b = max(bounds[i], lo), min(bounds[i + 1], hi)
        if a < b:
            out.append((i, b - a))
    return out


def compressed_bytes(numel: int, size: int, itemsize: int = 4) -> int:
    """Bytes one rank sends for a tensor of ``numel`` elements compressed as one layer: its
    chunk of signs to each other rank, its chunk of averaged signs back to each, and one scale
    each way (``ErrorFeedback.bytes_sent`` counts the real calls, per-layer scales included)."""
    if size == 1 or numel == 0:
        return 0
    return (size - 1) * (2 * chunk_size(numel, size) // 8 + 2 * itemsize)


def compressed_allreduce_(x: torch.Tensor, comm: Communicator, errors: ErrorFeedback,
                          lengths: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Replace the flat contiguous floating-point ``x`` by its error-compensated 1-bit average
    over ``comm``, one scale per layer (``lengths``, default one layer); returns ``x``."""
    if x.dim() != 1 or not x.is_contiguous():
        raise ValueError("compressed_allreduce_ needs a flat contiguous tensor")
    if not x.is_floating_point():
        raise TypeError(f"1-bit compression needs a floating-point tensor, got {x.dtype}")
    numel, n, me = x.numel(), comm.size, comm.rank
    if numel == 0:
        return x
    dtype, sdtype, itemsize = x.dtype, scale_dtype(x.dtype), 8 if x.dtype == torch.float64 else 4
    bounds = _bounds(numel, lengths)
    layer_lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    chunk = chunk_size(numel, n)
    cbytes = chunk // 8
    errors.ensure(numel, chunk, dtype, x.device)

    # Phase 1 (worker): compensate, compress (the error update waits for the next call);
    # signs all-to-all, scales all-gather.
    ws, device = errors.workspace, x.device
    packed = ws.get("send", n * cbytes, torch.uint8, device)
    with trace.activity("ONEBIT_COMPRESS", trace.nbytes_of(x)):
        packed[packed_bytes(numel):].fill_(0xFF)
        scales = compensate_compress_(errors._worker, layer_lengths, packed, ws,
                                      pending=errors._take("worker"), dense=x)
    errors._pending["worker"] = (scales, layer_lengths)
    with trace.transfer(comm, "ALLTOALL", packed, (n - 1) * (cbytes + trace.nbytes_of(scales))):
        received = comm.alltoall(packed, [cbytes] * n, [cbytes] * n).view(n, cbytes)
        all_scales = comm.allgather(scales, [len(layer_lengths)] * n).view(n, -1)

    # Phase 2 (server): average the chunk this rank owns (1/n folded into the scales),
    # compensate, recompress.
    pieces = [_pieces(bounds, k * chunk, min((k + 1) * chunk, numel)) for k in range(n)]
    mine = pieces[me]
    owned = sum(length for _, length in mine)
    server_packed = ws.get("server_packed", cbytes, torch.uint8, device)
    server_packed[packed_bytes(owned):].fill_(0xFF)
    server_scales = torch.empty(0, dtype=sdtype, device=device)
    with trace.activity("ONEBIT_SERVER_AVERAGE", owned * itemsize):
        if owned:
            server_scales = _server_average(errors, received, all_scales, mine, owned, n,
                                            server_packed, ws)

    # Phase 3: every rank gets every chunk.
    with trace.transfer(comm, "ALLGATHER", server_packed,
                        (n - 1) * (cbytes + len(mine) * itemsize)):
        gathered = comm.allgather(server_packed, [cbytes] * n)
        counts = [len(p) for p in pieces]
        gathered_scales = comm.allgather(server_scales, counts) if n > 1 else server_scales
    all_lengths = [length for p in pieces for _, length in p]
    with trace.activity("ONEBIT_DECOMPRESS", trace.nbytes_of(x)):
        decompress_into(gathered, gathered_scales, all_lengths, x, ws)

    sent = (n - 1) * (2 * cbytes + (len(layer_lengths) + len(mine)) * itemsize)
    errors.last_bytes_sent = sent
    errors.bytes_sent += sent
    errors.calls += 1
    return x


def _server_average(errors: ErrorFeedback, received: torch.Tensor, all_scales: torch.Tensor,
                    mine, owned: int, n: int, server_packed: torch.Tensor, ws) -> torch.Tensor:
    """Phase 2 on the chunk this rank owns: decompress what every rank sent, average,
    compensate and recompress into ``server_packed``; its scales."""
    device = received.device
    piece_lengths = [length for _, length in mine]
    layer_of = torch.tensor([i for i, _ in mine], device=device)
    # summed in rank order, the same sum on every rank and in any simulation
    parts = [(received[j], all_scales[j].index_select(0, layer_of)) for j in range(n)]
    server_scales = compensate_compress_(errors._server[:owned], piece_lengths,
                                         server_packed, ws, pending=errors._take("server"),
                                         packed=parts, divisor=n)
    errors._pending["server"] = (server_scales, piece_lengths)
    return server_scales


def hierarchical_compressed_allreduce_(x: torch.Tensor, topology: Topology,
                                       errors: ErrorFeedback,
                                       lengths: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Full-precision average inside the node, 1-bit compressed average of each rank's shard
    across nodes, shards shared inside the node (``backends.hierarchy``); returns ``x``
    (replaced in place).  ``errors`` then holds this rank's shard's errors."""
    return hierarchical_(x, topology, compressed_step(errors, x.numel(), lengths),
                         node_average=True)


def compressed_step(errors: ErrorFeedback, numel: int,
                    lengths: Optional[Sequence[int]] = None) -> Step:
    """The 1-bit step on a part of a buffer of ``numel`` elements with layers ``lengths``,
    flat or across nodes (``backends.hierarchy``): one scale per layer piece in the part."""
    def step(part: torch.Tensor, span: Span) -> torch.Tensor:
        return compressed_allreduce_(part, span.comm, errors,
                                     shard_lengths(numel, lengths, span.offset, part.numel()))
    return step


def shard_lengths(numel: int, lengths: Optional[Sequence[int]], offset: int,
                  count: int) -> Optional[List[int]]:
    """The layer lengths inside [offset, offset + count) of a buffer of ``numel`` elements
    with layers ``lengths`` (None: one layer)."""
    if lengths is None:
        return None
    return [length for _, length in _pieces(_bounds(numel, lengths), offset, offset + count)] \
        or [count]


def hierarchical_average_(x: torch.Tensor, topology: Topology) -> torch.Tensor:
    """Full-precision in-place average of the flat ``x`` over every rank through the
    hierarchical skeleton, so that a node sends its data across once (the warm-up,
    hierarchical)."""
    def step(shard: torch.Tensor, span: Span) -> torch.Tensor:
        if span.comm.size > 1:
            span.comm.allreduce(shard, ReduceOp.SUM)
        return shard.div_(span.topology.size)
    return hierarchical_(x, topology, step)
