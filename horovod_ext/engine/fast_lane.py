"""The steady-state lane of a synchronous allreduce (``hvd.allreduce_`` and ``hvd.allreduce``).

A training loop reduces the same named tensors again and again (``allreduce_``: at the same
addresses).  After such a request has completed once through the general path (negotiated,
cached, executed), the engine keeps a ``CachedAllreduce`` for its name: the cycle message that
announces it by cache id, its layer table, and, in place on MPI, the data call of an elementwise
op prepared by address, so that no torch op runs around the transfer (right after a large
transfer each one is slow: the transfer has evicted the caches).  The next identical call, made
while the engine is idle, sends that message; when every rank sent the same one, the request
runs at once.  Otherwise it joins the general path where the message left it, so mismatches and
stragglers are handled exactly as before.  ``Plans`` keeps an engine's plans, by name.
"""
from typing import Callable, Dict, Optional, Tuple

import torch

from horovod_ext.backends import trace
from horovod_ext.backends.collectives import Collectives
from horovod_ext.ops import Op, reduce_flat
from . import wire
from .fusion import layers_of
from .negotiation import ResponseCache
from .requests import Request, track

Key = Tuple


def key_of(tensor, op: Op, prescale: float, postscale: float, in_place: bool) -> Optional[Key]:
    """What two calls must share for the second to reuse the first's plan (in place: the
    memory too), or None for a call the lane does not take: an op given by name, anything but a
    dense contiguous CPU tensor."""
    if (not isinstance(op, Op) or not isinstance(tensor, torch.Tensor) or not tensor.is_cpu
            or tensor.layout != torch.strided or not tensor.is_contiguous()):
        return None
    address = tensor.data_ptr() if in_place else None
    return (address, tensor.dtype, tensor.shape, op, prescale, postscale)


class CachedAllreduce:
    """One named allreduce of one tensor (in place, or into a copy), ready to run again."""

    __slots__ = ("key", "cid", "entry", "message", "in_place", "_layers", "_comms",
                 "_prepared", "_finish")

    def __init__(self, key: Key, cid: int, entry, message: bytes, name: str,
                 tensor: torch.Tensor, comms: Collectives):
        self.key = key
        self.cid = cid            # its response-cache id, and the entry (compared by identity):
        self.entry = entry        # an evicted or replaced entry ends the plan
        self.message = message    # this request's cycle message: its cache id alone
        address, dtype, _, op, prescale, postscale = key
        self.in_place = address is not None  # otherwise the engine reduces a copy
        self._comms = comms
        self._layers = layers_of([tensor], [name])
        self._finish = op.finish_
        self._prepared: Optional[Callable[[], None]] = None
        flat_elementwise = (self.in_place and op.elementwise
                            and dtype != torch.bool
                            and prescale == postscale == 1.0
                            and comms.reduces_on_world(tensor))
        if flat_elementwise:
            self._prepared = comms.world.prepare_allreduce_by_address(tensor.view(-1),
                                                                      op.reduce_op)

    def run_recorded(self, tensor: torch.Tensor, name: str, round_started: int) -> None:
        """``run``, on the timeline when one is recorded (the round began at perf_counter_ns
        ``round_started``)."""
        tl = trace.recorder
        if tl is None:
            return self.run(tensor)
        tracks = (track("allreduce", name),)
        tl.negotiated_together([(tracks, "allreduce")], self._comms.world.size, round_started)
        with tl.executing(tracks, "STEADY_STATE_ALLREDUCE", None, trace.nbytes_of(tensor)):
            self.run(tensor)

    def run(self, tensor: torch.Tensor) -> None:
        """Reduce ``tensor`` in place, as the engine would (``Executor._run_allreduce``); for a
        plan that is not in place, ``tensor`` is the copy that becomes the result."""
        if self._prepared is not None:
            with trace.transfer(self._comms.world, "ALLREDUCE", tensor):
                self._prepared()
            self._finish(tensor, self._comms.world.size)
            return
        _, _, _, op, prescale, postscale = self.key
        buffer = tensor if tensor.dim() == 1 else tensor.view(-1)
        result = reduce_flat(op, buffer, self._layers, self._comms, prescale, postscale)
        if result.data_ptr() != buffer.data_ptr():
            buffer.copy_(result)


class Plans:
    """One engine's plans, by request name.  A plan lives as long as its response-cache entry:
    the cache is identical on every rank, so every rank's plan for a name sends the same id."""

    def __init__(self, comms: Collectives, cache: ResponseCache):
        self.by_name: Dict[str, CachedAllreduce] = {}
        self._comms = comms
        self._cache = cache

    def usable(self, name: str, key: Key) -> Optional[CachedAllreduce]:
        """The plan for a call of ``name`` with ``key``, while its cache entry stands."""
        plan = self.by_name.get(name)
        if plan is None or plan.key != key or self._cache.by_id.get(plan.cid) is not plan.entry:
            return None
        return plan

    def keep(self, request: Request, tensor: torch.Tensor, capacity: int):
        """After a synchronous allreduce of one tensor: what its next identical call needs."""
        cid = self._cache.by_name.get(request.name)
        if cid is None:
            return
        entry = self._cache.by_id[cid]
        plan = self.by_name.get(request.name)
        if plan is not None and plan.key == request.lane_key and plan.entry is entry:
            return
        if len(self.by_name) >= capacity:
            self.by_name.clear()
        self.by_name[request.name] = CachedAllreduce(
            request.lane_key, cid, entry, wire.encode([cid], [], False, []), request.name,
            tensor, self._comms)
