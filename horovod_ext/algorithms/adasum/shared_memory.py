"""Adasum among the ranks of one host, through their shared-memory segment (backends/shm.py).

Every rank publishes its whole vector in its slot, chunk by chunk, and every chunk of every slot
is split into the same ``split_sizes`` shards; rank s owns shard s of every chunk.  The tree is
the one RVH and the gather path compute (ranks r >= p folded into r - p, then pairs at distance
1, 2, ..., weighted by ``tree_divisors``), taken whole from the ranks' Gram matrix (gram.py):
each rank computes its shards' share of every per-layer dot product between the ranks' vectors
in one pass, the shares are summed through the segment (one small table per rank), every rank
derives the root's weight of each vector from the sum, and each rank writes its shards of the
weighted sum in one more pass, both into slot 0 and into its own vector; every rank then copies
the others' shards from slot 0.  A rank's own shard of its own vector is read by nobody else,
so it is not copied into the slot.  So the whole tree costs two passes over the shards and one
wait for the tables (besides a chunk's waits for its publication and its result), where the
tree level by level costs two passes and a wait per level, and RVH over sockets an exchange of
half the vector and a dot-product allreduce per level: on one host with Gloo, the exchanges'
copies through the kernel and their per-message latency dominated.

Every rank adds the tables in the same order and the result is each shard's one owner's, so
all ranks end with the same bits.

Where the C kernels take the buffer, the two passes and every copy run on addresses, with the
shard, its layers and the tables made once per buffer layout: on a small buffer the slices,
tables and checks around the kernels cost more than the kernels (Gloo, 2 ranks, 4 KiB: 90 us
a call with torch slices and tables, 30 us by address, against 52 us for Sum).
"""
import ctypes
from typing import List, Optional, Sequence, Tuple

import numpy as np

import torch

from horovod_ext.backends import trace
from horovod_ext.backends.base import split_sizes
from horovod_ext.backends.shm import IN_NODE_CHUNK_BYTES, SharedMemoryGroup

from .. import compiled
from . import operator
from .gram import HostTree, gram, mix_, pair_count, tree_weights
from .rvh import layer_map


# The buffer goes chunk by chunk, as the in-node Sum does (backends/shm.py): each chunk's Gram
# pass reads what the others have just published, and its result is copied out of slot 0 just
# after it was written, from the caches.  The weighted sums run last chunk first, which the
# Gram pass read last.
CHUNK_BYTES = IN_NODE_CHUNK_BYTES


class _Chunk:
    """One chunk [start, stop) of the buffer and this rank's shard [lo, hi) of it, with the
    shard's piece."""

    def __init__(self, layers, start: int, stop: int, n: int, me: int):
        counts = split_sizes(stop - start, n)
        self.start, self.stop = start, stop
        self.lo = start + sum(counts[:me])
        self.hi = self.lo + counts[me]
        self.piece = layers.piece(self.lo, self.hi)
        self.others = ((start, self.lo), (self.hi, stop))   # the other ranks' shards


class _Shard:
    """One rank's part of in_node_adasum_ for one buffer layout, made once (kept on the
    LayerMap, as RVH's schedules are): its shard of every chunk and the C kernels' tree (None
    where they do not take the buffer)."""

    def __init__(self, layers, x: torch.Tensor, n: int, me: int, chunk: int):
        # an empty buffer is one empty chunk: every rank still meets every step
        edges = list(range(0, max(x.numel(), 1), chunk)) + [x.numel()]
        self.chunks = [_Chunk(layers, a, b, n, me) for a, b in zip(edges, edges[1:])]
        self.table_bytes = layers.count * pair_count(n) * 8
        self.host = HostTree.for_tensor(x, n, layers.count)


def in_node_adasum_(x: torch.Tensor, bounds: Sequence[Tuple[int, int]],
                    group: SharedMemoryGroup) -> torch.Tensor:
    """Adasum of the flat CPU tensor ``x`` over the ranks of ``group`` (in local-rank order),
    per layer (``bounds``: (offset, numel) per layer), in place."""
    layers = layer_map(bounds)
    n, me = group.size, group.rank
    chunk = max(1, CHUNK_BYTES // x.element_size())
    # the C kernels' use can be switched (operator.HOST_CODE, HOROVOD_FUSED_KERNELS)
    key = ("in_node", x.numel(), x.dtype, n, me, chunk, operator.HOST_CODE,
           compiled.used_for(x))
    shard = layers.plans.get(key)
    if shard is None:
        shard = layers.plans[key] = _Shard(layers, x, n, me, chunk)
    group.reserve(x.numel() * x.element_size(), shard.table_bytes)
    # The result goes both into slot 0, where the others read it, and into this rank's x.
    at, result, size = x.data_ptr(), group.slot_address(0), x.element_size()
    separate = at != result
    passes = _ByAddress(shard.host, group, at, separate) if shard.host is not None \
        else _ByTensor(x, group, separate)
    table = None
    for part in shard.chunks:
        # Only this rank reads its own shard of its own vector, so that shard stays in x.
        with trace.activity("ADASUM_PUBLISH", (part.stop - part.start) * size):
            group.publish(x, part.others)
        with trace.activity("ADASUM_GRAM", n * (part.hi - part.lo) * size):
            shares = passes.gram(part)
            if table is None:
                table = shares.copy()   # the C kernels' table is theirs: refilled each call
            else:
                table += shares
    with trace.activity("ADASUM_GRAM_SUM", table.size * 8):
        weights = passes.weights(group.sum_tables(table))
    for part in reversed(shard.chunks):
        with trace.activity("ADASUM_COMBINE", n * (part.hi - part.lo) * size):
            passes.mix(part, weights)
        with trace.activity("ADASUM_RESULT", (part.stop - part.start) * size):
            group.arrive("adasum result")
            if separate:
                for lo, hi in part.others:
                    ctypes.memmove(at + lo * size, result + lo * size, (hi - lo) * size)
    group.arrive("adasum result read")   # nobody refills its slot before all read slot 0
    return x


class _ByAddress:
    """The Gram pass, the weights and the weighted sum of a chunk through ``host``'s C
    kernels."""

    def __init__(self, host: HostTree, group: SharedMemoryGroup, at: int, separate: bool):
        self.host, self.group, self.at, self.separate = host, group, at, separate

    def _point(self, part: _Chunk) -> int:
        offset, me = part.lo * self.host.itemsize, self.group.rank
        for k in range(self.group.size):
            self.host.vectors[k] = (self.at if k == me else self.group.slot_address(k)) + offset
        return offset

    def gram(self, part: _Chunk) -> np.ndarray:
        self._point(part)
        return self.host.gram(part.piece)

    def weights(self, table: np.ndarray) -> np.ndarray:
        return tree_weights(self.host.packed(table), self.group.size)

    def mix(self, part: _Chunk, weights: np.ndarray):
        offset = self._point(part)
        copy: Optional[int] = None
        if self.separate:
            copy = (self.group.slot_address(0) if self.group.rank == 0 else self.at) + offset
        self.host.mix(self.host.vectors[0], copy, part.piece, weights)


class _ByTensor:
    """_ByAddress with torch tensors: 16-bit types, and where the C kernels are off."""

    def __init__(self, x: torch.Tensor, group: SharedMemoryGroup, separate: bool):
        self.x, self.group, self.separate = x, group, separate
        self.slots = group.slots_like(x)

    def _shards(self, part: _Chunk) -> List[torch.Tensor]:
        shards = [slot[part.lo:part.hi] for slot in self.slots]
        shards[self.group.rank] = self.x[part.lo:part.hi]
        return shards

    def gram(self, part: _Chunk) -> np.ndarray:
        return gram(self._shards(part), part.piece)

    def weights(self, table: np.ndarray) -> np.ndarray:
        return tree_weights(table, self.group.size)

    def mix(self, part: _Chunk, weights: np.ndarray):
        shards = self._shards(part)
        copy = None
        if self.separate:
            copy = (self.slots[0] if self.group.rank == 0 else self.x)[part.lo:part.hi]
        mix_(shards[0], shards, weights, part.piece, copy)
