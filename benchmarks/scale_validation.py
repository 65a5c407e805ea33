"""The scale model against the network lab: every op's measured reduction time next to its
prediction, at 2, 4 and 8 hosts x 1 rank and 2 hosts x 2 ranks, at 100 Mbit/s and 1 Gbit/s.

    .venv/bin/python benchmarks/calibrate.py --lab          # the profile first (root)
    .venv/bin/python benchmarks/scale_validation.py --lab   # about 15 minutes (root)

A point: one op (Sum, Adasum, 1-bit, random-k 1%, PowerSGD rank 4), flat or hierarchical (2 x 2
only), on a buffer of 8 tensors of 512 x 512 float32 (8 MiB) reduced with one grouped
allreduce; the time per call is the median over 5 blocks of back-to-back calls started together.
The prediction: ``horovod_ext.planning.reduction_times`` for the same cluster (the lab's nominal
rate; latency and TCP efficiency from the profile).  The lab's hosts share this machine's cores:
from 4 hosts up the ranks outnumber the cores, so measurements there include waiting for a core,
which the model (one core per rank) does not; the table marks those points and the summary
gives the error with and without them.

Prints the table and writes JSON (``--out``, default docs/scale/validation.json).
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _spawn  # noqa: E402  (benchmarks/ is not a package)

SHAPES = [(512, 512)] * 8
CONFIGS = [(2, 1), (4, 1), (8, 1), (2, 2)]        # hosts, ranks per host
OPS = ["average", "adasum", "onebit", "randomk", "powersgd"]
RATES = ["100mbit", "1gbit"]


def hvd_op(hvd, name):
    return {"average": hvd.Sum, "adasum": hvd.Adasum, "onebit": hvd.OneBit,
            "randomk": hvd.RandomK(0.01),
            "powersgd": hvd.PowerSGD(rank=4, start_iter=0, min_compression_rate=1.0)}[name]


def worker(args):
    import torch
    import torch.distributed as dist
    import horovod_ext.torch as hvd
    hvd.init()
    op = hvd_op(hvd, args.op)
    g = torch.Generator().manual_seed(hvd.rank())
    tensors = [torch.randn(*shape, generator=g) for shape in SHAPES]

    def call():
        hvd.grouped_allreduce_(tensors, op=op, name="validation")
    seconds, samples = _spawn.median_per_call(call, args.calls, 5, dist.barrier)
    if hvd.rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"seconds": seconds, "samples": samples}, f)
    hvd.shutdown()


def predict(hosts, per_host, rate, op, hierarchical, profile):
    from horovod_ext.planning import Cluster, Options, parse_rate, reduction_times
    link = profile.links.get(rate, {})
    cluster = Cluster(hosts, per_host, parse_rate(rate), latency_s=link.get("latency_s", 50e-6))
    nbytes = sum(4 * a * b for a, b in SHAPES)
    options = Options(layers=len(SHAPES), hidden=SHAPES[0][0])
    (row,) = reduction_times(cluster, [nbytes], [op], [hierarchical], profile, options)
    return row.seconds


def main():
    p = _spawn.parser(__doc__, "scale_validation.json")
    p.set_defaults(out=os.path.join(_spawn.REPO, "docs", "scale", "validation.json"))
    p.add_argument("--op", help=argparse.SUPPRESS)
    p.add_argument("--calls", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--lab", action="store_true", help="run on the lab (root; required)")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--rates", default=",".join(RATES))
    p.add_argument("--profile", help="calibrated profile (default: the package's)")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if not args.lab:
        raise SystemExit("the validation runs on the network lab: pass --lab (as root)")
    from horovod_ext.planning import load_profile
    profile = load_profile(args.profile)
    ops = _spawn.choices(p, args.ops, OPS, "op")
    rates = _spawn.choices(p, args.rates, RATES, "rate")
    here = os.path.abspath(__file__)
    cores = os.cpu_count()
    rows = []
    for rate in rates:
        for hosts, per_host in CONFIGS:
            with _spawn.lab(hosts, rate) as names:
                placement = [names[i // per_host] for i in range(hosts * per_host)]
                for op in ops:
                    for hier in ([False, True] if per_host > 1 else [False]):
                        env = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1" if hier else "0"}
                        got = _spawn.run_collect("gloo", [here, "--worker", "--op", op],
                                                 hosts * per_host, env=env, hosts=placement)
                        predicted = predict(hosts, per_host, rate, op, hier, profile)
                        row = {"rate": rate, "hosts": hosts, "ranks_per_host": per_host,
                               "op": op, "hierarchical": hier, "measured_s": got["seconds"],
                               "samples_s": got["samples"], "predicted_s": predicted,
                               "error": predicted / got["seconds"] - 1,
                               "cpu_starved": hosts * per_host > cores}
                        rows.append(row)
                        print(f"{rate:>8} {hosts}x{per_host} {op:<9} "
                              f"{'hier' if hier else 'flat'}  measured "
                              f"{got['seconds'] * 1e3:8.1f} ms  predicted "
                              f"{predicted * 1e3:8.1f} ms  error {row['error']:+.1%}"
                              f"{'  (ranks > cores)' if row['cpu_starved'] else ''}", flush=True)
    summary = {}
    for name, subset in (("all", rows), ("ranks <= cores", [r for r in rows
                                                            if not r["cpu_starved"]])):
        if subset:
            errors = [abs(r["error"]) for r in subset]
            worst = max(subset, key=lambda r: abs(r["error"]))
            summary[name] = {"points": len(subset), "median_abs_error": statistics.median(errors),
                             "worst": {k: worst[k] for k in ("rate", "hosts", "ranks_per_host",
                                                             "op", "hierarchical", "error")}}
    print(json.dumps(summary, indent=1))
    _spawn.write_report(args.out, {"profile": profile.meta, "shapes": SHAPES, "rows": rows,
                                   "summary": summary})


if __name__ == "__main__":
    main()
