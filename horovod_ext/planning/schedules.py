"""What each op sends, to whom, and what it computes: communication schedules for the model.

A schedule is a list of stages; a stage is a list of steps; a step is a set of transfers that
run at the same time (a ``Pattern`` of flows, scaled to bytes) followed by local work, repeated
``repeat`` times.  The schedules follow the implementations: Gloo's ring allreduce and
allgather, direct all-to-all, Adasum's recursive vector halving with its per-level dot-product
allreduce (adasum/rvh.py), 1-bit's all-to-all + all-gather (onebit/compressed_allreduce.py),
random-k's reduced allreduce, PowerSGD's two allreduces, and the hierarchical forms: shared-memory
reduce-scatter in the node, the op across nodes on each rank's shard (local rank l of every
node together), shared-memory all-gather; elementwise hierarchical allreduce pipelines the three
over chunks.  Ranks are numbered node by node (rank = node * ranks_per_node + local rank).

Transfers of one step are timed by the network engine (simulate.py), the local work by the
calibrated costs of a profile (profile.py).  Nothing here knows about SimGrid.
"""
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

from horovod_ext.backends.partition import pipeline_chunk_bytes
from .cluster import Cluster
from .profile import Profile

F32 = 4


@dataclass(frozen=True)
class Pattern:
    """Flows (source rank, destination rank, weight) that run at once; a step sends ``weight *
    bytes`` on each.  Patterns are what the network engine times, once each."""
    name: str
    flows: Tuple[Tuple[int, int, float], ...]


@dataclass
class Step:
    name: str
    pattern: Pattern = None        # None: local work only
    bytes: float = 0.0             # bytes per unit of weight
    compute_s: float = 0.0         # local work after the transfers (the busiest rank's)
    messages: int = 0              # messages each rank sends and receives in the step
    repeat: int = 1


@dataclass
class Schedule:
    """Stages run one after the other, except that ``chunks`` > 1 pipelines them: chunk i's
    stage s runs while chunk i+1 is in stage s-1 (the steps are then per chunk)."""
    op: str
    stages: List[List[Step]]
    chunks: int = 1
    sent_per_rank: float = 0.0     # bytes each rank puts on the wire, for the report


# --- flow patterns ---------------------------------------------------------------------------

def ring_pattern(rings: Sequence[Sequence[int]]) -> Pattern:
    """Every member of each ring sends to the next, all rings at once."""
    flows = tuple((r[i], r[(i + 1) % len(r)], 1.0) for r in rings if len(r) > 1
                  for i in range(len(r)))
    return Pattern("ring:" + _shape(rings), flows)


def pair_pattern(rings: Sequence[Sequence[int]], distance: int,
                 cluster: Cluster = None) -> Pattern:
    """Members ``distance`` apart (in each list's order, paired by XOR) swap, both ways.

    With ``cluster`` (and power-of-two ranks per node and nodes per rack), a distance is
    replaced by the smallest one that pairs ranks the same way (inside a node, between nodes
    of a rack, between racks): those patterns load the same links alike, so they take the same
    time and the engine times one of them."""
    if cluster is not None:
        distance = _same_load_distance(rings, distance, cluster)
    flows = []
    for members in rings:
        for i, r in enumerate(members):
            j = i ^ distance
            if j < len(members):
                flows.append((r, members[j], 1.0))
    return Pattern(f"pairs{distance}:" + _shape(rings), tuple(flows))


def _same_load_distance(rings: Sequence[Sequence[int]], distance: int, cluster: Cluster) -> int:
    def power_of_two(x):
        return x > 0 and x & (x - 1) == 0
    per_node = cluster.ranks_per_node
    rack = cluster.nodes_per_rack or cluster.nodes
    if not (power_of_two(per_node) and power_of_two(rack)):
        return distance
    members = rings[0]
    if len(members) < 2:
        return distance
    # members per node and per rack, in list positions (the lists hold ranks in node order)
    step_nodes = (members[1] // per_node) - (members[0] // per_node)
    in_node = per_node if step_nodes == 0 else 1
    in_rack = in_node * rack
    if distance < in_node:
        return 1
    if distance < in_rack:
        return in_node
    return in_rack


def alltoall_pattern(cluster: Cluster, groups: Sequence[Sequence[int]]) -> Pattern:
    """Direct all-to-all inside each group, folded into at most three flows per rank: what it
    sends to the other members on its node, on the other nodes of its rack and in other racks
    (weights: number of pieces), each to one peer of that kind.  NIC and uplink loads are those
    of the full exchange, while the engine times O(ranks) flows instead of O(ranks^2)."""
    per_node = cluster.ranks_per_node
    rack = cluster.nodes_per_rack or cluster.nodes
    flows = []
    for members in groups:
        if len(members) < 2:
            continue
        on_node: Dict[int, List[int]] = {}
        for r in members:
            on_node.setdefault(r // per_node, []).append(r)
        # the group's nodes by rack, once: a pass per node would be quadratic at 1024 nodes
        by_rack: Dict[int, List[int]] = {}
        for node in sorted(on_node):
            by_rack.setdefault(node // rack, []).append(node)
        in_rack_of = {rk: sum(len(on_node[m]) for m in nodes) for rk, nodes in by_rack.items()}
        place = {node: i for nodes in by_rack.values() for i, node in enumerate(nodes)}
        racks = sorted(by_rack)
        for node, here in on_node.items():
            first = node - node % rack
            rack_nodes = by_rack[node // rack]
            in_rack = in_rack_of[node // rack]
            peers = []       # (node of the peer, pieces sent to that kind of peer)
            if in_rack > len(here):
                peers.append((rack_nodes[(place[node] + 1) % len(rack_nodes)],
                              in_rack - len(here)))
            if len(members) > in_rack:
                far = (first + rack + node % rack) % cluster.nodes   # same place, next rack
                if far not in on_node:   # the group's lowest node outside this rack
                    far = by_rack[next(rk for rk in racks if rk != node // rack)][0]
                peers.append((far, len(members) - in_rack))
            for k, r in enumerate(here):
                if len(here) > 1:
                    flows.append((r, here[(k + 1) % len(here)], float(len(here) - 1)))
                for peer_node, pieces in peers:
                    there = on_node[peer_node]
                    flows.append((r, there[k % len(there)], float(pieces)))
    return Pattern("alltoall:" + _shape(groups), tuple(flows))


def _shape(groups: Sequence[Sequence[int]]) -> str:
    return f"{len(groups)}x{max(len(g) for g in groups)}"


# --- collectives -------------------------------------------------------------------------------

def ring_allreduce(groups: Sequence[Sequence[int]], nbytes: float, profile: Profile,
                   name: str = "allreduce") -> List[Step]:
    """Gloo's ring: n - 1 reduce-scatter steps (each adds the chunk it received) and n - 1
    all-gather steps, a chunk of nbytes / n each, every group at once."""
    n = max(len(g) for g in groups)
    if n < 2:
        return []
    chunk = nbytes / n
    pattern = ring_pattern(groups)
    return [Step(f"{name} reduce-scatter", pattern, chunk, profile.cost("reduce", chunk), 1, n - 1),
            Step(f"{name} all-gather", pattern, chunk, 0.0, 1, n - 1)]


def ring_allgather(groups: Sequence[Sequence[int]], piece: float, name: str) -> List[Step]:
    n = max(len(g) for g in groups)
    if n < 2:
        return []
    return [Step(name, ring_pattern(groups), piece, 0.0, 1, n - 1)]


def world(cluster: Cluster) -> List[List[int]]:
    return [list(range(cluster.ranks))]


def cross_groups(cluster: Cluster) -> List[List[int]]:
    """Local rank l of every node, for each l: the cross-node communicators."""
    r = cluster.ranks_per_node
    return [[node * r + local for node in range(cluster.nodes)] for local in range(r)]


def hierarchy_applies(cluster: Cluster) -> bool:
    return cluster.nodes > 1 and cluster.ranks_per_node > 1


def in_node_reduce_scatter(nbytes: float, profile: Profile) -> Step:
    """Shared memory: each local rank sums its 1/R slice of the R buffers (reads nbytes)."""
    return Step("node reduce-scatter (shared memory)",
                compute_s=profile.cost("shm_reduce", nbytes))


def in_node_allgather(cluster: Cluster, nbytes: float, profile: Profile) -> Step:
    r = cluster.ranks_per_node
    return Step("node all-gather (shared memory)",
                compute_s=profile.cost("copy", nbytes * (r - 1) / r))


def pipeline_chunks(cluster: Cluster, nbytes: float) -> int:
    """How many chunks the hierarchical allreduce pipelines (Collectives' chunk size)."""
    chunk = pipeline_chunk_bytes(int(nbytes), ranks=cluster.ranks)
    return max(1, math.ceil(nbytes / chunk))


def op_work(op: str, profile: Profile, nbytes: float, tensors: int) -> Step:
    """The op's local work beyond its primitives (the profile's fit for it)."""
    return Step(f"{op}'s own work", compute_s=profile.op_work(op, nbytes, tensors))


def across_nodes(op: str, cluster: Cluster, nbytes: float, profile: Profile, hierarchical: bool,
                 body: Callable[[List[List[int]], float], Tuple[List[Step], float]]) -> Schedule:
    """A non-pipelined op, as Collectives runs it with a ``cross_step``: flat, ``body`` over the
    world on the whole buffer; hierarchical, a shared-memory reduce-scatter, ``body`` over the
    cross-node groups on each local rank's shard, a shared-memory all-gather.  ``body(groups,
    nbytes)`` returns its steps and the bytes each rank sends."""
    hier = hierarchical and hierarchy_applies(cluster)
    groups = cross_groups(cluster) if hier else world(cluster)
    steps, sent = body(groups, nbytes / cluster.ranks_per_node if hier else nbytes)
    if hier:
        steps = [in_node_reduce_scatter(nbytes, profile), *steps,
                 in_node_allgather(cluster, nbytes, profile)]
    return Schedule(op, [steps], 1, sent)


# --- ops -----------------------------------------------------------------------------------------

def average(cluster: Cluster, nbytes: float, profile: Profile, hierarchical: bool) -> Schedule:
    p = cluster.ranks
    if hierarchical and hierarchy_applies(cluster):
        chunks = pipeline_chunks(cluster, nbytes)
        piece = nbytes / chunks
        r = cluster.ranks_per_node
        stages = [[in_node_reduce_scatter(piece, profile)],
                  ring_allreduce(cross_groups(cluster), piece / r, profile, "cross allreduce"),
                  [in_node_allgather(cluster, piece, profile)]]
        n = cluster.nodes
        return Schedule("average", stages, chunks, 2 * (n - 1) / n * nbytes / r)
    return Schedule("average", [ring_allreduce(world(cluster), nbytes, profile)], 1,
                    2 * (p - 1) / p * nbytes if p > 1 else 0.0)


def adasum(cluster: Cluster, nbytes: float, profile: Profile, hierarchical: bool,
           layers: int) -> Schedule:
    """Recursive vector halving over the largest power of two p (others folded in first), one
    allreduce of the level's dot-product table over the whole communicator per level, then the
    halves gathered back in reverse (adasum/rvh.py).  Hierarchical: the tree across nodes on
    each local rank's shard, its dot products also summed over the node."""
    hier = hierarchical and hierarchy_applies(cluster)

    def body(groups, shard):
        n = len(groups[0])
        p = 1 << (n.bit_length() - 1)
        tree = [g[:p] for g in groups]
        steps: List[Step] = []
        if n - p:
            fold = Pattern("fold", tuple((g[i + p], g[i], 1.0) for g in groups
                                         for i in range(n - p)))
            steps.append(Step("fold exchange", fold, shard, profile.cost("adasum", shard), 1))
        levels = p.bit_length() - 1
        table = 3 * 8 * layers
        for level in range(levels):
            d = 1 << level
            piece = shard / (2 * d)
            steps.append(Step(f"level {level + 1} exchange", pair_pattern(tree, d, cluster),
                              piece, profile.cost("adasum", piece), 1))
            steps.extend(ring_allreduce(groups, table * (p // (2 * d)), profile,
                                        f"level {level + 1} dot products"))
            if hier:   # the node's ranks hold the other shards: a small allreduce among them
                steps.append(Step("dot products over the node", compute_s=profile.cost(
                    "message", 2 * (cluster.ranks_per_node - 1))))
        for level in reversed(range(levels)):
            d = 1 << level
            steps.append(Step(f"level {level + 1} gather back", pair_pattern(tree, d, cluster),
                              shard / (2 * d), 0.0, 1))
        if n - p:
            unfold = Pattern("unfold", tuple((g[i], g[i + p], 1.0) for g in groups
                                             for i in range(n - p)))
            steps.append(Step("fold result", unfold, shard, 0.0, 1))
        steps.append(op_work("adasum", profile, shard, layers))
        # each level sends half of what the one before did, there and back
        return steps, 2 * shard * (1 - 1 / p)
    return across_nodes("adasum", cluster, nbytes, profile, hierarchical, body)


def onebit(cluster: Cluster, nbytes: float, profile: Profile, hierarchical: bool,
           layers: int) -> Schedule:
    """The compressed stage (after the warm-up): compress with the worker error, all-to-all of
    1-bit chunks, all-gather of the scales, server average and recompress, all-gather of the
    server chunks and their scales, decompress (onebit/compressed_allreduce.py)."""
    def body(groups, shard):
        n = len(groups[0])
        piece = shard / F32 / 8 / n                   # one bit per element, a chunk per rank
        scales = 4 * layers
        steps = [Step("compress", compute_s=profile.cost("onebit_compress", shard))]
        if n > 1:
            steps.append(Step("all-to-all of signs", alltoall_pattern(cluster, groups), piece,
                              0.0, n - 1))
            steps.extend(ring_allgather(groups, scales, "all-gather of scales"))
            steps.append(Step("server average", compute_s=profile.cost("onebit_decompress", shard)
                              + profile.cost("onebit_compress", shard / n)))
            steps.extend(ring_allgather(groups, piece, "all-gather of server chunks"))
            steps.extend(ring_allgather(groups, scales / n + 4, "all-gather of server scales"))
        steps.append(Step("decompress", compute_s=profile.cost("onebit_decompress", shard)))
        steps.append(op_work("onebit", profile, shard, layers))
        return steps, 2 * (n - 1) * piece
    return across_nodes("onebit", cluster, nbytes, profile, hierarchical, body)


def randomk(cluster: Cluster, nbytes: float, profile: Profile, hierarchical: bool,
            ratio: float, layers: int) -> Schedule:
    """A fraction ``ratio`` of the elements, chosen by a mask every rank draws alike, gathered
    into one buffer, averaged with one allreduce and scattered back."""
    def body(groups, shard):
        n = len(groups[0])
        selected = shard * ratio
        steps = [Step("gather selected", compute_s=profile.cost("randomk_gather", selected)),
                 *ring_allreduce(groups, selected, profile),
                 Step("scatter back", compute_s=profile.cost("randomk_scatter", selected)),
                 op_work("randomk", profile, shard, layers)]
        return steps, 2 * (n - 1) / n * selected
    return across_nodes("randomk", cluster, nbytes, profile, hierarchical, body)


def powersgd(cluster: Cluster, nbytes: float, profile: Profile, hierarchical: bool,
             rank: int, hidden: int, layers: int) -> Schedule:
    """Rank-``rank`` PowerSGD with its matrices taken as ``hidden`` x ``hidden`` blocks: P = M Q,
    an allreduce of the P factors, orthogonalisation and Q = M^T P, an allreduce of the Q
    factors, M = P Q^T (three products of hidden^2 x rank per block).  Hierarchical: each local
    rank takes its share of the layers across nodes."""
    def body(groups, shard):
        n = len(groups[0])
        blocks = max(1.0, shard / F32 / (hidden * hidden))
        factor_bytes = blocks * hidden * rank * F32
        product = profile.flops(blocks * 2 * hidden * hidden * rank)
        steps = [Step("P = M Q", compute_s=product),
                 *ring_allreduce(groups, factor_bytes, profile, "allreduce of P"),
                 Step("orthogonalise P, Q = M^T P",
                      compute_s=product + profile.cost("copy", factor_bytes)),
                 *ring_allreduce(groups, factor_bytes, profile, "allreduce of Q"),
                 Step("M = P Q^T", compute_s=product),
                 op_work("powersgd", profile, shard, layers)]
        return steps, 2 * 2 * (n - 1) / n * factor_bytes
    return across_nodes("powersgd", cluster, nbytes, profile, hierarchical, body)
