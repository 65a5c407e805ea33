"""The background engine of one process set (the world is one too): submission, the thread
that runs cycles, cycle timing, shutdown and failures (the package's docstring tells the whole
path of a request).

Cycle timing: with requests waiting, a rank runs a cycle every HOROVOD_CYCLE_TIME ms so that
tensors submitted close together are fused; a request submitted while the rank was idle, or one
that a caller is blocked on, starts a cycle at once, which keeps a lone synchronous call's latency
near one network round trip.  Requests submitted with ``wake=NEXT_CYCLE`` (gradients from
backward hooks) start a cycle one cycle time after the first of them arrives: later gradients
of the same backward pass join it, and the reductions overlap the rest of the backward pass.
An idle rank cycles rarely, to learn of a peer's shutdown or aborts (idle_pace.py).
"""
import faulthandler
import logging
import threading
import time
from typing import Callable, Dict, List, Optional

import torch

from horovod_ext.backends import trace
from horovod_ext.backends.base import CommunicationError, PeerClosedError
from horovod_ext.backends.control import ControlChannel
from horovod_ext.backends.collectives import Collectives
from horovod_ext.config import Config
from . import wire
from .execution import Executor, zeros_request
from .fast_lane import CachedAllreduce, Key, Plans
from .fusion import plan_batches
from .idle_pace import IDLE_CYCLE_S
from .negotiation import Negotiator, Ready
from .requests import JOIN_NAME, NEXT_CYCLE, Handle, HorovodInternalError, Request
from .waiting import Waiters

log = logging.getLogger("horovod_ext")
# A failed peer says why on the heartbeat channel before it closes anything, but that channel's
# thread may not have run yet: a rank that finds a peer closed waits this long for the notice.
PEER_NOTICE_GRACE_S = 0.5


class Engine:
    """One process set's engine on this rank: requests go in by ``submit``, a background thread
    negotiates and runs them (``Negotiator``, ``plan_batches``, ``Executor``)."""

    def __init__(self, comms: Collectives, control: ControlChannel, config: Config):
        self.comms = comms
        self.control = control
        self.config = config
        self.rank, self.size = comms.world.rank, comms.world.size
        self._cond = threading.Condition()
        self._new: List[Request] = []                 # submitted, not yet announced
        self._local: Dict[str, Request] = {}           # announced, waiting to be executed
        self._waiters = Waiters()
        self._shutdown_requested = self._stopped = False
        self._fatal: Optional[BaseException] = None
        # Replicated on every rank, updated identically from the gathered messages:
        self._negotiator = Negotiator(self.rank, self.size, config)
        self._last_round_active = False
        self.shutdown_errors: List[str] = []   # names left unmatched, reported by shutdown()
        self.stats = {"cycles": 0, "cache_hits": 0, "announced": 0, "fused_buffers": 0,
                      "fast_lane": 0}
        self._lane = Plans(comms, self._negotiator.cache)
        self._executor = Executor(comms, self.stats, lambda request, tensor: self._lane.keep(
            request, tensor, self.config.cache_capacity), self.fail)
        self._running: List[Request] = []     # taken out of _local for this round's execution
        self._cycle_lock = threading.Lock()   # held by whichever thread runs a cycle
        self._caller_cycle = False            # a blocked caller is running a cycle
        self._event_lock = threading.Lock()   # makes the handles' events
        self._cycle_s, self._last_end = config.cycle_time_ms / 1000.0, 0.0
        self._round_started = 0  # perf_counter_ns at the start of the round (timeline)
        self._not_before = 0.0   # NEXT_CYCLE requests: no cycle before this (monotonic s)
        self.report_failure: Callable[[str], None] = lambda reason: None   # to peers: faults.py
        self._thread = threading.Thread(target=self._run, name="horovod_ext-engine", daemon=True)
        self._thread.start()

    # --- called from user threads -------------------------------------------------------------
    def submit(self, request: Request, wake=True) -> Handle:
        """Queue ``request``.  ``wake=False`` when the caller synchronizes at once: it runs the
        first cycle itself (waking the background thread would only contend).  ``NEXT_CYCLE``:
        run one cycle time after the first such request reaching an idle rank, with the rest."""
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
            if was_idle and wake:
                self._cond.notify()
        if self.size == 1:  # nothing to negotiate: complete it now, on the caller's thread
            with self._cycle_lock:
                if not self._stopped:
                    self._locked_cycle()
        return request.handle

    def wait_for(self, handle: Handle):
        if not handle.done() and self._cycle_lock.acquire(blocking=False):
            # A caller blocked on a fresh request runs its first cycle itself (two thread
            # hand-offs less); the background thread sleeps on, not contending for the GIL.
            try:
                with self._cond:
                    fresh = bool(self._new) and not (self._stopped or self._shutdown_requested)
                    self._caller_cycle = fresh
                if fresh and not handle.done():
                    self._locked_cycle(caller_blocked=True)
            finally:
                with self._cond:
                    self._caller_cycle = False
                    # always: a thread woken during the cycle slept with no timeout, and a rank
                    # that never cycles stalls its peers' idle rounds (lane steps submit nothing)
                    self._cond.notify()
                self._cycle_lock.release()
        if handle.done():
            return
        with self._cond:
            self._waiters.enter()
            self._cond.notify()
        try:
            handle._sleep_until_done(self._event_lock)
        finally:
            with self._cond:
                self._waiters.leave()

    def allreduce_cached(self, name: str, key: Key, tensor: torch.Tensor,
                         make_request: Callable[[], Request]):
        """The steady-state lane of a synchronous allreduce (fast_lane.py): in place when the
        key holds an address, into a new tensor otherwise.  Returns the reduced tensor; None
        when nothing was sent (take the general path); a Handle when the request went out but
        must finish on the general path (another rank sent something else): wait for it.
        ``make_request()`` builds the general request."""
        plan = self._lane.usable(name, key)
        if plan is None or not self._cycle_lock.acquire(blocking=False):
            return None
        try:
            # Only the thread holding _cycle_lock changes these, except _new (a list read is
            # atomic; a request submitted right after this check waits for the next cycle).
            if (self._new or self._local or not self._negotiator.settled()
                    or self._stopped or self._shutdown_requested):
                return None
            return self._lane_round(plan, name, tensor, make_request)
        finally:
            self._last_end = time.monotonic()
            self._cycle_lock.release()

    def _lane_round(self, plan: CachedAllreduce, name: str, tensor: torch.Tensor,
                    make_request: Callable[[], Request]):
        """A round that sends ``plan``'s message alone (the caller holds _cycle_lock)."""
        if trace.recorder is not None:
            self._round_started = time.perf_counter_ns()
        try:
            messages = self.control.agree(plan.message, True)
        except BaseException as exc:  # noqa: B902 - as a failed cycle: stops the engine
            raise self.fail(exc) from exc
        self.stats["cycles"] += 1
        self.stats["cache_hits"] += 1
        if messages is None:  # every rank sent this cached request alone: run it
            return self._run_plan(plan, name, tensor)
        # Some rank sent something else: the request is announced (by its cache id) and
        # continues on the general path from this round's messages.
        request = make_request()
        request.handle = Handle(name, self)
        request.meta = request.describe()
        with self._cond:
            self._local[name] = request
        self._run_round(lambda: self._after_round(plan.message, messages, [plan.cid]))
        return request.handle

    def _run_plan(self, plan: CachedAllreduce, name: str, tensor: torch.Tensor):
        self._last_round_active = True
        self.stats["fast_lane"] += 1
        if not plan.in_place:
            tensor = tensor.detach().clone()
        try:
            plan.run_recorded(tensor, name, self._round_started)
        except Exception as exc:  # the peers may wait mid-transfer: stop, as on a lost peer
            if not isinstance(exc, CommunicationError):
                exc = HorovodInternalError(f"allreduce of '{name}' failed: {exc}")
            raise self.fail(exc) from exc
        return tensor

    def reconfigure(self, config: Config):
        """Take ``config``'s fusion threshold, cycle time and cache capacity from now on.
        Called on the engine thread (a custom request), at the same point of the same round on
        every rank, so the ranks' response caches stay identical."""
        self.config = config
        self._cycle_s = config.cycle_time_ms / 1000.0
        self._negotiator.reconfigure(config)
        if config.cache_capacity == 0:
            self._lane.by_name.clear()

    def shutdown(self):
        with self._cond:
            self._shutdown_requested = True
            self._cond.notify()
        self._thread.join(None if self._fatal is None else 1.0)  # failed: maybe in a transfer
        self._executor.drain(self.config.timeout_s)   # transfers left running end or fail

    def fail_from_peer(self, reason: str):
        """A peer has failed (faults.py): fail every request with ``reason``, leave waits."""
        if not self._stopped:
            self.fail(CommunicationError(reason), tell_peers=False)
        self.comms.topology.abort_waits(reason)
        self.control.abort()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stopped  # by a shutdown or a failure

    @property
    def failure(self) -> Optional[BaseException]:
        return self._fatal   # the failure that stopped this engine, if one did

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
            caller_blocked = caller_blocked or self._waiters.count > 0
        self._run_round(lambda: self._cycle(new, shutdown, caller_blocked))

    def _run_round(self, round_fn: Callable[[], bool]):
        """Run a cycle's work (True: the engine should stop); failures reach every handle."""
        try:
            stop = round_fn()
        except BaseException as exc:  # noqa: B902 - any failure must reach the waiting callers
            self.fail(exc)
            stop = False  # fail() has stopped the engine
        # Counted from the end of a cycle: after a long execution the caller gets a moment to
        # submit its next request before this rank negotiates again.
        self._last_end = time.monotonic()
        if stop:
            with self._cond:
                self._stopped = True
                self._cond.notify_all()

    # --- cycle timing -------------------------------------------------------------------------
    def _due(self) -> bool:
        """Whether the background thread should run a cycle now (caller holds _cond)."""
        if self._shutdown_requested:
            return True
        if self._caller_cycle:  # it notifies when it is done, if work is left
            return False
        busy = bool(self._new or self._local)
        # A caller is blocked: go now if there is news to announce or the last round progressed
        if busy and self._waiters.count > 0 and (self._new or self._last_round_active):
            return True
        return time.monotonic() >= self._next_cycle_at(busy)

    def _next_cycle_at(self, busy: bool) -> float:
        return (max(self._last_end + self._cycle_s, self._not_before) if busy
                else self._last_end + IDLE_CYCLE_S)

    def _sleep_time(self) -> Optional[float]:
        if self._caller_cycle:
            return None
        return max(0.0, self._next_cycle_at(bool(self._new or self._local)) - time.monotonic())

    # --- one round ----------------------------------------------------------------------------
    def _cycle(self, new: List[Request], shutdown: bool, caller_blocked: bool = False) -> bool:
        """One negotiation and execution round; True when the engine should stop."""
        tl = trace.recorder
        if tl is not None:
            self._round_started = time.perf_counter_ns()
            if tl.mark_cycles:
                tl.cycle_start()
        cache_ids, announce = self._negotiator.outgoing(new)
        self.stats["cache_hits"] += len(cache_ids)
        self.stats["announced"] += len(announce)
        aborts = self._negotiator.take_aborts()
        message = wire.encode(cache_ids, announce, shutdown, aborts,
                              self._waiters.long_blocked(self.config.deadlock_s))
        messages = self.control.agree(message, caller_blocked)
        self.stats["cycles"] += 1
        only_cached = not announce and not shutdown and not aborts
        return self._after_round(message, messages, cache_ids if only_cached else None)

    def _after_round(self, message: bytes, messages: Optional[List[bytes]],
                     only_ids: Optional[List[int]]) -> bool:
        """After the round: ``messages`` is None when every rank sent ``message``; ``only_ids``:
        the cache ids ``message`` holds if nothing else.  True when the engine should stop."""
        negotiator = self._negotiator
        if messages is None and only_ids and not negotiator.pending and not negotiator.joined:
            # The steady state: every rank submitted these cached requests in this order and
            # nothing else (nothing is pending anywhere: that table is the same on every rank).
            self._last_round_active = True
            self._execute(negotiator.cached_ready(only_ids, self._round_started))
            return False
        gathered = [wire.decode(m) for m in (messages or [message] * self.size)]
        now = time.monotonic()
        activity, any_shutdown = negotiator.absorb(gathered, now, self._fail_local)
        if negotiator.fatal:  # MPI ends the job; else _run_round fails all, stops the engine
            self.comms.world.end_job(negotiator.fatal)
            raise HorovodInternalError(negotiator.fatal)
        ready = negotiator.collect_ready()
        self._last_round_active = activity or bool(ready)
        self._execute(ready)
        self._complete_join()
        if any_shutdown:
            self._fail_unmatched_at_shutdown()
            return True
        if self.config.stall_check:
            negotiator.check_stalls(now)
        return False

    def _execute(self, ready: List[Ready]):
        """Run the ready requests in their agreed order (fusion.py plans the batches); those
        that failed negotiation fail here, and a rank that has joined takes part with zeros."""
        resolved = []
        for name, metas, error in ready:
            request = self._local.pop(name, None)
            if error is not None:
                if request is not None:
                    request.handle._finish(error=HorovodInternalError(error))
                continue
            if request is None:
                request = zeros_request(name, next(iter(metas.values())), Handle(name, self),
                                        self._local.get(JOIN_NAME))
            self._negotiator.cache.add(name, metas)
            resolved.append((request, metas))
        batches = plan_batches(resolved, self.config.fusion_threshold,
                               self.config.fusion_max_tensor_bytes)
        # A transport failure below stops the engine: fail must reach these too.
        self._running = [r for batch in batches for r in batch.requests]
        self._executor.run(batches)
        self._running = []

    def _complete_join(self):
        last = self._negotiator.take_completed_join()
        if last is not None and JOIN_NAME in self._local:
            self._local.pop(JOIN_NAME).handle._finish([last])

    # --- failures -----------------------------------------------------------------------------
    def _fail_local(self, name: str, reason: str):
        """Fail this rank's request ``name``, if it submitted one."""
        request = self._local.pop(name, None)
        if request is not None:
            request.handle._finish(error=HorovodInternalError(reason))

    def _fail_unmatched_at_shutdown(self):
        for name, reason in self._negotiator.abandon_all("horovod_ext was shut down before"):
            self.shutdown_errors.append(reason)
            self._fail_local(name, reason)
        with self._cond:
            leftovers = list(self._local.values()) + self._new
            self._local, self._new = {}, []
            self._stopped = True
        for r in leftovers:
            r.handle._finish(error=HorovodInternalError(
                f"horovod_ext was shut down before '{r.name}' could complete"))

    def fail(self, exc: BaseException, tell_peers: bool = True) -> BaseException:
        """Stop the engine (its thread wakes and ends), fail every request with ``exc`` and return
        what stopped it (an earlier failure first); ``tell_peers``: this rank's own failure.
        Also for failures met outside a round (a bucket lane's sum, torch/reduction/lane.py)."""
        with self._cond:
            if tell_peers and isinstance(exc, PeerClosedError):
                self._cond.wait_for(lambda: self._fatal is not None, PEER_NOTICE_GRACE_S)
            if self._fatal is not None:   # failed already (a peer's notice came first)
                return self._fatal
            error = HorovodInternalError(f"horovod_ext stopped on rank {self.rank}: {exc}")
            error.__cause__ = exc
            self._fatal, self._stopped = error, True
            self._cond.notify_all()
            leftovers = list(self._local.values()) + self._new
            leftovers += [r for r in self._running + self._executor.in_flight()
                          if not r.handle.done()]
            self._local, self._new, self._running = {}, [], []
        log.error("%s", error)
        if log.isEnabledFor(logging.DEBUG):   # a rank stuck in a transfer shows where
            faulthandler.dump_traceback(all_threads=True)
        if tell_peers:
            self.report_failure(f"rank {self.rank} failed: {exc}")
        for r in leftovers:
            r.handle._finish(error=error)
        return error
