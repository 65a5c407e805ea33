"""Faults as clusters have them, injected into elastic training on the network lab.

    python benchmarks/chaos.py --runs 5 --out docs/benchmarks/chaos.json    # as root (the lab)
    python benchmarks/chaos.py --runs 1 --faults kill_worker,op_raises      # a quick look

3 emulated hosts at 1 Gbit/s (tools/netlab.sh), one worker each, hvdrun's elastic mode started
in host 0 (``--min-np 2``, ``--blacklist-cooldown-range 5 5``: a failed host comes back),
examples/fashion_mnist.py's CNN trained with ``DistributedOptimizer`` (Average) on synthetic
batches, a commit after every step, rank 0 writing a checkpoint every 10 steps.  Each fault is
injected once per run, at a random step between 20% and 40% of the run (``--seed``):

- ``kill_worker``: SIGKILL of the worker of rank 1; ``kill_rank0``: of rank 0;
- ``stop_30s``: SIGSTOP of rank 1's worker, SIGCONT 30 s later (if it still exists);
- ``link_down_10s``: host 2's link down for 10 s, then up again;
- ``loss_2pct``: 2% of the packets host 2 sends and receives dropped, from then on;
- ``op_raises``: an exception inside the reduction op, on rank 1 alone;
- ``kill_in_checkpoint``: rank 0 killed half-way through writing its checkpoint.

Measured per run: whether the job completed (exit 0, every step done), the seconds from the
fault to the first step of a generation formed after it (recovery: the failure found, the job
re-formed, the last commit restored; none where the job never re-formed), the sizes the job ran
at, the step time before and after, whether the checkpoint on disk still loads, and hvdrun's
account.  Prints a
table and writes JSON.
"""
import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _spawn  # noqa: E402  (benchmarks/ is not a package)

HVDRUN = os.path.join(os.path.dirname(sys.executable), "hvdrun")
NSRSH = os.path.join(_spawn.REPO, "tools", "nsrsh")
FAULTS = ["kill_worker", "kill_rank0", "stop_30s", "link_down_10s", "loss_2pct", "op_raises",
          "kill_in_checkpoint"]
HOSTS = 3
CHECKPOINT_EVERY = 10


# --- the worker -----------------------------------------------------------------------------
def worker(tmp: str, fault: str, at_step: int, steps: int):  # long: one training loop with its faults
    import torch
    import horovod_ext.torch as hvd
    from horovod_ext.backends import bootstrap
    sys.path.insert(0, os.path.join(_spawn.REPO, "examples"))
    from fashion_mnist import Net

    def once(tag: str) -> bool:
        """True the first time any worker asks for ``tag`` (files: every host sees tmp)."""
        try:
            os.close(os.open(os.path.join(tmp, f"fired.{tag}"), os.O_CREAT | os.O_EXCL))
            return True
        except FileExistsError:
            return False

    def mark_fault(what: str):
        with open(os.path.join(tmp, "fault"), "w") as f:
            f.write(f"{time.time()!r} {what}")

    class ChaosAverage(hvd.Op):
        name = "chaos_average"

        def allreduce(self, buffer, layers, comms):
            if (fault == "op_raises" and hvd.rank() == 1 and state.step == at_step
                    and once("op")):
                mark_fault("op_raises")
                raise RuntimeError("injected failure inside the op")
            return comms.allreduce(buffer).div_(hvd.size())

    hvd.init()
    torch.manual_seed(0)
    model = Net()
    op = hvd.register_op(ChaosAverage())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), op=op)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    me = os.environ.get("HOROVOD_ELASTIC_WORKER", "?")
    log = open(os.path.join(tmp, f"steps.{me}"), "a")

    @hvd.elastic.run
    def train(state):
        gen = torch.Generator().manual_seed(1000 + hvd.rank())
        while state.step < steps:
            if state.step == at_step:
                inject(state.step)
            x = torch.randn(32, 1, 28, 28, generator=gen)
            y = torch.randint(0, 10, (32,), generator=gen)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            generation = bootstrap.elastic_membership.generation
            log.write(f"{time.time()!r} {state.step} {hvd.size()} {generation} "
                      f"{loss.item():.4f}\n")
            log.flush()
            state.step += 1
            if hvd.rank() == 0 and state.step % CHECKPOINT_EVERY == 0:
                save_checkpoint(state.step)
            state.commit()

    def inject(step: int):
        if fault == "kill_worker" and hvd.rank() == 1 and once("kill"):
            mark_fault("kill_worker")
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "kill_rank0" and hvd.rank() == 0 and once("kill"):
            mark_fault("kill_rank0")
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "stop_30s" and hvd.rank() == 1 and once("stop"):
            with open(os.path.join(tmp, "stopped.pid"), "w") as f:
                f.write(str(os.getpid()))
            mark_fault("stop_30s")
            os.kill(os.getpid(), signal.SIGSTOP)

    def save_checkpoint(step: int):
        path = os.path.join(tmp, "checkpoint.pt")
        partial = path + ".part"
        blob = {"step": step, "model": model.state_dict()}
        if fault == "kill_in_checkpoint" and step >= at_step and once("kill"):
            with open(partial, "wb") as f:   # half of what torch.save writes, then killed
                import io
                buf = io.BytesIO()
                torch.save(blob, buf)
                f.write(buf.getvalue()[:len(buf.getvalue()) // 2])
                f.flush()
            mark_fault("kill_in_checkpoint")
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save(blob, partial)
        os.replace(partial, path)   # whole or absent: a kill mid-write leaves the last one

    train(state)


# --- the driver -----------------------------------------------------------------------------
def _steps(tmp: str):
    seen = []
    for name in os.listdir(tmp):
        if name.startswith("steps."):
            with open(os.path.join(tmp, name)) as f:
                for line in f:
                    t, step, size, generation, loss = line.split()
                    seen.append((float(t), int(step), int(size), int(generation), float(loss)))
    return sorted(seen)


def _lab(*args, check=True):
    return subprocess.run(["ip", "netns", "exec", *args], check=check, capture_output=True,
                          text=True)


def _drop_packets(ns: str, dev: str, percent: int) -> str:
    """Drop ``percent``% of the packets ``dev`` sends, at random: netem's loss where the kernel
    has netem, else tc's gact action.  Returns "" or why neither could be set up."""
    tried = _lab(ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                 "netem", "loss", f"{percent}%", check=False)
    if tried.returncode == 0:
        return ""
    _lab(ns, "tc", "qdisc", "add", "dev", dev, "clsact", check=False)
    gact = _lab(ns, "tc", "filter", "add", "dev", dev, "egress", "protocol", "all", "u32",
                "match", "u32", "0", "0", "action", "gact", "ok", "random", "netrand", "drop",
                str(100 // percent), check=False)
    if gact.returncode == 0:
        return ""
    return (f"no packet loss possible here: netem: {tried.stderr.strip().splitlines()[0]}; "
            f"tc gact: {gact.stderr.strip().splitlines()[0]}")


def driver_faults(fault: str, tmp: str, at_step: int, proc) -> None:
    """Faults the benchmark injects from outside: the link and the packet loss, and the SIGCONT
    of a stopped worker."""
    while True:
        if proc.poll() is not None:
            return
        done = _steps(tmp)
        if fault in ("link_down_10s", "loss_2pct") and done and done[-1][1] >= at_step:
            break
        if fault == "stop_30s" and os.path.exists(os.path.join(tmp, "stopped.pid")):
            break
        if fault not in ("link_down_10s", "loss_2pct", "stop_30s"):
            return
        time.sleep(0.05)   # polling the workers' progress files
    if fault == "link_down_10s":
        with open(os.path.join(tmp, "fault"), "w") as f:
            f.write(f"{time.time()!r} link_down_10s")
        _lab("nl-2", "ip", "link", "set", "eth0", "down")
        time.sleep(10)
        _lab("nl-2", "ip", "link", "set", "eth0", "up")
    elif fault == "loss_2pct":
        why = _drop_packets("nl-2", "eth0", 2) or _drop_packets("nl-hub", "nlh2", 2)
        with open(os.path.join(tmp, "fault" if not why else "not_injected"), "w") as f:
            f.write(f"{time.time()!r} loss_2pct" if not why else why)
    elif fault == "stop_30s":
        with open(os.path.join(tmp, "stopped.pid")) as f:
            pid = int(f.read())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def one_run(fault: str, at_step: int, steps: int, timeout: float):  # long: start, inject, read
    with _spawn.lab(HOSTS, "1gbit"), tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o777)
        hosts = ",".join(f"10.200.0.{i + 1}:1" for i in range(HOSTS))
        cmd = ["ip", "netns", "exec", "nl-0", "unshare", "--uts", "sh", "-c",
               'hostname nl-0; exec "$@"', "sh", HVDRUN, "-np", str(HOSTS), "--min-np", "2",
               "--blacklist-cooldown-range", "5", "5", "-H", hosts, "--ssh-command", NSRSH,
               sys.executable, os.path.abspath(__file__), "--worker", tmp, fault,
               str(at_step), str(steps)]
        started = time.time()
        proc = subprocess.Popen(cmd, env=_spawn._clean_env({}), cwd=_spawn.REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        import threading
        injector = threading.Thread(target=driver_faults, args=(fault, tmp, at_step, proc))
        injector.start()
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        injector.join()
        seen = _steps(tmp)
        fault_at = None
        if os.path.exists(os.path.join(tmp, "fault")):
            with open(os.path.join(tmp, "fault")) as f:
                fault_at = float(f.read().split()[0])
        starts = _step_starts(seen)
        before = [t for t in starts if fault_at is None or t < fault_at]
        after = [t for t in starts if fault_at is not None and t > fault_at]
        # recovered: the first step of a generation formed after the fault
        at_fault = max((g for t, _, _, g, _ in seen if fault_at and t <= fault_at), default=0)
        recovered = [t for t, _, _, g, _ in seen if fault_at and t > fault_at and g > at_fault]
        checkpoint_ok = None
        path = os.path.join(tmp, "checkpoint.pt")
        if os.path.exists(path):
            import torch
            try:
                checkpoint_ok = "model" in torch.load(path, weights_only=True)
            except Exception:   # noqa: BLE001 - a torn checkpoint is what this looks for
                checkpoint_ok = False
        steps_done = {s for _, s, _, _, _ in seen}
        why_not = None
        if os.path.exists(os.path.join(tmp, "not_injected")):
            with open(os.path.join(tmp, "not_injected")) as f:
                why_not = f.read()
        return {
            "fault": fault, "at_step": at_step, "injected": fault_at is not None,
            "not_injected_because": why_not,
            "completed": proc.returncode == 0 and steps_done >= set(range(steps)),
            "exit_status": proc.returncode,
            "recovery_s": (recovered[0] - fault_at) if recovered else None,
            "generations": max((g for *_, g, _ in seen), default=0),
            "sizes": _phases([size for _, _, size, _, _ in seen]),
            "step_ms_before": _median_gap(before[-20:]),
            "step_ms_after": _median_gap(after[5:25]) if len(after) > 10 else None,
            "checkpoint_loads": checkpoint_ok,
            "wall_s": time.time() - started,
            "hvdrun": [line for line in output.splitlines() if line.startswith("hvdrun:")],
            "errors": sorted({line.split("ERROR: ", 1)[1][:160] for line in output.splitlines()
                              if "ERROR: " in line})[:6],
        }


def _step_starts(seen):
    """When each step was first logged, by any worker, in time order (a step redone after a
    restore counts again)."""
    starts, last = [], None
    for t, step, *_ in seen:
        if step != last:
            starts.append(t)
            last = step
    return starts


def _phases(sizes):
    return [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s]


def _median_gap(times):
    gaps = [b - a for a, b in zip(times, times[1:])]
    return 1e3 * statistics.median(gaps) if gaps else None


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rng = random.Random(args.seed)
    faults = args.faults.split(",")
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        p.error(f"unknown faults {unknown}; known: {FAULTS}")
    report = {**_spawn.provenance(), "hosts": HOSTS, "steps": args.steps, "seed": args.seed,
              "runs": []}
    print(f"{'fault':<20} {'run':>3} {'step':>4} {'done':>5} {'recovery s':>10} "
          f"{'sizes':<14} {'ms/step before':>14} {'after':>7}", flush=True)
    for run in range(args.runs):
        for fault in faults:
            at = rng.randint(args.steps // 5, 2 * args.steps // 5)
            r = one_run(fault, at, args.steps, args.timeout)
            r["run"] = run
            report["runs"].append(r)
            rec = "-" if r["recovery_s"] is None else f"{r['recovery_s']:.2f}"
            after = "-" if r["step_ms_after"] is None else f"{r['step_ms_after']:.0f}"
            before = "-" if r["step_ms_before"] is None else f"{r['step_ms_before']:.0f}"
            print(f"{fault:<20} {run:>3} {at:>4} {str(r['completed']):>5} {rec:>10} "
                  f"{str(r['sizes']):<14} {before:>14} {after:>7}", flush=True)
            if args.out:   # after every run: a long session interrupted keeps what it has
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=1)
    if args.out:
        _spawn.write_report(args.out, report)


if __name__ == "__main__":
    main()
