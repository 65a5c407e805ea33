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
"""
from typing import Sequence, Tuple

import torch

from horovod_ext.backends import trace
from horovod_ext.backends.base import split_sizes
from horovod_ext.backends.shm import SharedMemoryGroup

from .gram import gram, mix_, pair_count, tree_weights
from .rvh import layer_map


def in_node_adasum_(x: torch.Tensor, bounds: Sequence[Tuple[int, int]],
                    group: SharedMemoryGroup) -> torch.Tensor:
    """Adasum of the flat CPU tensor ``x`` over the ranks of ``group`` (in local-rank order),
    per layer (``bounds``: (offset, numel) per layer), in place."""
    layers = layer_map(bounds)
    n, me = group.size, group.rank
    counts = split_sizes(x.numel(), n)
    lo = sum(counts[:me])
    hi = lo + counts[me]
    piece = layers.piece(lo, hi)
    # Only this rank reads its own shard of its own vector, so that shard stays in x.
    with trace.activity("ADASUM_PUBLISH", trace.nbytes_of(x)):
        slots = group.publish(x, table_bytes=layers.count * pair_count(n) * 8, private=(lo, hi))
    shards = [slot[lo:hi] for slot in slots]
    shards[me] = x[lo:hi]
    with trace.activity("ADASUM_GRAM", n * (hi - lo) * x.element_size()):
        table = gram(shards, piece)
    with trace.activity("ADASUM_GRAM_SUM", table.size * 8):
        weights = tree_weights(group.sum_tables(table), n)
    # The result goes both into slot 0, where the others read it, and into this rank's x.
    separate = x.data_ptr() != slots[0].data_ptr()
    copy = (slots[0] if me == 0 else x)[lo:hi] if separate else None
    with trace.activity("ADASUM_COMBINE", n * (hi - lo) * x.element_size()):
        mix_(shards[0], shards, weights, piece, copy)
    with trace.activity("ADASUM_RESULT", trace.nbytes_of(x)):
        group.arrive("adasum result")
        if separate:
            x[:lo].copy_(slots[0][:lo])
            x[hi:].copy_(slots[0][hi:])
        group.arrive("adasum result read")   # nobody refills its slot before all read slot 0
    return x
