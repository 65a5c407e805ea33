"""Adasum among the ranks of one host, through their shared-memory segment (backends/shm.py).

Every rank publishes its whole vector in its slot, and every slot is split into the same
``split_sizes`` shards; rank s owns shard s of every slot.  The tree is the one RVH and the
gather path compute (ranks r >= p folded into r - p, then pairs at distance 1, 2, ..., weighted
by ``tree_divisors``), taken whole from the ranks' Gram matrix (gram.py): each rank computes
its shard's share of every per-layer dot product between the ranks' vectors in one pass, the
shares are summed through the segment (one small table per rank), every rank derives the
root's weight of each vector from the sum, and each rank writes its shard of the weighted sum
in one more pass, both into slot 0 and into its own vector; every rank then copies the others'
shards from slot 0.  A rank's own shard of its own vector is read by nobody else, so it is not
copied into the slot.  So the whole tree costs two passes over the shards and one wait for the
tables, where the tree level by level costs two passes and a wait per level, and RVH over
sockets an exchange of half the vector and a dot-product allreduce per level: on one host with
Gloo, the exchanges' copies through the kernel and their per-message latency dominated.

Every rank adds the tables in the same order and the result is each shard's one owner's, so
all ranks end with the same bits.

Where the C kernels take the buffer, the two passes and every copy run on addresses, with the
shard, its layers and the tables made once per buffer layout: on a small buffer the slices,
tables and checks around the kernels cost more than the kernels (Gloo, 2 ranks, 4 KiB: 90 us
a call with torch slices and tables, 30 us by address, against 52 us for Sum).
"""
import ctypes
from typing import Optional, Sequence, Tuple

import torch

from horovod_ext.backends import trace
from horovod_ext.backends.base import split_sizes
from horovod_ext.backends.shm import SharedMemoryGroup

from .. import compiled
from . import operator
from .gram import HostTree, gram, mix_, pair_count, tree_weights
from .rvh import layer_map


class _Shard:
    """One rank's part of in_node_adasum_ for one buffer layout, made once (kept on the
    LayerMap, as RVH's schedules are): its shard, the shard's piece and the C kernels' tree
    (None where they do not take the buffer)."""

    def __init__(self, layers, x: torch.Tensor, n: int, me: int):
        counts = split_sizes(x.numel(), n)
        self.lo = sum(counts[:me])
        self.hi = self.lo + counts[me]
        self.piece = layers.piece(self.lo, self.hi)
        self.table_bytes = layers.count * pair_count(n) * 8
        self.host = HostTree.for_tensor(x, n, layers.count)


def in_node_adasum_(x: torch.Tensor, bounds: Sequence[Tuple[int, int]],
                    group: SharedMemoryGroup) -> torch.Tensor:
    """Adasum of the flat CPU tensor ``x`` over the ranks of ``group`` (in local-rank order),
    per layer (``bounds``: (offset, numel) per layer), in place."""
    layers = layer_map(bounds)
    n, me = group.size, group.rank
    # the C kernels' use can be switched (operator.HOST_CODE, HOROVOD_FUSED_KERNELS)
    key = ("in_node", x.numel(), x.dtype, n, me, operator.HOST_CODE, compiled.used_for(x))
    shard = layers.plans.get(key)
    if shard is None:
        shard = layers.plans[key] = _Shard(layers, x, n, me)
    lo, hi, size = shard.lo, shard.hi, x.element_size()
    # Only this rank reads its own shard of its own vector, so that shard stays in x.
    with trace.activity("ADASUM_PUBLISH", trace.nbytes_of(x)):
        group.publish(x, table_bytes=shard.table_bytes, private=(lo, hi))
    # The result goes both into slot 0, where the others read it, and into this rank's x.
    at, result = x.data_ptr(), group.slot_address(0)
    separate = at != result
    if shard.host is not None:
        _tree_by_address(shard.host, shard, group, at, separate)
    else:
        _tree(x, shard, group, separate)
    with trace.activity("ADASUM_RESULT", trace.nbytes_of(x)):
        group.arrive("adasum result")
        if separate:
            ctypes.memmove(at, result, lo * size)
            ctypes.memmove(at + hi * size, result + hi * size, (x.numel() - hi) * size)
        group.arrive("adasum result read")   # nobody refills its slot before all read slot 0
    return x


def _tree_by_address(host: HostTree, shard: _Shard, group: SharedMemoryGroup, at: int,
                     separate: bool):
    """The Gram pass, the tables' sum and the weighted sum through ``host``'s C kernels."""
    n, me, offset = group.size, group.rank, shard.lo * host.itemsize
    for k in range(n):
        host.vectors[k] = (at if k == me else group.slot_address(k)) + offset
    nbytes = n * (shard.hi - shard.lo) * host.itemsize
    with trace.activity("ADASUM_GRAM", nbytes):
        table = host.gram(shard.piece)
    with trace.activity("ADASUM_GRAM_SUM", table.size * 8):
        weights = tree_weights(host.packed(group.sum_tables(table)), n)
    copy: Optional[int] = None
    if separate:
        copy = (group.slot_address(0) if me == 0 else at) + offset
    with trace.activity("ADASUM_COMBINE", nbytes):
        host.mix(host.vectors[0], copy, shard.piece, weights)


def _tree(x: torch.Tensor, shard: _Shard, group: SharedMemoryGroup, separate: bool):
    """_tree_by_address with torch tensors: 16-bit types, and where the C kernels are off."""
    n, me, lo, hi = group.size, group.rank, shard.lo, shard.hi
    slots = group.slots_like(x)
    shards = [slot[lo:hi] for slot in slots]
    shards[me] = x[lo:hi]
    with trace.activity("ADASUM_GRAM", n * (hi - lo) * x.element_size()):
        table = gram(shards, shard.piece)
    with trace.activity("ADASUM_GRAM_SUM", table.size * 8):
        weights = tree_weights(group.sum_tables(table), n)
    copy = (slots[0] if me == 0 else x)[lo:hi] if separate else None
    with trace.activity("ADASUM_COMBINE", n * (hi - lo) * x.element_size()):
        mix_(shards[0], shards, weights, shard.piece, copy)
