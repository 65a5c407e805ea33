"""Execution: running negotiated batches, one runner per request kind, and finishing handles.

Allreduces go through their op (``ops.reduce_flat``) on one flat buffer: the caller's own tensor
in place where possible, a fusion buffer for several tensors.  An elementwise one in place (a
gradient bucket) is started and left running where the transport can (Gloo at three ranks or
more, one call of the world communicator): the engine negotiates and starts the next meanwhile,
so that a model's buckets share the wire as DDP's do, and its handle finishes when it ends.
Every other kind is one call on the set's communicators.  An op or a runner that raises on one
rank of several leaves its peers waiting in the middle of a collective, with the transport in an
unknown state: the error propagates and stops the engine, whose peers learn of it at once
(faults.py).  Alone, a rank fails only the requests concerned.
"""
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from horovod_ext.backends import trace
from horovod_ext.backends.base import CommunicationError, RefusedOnEveryRank, split_sizes
from horovod_ext.backends.collectives import Collectives
from horovod_ext.ops import Op, get_op, reduce_flat, scale_
from .fusion import Batch, FusionBuffers, layers_of
from .requests import Handle, HorovodInternalError, Request, RequestMeta, track

Metas = Dict[int, RequestMeta]


def _names(members: List[Request]) -> str:
    names = [f"'{r.name}'" for r in members]
    return names[0] if len(names) == 1 else f"{len(names)} fused requests ({', '.join(names)})"


def zeros_request(name: str, meta: RequestMeta, handle: Handle,
                  join: Optional[Request]) -> Request:
    """The part of a rank that has joined in a request it did not submit: zeros of the agreed
    shapes and dtype, so an allreduce counts it as contributing nothing.  CUDA zeros go to the
    device that this rank's ``join`` request names: join() finds it in the caller's thread
    (the current device is per thread, and this is the engine's)."""
    dev = "cpu"
    if meta.device == "cuda":
        dev = (join.tensors[0].device if join is not None and join.tensors
               else torch.device("cuda", torch.cuda.current_device()))
    tensors = [torch.zeros(s, dtype=getattr(torch, meta.dtype), device=dev)
               for s in meta.shapes]
    r = Request(name, meta.kind, tensors, op=meta.op, root=meta.root, splits=meta.splits,
                prescale=meta.prescale, postscale=meta.postscale, handle=handle)
    r.meta = meta
    return r


class Executor:
    """Runs one engine's batches over its communicators ``comms``; ``keep_plan(request,
    tensor)`` is told of each lone synchronous allreduce that may recur (fast_lane.py)."""

    def __init__(self, comms: Collectives, stats: Dict[str, int],
                 keep_plan: Callable[[Request, torch.Tensor], None],
                 on_failure: Callable[[BaseException], Optional[BaseException]] = lambda e: None):
        self.comms = comms
        self.rank = comms.world.rank
        self.size = comms.world.size
        self.stats = stats
        self._keep_plan = keep_plan
        # a transfer left running failed: stop the engine; returns the failure that stopped it
        self._on_failure = on_failure
        self._ended = threading.Condition()
        self._in_flight: Dict[int, Request] = {}   # id -> request whose transfer runs on
        stats.setdefault("left_running", 0)
        self._fusion = FusionBuffers()
        self._runners: Dict[str, Callable[[Request, Metas], object]] = {
            "allgather": self._allgather, "broadcast": self._broadcast,
            "alltoall": self._alltoall, "reducescatter": self._reducescatter,
            "barrier": self._barrier, "custom": self._custom}

    def run(self, batches: Sequence[Batch]):
        tl = trace.recorder
        negotiated = time.perf_counter_ns() if tl is not None else None
        for batch in batches:
            if tl is not None:
                with self._marked(tl, batch, negotiated):
                    self._run_batch(batch)
            else:
                self._run_batch(batch)

    def _run_batch(self, batch: Batch):
        first = batch.requests[0]
        if first.kind == "allreduce":
            self._run_allreduce(batch.requests)
        else:
            self._run_single(first, batch.metas)

    @staticmethod
    def _marked(tl, batch: Batch, since: int):
        """The timeline's record of one batch: its tensors' tracks, named after the operation
        (ALLREDUCE for the elementwise ops, the op's own name otherwise: ADASUM...)."""
        members = batch.requests
        first = members[0]
        if first.kind == "allreduce":
            name = get_op(first.op).timeline_name
        else:
            name = first.kind.upper()
        tracks = [track(r.kind, n) for r in members for n in r.tensor_names()]
        nbytes = sum(trace.nbytes_of(t) for r in members for t in r.tensors)
        return tl.executing(tracks, name, since, nbytes)

    # --- allreduce ----------------------------------------------------------------------------
    def _run_allreduce(self, members: List[Request]):
        first = members[0]
        op = get_op(first.op)
        tensors = [t for r in members for t in r.tensors]
        layers = layers_of(tensors, [n for r in members for n in r.tensor_names()])
        alone = len(tensors) == 1
        target = first.outputs[0] if first.outputs and alone else None
        buffer = self._input_buffer(op, tensors, target)
        if self._started(op, members, buffer, target):
            return
        try:
            buffer = reduce_flat(op, buffer, layers, self.comms, first.prescale, first.postscale)
        except CommunicationError:
            raise
        except Exception as exc:
            self._fail(members, HorovodInternalError(
                f"allreduce of {_names(members)} failed: {exc}"), exc)
            return
        if first.lane_key is not None and len(members) == 1 and alone:
            self._keep_plan(first, tensors[0])
        if target is not None and buffer.data_ptr() == target.data_ptr():
            # The usual in-place call: the result is already where it belongs.  (Slicing is
            # slow right after a large transfer has evicted the caches.)
            first.handle._finish([target])
            return
        with trace.activity("MEMCPY_OUT_FUSION_BUFFER", trace.nbytes_of(buffer)):
            self._unpack(members, buffer, alone)

    def _started(self, op: Op, members: List[Request], buffer: torch.Tensor, target) -> bool:
        """An elementwise allreduce in place on the caller's tensor (a gradient bucket) is
        started and left running where the transport can: the engine negotiates and starts
        the next one meanwhile, and the handle finishes when the transfer ends."""
        first = members[0]   # the only one: ``target`` is set for a request of one tensor
        if (target is None or not op.elementwise or first.lane_key
                or buffer.data_ptr() != target.data_ptr()
                or (first.prescale, first.postscale) != (1.0, 1.0)):
            return False
        with self._ended:
            self._in_flight[id(first)] = first

        def done(error):
            if error is not None:
                # the engine stops and fails this request with the rest, while it is still in
                # flight: with a peer's report naming the cause, when one comes within a grace
                failure = self._on_failure(error)
            with self._ended:
                self._in_flight.pop(id(first), None)
                self._ended.notify_all()
            if error is not None:
                first.handle._finish(error=failure or HorovodInternalError(
                    f"allreduce of '{first.name}' failed: {error}"))
                return
            op.finish_(buffer, self.size)
            first.handle._finish([target])

        started = False
        try:
            started = self.comms.allreduce_started(buffer, op.reduce_op, done)
            self.stats["left_running"] += started
        finally:
            if not started:
                with self._ended:
                    self._in_flight.pop(id(first), None)
        return started

    def in_flight(self) -> List[Request]:
        """Requests whose transfer was started and runs on."""
        with self._ended:
            return list(self._in_flight.values())

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the transfers left running to end (each ends or
        fails within the transport's own timeout); True when none is left."""
        with self._ended:
            return self._ended.wait_for(lambda: not self._in_flight, timeout)

    def _input_buffer(self, op: Op, tensors: List[torch.Tensor], target) -> torch.Tensor:
        """The flat buffer the op reduces: ``target`` (the caller's tensor) itself when the
        request reduces in place, otherwise a copy, or the fusion buffer for several tensors."""
        if target is not None and target.is_contiguous():
            # In place on the caller's tensor (its detached alias): no copies.
            return tensors[0] if tensors[0].dim() == 1 else tensors[0].view(-1)
        if len(tensors) == 1:
            with trace.activity("MEMCPY_IN_FUSION_BUFFER", trace.nbytes_of(tensors[0])):
                return tensors[0].detach().reshape(-1).clone()  # becomes the result itself
        # An elementwise op's fused buffer goes straight into shared memory when the in-node
        # steps run there, and so does the buffer of an op that reads whole vectors there.
        slot = None
        if (op.elementwise or op.reads_whole_vectors_in_node) and tensors[0].is_cpu:
            slot = self.comms.pack_target(sum(t.numel() for t in tensors), tensors[0].dtype,
                                          whole_vectors=not op.elementwise)
        with trace.activity("MEMCPY_IN_FUSION_BUFFER", sum(trace.nbytes_of(t) for t in tensors)):
            buffer = self._fusion.pack(tensors, slot)
        self.stats["fused_buffers"] += 1
        return buffer

    @staticmethod
    def _unpack(members: List[Request], buffer: torch.Tensor, alone: bool):
        """Hand each request its part of the reduced ``buffer``."""
        position = 0
        for r in members:
            results = []
            targets = r.outputs or [None] * len(r.tensors)
            for t, target in zip(r.tensors, targets):
                chunk = buffer[position:position + t.numel()].view(t.shape)
                position += t.numel()
                if target is not None:
                    if target.data_ptr() != chunk.data_ptr():
                        target.copy_(chunk)
                    results.append(target)
                else:  # a fusion buffer is reused next cycle: hand out copies of it
                    results.append(chunk if alone else chunk.clone())
            r.handle._finish(results)

    def _fail(self, members: List[Request], error: HorovodInternalError, cause: Exception):
        """An op or runner raised: with peers, which may wait mid-collective, the engine stops
        (raised); alone, or refused alike on every rank before any data moved, only ``members``
        fail."""
        if self.size > 1 and not (isinstance(cause, RefusedOnEveryRank) and cause.whole_job):
            raise error from cause
        for r in members:
            r.handle._finish(error=error)

    # --- every other kind ---------------------------------------------------------------------
    def _run_single(self, r: Request, metas: Metas):
        try:
            runner = self._runners.get(r.kind)
            if runner is None:
                raise ValueError(f"unknown request kind {r.kind}")
            result = runner(r, metas)
        except CommunicationError:
            raise
        except Exception as exc:
            self._fail([r], HorovodInternalError(f"{r.kind} of '{r.name}' failed: {exc}"), exc)
            return
        r.handle._finish([result])

    def _allgather(self, r: Request, metas: Metas):
        counts = [metas[k].shapes[0][0] if metas[k].shapes[0] else 1 for k in range(self.size)]
        return self.comms.allgather(r.tensors[0], counts)

    def _broadcast(self, r: Request, metas: Metas):
        world = self.comms.world
        t = r.outputs[0] if r.outputs else r.tensors[0].clone()
        with trace.transfer(world, "BROADCAST", t):
            world.broadcast(t, r.root)
        return t

    def _alltoall(self, r: Request, metas: Metas):
        world = self.comms.world
        recv = [metas[k].splits[self.rank] for k in range(self.size)]
        with trace.transfer(world, "ALLTOALL", r.tensors[0]):
            return (world.alltoall(r.tensors[0], list(r.splits), recv),
                    torch.tensor(recv, dtype=torch.int32))

    def _reducescatter(self, r: Request, metas: Metas):
        t = r.tensors[0]
        rows = split_sizes(t.shape[0], self.size)
        row = t[0].numel() if t.shape[0] else 0
        buffer = t.detach().reshape(-1)
        if r.prescale != 1.0:
            buffer = scale_(buffer.clone(), r.prescale)
        op = get_op(r.op)
        reduce_op = op.reduce_op
        if reduce_op is None:
            raise ValueError(f"reducescatter supports Sum, Average, Min, Max and Product, "
                             f"not {r.op}")
        with trace.transfer(self.comms.world, "REDUCESCATTER", buffer):
            out = self.comms.world.reduce_scatter(buffer, [n * row for n in rows], reduce_op)
        op.finish_(out, self.size)
        scale_(out, r.postscale)
        return out.view((rows[self.rank],) + tuple(t.shape[1:]))

    @staticmethod
    def _barrier(r: Request, metas: Metas):
        return None

    def _custom(self, r: Request, metas: Metas):
        if r.fn is None:
            raise ValueError("a rank that has joined cannot take part in a custom "
                             "collective (an optimizer's own communication)")
        return r.fn(self.comms.topology)
