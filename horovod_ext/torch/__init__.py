"""``import horovod_ext.torch as hvd``: Horovod's PyTorch API on horovod_ext's runtime."""
# flake8: noqa: F401 - this module re-exports the public API
import torch as _torch

from horovod_ext.engine import process_sets as _process_sets
from horovod_ext.engine import runtime as _runtime
from horovod_ext.backends.base import CommunicationError
from horovod_ext.config import ConfigError
from horovod_ext.engine import Handle, HorovodInternalError
from horovod_ext.ops import Average, Max, Min, Op, Product, Sum, register_op, registered_ops
from .compression import Compression
from .functions import broadcast_optimizer_state, broadcast_parameters
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm
from .sparse import sparse_allreduce, sparse_allreduce_async
from horovod_ext.engine.process_sets import (ProcessSet, add_process_set, global_process_set,
                                             remove_process_set)
from . import mpi_ops as _mpi_ops
from .differentiable import (allgather, allreduce, alltoall, broadcast, grouped_allgather,
                             grouped_allreduce, grouped_reducescatter, reducescatter)
from .mpi_ops import (allgather_async, allgather_object, allreduce_, allreduce_async,
                      allreduce_async_, alltoall_async, barrier, broadcast_, broadcast_async,
                      broadcast_async_, broadcast_object, grouped_allgather_async,
                      grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_,
                      grouped_reducescatter_async, join, poll, reducescatter_async,
                      synchronize)

# --- ops and optimizers from the papers --------------------------------------------------
# Adasum
from horovod_ext.ops.adasum import Adasum
# 1-bit compressed allreduce and optimizers
from horovod_ext.algorithms.onebit import OnebitAdam, OnebitLamb
from horovod_ext.ops.onebit import OneBit
# LAMB, random-k, SLAMB
from horovod_ext.algorithms.slamb import SLAMB
from horovod_ext.algorithms.lamb import Lamb
from horovod_ext.ops.randomk import RandomK
from horovod_ext.ops.powersgd import PowerSGD
# compressed averages for DiLoCo's outer step: SparseLoCo's top-k, the chunked quantiser
from horovod_ext.ops.sparseloco import SparseLoCo
from horovod_ext.ops.quantized import Quantized
from .diloco import DiLoCo
from . import elastic
from .elastic import HostsUpdatedInterrupt



def init(comm=None, process_sets=None):
    """Start horovod_ext on this process (a collective call on every rank).  ``process_sets``:
    ProcessSet objects to register now, or "dynamic" to allow ``add_process_set`` later (as
    HOROVOD_DYNAMIC_PROCESS_SETS=1 does)."""
    if _runtime.is_initialized():
        if _runtime.engine().running:
            return
        try:  # stopped by a failure (a lost peer, a deadlock) or a peer's shutdown: afresh
            shutdown()
        except HorovodInternalError:
            pass  # the requests it failed have reported the reason
    _runtime.init(comm)
    _mpi_ops.reset_names()
    _process_sets.start(process_sets)


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return _runtime.is_initialized()


def shutdown():
    """Stop every engine; pending requests that cannot complete fail with an error."""
    _process_sets.forget()
    _runtime.shutdown()


def rank() -> int:
    """This process's rank in the job, 0 to ``size() - 1`` (HOROVOD_RANK under hvdrun,
    OMPI_COMM_WORLD_RANK under mpirun, RANK under torchrun)."""
    return _runtime.topology().rank


def size() -> int:
    """The number of processes in the job."""
    return _runtime.topology().size


def local_rank() -> int:
    """This process's rank among the processes on its host: the GPU to pin it to,
    ``torch.cuda.set_device(hvd.local_rank())``."""
    return _runtime.topology().local_rank


def local_size() -> int:
    """The number of processes on this process's host."""
    return _runtime.topology().local_size


def cross_rank() -> int:
    """The index of this process's host among the hosts (the rank of its group of
    same-``local_rank`` processes across hosts)."""
    return _runtime.topology().cross_rank


def cross_size() -> int:
    """The number of hosts that run a process with this ``local_rank``."""
    return _runtime.topology().cross_size


def is_homogeneous() -> bool:
    """True when every host runs the same number of processes (the hierarchical
    allreduce needs it)."""
    return _runtime.topology().is_homogeneous


def mpi_built() -> bool:
    """True when mpi4py is installed, so ``mpirun`` can start a job over MPI."""
    try:
        import mpi4py  # noqa: F401
        return True
    except ImportError:
        return False


def gloo_built() -> bool:
    """True when this torch build has torch.distributed's Gloo backend."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_gloo_available()


def nccl_built() -> bool:
    """True when this torch build has NCCL (CUDA builds), used for CUDA tensors."""
    import torch.distributed as dist
    return dist.is_available() and dist.is_nccl_available()


def cuda_built() -> bool:
    """True when torch was built with CUDA."""
    return _torch.backends.cuda.is_built()


def rocm_built() -> bool:
    """True when torch was built with ROCm."""
    return getattr(_torch.version, "hip", None) is not None


def ccl_built() -> bool:
    """Intel oneCCL is not a transport of horovod_ext."""
    return False


def ddl_built() -> bool:
    """IBM DDL is not a transport of horovod_ext."""
    return False


def mpi_enabled() -> bool:
    """True when this job's collectives run over MPI (started under ``mpirun``)."""
    return _runtime.state.transport == "mpi"


def gloo_enabled() -> bool:
    """True when this job's collectives run over torch.distributed (Gloo, or NCCL
    for CUDA tensors)."""
    return _runtime.state.transport == "gloo"


def mpi_threads_supported() -> bool:
    """True when running over MPI with ``MPI_THREAD_MULTIPLE``, so other threads may
    call MPI alongside horovod_ext."""
    if not mpi_enabled():
        return False
    from mpi4py import MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def start_timeline(file_path, mark_cycles=False):
    """Write a timeline (Chrome trace) of every collective to ``file_path`` from now on;
    ``mark_cycles`` marks each engine cycle.  Rank 0 writes it (every rank, each to its own
    ``<stem>.rank<N>.json``, with HOROVOD_TIMELINE_ALL_RANKS=1)."""
    _runtime.start_timeline(file_path, mark_cycles)


def stop_timeline():
    """Stop writing the timeline and complete its file."""
    _runtime.stop_timeline()
