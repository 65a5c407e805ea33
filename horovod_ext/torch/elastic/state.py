"""Elastic training: the ``run`` wrapper and the states it saves, restores and shares.

A job started by hvdrun's elastic mode (``--min-np``/``--max-np``/``--host-discovery-script``)
can lose and gain workers.  ``run(train)`` calls ``train(state)`` and, when a peer fails
(``HorovodInternalError``), restores the state's last ``commit()``, re-forms the job with the
workers still present (``hvd.shutdown()`` then ``hvd.init()``: new ranks, size and topology)
and calls ``train`` again.  When the driver has added workers (``HostsUpdatedInterrupt``, raised
by ``commit()``/``check_host_updates()`` on every rank at once), the job re-forms without losing
uncommitted work.  After each re-forming, ``state.sync()`` gives every worker rank 0's state, so
a worker that just joined starts from it.
"""
import copy
import functools
import logging
from typing import Callable, List

from horovod_ext.backends import bootstrap
from horovod_ext.backends.base import CommunicationError
from horovod_ext.config import ELASTIC_UPDATES_KEY
from horovod_ext.engine import HorovodInternalError, runtime
from horovod_ext.torch import mpi_ops

_log = logging.getLogger("horovod_ext")


class HostsUpdatedInterrupt(RuntimeError):
    """The driver changed the set of workers; ``skip_sync``: no worker needs the state sent."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the set of workers has changed")
        self.skip_sync = skip_sync


def _hosts_updated() -> bool:
    """Whether the driver has changed the workers since this generation formed; the same answer
    on every rank (rank 0 asks the driver's store and tells the others)."""
    membership = bootstrap.elastic_membership
    if membership is None:
        return False
    changed = (runtime.topology().rank == 0 and
               membership.store.add(ELASTIC_UPDATES_KEY, 0) > membership.hosts_updates)
    return bool(mpi_ops.broadcast_object(changed, root_rank=0, name="elastic.hosts_updated"))


class State:
    """What ``run`` saves, restores and shares.  Subclasses define ``save``, ``restore`` and
    ``sync``; ``commit()`` saves and then checks for host changes."""

    def __init__(self):
        self._reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]):
        """Functions called after every re-forming (e.g. to scale the learning rate with the
        new ``hvd.size()``)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Save the state (kept in memory), then raise ``HostsUpdatedInterrupt`` on every rank if
        workers were added.  Commit often enough that a failure loses little work, not so often
        that the copies cost much."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        if _hosts_updated():
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError


class ObjectState(State):
    """Picklable attributes given as keyword arguments (``ObjectState(epoch=0, batch=0)``),
    reachable as ``state.epoch``; ``sync`` broadcasts them from rank 0."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        # get_rank is taken for Horovod's signature; rank 0 is always the one that sends
        super().__init__()
        self._bcast_object = bcast_object or mpi_ops.broadcast_object
        self._names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._saved = {}
        self.save()

    def save(self):
        self._saved = {n: copy.deepcopy(getattr(self, n)) for n in self._names}

    def restore(self):
        for name, value in self._saved.items():
            setattr(self, name, copy.deepcopy(value))

    def sync(self):
        if self._names:
            values = self._bcast_object({n: getattr(self, n) for n in self._names},
                                        root_rank=0)
            for name, value in values.items():
                setattr(self, name, value)
            self.save()


def _reform():
    """Leave the current generation and join the next one."""
    import horovod_ext.torch as hvd
    try:
        hvd.shutdown()
    except (HorovodInternalError, CommunicationError) as exc:  # the failed generation's requests
        _log.info("elastic: leaving a failed generation: %s", exc)
    hvd.init()


def _engine_healthy() -> bool:
    """Whether this rank's engine still runs: an error then came from an op, not a lost peer."""
    engine = runtime.state.engine
    return engine is not None and engine.running and engine.failure is None


def run(func):
    """Decorator for ``train(state, ...)``: re-runs it after restoring ``state`` when a worker
    fails, and after re-forming when workers are added, until it returns."""
    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        if not runtime.is_initialized():
            import horovod_ext.torch as hvd
            hvd.init()
        reset, sync = False, True
        while True:
            if reset:
                _reform()
                state.on_reset()
            try:
                if sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except (HorovodInternalError, CommunicationError) as exc:
                if _engine_healthy():
                    raise   # the op itself failed (bad input, a bug): re-forming cannot help
                if bootstrap.elastic_membership is None:
                    # Not started by hvdrun's elastic mode: nobody to re-form with (under
                    # torchrun, its restart of every worker takes over from here).
                    raise
                _log.warning("elastic: a worker failed (%s); restoring the last commit", exc)
                state.restore()
                sync = True
            except HostsUpdatedInterrupt as exc:
                sync = not exc.skip_sync
            reset = True
    return wrapper
