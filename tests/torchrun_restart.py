"""A worker program for the torchrun test: restart-based elasticity.  Trains the counting model
of elastic_train.py (weights count how often each sample was trained on) for EPOCHS epochs,
rank 0 saving a checkpoint after each; in its first life (TORCHELASTIC_RESTART_COUNT=0) rank 1
kills itself in epoch 1, torchrun restarts every worker, and they resume from the checkpoint.

    torchrun --standalone --nproc_per_node=2 --max-restarts=1 tests/torchrun_restart.py OUT EPOCHS
"""
import json
import os
import signal
import sys

import torch

import horovod_ext.torch as hvd

SAMPLES, BATCH = 64, 8


def main():
    out, epochs = sys.argv[1], int(sys.argv[2])
    checkpoint = os.path.join(out, "checkpoint.pt")
    hvd.init()
    model = torch.nn.Linear(SAMPLES, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    start = 0
    if os.path.exists(checkpoint):
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        start = saved["epoch"]
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                         named_parameters=model.named_parameters(), op=hvd.Sum)
    first_life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for epoch in range(start, epochs):
        mine = torch.arange(hvd.rank(), SAMPLES, hvd.size())
        for i in range(0, len(mine), BATCH):
            if first_life and hvd.rank() == 1 and epoch == 1 and i == BATCH:
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            (-model.weight[0, mine[i:i + BATCH]].sum()).backward()
            optimizer.step()
        if hvd.rank() == 0:
            torch.save({"model": model.state_dict(), "epoch": epoch + 1}, checkpoint + ".tmp")
            os.replace(checkpoint + ".tmp", checkpoint)
        hvd.barrier()
    if hvd.rank() == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"counts": model.weight[0].tolist(), "started_at": start}, f)
    hvd.shutdown()


if __name__ == "__main__":
    main()
