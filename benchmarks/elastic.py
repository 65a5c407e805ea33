"""Elastic recovery and scale-up times under hvdrun's elastic mode, on this machine.

    python benchmarks/elastic.py                  # 3 runs, 4 workers posing as 4 hosts
    python benchmarks/elastic.py --runs 1 --out /tmp/elastic.json
    python benchmarks/elastic.py --accuracy       # also the example with one failure and without
    python benchmarks/elastic.py --lab-only       # a host's link taken down (root, network lab)

Each run starts 4 workers on hosts 127.0.0.1-4 (one slot each, a discovery script listing them,
`--blacklist-cooldown-range C C`), trains a small model with `hvd.elastic.run`, committing after
every step, and the worker of the third host kills itself with SIGKILL mid-epoch.  Measured:

- recovery: from the kill to the first step of the 3 remaining workers (their failure seen, the
  last commit restored, the job re-formed, the state synced);
- scale-up: from the end of the host's cooldown (kill + C seconds) to the first step at 4
  workers again (the host offered again, a worker started there and imported torch, the others
  told at their next commit, the job re-formed).

With --lab, 2 emulated hosts x 2 workers at 1 Gbit/s (tools/netlab.sh; needs root) train until
the second host's link is taken down (``ip link set eth0 down`` in its namespace); measured: the
time to the first step of the 2 workers left, against HOROVOD_COMM_TIMEOUT_SECONDS (--comm-timeout).

With --accuracy, examples/elastic_fashion_mnist.py is also trained twice on 2 workers, once
uninterrupted and once with worker 1 killed a third of the way in (the job then finishes on one
worker), and both test accuracies are recorded.

Prints a table and writes JSON (``--out``).
"""
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _spawn  # noqa: E402  (benchmarks/ is not a package)

HVDRUN = os.path.join(os.path.dirname(sys.executable), "hvdrun")


def worker(out_dir: str, step_s: float, steps: int, kill: bool = True):
    import torch
    import horovod_ext.torch as hvd

    me = int(os.environ["HOROVOD_ELASTIC_WORKER"])
    hvd.init()
    model = torch.nn.Linear(256, 10)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    log = open(os.path.join(out_dir, f"steps.{me}"), "a")

    @hvd.elastic.run
    def train(state):
        x, y = torch.randn(32, 256), torch.randint(0, 10, (32,))
        while state.step < steps:
            if kill and me == 2 and state.step == steps // 4:
                with open(os.path.join(out_dir, "killed"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            until = time.perf_counter() + step_s     # the compute a real step would do
            while time.perf_counter() < until:
                pass
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            log.write(f"{time.time()!r} {hvd.size()}\n")
            log.flush()
            state.step += 1
            state.commit()

    train(state)


def one_run(cooldown: float, step_s: float, steps: int):
    with tempfile.TemporaryDirectory() as tmp:
        hosts = os.path.join(tmp, "hosts")
        with open(hosts, "w") as f:
            f.write("".join(f"127.0.0.{i}:1\n" for i in range(1, 5)))
        cmd = [HVDRUN, "-np", "4", "--min-np", "3", "--max-np", "4",
               "--host-discovery-script", f"cat {hosts}",
               "--blacklist-cooldown-range", str(cooldown), str(cooldown),
               sys.executable, os.path.abspath(__file__), "--worker", tmp, str(step_s),
               str(steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              env=_spawn._clean_env({}), cwd=_spawn.REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"elastic run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(os.path.join(tmp, "killed")) as f:
            killed = float(f.read())
        steps_seen = []
        for name in os.listdir(tmp):
            if name.startswith("steps."):
                with open(os.path.join(tmp, name)) as f:
                    steps_seen += [(float(t), int(n)) for t, n in map(str.split, f)]
        after = sorted(s for s in steps_seen if s[0] > killed)
        first3 = next(t for t, n in after if n == 3)
        first4 = next(t for t, n in after if n == 4 and t > first3)
        return {"recovery_s": first3 - killed, "scale_up_s": first4 - (killed + cooldown)}


def _read_steps(tmp):
    seen = []
    for name in os.listdir(tmp):
        if name.startswith("steps."):
            with open(os.path.join(tmp, name)) as f:
                seen += [(float(t), int(n)) for t, n in map(str.split, f)]
    return sorted(seen)


def lab_run(comm_timeout: float, step_s: float, steps: int):
    """2 emulated hosts x 2 workers at 1 Gbit/s; the second host's link is taken down mid-run.
    Returns the seconds from the link going down to the first step of the 2 workers left, and
    whether the job completed."""
    nsrsh = os.path.join(_spawn.REPO, "tools", "nsrsh")
    with _spawn.lab(2, "1gbit"), tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        cmd = ["ip", "netns", "exec", "nl-0", "unshare", "--uts", "sh", "-c",
               'hostname nl-0; exec "$@"', "sh", HVDRUN, "-np", "4", "--min-np", "2",
               "-H", "10.200.0.1:2,10.200.0.2:2", "--ssh-command", nsrsh,
               sys.executable, os.path.abspath(__file__), "--worker", tmp, str(step_s),
               str(steps), "no-kill"]
        env = _spawn._clean_env({"HOROVOD_COMM_TIMEOUT_SECONDS": f"{comm_timeout:g}"})
        proc = subprocess.Popen(cmd, env=env, cwd=_spawn.REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while len([s for s in _read_steps(tmp) if s[1] == 4]) < steps // 4:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the lab job did not get going:\n{proc.stdout.read()[-3000:]}")
            time.sleep(0.2)     # polling the workers' progress files
        down = time.time()
        subprocess.run(["ip", "netns", "exec", "nl-1", "ip", "link", "set", "eth0", "down"],
                       check=True)
        output, _ = proc.communicate(timeout=600)
        after = [t for t, n in _read_steps(tmp) if t > down and n == 2]
        return {"detect_and_recover_s": (after[0] - down) if after else None,
                "completed": proc.returncode == 0 and len(after) > 0,
                "exit_status": proc.returncode, "comm_timeout_s": comm_timeout,
                "driver_lines": [line for line in output.splitlines()
                                 if line.startswith("hvdrun:")]}


def accuracy_run(kill_at: int, epochs: int, max_train: int, seed: int) -> float:
    """Test accuracy of examples/elastic_fashion_mnist.py on 2 workers (2 hosts), worker 1
    killed at its step ``kill_at`` (0: no failure)."""
    cmd = [HVDRUN, "-np", "2", "--min-np", "1", "-H", "127.0.0.1:1,127.0.0.2:1",
           sys.executable, os.path.join(_spawn.REPO, "examples", "elastic_fashion_mnist.py"),
           "--epochs", str(epochs), "--max-train", str(max_train), "--seed", str(seed)]
    if kill_at:
        cmd += ["--kill-worker", "1", "--kill-at-step", str(kill_at)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env=_spawn._clean_env({}), cwd=_spawn.REPO)
    found = [line for line in proc.stdout.splitlines() if "test accuracy:" in line]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"example failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return float(found[-1].rsplit(":", 1)[1])


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]),
                      kill=len(sys.argv) < 6)
    p = _spawn.parser(__doc__, "elastic.json")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--cooldown", type=float, default=3.0, help="seconds a failed host is out")
    p.add_argument("--step-ms", type=float, default=50.0, help="compute per step")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--accuracy", action="store_true",
                   help="also: the example's test accuracy with one failure and without")
    p.add_argument("--epochs", type=int, default=2, help="for --accuracy")
    p.add_argument("--max-train", type=int, default=20000, help="for --accuracy")
    p.add_argument("--lab", action="store_true",
                   help="also: a host's link taken down on 2 emulated hosts (needs root)")
    p.add_argument("--lab-only", action="store_true", help="only the --lab run")
    p.add_argument("--comm-timeout", type=float, default=10.0,
                   help="HOROVOD_COMM_TIMEOUT_SECONDS for --lab")
    args = p.parse_args()
    report = {"workers": 4, "cooldown_s": args.cooldown, "step_ms": args.step_ms}
    if args.lab or args.lab_only:
        report["lab"] = []
        for _ in range(args.runs):
            lab = lab_run(args.comm_timeout, args.step_ms / 1e3, args.steps)
            report["lab"].append(lab)
            print(f"lab: link of host 2 down; the 2 workers left took their first step "
                  f"{lab['detect_and_recover_s']:.2f} s later (HOROVOD_COMM_TIMEOUT_SECONDS "
                  f"{args.comm_timeout:g}); completed: {lab['completed']}", flush=True)
            for line in lab["driver_lines"]:
                print("   ", line)
        if args.lab_only:
            _spawn.write_report(args.out, report)
            return
    if args.accuracy:
        # killed a third of the way into training (at 2 workers of 64 samples a step); each
        # run its own seed (model initialisation and data order), the same for both variants
        kill_at = args.epochs * args.max_train // (2 * 64) // 3
        acc = {"epochs": args.epochs, "max_train": args.max_train, "kill_at_step": kill_at,
               "seeds": [], "uninterrupted": [], "one_failure": []}
        for run in range(args.runs):
            seed = 42 + run
            acc["seeds"].append(seed)
            acc["uninterrupted"].append(accuracy_run(0, args.epochs, args.max_train, seed))
            acc["one_failure"].append(accuracy_run(kill_at, args.epochs, args.max_train, seed))
            print(f"test accuracy, examples/elastic_fashion_mnist.py, 2 workers, {args.epochs} "
                  f"epochs of {args.max_train} samples, seed {seed}: uninterrupted "
                  f"{acc['uninterrupted'][-1]:.4f}, worker 1 killed at step {kill_at} "
                  f"{acc['one_failure'][-1]:.4f}", flush=True)
        report["accuracy"] = acc
    rows = []
    print(f"{'run':>3} {'recovery s':>11} {'scale-up s':>11}", flush=True)
    for run in range(args.runs):
        row = {"run": run, **one_run(args.cooldown, args.step_ms / 1e3, args.steps)}
        rows.append(row)
        print(f"{run:>3} {row['recovery_s']:>11.2f} {row['scale_up_s']:>11.2f}", flush=True)
    summary = {k: {"median": statistics.median(r[k] for r in rows),
                   "min": min(r[k] for r in rows), "max": max(r[k] for r in rows)}
               for k in ("recovery_s", "scale_up_s")}
    print(f"median {summary['recovery_s']['median']:>8.2f} {summary['scale_up_s']['median']:>11.2f}")
    _spawn.write_report(args.out, {**report, "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
