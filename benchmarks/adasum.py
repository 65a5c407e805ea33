"""Adasum vs Sum allreduce time, 1 KiB .. 64 MiB, np = 2 and 4, MPI and Gloo, in the same run.

    python benchmarks/adasum.py              # the whole matrix
    python benchmarks/adasum.py --quick      # 3 sizes, np=2, shorter runs
    python benchmarks/adasum.py --lab 1gbit  # across the network lab's 2 hosts (root)
    python benchmarks/adasum.py --tensors 64 # each call 64 layers in one grouped allreduce
    python benchmarks/adasum.py --markdown RUN.json ...   # earlier reports' tables, run by run

Both ops reduce the same float32 values in place (hvd.allreduce_, the buffer refilled before
each call).  They are timed in blocks of back-to-back calls that start together after a barrier
(outside the timing), as allreduce.py does, taking turns block by block so that drift on a
shared machine hits both alike; the refill's own time, measured the same way, is subtracted.
The table gives the medians over blocks and the ratio Adasum / Sum.  JSON goes to ``--out``.

The "as called" columns time calls the way a training script makes them: a barrier, then one
call under a name never used before (so no response cache or steady-state lane helps either op),
alone.  Blocks of 15 such calls of each op take turns (``--user-blocks``, default 3); the
median call of each block, and the median of those, is reported, and the ratio is the median of
the blocks' ratios (each Adasum block against the Sum block beside it).

``--tensors K`` makes every call one grouped allreduce (hvd.grouped_allreduce_) of K tensors of
size / K bytes each, as a model's layers reach the allreduce together in one fusion buffer; Adasum
combines each tensor with its own dot products, so its arithmetic is per layer.

``--lab RATE`` runs the same matrix across the two hosts of the network lab (tools/netlab.sh, at
RATE per direction), np / 2 ranks on each: a training job's Adasum crosses a link, where the
transfer, not the arithmetic both ops do in memory, sets the time.
"""
import contextlib
import itertools
import time
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
        reduce_ = _reducer(hvd, buf, args.tensors)

        # Every call reduces the same fresh values, as a step reduces fresh gradients
        # (reducing the result again would double it under Sum until it overflows).
        methods = {op: (lambda op=op: (buf.copy_(gradient),
                                       reduce_(ops[op], f"bench.{op}")))
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
        as_called = _as_called(hvd, ops, buf, gradient, reduce_, args.user_blocks)
        rows.append({"size": size, "calls": calls, "blocks": blocks,
                     **{f"{op}_called_us": statistics.median(ts) * 1e6
                        for op, ts in as_called.items()},
                     **{f"{op}_called_us_blocks": [t * 1e6 for t in ts]
                        for op, ts in as_called.items()},
                     **{f"{op}_us": (statistics.median(ts) - refill) * 1e6
                        for op, ts in samples.items()},
                     **{f"{op}_us_min_max": [(min(ts) - refill) * 1e6, (max(ts) - refill) * 1e6]
                        for op, ts in samples.items()}})
    if hvd.rank() == 0:
        import json
        with open(args.result, "w") as f:
            json.dump({"size": hvd.size(), "mpi": hvd.mpi_enabled(), "tensors": args.tensors,
                       "rows": rows}, f)
    hvd.shutdown()


_FRESH = itertools.count()


def _reducer(hvd, buf, tensors):
    """reduce_(op, name): ``buf`` reduced in place, whole or as ``tensors`` equal views of it in
    one grouped call."""
    if tensors == 1:
        return lambda op, name: hvd.allreduce_(buf, op=op, name=name)
    views = list(buf.view(tensors, -1).unbind(0))
    return lambda op, name: hvd.grouped_allreduce_(views, op=op, name=name)


def _as_called(hvd, ops, buf, gradient, reduce_, blocks, calls=15):
    """{op: [median call time of each block]}: each call after a barrier, under a new name."""
    out = {op: [] for op in ops}
    for block in range(blocks):
        for op in (list(ops) if block % 2 == 0 else list(reversed(list(ops)))):
            times = []
            for _ in range(calls):
                buf.copy_(gradient)
                hvd.barrier()
                t0 = time.perf_counter()
                reduce_(ops[op], f"called.{op}.{next(_FRESH)}")
                times.append(time.perf_counter() - t0)
            # the slowest rank's median is what the job waits for
            out[op].append(max(hvd.allgather_object(statistics.median(times))))
    return out


def _us(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def runs_markdown(reports) -> str:
    """Both tables of several reports of the same matrix: per transport, np and size, each run's
    median of each op and each run's ratio Adasum / Sum, back-to-back calls then as called."""
    out = []
    tensors = {report.get("tensors", 1) for report in reports}
    if len(tensors) > 1:
        raise SystemExit(f"the reports hold different --tensors ({sorted(tensors)}): one table "
                         "needs one")
    tensors = tensors.pop()
    each = f", each call {tensors} tensors of size / {tensors}" if tensors > 1 else ""
    for title, key, ratio in (("Back-to-back calls", "us", "ratio"),
                              ("As a script calls it", "called_us", "called_ratio")):
        out += [f"{title}{each}:", "",
                "| transport | size | Sum us (runs) | Adasum us (runs) | Adasum / Sum (runs) |",
                "| --- | ---: | --- | --- | --- |"]
        for i, run in enumerate(reports[0]["runs"]):
            for j, r in enumerate(run["rows"]):
                rows = [report["runs"][i]["rows"][j] for report in reports]
                cells = [", ".join(_us(row[f"{op}_{key}"]) for row in rows)
                         for op in ("sum", "adasum")]
                ratios = ", ".join(f"{row[ratio]:.2f}" for row in rows)
                out.append(f"| {run['transport']} np={run['np']} | {_spawn.human(r['size'])} | "
                           f"{cells[0]} | {cells[1]} | {ratios} |")
        out.append("")
    return "\n".join(out)


def main():
    p = _spawn.parser(__doc__, "adasum.json", SIZES)
    p.add_argument("--markdown", metavar="JSON", nargs="+",
                   help="only print the tables of earlier reports of one matrix (each "
                        "run's medians and ratios)")
    p.add_argument("--nps", default="2,4")
    p.add_argument("--backends", default="mpi,gloo")
    p.add_argument("--seconds", type=float, default=1.5, help="time budget per size")
    p.add_argument("--lab", metavar="RATE",
                   help="across the network lab's 2 hosts at RATE (1gbit, 100mbit; needs root)")
    p.add_argument("--user-blocks", type=int, default=3,
                   help="blocks of 15 calls as a script makes them (barrier, new name)")
    p.add_argument("--tensors", type=int, default=1, metavar="K",
                   help="each call one grouped allreduce of K tensors of size / K")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.markdown:
        import json
        reports = []
        for path in args.markdown:
            with open(path) as f:
                reports.append(json.load(f))
        return print(runs_markdown(reports))
    if args.quick:
        args.sizes, args.nps, args.seconds = [4 * KIB, KIB * KIB, 16 * KIB * KIB], "2", 0.5
    if args.tensors < 1:
        p.error(f"--tensors must be at least 1, not {args.tensors}")
    uneven = [size for size in args.sizes if size % (4 * args.tensors)]
    if uneven:   # before any rank starts, rather than a failure on every rank
        p.error(f"--tensors {args.tensors} does not split {uneven} bytes into equal float32 "
                "tensors")
    report = {"runs": [], "lab": args.lab, "tensors": args.tensors}
    with _spawn.lab(2, args.lab) if args.lab else contextlib.nullcontext():
        _matrix(args, report)
    _spawn.write_report(args.out, report)


def _matrix(args, report):
    """Every np and transport of ``args``, printed row by row, the runs into ``report``."""
    print("medians in microseconds; ratio = Adasum / Sum (hvd.allreduce_, float32, in place)")
    print(f"{'transport':<9} {'np':>3} {'size':>9} {'sum':>10} {'adasum':>10} {'ratio':>7} "
          f"{'sum called':>11} {'adasum called':>14} {'ratio':>7}", flush=True)
    for np in [int(x) for x in args.nps.split(",")]:
        for kind in args.backends.split(","):
            argv = [os.path.abspath(__file__), "--worker", "--seconds", str(args.seconds),
                    "--sizes", ",".join(map(str, args.sizes)),
                    "--user-blocks", str(args.user_blocks), "--tensors", str(args.tensors)]
            hosts = [f"nl-{i * 2 // np}" for i in range(np)] if args.lab else None
            rows = _spawn.run_collect(kind, argv, np, hosts=hosts)["rows"]
            for r in rows:
                r["ratio"] = r["adasum_us"] / r["sum_us"]
                # block by block (each Adasum block against the Sum block beside it), so that
                # the machine's drift between blocks cancels
                r["called_ratio"] = statistics.median(
                    a / b for a, b in zip(r["adasum_called_us_blocks"], r["sum_called_us_blocks"]))
                print(f"{kind:<9} {np:>3} {_spawn.human(r['size']):>9} {r['sum_us']:>10.1f} "
                      f"{r['adasum_us']:>10.1f} {r['ratio']:>7.2f} {r['sum_called_us']:>11.1f} "
                      f"{r['adasum_called_us']:>14.1f} {r['called_ratio']:>7.2f}", flush=True)
            report["runs"].append({"transport": kind, "np": np, "rows": rows})


if __name__ == "__main__":
    main()
