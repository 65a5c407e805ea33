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


def pipeline_chunk_bytes(nbytes: int, configured: int = 0) -> int:
    """Bytes per chunk of a pipelined hierarchical allreduce of ``nbytes``: ``configured``
    (HOROVOD_HIERARCHICAL_CHUNK_BYTES), or an eighth of the buffer between 1 and 16 MiB (smaller
    chunks overlap more, each costs a few synchronisations)."""
    return configured or min(max(nbytes // 8, 1 << 20), 16 << 20)
