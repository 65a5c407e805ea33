"""Fusion buffers: many tensors packed into one flat buffer that keeps their boundaries.

One persistent buffer per (dtype, device), grown on demand and reused every cycle: fresh large
allocations cost page faults (a 16 MiB clone takes ~3 ms here, as long as the transfer).
"""
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .ops import Layer


def layers_of(tensors: Sequence[torch.Tensor], names: Optional[Sequence[str]] = None) -> List[Layer]:
    layers, offset = [], 0
    for i, t in enumerate(tensors):
        layers.append(Layer(offset, t.numel(), tuple(t.shape), names[i] if names else ""))
        offset += t.numel()
    return layers


class FusionBuffers:
    def __init__(self):
        self._buffers: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def pack(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """A flat view of the persistent buffer holding ``tensors`` back to back."""
        first = tensors[0]
        total = sum(t.numel() for t in tensors)
        key = (first.dtype, first.device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < total:
            buf = torch.empty(total, dtype=first.dtype, device=first.device)
            self._buffers[key] = buf
        view = buf[:total]
        torch.cat([t.detach().reshape(-1) for t in tensors], out=view)
        return view
