"""Each rank's share of its host's cores for torch's intra-op threads.

torch gives every process as many intra-op threads as the host has cores, so k ranks on one
host run k times as many threads as there are cores.  The engine's large copies and reductions
then wait on descheduled threads: a 16 MiB allreduce between two ranks on two cores took 46 ms
with two threads each and 4.7 ms with one.  torchrun sets OMP_NUM_THREADS=1 for this reason;
hvdrun, mpirun, Slurm and Ray start ranks without it, so ``hvd.init`` gives each local rank its
share of the cores instead, unless OMP_NUM_THREADS says what the user wants.
"""
import logging
import os
from typing import Optional

import torch

logger = logging.getLogger("horovod_ext")


def share_of_cores(local_size: int, usable: int, on_host: int) -> int:
    """Threads for one of ``local_size`` ranks that may run on ``usable`` of the host's
    ``on_host`` cores.  A rank confined to fewer cores than the host has was placed by its
    launcher (mpirun's binding, a Slurm cpuset), so those cores are its own share already."""
    if usable < on_host:
        return max(1, usable)
    return max(1, usable // max(1, local_size))


def limit_to_share(local_size: int) -> Optional[int]:
    """Lower torch's intra-op threads to this rank's share of the cores where several ranks
    share the host and OMP_NUM_THREADS is unset; the new count, or None if left as it was."""
    if local_size <= 1 or os.environ.get("OMP_NUM_THREADS"):
        return None
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = share_of_cores(local_size, usable or 1, os.cpu_count() or 1)
    if torch.get_num_threads() <= share:
        return None
    logger.info("%d ranks share this host: torch.set_num_threads(%d) on each (set "
                "OMP_NUM_THREADS to choose another count)", local_size, share)
    torch.set_num_threads(share)
    return share
