"""A few training steps of a small MLP with each kind of op, to look at on the timeline.

    .venv/bin/hvdrun -np 2 --timeline-filename /tmp/tour.json .venv/bin/python examples/timeline_tour.py
    .venv/bin/python -m horovod_ext.engine.timeline_plot /tmp/tour.json /tmp/tour.png --zoom ADASUM

Steps with Average (gradient buckets), Adasum, 1-bit (hvd.OneBit) and random-k
(hvd.RandomK(0.1)); open the trace in Perfetto (ui.perfetto.dev) or chrome://tracing, or draw it
with horovod_ext.engine.timeline_plot.
"""
import argparse

import torch

import horovod_ext.torch as hvd


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="steps per op")
    args = p.parse_args()
    hvd.init()
    data = torch.Generator().manual_seed(hvd.rank())
    for label, op in (("average", hvd.Average), ("adasum", hvd.Adasum), ("onebit", hvd.OneBit),
                      ("randomk", hvd.RandomK(0.1))):
        torch.manual_seed(0)   # the same model for each op (an optimizer's hooks stay on it)
        model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 10))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=op)
        for _ in range(args.steps):
            x = torch.randn(64, 784, generator=data)
            y = torch.randint(0, 10, (64,), generator=data)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        if hvd.rank() == 0:
            print(f"{label}: {args.steps} steps", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
