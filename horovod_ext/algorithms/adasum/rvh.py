"""AdasumRVH (paper Algorithm 1) over any number of ranks of one communicator.

Recursive vector-halving: at distance d each rank swaps half of its current piece with the rank
d away, computes its share of the per-layer [a.b, a.a, b.b], sums the shares over the 2d ranks
that hold pieces of the same logical vectors (one small allreduce per level), applies Adasum to
its half, and recurses with 2d; the halves are then gathered back in reverse.  Each rank sends
about as many bytes as in a recursive-halving Sum allreduce.  For a power-of-two count the result
is the tree Adasum: ranks (0, 1), (2, 3), ... first, then those results pairwise, and so on.

Any count n (Horovod refuses counts that are not powers of two): with p the largest power of two
<= n, rank r >= p is first folded into rank r - p as Adasum(x[r-p], x[r]), the p first ranks run
AdasumRVH, and the folded ranks receive the result.  After the fold the p tree nodes no longer
stand for as many ranks each (r < n - p for two, the others for one), and the plain tree would
count a lone node like a folded pair: parallel inputs at n = 3 came out as
((x0 + x2) / 2 + x1) / 2, rank 1 weighing twice the others.  So each pair of the tree is weighted
by the ranks its two sides stand for, W_a and W_b (gather.tree_divisors, the same on every rank):
(1 - w_a a.b / |a|^2) a + (1 - w_b a.b / |b|^2) b with w = W / (W_a + W_b), which sums orthogonal
sides as Adasum does and keeps its other property, the mean of parallel inputs, at any n.  Equal
sides (every pair of a power-of-two count, and the fold itself) have w = 1/2: the usual Adasum,
computed by the same operations bit for bit.

Ranks are taken in a given ``order`` (a permutation of the communicator's ranks), so that a
hierarchical caller can run the tree over nodes in node order whatever the communicator's own
order; ``extra_reduce`` sums the partial products once more (over the local ranks that hold the
other shards of the same vectors, in the hierarchical variant).
"""
from collections import OrderedDict
from typing import Callable, Collection, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np
import torch

from horovod_ext.backends import trace
from horovod_ext.backends.base import Communicator

from .gather import gather_adasum_, largest_power_of_two, tree_divisors
from .operator import (WORKSPACE, Kernels, LayerMap, coefficients, combine_, kernels_for,
                       partial_dots)

# Bytes a rank may receive from the others for the gather path (see gather.py): below this its
# single collective beats RVH's 2 log2(n) + 1 synchronisation points.  At n = 2 on one host
# RVH, with its exchanges prepared once and its arithmetic on addresses (_Schedule), beats the
# single exchange at every size measured, so two ranks there always take RVH.  GATHER_LIMIT for
# n > 2 predates that change.
GATHER_LIMIT = 1 << 20
PAIR_GATHER_LIMIT = 0
# Bytes up to which a pair on two hosts swaps whole vectors (gather.py) instead of running RVH:
# the same bytes in one round trip over the link instead of three (the halves, the products'
# sum, the gather), for twice the arithmetic.  Lab, 1 Gbit/s, Gloo: 1 MiB 8.7 ms against
# 10.6-12.2 (Sum 8.5-9.0), 16 MiB 143.2-143.6 against 145.8-146.5; at 64 MiB the arithmetic
# shows (577-578 against 572-575), so larger vectors keep RVH.
PAIR_SWAP_LIMIT = 16 << 20

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


def layer_map(bounds) -> LayerMap:
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
                      offset: int = 0, gather_limit: Optional[int] = None,
                      remote: Collection[int] = ()) -> torch.Tensor:
    """Adasum of the flat tensor ``x`` over the ranks of ``comm``, per layer, in place.

    ``bounds``: (offset, numel) of every layer in the coordinates of the whole buffer; ``x``
    holds elements [offset, offset + x.numel()) of it (a shard, in the hierarchical variant).
    Whole vectors whose gathering would bring each rank at most ``gather_limit`` bytes from
    the others (default: PAIR_GATHER_LIMIT for 2 ranks, GATHER_LIMIT otherwise) go through
    gather.py (one collective) instead of RVH.  ``remote``: the ranks of ``comm`` on other
    hosts, with which every exchange goes whole (see CHUNK_ELEMENTS), and two of which swap
    their whole vectors up to PAIR_SWAP_LIMIT.
    """
    n = comm.size
    if n == 1:
        return x
    order = tuple(range(n)) if order is None else tuple(order)
    layers = layer_map(bounds)
    p = largest_power_of_two(n)
    me = order.index(comm.rank)
    gathered_bytes = (n - 1) * x.numel() * x.element_size()
    if gather_limit is None:
        gather_limit = PAIR_GATHER_LIMIT if n == 2 else GATHER_LIMIT
    if extra_reduce is None and offset == 0 and gathered_bytes <= gather_limit:
        with trace.activity("ADASUM_GATHER_AND_COMBINE", gathered_bytes // (n - 1)):
            return gather_adasum_(x, layers, comm, order)
    if (n == 2 and order[1 - me] in remote
            and x.numel() * x.element_size() <= PAIR_SWAP_LIMIT):
        with trace.activity("ADASUM_PAIR_SWAP", trace.nbytes_of(x)):
            return gather_adasum_(x, layers, comm, order, offset, extra_reduce)
    reduce_dots = extra_reduce or (lambda dots: dots)
    if me >= p:  # folded: hand the vector over, join the level sums, get the result back
        with trace.activity("ADASUM_FOLD_EXCHANGE", trace.nbytes_of(x)):
            _swap(comm, x, None, order[me - p])
        span = 2
        while span <= p:
            _sum_over_groups(comm, None, me, span, p, (layers.count, 3), x.device)
            span *= 2
        _swap(comm, None, x, order[me - p])
        return x
    if me + p < n:
        other = WORKSPACE.get("received", x.numel(), x.dtype, x.device)
        with trace.activity("ADASUM_FOLD_EXCHANGE"):
            _swap(comm, None, other, order[me + p])
        with trace.activity("ADASUM_FOLD_COMBINE"):
            piece = layers.piece(offset, offset + x.numel())
            dots = reduce_dots(partial_dots(x, other, piece))
            combine_(x, other, True, coefficients(dots), piece)
    kernels = kernels_for(x)
    if p > 1 and kernels is not None:
        schedule = _schedule(layers, x.numel(), offset, order, p, me, comm, frozenset(remote))
        _rvh_native(x, kernels, schedule, comm, extra_reduce)
    elif p > 1:
        _rvh(x, layers, comm, order, p, me, reduce_dots, offset)
    if me + p < n:
        with trace.activity("ADASUM_FOLD_EXCHANGE", trace.nbytes_of(x)):
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


# The first exchange of a level with a rank of the same host goes in chunks of at least this
# many elements (at most MAX_CHUNKS), and each chunk's dot products are summed as soon as it
# arrives, while it is still in cache: one pass over the received half from memory fewer.
# Across hosts the exchange goes whole: there the link, not memory, sets the time, and every
# chunk's end was one more chance for a TCP tail loss and its 200 ms retransmission timeout
# (MPI, 2 lab hosts at 1 Gbit/s, 64 MiB: 8 chunks took 810 ms in most calls, one 572 ms as Sum).
# Each chunk's end is also a wait for the partner: on one host (MPI, np = 2, 7 runs) a 4 MiB
# Adasum took 1.06-1.14x Sum's time in chunks of 512 KiB and 0.98-1.09x in one of 2 MiB (np = 4:
# 1.04x and 0.98x), where the halves stay in the last-level cache either way; at 64 MiB, 8
# chunks of 4 MiB beat 1, 2 or 4 larger ones by 3-6%.
CHUNK_ELEMENTS = 512 << 10
MAX_CHUNKS = 8


class _Level:
    """One halving step of one rank: it keeps [keep) of its current range, sends [send) to
    ``peer``, and sums its share of the products over the group of ``2 d`` ranks."""

    def __init__(self, keep, send, peer: int, left: bool, layers: LayerMap, offset: int,
                 groups: int, row: int, comm: Communicator, divisors: Tuple[float, float],
                 chunked: bool):
        self.keep, self.send, self.peer, self.left = keep, send, peer, left
        self.divisors = divisors  # of this level's pair (gather.tree_divisors)
        self.piece = layers.piece(offset + keep[0], offset + keep[1])
        # The (groups, layers, 3) table of _sum_over_groups, made once (float64 on the CPU:
        # the C kernels' path only), and the addresses the kernels take.
        count = self.piece.layer_count
        self.table = torch.zeros((groups, count, 3), dtype=torch.float64)
        self.zero = self.table.numpy().reshape(-1).fill
        self.row = self.table[row]
        self.dots = self.row.data_ptr()
        self.reduce = comm.prepare_allreduce(self.table)
        self._weights = np.zeros((count, 2))
        self.weights = self._weights.ctypes.data
        # Both partners hold the same range, so they agree on the count; the kept and the sent
        # half (one element longer or shorter) are each cut into that many chunks, and
        # chunk i of one rank's sent half is chunk i of its partner's kept half.
        # Only with a peer on this host (``chunked``) where an exchange is prepared by address
        # (MPI: cheap per exchange); a Gloo exchange is a round of its own.
        half = (max(keep[1], send[1]) - min(keep[0], send[0])) // 2
        count = (max(1, min(MAX_CHUNKS, half // CHUNK_ELEMENTS))
                 if chunked and comm.prepared_by_address else 1)
        cuts = [_cuts(*keep, count), _cuts(*send, count)]
        self.chunks = [(klo, khi, slo, shi, layers.piece(offset + klo, offset + khi))
                       for (klo, khi), (slo, shi) in zip(*cuts)]


def _cuts(lo: int, hi: int, count: int) -> List[Tuple[int, int]]:
    bounds = [lo + (hi - lo) * i // count for i in range(count + 1)]
    return list(zip(bounds, bounds[1:]))


def _prepare_swap(comm: Communicator, send: torch.Tensor, recv: torch.Tensor, peer: int):
    if comm.prepared_by_address or (send.numel() and recv.numel()):
        return comm.prepare_sendrecv(send, peer, recv, peer)
    return lambda: _swap(comm, send, recv, peer)


class _Schedule:
    """RVH's levels for one rank, one buffer layout and one communicator, and the exchanges
    prepared for the last buffer it ran on (kept on the LayerMap: the same buffers recur every
    step, and preparing costs more than the exchanges' own Python work)."""

    def __init__(self, layers: LayerMap, numel: int, offset: int, order, p: int, me: int,
                 comm: Communicator, remote: FrozenSet[int]):
        n = len(order)
        self.levels, lo, hi, d = [], 0, numel, 1
        while d < p:
            mid = lo + (hi - lo) // 2
            left = (me // d) % 2 == 0
            keep, send = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
            peer = order[me + d] if left else order[me - d]
            self.levels.append(_Level(keep, send, peer, left, layers, offset, p // (2 * d),
                                      me // (2 * d), comm, tree_divisors(n, me - me % (2 * d), d),
                                      peer not in remote))
            lo, hi = keep
            d *= 2
        self._prepared_for = None
        self._prepared = None

    def steps(self, x: torch.Tensor, comm: Communicator, size: int):
        """Per level: [(exchange, address of a, address of b, piece)] for its chunks, and the
        addresses of its kept half and of what it received; then the gather exchanges."""
        received = max((lv.keep[1] - lv.keep[0] for lv in self.levels), default=0)
        key = (x.data_ptr(), x.dtype, WORKSPACE.generation)
        if self._prepared_for == key and comm.prepared_by_address:
            return self._prepared
        theirs = WORKSPACE.get("received", received, x.dtype, x.device)
        base, other = x.data_ptr(), theirs.data_ptr()
        levels = []
        for lv in self.levels:
            lo = lv.keep[0]
            chunks = []
            for klo, khi, slo, shi, piece in lv.chunks:
                exchange = _prepare_swap(comm, x[slo:shi], theirs[klo - lo:khi - lo], lv.peer)
                mine, got = base + klo * size, other + (klo - lo) * size
                chunks.append((exchange, *((mine, got) if lv.left else (got, mine)), piece))
            levels.append((chunks, base + lo * size, other))
        gathers = [_prepare_swap(comm, x[lv.keep[0]:lv.keep[1]], x[lv.send[0]:lv.send[1]],
                                 lv.peer)
                   for lv in reversed(self.levels)]
        prepared = (levels, gathers)
        if comm.prepared_by_address:  # others hold the tensors: keeping them would hold x
            # the workspace may have grown while preparing: key on the generation after it
            self._prepared_for = (x.data_ptr(), x.dtype, WORKSPACE.generation)
            self._prepared = prepared
        return prepared


def _schedule(layers: LayerMap, numel: int, offset: int, order, p: int, me: int,
              comm: Communicator, remote: FrozenSet[int]) -> _Schedule:
    key = ("rvh", numel, offset, tuple(order), p, me, comm, CHUNK_ELEMENTS, remote)
    found = layers.plans.get(key)
    if found is None:
        found = layers.plans[key] = _Schedule(layers, numel, offset, order, p, me, comm, remote)
    return found


def _rvh_native(x: torch.Tensor, kernels: Kernels, schedule: _Schedule, comm: Communicator,
                extra_reduce: Optional[DotsReduce]):
    """_rvh for contiguous CPU float32/float64 buffers: the same exchanges and sums, the
    arithmetic on addresses, tables and exchanges made once (see _Schedule)."""
    steps, gathers = schedule.steps(x, comm, kernels.itemsize)
    if trace.recorder is not None:
        return _rvh_native_traced(x, kernels, schedule, steps, gathers, comm, extra_reduce)
    for level, (chunks, mine, other) in zip(schedule.levels, steps):
        level.zero(0.0)
        for exchange, a, b, piece in chunks:
            exchange()
            kernels.dots(a, b, piece, level.dots)
        level.reduce()
        if extra_reduce is not None:
            extra_reduce(level.row)
        kernels.combine(mine, other, level.left, level.dots, level.piece, level.weights,
                        level.divisors)
    for exchange in gathers:
        exchange()


def _rvh_native_traced(x, kernels: Kernels, schedule: _Schedule, steps, gathers,
                       comm: Communicator, extra_reduce: Optional[DotsReduce]):
    """_rvh_native with each level's exchange, dot products and combination on the timeline
    (the exchange of a chunk and its products alternate, each marked on its own)."""
    size = kernels.itemsize
    for i, (level, (chunks, mine, other)) in enumerate(zip(schedule.levels, steps)):
        with trace.activity(f"ADASUM_LEVEL_{i}", (level.send[1] - level.send[0]) * size):
            level.zero(0.0)
            for exchange, a, b, piece in chunks:
                with trace.activity("ADASUM_EXCHANGE"):
                    exchange()
                with trace.activity("ADASUM_DOT_PRODUCTS"):
                    kernels.dots(a, b, piece, level.dots)
            with trace.activity("ADASUM_DOT_PRODUCTS_SUM", level.table.numel() * 8):
                level.reduce()
                if extra_reduce is not None:
                    extra_reduce(level.row)
            with trace.activity("ADASUM_COMBINE"):
                kernels.combine(mine, other, level.left, level.dots, level.piece,
                                level.weights, level.divisors)
    with trace.activity("ADASUM_ALLGATHER", (x.numel() - (schedule.levels[-1].keep[1]
                                                          - schedule.levels[-1].keep[0])) * size):
        for exchange in gathers:
            exchange()


def _rvh(x, layers: LayerMap, comm: Communicator, order, p: int, me: int,
         reduce_dots: DotsReduce, offset: int):
    n = len(order)
    lo, hi = 0, x.numel()
    trail = []  # (lo, mid, hi, neighbour, kept_left) per level, for the gather phase
    d = 1
    level = 0
    while d < p:
        mid = lo + (hi - lo) // 2
        left = (me // d) % 2 == 0
        nghr = order[me + d] if left else order[me - d]
        sent = x[mid:hi] if left else x[lo:mid]
        with trace.activity(f"ADASUM_LEVEL_{level}", trace.nbytes_of(sent)):
            if left:  # keep [lo, mid): a is mine, b comes from the right neighbour
                mine = x[lo:mid]
                theirs = WORKSPACE.get("received", mid - lo, x.dtype, x.device)
                a, b, new = mine, theirs, (lo, mid)
            else:     # keep [mid, hi): a comes from the left neighbour, b is mine
                mine = x[mid:hi]
                theirs = WORKSPACE.get("received", hi - mid, x.dtype, x.device)
                a, b, new = theirs, mine, (mid, hi)
            with trace.activity("ADASUM_EXCHANGE"):
                _swap(comm, sent, theirs, nghr)
            piece = layers.piece(offset + new[0], offset + new[1])
            with trace.activity("ADASUM_DOT_PRODUCTS"):
                dots = partial_dots(a, b, piece)
                dots = reduce_dots(_sum_over_groups(comm, dots, me, 2 * d, p, dots.shape,
                                                    x.device))
            with trace.activity("ADASUM_COMBINE"):
                combine_(mine, theirs, left,
                         coefficients(dots, tree_divisors(n, me - me % (2 * d), d)), piece)
        trail.append((lo, mid, hi, nghr, left))
        lo, hi = new
        d *= 2
        level += 1
    with trace.activity("ADASUM_ALLGATHER", trace.nbytes_of(x) - (hi - lo) * x.element_size()):
        for lo, mid, hi, nghr, left in reversed(trail):
            if left:
                _swap(comm, x[lo:mid], x[mid:hi], nghr)
            else:
                _swap(comm, x[mid:hi], x[lo:mid], nghr)

