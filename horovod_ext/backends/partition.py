"""Cutting an ordered list of tensors into consecutive parts of about equal size (DiLoCo's
fragments; the layers each rank of a node takes in PowerSGD's hierarchical form), and a buffer
into the chunks that the hierarchical allreduce pipelines (also priced by the scale model)."""
from typing import List, Sequence


def balanced_parts(sizes: Sequence[int], parts: int) -> List[List[int]]:
    """The indices of ``sizes`` cut into ``parts`` consecutive groups of about equal total;
    none empty where there are at least ``parts`` items."""
    total = max(1, sum(sizes))
    groups: List[List[int]] = [[] for _ in range(parts)]
    seen, previous = 0, -1
    for i, size in enumerate(sizes):
        wanted = int(parts * (seen + size / 2) / total)      # where the item's middle falls
        at = max(previous, min(wanted, previous + 1))         # in order, no group skipped
        at = min(max(at, parts - (len(sizes) - i)), parts - 1)  # one left for each later group
        groups[at].append(i)
        seen, previous = seen + size, at
    return groups


#: Least bytes per rank in one step of a chunk's cross-node ring: below it a ring step costs
#: more in per-message software time (CPU Gloo's, the profile's ``message_s``) than in transfer
#: at 10 Gbit/s.
MIN_RING_PIECE = 64 << 10


def pipeline_chunk_bytes(nbytes: int, configured: int = 0, ranks: int = 1) -> int:
    """Bytes per chunk of a pipelined hierarchical allreduce of ``nbytes`` over ``ranks`` ranks:
    ``configured`` (HOROVOD_HIERARCHICAL_CHUNK_BYTES), or an eighth of the buffer between 1 and
    16 MiB (smaller chunks overlap more, each costs a few synchronisations), but not so small
    that a ring step across nodes carries less than MIN_RING_PIECE per rank (a chunk's shard
    is cut into a piece per node, and there are ``ranks`` pieces in all): on many nodes the
    chunks grow, to the whole buffer, instead of paying 2 (nodes - 1) messages each."""
    if configured:
        return configured
    return max(min(max(nbytes // 8, 1 << 20), 16 << 20), MIN_RING_PIECE * ranks)
