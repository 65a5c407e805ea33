"""Which GPU each rank drives, and whether NCCL can take that layout.

NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected"), but only
when its communicator is first set up, at the first collective on a CUDA tensor (22 s into the
job where this was first seen), and in words that do not say what to change.  The usual cause
is Horovod's recipe left out: without ``torch.cuda.set_device(hvd.local_rank())`` every rank of
a host uses cuda:0.
``TorchCommunicator`` therefore gathers each rank's ``Gpu`` over Gloo right before its first
NCCL collective (by then the ranks have placed their tensors: Horovod's recipe pins the device
only after ``hvd.init()``, which is why this cannot be decided at init), and
``shared_gpu_message`` says which ranks share a GPU and how to fix it.

Two ranks share a GPU when they run on the same host (the real host name, as NCCL groups ranks
by host, not HOROVOD_HOSTNAME) and name the same device: by UUID where torch reports one, which
also catches one GPU seen under different indices through CUDA_VISIBLE_DEVICES, else by index.
"""
import socket
from collections import defaultdict
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from .base import RefusedOnEveryRank


class Gpu(NamedTuple):
    host: str
    device: Union[int, str]      # the UUID where torch reports one, else the index on the host
    index: Optional[int] = None  # torch's index in that process, for the message


class SharedGpuError(RefusedOnEveryRank):
    """Ranks of one NCCL communicator drive the same GPU.  Not a CommunicationError: the
    transport is intact, every rank decided alike from the gathered GPUs, and only CUDA requests
    fail (CPU ones still run)."""


FIX = ("Pin each process to its own GPU, Horovod's recipe: call "
       "torch.cuda.set_device(hvd.local_rank()) right after hvd.init() and before creating "
       "CUDA tensors (then start at most as many ranks per host as it has GPUs). Where ranks "
       "must share a GPU, set HOROVOD_GPU_OPERATIONS=mpi: CUDA tensors then go through host "
       "memory over Gloo instead of NCCL.")


def local_gpu(device: torch.device) -> Gpu:
    """This process's identity of the CUDA ``device``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return Gpu(socket.gethostname(), str(uuid) if uuid else index, index)


def _name(gpu: Tuple) -> str:
    device = gpu[1]
    index = gpu[2] if len(gpu) > 2 else None
    if isinstance(device, int):
        return f"cuda:{device}"
    return f"GPU {device}" if index is None else f"cuda:{index} (GPU {device})"


def shared_gpus(gpus: Sequence[Tuple], ranks: Optional[Sequence[int]] = None
                ) -> List[Tuple[str, str, List[int]]]:
    """(host, device name, ranks) for every GPU that more than one rank drives; ``gpus[i]`` is
    the (host, device[, index]) of rank ``ranks[i]`` (default i), device an index or a UUID."""
    ranks = range(len(gpus)) if ranks is None else ranks
    sharing: Dict[Tuple[str, Union[int, str]], List[int]] = defaultdict(list)
    first: Dict[Tuple[str, Union[int, str]], Tuple] = {}
    for rank, gpu in zip(ranks, gpus):
        sharing[(gpu[0], gpu[1])].append(rank)
        first.setdefault((gpu[0], gpu[1]), gpu)
    return [(key[0], _name(first[key]), members)
            for key, members in sharing.items() if len(members) > 1]


def _ranks(members: Sequence[int]) -> str:
    words = [str(r) for r in members]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def shared_gpu_message(gpus: Sequence[Tuple], ranks: Optional[Sequence[int]] = None,
                       shown: int = 4) -> Optional[str]:
    """None when every rank drives a GPU of its own, else the error to raise: which ranks share
    which GPU (the first ``shown`` GPUs), and the fix; arguments as ``shared_gpus``."""
    shared = shared_gpus(gpus, ranks)
    if not shared:
        return None
    parts = [f"ranks {_ranks(members)} all use {name} on host {host}"
             for host, name, members in shared[:shown]]
    if len(shared) > shown:
        parts.append(f"{len(shared) - shown} more GPUs are shared likewise")
    return ("NCCL cannot run two ranks of one job on the same GPU, and " + "; ".join(parts)
            + ". " + FIX)
