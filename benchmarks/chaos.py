"""Faults as clusters have them, injected into elastic training on the network lab.

    python benchmarks/chaos.py --runs 5 --out docs/benchmarks/chaos.json    # as root (the lab)
    python benchmarks/chaos.py --runs 1 --faults kill_worker,op_raises      # a quick look
    python benchmarks/chaos.py --plot docs/benchmarks/chaos.json            # its figure again

3 emulated hosts at 1 Gbit/s (tools/netlab.sh), one worker each, hvdrun's elastic mode started
in host 0 (``--min-np 2``, ``--blacklist-cooldown-range 5 5``: a failed host comes back), the
example's CNN trained on Fashion-MNIST (benchmarks/_chaos_worker.py: 2 epochs of 6144 samples,
a commit every 5 steps, rank 0's checkpoint every 10).  ``none`` runs undisturbed (the seed
spread of the accuracy); every other fault is injected once per run at a random step between
20% and 40% of the run (``--seed``):

- ``kill_worker``: SIGKILL of rank 1's worker; ``kill_rank0``: of rank 0's;
- ``stop_30s``: SIGSTOP of rank 1's worker, SIGCONT 30 s later if it still exists;
- ``link_down_10s``: host 2's link down for 10 s, then up again;
- ``loss_2pct``: 2% of the packets host 2 sends and receives dropped from then on (netem, or
  tc's gact action; where the kernel has neither the run says so and is not counted);
- ``op_raises``: an exception inside the reduction op on rank 1 alone;
- ``kill_in_checkpoint``: rank 0 killed half-way through writing its checkpoint;
- ``below_min_np``: ``--min-np 3`` and rank 1's worker killed, its host never back: the job
  must end with the reason within ``--elastic-timeout`` (10 s here).

Recorded per run: detection (fault to the first worker catching the failure), recovery (fault
to the first step of a generation formed after it), steps redone, samples lost and seen twice in
the steps that count (by sample id, against the sampler's padding), whether the replicas end
bitwise equal, the test accuracy against the undisturbed runs' spread, whether the checkpoint on
disk still loads, and hvdrun's account.  Prints a table, writes JSON and a PNG beside it.
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _spawn  # noqa: E402  (benchmarks/ is not a package)

HVDRUN = os.path.join(os.path.dirname(sys.executable), "hvdrun")
NSRSH = os.path.join(_spawn.REPO, "tools", "nsrsh")
WORKER = os.path.join(_spawn.REPO, "benchmarks", "_chaos_worker.py")
FAULTS = ["none", "kill_worker", "kill_rank0", "stop_30s", "link_down_10s", "loss_2pct",
          "op_raises", "kill_in_checkpoint", "below_min_np"]
HOSTS, EPOCHS, MAX_TRAIN, ELASTIC_TIMEOUT = 3, 2, 6144, 10
STEPS = EPOCHS * MAX_TRAIN // (32 * HOSTS)     # at 3 workers: 128


# --- faults from outside ----------------------------------------------------------------------
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
    return (f"no random packet loss on this kernel: netem: "
            f"{(tried.stderr.strip().splitlines() or ['?'])[0]}; tc gact: "
            f"{(gact.stderr.strip().splitlines() or ['?'])[0]}")


def _progress(tmp: str) -> int:
    return max((r["step"] for r in _records(tmp)), default=0)


def outside_faults(fault: str, tmp: str, at_step: int, proc) -> None:
    """The faults the driver injects (the link, the packet loss) and a stopped worker's
    SIGCONT; returns when done or when the job ends."""
    def note(text: str, name: str = "fault"):
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    wanted = {"link_down_10s": lambda: _progress(tmp) >= at_step,
              "loss_2pct": lambda: _progress(tmp) >= at_step,
              "stop_30s": lambda: os.path.exists(os.path.join(tmp, "stopped.pid"))}.get(fault)
    if wanted is None:
        return
    while not wanted():
        if proc.poll() is not None:
            return
        time.sleep(0.05)   # polling the workers' progress files
    if fault == "link_down_10s":
        note(f"{time.time()!r} {fault}")
        _lab("nl-2", "ip", "link", "set", "eth0", "down")
        time.sleep(10)
        _lab("nl-2", "ip", "link", "set", "eth0", "up")
    elif fault == "loss_2pct":
        why = _drop_packets("nl-2", "eth0", 2) or _drop_packets("nl-hub", "nlh2", 2)
        note(why, "not_injected") if why else note(f"{time.time()!r} {fault}")
    else:
        with open(os.path.join(tmp, "stopped.pid")) as f:
            pid = int(f.read())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


# --- one run ----------------------------------------------------------------------------------
def one_run(fault: str, at_step: int, seed: int, timeout: float) -> dict:
    with _spawn.lab(HOSTS, "1gbit"), tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o777)
        hosts = ",".join(f"10.200.0.{i + 1}:1" for i in range(HOSTS))
        min_np = HOSTS if fault == "below_min_np" else 2
        cooldown = [] if fault == "below_min_np" else ["--blacklist-cooldown-range", "5", "5"]
        cmd = ["ip", "netns", "exec", "nl-0", "unshare", "--uts", "sh", "-c",
               'hostname nl-0; exec "$@"', "sh", HVDRUN, "-np", str(HOSTS), "--min-np",
               str(min_np), "--elastic-timeout", str(ELASTIC_TIMEOUT), *cooldown, "-H", hosts,
               "--ssh-command", NSRSH, sys.executable, WORKER, tmp, fault, str(at_step),
               str(EPOCHS), str(MAX_TRAIN), str(seed)]
        started = time.time()
        proc = subprocess.Popen(cmd, env=_spawn._clean_env({}), cwd=_spawn.REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        injector = threading.Thread(target=outside_faults, args=(fault, tmp, at_step, proc))
        injector.start()
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        ended = time.time()
        injector.join()
        return measure(tmp, fault, at_step, seed, proc.returncode, output, started, ended)


def _records(tmp: str):
    out = []
    for name in os.listdir(tmp):
        if name.startswith("steps."):
            with open(os.path.join(tmp, name)) as f:
                out += [json.loads(line) for line in f if line.endswith("\n")]
    return sorted(out, key=lambda r: r["t"])


def _read(tmp: str, name: str):
    path = os.path.join(tmp, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return f.read()


def measure(tmp, fault, at_step, seed, status, output, started, ended) -> dict:  # long: one record per run
    records = _records(tmp)
    marked = _read(tmp, "fault")
    fault_at = float(marked.split()[0]) if marked else None
    detected = sorted(float(t) for name in os.listdir(tmp) if name.startswith("detect.")
                      for t in _read(tmp, name).split())
    gen_at_fault = max((r["gen"] for r in records if fault_at and r["t"] <= fault_at),
                       default=0)
    later = [r["t"] for r in records if fault_at and r["t"] > fault_at and r["gen"] > gen_at_fault]
    result = json.loads(_read(tmp, "result.json") or "null")
    lost, twice, padding = samples_accounting(records)
    by_step = {}
    for r in records:
        by_step.setdefault(r["step"], set()).add(r["gen"])
    return {
        "fault": fault, "seed": seed, "at_step": at_step, "injected": fault_at is not None,
        "not_injected_because": _read(tmp, "not_injected"),
        "exit_status": status,
        "completed": status == 0 and result is not None,
        "detection_s": _after(detected, fault_at),
        "recovery_s": (later[0] - fault_at) if later else None,
        "ended_after_s": (ended - fault_at) if fault_at and status != 0 else None,
        "steps_redone": sum(1 for gens in by_step.values() if len(gens) > 1),
        "samples_lost": lost, "samples_twice": twice, "padding_allowed": padding,
        "replicas_equal": None if result is None else result["replicas_equal"],
        "accuracy": None if result is None else result["accuracy"],
        "sizes": _phases([r["size"] for r in records]),
        "checkpoint_loads": _checkpoint_loads(tmp),
        "wall_s": ended - started,
        "hvdrun": [line for line in output.splitlines() if line.startswith("hvdrun:")],
        "errors": sorted({line.split("ERROR: ", 1)[1][:200] for line in output.splitlines()
                          if "ERROR: " in line})[:6],
    }


def samples_accounting(records):
    """(lost, seen twice, padding allowed) over the steps that count: for each global step, the
    records of the last generation that ran it (a failed generation's uncommitted steps were
    rolled back and redone).  The sampler pads each re-formed remainder of an epoch by up to
    size - 1 repeated samples; that is the allowance."""
    last_gen = {}
    for r in records:
        last_gen[r["step"]] = max(last_gen.get(r["step"], 0), r["gen"])
    counted = [r for r in records if r["gen"] == last_gen[r["step"]]]
    lost = twice = padding = 0
    for epoch in sorted({r["epoch"] for r in counted}):
        seen = {}
        for r in counted:
            if r["epoch"] == epoch:
                for i in r["ids"]:
                    seen[i] = seen.get(i, 0) + 1
        lost += MAX_TRAIN - len(seen)
        twice += sum(n - 1 for n in seen.values() if n > 1)
        in_epoch = [r for r in counted if r["epoch"] == epoch]
        padding += len({r["gen"] for r in in_epoch}) * (max(r["size"] for r in in_epoch) - 1)
    return lost, twice, padding


def _after(times, since):
    later = [t for t in times if since is not None and t > since]
    return later[0] - since if later else None


def _checkpoint_loads(tmp: str):
    path = os.path.join(tmp, "checkpoint.pt")
    if not os.path.exists(path):
        return None
    import torch
    try:
        return "model" in torch.load(path, weights_only=True)
    except Exception:   # noqa: BLE001 - a torn checkpoint is what this looks for
        return False


def _phases(sizes):
    return [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s]


# --- the report -------------------------------------------------------------------------------
def summary(runs):
    """One row per fault over its runs (the undisturbed runs give the accuracy's spread)."""
    base = [r["accuracy"] for r in runs if r["fault"] == "none" and r["accuracy"] is not None]
    low, high = (min(base), max(base)) if base else (None, None)
    rows = []
    for fault in dict.fromkeys(r["fault"] for r in runs):
        rs = [r for r in runs if r["fault"] == fault]
        injected = [r for r in rs if r["injected"] or fault == "none"]
        acc = [r["accuracy"] for r in injected if r["accuracy"] is not None]
        rows.append({
            "fault": fault, "runs": len(rs), "injected": len(injected),
            "completed": sum(r["completed"] for r in injected),
            "detection_s": _span([r["detection_s"] for r in injected]),
            "recovery_s": _span([r["recovery_s"] for r in injected]),
            "ended_after_s": _span([r["ended_after_s"] for r in injected]),
            "steps_redone": _span([r["steps_redone"] for r in injected]),
            "samples_lost": sum(r["samples_lost"] for r in injected if r["completed"]),
            "samples_twice_over_padding": sum(max(0, r["samples_twice"] - r["padding_allowed"])
                                              for r in injected if r["completed"]),
            "replicas_equal": sum(bool(r["replicas_equal"]) for r in injected),
            "accuracy": _span(acc),
            "accuracy_within_spread": (sum(low - 0.005 <= a <= high + 0.005 for a in acc)
                                       if base else None),
            "checkpoint_loads": sum(r["checkpoint_loads"] is not False for r in injected),
            "why_not": next((r["not_injected_because"] for r in rs
                             if r["not_injected_because"]), None)})
    return rows


def _span(values):
    values = sorted(v for v in values if v is not None)
    return [values[0], values[-1]] if values else None


def _fmt(span, digits=1):
    if span is None:
        return "-"
    lo, hi = span
    return f"{lo:.{digits}f}" if lo == hi else f"{lo:.{digits}f}-{hi:.{digits}f}"


def print_table(rows):
    print(f"{'fault':<19} {'done':>5} {'detect s':>9} {'recover s':>10} {'ended s':>8} "
          f"{'redone':>6} {'lost':>4} {'twice':>5} {'equal':>5} {'accuracy':>13} "
          f"{'in spread':>9} {'ckpt ok':>7}")
    for r in rows:
        if not r["injected"]:
            print(f"{r['fault']:<19} not injected: {r['why_not']}")
            continue
        n = r["injected"]
        print(f"{r['fault']:<19} {r['completed']:>2}/{n:<2} {_fmt(r['detection_s']):>9} "
              f"{_fmt(r['recovery_s']):>10} {_fmt(r['ended_after_s']):>8} "
              f"{_fmt(r['steps_redone'], 0):>6} {r['samples_lost']:>4} "
              f"{r['samples_twice_over_padding']:>5} {r['replicas_equal']:>2}/{n:<2} "
              f"{_fmt(r['accuracy'], 4):>13} {str(r['accuracy_within_spread']):>9} "
              f"{r['checkpoint_loads']:>3}/{n:<2}")


def plot(path: str, report):
    """Detection and recovery time of every run, by fault, next to ``path`` (PNG)."""
    def draw():
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        faults = [f for f in dict.fromkeys(r["fault"] for r in report["runs"]) if f != "none"]
        fig, ax = plt.subplots(figsize=(9, 4))
        for key, shift, colour in (("detection_s", -0.15, "tab:orange"),
                                   ("recovery_s", 0.15, "tab:blue"),
                                   ("ended_after_s", 0.15, "tab:red")):
            for i, fault in enumerate(faults):
                ys = [r[key] for r in report["runs"] if r["fault"] == fault and r[key] is not None]
                ax.scatter([i + shift] * len(ys), ys, color=colour, s=18,
                           label=key[:-2].replace("_", " ") if ys else None)
        ax.axhline(10, color="grey", linestyle=":", linewidth=1)
        ax.set_xticks(range(len(faults)), faults, rotation=20, fontsize=8)
        ax.set_ylabel("seconds after the fault")
        ax.set_title(f"faults in elastic training, {HOSTS} emulated hosts "
                     f"(commit {report['commit']}, {report['date']})", fontsize=9)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=8)
        fig.tight_layout()
        fig.savefig(path.rsplit(".", 1)[0] + ".png", dpi=110)
    _spawn.plot_if_possible(draw)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None, help="only draw the figure of this JSON")
    args = p.parse_args()
    if args.plot:
        with open(args.plot) as f:
            report = json.load(f)
        print_table(summary(report["runs"]))
        return plot(args.plot, report)
    faults = args.faults.split(",")
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        p.error(f"unknown faults {unknown}; known: {FAULTS}")
    rng = random.Random(args.seed)
    report = {**_spawn.provenance(), "hosts": HOSTS, "steps": STEPS, "seed": args.seed,
              "runs": []}
    for run in range(args.runs):
        for fault in faults:
            at = rng.randint(STEPS // 5, 2 * STEPS // 5)
            r = one_run(fault, at, run, args.timeout)
            report["runs"].append(r)
            print(f"run {run} {fault:<19} step {at:>3}: completed {r['completed']}, detect "
                  f"{_fmt([r['detection_s']] * 2 if r['detection_s'] else None, 2)} s, recover "
                  f"{_fmt([r['recovery_s']] * 2 if r['recovery_s'] else None, 2)} s, sizes "
                  f"{r['sizes']}, accuracy {r['accuracy']}", flush=True)
            if args.out:   # after every run: an interrupted session keeps what it has
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=1)
    print()
    report["summary"] = summary(report["runs"])
    print_table(report["summary"])
    if args.out:
        _spawn.write_report(args.out, report)
        plot(args.out, report)


if __name__ == "__main__":
    main()
