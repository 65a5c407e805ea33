"""Horovod's collective API for torch tensors: sync, async and in-place forms.

Each call becomes a named request for the background engine of its process set; async forms
return a handle for ``synchronize``/``poll``.  Names default to a per-set, per-kind counter, so
unnamed calls must be made in the same order on every rank of the set (as in Horovod); named
calls may come in any order.  The synchronous forms here do not record gradients:
``differentiable.py`` wraps them for tensors that require grad.
"""
import pickle
from typing import List

import torch

from horovod_ext.engine import JOIN_NAME, Handle, Request, runtime
from horovod_ext.engine.fast_lane import key_of
from horovod_ext.engine.process_sets import global_process_set, set_id_of
# Horovod's mpi_ops module names every reduction op.
from horovod_ext.ops import Adasum, Average, Max, Min, Product, Sum, get_op  # noqa: F401

from .calls import (GroupHandle, _check_process_set, _check_tensor, _name, _resolve_op,
                    _set_size, _submit, reset_names, set_rank_of)  # noqa: F401 (re-exported)
from .compression import Compression


def _first(results):
    return results[0]


# --- allreduce ------------------------------------------------------------------------------
def _allreduce_request(tensors, name, op, average, prescale_factor, postscale_factor,
                       kind_name, inplace, process_set):
    _check_process_set(process_set)
    reduce_op = _resolve_op(op, average)
    if not tensors:
        raise ValueError(f"{kind_name} needs at least one tensor")
    for t in tensors:
        _check_tensor(t, kind_name)
        reason = reduce_op.check_dtype(t.dtype)
        if reason is None and t.dtype == torch.bool and (prescale_factor != 1.0
                                                          or postscale_factor != 1.0):
            reason = "bool tensors cannot be scaled"
        if reason:
            raise TypeError(f"{kind_name}: {reason}")
    if len(tensors) > 1 and len({(t.dtype, t.device) for t in tensors}) > 1:
        raise ValueError(f"{kind_name}: all tensors of a group need the same dtype and device")
    return Request(_name(kind_name, name, process_set), "allreduce",
                   [t.detach() for t in tensors], outputs=list(tensors) if inplace else None,
                   op=reduce_op.name, prescale=float(prescale_factor),
                   postscale=float(postscale_factor))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0, process_set=global_process_set, *,
        _wake=True) -> Handle:
    """Start an allreduce of ``tensor`` over the ranks of ``process_set``; returns a handle
    whose ``synchronize`` gives a new tensor with the result.  ``op``: a registry op
    (default Average); ``average`` is Horovod's older spelling (True: Average, False: Sum).
    The result is ``postscale_factor * reduce(prescale_factor * tensor)``."""
    req = _allreduce_request([tensor], name, op, average, prescale_factor, postscale_factor,
                             "allreduce", False, process_set)
    return _submit(req, _first, _wake, process_set)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0, process_set=global_process_set, *,
        _wake=True) -> Handle:
    """In-place ``allreduce_async``: ``synchronize`` writes the result into ``tensor``
    and returns it."""
    req = _allreduce_request([tensor], name, op, average, prescale_factor, postscale_factor,
                             "allreduce", True, process_set)
    return _submit(req, _first, _wake, process_set)


def _allreduce_now(tensor, average, name, op, prescale_factor, postscale_factor, process_set,
                   in_place: bool):
    """A synchronous allreduce of one tensor.  A named call that recurs (same op, scaling,
    dtype and shape; in place, the same memory too) takes the engine's steady-state lane once
    it has completed on the general path (fast_lane.py)."""
    def request():
        return _allreduce_request([tensor], name, op, average, prescale_factor,
                                  postscale_factor, "allreduce", in_place, process_set)

    key = None
    if name is not None and average is None:
        key = key_of(tensor, Average if op is None else op, prescale_factor, postscale_factor,
                     in_place)
    if key is None:
        return synchronize(_submit(request(), _first, False, process_set))
    engine = runtime.engine_for(set_id_of(process_set))
    outcome = engine.allreduce_cached(name, key, tensor, request)
    if isinstance(outcome, torch.Tensor):
        return outcome
    if outcome is None:
        req = request()
        req.lane_key = key
        outcome = engine.submit(req, wake=False)
    outcome.post = _first
    return synchronize(outcome)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """A new tensor holding the reduction of ``tensor`` over all ranks (default: Average)."""
    wire, ctx = compression.compress(tensor)
    result = _allreduce_now(wire, average, name, op, prescale_factor, postscale_factor,
                            process_set, in_place=False)
    return compression.decompress(result, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=global_process_set):
    """In-place allreduce; returns ``tensor``."""
    return _allreduce_now(tensor, average, name, op, prescale_factor, postscale_factor,
                          process_set, in_place=True)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set, *,
        _wake=True) -> Handle:
    """Start one fused allreduce of every tensor in ``tensors`` (same dtype and
    device); ``synchronize`` returns the list of new result tensors."""
    req = _allreduce_request(list(tensors), name, op, average, prescale_factor,
                             postscale_factor, "grouped_allreduce", False, process_set)
    return _submit(req, list, _wake, process_set)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set, *,
        _wake=True) -> Handle:
    """In-place ``grouped_allreduce_async``: the results are written into
    ``tensors``."""
    req = _allreduce_request(list(tensors), name, op, average, prescale_factor,
                             postscale_factor, "grouped_allreduce", True, process_set)
    return _submit(req, list, _wake, process_set)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set) -> List[torch.Tensor]:
    """Reduce several tensors as one fused request; returns new tensors."""
    packed = [compression.compress(t) for t in tensors]
    handle = grouped_allreduce_async([w for w, _ in packed], average, name, op,
                                     prescale_factor, postscale_factor, process_set,
                                     _wake=False)
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(synchronize(handle), packed)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=global_process_set):
    """In-place ``grouped_allreduce``: waits, writes the results into ``tensors``
    and returns them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set, _wake=False))


# --- allgather, broadcast, alltoall, reducescatter -----------------------------------------------
def allgather_async(tensor, name=None, process_set=global_process_set, *,
        _wake=True) -> Handle:
    """Start an allgather of ``tensor`` (first dimensions may differ between ranks);
    ``synchronize`` returns the concatenation along dim 0 in rank order."""
    _check_process_set(process_set)
    _check_tensor(tensor, "allgather")
    return _submit(Request(_name("allgather", name, process_set), "allgather", [tensor.detach()]),
                   _first, _wake, process_set)


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Concatenation of every rank's tensor along dim 0 (first dimensions may differ)."""
    return synchronize(allgather_async(tensor, name, process_set, _wake=False))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set, *,
        _wake=True) -> GroupHandle:
    """Allgather of each tensor; one handle whose result is the list of results."""
    tensors = _group_of(tensors, "grouped_allgather")
    name = _name("grouped_allgather", name, process_set)
    return GroupHandle([allgather_async(t, f"{name}.{i}", process_set, _wake=_wake)
                        for i, t in enumerate(tensors)])


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> List[torch.Tensor]:
    return synchronize(grouped_allgather_async(tensors, name, process_set, _wake=False))


def _group_of(tensors, what: str) -> list:
    tensors = list(tensors)
    if not tensors:
        raise ValueError(f"{what} needs at least one tensor")
    return tensors


def _broadcast_request(tensor, root_rank, name, inplace, process_set):
    _check_process_set(process_set)
    _check_tensor(tensor, "broadcast")
    root = set_rank_of(root_rank, process_set, "broadcast root_rank")
    return Request(_name("broadcast", name, process_set), "broadcast", [tensor.detach()],
                   outputs=[tensor] if inplace else None, root=root)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set, *,
        _wake=True) -> Handle:
    """Start a broadcast of ``root_rank``'s ``tensor``; ``synchronize`` returns a new
    tensor holding it on every rank."""
    return _submit(_broadcast_request(tensor, root_rank, name, False, process_set), _first,
                   _wake, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set, *,
        _wake=True) -> Handle:
    """In-place ``broadcast_async``: ``synchronize`` writes ``root_rank``'s values
    into ``tensor`` on every rank."""
    return _submit(_broadcast_request(tensor, root_rank, name, True, process_set), _first,
                   _wake, process_set)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    return synchronize(broadcast_async(tensor, root_rank, name, process_set, _wake=False))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """In-place broadcast: waits and writes ``root_rank``'s values into ``tensor``;
    returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set, _wake=False))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set, *,
        _wake=True) -> Handle:
    """Handle whose result is ``(received tensor, received splits)``."""
    _check_process_set(process_set)
    _check_tensor(tensor, "alltoall")
    size = _set_size(process_set)
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    if splits is None:
        if tensor.shape[0] % size:
            raise ValueError(f"alltoall: first dimension {tensor.shape[0]} is not divisible by "
                             f"{size} ranks; pass splits")
        splits = [tensor.shape[0] // size] * size
    if isinstance(splits, torch.Tensor) and splits.is_floating_point():
        raise ValueError(f"alltoall splits must be integers, got a {splits.dtype} tensor")
    splits = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(splits) != size or any(s < 0 for s in splits) or sum(splits) != tensor.shape[0]:
        raise ValueError(f"alltoall splits {splits} must be {size} non-negative numbers summing "
                         f"to the first dimension {tensor.shape[0]}")
    return _submit(Request(_name("alltoall", name, process_set), "alltoall", [tensor.detach()],
                           splits=tuple(splits)), _first, _wake, process_set)


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rank i gets rows splits[i] of every rank's tensor: the received tensor, and with
    ``splits`` given also the received splits (as in Horovod)."""
    received, received_splits = synchronize(alltoall_async(tensor, splits, name, process_set,
                                                           _wake=False))
    return received if splits is None else (received, received_splits)


def _reducescatter_request(tensor, name, op, prescale_factor, postscale_factor, process_set):
    _check_process_set(process_set)
    _check_tensor(tensor, "reducescatter")
    reduce_op = get_op(op)
    if not reduce_op.elementwise:
        # NotImplementedError is a RuntimeError, the type Horovod raises here.
        raise NotImplementedError(f"reducescatter supports Sum, Average, Min, Max and Product, "
                                  f"not {reduce_op.name}")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    reason = reduce_op.check_dtype(tensor.dtype)
    if reason:
        raise TypeError(f"reducescatter: {reason}")
    return Request(_name("reducescatter", name, process_set), "reducescatter",
                   [tensor.detach()], op=reduce_op.name, prescale=float(prescale_factor),
                   postscale=float(postscale_factor))


def reducescatter_async(tensor, name=None, op=Average, prescale_factor=1.0,
                        postscale_factor=1.0, process_set=global_process_set, *,
        _wake=True) -> Handle:
    """Start a reducescatter; ``synchronize`` returns this rank's block of dim 0
    of the reduction (earlier ranks get the extra rows)."""
    return _submit(_reducescatter_request(tensor, name, op, prescale_factor, postscale_factor,
                                          process_set), _first, _wake, process_set)


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Reduce over ranks and keep this rank's block of dim 0 (earlier ranks get the extra rows)."""
    wire, ctx = compression.compress(tensor)
    return compression.decompress(
        synchronize(reducescatter_async(wire, name, op, prescale_factor, postscale_factor,
                                        process_set, _wake=False)), ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, prescale_factor=1.0,
                                postscale_factor=1.0, process_set=global_process_set, *,
        _wake=True) -> GroupHandle:
    """Reducescatter of each tensor; one handle whose result is the list of results.  Every
    tensor is checked before any request goes out."""
    tensors = _group_of(tensors, "grouped_reducescatter")
    name = _name("grouped_reducescatter", name, process_set)
    requests = [_reducescatter_request(t, f"{name}.{i}", op, prescale_factor, postscale_factor,
                                       process_set) for i, t in enumerate(tensors)]
    return GroupHandle([_submit(r, _first, _wake, process_set) for r in requests])


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          prescale_factor=1.0, postscale_factor=1.0,
                          process_set=global_process_set) -> List[torch.Tensor]:
    packed = [compression.compress(t) for t in _group_of(tensors, "grouped_reducescatter")]
    handle = grouped_reducescatter_async([w for w, _ in packed], name, op, prescale_factor,
                                         postscale_factor, process_set, _wake=False)
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(synchronize(handle), packed)]


# --- control ----------------------------------------------------------------------------------
def synchronize(handle: Handle):
    """Wait for an async call and return its result (raises its error)."""
    if not callable(getattr(handle, "wait", None)):
        raise TypeError(f"synchronize expects a handle from an *_async call, got {handle!r}")
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True once the async call has finished (synchronize will not block)."""
    if not callable(getattr(handle, "done", None)):
        raise TypeError(f"poll expects a handle from an *_async call, got {handle!r}")
    return handle.done()


def join(device=-1) -> int:
    """Wait until every rank has joined; until then this rank contributes zeros to the others'
    allreduces (on GPU ``device``, or the current one, for their CUDA tensors).  Returns the
    rank that joined last."""
    gpu = []  # an empty tensor that says where this rank's zeros go
    if torch.cuda.is_available() and (device >= 0 or torch.cuda.is_initialized()):
        gpu = [torch.empty(0, device=torch.device(
            "cuda", device if device >= 0 else torch.cuda.current_device()))]
    from .reduction import lane   # here: the reduction package imports this module
    farewells = lane.before_join()
    try:
        return synchronize(_submit(Request(JOIN_NAME, "join", gpu), _first, wake=False))
    finally:
        lane.after_join(farewells)


def barrier(process_set=global_process_set):
    """Wait until every rank of ``process_set`` has reached this call."""
    _check_process_set(process_set)
    synchronize(_submit(Request(_name("barrier", None, process_set), "barrier", []),
                        wake=False, process_set=process_set))


# --- objects ----------------------------------------------------------------------------------
def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """``obj`` from ``root_rank`` (a world rank), pickled, on every rank of the set."""
    _check_process_set(process_set)
    name = _name("broadcast_object", name, process_set)
    me = runtime.topology().rank
    payload = (torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
               if me == root_rank else torch.empty(0, dtype=torch.uint8))
    length = broadcast(torch.tensor([payload.numel()], dtype=torch.int64), root_rank,
                       name=f"{name}.len", process_set=process_set)
    if me != root_rank:
        payload = torch.empty(int(length[0]), dtype=torch.uint8)
    data = broadcast(payload, root_rank, name=f"{name}.data", process_set=process_set)
    return obj if me == root_rank else pickle.loads(data.numpy().tobytes())


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Every rank's ``obj``, in rank order of the set."""
    _check_process_set(process_set)
    name = _name("allgather_object", name, process_set)
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = allgather(torch.tensor([payload.numel()], dtype=torch.int64), name=f"{name}.len",
                      process_set=process_set)
    data = allgather(payload, name=f"{name}.data", process_set=process_set).numpy()
    out, offset = [], 0
    for n in sizes.tolist():
        out.append(pickle.loads(data[offset:offset + n].tobytes()))
        offset += n
    return out
