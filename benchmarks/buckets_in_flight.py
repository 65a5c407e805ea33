"""Two gradient buckets reduced back to back: left running together or one after the other.

A model's buckets: 4.2 MB then 3.2 MB (the MLP of ddp_parity.py cut as DDP cuts it), allreduced
in place on every rank of a setting (``_spawn.LINK_SETTINGS``) with the allreduces flat, by
``hvd.allreduce_async_`` twice then waiting (the engine leaves a transfer running while it
negotiates and starts the next), by ``hvd.allreduce_`` twice (one after the other), and by
torch.distributed as DDP reduces its buckets (both ``all_reduce(async_op=True)`` in flight) and one
after the other.  Each method: median of 10 calls after 2, in 3 rounds, the methods in turn.
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _spawn  # noqa: E402  (benchmarks/ is not a package; also fixes sys.path for the packages)

BUCKETS = (4239 * 1024, 3215 * 1024)   # bytes
METHODS = ("hvd_in_flight", "hvd_one_by_one", "dist_in_flight", "dist_one_by_one")


def worker(args):
    import torch
    import torch.distributed as dist
    hvd = _spawn.start_beside_ddp()
    buckets = [torch.randn(n // 4) for n in BUCKETS]

    def hvd_in_flight():   # the same names every step, as DistributedOptimizer's buckets
        handles = [hvd.allreduce_async_(b, op=hvd.Sum, name=f"bucket{i}.in_flight")
                   for i, b in enumerate(buckets)]
        for h in handles:
            hvd.synchronize(h)

    def hvd_one_by_one():
        for i, b in enumerate(buckets):
            hvd.allreduce_(b, op=hvd.Sum, name=f"bucket{i}")

    def dist_in_flight():
        for work in [dist.all_reduce(b, async_op=True) for b in buckets]:
            work.wait()

    def dist_one_by_one():
        for b in buckets:
            dist.all_reduce(b)

    fns = dict(zip(METHODS, (hvd_in_flight, hvd_one_by_one, dist_in_flight, dist_one_by_one)))
    rounds = {name: [] for name in METHODS}
    for _ in range(args.rounds):
        for name in METHODS:
            times = []
            for _ in range(args.calls + 2):
                dist.barrier()
                start = time.perf_counter()
                fns[name]()
                times.append(time.perf_counter() - start)
            rounds[name].append(statistics.median(times[2:]))
    every = [None] * hvd.size()
    dist.all_gather_object(every, rounds)
    slowest = {name: [max(r[name][i] for r in every) for i in range(args.rounds)]
               for name in METHODS}
    _spawn.finish_beside_ddp(hvd, slowest, args.result)


def markdown(report) -> str:
    out = ["| setting | " + " | ".join(METHODS) + " |", "|---" * (len(METHODS) + 1) + "|"]
    for setting, rounds in report["settings"].items():
        cells = [f"{statistics.median(rounds[m]) * 1e3:.1f} ({min(rounds[m]) * 1e3:.1f}-"
                 f"{max(rounds[m]) * 1e3:.1f})" for m in METHODS]
        out.append(f"| {setting} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main():
    p = _spawn.parser(__doc__, "buckets_in_flight.json")
    p.add_argument("--settings", default="loopback-2x1,loopback-2x2,lab-1gbit-2x1,lab-1gbit-2x2",
                   help=f"of {', '.join(_spawn.LINK_SETTINGS)} (lab ones need root)")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.calls, args.rounds = 3, 1
    report = {"buckets_bytes": list(BUCKETS), "calls": args.calls, "rounds": args.rounds,
              "settings": {}}
    names = args.settings.split(",")
    for setting in _spawn.by_link_rate(names, lambda n: _spawn.LINK_SETTINGS[n][1]):
        env = {"BENCH_DDP_PORT": str(_spawn.free_port()), "HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}
        argv = [os.path.abspath(__file__), "--worker", "--calls", str(args.calls),
                "--rounds", str(args.rounds)]
        report["settings"][setting] = _spawn.run_on(setting, argv, env)
    print("ms per pair of buckets, median (min-max) of the rounds, slowest rank\n")
    print(markdown(report))
    _spawn.write_report(args.out, report)


if __name__ == "__main__":
    main()
