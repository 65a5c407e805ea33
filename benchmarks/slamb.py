"""Bytes per step and step time of LAMB and SLAMB (k = 0.1, 0.01) on a 21 M-parameter model.

    python benchmarks/slamb.py              # np = 2 and 4 on loopback, then 2 lab hosts at 1 Gbit/s
    python benchmarks/slamb.py --no-lab     # loopback only (the lab needs root)
    python benchmarks/slamb.py --quick      # fewer steps

Model: 5 x Linear(2048, 2048) (20.98 M parameters, 10 k of them in biases, which SLAMB syncs in
full), batch 64 per rank, MSE loss, float32, one thread per rank.
Methods, all in the same processes, taking turns step by step:
  compute     plain Lamb, no communication: forward + backward + optimizer step
  lamb        hvd.DistributedOptimizer(hvd.Lamb) (gradient allreduce overlapping backward)
  slamb_<k>   hvd.SLAMB(ratio=k, sync_interval=H): masked momentum sync every step, model
              average every H steps (its time and bytes are spread over the H steps)
Communication time: SLAMB measures its own (``last_comm_seconds``); for LAMB it is the step time
minus the compute-only step (the part of the allreduce not hidden behind backward).  Bytes are
the payload each rank puts into allreduces per step across ranks (hierarchical: across nodes,
where each rank of a node sends its share; SLAMB's in-node gradient average is not counted).  In the lab, np = 4 is 2 hosts x 2 ranks
with hierarchical allreduce for every method.  Prints a table and writes JSON (``--out``).
"""
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _spawn  # noqa: E402  (not a package; it also takes benchmarks/ off sys.path again, so
#                             that ``import slamb`` finds the package, not this script)

WIDTH, DEPTH, BATCH = 2048, 5, 64


def worker(args):
    import torch
    import horovod_ext.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    r = hvd.rank()
    gen = torch.Generator().manual_seed(r)
    x, y = torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)

    def make_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])

    numel = sum(p.numel() for p in make_model().parameters())
    hierarchical = (os.environ.get("HOROVOD_HIERARCHICAL_ALLREDUCE") == "1"
                    and hvd.cross_size() > 1 and hvd.local_size() > 1)
    results = {"size": hvd.size(), "params": numel, "hierarchical": hierarchical, "methods": {}}
    runs = {}
    for method in args.methods.split(","):
        model = make_model()
        if method == "compute":
            opt = hvd.Lamb(model.parameters(), lr=1e-3)
        elif method == "lamb":
            opt = hvd.DistributedOptimizer(hvd.Lamb(model.parameters(), lr=1e-3),
                                           named_parameters=model.named_parameters())
        else:
            opt = hvd.SLAMB(model.parameters(), lr=1e-3, ratio=float(method.split("_")[1]),
                            sync_interval=args.interval)
        runs[method] = (model, opt, {"step": [], "comm": [], "bytes": []})
    # The methods take turns step by step, so that drift on this shared machine hits all alike.
    for i in range(args.warmup + args.steps):
        for method, (model, opt, samples) in runs.items():
            hvd.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if i >= args.warmup:
                samples["step"].append(time.perf_counter() - t0)
                if method.startswith("slamb"):
                    samples["comm"].append(opt.last_comm_seconds)
                    samples["bytes"].append(opt.last_step_bytes)
    for method, (model, opt, samples) in runs.items():
        row = {"step_s": statistics.median(samples["step"])}
        if method == "lamb":
            # Average allreduce of every float32 gradient; hierarchical: each rank's shard
            # crosses the nodes
            row["bytes"] = 4 * numel / (hvd.local_size() if hierarchical else 1)
        elif method.startswith("slamb"):
            row["comm_s"] = statistics.median(samples["comm"])
            row["bytes"] = statistics.median(samples["bytes"])
            row.update(_spawn.time_model_syncs(hvd, opt, args.syncs))
        results["methods"][method] = row
    if r == 0:
        import json
        with open(args.result, "w") as f:
            json.dump(results, f)
    hvd.shutdown()


def summarise(res, interval):
    """Rows with compute / communication split, amortised model sync, and ratios to LAMB."""
    m = res["methods"]
    compute = m["compute"]["step_s"]
    lamb = m["lamb"]
    lamb["comm_s"] = max(lamb["step_s"] - compute, 0.0)
    lamb["compute_s"] = lamb["step_s"] - lamb["comm_s"]
    rows = {"lamb": dict(lamb, amortised_s=lamb["step_s"], amortised_bytes=lamb["bytes"])}
    for name, row in m.items():
        if not name.startswith("slamb"):
            continue
        row = dict(row)
        row["compute_s"] = row["step_s"] - row["comm_s"]
        row["sync_per_step_s"] = row["model_sync_s"] / interval
        row["amortised_s"] = row["step_s"] + row["sync_per_step_s"]
        row["amortised_bytes"] = row["bytes"] + row["model_sync_bytes"] / interval
        row["bytes_reduction"] = lamb["bytes"] / row["amortised_bytes"]
        row["speedup"] = lamb["step_s"] / row["amortised_s"]
        # What the byte reduction allows if LAMB's communication shrank in proportion and
        # compute stayed LAMB's.
        row["ideal_speedup"] = lamb["step_s"] / (lamb["compute_s"]
                                                 + lamb["comm_s"] / row["bytes_reduction"])
        # The same with SLAMB's own compute (its optimizer step costs more than LAMB's): the
        # speed-up its compute time allows.
        row["bound_speedup"] = lamb["step_s"] / (row["compute_s"]
                                                 + lamb["comm_s"] / row["bytes_reduction"])
        rows[name] = row
    return {"compute_only_s": compute, "rows": rows}


def print_table(title, summary):
    print(f"\n{title}   (compute-only LAMB step: {summary['compute_only_s'] * 1e3:.0f} ms)")
    print(f"{'method':<11} {'MB/step':>8} {'fewer':>6} {'step ms':>8} {'compute':>8} "
          f"{'comm':>7} {'sync/H':>7} {'speed-up':>8} {'ideal':>6} {'bound':>6}")
    for name, r in summary["rows"].items():
        print(f"{name:<11} {r['amortised_bytes'] / 1e6:>8.2f} "
              f"{r.get('bytes_reduction', 1.0):>5.1f}x {r['amortised_s'] * 1e3:>8.0f} "
              f"{r['compute_s'] * 1e3:>8.0f} {r['comm_s'] * 1e3:>7.0f} "
              f"{r.get('sync_per_step_s', 0.0) * 1e3:>7.1f} "
              f"{r.get('speedup', 1.0):>7.2f}x {r.get('ideal_speedup', 1.0):>5.2f}x "
              f"{r.get('bound_speedup', 1.0):>5.2f}x", flush=True)


def main():
    p = _spawn.parser(__doc__, "slamb.json")
    p.add_argument("--methods", default="compute,lamb,slamb_0.1,slamb_0.01")
    p.add_argument("--nps", default="2,4")
    p.add_argument("--backends", default="gloo", help="loopback transports (gloo,mpi)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--syncs", type=int, default=3, help="model syncs timed per SLAMB run")
    p.add_argument("--interval", type=int, default=100, help="SLAMB's H")
    p.add_argument("--no-lab", action="store_true")
    p.add_argument("--lab-only", action="store_true", help="skip the loopback runs")
    p.add_argument("--lab-rate", default="1gbit")
    p.add_argument("--show", metavar="JSON", help="print the tables of an earlier report")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.show:
        import json
        with open(args.show) as f:
            report = json.load(f)
        for run in report["runs"]:
            for name, row in run["rows"].items():
                if name != "lamb":
                    lamb = run["rows"]["lamb"]
                    row["bound_speedup"] = lamb["step_s"] / (
                        row["compute_s"] + lamb["comm_s"] / row["bytes_reduction"])
            print_table(f"{run['where']}, np={run['np']}", run)
        return None
    if args.quick:
        args.steps, args.warmup, args.syncs = 4, 1, 2
    argv = [os.path.abspath(__file__), "--worker", "--methods", args.methods,
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--syncs", str(args.syncs), "--interval", str(args.interval)]
    report = {"model": f"{DEPTH} x Linear({WIDTH}, {WIDTH}), batch {BATCH} per rank",
              "interval": args.interval, "steps": args.steps, "runs": []}
    print(f"model {report['model']}; SLAMB H = {args.interval} (model sync time and bytes "
          f"spread over H steps);\nMB/step: payload per rank per step; step ms: medians; "
          f"comm: SLAMB's own measure, LAMB's step minus compute-only;\nideal: LAMB's step "
          f"if its communication shrank by the byte reduction, over LAMB's step;\nbound: the "
          f"same with SLAMB's compute instead of LAMB's (what its compute time allows)")
    settings = [] if args.lab_only else [(kind, int(n), None) for kind in args.backends.split(",")
                                         for n in args.nps.split(",")]
    for kind, n, _ in settings:
        res = _spawn.run_collect(kind, argv, n)
        summary = summarise(res, args.interval)
        report["runs"].append({"where": f"loopback {kind}", "np": n, **summary,
                               "params": res["params"]})
        print_table(f"loopback, {kind}, np={n}, {res['params'] / 1e6:.2f} M parameters", summary)
    if not args.no_lab:
        with _spawn.lab(2, args.lab_rate):
            for n in (int(x) for x in args.nps.split(",")):
                hosts = ["nl-0", "nl-1"] if n == 2 else \
                    [f"nl-{i * 2 // n}" for i in range(n)]
                env = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"} if n > 2 else None
                res = _spawn.run_collect("gloo", argv, n, env=env, hosts=hosts)
                summary = summarise(res, args.interval)
                report["runs"].append({"where": f"lab 2 hosts {args.lab_rate}", "np": n,
                                       "hosts": hosts, **summary, "params": res["params"]})
                print_table(f"lab: 2 hosts at {args.lab_rate}, Gloo, np={n} "
                            f"({'hierarchical' if env else 'flat'})", summary)
    _spawn.write_report(args.out, report)


if __name__ == "__main__":
    main()
