"""Train a small CNN on Fashion-MNIST with hvd.DistributedOptimizer.

    torchrun --standalone --nproc_per_node=2 examples/fashion_mnist.py
    mpirun -np 2 python examples/fashion_mnist.py --op sum --epochs 2
    torchrun --standalone --nproc_per_node=2 examples/fashion_mnist.py --device cuda   # 1 GPU/rank

Data: Debian's `dataset-fashion-mnist` package (/usr/share/datasets/fashion-mnist, or --data-dir).
Without it, scikit-learn's bundled 8x8 digits are used instead, upscaled to 28x28, and rank 0 says
so.  Rank 0 shows a progress bar and the final test accuracy; --checkpoint saves after every epoch
and resumes from the file when it exists.  ``--device cuda`` pins each rank to the GPU of its local
rank (Horovod's ``torch.cuda.set_device(hvd.local_rank())``) and trains there.
"""
import argparse
import gzip
import os

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import horovod_ext.torch as hvd

DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"


def read_idx(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    dims = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load_data(data_dir):
    """(train_x, train_y, test_x, test_y, description) as float tensors in [0, 1]."""
    files = [os.path.join(data_dir, f"{p}-{k}-idx{d}-ubyte.gz")
             for p in ("train", "t10k") for k, d in (("images", 3), ("labels", 1))]
    if all(os.path.exists(f) for f in files):
        tx, ty, vx, vy = (read_idx(f) for f in files)
        conv = lambda a: torch.from_numpy(a.astype(np.float32) / 255.0).unsqueeze(1)  # noqa
        return (conv(tx), torch.from_numpy(ty.astype(np.int64)), conv(vx),
                torch.from_numpy(vy.astype(np.int64)), f"Fashion-MNIST from {data_dir}")
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit(f"no Fashion-MNIST in {data_dir} (apt-get install dataset-fashion-mnist) "
                         f"and no scikit-learn for the digits fallback (pip install scikit-learn)")
    digits = load_digits()
    x = torch.from_numpy(digits.images.astype(np.float32) / 16.0).unsqueeze(1)
    x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
    y = torch.from_numpy(digits.target.astype(np.int64))
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    cut = int(0.8 * len(y))
    return (x[:cut], y[:cut], x[cut:], y[cut:],
            f"scikit-learn digits (Fashion-MNIST not found in {data_dir}; "
            f"apt-get install dataset-fashion-mnist for the real data)")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 5, padding=2)
        self.conv2 = torch.nn.Conv2d(16, 32, 5, padding=2)
        self.fc1 = torch.nn.Linear(32 * 7 * 7, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def evaluate(model, x, y, batch):
    """Accuracy over the whole test set: each rank scores its shard, the counts are summed."""
    model.eval()
    mine = torch.arange(hvd.rank(), len(y), hvd.size())
    correct = 0
    with torch.no_grad():
        for i in range(0, len(mine), batch):
            idx = mine[i:i + batch]
            correct += int((model(x[idx]).argmax(1) == y[idx]).sum())
    totals = hvd.allreduce(torch.tensor([correct, len(mine)], dtype=torch.int64), op=hvd.Sum,
                           name="eval_counts")
    model.train()
    return totals[0].item() / totals[1].item()


def pick_device(name: str) -> torch.device:
    """The device this rank trains on; for "cuda", the GPU of its local rank, pinned as Horovod
    does (tensors made later without a device index, and NCCL, use the pinned GPU)."""
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = "a CPU-only build" if torch.version.cuda is None else "none visible"
        raise SystemExit(f"--device cuda: torch {torch.__version__} sees no CUDA device "
                         f"({why}); use --device cpu")
    if hvd.local_rank() >= torch.cuda.device_count():
        raise SystemExit(f"--device cuda: local rank {hvd.local_rank()} has no GPU of its own "
                         f"({torch.cuda.device_count()} on this host); start at most that many "
                         f"ranks per host")
    torch.cuda.set_device(hvd.local_rank())
    return torch.device("cuda", hvd.local_rank())


def prepare(args, about: str):
    """After hvd.init(): threads, seed and the data (train x, y, test x, y), said by rank 0."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    torch.manual_seed(args.seed)
    tx, ty, vx, vy, what = load_data(args.data_dir)
    if args.max_train:
        tx, ty = tx[:args.max_train], ty[:args.max_train]
    if hvd.rank() == 0:
        print(f"data: {what}; {len(ty)} training and {len(vy)} test samples; {about}",
              flush=True)
    return tx, ty, vx, vy


def finish(model, vx, vy) -> float:
    """Test accuracy (said by rank 0), then hvd.shutdown()."""
    accuracy = evaluate(model, vx, vy, 256)
    if hvd.rank() == 0:
        print(f"test accuracy: {accuracy:.4f}", flush=True)
    hvd.shutdown()
    return accuracy


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--lr", type=float, default=1e-3, help="for one rank; scaled by sqrt(size)")
    p.add_argument("--op", default="average", help="registered op name: average, sum, ...")
    p.add_argument("--data-dir", default=DEFAULT_DIR)
    p.add_argument("--max-train", type=int, default=0, help="use only this many samples")
    p.add_argument("--checkpoint", default="", help="save here every epoch; resume if present")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: each rank on the GPU of its local rank")
    args = p.parse_args(argv)

    hvd.init()
    device = pick_device(args.device)
    tx, ty, vx, vy = (t.to(device) for t in prepare(
        args, f"{hvd.size()} ranks on {device.type}; op {args.op}"))

    model = Net().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr * hvd.size() ** 0.5)
    start_epoch = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        state = (torch.load(args.checkpoint, map_location="cpu", weights_only=False)
                 if hvd.rank() == 0 else None)
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
        start_epoch = hvd.broadcast_object(state["epoch"] if state else 0, root_rank=0)
        if hvd.rank() == 0:
            print(f"resumed from {args.checkpoint} after epoch {start_epoch}", flush=True)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=args.op)

    per_rank = len(ty) // hvd.size()
    steps = per_rank // args.batch_size
    for epoch in range(start_epoch, args.epochs):
        order = torch.randperm(len(ty), generator=torch.Generator().manual_seed(args.seed + epoch))
        mine = order[hvd.rank() * per_rank:(hvd.rank() + 1) * per_rank]
        samples = args.batch_size * hvd.size()  # per step, all ranks
        bar = tqdm(total=steps * samples, desc=f"epoch {epoch + 1}/{args.epochs}",
                   unit="sample", unit_scale=True, disable=hvd.rank() != 0, mininterval=0.5)
        for step in range(steps):
            idx = mine[step * args.batch_size:(step + 1) * args.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(tx[idx]), ty[idx])
            loss.backward()
            opt.step()
            bar.update(samples)
            bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
        bar.close()
        if args.checkpoint and hvd.rank() == 0:
            # a temporary file renamed over the last checkpoint: a kill mid-save leaves that one
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "epoch": epoch + 1}, args.checkpoint + ".part")
            os.replace(args.checkpoint + ".part", args.checkpoint)
    return finish(model, vx, vy)


if __name__ == "__main__":
    main()
