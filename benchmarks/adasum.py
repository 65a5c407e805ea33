"""Adasum vs Sum allreduce time, 1 KiB .. 64 MiB, np = 2 and 4, MPI and Gloo, in the same run.

    python benchmarks/adasum.py              # the whole matrix
    python benchmarks/adasum.py --quick      # 3 sizes, np=2, shorter runs

Both ops reduce the same float32 values in place (hvd.allreduce_, the buffer refilled before
each call).  They are timed in blocks of back-to-back calls that start together after a barrier
(outside the timing), as allreduce.py does, taking turns block by block so that drift on a
shared machine hits both alike; the refill's own time, measured the same way, is subtracted.
The table gives the medians over blocks and the ratio Adasum / Sum.  JSON goes to ``--out``.
"""
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _spawn  # noqa: E402  (benchmarks/ is not a package)

KIB = 1024
SIZES = [KIB * 4 ** i for i in range(9)]   # 1 KiB .. 64 MiB


def worker(args):
    import torch
    import horovod_ext.torch as hvd

    hvd.init()
    ops = {"sum": hvd.Sum, "adasum": hvd.Adasum}
    rows = []
    for size in args.sizes:
        g = torch.Generator().manual_seed(hvd.rank())
        gradient = torch.randn(size // 4, generator=g)
        buf = gradient.clone()

        # Every call reduces the same fresh values, as a step reduces fresh gradients
        # (reducing the result again would double it under Sum until it overflows).
        methods = {op: (lambda op=op: (buf.copy_(gradient),
                                       hvd.allreduce_(buf, op=ops[op], name=f"bench.{op}")))
                   for op in ops}
        methods["refill"] = lambda: buf.copy_(gradient)
        for fn in methods.values():
            for _ in range(3):   # warm-up: connections, scratch buffers
                fn()
        probe = _spawn.per_call(methods["adasum"], 3, hvd.barrier)
        calls = int(min(50, max(1, 0.05 / max(probe, 1e-6))))     # blocks of ~50 ms
        blocks = int(min(100, max(5, args.seconds / (probe * calls * len(ops)))))
        calls, blocks = hvd.broadcast_object((calls, blocks), root_rank=0)  # the same everywhere
        samples = _spawn.interleaved_blocks(methods, calls, blocks, hvd.barrier)
        refill = statistics.median(samples.pop("refill"))
        rows.append({"size": size, "calls": calls, "blocks": blocks,
                     **{f"{op}_us": (statistics.median(ts) - refill) * 1e6
                        for op, ts in samples.items()},
                     **{f"{op}_us_min_max": [(min(ts) - refill) * 1e6, (max(ts) - refill) * 1e6]
                        for op, ts in samples.items()}})
    if hvd.rank() == 0:
        import json
        with open(args.result, "w") as f:
            json.dump({"size": hvd.size(), "mpi": hvd.mpi_enabled(), "rows": rows}, f)
    hvd.shutdown()


def main():
    p = _spawn.parser(__doc__, "adasum.json", SIZES)
    p.add_argument("--nps", default="2,4")
    p.add_argument("--backends", default="mpi,gloo")
    p.add_argument("--seconds", type=float, default=1.5, help="time budget per size")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.sizes, args.nps, args.seconds = [4 * KIB, KIB * KIB, 16 * KIB * KIB], "2", 0.5
    report = {"runs": []}
    print("medians in microseconds; ratio = Adasum / Sum (hvd.allreduce_, float32, in place)")
    print(f"{'transport':<9} {'np':>3} {'size':>9} {'sum':>10} {'adasum':>10} {'ratio':>7}",
          flush=True)
    for np in [int(x) for x in args.nps.split(",")]:
        for kind in args.backends.split(","):
            argv = [os.path.abspath(__file__), "--worker", "--seconds", str(args.seconds),
                    "--sizes", ",".join(map(str, args.sizes))]
            rows = _spawn.run_collect(kind, argv, np)["rows"]
            for r in rows:
                r["ratio"] = r["adasum_us"] / r["sum_us"]
                print(f"{kind:<9} {np:>3} {_spawn.human(r['size']):>9} {r['sum_us']:>10.1f} "
                      f"{r['adasum_us']:>10.1f} {r['ratio']:>7.2f}", flush=True)
            report["runs"].append({"transport": kind, "np": np, "rows": rows})
    _spawn.write_report(args.out, report)


if __name__ == "__main__":
    main()
