"""Fused kernels through torch.compile: which tensors use them, and the compile-on-first-call
wrapper every kernel is declared with.

A kernel is a plain torch function; torch.compile turns it into one or a few fused kernels
(Triton on GPUs, C++ on CPUs), so the same code serves both devices and the tests check it on
CPU tensors (``HOROVOD_FUSED_KERNELS=all``).  Shapes are dynamic: one compilation serves every
size.  Where compiling fails (no compiler, a Triton that cannot build for this GPU) the function
runs uncompiled, with one warning: slower, the same values.
"""
import contextlib
import functools
import logging
import os
import threading
import types

import torch
import torch._dynamo
import torch.fx.experimental._config as fx_config

from horovod_ext import config

_LOG = logging.getLogger("horovod_ext")
_LOCK = threading.Lock()
# Round every intermediate of a float16 / bfloat16 kernel to its dtype, as eager torch does:
# the fused kernels give the torch code's values, not more precise ones.
_OPTIONS = {"emulate_precision_casts": True}
# what a failed compilation raises (a missing compiler or Triton surfaces as one of these)
_COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException,
                   torch._dynamo.exc.FailOnRecompileLimitHit, ImportError, OSError)


@functools.lru_cache(maxsize=4)
def _where(raw) -> str:
    return config.fused_kernels({} if raw is None else {"HOROVOD_FUSED_KERNELS": raw})


def used_for(t: torch.Tensor) -> bool:
    """Whether the fused kernels serve tensors like ``t`` (HOROVOD_FUSED_KERNELS)."""
    where = _where(os.environ.get("HOROVOD_FUSED_KERNELS"))
    return where == "all" or (where == "cuda" and t.is_cuda)


def flat_aliases(tensors) -> list:
    """Each tensor as a one-dimensional alias of its memory (``reshape(-1).detach()`` of a
    contiguous tensor: not a view, so Dynamo guards no base shape, and it shares the version
    counter), for a kernel that takes lists of tensors of any shapes: one graph whatever their
    number of dimensions."""
    return [t.reshape(-1).detach() for t in tensors]


def _signature(args) -> tuple:
    """What a compiled kernel is specialised on besides sizes: dtypes, devices, which optional
    arguments are None, how long lists are.  Paid on every call: for a list that starts with a
    tensor, the first one's device stands for the list's (a kernel's lists are on one device,
    and a tensor's device is slow to read: a LAMB step's 36 tensors took 65 us one by one)."""
    def key(a):
        if isinstance(a, torch.Tensor):
            return (a.dtype, a.device.type)
        if isinstance(a, (list, tuple)):
            if a and isinstance(a[0], torch.Tensor):
                return (a[0].device.type,) + tuple(
                    x.dtype if isinstance(x, torch.Tensor) else key(x) for x in a)
            return tuple(key(x) for x in a)
        return a if a is None or isinstance(a, (bool, int, str)) else type(a)
    return tuple(key(a) for a in args)


def _clone(fn):
    """``fn`` with a code object of its own: torch.compile keeps its cache (and its limit of
    recompilations) per code object, so each signature gets a fresh one."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


def kernel(fn, duck_shapes: bool = True):
    """``fn`` compiled at its first call with each signature (``fn.eager`` stays the
    uncompiled function); ``duck_shapes``: Dynamo's default of one symbol for equal sizes."""
    made = {}
    # duck_shapes=False: equal sizes get symbols of their own, so that a graph compiled for
    # one list of tensors serves another of other sizes (no guard that two sizes are equal)
    shapes = (contextlib.nullcontext if duck_shapes
              else lambda: fx_config.patch(use_duck_shape=False))

    @functools.wraps(fn)
    def run(*args):
        sig = _signature(args)
        compiled = made.get(sig)
        if compiled is None:
            with _LOCK:
                if sig not in made:
                    made[sig] = torch.compile(_clone(fn), dynamic=True, fullgraph=True,
                                              options=_OPTIONS)
                compiled = made[sig]
        if compiled is fn:
            return fn(*args)
        try:
            with shapes():
                return compiled(*args)
        except _COMPILE_ERRORS as exc:  # the same function, uncompiled
            _LOG.warning("horovod_ext: torch.compile of %s failed (%s: %s); it runs uncompiled",
                         fn.__name__, type(exc).__name__, str(exc).splitlines()[0][:200])
            made[sig] = fn
            return fn(*args)

    run.eager = fn
    run.compiled = made      # signature -> compiled function (or fn, where compiling failed)
    return run
