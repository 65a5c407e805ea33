"""The communication context of the running job, for the algorithms of layer 2.

``adasum/``, ``onebit/`` and ``slamb/`` may import only the backends, yet their optimizers must
talk over the job's communicators, and in the same order on every rank as every other horovod_ext
collective.  The runtime installs a ``CommContext`` at ``hvd.init()``: its ``execute(name, fn)``
runs ``fn(topology)`` as a named request of the background engine (negotiated across ranks like
any tensor, so it never interleaves differently with other collectives, and is covered by the
stall check and the communication timeout).
"""
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .topology import Topology


@dataclass
class CommContext:
    topology: Topology
    hierarchical_allreduce: bool
    # execute(name, fn): run fn(topology) on every rank as one negotiated request; fn's result
    execute: Callable[[str, Callable[[Topology], Any]], Any]
    # submit(name, fn): the same without waiting: a handle whose wait() returns fn's result (or
    # raises its error); fn runs on the engine's thread, so it must touch only data that the
    # caller leaves alone until wait() returns
    submit: Optional[Callable[[str, Callable[[Topology], Any]], Any]] = None


_current: Optional[CommContext] = None


def set_context(context: Optional[CommContext]) -> None:
    global _current
    _current = context


def current() -> CommContext:
    """The running job's context; a clear error before ``hvd.init()``."""
    if _current is None:
        raise RuntimeError("horovod_ext has not been initialized; call hvd.init() before "
                           "creating or stepping a distributed optimizer")
    return _current
