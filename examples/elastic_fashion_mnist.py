"""Train the Fashion-MNIST CNN of fashion_mnist.py elastically: workers may die or join, and
training goes on from the last commit.

    .venv/bin/hvdrun -np 2 --min-np 1 -H localhost:2 .venv/bin/python examples/elastic_fashion_mnist.py
    .venv/bin/hvdrun -np 4 --min-np 2 --max-np 4 --host-discovery-script ./discover_hosts.sh \\
        .venv/bin/python examples/elastic_fashion_mnist.py --epochs 3

The state (model, optimizer, the samples already trained on this epoch, the epoch) is committed
every --commit-every steps and at the end of each epoch.  --kill-worker W --kill-at-step N makes
worker W (hvdrun's worker number) kill itself at its N-th step, to see a recovery.
"""
import argparse
import os
import signal
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import horovod_ext.torch as hvd  # noqa: E402
from fashion_mnist import DEFAULT_DIR, Net, Progress, finish, prepare  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--lr", type=float, default=1e-3, help="for one worker; scaled by sqrt(size)")
    p.add_argument("--data-dir", default=DEFAULT_DIR)
    p.add_argument("--max-train", type=int, default=0, help="use only this many samples")
    p.add_argument("--commit-every", type=int, default=10, help="steps between commits")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--kill-worker", type=int, default=-1)
    p.add_argument("--kill-at-step", type=int, default=-1)
    args = p.parse_args(argv)

    hvd.init()
    tx, ty, vx, vy = prepare(args, f"{hvd.size()} workers to start with")
    me = int(os.environ.get("HOROVOD_ELASTIC_WORKER", "0"))

    model = Net()
    base = torch.optim.Adam(model.parameters(), lr=args.lr * hvd.size() ** 0.5)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(range(len(ty)), shuffle=True, seed=args.seed)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0,
                                   steps=0)

    def scale_lr():   # the job may have a new size after each re-forming
        for group in opt.param_groups:
            group["lr"] = args.lr * hvd.size() ** 0.5
        if hvd.rank() == 0:
            print(f"training on {hvd.size()} workers", flush=True)

    state.register_reset_callbacks([scale_lr])

    @hvd.elastic.run
    def train(state):
        while state.epoch < args.epochs:
            loader = torch.utils.data.DataLoader(range(len(ty)), batch_size=args.batch_size,
                                                 sampler=state.sampler)
            bar = Progress(len(loader), f"epoch {state.epoch + 1}/{args.epochs}",
                           hvd.rank() == 0)
            for i, idx in enumerate(loader):
                state.steps += 1
                if me == args.kill_worker and state.steps == args.kill_at_step:
                    os.kill(os.getpid(), signal.SIGKILL)
                opt.zero_grad()
                loss = F.cross_entropy(model(tx[idx]), ty[idx])
                loss.backward()
                opt.step()
                state.sampler.record_batch(i, args.batch_size)
                if (i + 1) % args.commit_every == 0:
                    state.commit()
                bar.update(i + 1, loss.item(), (i + 1) * args.batch_size * hvd.size())
            # epoch and sampler advance together before the commit: a re-forming there
            # must not repeat the epoch
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    return finish(model, vx, vy)


if __name__ == "__main__":
    main()
