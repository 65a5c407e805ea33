"""Reusable scratch tensors, shared by every algorithm that needs work space per call.

Fresh large allocations are fresh pages here (~0.25 ms per MiB of page faults), which costs
more than the arithmetic done in them; a ``Workspace`` keeps one tensor per (name, dtype,
device), grows it on demand and hands out views of it.  A view is valid until the next ``get``
of the same name.
"""
from typing import Dict, Tuple

import torch


class Workspace:
    def __init__(self):
        self._tensors: Dict[Tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        # Bumped whenever a tensor is replaced: callers that kept addresses of earlier views
        # know they must ask again.
        self.generation = 0

    def get(self, name: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements (uninitialised) kept under ``name``."""
        # torch.device() costs microseconds: keep the given device unless it is a string
        key = (name, dtype, device if isinstance(device, torch.device) else torch.device(device))
        t = self._tensors.get(key)
        if t is None or t.numel() < numel:
            t = self._tensors[key] = torch.empty(numel, dtype=dtype, device=device)
            self.generation += 1
        return t[:numel]
