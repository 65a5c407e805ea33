"""What the non-finite guard costs: training step time with check_finite off and on.

    python benchmarks/finite_guard.py                 # np = 2, MLP and small transformer
    python benchmarks/finite_guard.py --quick

The model and data of synthetic.py, trained with hvd.DistributedOptimizer(check_finite="raise");
in each round the same ranks run the timed steps with the guard switched off and on, in
alternating order, so machine drift hits both.  Prints the median step time of each, the
overhead with its spread over rounds, and the check alone timed on a step's gradients as a
fraction of the step (target: < 1%), and writes JSON.
"""
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _spawn  # noqa: E402  (benchmarks/ is not a package)


def worker(args):
    import torch
    import horovod_ext.torch as hvd

    hvd.init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    results = {}
    for kind in args.models:
        gen = torch.Generator().manual_seed(hvd.rank())
        model, make_batch, lossf = _spawn.sibling("synthetic").build(kind)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(),
                                       check_finite="raise")
        guard = opt._hvd_finite
        batches = [make_batch(args.batch, gen) for _ in range(4)]

        def steps(n):
            for i in range(n):
                x, y = batches[i % len(batches)]
                opt.zero_grad()
                lossf(model(x), y).backward()
                opt.step()

        steps(args.warmup)
        times = {"off": [], "on": []}
        for r in range(args.rounds):
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                opt._hvd_finite = guard if mode == "on" else None
                hvd.barrier()
                t0 = time.perf_counter()
                steps(args.steps)
                times[mode].append((time.perf_counter() - t0) / args.steps)
        # The check alone, timed on the last step's gradients: the difference of the noisy
        # step times above bounds it only loosely.
        grads = [p.grad for p in guard.params if p.grad is not None]
        checks = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            guard._non_finite(grads)
            checks.append(time.perf_counter() - t0)
        times["check"] = [statistics.median(checks)] * args.rounds
        every = hvd.allgather_object(times, name=f"times.{kind}")   # the slowest rank's pace
        results[kind] = {mode: [max(rank[mode][r] for rank in every)
                                for r in range(args.rounds)] for mode in times}
        results[kind]["tensors"] = len(guard.params)
        results[kind]["elements"] = sum(g.numel() for g in grads)
    if hvd.rank() == 0:
        with open(args.result, "w") as f:
            json.dump(results, f)
    hvd.shutdown()


def main():
    args = _spawn.rounds_arguments(__doc__, "finite_guard.json")
    if args.worker:
        return worker(args)
    argv = _spawn.rounds_worker_argv(__file__, args)
    report = {"np": args.np, "batch_per_rank": args.batch, "steps": args.steps,
              "rounds": args.rounds, "models": {}}
    print(f"{'model':<12} {'elements':>10} {'off ms/step':>12} {'on ms/step':>12} "
          f"{'overhead':>9} {'per-round min..max':>20} {'check ms':>9} {'check/step':>10}")
    data = _spawn.run_collect("gloo", argv, args.np)
    for kind in args.models:
        off, on = data[kind]["off"], data[kind]["on"]
        per_round = [b / a - 1 for a, b in zip(off, on)]
        row = {"off_s": off, "on_s": on, "off_median_s": statistics.median(off),
               "on_median_s": statistics.median(on), "tensors": data[kind]["tensors"],
               "elements": data[kind]["elements"],
               "overhead": statistics.median(on) / statistics.median(off) - 1,
               "overhead_per_round": per_round, "check_s": data[kind]["check"][0],
               "check_fraction": data[kind]["check"][0] / statistics.median(off)}
        report["models"][kind] = row
        print(f"{kind:<12} {row['elements']:>10} {row['off_median_s'] * 1e3:>12.2f} "
              f"{row['on_median_s'] * 1e3:>12.2f} {row['overhead'] * 100:>8.2f}% "
              f"{min(per_round) * 100:>9.2f}..{max(per_round) * 100:.2f}% "
              f"{row['check_s'] * 1e3:>9.3f} {row['check_fraction'] * 100:>9.2f}%", flush=True)
    _spawn.write_report(args.out, report)


if __name__ == "__main__":
    main()
