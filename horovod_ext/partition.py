"""Cutting an ordered list of tensors into consecutive parts of about equal size (DiLoCo's
fragments; the layers each rank of a node takes in PowerSGD's hierarchical form)."""
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
