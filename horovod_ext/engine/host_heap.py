"""Keep freed host memory in the process between training steps (glibc's malloc).

glibc hands the top of its heap back to the kernel once more than a few megabytes of it are
free, and serves allocations above a threshold that starts at 128 KiB with fresh mappings.  A
CPU training step frees most of its activations at the end of backward and allocates them again
in the next forward, so every step can fault the same pages in again, each fault costing a few
microseconds: a 0.44 M-parameter transformer step (2 ranks on 2 cores, 240 ms) took 1,000-4,000
minor faults with DistributedOptimizer and 0-2,000 with DDP (counted from /proc per step);
with both limits raised, both took under 100, and in benchmarks/ddp_parity.py the step's
ratio to DDP's went from 1.05-1.09 to 0.97-0.98 (glibc's variables as a ``--variants``).
A CUDA caching allocator keeps its memory for the same reason.  ``hvd.init`` raises them once,
unless HOROVOD_KEEP_HOST_HEAP=0 or the user set glibc's own malloc variables.
"""
import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger("horovod_ext")

# mallopt's parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit hosts: allocations above it are mapped afresh anyway
MMAP_THRESHOLD = 32 * 1024 * 1024
# free memory at the heap's top that stays with the process: a step's activations and more
TRIM_THRESHOLD = 256 * 1024 * 1024
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
                  "MALLOC_MMAP_MAX_")

_done = False


def _glibc():
    """The C library, where it is glibc; None elsewhere (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None
    return libc


def user_chose(env) -> bool:
    """Whether ``env`` sets glibc's malloc parameters itself."""
    return (any(name in env for name in _USER_SETTINGS)
            or "glibc.malloc" in env.get("GLIBC_TUNABLES", ""))


def keep(env=None) -> bool:
    """Raise glibc's trim and mmap thresholds for this process (once); True where they are
    raised now or were before."""
    global _done
    env = os.environ if env is None else env
    if user_chose(env):
        return False
    if _done:
        return True
    libc = _glibc()
    if libc is None:
        return False
    _done = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                 and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _done:
        logger.debug("glibc refused the heap thresholds: it keeps its own")
    return _done
