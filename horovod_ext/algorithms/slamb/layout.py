"""What a SLAMB step lays out before any bucket starts: each tensor's piece of the step's
random-k mask (Algorithm 1, line 6), and the buckets of parameters that the gradient hooks start
together (see ``slamb.optimizer``)."""
from typing import List, Optional, Sequence

import torch

from .mask import random_k_indices, split_indices
from .sparse import syncs_in_full


def mask_pieces(tensors: Sequence[torch.Tensor], small_tensor_numel: int, ratio: float,
                seed: int, step: int) -> List[Optional[torch.Tensor]]:
    """Per tensor, the selected flat indices (on its device), or None for a tensor synchronised
    in full; one mask is drawn over the concatenation of the masked tensors."""
    full = [syncs_in_full(p.shape, small_tensor_numel) for p in tensors]
    sparse_sizes = [p.numel() for p, f in zip(tensors, full) if not f]
    idx = random_k_indices(sum(sparse_sizes), ratio, seed, step, "SLAMB",
                           tensors[0].device if tensors else None)
    pieces = iter(split_indices(idx, sparse_sizes))
    return [None if f else next(pieces).to(p.device) for p, f in zip(tensors, full)]


def backward_buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> List[List[int]]:
    """Indices of ``tensors`` in buckets of about ``bucket_bytes`` (0: one tensor each), last
    tensor first: backward produces the last layers first."""
    buckets: List[List[int]] = []
    size = bucket_bytes
    for i in reversed(range(len(tensors))):
        if size >= bucket_bytes or not buckets:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += tensors[i].numel() * tensors[i].element_size()
    return buckets
