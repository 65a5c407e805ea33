"""One worker of benchmarks/chaos.py: examples/fashion_mnist.py's CNN trained on Fashion-MNIST
under ``hvd.elastic.run`` (Adam, ElasticSampler, a commit every 5 steps, rank 0 writing a
checkpoint every 10), with the fault the run asks for injected at its step.

    python benchmarks/_chaos_worker.py TMP FAULT AT_STEP EPOCHS MAX_TRAIN SEED

Every worker appends one JSON line per step to TMP/steps.<worker id> (time, global step, epoch,
size, generation, loss, the sample ids it trained) and the time of each restore (a failure seen)
to TMP/detect.<worker id>; rank 0 writes TMP/result.json at the end (test accuracy, whether
every replica's parameters are bitwise equal).
"""
import hashlib
import io
import json
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

import horovod_ext.torch as hvd
from horovod_ext.backends import bootstrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples"))
from fashion_mnist import DEFAULT_DIR, Net, evaluate, load_data  # noqa: E402

BATCH, COMMIT_EVERY, CHECKPOINT_EVERY = 32, 5, 10


def once(tmp: str, tag: str) -> bool:
    """True the first time any worker asks for ``tag`` (a file: every host sees TMP)."""
    try:
        os.close(os.open(os.path.join(tmp, f"fired.{tag}"), os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def mark_fault(tmp: str, what: str):
    with open(os.path.join(tmp, "fault"), "w") as f:
        f.write(f"{time.time()!r} {what}")


def chaos_op(tmp: str, fault: str, at_step: int, state_of):
    """Average, except that it raises on rank 1 at ``at_step`` once (the op_raises fault)."""
    class ChaosAverage(hvd.Op):
        name = "chaos_average"

        def allreduce(self, buffer, layers, comms):
            if (fault == "op_raises" and hvd.rank() == 1 and state_of().steps >= at_step
                    and once(tmp, "op")):
                mark_fault(tmp, fault)
                raise RuntimeError("injected failure inside the op")
            return comms.allreduce(buffer).div_(hvd.size())
    return hvd.register_op(ChaosAverage())


def inject(tmp: str, fault: str):
    """The faults a worker does to itself, at the step the run chose."""
    if fault in ("kill_worker", "below_min_np") and hvd.rank() == 1 and once(tmp, "kill"):
        mark_fault(tmp, fault)
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "kill_rank0" and hvd.rank() == 0 and once(tmp, "kill"):
        mark_fault(tmp, fault)
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "stop_30s" and hvd.rank() == 1 and once(tmp, "stop"):
        with open(os.path.join(tmp, "stopped.pid"), "w") as f:
            f.write(str(os.getpid()))
        mark_fault(tmp, fault)
        os.kill(os.getpid(), signal.SIGSTOP)


def save_checkpoint(tmp: str, fault: str, at_step: int, state, model):
    """Rank 0's checkpoint, written atomically (a temporary file renamed over the last one);
    the kill_in_checkpoint fault kills rank 0 half-way through writing it."""
    path = os.path.join(tmp, "checkpoint.pt")
    blob = {"steps": state.steps, "model": model.state_dict()}
    if fault == "kill_in_checkpoint" and state.steps >= at_step and once(tmp, "kill"):
        buf = io.BytesIO()
        torch.save(blob, buf)
        with open(path + ".part", "wb") as f:
            f.write(buf.getvalue()[:len(buf.getvalue()) // 2])
        mark_fault(tmp, fault)
        os.kill(os.getpid(), signal.SIGKILL)
    torch.save(blob, path + ".part")
    os.replace(path + ".part", path)


def parameters_digest(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def main():  # long: one elastic training loop with its faults and its records
    tmp, fault, at_step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    epochs, max_train, seed = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    tx, ty, vx, vy, _ = load_data(DEFAULT_DIR)
    tx, ty = tx[:max_train], ty[:max_train]
    me = os.environ.get("HOROVOD_ELASTIC_WORKER", "0")
    model = Net()
    base = torch.optim.Adam(model.parameters(), lr=1e-3 * hvd.size() ** 0.5)
    holder = []
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   op=chaos_op(tmp, fault, at_step, lambda: holder[0]))
    sampler = hvd.elastic.ElasticSampler(range(len(ty)), shuffle=True, seed=seed)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0,
                                   steps=0)
    holder.append(state)
    restore = state.restore

    def restore_and_note():   # elastic.run calls it as soon as it has caught a failure
        with open(os.path.join(tmp, f"detect.{me}"), "a") as f:
            f.write(f"{time.time()!r}\n")
        restore()
    state.restore = restore_and_note

    def scale_lr():
        for group in opt.param_groups:
            group["lr"] = 1e-3 * hvd.size() ** 0.5
    state.register_reset_callbacks([scale_lr])
    log = open(os.path.join(tmp, f"steps.{me}"), "a")

    @hvd.elastic.run
    def train(state):
        while state.epoch < epochs:
            loader = torch.utils.data.DataLoader(range(len(ty)), batch_size=BATCH,
                                                 sampler=state.sampler)
            for i, idx in enumerate(loader):
                if state.steps == at_step:
                    inject(tmp, fault)
                opt.zero_grad()
                loss = F.cross_entropy(model(tx[idx]), ty[idx])
                loss.backward()
                opt.step()
                state.steps += 1
                log.write(json.dumps({
                    "t": time.time(), "step": state.steps, "epoch": state.epoch,
                    "size": hvd.size(), "gen": bootstrap.elastic_membership.generation,
                    "loss": round(loss.item(), 4), "ids": idx.tolist()}) + "\n")
                log.flush()
                state.sampler.record_batch(i, BATCH)
                if hvd.rank() == 0 and state.steps % CHECKPOINT_EVERY == 0:
                    save_checkpoint(tmp, fault, at_step, state, model)
                if state.steps % COMMIT_EVERY == 0:
                    state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    accuracy = evaluate(model, vx, vy, 256)
    digests = hvd.allgather_object(parameters_digest(model))
    if hvd.rank() == 0:
        with open(os.path.join(tmp, "result.json"), "w") as f:
            json.dump({"accuracy": accuracy, "replicas_equal": len(set(digests)) == 1,
                       "final_size": hvd.size()}, f)


if __name__ == "__main__":
    main()
