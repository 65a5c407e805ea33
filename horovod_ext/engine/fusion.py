"""Fusion buffers: many tensors packed into one flat buffer that keeps their boundaries.

One persistent buffer per (dtype, device), grown on demand and reused every cycle: fresh large
allocations cost page faults (a 16 MiB clone takes ~3 ms here, as long as the transfer).
"""
from typing import List, Optional, Sequence

import torch

from horovod_ext.backends.scratch import Workspace
from horovod_ext.ops import Layer


def layers_of(tensors: Sequence[torch.Tensor], names: Optional[Sequence[str]] = None) -> List[Layer]:
    layers, offset = [], 0
    for i, t in enumerate(tensors):
        layers.append(Layer(offset, t.numel(), tuple(t.shape), names[i] if names else ""))
        offset += t.numel()
    return layers


class FusionBuffers:
    def __init__(self):
        self._workspace = Workspace()

    def pack(self, tensors: Sequence[torch.Tensor],
             target: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A flat view of the persistent buffer (or of ``target``, a flat tensor of the right
        size and dtype) holding ``tensors`` back to back."""
        first = tensors[0]
        view = target if target is not None else self._workspace.get(
            "fusion", sum(t.numel() for t in tensors), first.dtype, first.device)
        torch.cat([t.detach().reshape(-1) for t in tensors], out=view)
        return view
