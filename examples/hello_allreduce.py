"""Smallest horovod_ext program: every rank contributes its rank; prints the collectives' results.

    torchrun --nproc_per_node=2 examples/hello_allreduce.py
    mpirun -np 2 python examples/hello_allreduce.py
"""
import torch

import horovod_ext.torch as hvd


def main():
    hvd.init()
    me = torch.tensor([float(hvd.rank())])
    total = hvd.allreduce(me, op=hvd.Sum, name="rank_sum")
    mean = hvd.allreduce(me, name="rank_mean")
    gathered = hvd.allgather(me, name="ranks")
    print(f"rank {hvd.rank()}/{hvd.size()} (local {hvd.local_rank()}/{hvd.local_size()}, "
          f"{'MPI' if hvd.mpi_enabled() else 'Gloo'}): sum={total.item():g} "
          f"mean={mean.item():g} gathered={gathered.tolist()}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
