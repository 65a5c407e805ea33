"""Fusion: which ready requests run together, and the buffers fused allreduces share.

Allreduces with the same op, dtype, device and scaling share a batch up to
HOROVOD_FUSION_THRESHOLD bytes and are reduced with one op call on one flat buffer; every other
request runs in a batch of its own.  One persistent buffer per (dtype, device), grown on demand
and reused every cycle: fresh large allocations cost page faults, which can take as long as the
transfer itself.
"""
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from horovod_ext.backends.scratch import Workspace
from horovod_ext.ops import Layer, get_op
from .requests import Request, RequestMeta


class Batch(NamedTuple):
    """Requests that run together: one request, or allreduces fused into one buffer."""
    requests: List[Request]
    metas: Dict[int, RequestMeta]   # every rank's description of requests[0] (allgather
                                    # counts, alltoall splits)


def plan_batches(resolved: Sequence[Tuple[Request, Dict[int, RequestMeta]]], threshold: int,
                 max_tensor_bytes: int) -> List[Batch]:
    """The batches of ``resolved`` (each request with every rank's description), in their agreed
    order: an allreduce joins the open batch of its (op, dtype, device, scaling) while that stays
    within ``threshold`` bytes, unless it is ``max_tensor_bytes`` or larger or its op keeps state
    per buffer (``fuse_across_requests``)."""
    batches: List[Batch] = []
    open_batch: Dict[Tuple, Tuple[List[Request], int]] = {}   # key -> (members, bytes)
    for request, metas in resolved:
        if request.kind != "allreduce":
            batches.append(Batch([request], metas))
            continue
        meta = next(iter(metas.values()))
        nbytes = sum(t.numel() * t.element_size() for t in request.tensors)
        key = (request.op, meta.dtype, meta.device, request.prescale, request.postscale)
        fusable = (threshold > 0 and nbytes < max_tensor_bytes
                   and get_op(request.op).fuse_across_requests)
        members, used = open_batch.get(key, (None, 0))
        if fusable and members is not None and used + nbytes <= threshold:
            members.append(request)
            open_batch[key] = (members, used + nbytes)
            continue
        members = [request]
        batches.append(Batch(members, metas))
        if fusable:
            open_batch[key] = (members, nbytes)
    return batches


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
