"""Does autotune find good settings?  Throughput after tuning against hand-picked settings.

    python benchmarks/autotune.py                # np = 2 on this host, synthetic.py's MLP
    python benchmarks/autotune.py --lab          # also 2 lab hosts x 2 ranks at 1 Gbit/s
    python benchmarks/autotune.py --quick

Local part: the job starts from bad settings (fusion off, 20 ms cycle time, buckets off) with
HOROVOD_AUTOTUNE=1 and the default budget (3 warm-up samples, 20 samples of 10 steps); once
autotune has settled, its throughput is measured and compared with that of each hand-picked
setting, measured the same way in runs of their own (``--runs`` times each, the median kept).
Lab part (``--lab``, root): 2 hosts of 2 ranks each over a 1 Gbit/s link; autotune starts with
hierarchical allreduce off and may turn it on; both hand-set choices are measured beside it.
Prints tables and writes JSON.
"""
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _spawn  # noqa: E402  (benchmarks/ is not a package)

BAD = {"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_CYCLE_TIME": "20",
       "HOROVOD_GRADIENT_BUCKET_BYTES": "0"}
HAND_PICKED = {
    "defaults (fusion 128 MiB, cycle 1 ms, buckets 25 MiB)": {},
    "buckets 4 MiB": {"HOROVOD_GRADIENT_BUCKET_BYTES": str(4 << 20)},
    "buckets off, fusion 128 MiB": {"HOROVOD_GRADIENT_BUCKET_BYTES": "0"},
    "cycle 0.2 ms, buckets 25 MiB": {"HOROVOD_CYCLE_TIME": "0.2"},
}



def worker(args):
    import torch
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    hvd.init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    gen = torch.Generator().manual_seed(hvd.rank())
    model, make_batch, lossf = _spawn.sibling("synthetic").build("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    batches = [make_batch(args.batch, gen) for _ in range(4)]
    step_count = [0]

    def steps(n):
        for _ in range(n):
            x, y = batches[step_count[0] % len(batches)]
            step_count[0] += 1
            opt.zero_grad()
            lossf(model(x), y).backward()
            opt.step()

    steps(args.warmup)
    tuner = runtime.state.autotuner
    tuning_steps = 0
    if tuner is not None:
        limit = 10_000
        while not tuner.frozen and tuning_steps < limit:
            steps(1)
            tuning_steps += 1
        steps(args.warmup)   # let the settled setting warm up as the others did
    rates = []
    for _ in range(args.rounds):
        hvd.barrier()
        t0 = time.perf_counter()
        steps(args.steps)
        rates.append(args.batch * hvd.size() * args.steps / (time.perf_counter() - t0))
    every = hvd.allgather_object(rates)
    config = runtime.state.config
    result = {"samples_per_s": statistics.median(min(r[i] for r in every)
                                                 for i in range(args.rounds)),
              "tuning_steps": tuning_steps,
              "setting": {"fusion_threshold": config.fusion_threshold,
                          "cycle_time_ms": config.cycle_time_ms,
                          "gradient_bucket_bytes": config.gradient_bucket_bytes,
                          "cache": config.cache_capacity > 0,
                          "hierarchical_allreduce": config.hierarchical_allreduce}}
    if hvd.rank() == 0:
        with open(args.result, "w") as f:
            json.dump(result, f)
    hvd.shutdown()


def _measure(args, env, np_, hosts=None):
    argv = [os.path.abspath(__file__), "--worker", "--batch", str(args.batch),
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--rounds", str(args.rounds)]
    return _spawn.run_collect("gloo", argv, np_, env=env, hosts=hosts)


def _compare(args, title, candidates, tuned_env, np_, hosts=None):
    """Each hand-picked setting and the autotuned run, ``args.runs`` times each, in turns."""
    runs = {name: [] for name in candidates}
    runs["autotune"] = []
    for _ in range(args.runs):
        for name, env in candidates.items():
            runs[name].append(_measure(args, env, np_, hosts))
        runs["autotune"].append(_measure(args, tuned_env, np_, hosts))
    print(f"\n{title}")
    print(f"{'setting':<55} {'samples/s (median)':>19} {'min..max':>17}")
    rows = {}
    for name, results in runs.items():
        rates = [r["samples_per_s"] for r in results]
        rows[name] = {"samples_per_s": rates, "median": statistics.median(rates),
                      "settings": [r["setting"] for r in results],
                      "tuning_steps": [r["tuning_steps"] for r in results]}
        print(f"{name:<55} {rows[name]['median']:>19.0f} {min(rates):>8.0f}..{max(rates):<8.0f}")
    best = max((n for n in rows if n != "autotune"), key=lambda n: rows[n]["median"])
    ratio = rows["autotune"]["median"] / rows[best]["median"]
    print(f"autotune / best hand-picked ({best}): {ratio:.3f}")
    for s, n in zip(rows["autotune"]["settings"], rows["autotune"]["tuning_steps"]):
        print(f"  settled after {n} steps on {s}")
    return {"runs": rows, "best_hand_picked": best, "autotune_over_best": ratio}


def main():
    p = _spawn.parser(__doc__, "autotune.json")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=50, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=3, help="runs of each setting")
    p.add_argument("--lab", action="store_true", help="also 2 lab hosts x 2 ranks (root)")
    p.add_argument("--lab-only", action="store_true")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.steps, args.rounds, args.runs = 20, 2, 1
    report = {"batch_per_rank": args.batch, "steps": args.steps, "rounds": args.rounds,
              "model": "synthetic.py mlp", "start": BAD}
    tuned = dict(BAD, HOROVOD_AUTOTUNE="1")
    if not args.lab_only:
        report["local_np2"] = _compare(args, "np=2 on this host", HAND_PICKED, tuned, 2)
    if args.lab or args.lab_only:
        with _spawn.lab(2, "1gbit") as hosts:
            ranks = [hosts[0], hosts[0], hosts[1], hosts[1]]
            lab_candidates = {"hierarchical allreduce off (defaults)": {},
                              "hierarchical allreduce on":
                                  {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}}
            report["lab_2x2_1gbit"] = _compare(args, "2 lab hosts x 2 ranks, 1 Gbit/s",
                                               lab_candidates, tuned, 4, ranks)
    _spawn.write_report(args.out, report)


if __name__ == "__main__":
    main()
