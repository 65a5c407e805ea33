"""``hvd.RandomK(ratio)``: sparse random-k averaging as a registry op (adapter over ``slamb``).

For every tensor (layer) of the buffer, a fraction ``ratio`` of its elements, drawn from a mask
that every rank generates from (step of that layer, layer name) without sending indices, is
averaged over all ranks; the other elements keep this rank's value (SLAMB's local error
compensation: the unsynchronised part stays local).  1-D tensors and tensors below
``slamb.SMALL_TENSOR_NUMEL`` elements are averaged in full.  All of a buffer's values travel in
one allreduce.  Ranks' results therefore differ outside the mask: a model trained with it
drifts apart per rank until its parameters are averaged (SLAMB does that every H steps).

Hierarchical allreduce (HOROVOD_HIERARCHICAL_ALLREDUCE=1 with several nodes): full average
inside the node (reduce-scatter), the sparse step across nodes on each rank's shard, all-gather
inside the node; the unselected elements then hold the node's average.

State: the step count of each layer name (it seeds the mask), so the op never fuses separate
requests (``fuse_across_requests = False``).
"""
from typing import Dict, List, Optional, Sequence

import torch

from horovod_ext.algorithms.slamb.mask import random_k_indices, slice_indices
from horovod_ext.algorithms.slamb.sparse import (SMALL_TENSOR_NUMEL, Entry, masked_average_,
                                                 syncs_in_full)
from horovod_ext.backends import trace
from horovod_ext.backends.hierarchy import Span

from .base import Layer, Op, layer_overlap
from .registry import configured_op


class RandomKOp(Op):
    floating_point_only = True
    fuse_across_requests = False

    def __init__(self, ratio: float, small_tensor_numel: int = SMALL_TENSOR_NUMEL, seed: int = 0):
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"RandomK ratio must be in (0, 1], got {ratio!r}")
        self.ratio = float(ratio)
        self.small_tensor_numel = small_tensor_numel
        self.seed = seed
        self.name = op_name(self.ratio)
        self.steps: Dict[str, int] = {}      # per layer name: how many times it was reduced
        self.bytes_sent = 0                  # payload bytes this rank put into allreduces


    def allreduce(self, buffer, layers, comms):
        flat = buffer.view(-1)
        if not layers:
            layers = [Layer(0, flat.numel(), tuple(buffer.shape), "")]
        with trace.activity("RANDOMK_MASK"):
            masks = [self._mask(layer, flat.device) for layer in layers]

        def step(part: torch.Tensor, span: Span) -> torch.Tensor:
            self.bytes_sent += masked_average_(self._entries(part, span.offset, layers, masks),
                                               span.comm, span.comm.size)
            return part

        return comms.reduce(buffer, step, node_average=True)

    def _mask(self, layer: Layer, device) -> Optional[torch.Tensor]:
        """Sorted indices of the layer's selected elements, None when it syncs in full."""
        step = self.steps.get(layer.name, 0) + 1
        # Unnamed requests get a fresh name per call ("allreduce.noname.<n>"), which already
        # varies the mask: counting them would only grow this dict without end.
        if ".noname." not in layer.name:
            self.steps[layer.name] = step
        if syncs_in_full(layer.shape, self.small_tensor_numel):
            return None
        return random_k_indices(layer.numel, self.ratio, self.seed, step, layer.name, device)

    @staticmethod
    def _entries(part: torch.Tensor, offset: int, layers: Sequence[Layer],
                 masks: Sequence[Optional[torch.Tensor]]) -> List[Entry]:
        """(view, local indices) of every layer overlapping ``part`` = buffer[offset:...]."""
        entries: List[Entry] = []
        for layer, idx in zip(layers, masks):
            span = layer_overlap(layer, offset, part.numel())
            if span is None:
                continue
            lo, hi = span
            view = part[lo - offset:hi - offset]
            if idx is None:
                entries.append((view, None))
                continue
            entries.append((view, slice_indices(idx, lo - layer.offset, hi - layer.offset)))
        return entries


def op_name(ratio: float) -> str:
    return f"randomk_{float(ratio):g}"


def RandomK(ratio: float) -> RandomKOp:
    """The random-k averaging op for ``ratio`` (the fraction of each large tensor's elements
    averaged per call), registered as ``randomk_<ratio>``; the same object for the same ratio,
    so every rank may call this wherever it needs the op."""
    return configured_op(RandomKOp(ratio))
