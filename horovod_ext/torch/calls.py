"""What every collective call shares on its way to the engine: argument checks, request names,
submission to the engine of the call's process set, and the handle of a grouped call.

Names default to a per-set, per-kind counter, so unnamed calls must be made in the same order on
every rank of the set (as in Horovod); named calls may come in any order.
"""
import itertools
from typing import List, Optional

import torch

from horovod_ext.engine import Handle, Request, runtime
from horovod_ext.engine.process_sets import global_process_set, set_id_of
from horovod_ext.ops import Average, Op, Sum, get_op

_SUPPORTED = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
              torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool}
_counters = {}


def _check_process_set(process_set) -> int:
    """The set's id, after checking that this rank may call a collective on it."""
    set_id = set_id_of(process_set)
    if set_id:
        runtime.engine_for(set_id)  # a clear error on a rank outside the set
    return set_id


def _set_size(process_set) -> int:
    return runtime.set_topology(set_id_of(process_set)).size


def set_rank_of(world_rank, process_set, what: str) -> int:
    """``world_rank`` as a rank of ``process_set`` (collectives take world ranks)."""
    ranks = runtime.process_set_ranks(set_id_of(process_set)) or []
    if (not isinstance(world_rank, int) or isinstance(world_rank, bool)
            or world_rank not in ranks):
        where = "a rank in 0..%d" % (len(ranks) - 1) if set_id_of(process_set) == 0 else \
            f"one of the set's ranks {ranks}"
        raise ValueError(f"{what} {world_rank!r} is not {where}")
    return ranks.index(world_rank)


def reset_names():
    """Unnamed requests count from zero again (at init, on every rank alike)."""
    _counters.clear()


def _name(kind: str, name: Optional[str], process_set=global_process_set) -> str:
    if name is not None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        return name
    set_id = set_id_of(process_set)
    counter = _counters.setdefault((set_id, kind), itertools.count())
    prefix = kind if set_id == 0 else f"{kind}.set{set_id}"
    return f"{prefix}.noname.{next(counter)}"


def _check_tensor(tensor, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _SUPPORTED:
        raise TypeError(f"{what}: dtype {tensor.dtype} is not supported; supported: "
                        f"{sorted(str(d).replace('torch.', '') for d in _SUPPORTED)}")
    if tensor.is_sparse:
        raise TypeError(f"{what}: sparse tensors are not supported; densify them first")
    return tensor


def _resolve_op(op, average) -> Op:
    if op is not None and average is not None:
        raise ValueError("pass either op or the deprecated average argument, not both")
    if op is None:
        op = Sum if average is False else Average
    return get_op(op)


def _submit(request: Request, post=None, wake: bool = True,
            process_set=global_process_set) -> Handle:
    handle = runtime.engine_for(set_id_of(process_set)).submit(request, wake)
    handle.post = post
    return handle


class GroupHandle:
    """The handle of a grouped call made of one request per tensor: its result is the list of
    their results."""

    __slots__ = ("handles",)

    def __init__(self, handles: List[Handle]):
        self.handles = handles

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def wait(self) -> list:
        results, error = [], None
        for h in self.handles:  # wait for all, so no request is left running on failure
            try:
                results.append(h.wait())
            except Exception as exc:  # noqa: B902 - re-raised below, after the others
                error = error or exc
        if error is not None:
            raise error
        return results
