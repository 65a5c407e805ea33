"""Optional C kernels: find a library that setup.py built next to its package and load it.

Algorithms ship their hot loops as plain C files (no Python API) that setup.py compiles as
optional extensions; where there is no compiler the build skips them and the algorithms use their
torch code instead.  ``HOROVOD_NATIVE_KERNELS=0`` forces the torch code (to compare the two, or to
rule the kernels out when hunting a problem).
"""
import ctypes
import importlib.util
import os
from typing import Dict, Optional, Sequence

import torch

ENV = "HOROVOD_NATIVE_KERNELS"


def enabled() -> bool:
    raw = os.environ.get(ENV, "").strip().lower()
    if raw in ("", "1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{ENV}={os.environ[ENV]!r} is not valid: expected 0 or 1")


def load(module: str, signatures: Dict[str, Sequence]) -> Optional[ctypes.CDLL]:
    """The built library of ``module`` (e.g. "horovod_ext.algorithms.adasum._kernels") with argument types set from
    ``signatures`` (function name -> ctypes argument types), or None when it is not built or
    the kernels are switched off."""
    if not enabled():
        return None
    try:
        spec = importlib.util.find_spec(module)
    except ImportError:
        return None
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes = list(argtypes)
            fn.restype = None
    except (OSError, AttributeError):  # a stale or foreign build: the torch code still works
        return None
    return lib


def takes(dtype: torch.dtype, *tensors: Optional[torch.Tensor]) -> bool:
    """Whether a CPU kernel can work on ``tensors`` in place: all (None skipped) contiguous on
    the CPU with ``dtype``."""
    return all(t is None or (t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous())
               for t in tensors)
