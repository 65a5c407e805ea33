"""Negotiation: the table of who submitted what, when a request is ready, whether the ranks
agree on it, and the response cache that lets a recurring request travel as a small id.

Every rank of a process set (the world is one too) holds a ``Negotiator`` that it updates from
the same gathered cycle messages in the same order, so the table, the cache and the joined ranks
are identical on every rank without further messages.  Handles are not its business: where a
request must fail it reports the reason and the engine fails the local request.
"""
import logging
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from horovod_ext.backends import trace
from horovod_ext.config import Config
from .requests import JOIN_NAME, Request, RequestMeta, tracks
from .wire import Announcement, Message

log = logging.getLogger("horovod_ext")

Metas = Dict[int, RequestMeta]               # rank -> its description of one request
Ready = Tuple[str, Metas, Optional[str]]     # (name, descriptions, why it fails or None)

# How the fields of RequestMeta are called in mismatch errors, in their order.
_META_LABELS = ("kind", "op", "dtype", "device", "shape", "root rank", "splits",
                "prescale_factor", "postscale_factor")


def agreement_key(meta: RequestMeta) -> RequestMeta:
    """The parts of a request that must be equal on every rank."""
    if meta.kind in ("allgather", "alltoall"):  # first dimensions and splits may differ
        return meta._replace(shapes=tuple(s[1:] for s in meta.shapes), splits=None)
    return meta


def mismatch_message(name: str, metas: Metas) -> Optional[str]:
    """Why the ranks' descriptions of ``name`` disagree (the first field that differs, with
    which ranks hold which value), or None when they agree."""
    keys = {r: agreement_key(m) for r, m in metas.items()}
    first = next(iter(keys.values()))
    if all(k == first for k in keys.values()):
        return None
    for i, label in enumerate(_META_LABELS):
        values: Dict[Any, List[int]] = {}
        for r, k in sorted(keys.items()):
            values.setdefault(repr(k[i]), []).append(r)
        if len(values) > 1:
            detail = "; ".join(f"ranks {rs}: {v}" for v, rs in values.items())
            return f"mismatched {label} for tensor '{name}' across ranks ({detail})"
    return f"mismatched requests for tensor '{name}'"


class ResponseCache:
    """Requests that recur with the same descriptions get a small integer id on every rank."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.by_id: Dict[int, Tuple[str, Metas]] = {}
        self.by_name: Dict[str, int] = {}
        self._next = 0

    def lookup(self, name: str, rank: int, meta: RequestMeta) -> Optional[int]:
        cid = self.by_name.get(name)
        if cid is not None and self.by_id[cid][1].get(rank) == meta:
            return cid
        return None

    def add(self, name: str, metas: Metas):
        if name in self.by_name or len(self.by_id) >= self.capacity:
            return
        self.by_id[self._next] = (name, dict(metas))
        self.by_name[name] = self._next
        self._next += 1

    def evict(self, name: str):
        cid = self.by_name.pop(name, None)
        if cid is not None:
            del self.by_id[cid]

    def clear(self):
        self.by_id.clear()
        self.by_name.clear()


STOP_ALL = ""   # an abort of this name stops every rank's engine (a deadlock)


class Negotiator:
    """One process set's replicated negotiation state, as seen from rank ``rank`` of ``size``."""

    def __init__(self, rank: int, size: int, config: Config):
        self.rank = rank
        self.size = size
        self.config = config
        self.pending: "OrderedDict[str, Metas]" = OrderedDict()
        self.first_seen: Dict[str, float] = {}
        self.warned: Dict[str, float] = {}
        self.joined: List[int] = []
        self.cache = ResponseCache(config.cache_capacity)
        self.abort_next: List[Tuple[str, str]] = []   # (name, reason) rank 0 fails next cycle
        self.waiting: Set[int] = set()    # ranks whose last message said a caller is blocked
        self.deadlocked_since: Optional[float] = None
        self.fatal: Optional[str] = None  # rank 0 stopped every rank's engine, for this reason

    def reconfigure(self, config: Config):
        """Take ``config``'s stall limits and cache capacity; a capacity of 0 empties the cache.
        Called at the same point of the same round on every rank, so the caches stay equal."""
        self.config = config
        self.cache.capacity = config.cache_capacity
        if config.cache_capacity == 0:
            self.cache.clear()

    def settled(self) -> bool:
        """Nothing pending, joined or to abort: the table is empty on every rank."""
        return not (self.pending or self.joined or self.abort_next)

    # --- this rank's message ------------------------------------------------------------------
    def outgoing(self, new: Sequence[Request]) -> Tuple[List[int], List[Announcement]]:
        """How ``new`` requests go out: cache ids for those cached with the same description,
        full descriptions for the rest."""
        cache_ids, announce = [], []
        for r in new:
            cid = self.cache.lookup(r.name, self.rank, r.meta)
            if cid is not None:
                cache_ids.append(cid)
            else:
                announce.append((r.name, r.meta))
        return cache_ids, announce

    def take_aborts(self) -> List[Tuple[str, str]]:
        aborts, self.abort_next = self.abort_next, []
        return aborts

    # --- the gathered messages ----------------------------------------------------------------
    def cached_ready(self, cache_ids: Sequence[int], since: int) -> List[Ready]:
        """The steady state: every rank sent exactly these cache ids and nothing is pending, so
        they are ready with the descriptions agreed when they were cached.  ``since``: the
        round's start (timeline)."""
        ready = [self.cache.by_id[cid] + (None,) for cid in cache_ids]
        tl = trace.recorder
        if tl is not None:
            metas = [(name, next(iter(m.values()))) for name, m, _ in ready]
            tl.negotiated_together([(tracks(name, meta), meta.kind) for name, meta in metas],
                                   self.size, since)
        return ready

    def absorb(self, gathered: Sequence[Message], now: float,
               fail: Callable[[str, str], None]) -> Tuple[bool, bool]:
        """Enter every rank's message into the table; ``fail(name, reason)`` fails this rank's
        request of a name that is aborted.  (whether anything was submitted, whether a rank is
        shutting down)."""
        any_shutdown = False
        activity = False
        self.waiting = {rank for rank, message in enumerate(gathered) if message.waiting}
        # Cache ids first: an announcement below may evict the entry they point to.
        for rank, message in enumerate(gathered):
            any_shutdown |= message.shutdown
            for cid in message.cache_ids:
                name, metas = self.cache.by_id[cid]
                self._note(name, rank, metas[rank], now)
                activity = True
        for rank, message in enumerate(gathered):
            for name, meta in message.announce:
                activity = True
                if name == JOIN_NAME:
                    self.joined.append(rank)
                    continue
                self.cache.evict(name)  # a new description replaces a cached one everywhere
                self._note(name, rank, meta, now)
            for name, reason in message.aborts:
                if name == STOP_ALL:
                    self.fatal = reason
                    continue
                self.abandon(name)
                fail(name, reason)
        return activity, any_shutdown

    def _note(self, name: str, rank: int, meta: RequestMeta, now: float):
        self.pending.setdefault(name, {})[rank] = meta
        self.first_seen.setdefault(name, now)
        tl = trace.recorder
        if tl is not None:
            tl.submitted(tracks(name, meta), rank)

    def collect_ready(self) -> List[Ready]:
        """Take the names every non-joined rank has submitted out of the table, in the order
        they were first submitted, each with the reason it fails (disagreement) or None."""
        needed = set(range(self.size)) - set(self.joined)
        ready = []
        for name, metas in self.pending.items():
            kind = next(iter(metas.values())).kind
            if self.joined and kind != "allreduce":
                # Fails at once, without waiting for the other ranks: they may never submit it
                # (unnamed requests of ranks that joined at different times carry different
                # counters), and it would fail when they did.
                ready.append((name, metas, f"tensor '{name}': {kind} is not possible while "
                                           f"ranks {sorted(self.joined)} have joined (only "
                                           f"allreduce is)"))
            elif needed <= metas.keys():
                ready.append((name, metas, mismatch_message(name, metas)))
        tl = trace.recorder
        for name, metas, _ in ready:
            del self.pending[name]
            self.first_seen.pop(name, None)
            self.warned.pop(name, None)
            if tl is not None:
                meta = next(iter(metas.values()))
                tl.negotiated(tracks(name, meta), meta.kind)
        return ready

    def take_completed_join(self) -> Optional[int]:
        """When every rank has joined: the last one to join (join()'s result), and the join is
        over.  None otherwise."""
        if len(self.joined) != self.size:
            return None
        last = self.joined[-1]
        self.joined = []
        return last

    # --- failures -----------------------------------------------------------------------------
    def who_submitted(self, name: str) -> str:
        have = sorted(self.pending.get(name, {}))
        missing = sorted(set(range(self.size)) - set(have) - set(self.joined))
        return f"submitted by ranks {have}, not by ranks {missing}"

    def abandon(self, name: str):
        """Forget ``name``: it failed before every rank submitted it."""
        metas = self.pending.pop(name, None)
        self.first_seen.pop(name, None)
        tl = trace.recorder
        if tl is not None and metas:
            tl.abandoned(tracks(name, next(iter(metas.values()))))

    def abandon_all(self, why: str) -> List[Tuple[str, str]]:
        """Forget every pending name; (name, reason) for each, the reason starting with
        ``why``."""
        failed = [(name, f"{why} tensor '{name}' was reduced: {self.who_submitted(name)}")
                  for name in self.pending]
        for name, _ in failed:
            self.abandon(name)
        return failed

    def check_stalls(self, now: float):
        """Warn about names waiting longer than the stall warning time; past the shutdown time,
        or when the ranks are deadlocked, rank 0 aborts them in its next message (every rank
        then fails them alike)."""
        warn_after = self.config.stall_warning_s
        abort_after = self.config.stall_shutdown_s
        aborting = {name for name, _ in self.abort_next}
        for name, since in list(self.first_seen.items()):
            age = now - since
            if age > warn_after and now - self.warned.get(name, 0.0) > warn_after:
                self.warned[name] = now
                if self.rank == 0:
                    log.warning("stall: tensor '%s' waited %.0f s, %s", name, age,
                                self.who_submitted(name))
            if abort_after > 0 and age > abort_after and self.rank == 0 \
                    and name not in aborting:
                self.abort_next.append((name, f"tensor '{name}' stalled for more than "
                                              f"{abort_after:.0f} s (HOROVOD_STALL_SHUTDOWN_"
                                              f"TIME_SECONDS); {self.who_submitted(name)}"))
        self._check_deadlock(now)

    def _check_deadlock(self, now: float):
        """Every rank that has not joined is blocked waiting, and nothing pending has been
        submitted by all of them: no rank can submit the missing requests, so none of them
        can ever complete (Horovod waits forever here).  Past the deadlock time, rank 0 stops
        every rank's engine, naming who submitted what: the ranks' programs have diverged (and
        with them the counters that name unnamed requests), so every later call would
        mismatch too; as after a communication failure, ``hvd.init()`` starts afresh (and
        elastic training restores its state)."""
        limit = self.config.deadlock_s
        needed = set(range(self.size)) - set(self.joined)
        if limit <= 0 or not self.pending or not needed <= self.waiting:
            self.deadlocked_since = None
            return
        if self.deadlocked_since is None:
            self.deadlocked_since = now
        if now - self.deadlocked_since < limit or self.rank != 0:
            return
        who = "; ".join(f"'{name}' {self.who_submitted(name)}" for name in self.pending)
        reason = (f"deadlock: every rank has been blocked for {limit:g} s "
                  f"(HOROVOD_DEADLOCK_TIME_SECONDS) on collectives that not every rank "
                  f"submitted: {who}. The ranks called collectives in different orders, or "
                  f"some ranks skipped one (for example after an exception on those ranks); "
                  f"call hvd.init() again to start afresh")
        self.abort_next.append((STOP_ALL, reason))
        self.deadlocked_since = None
