"""Smallest horovod_ext program: every rank contributes its rank; prints the collectives' results.

    torchrun --nproc_per_node=2 examples/hello_allreduce.py
    mpirun -np 2 python examples/hello_allreduce.py
    torchrun --nproc_per_node=2 examples/hello_allreduce.py --device cuda   # one GPU per rank
"""
import argparse

import torch

import horovod_ext.torch as hvd


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: each rank on the GPU of its local rank")
    args = p.parse_args(argv)
    hvd.init()
    device = "cpu"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            why = "a CPU-only build" if torch.version.cuda is None else "none visible"
            raise SystemExit(f"--device cuda: torch {torch.__version__} sees no CUDA device "
                             f"({why}); use --device cpu")
        torch.cuda.set_device(hvd.local_rank())    # Horovod's recipe: one GPU per process
        device = f"cuda:{hvd.local_rank()}"
    me = torch.tensor([float(hvd.rank())], device=device)
    total = hvd.allreduce(me, op=hvd.Sum, name="rank_sum")
    mean = hvd.allreduce(me, name="rank_mean")
    gathered = hvd.allgather(me, name="ranks")
    print(f"rank {hvd.rank()}/{hvd.size()} (local {hvd.local_rank()}/{hvd.local_size()}, "
          f"{'MPI' if hvd.mpi_enabled() else 'Gloo'}): sum={total.item():g} "
          f"mean={mean.item():g} gathered={gathered.tolist()} on {total.device}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
