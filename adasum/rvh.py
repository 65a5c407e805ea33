"""AdasumRVH (paper Algorithm 1) over any number of ranks of one communicator.

Recursive vector-halving: at distance d each rank swaps half of its current piece with the rank
d away, computes its share of the per-layer [a.b, a.a, b.b], sums the shares over the 2d ranks
that hold pieces of the same logical vectors (one small allreduce per level), applies Adasum to its half, and recurses with 2d;
the halves are then gathered back in reverse.  Each rank sends about as many bytes as in a
recursive-halving Sum allreduce.  For a power-of-two count the result is the tree Adasum: ranks
(0, 1), (2, 3), ... first, then those results pairwise, and so on.

Any count n (Horovod needs a power of two): with p the largest power of two <= n, rank r >= p is
first folded into rank r - p as Adasum(x[r-p], x[r]), the p first ranks run AdasumRVH, and the
folded ranks receive the result.

Ranks are taken in a given ``order`` (a permutation of the communicator's ranks), so that a
hierarchical caller can run the tree over nodes in node order whatever the communicator's own
order; ``extra_reduce`` sums the partial products once more (over the local ranks that hold the
other shards of the same vectors, in the hierarchical variant).
"""
from collections import OrderedDict
from typing import Callable, Optional, Sequence, Tuple

import torch

from horovod_ext.backends.base import Communicator

from .gather import gather_adasum_, largest_power_of_two
from .operator import WORKSPACE, LayerMap, coefficients, combine_, partial_dots

# Bytes a rank may receive from the others for the gather path (see gather.py): below this its
# single collective beats RVH's 2 log2(n) + 1 synchronisation points.  At n = 2 it sends the
# same bytes as RVH, and with the float32-block dot kernel its doubled arithmetic costs less
# than RVH's second exchange and dot-product allreduce up to 4 MiB (measured: 2 MiB 1.15x Sum
# against 1.41x, 4 MiB 1.14-1.18x against 1.20x, 8 MiB 1.23x against 1.21x).
GATHER_LIMIT = 1 << 20
PAIR_GATHER_LIMIT = 4 << 20

DotsReduce = Callable[[torch.Tensor], torch.Tensor]


def _sum_over_groups(comm: Communicator, dots: Optional[torch.Tensor], me: int, span: int,
                     p: int, shape, device) -> torch.Tensor:
    """Each group of ``span`` consecutive ranks (in order) sums its members' partial products.

    One allreduce over the whole communicator of a (p / span, layers, 3) table, each rank
    writing its group's row, instead of one sub-communicator per group: building those
    (Gloo new_group) must happen in the same order on every process, which ranks that run
    different parts of the tree cannot guarantee.  Folded ranks take part with ``dots=None``.
    """
    # on the data's device, so that every rank uses the same transport (Gloo or NCCL)
    table = torch.zeros((p // span,) + tuple(shape), dtype=torch.float64, device=device)
    if dots is not None:
        table[me // span] = dots
    comm.allreduce(table)
    return table[me // span] if dots is not None else table[0]


_LAYER_MAPS: "OrderedDict[tuple, LayerMap]" = OrderedDict()


def _layer_map(bounds) -> LayerMap:
    """The LayerMap of these bounds, kept for the buffers seen lately (they recur each step,
    and a map keeps the pieces it has sliced)."""
    key = tuple(map(tuple, bounds))
    found = _LAYER_MAPS.get(key)
    if found is None:
        found = _LAYER_MAPS[key] = LayerMap(bounds)
        if len(_LAYER_MAPS) > 64:
            _LAYER_MAPS.popitem(last=False)
    else:
        _LAYER_MAPS.move_to_end(key)
    return found


def adasum_allreduce_(x: torch.Tensor, bounds: Sequence[Tuple[int, int]], comm: Communicator,
                      order: Optional[Sequence[int]] = None,
                      extra_reduce: Optional[DotsReduce] = None,
                      offset: int = 0, gather_limit: Optional[int] = None) -> torch.Tensor:
    """Adasum of the flat tensor ``x`` over the ranks of ``comm``, per layer, in place.

    ``bounds``: (offset, numel) of every layer in the coordinates of the whole buffer; ``x``
    holds elements [offset, offset + x.numel()) of it (a shard, in the hierarchical variant).
    Whole vectors whose gathering would bring each rank at most ``gather_limit`` bytes from
    the others (default: PAIR_GATHER_LIMIT for 2 ranks, GATHER_LIMIT otherwise) go through
    gather.py (one collective) instead of RVH.
    """
    n = comm.size
    if n == 1:
        return x
    order = tuple(range(n)) if order is None else tuple(order)
    layers = _layer_map(bounds)
    p = largest_power_of_two(n)
    me = order.index(comm.rank)
    gathered_bytes = (n - 1) * x.numel() * x.element_size()
    if gather_limit is None:
        gather_limit = PAIR_GATHER_LIMIT if n == 2 else GATHER_LIMIT
    if extra_reduce is None and offset == 0 and gathered_bytes <= gather_limit:
        return gather_adasum_(x, layers, comm, order)
    reduce_dots = extra_reduce or (lambda dots: dots)

    if me >= p:  # folded: hand the vector over, join the level sums, get the result back
        _swap(comm, x, None, order[me - p])
        span = 2
        while span <= p:
            _sum_over_groups(comm, None, me, span, p, (layers.count, 3), x.device)
            span *= 2
        _swap(comm, None, x, order[me - p])
        return x
    if me + p < n:
        other = WORKSPACE.get("received", x.numel(), x.dtype, x.device)
        _swap(comm, None, other, order[me + p])
        piece = layers.piece(offset, offset + x.numel())
        dots = reduce_dots(partial_dots(x, other, piece))
        combine_(x, other, True, coefficients(dots), piece)
    if p > 1:
        _rvh(x, layers, comm, order, p, me, reduce_dots, offset)
    if me + p < n:
        _swap(comm, x, None, order[me + p])
    return x


def _swap(comm: Communicator, send: Optional[torch.Tensor], recv: Optional[torch.Tensor],
          peer: int):
    """Send and/or receive with ``peer``; empty parts are left out (both sides agree on the
    sizes, so both leave out the same ones)."""
    send = send if send is not None and send.numel() else None
    recv = recv if recv is not None and recv.numel() else None
    if send is not None or recv is not None:
        comm.sendrecv(send, peer if send is not None else None,
                      recv, peer if recv is not None else None)


def _rvh(x, layers: LayerMap, comm: Communicator, order, p: int, me: int,
         reduce_dots: DotsReduce, offset: int):
    lo, hi = 0, x.numel()
    trail = []  # (lo, mid, hi, neighbour, kept_left) per level, for the gather phase
    d = 1
    while d < p:
        mid = lo + (hi - lo) // 2
        left = (me // d) % 2 == 0
        nghr = order[me + d] if left else order[me - d]
        if left:  # keep [lo, mid): a is mine, b comes from the right neighbour
            mine = x[lo:mid]
            theirs = WORKSPACE.get("received", mid - lo, x.dtype, x.device)
            _swap(comm, x[mid:hi], theirs, nghr)
            a, b, new = mine, theirs, (lo, mid)
        else:     # keep [mid, hi): a comes from the left neighbour, b is mine
            mine = x[mid:hi]
            theirs = WORKSPACE.get("received", hi - mid, x.dtype, x.device)
            _swap(comm, x[lo:mid], theirs, nghr)
            a, b, new = theirs, mine, (mid, hi)
        piece = layers.piece(offset + new[0], offset + new[1])
        dots = partial_dots(a, b, piece)
        dots = reduce_dots(_sum_over_groups(comm, dots, me, 2 * d, p, dots.shape, x.device))
        combine_(mine, theirs, left, coefficients(dots), piece)
        trail.append((lo, mid, hi, nghr, left))
        lo, hi = new
        d *= 2
    for lo, mid, hi, nghr, left in reversed(trail):
        if left:
            _swap(comm, x[lo:mid], x[mid:hi], nghr)
        else:
            _swap(comm, x[mid:hi], x[lo:mid], nghr)

