"""Sum-allreduce latency and bandwidth: horovod_ext next to the raw transport, same buffers.

    python benchmarks/allreduce.py                 # np=2, Gloo and MPI, 4 KiB .. 64 MiB
    python benchmarks/allreduce.py --lab           # also flat vs hierarchical, 2 lab hosts x 2
    python benchmarks/allreduce.py --in-node-only  # shared memory vs the transport, 2 local ranks
    python benchmarks/allreduce.py --quick         # fewer sizes, shorter runs

Prints a table and writes JSON (``--out``).  Each method is timed over blocks of back-to-back
calls that start together (a barrier of the raw transport first, outside the timing), as the OSU
micro-benchmarks do, and reported as the median over blocks of the time per call; the methods
take turns block by block, so that drift on this shared 2-core machine hits all of them alike.
Timing single calls instead would charge one method for the skew the previous one left between
the ranks.  The buffers hold zeros, so every call reduces the same finite values.

Each method is timed twice: back to back, and with the same busy work (``--gap-us``, 500 us by
default, not counted) before every call, as a training step computes between its reductions.
Back-to-back raw calls are a best case for the transport (here a socket round or a busy loop
between raw Gloo calls added up to a few hundred microseconds beyond its own time, noisily), and
a framework always does something between calls, a negotiation round at least; the gap columns
compare the two after the same compute.  Both are reported.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _spawn  # noqa: E402  (benchmarks/ is not a package)

KIB = 1024
SIZES = [4 * KIB * 4 ** i for i in range(7)] + [64 * KIB * KIB]   # 4 KiB .. 16 MiB, 64 MiB


def worker(args):
    import torch
    import horovod_ext.torch as hvd

    hvd.init()
    if hvd.mpi_enabled():
        from mpi4py import MPI
        world = MPI.COMM_WORLD

        def raw_call(buf):
            world.Allreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM)
        barrier = world.Barrier
    else:
        import torch.distributed as dist

        def raw_call(buf):
            dist.all_reduce(buf)
        barrier = dist.barrier
    # Like for like: the raw calls reduce in place, so does hvd.allreduce_; hvd.allreduce
    # (a new tensor, one copy more) is timed too.
    # hvd_x8: eight tensors of this size in flight at once, as a backward pass submits them
    # (they are fused); reported per tensor, next to the raw call's time for one tensor.
    batch = {}

    def hvd_x8(buf):
        bufs = batch.setdefault(buf.numel(), [buf.clone() for _ in range(8)])
        handles = [hvd.allreduce_async_(b, op=hvd.Sum, name=f"bench8.{i}")
                   for i, b in enumerate(bufs)]
        for h in handles:
            hvd.synchronize(h)

    def in_place(buf):
        hvd.allreduce_(buf, op=hvd.Sum, name="bench")

    # (function, busy gap before each call): the "_gap" forms put the same compute between
    # calls for the transport and for us, which ends the overlap of back-to-back calls that
    # Gloo otherwise gets (see the module docstring).
    gap = args.gap_us * 1e-6
    # raw_again: the raw call once more in another slot of the rotation.  Its difference from
    # raw (an A/A comparison) is the noise floor of this machine for the "over" columns.
    methods = {"hvd": (in_place, 0.0), "raw": (raw_call, 0.0), "raw_again": (raw_call, 0.0),
               "hvd_gap": (in_place, gap), "raw_gap": (raw_call, gap),
               "hvd_copy": (lambda buf: hvd.allreduce(buf, op=hvd.Sum, name="bench_copy"), 0.0),
               "hvd_x8": (hvd_x8, 0.0)}
    if args.methods:
        methods = {m: methods[m] for m in args.methods.split(",")}
    rows = []
    for size in args.sizes:
        buf = torch.zeros(size // 4)
        for fn, _ in methods.values():
            _spawn.per_call(lambda: fn(buf), 3, barrier)  # warm-up: connections, caches, allocator
        probe = _spawn.per_call(lambda: in_place(buf), 3, barrier)
        # Blocks of about 20 ms (2..50 calls), as many as fit the time budget.
        calls = int(min(50, max(2, 0.02 / max(probe, 1e-6))))
        blocks = int(min(200, max(3, args.seconds / max(probe * calls, 1e-6) / len(methods))))
        calls, blocks = hvd.broadcast_object((calls, blocks), root_rank=0)  # same calls everywhere
        samples = {m: [] for m in methods}
        for _ in range(blocks):
            for m, (fn, gap_s) in methods.items():
                samples[m].append(_spawn.per_call(lambda: fn(buf), calls, barrier, gap_s))
        row = {"size": size, "calls": calls * blocks}
        for m, ts in samples.items():
            row[f"{m}_us"] = statistics.median(ts) * 1e6 / (8 if m == "hvd_x8" else 1)
        # Each hvd block against the raw block run right next to it: drift of this shared
        # machine between blocks (often larger than the difference measured) cancels out.
        for ours, theirs, key in (("hvd", "raw", "paired_overhead_pct"),
                                  ("hvd_gap", "raw_gap", "paired_gap_overhead_pct"),
                                  ("raw_again", "raw", "paired_a_a_pct")):
            if ours in samples and theirs in samples:
                row[key] = 100.0 * (statistics.median(
                    a / b for a, b in zip(samples[ours], samples[theirs])) - 1.0)
        rows.append(row)
    if hvd.rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"size": hvd.size(), "mpi": hvd.mpi_enabled(), "rows": rows}, f)
    hvd.shutdown()


def launch(kind, np, sizes, seconds, gap_us=0.0, env=None, hosts=None, methods=""):
    argv = [os.path.abspath(__file__), "--worker", "--seconds", str(seconds), "--gap-us", str(gap_us),
            "--sizes", ",".join(map(str, sizes))]
    if methods:
        argv += ["--methods", methods]
    return _spawn.run_collect(kind, argv, np, env, hosts)["rows"]


def in_node(args):
    """2 ranks on this host: hvd.allreduce_ with its in-node steps in shared memory, the
    transport's own allreduce of the same buffer (Gloo: loopback TCP), and hvd.allreduce_ with
    HOROVOD_SHARED_MEMORY=0 (over the transport)."""
    sizes = [s for s in args.sizes if s >= 1024 * KIB] or args.sizes
    print(f"\nin-node: 2 ranks on this host, Sum allreduce in place, {args.in_node_runs} runs\n"
          f"{'transport':<9} {'size':>9} {'raw ms':>9} {'shm ms':>9} {'no-shm ms':>9} "
          f"{'raw/shm':>8}", flush=True)
    rows = []
    for kind in args.backends.split(","):
        for run in range(args.in_node_runs):
            shared = launch(kind, 2, sizes, args.seconds, methods="raw,hvd")
            sockets = launch(kind, 2, sizes, args.seconds, methods="hvd",
                             env={"HOROVOD_SHARED_MEMORY": "0"})
            for a, b in zip(shared, sockets):
                row = {"transport": kind, "run": run, "size": a["size"],
                       "raw_ms": a["raw_us"] / 1e3, "shm_ms": a["hvd_us"] / 1e3,
                       "no_shm_ms": b["hvd_us"] / 1e3}
                row["raw_over_shm"] = row["raw_ms"] / row["shm_ms"]
                rows.append(row)
                print(f"{kind:<9} {_spawn.human(row['size']):>9} {row['raw_ms']:>9.2f} "
                      f"{row['shm_ms']:>9.2f} {row['no_shm_ms']:>9.2f} "
                      f"{row['raw_over_shm']:>7.2f}x", flush=True)
    return {"runs": args.in_node_runs, "rows": rows}


def main():
    p = _spawn.parser(__doc__, "allreduce.json", SIZES)
    p.add_argument("--methods", default="", help=argparse.SUPPRESS)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--backends", default="gloo,mpi")
    p.add_argument("--seconds", type=float, default=2.0, help="time budget per size and method")
    p.add_argument("--gap-us", type=float, default=500.0,
                   help="busy work before each call in the _gap measurements")
    p.add_argument("--lab", action="store_true",
                   help="also flat vs hierarchical on 2 emulated hosts x 2 ranks (needs root)")
    p.add_argument("--lab-rate", default="1gbit")
    p.add_argument("--lab-only", action="store_true", help="skip the local runs")
    p.add_argument("--lab-runs", type=int, default=3, help="repetitions of the lab comparison")
    p.add_argument("--in-node", action="store_true",
                   help="also 2 ranks on this host: shared memory against the transport alone")
    p.add_argument("--in-node-only", action="store_true", help="only the --in-node comparison")
    p.add_argument("--in-node-runs", type=int, default=3)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.sizes = [4 * KIB, 1024 * KIB, 16 * KIB * KIB]
        args.seconds = 0.6
    report = {"np": args.np, "local": {}, "lab": None}
    local_kinds = [] if args.lab_only or args.in_node_only else args.backends.split(",")
    if local_kinds:
        print("raw: the transport alone, in place; hvd_: hvd.allreduce_ (in place); back to back, "
              f"and after {args.gap_us:g} us of busy work per call (gap);\nhvd: hvd.allreduce (new "
              "tensor); x8/tensor: 8 async allreduce_ in flight, time per tensor.  Medians, us.")
        print("over: the median over blocks of each hvd_ block's time against the raw block next "
              "to it, in percent (JSON: paired_*; the ratio of the medians is in it too);\na/a: the "
              "same for a second raw block against the first, the noise floor of this machine.")
        print(f"{'transport':<9} {'size':>9} {'raw':>9} {'hvd_':>9} {'over':>7} {'a/a':>7} "
              f"{'raw gap':>9} {'hvd_ gap':>9} {'over':>7} {'hvd':>9} {'x8/tensor':>9}", flush=True)
    for kind in local_kinds:
        rows = launch(kind, args.np, args.sizes, args.seconds, args.gap_us)
        report["local"][kind] = rows
        for r in rows:
            r["overhead_pct"] = 100.0 * (r["hvd_us"] / r["raw_us"] - 1.0)
            r["gap_overhead_pct"] = 100.0 * (r["hvd_gap_us"] / r["raw_gap_us"] - 1.0)
            r["x8_overhead_pct"] = 100.0 * (r["hvd_x8_us"] / r["raw_us"] - 1.0)
            print(f"{kind:<9} {_spawn.human(r['size']):>9} {r['raw_us']:>9.1f} {r['hvd_us']:>9.1f} "
                  f"{r['paired_overhead_pct']:>6.1f}% {r['paired_a_a_pct']:>6.1f}% "
                  f"{r['raw_gap_us']:>9.1f} "
                  f"{r['hvd_gap_us']:>9.1f} {r['paired_gap_overhead_pct']:>6.1f}% "
                  f"{r['hvd_copy_us']:>9.1f} "
                  f"{r['hvd_x8_us']:>9.1f}", flush=True)
    if args.in_node or args.in_node_only:
        report["in_node"] = in_node(args)
    if args.lab or args.lab_only:
        sizes = [s for s in args.sizes if s >= 1024 * KIB] or args.sizes
        report["lab"] = {"rate": args.lab_rate, "runs": args.lab_runs, "rows": []}
        print(f"\nlab: 2 hosts x 2 ranks at {args.lab_rate}, Sum allreduce, {args.lab_runs} runs"
              f" (hierarchical / flat, each run flat then hierarchical)\n"
              f"{'transport':<9} {'size':>9} {'flat ms':>9} {'hier ms':>9} {'hier/flat':>10}",
              flush=True)
        with _spawn.lab(2, args.lab_rate):
            for kind in args.backends.split(","):
                hosts = ["nl-0", "nl-0", "nl-1", "nl-1"]       # ranks 0-1 on host 0
                for run in range(args.lab_runs):
                    flat = launch(kind, 4, sizes, args.seconds, hosts=hosts, methods="hvd")
                    hier = launch(kind, 4, sizes, args.seconds, hosts=hosts, methods="hvd",
                                  env={"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"})
                    for f, h in zip(flat, hier):
                        row = {"transport": kind, "run": run, "size": f["size"],
                               "flat_ms": f["hvd_us"] / 1e3, "hier_ms": h["hvd_us"] / 1e3}
                        report["lab"]["rows"].append(row)
                        print(f"{kind:<9} {_spawn.human(f['size']):>9} {row['flat_ms']:>9.2f} "
                              f"{row['hier_ms']:>9.2f} {row['hier_ms'] / row['flat_ms']:>9.2f}x",
                              flush=True)
    _spawn.write_report(args.out, report)


if __name__ == "__main__":
    main()
