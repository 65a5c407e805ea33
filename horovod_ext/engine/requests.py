"""What the API hands the engine and gets back: ``Request``, its agreed description
(``RequestMeta``), the ``Handle`` a caller waits on, and the engine's error type.

A request is identified across ranks by its name alone; its ``RequestMeta`` is what every rank
must agree on before it runs (negotiation.py) and what travels between ranks (wire.py).
"""
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

if TYPE_CHECKING:  # the engine imports this module
    from .engine import Engine

NEXT_CYCLE = "next_cycle"   # submit(wake=...): run within one cycle time, batched with others
JOIN_NAME = "__horovod_ext_join__"


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
        if self._done:   # a peer's failure finished it first (faults.py): the caller has that
            return
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


class RequestMeta(NamedTuple):
    """A request's description as one rank submitted it.  A tuple, so that it compares equal to
    (and pickles like) the plain tuple that travels between ranks (wire.py)."""
    kind: str
    op: str
    dtype: str                                # torch dtype without "torch.": "float32"
    device: str                               # "cpu", "cuda"
    shapes: Tuple[Tuple[int, ...], ...]       # one per tensor
    root: int
    splits: Optional[Tuple[int, ...]]
    prescale: float
    postscale: float


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
    meta: Optional[RequestMeta] = None   # set by the engine on submission: describe()
    fn: Optional[Callable] = None   # kind "custom": fn(topology) runs on the engine thread
    lane_key: Optional[Tuple] = None  # a synchronous allreduce that may recur (fast_lane.py)

    def tensor_names(self) -> List[str]:
        if len(self.tensors) == 1:
            return [self.name]
        return [f"{self.name}.{i}" for i in range(len(self.tensors))]

    def describe(self) -> RequestMeta:
        t = self.tensors[0] if self.tensors else None
        dtype = dtype_name(t.dtype) if t is not None else ""
        device = "cpu" if t is None or t.is_cpu else t.device.type
        shapes = tuple(tuple(x.shape) for x in self.tensors)
        return RequestMeta(self.kind, self.op, dtype, device, shapes, self.root, self.splits,
                           self.prescale, self.postscale)


_DTYPE_NAMES: Dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def track(kind: str, name: str) -> str:
    """A tensor's track on the timeline, named as Horovod names it: ``allreduce.<name>``."""
    return name if name.startswith(kind + ".") else f"{kind}.{name}"


def tracks(name: str, meta: RequestMeta) -> Tuple[str, ...]:
    """The tracks of a request's tensors (``Request.tensor_names``) from its description."""
    count = len(meta.shapes)
    if count == 1:
        return (track(meta.kind, name),)
    return tuple(track(meta.kind, f"{name}.{i}") for i in range(count))
