"""1-bit compressed allreduce (hvd.OneBit) vs float32 Sum allreduce, bytes sent, pack speed.

    python benchmarks/onebit.py             # 1 .. 256 MiB, np=2 and 4, Gloo and MPI, loopback
    python benchmarks/onebit.py --lab       # also 2 emulated hosts x 1 rank at 1 Gbit/s (root)
    python benchmarks/onebit.py --quick     # fewer sizes and calls

Prints tables and writes JSON (``--out``).  Per size, the two ops are timed in blocks of
back-to-back calls that start together after a barrier (outside the timing), taking turns block
by block so that drift on this shared machine hits both alike; times are medians over blocks,
the input copy (timed the same way) subtracted.  The lab part runs ``--lab-runs`` times.  Bytes: what each rank sends
in the compressed allreduce (hvd.OneBit.bytes_sent) against a float32 ring allreduce,
2 (n-1)/n * 4 * numel.  Pack/unpack: compress (scale + signs) and decompress of float32 input on
one thread, in GB/s of input.
"""
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _spawn  # noqa: E402  (benchmarks/ is not a package)
# This file is named like the onebit package: keep benchmarks/ off the path from here on.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

MIB = 1024 * 1024
SIZES = [1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]


def worker(args):
    import torch
    import horovod_ext.torch as hvd

    hvd.init()
    rows = []
    for size in args.sizes:
        numel = size // 4
        g = torch.Generator().manual_seed(hvd.rank())
        data = torch.randn(numel, generator=g)
        buf = torch.empty(numel)
        name = f"bench.onebit.{size}"

        def onebit():
            buf.copy_(data)
            hvd.allreduce_(buf, op=hvd.OneBit, name=name)

        def plain():
            buf.copy_(data)
            hvd.allreduce_(buf, op=hvd.Sum, name="bench.sum")

        def copy_only():
            buf.copy_(data)

        onebit(), plain()   # warm-up: connections, allocator, error state
        before = hvd.OneBit.bytes_sent
        onebit()
        per_call = hvd.OneBit.bytes_sent - before
        # blocks of a few calls (more for small sizes), at least 5 blocks per op
        calls = max(1, min(16, 16 * MIB // size))
        blocks = max(5, min(args.calls * 4, args.calls * 64 * MIB // (size * calls)))
        samples = _spawn.interleaved_blocks(
            {"onebit": onebit, "sum": plain, "copy": copy_only}, calls, blocks, hvd.barrier)
        copy_s = statistics.median(samples["copy"])
        n = hvd.size()
        rows.append({"size": size, "calls": calls, "blocks": blocks,
                     "onebit_ms": (statistics.median(samples["onebit"]) - copy_s) * 1e3,
                     "sum_ms": (statistics.median(samples["sum"]) - copy_s) * 1e3,
                     "onebit_ms_min_max": [(min(samples["onebit"]) - copy_s) * 1e3,
                                           (max(samples["onebit"]) - copy_s) * 1e3],
                     "sum_ms_min_max": [(min(samples["sum"]) - copy_s) * 1e3,
                                        (max(samples["sum"]) - copy_s) * 1e3],
                     "bytes_sent": per_call, "ring_bytes": 2 * (n - 1) / n * 4 * numel})
    if hvd.rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"size": hvd.size(), "mpi": hvd.mpi_enabled(), "rows": rows}, f)
    hvd.shutdown()


def pack_speed(sizes, reps=7):
    """compress + decompress of float32 input on one thread, GB/s of input."""
    import torch
    from horovod_ext.algorithms.onebit import compress, decompress
    torch.set_num_threads(1)
    rows = []
    for size in sizes:
        x = torch.randn(size // 4)
        # reused output buffers, as the compressed allreduce reuses them from call to call
        out = torch.empty_like(x)
        packed = torch.empty(x.numel() // 8, dtype=torch.uint8)
        comp, decomp = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            packed, scales = compress(x, out=packed)
            t1 = time.perf_counter()
            decompress(packed, scales, [x.numel()], x.dtype, out=out)
            t2 = time.perf_counter()
            comp.append(t1 - t0)
            decomp.append(t2 - t1)
        c, d = statistics.median(comp), statistics.median(decomp)
        rows.append({"size": size, "compress_ms": c * 1e3, "decompress_ms": d * 1e3,
                     "compress_gbs": size / c / 1e9, "decompress_gbs": size / d / 1e9,
                     "both_gbs": size / (c + d) / 1e9})
    return rows


def launch(kind, np, sizes, calls, hosts=None):
    argv = [os.path.abspath(__file__), "--worker", "--calls", str(calls),
            "--sizes", ",".join(map(str, sizes))]
    return _spawn.run_collect(kind, argv, np, None, hosts)["rows"]


def print_rows(label, rows):
    for r in rows:
        print(f"{label:<14} {_spawn.human(r['size']):>8} {r['sum_ms']:>10.1f} {r['onebit_ms']:>10.1f} "
              f"{r['sum_ms'] / r['onebit_ms']:>8.2f}x {r['bytes_sent']:>12d} "
              f"{r['ring_bytes'] / r['bytes_sent']:>8.1f}x", flush=True)


HEADER = (f"{'run':<14} {'size':>8} {'sum ms':>10} {'1-bit ms':>10} {'speed-up':>9} "
          f"{'bytes/rank':>12} {'fewer':>9}")


def main():
    p = _spawn.parser(__doc__, "onebit.json", SIZES)
    p.add_argument("--nps", default="2,4")
    p.add_argument("--backends", default="gloo,mpi")
    p.add_argument("--calls", type=int, default=6, help="timed calls per op at 64 MiB")
    p.add_argument("--lab", action="store_true", help="also 2 emulated hosts x 1 rank (root)")
    p.add_argument("--lab-only", action="store_true", help="only the lab runs")
    p.add_argument("--lab-rate", default="1gbit")
    p.add_argument("--lab-runs", type=int, default=3, help="repetitions of the lab part")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.sizes = [1 * MIB, 16 * MIB, 64 * MIB]
        args.calls = 3
    report = {"pack": None, "local": {}, "lab": None}
    if not args.lab_only:
        report["pack"] = pack_speed([4 * MIB, 64 * MIB])
        print("compress (scale + signs) and decompress, float32 input, one thread")
        print(f"{'size':>8} {'compress ms':>12} {'decompress ms':>14} {'GB/s both':>10}")
        for r in report["pack"]:
            print(f"{_spawn.human(r['size']):>8} {r['compress_ms']:>12.2f} {r['decompress_ms']:>14.2f} "
                  f"{r['both_gbs']:>10.2f}", flush=True)
        print("\nloopback; times are medians of allreduce_ calls (input copy subtracted); bytes: "
              "sent per rank per call,\n'fewer': float32 ring allreduce bytes / 1-bit bytes")
        print(HEADER, flush=True)
        for kind in args.backends.split(","):
            for np in map(int, args.nps.split(",")):
                rows = launch(kind, np, args.sizes, args.calls)
                report["local"][f"{kind}-np{np}"] = rows
                print_rows(f"{kind} np={np}", rows)
    if args.lab or args.lab_only:
        sizes = [s for s in args.sizes if s >= 16 * MIB] or args.sizes
        hosts = ["nl-0", "nl-1"]
        print(f"\nlab: 2 hosts x 1 rank at {args.lab_rate}, Gloo\n{HEADER}", flush=True)
        runs = []
        with _spawn.lab(2, args.lab_rate):
            for i in range(args.lab_runs):
                rows = launch("gloo", 2, sizes, args.calls, hosts=hosts)
                runs.append(rows)
                print_rows(f"lab run {i + 1}", rows)
        report["lab"] = {"rate": args.lab_rate, "hosts": hosts, "runs": runs}
    _spawn.write_report(args.out, report)


if __name__ == "__main__":
    main()
