"""The scale model against the network lab: every op's measured reduction time next to its
prediction, at 2, 4 and 8 hosts x 1 rank and 2 hosts x 2 ranks, at 100 Mbit/s and 1 Gbit/s.

    .venv/bin/python benchmarks/calibrate.py --lab          # the profile first (root)
    .venv/bin/python benchmarks/scale_validation.py --lab   # about 25 minutes (root)

A point: one op (Sum, Adasum, 1-bit, random-k 1%, PowerSGD rank 4), flat or hierarchical (2 x 2
only), on a buffer of 8 tensors of 512 x 512 float32 (8 MiB) reduced with one grouped
allreduce, and at 2 hosts x 1 also of 8 x 256 x 256 (2 MiB) and 8 x 1024 x 1024 (32 MiB); the
time per call is the median over 5 blocks of back-to-back calls started together.  The
prediction: ``horovod_ext.planning.reduction_times`` for the same cluster (the lab's nominal
rate; latency and TCP efficiency from the profile, each op's own work fitted on loopback by
calibrate.py, never on these points).  The lab's hosts share this machine's cores, and the
cluster says so (``shared_cores``): from 4 ranks up, local work that all ranks do at once takes
ranks / cores as long.  That is a description of the machine, not a fit, but it is cruder than
a core per rank, so the table marks those points and the summary gives the error with and
without them.

Training steps (``--training-steps``, no lab needed once the steps are measured): the CNN and
the transformer of the head-to-head benchmark, trained at 2 hosts x 1 on the lab on this machine
(the profile's), against ``horovod_ext.planning.training_step`` for the same model, with the
step's compute (forward, backward, batch) timed here on one thread at the per-rank batch:

    .venv/bin/python benchmarks/head_to_head.py --workload cnn --lab \
        --settings lab-1gbit-2x1,lab-100mbit-2x1 --reps 2 --steps 100 \
        --methods average,adasum,diloco_h50,powersgd_r4,onebit_lamb,slamb \
        --out docs/scale/steps_cnn.json          # and --workload lm ... steps_lm.json
    .venv/bin/python benchmarks/scale_validation.py --training-steps

Each method as the model sees it: Average, Adasum and DiLoCo H = 50 directly; PowerSGD rank 4
after 10% of plain steps; 1-bit LAMB after a 15% warm-up of full-precision steps with LAMB;
SLAMB with its model average every 50 steps.  Stored beside the reduction points
(``training_steps`` in the JSON).

Prints the table and writes JSON (``--out``, default docs/scale/validation.json).
"""
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _spawn  # noqa: E402  (benchmarks/ is not a package)

calibrate = _spawn.sibling("calibrate")

SHAPES = "8x512x512"
SIZES_2X1 = ["8x256x256", SHAPES, "8x1024x1024"]
CONFIGS = [(2, 1), (4, 1), (8, 1), (2, 2)]        # hosts, ranks per host
OPS = ["average", "adasum", "onebit", "randomk", "powersgd"]
RATES = ["100mbit", "1gbit"]


def lab_cluster(hosts, per_host, rate, profile, cores):
    """The lab as the model describes it: the nominal rate, the profile's latency for it, all
    ranks on the machine's ``cores``."""
    from horovod_ext.planning import Cluster, parse_rate
    latency = profile.links.get(rate, {}).get("latency_s", 50e-6)
    return Cluster(hosts, per_host, parse_rate(rate), latency_s=latency, shared_cores=cores)


def show(row, profile, cores):
    """Adds the prediction to ``row`` and prints the row."""
    cluster = lab_cluster(row["hosts"], row["ranks_per_host"], row["rate"], profile, cores)
    row["predicted_s"] = calibrate.predict_op(cluster, row["op"], row["hierarchical"],
                                              row["shapes"], profile)
    row["error"] = row["predicted_s"] / row["measured_s"] - 1
    print(f"{row['rate']:>8} {row['hosts']}x{row['ranks_per_host']} {row['op']:<9} "
          f"{row['shapes']:<12} {'hier' if row['hierarchical'] else 'flat'}  measured "
          f"{row['measured_s'] * 1e3:8.1f} ms  predicted {row['predicted_s'] * 1e3:8.1f} ms  "
          f"error {row['error']:+.1%}{'  (ranks > cores)' if row['cpu_starved'] else ''}",
          flush=True)


def predict_all(rows, profile, cores):
    """Predictions for measured rows; the summary of their errors."""
    for row in rows:
        if "predicted_s" not in row:
            show(row, profile, cores)
    summary = {}
    for name, subset in (("all", rows), ("ranks <= cores", [r for r in rows
                                                            if not r["cpu_starved"]])):
        if subset:
            errors = [abs(r["error"]) for r in subset]
            worst = max(subset, key=lambda r: abs(r["error"]))
            summary[name] = {"points": len(subset), "median_abs_error": statistics.median(errors),
                             "worst": {k: worst[k] for k in ("rate", "hosts", "ranks_per_host",
                                                             "op", "shapes", "hierarchical",
                                                             "error")}}
    return summary


def compute_seconds(head, report, ranks=2, steps=10, blocks=5):
    """Forward, backward and batch of one rank's share of a step of the head-to-head run in
    ``report`` (``head``: the head_to_head module), one thread: the median over ``blocks`` of
    ``steps`` steps."""
    import types
    import torch
    torch.set_num_threads(1)
    work = head.Workload(report["workload"], types.SimpleNamespace(
        data_dir=head.FASHION_MNIST, lm_held_out=report["options"]["lm_held_out"]))
    global_batch = report["global_batch"]
    model = work.make_model()
    per_rank = global_batch // ranks
    order = torch.randperm(work.samples, generator=torch.Generator().manual_seed(0))

    def step(i):
        model.zero_grad()
        idx = order[i * per_rank:(i + 1) * per_rank]
        loss = work.loss(model, work.batch(idx))
        loss.backward()
        loss.item()
    for i in range(3):
        step(i)
    times = []
    for b in range(blocks):
        start = time.perf_counter()
        for i in range(steps):
            step(b * steps + i)
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times), model


def powersgd_hidden(model):
    """The side of the square blocks with the same elements and factor bytes as the model's
    matrices (each tensor taken as shape[0] x the rest, as PowerSGD does)."""
    elements = sides = 0
    for p in model.parameters():
        if p.dim() > 1:
            rows = p.shape[0]
            cols = p.numel() // rows
            elements += rows * cols
            sides += rows + cols
    return max(1, round(2 * elements / max(1, sides)))


def predicted_steps(cluster, model, compute_s, profile, head, warmup_fraction):
    """Seconds per step of each head-to-head method of ours, as the model prices it (``head``:
    the head_to_head module, whose settings the methods ran with)."""
    from horovod_ext.planning import Options, reduction_times, training_step
    nbytes = 4 * sum(p.numel() for p in model.parameters())
    tensors = sum(1 for _ in model.parameters())
    options = Options(layers=tensors, hidden=powersgd_hidden(model), powersgd_rank=4)
    step = {r.op: r.step_s for r in training_step(
        cluster, nbytes, compute_s, ["average", "adasum", "onebit", "slamb", "powersgd",
                                      "diloco"], profile, options, hierarchical=[False])}
    (whole,) = reduction_times(cluster, [nbytes], ["average"], [False], profile, options)
    lamb_instead_of_adam = profile.cost("optimizer_lamb", nbytes) - \
        profile.cost("optimizer_adam", nbytes)
    plain, warm = head.PLAIN_START_FRACTION, warmup_fraction
    return {"average": step["average"], "adasum": step["adasum"],
            "diloco_h50": step["diloco"],
            "powersgd_r4": plain * step["average"] + (1 - plain) * step["powersgd"],
            "onebit_lamb": warm * (step["average"] + lamb_instead_of_adam)
            + (1 - warm) * step["onebit"],
            "slamb": step["slamb"] + whole.seconds / head.SLAMB_INTERVAL}


def training_steps(profile, cores):
    """Measured steps at 2 hosts x 1 (docs/scale/steps_<workload>.json, from head_to_head.py on
    this machine) against the model's."""
    head = _spawn.sibling("head_to_head")
    rows = []
    for workload in ("cnn", "lm"):
        report = _spawn.read_report(os.path.join(_spawn.REPO, "docs", "scale",
                                                 f"steps_{workload}.json"))
        batch = report["global_batch"]
        per_rep = head.summary(report)
        compute_s, model = compute_seconds(head, report)
        print(f"{workload}: compute {compute_s * 1e3:.1f} ms per step per rank (steps measured "
              f"at commit {report['commit']})", flush=True)
        for rate in RATES:
            predicted = predicted_steps(lab_cluster(2, 1, rate, profile, cores), model,
                                        compute_s, profile, head,
                                        report["options"]["warmup_fraction"])
            for method, seconds in predicted.items():
                reps = [batch / v for v in per_rep[f"lab-{rate}-2x1"][method]["samples_per_s"]]
                measured = statistics.median(reps)
                row = {"workload": workload, "rate": rate, "method": method,
                       "compute_s": compute_s, "measured_s": measured, "reps_s": reps,
                       "predicted_s": seconds, "error": seconds / measured - 1}
                rows.append(row)
                print(f"  {rate:>8} {method:<12} measured {measured * 1e3:7.1f} ms  predicted "
                      f"{seconds * 1e3:7.1f} ms  error {row['error']:+.1%}", flush=True)
    errors = [abs(r["error"]) for r in rows]
    worst = max(rows, key=lambda r: abs(r["error"]))
    return {"rows": rows, "points": len(rows), "median_abs_error": statistics.median(errors),
            "worst": {k: worst[k] for k in ("workload", "rate", "method", "error")}}


def markdown(report):
    """The report's tables, as docs/scale.md shows them."""
    lines = ["| rate | hosts x ranks | op | buffer | form | measured ms (blocks' range) | "
             "predicted ms | error |", "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        low, high = min(r["block_samples_s"]), max(r["block_samples_s"])
        lines.append(f"| {r['rate']} | {r['hosts']}x{r['ranks_per_host']}"
                     f"{' (ranks > cores)' if r['cpu_starved'] else ''} | {r['op']} | "
                     f"{r['shapes']} | {'hierarchical' if r['hierarchical'] else 'flat'} | "
                     f"{r['measured_s'] * 1e3:.1f} ({low * 1e3:.1f}-{high * 1e3:.1f}) | "
                     f"{r['predicted_s'] * 1e3:.1f} | {r['error']:+.1%} |")
    for name, s in report["summary"].items():
        w = s["worst"]
        lines.append(f"\n{name}: {s['points']} points, median absolute error "
                     f"{s['median_abs_error']:.1%}; worst {w['error']:+.1%} ({w['op']}, "
                     f"{w['hosts']}x{w['ranks_per_host']}, {w['rate']}, {w['shapes']})")
    steps = report.get("training_steps")
    if steps:
        lines += ["", "| workload | rate | method | compute ms | measured ms (runs' range) | "
                      "predicted ms | error |", "|---|---|---|---|---|---|---|"]
        for r in steps["rows"]:
            lines.append(f"| {r['workload']} | {r['rate']} | {r['method']} | "
                         f"{r['compute_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} "
                         f"({min(r['reps_s']) * 1e3:.1f}-{max(r['reps_s']) * 1e3:.1f}) | "
                         f"{r['predicted_s'] * 1e3:.1f} | {r['error']:+.1%} |")
        w = steps["worst"]
        lines.append(f"\ntraining steps: {steps['points']} points, median absolute error "
                     f"{steps['median_abs_error']:.1%}; worst {w['error']:+.1%} "
                     f"({w['method']}, {w['workload']}, {w['rate']})")
    return "\n".join(lines)


def main():
    p = _spawn.parser(__doc__, "scale_validation.json")
    p.set_defaults(out=os.path.join(_spawn.REPO, "docs", "scale", "validation.json"))
    p.add_argument("--lab", action="store_true", help="run on the lab (root; required)")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--rates", default=",".join(RATES))
    p.add_argument("--profile", help="calibrated profile (default: the package's)")
    p.add_argument("--repredict", metavar="JSON",
                   help="only predict an earlier report's measured points again with the "
                        "current model and profile (rewrites the JSON)")
    p.add_argument("--markdown", metavar="JSON", help="only print an earlier report's tables")
    p.add_argument("--training-steps", action="store_true",
                   help="only the training-step check, added to the report at --out")
    args = p.parse_args()
    if args.markdown:
        return print(markdown(_spawn.read_report(args.markdown)))
    from horovod_ext.planning import load_profile
    profile = load_profile(args.profile)
    if args.training_steps:
        report = _spawn.read_report(args.out)
        report["training_steps"] = {**_spawn.provenance(),
                                    **training_steps(profile, report["cores"])}
        print(json.dumps({k: v for k, v in report["training_steps"].items() if k != "rows"},
                         indent=1))
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        return
    if args.repredict:
        with open(args.repredict) as f:
            report = json.load(f)
        for row in report["rows"]:
            row.pop("predicted_s", None)
        report.update(profile=profile.meta, predicted_at=_spawn.provenance(),
                      summary=predict_all(report["rows"], profile, report["cores"]))
        print(json.dumps(report["summary"], indent=1))
        with open(args.repredict, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        return
    if not args.lab:
        raise SystemExit("the validation runs on the network lab: pass --lab (as root)")
    ops = _spawn.choices(p, args.ops, OPS, "op")
    rates = _spawn.choices(p, args.rates, RATES, "rate")
    cores = os.cpu_count()
    rows = []
    for rate in rates:
        for hosts, per_host in CONFIGS:
            with _spawn.lab(hosts, rate) as names:
                placement = [names[i // per_host] for i in range(hosts * per_host)]
                for op in ops:
                    for shapes in (SIZES_2X1 if (hosts, per_host) == (2, 1) else [SHAPES]):
                        for hier in ([False, True] if per_host > 1 else [False]):
                            env = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1" if hier else "0"}
                            got, samples = calibrate.time_op(op, shapes, hosts * per_host,
                                                             calls=2, env=env, hosts=placement)
                            row = {"rate": rate, "hosts": hosts, "ranks_per_host": per_host,
                                   "op": op, "shapes": shapes, "hierarchical": hier,
                                   "measured_s": got, "block_samples_s": samples,
                                   "cpu_starved": hosts * per_host > cores}
                            rows.append(row)
                            show(row, profile, cores)
    summary = predict_all(rows, profile, cores)
    print(json.dumps(summary, indent=1))
    _spawn.write_report(args.out, {"profile": profile.meta, "cores": cores, "rows": rows,
                                   "summary": summary})


if __name__ == "__main__":
    main()
