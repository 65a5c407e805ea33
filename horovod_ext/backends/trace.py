"""Timeline hooks: the activities that the engine, the collectives and the algorithms mark.

A timeline (horovod_ext/timeline.py) installs itself as ``recorder`` while it records.  Until
then every hook is one test of that global and hands back a shared no-op context.  Activities
land on the tracks of the tensors being executed on the calling thread (the engine sets them),
so an algorithm marks its phases without knowing which tensors it is reducing.
"""
from typing import Optional

import torch

recorder = None   # the recording Timeline, or None


class _Nothing:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False


NOTHING = _Nothing()


def activity(name: str, nbytes: int = 0, **args):
    """``with activity("ONEBIT_COMPRESS", nbytes):`` marks a phase on the current tracks."""
    r = recorder
    if r is None:
        return NOTHING
    return r.activity(name, nbytes, args)


def nbytes_of(tensor: Optional[torch.Tensor]) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def current_tracks():
    """The calling thread's tracks, to hand to work done on another thread (None when off)."""
    r = recorder
    return None if r is None else r.tracks()


def transfer(comm, what: str, tensor: Optional[torch.Tensor], nbytes: Optional[int] = None,
             tracks=None):
    """A data transfer ``what`` (ALLREDUCE, ALLGATHER...) over ``comm``, named by the transport
    that carries ``tensor`` there (MPI_ALLREDUCE, GLOO_ALLGATHER, NCCL_ALLREDUCE...);
    ``tracks`` from ``current_tracks()`` when it runs on another thread."""
    r = recorder
    if r is None:
        return NOTHING
    name = f"{comm.transport(tensor)}_{what}"
    return r.activity(name, nbytes_of(tensor) if nbytes is None else nbytes, None, tracks)
