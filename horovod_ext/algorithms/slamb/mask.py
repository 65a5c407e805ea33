"""The random-k mask that every rank draws identically, so that only values travel.

The mask M_t of SLAMB (Algorithm 1, line 6) has [M_t]_j ~ Bernoulli(k) independently.  Every rank
seeds a ``torch.Generator`` from (seed, step, key) and draws the same mask; no index is sent.

Drawing ``torch.rand(n) < k`` costs n random numbers and a pass over n elements per step.  We draw
the same Bernoulli(k) process from its gaps instead: the distance between consecutive selected
positions is 1 + Geometric(k), and a geometric variable is ``floor(log(U) / log(1 - k))``, so
about k*n random numbers give the sorted selected indices directly, which is faster than
``rand < k`` (and than ``randperm``), the more so the smaller k.
Sorted indices also make splitting the mask into per-tensor pieces a ``searchsorted``.
"""
import hashlib
import math
from typing import List, Sequence

import torch


def mask_seed(seed: int, step: int, key: str) -> int:
    """A 63-bit generator seed from (seed, step, key), the same in every process (Python's
    ``hash`` of a string is randomised per process, so it cannot be used)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def random_k_indices(n: int, ratio: float, seed: int, step: int, key: str,
                     device=None) -> torch.Tensor:
    """Sorted int64 indices of the selected elements of an ``n``-element mask with density
    ``ratio`` (each element independently with probability ``ratio``), identical on every rank
    that passes the same (seed, step, key) and device type."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"random-k ratio must be in (0, 1], got {ratio!r}")
    device = torch.device(device or "cpu")
    if ratio >= 1.0 or n == 0:
        return torch.arange(n, dtype=torch.int64, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(mask_seed(seed, step, key))
    log_q = math.log1p(-ratio)
    expected = n * ratio
    # Enough gaps to pass n with overwhelming probability; draw more in the rare other case.
    chunk = int(expected + 8.0 * math.sqrt(expected * (1.0 - ratio)) + 16)
    pieces: List[torch.Tensor] = []
    last = -1
    while last < n - 1:
        u = 1.0 - torch.rand(chunk, generator=gen, device=device)     # in (0, 1]
        gaps = torch.floor(torch.log(u) / log_q).to(torch.int64) + 1
        idx = gaps.cumsum_(0).add_(last)
        pieces.append(idx)
        last = int(idx[-1])
    idx = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    return idx[:int(torch.searchsorted(idx, n))]


def split_indices(idx: torch.Tensor, sizes: Sequence[int]) -> List[torch.Tensor]:
    """Cut sorted flat indices over consecutive segments of ``sizes`` elements into per-segment
    local indices."""
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    cuts = torch.searchsorted(idx, torch.tensor(bounds, dtype=idx.dtype, device=idx.device))
    cuts = cuts.tolist()
    return [idx[cuts[i]:cuts[i + 1]] - bounds[i] for i in range(len(sizes))]


def slice_indices(idx: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The sorted indices that fall in [start, stop), made relative to ``start``."""
    lo, hi = torch.searchsorted(idx, torch.tensor([start, stop], dtype=idx.dtype,
                                                  device=idx.device)).tolist()
    return idx[lo:hi] - start
