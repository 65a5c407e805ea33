"""Failures between ranks: what this rank does when a peer fails, and how its own failures
reach the peers (over the heartbeat channel, backends/liveness.py).

A rank whose engine fails (an op raised, a transfer failed) reports it; every peer in the
process set concerned then fails its waiting requests with an error naming the culprit, within a
round trip, instead of waiting in a transfer for the timeout.  A rank that dies or stops
answering fails every set it belongs to.  Under MPI, whose calls cannot be interrupted, the job
ends instead with the same reason, as it does on a deadlock.

Under hvdrun's elastic mode the heartbeat channel keeps the worker ids of ranks that stopped
answering, and the next join asks the driver to drop them like dead ones (liveness.py).
"""
import os
from typing import Callable, Dict, List, Optional

from horovod_ext.backends import bootstrap
from horovod_ext.backends.liveness import EVERY_SET, Liveness, Notice
from horovod_ext.config import Config

from .engine import Engine


class FaultRouter:
    """Delivers peers' failures to this rank's engines; ``sets()`` is the runtime's table of
    process sets (id -> an object with ``engine``, None where this rank is no member)."""

    def __init__(self, world, transport: str, sets: Callable[[], Dict[int, object]]):
        self.world, self.transport, self._sets = world, transport, sets
        self.liveness: Optional[Liveness] = None

    @classmethod
    def start(cls, world, transport: str, config: Config,
              sets: Callable[[], Dict[int, object]]) -> "FaultRouter":
        """Collective over the world: connect the heartbeat channel."""
        router = cls(world, transport, sets)
        identity = f"pid {os.getpid()} on host {bootstrap.hostname()}"
        worker = os.environ.get("HOROVOD_ELASTIC_WORKER", "")
        router.liveness = Liveness.connect(world, config.heartbeat_s, config.timeout_s,
                                           config.control_iface, identity, worker,
                                           router.on_notice)
        return router

    def watch(self, engine: Engine, set_id: int):
        """Let ``engine`` (process set ``set_id``'s) report its own failures to the peers."""
        if self.liveness is not None:
            liveness = self.liveness
            engine.report_failure = lambda reason: liveness.report(set_id, reason)

    def on_notice(self, notice: Notice):
        if self.transport == "mpi":   # nothing can end a blocked MPI call but the job's end
            self.world.end_job(notice.reason)
            return
        for engine in self._engines_in(notice.scope):
            engine.fail_from_peer(notice.reason)

    def _engines_in(self, scope: int) -> List[Engine]:
        sets = dict(self._sets())
        chosen = sets.values() if scope == EVERY_SET else [sets.get(scope)]
        return [s.engine for s in chosen if s is not None and s.engine is not None]

    def close(self):
        if self.liveness is not None:
            self.liveness.close()
            self.liveness = None


__all__ = ["EVERY_SET", "FaultRouter"]
