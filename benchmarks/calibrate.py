"""Calibrate the scale model (horovod_ext.planning): this machine's costs, and the lab's links.

    .venv/bin/python benchmarks/calibrate.py          # local work, loopback, shared memory
    .venv/bin/python benchmarks/calibrate.py --lab    # also 2 lab hosts at 100 Mbit/s and
                                                      # 1 Gbit/s (root; tools/netlab.sh)

Measures, on one core: each op's local work per byte (reduction, copy, Adasum's dot products
and combine, 1-bit compress and decompress, random-k gather and scatter, Adam and LAMB steps),
PowerSGD's matrix products, the control plane's cost per peer; with 2 local ranks: a raw Gloo
allreduce of 4 bytes and of 16 MiB (the software cost of a message, loopback bandwidth), the same
through horovod_ext (the engine's cost per call) and a 64 MiB allreduce through shared memory,
then each op that runs its own cross-node step (Adasum, 1-bit, random-k, PowerSGD) on buffers
of 2 to 32 MiB in 8 to 64 tensors: what it takes beyond the model's prediction from the costs
above is its own work (fusion copies, per-tensor bookkeeping, mask drawing,
orthogonalisation), fitted per op as ``call + per_byte * bytes + per_tensor * tensors``; on the
lab: raw Gloo allreduces of 256 KiB to 16 MiB between 2 hosts, fitted to
``2 (latency + message) + bytes / bandwidth``: the achieved fraction of the link rate and the
latency.  Writes the profile ``hvdrun --plan`` reads (``--out``, default the package's
horovod_ext/planning/profile_cpu.json) with the commit, date and machine, and prints it.
"""
import argparse
import json
import math
import os
import platform
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _spawn  # noqa: E402  (benchmarks/ is not a package)

MiB = 1 << 20
PROFILE = os.path.join(_spawn.REPO, "horovod_ext", "planning", "profile_cpu.json")
LINK_SIZES = [256 << 10, 1 * MiB, 4 * MiB, 16 * MiB]
RATES = {"100mbit": 100e6 / 8, "1gbit": 1e9 / 8}
#: ops with a cross-node step of their own, and the buffers their own work is fitted on
OWN_WORK_OPS = ["adasum", "onebit", "randomk", "powersgd"]
OWN_WORK_SHAPES = ["8x256x256", "8x512x512", "32x256x256", "64x128x128", "8x1024x1024"]


def hvd_op(hvd, name):
    """The registry op the scale model calls ``name``."""
    return {"average": hvd.Sum, "adasum": hvd.Adasum, "onebit": hvd.OneBit,
            "randomk": hvd.RandomK(0.01),
            "powersgd": hvd.PowerSGD(rank=4, start_iter=0, min_compression_rate=1.0)}[name]


def parse_shapes(text):
    """"8x512x512" -> 8 tensors of 512 x 512."""
    count, *shape = (int(v) for v in text.split("x"))
    return [tuple(shape)] * count


def shapes_bytes(shapes):
    return sum(4 * math.prod(shape) for shape in shapes)


def time_op(op, shapes, np, calls, env=None, hosts=None, hostnames=None):
    """Seconds of one grouped allreduce of ``shapes`` with ``op`` on ``np`` ranks: the median
    over 5 blocks of ``calls`` calls started together, and the 5 blocks' samples."""
    argv = [os.path.abspath(__file__), "--worker", "--mode", "op", "--op", op,
            "--shapes", shapes, "--calls", str(calls)]
    got = _spawn.run_collect("gloo", argv, np, env=env, hosts=hosts, hostnames=hostnames)
    return got["seconds"], got["samples"]


def predict_op(cluster, op, hierarchical, shapes, profile):
    """The model's seconds for the same reduction."""
    from horovod_ext.planning import Options, reduction_times
    buffers = parse_shapes(shapes)
    options = Options(layers=len(buffers), hidden=buffers[0][0])
    (row,) = reduction_times(cluster, [shapes_bytes(buffers)], [op], [hierarchical], profile,
                             options)
    return row.seconds


def own_work(profile, here_np=2):
    """Each op's time beyond the model's prediction, fitted (profile.per_op): ``here_np``
    ranks on loopback, each named a host of its own so that every op takes the path it takes
    between hosts (TCP, no shared memory)."""
    from horovod_ext.planning import Cluster, calibrate
    cluster = Cluster(here_np, 1, profile.loopback_Bps)
    hostnames = [f"calibrate{i}" for i in range(here_np)]
    fits = {}
    for op in OWN_WORK_OPS:
        points = []
        for shapes in OWN_WORK_SHAPES:
            measured, _ = time_op(op, shapes, here_np, calls=10, hostnames=hostnames)
            predicted = predict_op(cluster, op, False, shapes, profile)
            buffers = parse_shapes(shapes)
            points.append((shapes_bytes(buffers), len(buffers), measured - predicted))
            print(f"  {op:<9} {shapes:<12} measured {measured * 1e3:7.2f} ms, model without "
                  f"its own work {predicted * 1e3:7.2f} ms", flush=True)
        fits[op] = {**calibrate.fit_op_work(points),
                    "points": [{"bytes": b, "tensors": t, "unexplained_s": s}
                               for b, t, s in points]}
    return fits


def timed(fn, calls, blocks, barrier) -> float:
    return _spawn.median_per_call(fn, calls, blocks, barrier)[0]


def worker(args):
    import torch
    import torch.distributed as dist
    import horovod_ext.torch as hvd
    hvd.init()
    out = {}
    if args.mode == "op":
        op = hvd_op(hvd, args.op)
        g = torch.Generator().manual_seed(hvd.rank())
        tensors = [torch.randn(*shape, generator=g) for shape in parse_shapes(args.shapes)]
        out["seconds"], out["samples"] = _spawn.median_per_call(
            lambda: hvd.grouped_allreduce_(tensors, op=op, name="op"), args.calls, 5,
            dist.barrier)
    elif args.mode == "loopback":
        small, big = torch.zeros(1), torch.zeros(16 * MiB // 4)
        shm = torch.zeros(64 * MiB // 4)
        out["raw_small_s"] = timed(lambda: dist.all_reduce(small), 200, 7, dist.barrier)
        out["raw_16MiB_s"] = timed(lambda: dist.all_reduce(big), 4, 7, dist.barrier)
        out["hvd_small_s"] = timed(lambda: hvd.allreduce_(small, op=hvd.Sum, name="s"),
                                          200, 7, dist.barrier)
        out["hvd_shm_64MiB_s"] = timed(
            lambda: hvd.allreduce_(shm, op=hvd.Sum, name="shm"), 3, 7, dist.barrier)
    else:
        for size in LINK_SIZES:
            buf = torch.zeros(size // 4)
            calls = max(2, min(50, (4 * MiB) // size))
            out[str(size)] = timed(lambda: dist.all_reduce(buf), calls, 5, dist.barrier)
    if hvd.rank() == 0:
        with open(args.result, "w") as f:
            json.dump(out, f)
    hvd.shutdown()


def main():
    p = _spawn.parser(__doc__, "calibrate.json")
    p.set_defaults(out=PROFILE)
    p.add_argument("--mode", default="loopback", help=argparse.SUPPRESS)
    p.add_argument("--op", help=argparse.SUPPRESS)
    p.add_argument("--shapes", help=argparse.SUPPRESS)
    p.add_argument("--calls", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--lab", action="store_true", help="also the lab's links (root)")
    args = p.parse_args()
    if args.worker:
        return worker(args)

    from horovod_ext.planning import Profile, calibrate
    print("local costs (one core) ...", flush=True)
    per_byte = calibrate.local_costs()
    flops = calibrate.matmul_flops_per_s()
    control = calibrate.control_round_per_peer()
    print("loopback, 2 ranks ...", flush=True)
    here = os.path.abspath(__file__)
    loop = _spawn.run_collect("gloo", [here, "--worker", "--mode", "loopback"], 2)
    message = loop["raw_small_s"] / 2               # two ring steps
    reduce_half = per_byte["reduce"] * 8 * MiB
    loopback_Bps = 16 * MiB / max(1e-9, loop["raw_16MiB_s"] - 2 * message - reduce_half)
    call = max(0.0, loop["hvd_small_s"] - loop["raw_small_s"] - 2 * control)
    # one host's allreduce through shared memory: reduce-scatter, then all-gather (a copy of
    # the other rank's half)
    shm_reduce = max(0.0, loop["hvd_shm_64MiB_s"] - call - 2 * control) / (64 * MiB) \
        - per_byte["copy"] / 2
    per_byte["shm_reduce"] = max(shm_reduce, per_byte["reduce"])
    links, efficiencies = {}, []
    if args.lab:
        for rate, nominal in RATES.items():
            print(f"lab, 2 hosts at {rate} ...", flush=True)
            with _spawn.lab(2, rate) as hosts:
                got = _spawn.run_collect("gloo", [here, "--worker", "--mode", "link"], 2,
                                         hosts=hosts)
            points = [(int(size), t) for size, t in got.items()]
            slope, intercept = statistics.linear_regression(*zip(*points))
            effective = 1.0 / max(1e-15, slope - per_byte["reduce"] / 2)
            latency = max(0.0, intercept / 2 - message)
            links[rate] = {"nominal_Bps": nominal, "effective_Bps": effective,
                           "efficiency": effective / nominal, "latency_s": latency,
                           "points": {str(s): t for s, t in points}}
            efficiencies.append(effective / nominal)
    profile = Profile(
        per_byte=per_byte,
        per_call={"message": message, "call": call, "control_per_rank": control},
        flops_per_s=flops, loopback_Bps=loopback_Bps, loopback_latency_s=0.0,
        efficiency=statistics.median(efficiencies) if efficiencies else 0.95, links=links,
        meta={**_spawn.provenance(),
              "machine": f"{platform.processor() or platform.machine()}, "
                         f"{os.cpu_count()} cores, {platform.system()}",
              "loopback": loop,
              "command": "benchmarks/calibrate.py" + (" --lab" if args.lab else "")})
    print("each op's own work, 2 loopback ranks ...", flush=True)
    profile.per_op = own_work(profile)
    profile.save(args.out)
    print(json.dumps(profile.to_json(), indent=1, sort_keys=True))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
