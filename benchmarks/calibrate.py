"""Calibrate the scale model (horovod_ext.planning): this machine's costs, and the lab's links.

    .venv/bin/python benchmarks/calibrate.py          # local work, loopback, shared memory
    .venv/bin/python benchmarks/calibrate.py --lab    # also 2 lab hosts at 100 Mbit/s and
                                                      # 1 Gbit/s (root; tools/netlab.sh)

Measures, on one core: each op's local work per byte (reduction, copy, Adasum's dot products
and combine, 1-bit compress and decompress, random-k gather and scatter, Adam and LAMB steps),
PowerSGD's matrix products, the control plane's cost per peer; with 2 local ranks: a raw Gloo
allreduce of 4 bytes and of 16 MiB (the software cost of a message, loopback bandwidth), the same
through horovod_ext (the engine's cost per call) and a 64 MiB allreduce through shared memory;
on the lab: raw Gloo allreduces of 256 KiB to 16 MiB between 2 hosts, fitted to
``2 (latency + message) + bytes / bandwidth``: the achieved fraction of the link rate and the
latency.  Writes the profile ``hvdrun --plan`` reads (``--out``, default the package's
horovod_ext/planning/profile_cpu.json) with the commit, date and machine, and prints it.
"""
import argparse
import json
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


def timed(fn, calls, blocks, barrier) -> float:
    return _spawn.median_per_call(fn, calls, blocks, barrier)[0]


def worker(args):
    import torch
    import torch.distributed as dist
    import horovod_ext.torch as hvd
    hvd.init()
    out = {}
    if args.mode == "loopback":
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
    profile.save(args.out)
    print(json.dumps(profile.to_json(), indent=1, sort_keys=True))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
