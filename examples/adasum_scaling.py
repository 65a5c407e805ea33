"""The Adasum paper's LeNet-5 case study (section 5.4), in small: Sum vs Adasum as processes grow.

    python examples/adasum_scaling.py                      # 1, 2, 4, 8 processes, Sum and Adasum
    python examples/adasum_scaling.py --nps 1,2 --max-train 3000   # a quick look

A LeNet-5 on Fashion-MNIST, momentum SGD with batch 32 per process, a fixed number of epochs and
an aggressive learning-rate schedule (linear warm-up then linear decay to zero, by step) tuned for
ONE process, run unchanged at every process count: each process gets 1/n of the training data,
so n processes take n times fewer, n times larger steps.  With Sum the step grows with n; Adasum
adapts it.  Prints a table of final test accuracy and writes a PNG plot and JSON.

Each configuration is started with torchrun (ships with PyTorch); workers use only the public
horovod_ext API.  With momentum SGD, DistributedOptimizer(op=hvd.Adasum) combines the parameter
changes after each local step (paper section 4.1), Sum combines gradients as usual.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))


class LeNet5(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 6, 5, padding=2)
        self.conv2 = torch.nn.Conv2d(6, 16, 5)
        self.fc1 = torch.nn.Linear(16 * 5 * 5, 120)
        self.fc2 = torch.nn.Linear(120, 84)
        self.fc3 = torch.nn.Linear(84, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))


def schedule(step, total, max_lr, warmup):
    """Linear from 0 to max_lr over the first ``warmup`` fraction of steps, then down to 0."""
    w = max(1, int(round(warmup * total)))
    if step < w:
        return max_lr * (step + 1) / w
    return max_lr * max(0.0, (total - step) / max(1, total - w))


def worker(args):
    import horovod_ext.torch as hvd
    sys.path.insert(0, HERE)
    from fashion_mnist import load_data

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    tx, ty, vx, vy, source = load_data(args.data_dir)
    g = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(ty), generator=g)[:args.max_train or len(ty)]
    mine = order[rank::size]                       # each process: 1/n of the data
    torch.manual_seed(args.seed)
    model = LeNet5()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    op = {"sum": hvd.Sum, "adasum": hvd.Adasum}[args.op]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                   named_parameters=model.named_parameters(), op=op)
    steps_per_epoch = len(order) // (args.batch_size * size)
    total = steps_per_epoch * args.epochs
    step, curve = 0, []
    for epoch in range(args.epochs):
        perm = mine[torch.randperm(len(mine), generator=g)]
        for i in range(steps_per_epoch):
            idx = perm[i * args.batch_size:(i + 1) * args.batch_size]
            for group in opt.param_groups:
                group["lr"] = schedule(step, total, args.lr, args.warmup)
            opt.zero_grad()
            loss = F.cross_entropy(model(tx[idx]), ty[idx])
            loss.backward()
            opt.step()
            step += 1
        curve.append(evaluate(hvd, model, vx, vy))
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"accuracy": curve[-1], "curve": curve, "steps": total,
                       "final_loss": float(loss), "data": source}, f)
    hvd.shutdown()


def evaluate(hvd, model, x, y):
    """Test accuracy: each process scores its shard of the test set; the counts are summed."""
    model.eval()
    idx = torch.arange(hvd.rank(), len(y), hvd.size())
    with torch.no_grad():
        correct = sum(int((model(x[idx[i:i + 500]]).argmax(1) == y[idx[i:i + 500]]).sum())
                      for i in range(0, len(idx), 500))
    counts = hvd.allreduce(torch.tensor([correct, len(idx)]), op=hvd.Sum, name="eval")
    model.train()
    accuracy = counts[0].item() / counts[1].item()
    return accuracy if accuracy == accuracy else 0.0


def run_one(args, op, np):
    fd, result = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={np}", os.path.abspath(__file__), "--worker", "--op", op,
           "--result", result] + [f"--{k.replace('_', '-')}={v}" for k, v in (
               ("lr", args.lr), ("warmup", args.warmup), ("epochs", args.epochs),
               ("batch_size", args.batch_size), ("max_train", args.max_train),
               ("seed", args.seed), ("data_dir", args.data_dir))]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, timeout=args.timeout)
        with open(result) as f:
            return json.load(f)
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"{op} at np={np} failed:\n{exc.stderr.decode()[-3000:]}")
    finally:
        os.unlink(result)


def plot(results, nps, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for op, style in (("sum", "o--"), ("adasum", "s-")):
        ax.plot(nps, [100 * results[op][n]["accuracy"] for n in nps], style,
                label={"sum": "Sum", "adasum": "Adasum"}[op])
    ax.set_xscale("log", base=2)
    ax.set_xticks(nps)
    ax.set_xticklabels([str(n) for n in nps])
    ax.set_xlabel("processes (learning-rate schedule tuned for 1)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("LeNet-5 on Fashion-MNIST: Sum vs Adasum")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--op", default="adasum", help=argparse.SUPPRESS)
    p.add_argument("--nps", default="1,2,4,8")
    p.add_argument("--lr", type=float, default=0.05, help="peak learning rate (for 1 process)")
    p.add_argument("--warmup", type=float, default=0.17, help="fraction of steps warming up")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--max-train", type=int, default=12000, help="training samples (0: all)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
    p.add_argument("--out", default=os.path.join(HERE, "results", "adasum_scaling"),
                   help="writes OUT.json and OUT.png")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    nps = [int(n) for n in args.nps.split(",")]
    results = {"sum": {}, "adasum": {}}
    print(f"{'processes':>9} {'Sum acc %':>10} {'Adasum acc %':>13} {'steps':>6} {'seconds':>8}",
          flush=True)
    for np in nps:
        t0 = time.time()
        for op in results:
            results[op][np] = run_one(args, op, np)
        print(f"{np:>9} {100 * results['sum'][np]['accuracy']:>10.2f} "
              f"{100 * results['adasum'][np]['accuracy']:>13.2f} "
              f"{results['sum'][np]['steps']:>6} {time.time() - t0:>8.1f}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"commit": _commit(), "date": time.strftime("%Y-%m-%d"),
                   "settings": {k: v for k, v in vars(args).items()
                                if k not in ("worker", "result", "op")},
                   "data": results["sum"][nps[0]]["data"],
                   "results": {op: {str(n): r for n, r in rs.items()}
                               for op, rs in results.items()}}, f, indent=1)
    plot(results, nps, args.out + ".png")
    print(f"data: {results['sum'][nps[0]]['data']}\nwrote {args.out}.json and {args.out}.png")


def _commit() -> str:
    """The checkout's commit, for the record (empty outside a git checkout)."""
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                           capture_output=True, text=True)
    return found.stdout.strip() if found.returncode == 0 else ""


if __name__ == "__main__":
    main()
