"""Adasum among the ranks of one host, through their shared-memory segment (backends/shm.py).

Every rank publishes its whole vector in its slot, and every slot is split into the same
``split_sizes`` shards; rank s owns shard s of every slot.  The tree is the one RVH and the
gather path compute (ranks r >= p folded into r - p, then pairs at distance 1, 2, ..., weighted
by ``tree_divisors``): at each level every rank computes, for every pair of the level, its
shard's share of the per-layer [a.b, a.a, b.b]; the shares are summed through the segment (one
small table per rank and level); and each rank combines its own shard of every pair into the
a side's slot.  A rank's own shard of its own vector is read by nobody else, so it is not
copied into the slot: it is read and combined where it is.  Only the tables cross between ranks
until the last level, whose pass writes each rank's shard of the result both into slot 0 and
into the rank's own vector; every rank then copies the others' shards from slot 0.  So a level costs one
pass over the shards and one wait, where RVH over sockets costs an exchange of half the vector
and a dot-product allreduce: on one host with Gloo, the exchanges' copies through the kernel
and their per-message latency dominated.

Every rank adds the tables in the same order and the result is each shard's one owner's, so
all ranks end with the same bits.
"""
from typing import List, Sequence, Tuple

import torch

from horovod_ext.backends import trace
from horovod_ext.backends.base import split_sizes
from horovod_ext.backends.shm import SharedMemoryGroup

from .gather import largest_power_of_two, tree_divisors
from .operator import EQUAL, coefficients, combine_, partial_dots
from .rvh import layer_map

# (a, b, divisors): the a side's vector becomes Adasum(a, b)
Pair = Tuple[int, int, Tuple[float, float]]


def tree_levels(n: int) -> List[List[Pair]]:
    """The tree's pairs over ``n`` ranks, level by level: the fold, then distance 1, 2, ..."""
    p = largest_power_of_two(n)
    levels = [[(r - p, r, EQUAL) for r in range(p, n)]] if n > p else []
    d = 1
    while d < p:
        levels.append([(i, i + d, tree_divisors(n, i, d)) for i in range(0, p, 2 * d)])
        d *= 2
    return levels


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
    levels = tree_levels(n)
    widest = max(len(pairs) for pairs in levels)
    # Only this rank reads its own shard of its own vector, so that shard stays in x.
    with trace.activity("ADASUM_PUBLISH", trace.nbytes_of(x)):
        slots = group.publish(x, table_bytes=widest * layers.count * 3 * 8, private=(lo, hi))
    shards = [slot[lo:hi] for slot in slots]
    shards[me] = x[lo:hi]
    shard_bytes = (hi - lo) * x.element_size()
    # The last level (one pair, whose a side is rank 0) writes each shard's result both into
    # slot 0, where the others read it, and into this rank's x, in one pass.
    separate = x.data_ptr() != slots[0].data_ptr()
    result_copy = (slots[0] if me == 0 else x)[lo:hi] if separate else None
    for i, pairs in enumerate(levels):
        with trace.activity(f"ADASUM_LEVEL_{i}", 2 * len(pairs) * shard_bytes):
            _level(pairs, shards, piece, layers.count, group, hi > lo,
                   result_copy if i == len(levels) - 1 else None)
    with trace.activity("ADASUM_RESULT", trace.nbytes_of(x)):
        group.arrive("adasum result")
        if separate:
            x[:lo].copy_(slots[0][:lo])
            x[hi:].copy_(slots[0][hi:])
        group.arrive("adasum result read")   # nobody refills its slot before all read slot 0
    return x


def _level(pairs: List[Pair], shards, piece, layer_count: int, group: SharedMemoryGroup,
           owns_elements: bool, copy=None):
    """One level of the tree on this rank's shard: its share of every pair's products, their
    sum over the ranks, and the a sides combined in place (also into ``copy``, if given, on
    the last level, whose one pair's a side is slot 0)."""
    table = torch.zeros(len(pairs), layer_count, 3, dtype=torch.float64)
    with trace.activity("ADASUM_DOT_PRODUCTS"):
        if owns_elements:
            for k, (a, b, _) in enumerate(pairs):
                table[k] = partial_dots(shards[a], shards[b], piece)
    with trace.activity("ADASUM_DOT_PRODUCTS_SUM", table.numel() * 8):
        dots = group.sum_tables(table)
    with trace.activity("ADASUM_COMBINE"):
        if owns_elements:
            for k, (a, b, divisors) in enumerate(pairs):
                combine_(shards[a], shards[b], True, coefficients(dots[k], divisors), piece,
                         copy)
