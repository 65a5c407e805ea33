"""A worker program for the elastic tests: a model whose weights count how often each sample
was trained on (Sum of one-hot gradients, SGD with lr 1), so that the final weights say whether
every sample of every epoch was processed exactly once across failures and re-formings.
ELASTIC_TEST_OPTIMIZER=adasum, onebit, slamb or diloco trains the same model with Adasum, 1-bit
Adam, SLAMB or DiLoCo instead
(the weights then count nothing; the run must still complete with the ranks in agreement).

    python tests/elastic_train.py OUT_DIR SAMPLES EPOCHS BATCH STEP_S [KILLS]

STEP_S: seconds of compute each step stands for (a busy loop, so that a run lasts long enough for
hosts to come and go).  KILLS: WORKER:EPOCH:BATCH[:WHERE],... - that worker (its
HOROVOD_ELASTIC_WORKER id) kills itself with SIGKILL at that batch (-1: any epoch or batch):
WHERE "step" (default) before the batch's step, "commit" inside the commit after it (saved, not
yet checked for host changes), "reset" in its first reset callback; "stop": it stops itself
with SIGSTOP before the batch's step instead (hung: its peers' heartbeats find it); or "drop":
instead of dying, that worker removes the last host from OUT_DIR/hosts (the discovery script's
list).
"""
import json
import os
import signal
import sys
import time

import torch

import horovod_ext.torch as hvd


def main():
    out, samples, epochs, batch = sys.argv[1], *map(int, sys.argv[2:5])
    step_s = float(sys.argv[5])
    kills = []
    for spec in (sys.argv[6].split(",") if len(sys.argv) > 6 else []):
        parts = spec.split(":")
        kills.append((int(parts[0]), int(parts[1]), int(parts[2]),
                      parts[3] if len(parts) > 3 else "step"))

    def should_die(where, epoch=-1, index=-1):
        return any(w == me and at == where and e in (-1, epoch) and b in (-1, index)
                   for w, e, b, at in kills)
    me = int(os.environ.get("HOROVOD_ELASTIC_WORKER", "0"))
    hvd.init()
    model = torch.nn.Linear(samples, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    kind = os.environ.get("ELASTIC_TEST_OPTIMIZER", "sgd")
    if kind == "sgd":
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                             named_parameters=model.named_parameters(),
                                             op=hvd.Sum)
    elif kind == "adasum":
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters(),
                                             op=hvd.Adasum)
    elif kind == "onebit":   # past its warm-up after 2 steps: compressed from then on
        optimizer = hvd.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=2)
    elif kind == "diloco":   # outer steps every 3 steps, each reduction overlapping a step
        optimizer = hvd.DiLoCo(torch.optim.SGD(model.parameters(), lr=1e-2),
                               named_parameters=model.named_parameters(), sync_every=3,
                               overlap_steps=1)
    else:
        optimizer = hvd.SLAMB(model.parameters(), lr=1e-2, ratio=0.25, sync_interval=3)
    sampler = hvd.elastic.ElasticSampler(range(samples), shuffle=True, seed=1)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0,
                                   sizes=[])
    events = []
    dropped = []      # the "drop" action happens once

    def on_reset():
        if should_die("reset"):
            os.kill(os.getpid(), signal.SIGKILL)
        events.append(("reset", time.time(), hvd.size()))

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        while state.epoch < epochs:
            loader = torch.utils.data.DataLoader(range(samples), batch_size=batch,
                                                 sampler=state.sampler)
            for index, idx in enumerate(loader):
                if should_die("step", state.epoch, index):
                    os.kill(os.getpid(), signal.SIGKILL)
                if should_die("stop", state.epoch, index):
                    os.kill(os.getpid(), signal.SIGSTOP)
                if should_die("drop", state.epoch, index) and not dropped:
                    dropped.append(True)
                    hosts = os.path.join(out, "hosts")
                    with open(hosts) as f:
                        lines = f.read().splitlines()
                    with open(hosts + ".tmp", "w") as f:
                        f.write("".join(line + "\n" for line in lines[:-1]))
                    os.replace(hosts + ".tmp", hosts)
                until = time.perf_counter() + step_s
                while time.perf_counter() < until:
                    pass
                optimizer.zero_grad()
                # d(-sum w[idx])/dw = -onehot counts; SGD with lr 1 adds them, Sum over ranks
                loss = -model.weight[0, idx].sum()
                loss.backward()
                optimizer.step()
                events.append(("step", time.time(), hvd.size()))
                state.sampler.record_batch(index, batch)
                state.sizes.append(hvd.size())
                if should_die("commit", state.epoch, index):
                    state.save()
                    os.kill(os.getpid(), signal.SIGKILL)
                state.commit()
            # epoch and sampler advance together before the commit: a re-forming there
            # must not repeat the epoch
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    if kind == "slamb":
        optimizer.average_parameters()
    if kind == "diloco":
        optimizer.sync()
    # every rank's weights, to check that they agree
    weights = hvd.allgather_object(model.weight[0].tolist())
    if hvd.rank() == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"counts": model.weight[0].tolist(), "sizes": state.sizes,
                       "agree": all(w == weights[0] for w in weights)}, f)
    with open(os.path.join(out, f"events.{me}.json"), "w") as f:
        json.dump(events, f)


if __name__ == "__main__":
    main()
