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
from typing import List, Sequence, Tuple

import torch

from horovod_ext.backends.base import Communicator

import numpy as np

from .operator import EQUAL, WORKSPACE, LayerMap, adasum_pair_, kernels_for


def largest_power_of_two(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def splits_into_blocks(n: int, block: int) -> bool:
    """Whether the tree over ``n`` ranks (RVH's, the gather path's) has every run of ``block``
    consecutive ranks as a subtree of its own: where both are powers of two, and ``block``
    divides ``n``.  A count that is not a power of two folds ranks across the runs."""
    return (n > 0 and block > 0 and n % block == 0
            and largest_power_of_two(n) == n and largest_power_of_two(block) == block)


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
                   order: Sequence[int]) -> torch.Tensor:
    """Adasum of the whole flat tensor ``x`` over ``comm``, the tree taken in ``order``."""
    n = comm.size
    me = order.index(comm.rank)
    if n == 2:
        peer = order[1 - me]
        other = WORKSPACE.get("received", x.numel(), x.dtype, x.device)
        comm.sendrecv(x, peer, other, peer)
        kernels = kernels_for(x)
        if kernels is not None:  # into x on both ranks: the C combine rounds alike either way
            piece = layers.piece(0, x.numel())
            tables = np.zeros(5 * layers.count)   # dots (layers, 3), then weights (layers, 2)
            dots = tables.ctypes.data
            mine, theirs = x.data_ptr(), other.data_ptr()
            a, b = (mine, theirs) if me == 0 else (theirs, mine)
            kernels.dots(a, b, piece, dots)
            kernels.combine(mine, theirs, me == 0, dots, piece, dots + 24 * layers.count)
        elif me == 0:
            adasum_pair_(x, other, layers)
        else:  # the same operation, a first, on both ranks: the same rounding
            x.copy_(adasum_pair_(other, x, layers))
        return x
    rows = comm.allgather(x.view(1, -1))
    vectors = [rows[rank] for rank in order]
    for pairs in tree_levels(n):
        for a, b, divisors in pairs:
            adasum_pair_(vectors[a], vectors[b], layers, divisors)
    return x.copy_(vectors[0])
