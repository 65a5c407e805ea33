"""Adasum of small vectors: every rank gets every vector and runs the tree itself.

For small messages RVH's cost is not bytes but its synchronisation points (an exchange and a
dot-product allreduce per level, then the gather) and the work between them.  Here there is one
collective: at n = 2 a single exchange of the whole vector, which sends exactly the bytes RVH
sends (one whole vector instead of two halves) for twice the arithmetic; for larger n an
allgather, which moves n - 1 times RVH's bytes, so the caller keeps this for small messages.

The tree is the one RVH computes (ranks r >= p folded into r - p, then pairs at distance 1, 2,
..., each pair weighted by the ranks its two sides stand for: ``tree_divisors``), and every rank
runs the same operations on the same operands in the same roles, so all ranks end with the same
bits (the C kernels' sums have a fixed order on every CPU, and so have the fused kernels' that
CUDA tensors take, and the torch code's: fixed-order reductions and scans, no atomics).
"""
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from horovod_ext.backends.base import Communicator

import numpy as np

from .operator import (EQUAL, WORKSPACE, LayerMap, adasum_pair_, coefficients, combine_,
                       kernels_for, partial_dots)


def largest_power_of_two(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def splits_into_blocks(n: int, block: int) -> bool:
    """Whether the tree over ``n`` ranks (RVH's, the gather path's) has every run of ``block``
    consecutive ranks as a subtree of its own: single ranks and all of them trivially, else
    where both are powers of two (``block`` then divides ``n``).  A count that is not a power of
    two folds ranks across the runs."""
    if n <= 0 or block <= 0 or n % block:
        return False
    return (block in (1, n)
            or (largest_power_of_two(n) == n and largest_power_of_two(block) == block))


def tree_divisors(n: int, lo: int, d: int) -> Tuple[float, float]:
    """The divisors (d_a, d_b) (operator.py) of the tree's pair at distance ``d`` whose a side is
    nodes [lo, lo + d) and b side [lo + d, lo + 2 d), over ``n`` ranks.

    After the fold, node r < n - p stands for two ranks (r and r + p), the others for one; a
    side weighs the ranks its nodes stand for.  Weighting by them keeps Adasum's mean of
    parallel inputs at every count (unweighted, n = 3 gave rank 1 half the result).  For a
    power of two every side has d ranks: (2.0, 2.0), the usual Adasum, exactly.  The same on
    every rank: it depends on n, the level and the pair only."""
    folded = n - largest_power_of_two(n)

    def ranks(first: int, end: int) -> int:
        return (end - first) + max(0, min(end, folded) - first)

    w_a, w_b = ranks(lo, lo + d), ranks(lo + d, lo + 2 * d)
    return (w_a + w_b) / w_a, (w_a + w_b) / w_b


def tree_levels(n: int) -> List[List[Tuple[int, int, Tuple[float, float]]]]:
    """The tree's pairs (a, b, divisors) over ``n`` nodes, level by level: the fold of
    r >= p into r - p (p the largest power of two <= n), then distance 1, 2, ...; the a side
    becomes the pair's node, and the root is node 0."""
    p = largest_power_of_two(n)
    levels = [[(r - p, r, EQUAL) for r in range(p, n)]] if n > p else []
    d = 1
    while d < p:
        levels.append([(i, i + d, tree_divisors(n, i, d)) for i in range(0, p, 2 * d)])
        d *= 2
    return levels


def gather_adasum_(x: torch.Tensor, layers: LayerMap, comm: Communicator,
                   order: Sequence[int], offset: int = 0,
                   extra_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
                   ) -> torch.Tensor:
    """Adasum of the whole flat tensor ``x`` over ``comm``, the tree taken in ``order``.  Two
    ranks may hold a shard (elements [offset, offset + x.numel()) of the buffer ``layers``
    maps) whose dot products ``extra_reduce`` sums over the ranks holding the other shards."""
    n = comm.size
    me = order.index(comm.rank)
    if n == 2:
        return _pair_(x, layers, comm, order[1 - me], me == 0, offset, extra_reduce)
    rows = comm.allgather(x.view(1, -1))
    vectors = [rows[rank] for rank in order]
    for pairs in tree_levels(n):
        for a, b, divisors in pairs:
            adasum_pair_(vectors[a], vectors[b], layers, divisors)
    return x.copy_(vectors[0])


def _pair_(x: torch.Tensor, layers: LayerMap, comm: Communicator, peer: int, first: bool,
           offset: int, extra_reduce) -> torch.Tensor:
    """Two ranks: one exchange of the whole vectors, then each computes the pair's dot
    products (the same operands in the same roles on both: the same bits) and its result."""
    other = WORKSPACE.get("received", x.numel(), x.dtype, x.device)
    comm.sendrecv(x, peer, other, peer)
    piece = layers.piece(offset, offset + x.numel())
    kernels = kernels_for(x)
    if kernels is not None:  # into x on both ranks: the C combine rounds alike either way
        tables = np.zeros(5 * layers.count)   # dots (layers, 3), then weights (layers, 2)
        dots = tables.ctypes.data
        mine, theirs = x.data_ptr(), other.data_ptr()
        a, b = (mine, theirs) if first else (theirs, mine)
        kernels.dots(a, b, piece, dots)
        if extra_reduce is not None:
            table = torch.from_numpy(tables[:3 * layers.count]).view(layers.count, 3)
            summed = extra_reduce(table)
            if summed.data_ptr() != table.data_ptr():
                table.copy_(summed)
        kernels.combine(mine, theirs, first, dots, piece, dots + 24 * layers.count)
        return x
    a, b = (x, other) if first else (other, x)
    dots = partial_dots(a, b, piece)
    if extra_reduce is not None:
        dots = extra_reduce(dots)
    # the same operation, a first, on both ranks: the same rounding
    result = combine_(a, b, True, coefficients(dots), piece)
    return x if first else x.copy_(result)
