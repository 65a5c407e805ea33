"""The background engine: named requests, negotiation each cycle, fusion, execution.

As in Horovod, API calls only enqueue a request and return a handle.  A background thread runs
cycles; in each cycle every rank sends what it has newly submitted (a cache id for a request seen
before with the same shape, its full description otherwise) over the control plane, so every rank
holds the same table of who submitted what.  A name becomes ready when every (non-joined) rank has
submitted it; ready requests are checked for agreement (kind, op, dtype, shape, root, scaling),
packed into fusion buffers up to HOROVOD_FUSION_THRESHOLD bytes and reduced with one op call per
buffer.  Ranks may submit in different orders.  Disagreements fail on every rank with an error
naming the tensor and the ranks; a name left unmatched at shutdown fails the same way; a peer
that dies or goes silent fails every pending request within the communication timeout.

Cycle timing: with requests waiting, a rank runs a cycle every HOROVOD_CYCLE_TIME ms so that
tensors submitted close together are fused; a request submitted while the rank was idle, or one
that a caller is blocked on, starts a cycle at once, which keeps a lone synchronous call's latency
near one network round trip.  Requests submitted with ``wake=NEXT_CYCLE`` (gradients from
backward hooks) start a cycle one cycle time after the first of them arrives: later gradients
of the same backward pass join it, and the reductions overlap the rest of the backward pass.
Idle ranks cycle every ``IDLE_CYCLE_S`` to serve their peers.
"""
import logging
import pickle
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from horovod_ext.backends import trace
from horovod_ext.backends.base import CommunicationError, split_sizes
from horovod_ext.backends.control import ControlChannel
from horovod_ext.backends.collectives import Collectives
from horovod_ext.config import Config
from .fast_lane import CachedAllreduce
from .fusion import FusionBuffers, layers_of
from horovod_ext.ops import get_op, reduce_flat, scale_

log = logging.getLogger("horovod_ext")

IDLE_CYCLE_S = 0.01
NEXT_CYCLE = "next_cycle"   # submit(wake=...): run within one cycle time, batched with others
JOIN_NAME = "__horovod_ext_join__"


# A cycle's message: flags, the number of cache ids, the ids, then (announcements, aborts)
# pickled when there are any.  Binary, since the steady state (cache ids only) recurs every step.
_MESSAGE = struct.Struct("<BI")
_SHUTDOWN_FLAG, _EXTRA_FLAG = 1, 2


def _encode(cache_ids: List[int], announce: List, shutdown: bool, aborts: List[str]) -> bytes:
    extra = bool(announce or aborts)
    flags = (_SHUTDOWN_FLAG if shutdown else 0) | (_EXTRA_FLAG if extra else 0)
    message = _MESSAGE.pack(flags, len(cache_ids)) + struct.pack(f"<{len(cache_ids)}i", *cache_ids)
    if extra:
        message += pickle.dumps((announce, aborts), protocol=pickle.HIGHEST_PROTOCOL)
    return message


def _decode(message: bytes) -> Tuple[Tuple[int, ...], List, bool, List[str]]:
    flags, count = _MESSAGE.unpack_from(message)
    ids = struct.unpack_from(f"<{count}i", message, _MESSAGE.size)
    announce, aborts = [], []
    if flags & _EXTRA_FLAG:
        announce, aborts = pickle.loads(message[_MESSAGE.size + 4 * count:])
    return ids, announce, bool(flags & _SHUTDOWN_FLAG), aborts


def _track(kind: str, name: str) -> str:
    """A tensor's track on the timeline, named as Horovod names it: ``allreduce.<name>``."""
    return name if name.startswith(kind + ".") else f"{kind}.{name}"


def _tracks(name: str, meta: Tuple) -> Tuple[str, ...]:
    """The tracks of a request's tensors (``Request.tensor_names``) from its description."""
    kind, count = meta[0], len(meta[4])
    if count == 1:
        return (_track(kind, name),)
    return tuple(_track(kind, f"{name}.{i}") for i in range(count))


class HorovodInternalError(RuntimeError):
    """A collective could not complete (mismatch across ranks, dead peer, shutdown)."""


class Handle:
    """What an async call returns; pass it to synchronize() or poll()."""

    __slots__ = ("name", "post", "_done", "_event", "_result", "_error", "_engine")

    def __init__(self, name: str, engine: "Engine"):
        self.name = name
        self.post = None  # the API's finishing touch on the raw result (unwrap, decompress)
        self._done = False
        # Made only for a thread that must sleep until another one finishes the request (most
        # synchronous calls finish on their own thread and never need one).
        self._event: Optional[threading.Event] = None
        self._result = None
        self._error: Optional[BaseException] = None
        self._engine = engine

    def done(self) -> bool:
        return self._done

    def _finish(self, result=None, error=None):
        self._result, self._error = result, error
        self._done = True
        event = self._event   # read after _done is set: see _sleep_until_done
        if event is not None:
            event.set()

    def _sleep_until_done(self, lock):
        with lock:
            if self._event is None:
                self._event = threading.Event()
        if self._done:  # finished before the event existed: _finish may not have seen it
            return
        self._event.wait()

    def wait(self):
        if not self._done:
            self._engine.wait_for(self)
        if self._error is not None:
            raise self._error
        return self.post(self._result) if self.post is not None else self._result


@dataclass
class Request:
    name: str
    kind: str                       # allreduce allgather broadcast alltoall reducescatter barrier join
    tensors: List[torch.Tensor]     # inputs
    outputs: Optional[List[torch.Tensor]] = None   # in-place targets (allreduce_, broadcast_)
    op: str = "sum"
    root: int = 0
    splits: Optional[Tuple[int, ...]] = None
    prescale: float = 1.0
    postscale: float = 1.0
    handle: Optional[Handle] = None
    meta: Tuple = field(default=())
    fn: Optional[Callable] = None   # kind "custom": fn(topology) runs on the engine thread
    lane_key: Optional[Tuple] = None  # a synchronous allreduce that may recur (fast_lane.py)

    def tensor_names(self) -> List[str]:
        if len(self.tensors) == 1:
            return [self.name]
        return [f"{self.name}.{i}" for i in range(len(self.tensors))]

    def describe(self) -> Tuple:
        t = self.tensors[0] if self.tensors else None
        dtype = _dtype_name(t.dtype) if t is not None else ""
        device = "cpu" if t is None or t.is_cpu else t.device.type
        shapes = tuple(tuple(x.shape) for x in self.tensors)
        return (self.kind, self.op, dtype, device, shapes, self.root, self.splits,
                self.prescale, self.postscale)


_DTYPE_NAMES: Dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


_META_FIELDS = ("kind", "op", "dtype", "device", "shape", "root rank", "splits",
                "prescale_factor", "postscale_factor")


def _agreement_key(meta: Tuple) -> Tuple:
    """The parts of a request that must be equal on every rank."""
    kind, op, dtype, device, shapes, root, splits, pre, post = meta
    if kind in ("allgather", "alltoall"):  # first dimensions and splits may differ
        shapes = tuple(s[1:] for s in shapes)
        splits = None
    return (kind, op, dtype, device, shapes, root, splits, pre, post)


def _mismatch_message(name: str, metas: Dict[int, Tuple]) -> Optional[str]:
    keys = {r: _agreement_key(m) for r, m in metas.items()}
    first = next(iter(keys.values()))
    if all(k == first for k in keys.values()):
        return None
    for i, label in enumerate(_META_FIELDS):
        values: Dict[Any, List[int]] = {}
        for r, k in sorted(keys.items()):
            values.setdefault(repr(k[i]), []).append(r)
        if len(values) > 1:
            detail = "; ".join(f"ranks {rs}: {v}" for v, rs in values.items())
            return f"mismatched {label} for tensor '{name}' across ranks ({detail})"
    return f"mismatched requests for tensor '{name}'"


class _ResponseCache:
    """Requests that recur with the same descriptions get a small integer id on every rank."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.by_id: Dict[int, Tuple[str, Dict[int, Tuple]]] = {}
        self.by_name: Dict[str, int] = {}
        self._next = 0

    def lookup(self, name: str, rank: int, meta: Tuple) -> Optional[int]:
        cid = self.by_name.get(name)
        if cid is not None and self.by_id[cid][1].get(rank) == meta:
            return cid
        return None

    def add(self, name: str, metas: Dict[int, Tuple]):
        if name in self.by_name or len(self.by_id) >= self.capacity:
            return
        self.by_id[self._next] = (name, dict(metas))
        self.by_name[name] = self._next
        self._next += 1

    def evict(self, name: str):
        cid = self.by_name.pop(name, None)
        if cid is not None:
            del self.by_id[cid]


class Engine:
    def __init__(self, comms: Collectives, control: ControlChannel, config: Config):
        self.comms = comms
        self.control = control
        self.config = config
        self.rank = comms.world.rank
        self.size = comms.world.size
        self._cond = threading.Condition()
        self._new: List[Request] = []                 # submitted, not yet announced
        self._local: Dict[str, Request] = {}           # announced, waiting to be executed
        self._waiters = 0
        self._shutdown_requested = False
        self._stopped = False
        self._fatal: Optional[BaseException] = None
        # Replicated on every rank, updated identically from the gathered messages:
        self._pending: "OrderedDict[str, Dict[int, Tuple]]" = OrderedDict()
        self._first_seen: Dict[str, float] = {}
        self._warned: Dict[str, float] = {}
        self._joined: List[int] = []
        self._cache = _ResponseCache(config.cache_capacity)
        self._abort_next: List[str] = []
        self._last_round_active = False
        self.shutdown_errors: List[str] = []   # names left unmatched, reported by shutdown()
        self.stats = {"cycles": 0, "cache_hits": 0, "announced": 0, "fused_buffers": 0,
                      "fast_lane": 0}
        self._plans: Dict[str, CachedAllreduce] = {}   # by name: see fast_lane.py
        self._running: List[Request] = []     # taken out of _local for this round's execution
        self._fusion = FusionBuffers()
        self._cycle_lock = threading.Lock()   # held by whichever thread runs a cycle
        self._caller_cycle = False            # a blocked caller is running a cycle
        self._event_lock = threading.Lock()   # makes the handles' events
        self._cycle_s = config.cycle_time_ms / 1000.0
        self._last_end = 0.0
        self._round_started = 0  # perf_counter_ns at the start of the round (timeline)
        self._not_before = 0.0   # NEXT_CYCLE requests: no cycle before this (monotonic s)
        self._thread = threading.Thread(target=self._run, name="horovod_ext-engine", daemon=True)
        self._thread.start()

    # --- called from user threads -------------------------------------------------------------
    def submit(self, request: Request, wake=True) -> Handle:
        """Queue ``request``.  ``wake=False`` when the caller synchronizes at once: it will run
        the first cycle itself, and waking the background thread would only contend with it.
        ``wake=NEXT_CYCLE``: the background thread runs it one cycle time after the first such
        request reaching an idle rank, with whatever else arrived meanwhile."""
        request.handle = Handle(request.name, self)
        request.meta = request.describe()
        with self._cond:
            if self._fatal is not None:
                raise HorovodInternalError(str(self._fatal)) from self._fatal
            if self._stopped or self._shutdown_requested:
                raise HorovodInternalError("horovod_ext has been shut down; call hvd.init() again")
            if request.name in self._local or any(r.name == request.name for r in self._new):
                raise ValueError(f"a request named '{request.name}' is already in flight on rank "
                                 f"{self.rank}; names must be unique until they complete")
            was_idle = not self._new and not self._local
            self._new.append(request)
            if was_idle and wake == NEXT_CYCLE:
                self._not_before = time.monotonic() + self._cycle_s
                self._cond.notify()
            elif was_idle and wake:
                self._cond.notify()
        if self.size == 1:  # nothing to negotiate: complete it now, on the caller's thread
            with self._cycle_lock:
                if not self._stopped:
                    self._locked_cycle()
        return request.handle

    def wait_for(self, handle: Handle):
        if not handle.done() and self._cycle_lock.acquire(blocking=False):
            # A caller blocked on a fresh request runs that request's first cycle itself:
            # two thread hand-offs (~100 us here) less on every synchronous call.  Meanwhile
            # the background thread stays asleep (a cycle longer than the cycle time would
            # otherwise wake it to queue on the lock and contend for the interpreter).
            try:
                with self._cond:
                    fresh = (bool(self._new) and not self._stopped
                             and not self._shutdown_requested)
                    self._caller_cycle = fresh
                if fresh and not handle.done():
                    self._locked_cycle(caller_blocked=True)
            finally:
                with self._cond:
                    self._caller_cycle = False
                    if self._new or self._local:
                        self._cond.notify()
                self._cycle_lock.release()
        if handle.done():
            return
        with self._cond:
            self._waiters += 1
            self._cond.notify()
        try:
            handle._sleep_until_done(self._event_lock)
        finally:
            with self._cond:
                self._waiters -= 1

    def allreduce_cached(self, name: str, key: Tuple, tensor: torch.Tensor,
                         make_request: Callable[[], Request]):
        """The steady-state lane of a synchronous allreduce (fast_lane.py): in place when the
        key holds an address, into a new tensor otherwise.  Returns the reduced tensor; None
        when nothing was sent (take the general path); a Handle when the request went out but
        must finish on the general path (another rank sent something else): wait for it.
        ``make_request()`` builds the general request."""
        plan = self._plans.get(name)
        if plan is None or plan.key != key or self._cache.by_id.get(plan.cid) is not plan.entry:
            return None
        if not self._cycle_lock.acquire(blocking=False):
            return None
        try:
            # Only the thread holding _cycle_lock changes these, except _new (a list read is
            # atomic; a request submitted right after this check waits for the next cycle).
            if (self._new or self._local or self._pending or self._joined or self._abort_next
                    or self._stopped or self._shutdown_requested):
                return None
            tl = trace.recorder
            if tl is not None:
                self._round_started = time.perf_counter_ns()
            try:
                messages = self.control.agree(plan.message, True)
            except BaseException as exc:  # noqa: B902 - as a failed cycle: stops the engine
                self._fail_everything(exc)
                raise self._fatal from exc
            self.stats["cycles"] += 1
            self.stats["cache_hits"] += 1
            if messages is None:  # every rank sent this cached request alone: run it
                self._last_round_active = True
                self.stats["fast_lane"] += 1
                if not plan.in_place:
                    tensor = tensor.detach().clone()
                try:
                    if tl is None:
                        plan.run(tensor)
                    else:
                        track = (_track("allreduce", name),)
                        tl.negotiated_together([(track, "allreduce")], self.size,
                                               self._round_started)
                        with tl.executing(track, "STEADY_STATE_ALLREDUCE", None,
                                          trace.nbytes_of(tensor)):
                            plan.run(tensor)
                except CommunicationError as exc:
                    self._fail_everything(exc)
                    raise self._fatal from exc
                except Exception as exc:  # the op failed on this request: fail it, keep running
                    raise HorovodInternalError(f"allreduce of '{name}' failed: {exc}") from exc
                return tensor
            # Some rank sent something else: the request is announced (by its cache id) and
            # continues on the general path from this round's messages.
            request = make_request()
            request.handle = Handle(name, self)
            request.meta = request.describe()
            with self._cond:
                self._local[name] = request
            self._run_round(lambda: self._after_round(plan.message, messages, [plan.cid]))
            return request.handle
        finally:
            self._last_end = time.monotonic()
            self._cycle_lock.release()

    def _keep_plan(self, request: Request, tensor: torch.Tensor):
        """After a synchronous allreduce of one tensor: what its next identical call needs."""
        cid = self._cache.by_name.get(request.name)
        if cid is None:
            return
        entry = self._cache.by_id[cid]
        plan = self._plans.get(request.name)
        if plan is not None and plan.key == request.lane_key and plan.entry is entry:
            return
        if len(self._plans) >= self.config.cache_capacity:
            self._plans.clear()
        self._plans[request.name] = CachedAllreduce(
            request.lane_key, cid, entry, _encode([cid], [], False, []), request.name, tensor,
            self.comms)

    def reconfigure(self, config: Config):
        """Take ``config``'s fusion threshold, cycle time and cache capacity from now on.
        Called on the engine thread (a custom request), at the same point of the same round on
        every rank, so the ranks' response caches stay identical."""
        self.config = config
        self._cycle_s = config.cycle_time_ms / 1000.0
        self._cache.capacity = config.cache_capacity
        if config.cache_capacity == 0:
            self._cache.by_id.clear()
            self._cache.by_name.clear()
            self._plans.clear()

    def shutdown(self):
        with self._cond:
            self._shutdown_requested = True
            self._cond.notify()
        self._thread.join()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def failure(self) -> Optional[BaseException]:
        """The communication failure that stopped this engine, if one did."""
        return self._fatal

    # --- the background thread ----------------------------------------------------------------
    def _run(self):
        while True:
            with self._cond:
                while not self._stopped and not self._due():
                    self._cond.wait(self._sleep_time())
                if self._stopped:
                    return
            with self._cycle_lock:
                with self._cond:
                    if self._stopped:
                        return
                    if not self._due():  # a caller ran the cycle meanwhile
                        continue
                self._locked_cycle()

    def _locked_cycle(self, caller_blocked: bool = False):
        """One cycle; the caller holds _cycle_lock.  Failures reach every waiting handle."""
        with self._cond:
            new, self._new = self._new, []
            for r in new:
                self._local[r.name] = r
            shutdown = self._shutdown_requested
            caller_blocked = caller_blocked or self._waiters > 0
        self._run_round(lambda: self._cycle(new, shutdown, caller_blocked))

    def _run_round(self, round_fn: Callable[[], bool]):
        """Run a cycle's work; it returns True when the engine should stop.  Failures reach
        every waiting handle."""
        try:
            stop = round_fn()
        except BaseException as exc:  # noqa: B902 - any failure must reach the waiting callers
            self._fail_everything(exc)
            stop = False  # _fail_everything has stopped the engine
        # Counted from the end of a cycle: after a long execution the caller gets a moment to
        # submit its next request before this rank negotiates again.
        self._last_end = time.monotonic()
        if stop:
            with self._cond:
                self._stopped = True
                self._cond.notify_all()

    def _due(self) -> bool:
        """Whether the background thread should run a cycle now (caller holds _cond)."""
        if self._shutdown_requested:
            return True
        if self._caller_cycle:  # it notifies when it is done, if work is left
            return False
        busy = bool(self._new or self._local)
        # A caller is blocked: go now if there is something new to announce, or if the last
        # cycle moved things along (peers are active and may complete ours).
        if busy and self._waiters > 0 and (self._new or self._last_round_active):
            return True
        return time.monotonic() >= self._next_cycle_at(busy)

    def _next_cycle_at(self, busy: bool) -> float:
        if busy:
            return max(self._last_end + self._cycle_s, self._not_before)
        return self._last_end + IDLE_CYCLE_S

    def _sleep_time(self) -> Optional[float]:
        if self._caller_cycle:
            return None
        return max(0.0, self._next_cycle_at(bool(self._new or self._local)) - time.monotonic())

    def _cycle(self, new: List[Request], shutdown: bool, caller_blocked: bool = False) -> bool:
        """One negotiation and execution round; True when the engine should stop."""
        tl = trace.recorder
        if tl is not None:
            self._round_started = time.perf_counter_ns()
            if tl.mark_cycles:
                tl.cycle_start()
        cache_ids, announce = [], []
        for r in new:
            cid = self._cache.lookup(r.name, self.rank, r.meta)
            if cid is not None:
                cache_ids.append(cid)
                self.stats["cache_hits"] += 1
            else:
                announce.append((r.name, r.meta))
                self.stats["announced"] += 1
        aborts, self._abort_next = self._abort_next, []
        message = _encode(cache_ids, announce, shutdown, aborts)
        messages = self.control.agree(message, caller_blocked)
        self.stats["cycles"] += 1
        only_cached = not announce and not shutdown and not aborts
        return self._after_round(message, messages, cache_ids if only_cached else None)

    def _after_round(self, message: bytes, messages: Optional[List[bytes]],
                     only_ids: Optional[List[int]]) -> bool:
        """Everything after the round: ``messages`` is None when every rank sent ``message``;
        ``only_ids``: the cache ids ``message`` holds when it holds nothing else.  True when the
        engine should stop."""
        if messages is None and only_ids and not self._pending and not self._joined:
            # The steady state: every rank submitted these cached requests in this order and
            # nothing else (nothing is pending anywhere: that table is the same on every rank),
            # so they are ready everywhere with the descriptions agreed when they were cached.
            self._last_round_active = True
            ready = [self._cache.by_id[cid] + (None,) for cid in only_ids]
            tl = trace.recorder
            if tl is not None:
                metas = [(name, next(iter(m.values()))) for name, m, _ in ready]
                tl.negotiated_together([(_tracks(name, meta), meta[0]) for name, meta in metas],
                                       self.size, self._round_started)
            self._execute(ready)
            return False
        gathered = [_decode(m) for m in (messages or [message] * self.size)]

        any_shutdown = False
        now = time.monotonic()
        activity = False
        # Cache ids first: an announcement below may evict the entry they point to.
        for rank, (ids, _, flag, _) in enumerate(gathered):
            any_shutdown |= flag
            for cid in ids:
                name, metas = self._cache.by_id[cid]
                self._note(name, rank, metas[rank], now)
                activity = True
        for rank, (_, anns, _, rank_aborts) in enumerate(gathered):
            for name, meta in anns:
                activity = True
                if name == JOIN_NAME:
                    self._joined.append(rank)
                    continue
                self._cache.evict(name)  # a new description replaces a cached one everywhere
                self._note(name, rank, meta, now)
            for name in rank_aborts:
                self._abort(name, f"tensor '{name}' stalled for more than "
                            f"{self.config.stall_shutdown_s:.0f} s "
                            f"(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS); "
                            f"{self._who_submitted(name)}")

        ready = self._collect_ready()
        activity |= bool(ready)
        self._last_round_active = activity
        self._execute(ready)
        self._complete_join()
        if any_shutdown:
            self._fail_unmatched_at_shutdown()
            return True
        if self.config.stall_check:
            self._check_stalls(now)
        return False

    def _note(self, name: str, rank: int, meta: Tuple, now: float):
        self._pending.setdefault(name, {})[rank] = meta
        self._first_seen.setdefault(name, now)
        tl = trace.recorder
        if tl is not None:
            tl.submitted(_tracks(name, meta), rank)

    def _collect_ready(self):
        needed = set(range(self.size)) - set(self._joined)
        ready = []
        for name, metas in self._pending.items():
            kind = next(iter(metas.values()))[0]
            if self._joined and kind != "allreduce":
                # Fails at once, without waiting for the other ranks: they may never submit it
                # (unnamed requests of ranks that joined at different times carry different
                # counters), and it would fail when they did.
                ready.append((name, metas, f"tensor '{name}': {kind} is not possible while "
                                           f"ranks {sorted(self._joined)} have joined (only "
                                           f"allreduce is)"))
            elif needed <= metas.keys():
                ready.append((name, metas, _mismatch_message(name, metas)))
        tl = trace.recorder
        for name, metas, _ in ready:
            del self._pending[name]
            self._first_seen.pop(name, None)
            self._warned.pop(name, None)
            if tl is not None:
                meta = next(iter(metas.values()))
                tl.negotiated(_tracks(name, meta), meta[0])
        return ready

    # --- execution ----------------------------------------------------------------------------
    def _execute(self, ready):
        """Run the ready requests in their agreed order; allreduces with the same op, dtype,
        device and scaling share a fusion buffer up to the threshold."""
        batches: List[Tuple[str, Any]] = []          # ("allreduce", [requests]) | ("single", ..)
        open_batch: Dict[Tuple, Tuple[List[Request], int]] = {}   # key -> (members, bytes)
        threshold = self.config.fusion_threshold
        for name, metas, error in ready:
            request = self._local.pop(name, None)
            if error is not None:
                if request is not None:
                    request.handle._finish(error=HorovodInternalError(error))
                continue
            meta = next(iter(metas.values()))
            if request is None:  # this rank has joined: take part with zeros
                request = self._zeros_request(name, meta)
            self._cache.add(name, metas)
            if request.kind != "allreduce":
                batches.append(("single", (request, metas)))
                continue
            nbytes = sum(t.numel() * t.element_size() for t in request.tensors)
            key = (request.op, meta[2], meta[3], request.prescale, request.postscale)
            fusable = (threshold > 0 and nbytes < self.config.fusion_max_tensor_bytes
                       and get_op(request.op).fuse_across_requests)
            members, used = open_batch.get(key, (None, 0))
            if fusable and members is not None and used + nbytes <= threshold:
                members.append(request)
                open_batch[key] = (members, used + nbytes)
                continue
            members = [request]
            batches.append(("allreduce", members))
            if fusable:
                open_batch[key] = (members, nbytes)
        # A transport failure below stops the engine: _fail_everything must reach these too.
        self._running = [r for kind, item in batches
                         for r in ([item[0]] if kind == "single" else item)]
        tl = trace.recorder
        negotiated = time.perf_counter_ns() if tl is not None else None
        for kind, item in batches:
            if tl is not None:
                with self._marked(tl, kind, item, negotiated):
                    self._run_batch(kind, item)
            else:
                self._run_batch(kind, item)
        self._running = []

    def _run_batch(self, kind: str, item):
        if kind == "single":
            self._run_single(*item)
        else:
            self._run_allreduce(item)

    @staticmethod
    def _marked(tl, kind: str, item, since: int):
        """The timeline's record of one batch: its tensors' tracks, named after the operation
        (ALLREDUCE for the elementwise ops, the op's own name otherwise: ADASUM...)."""
        members = [item[0]] if kind == "single" else item
        first = members[0]
        if first.kind == "allreduce":
            op = get_op(first.op)
            name = op.timeline_name
        else:
            name = first.kind.upper()
        tracks = [_track(r.kind, n) for r in members for n in r.tensor_names()]
        nbytes = sum(trace.nbytes_of(t) for r in members for t in r.tensors)
        return tl.executing(tracks, name, since, nbytes)

    def _zeros_request(self, name, meta):
        kind, op, dtype, device, shapes, root, splits, pre, post = meta
        dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else "cpu"
        tensors = [torch.zeros(s, dtype=getattr(torch, dtype), device=dev) for s in shapes]
        r = Request(name, kind, tensors, op=op, root=root, splits=splits, prescale=pre,
                    postscale=post, handle=Handle(name, self))
        r.meta = meta
        return r

    def _run_allreduce(self, members: List[Request]):
        first = members[0]
        op = get_op(first.op)
        tensors = [t for r in members for t in r.tensors]
        layers = layers_of(tensors, [n for r in members for n in r.tensor_names()])
        target = first.outputs[0] if first.outputs and len(tensors) == 1 else None
        alone = len(tensors) == 1
        if target is not None and target.is_contiguous():
            # In place on the caller's tensor (its detached alias): no copies.
            buffer = tensors[0] if tensors[0].dim() == 1 else tensors[0].view(-1)
        elif alone:
            with trace.activity("MEMCPY_IN_FUSION_BUFFER", trace.nbytes_of(tensors[0])):
                buffer = tensors[0].detach().reshape(-1).clone()  # becomes the result itself
        else:
            # An elementwise op's fused buffer goes straight into shared memory when the
            # in-node steps run there.
            slot = None
            if op.elementwise and tensors[0].is_cpu:
                slot = self.comms.pack_target(sum(t.numel() for t in tensors),
                                              tensors[0].dtype)
            with trace.activity("MEMCPY_IN_FUSION_BUFFER",
                                sum(trace.nbytes_of(t) for t in tensors)):
                buffer = self._fusion.pack(tensors, slot)
            self.stats["fused_buffers"] += 1
        try:
            buffer = reduce_flat(op, buffer, layers, self.comms, first.prescale, first.postscale)
        except CommunicationError:
            raise
        except Exception as exc:  # the op itself failed: fail these requests, keep running
            for r in members:
                r.handle._finish(error=HorovodInternalError(f"allreduce of '{r.name}' failed: {exc}"))
            return
        if first.lane_key is not None and len(members) == 1 and alone:
            self._keep_plan(first, tensors[0])
        if target is not None and buffer.data_ptr() == target.data_ptr():
            # The usual in-place call: the result is already where it belongs.  (Slicing costs
            # tens of microseconds right after a large transfer has evicted the caches.)
            first.handle._finish([target])
            return
        with trace.activity("MEMCPY_OUT_FUSION_BUFFER", trace.nbytes_of(buffer)):
            self._unpack(members, buffer, alone)

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

    def _run_single(self, r: Request, metas: Dict[int, Tuple]):
        comms, world = self.comms, self.comms.world
        try:
            if r.kind == "allgather":
                counts = [metas[k][4][0][0] if metas[k][4][0] else 1 for k in range(self.size)]
                result = comms.allgather(r.tensors[0], counts)
            elif r.kind == "broadcast":
                t = r.outputs[0] if r.outputs else r.tensors[0].clone()
                with trace.transfer(world, "BROADCAST", t):
                    world.broadcast(t, r.root)
                result = t
            elif r.kind == "alltoall":
                recv = [metas[k][6][self.rank] for k in range(self.size)]
                with trace.transfer(world, "ALLTOALL", r.tensors[0]):
                    result = (world.alltoall(r.tensors[0], list(r.splits), recv),
                              torch.tensor(recv, dtype=torch.int32))
            elif r.kind == "reducescatter":
                result = self._reducescatter(r)
            elif r.kind == "barrier":
                result = None
            elif r.kind == "custom":
                if r.fn is None:
                    raise ValueError("a rank that has joined cannot take part in a custom "
                                     "collective (an optimizer's own communication)")
                result = r.fn(comms.topology)
            else:
                raise ValueError(f"unknown request kind {r.kind}")
        except CommunicationError:
            raise
        except Exception as exc:
            r.handle._finish(error=HorovodInternalError(f"{r.kind} of '{r.name}' failed: {exc}"))
            return
        r.handle._finish([result])

    def _reducescatter(self, r: Request):
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

    def _complete_join(self):
        if JOIN_NAME in self._local and len(self._joined) == self.size:
            last = self._joined[-1]
            self._local.pop(JOIN_NAME).handle._finish([last])
            self._joined = []
        elif len(self._joined) == self.size:
            self._joined = []

    # --- failures -----------------------------------------------------------------------------
    def _who_submitted(self, name: str) -> str:
        have = sorted(self._pending.get(name, {}))
        missing = sorted(set(range(self.size)) - set(have) - set(self._joined))
        return f"submitted by ranks {have}, not by ranks {missing}"

    def _abort(self, name: str, reason: str):
        request = self._local.pop(name, None)
        metas = self._pending.pop(name, None)
        self._first_seen.pop(name, None)
        tl = trace.recorder
        if tl is not None and metas:
            tl.abandoned(_tracks(name, next(iter(metas.values()))))
        if request is not None:
            request.handle._finish(error=HorovodInternalError(reason))

    def _fail_unmatched_at_shutdown(self):
        for name in list(self._pending):
            reason = (f"horovod_ext was shut down before tensor '{name}' was reduced: "
                      f"{self._who_submitted(name)}")
            self.shutdown_errors.append(reason)
            self._abort(name, reason)
        with self._cond:
            leftovers = list(self._local.values()) + self._new
            self._local, self._new = {}, []
            self._stopped = True
        for r in leftovers:
            r.handle._finish(error=HorovodInternalError(
                f"horovod_ext was shut down before '{r.name}' could complete"))

    def _fail_everything(self, exc: BaseException):
        """Stop the engine (its thread wakes and ends) and fail every request with ``exc``."""
        error = HorovodInternalError(f"horovod_ext stopped on rank {self.rank}: {exc}")
        error.__cause__ = exc
        log.error("%s", error)
        with self._cond:
            self._fatal = error
            self._stopped = True
            self._cond.notify_all()
            leftovers = list(self._local.values()) + self._new
            leftovers += [r for r in self._running if not r.handle.done()]
            self._local, self._new, self._running = {}, [], []
        for r in leftovers:
            r.handle._finish(error=error)

    def _check_stalls(self, now: float):
        warn_after = self.config.stall_warning_s
        abort_after = self.config.stall_shutdown_s
        for name, since in list(self._first_seen.items()):
            age = now - since
            if age > warn_after and now - self._warned.get(name, 0.0) > warn_after:
                self._warned[name] = now
                if self.rank == 0:
                    log.warning("stall: tensor '%s' waited %.0f s, %s", name, age,
                                self._who_submitted(name))
            if abort_after > 0 and age > abort_after and self.rank == 0 \
                    and name not in self._abort_next:
                self._abort_next.append(name)
