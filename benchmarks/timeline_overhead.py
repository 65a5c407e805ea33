"""What recording a timeline costs: training step time with the timeline off and on.

    python benchmarks/timeline_overhead.py                 # np = 2, MLP and small transformer
    python benchmarks/timeline_overhead.py --quick

The model and data of synthetic.py, trained with hvd.DistributedOptimizer; in each round the
same ranks run the timed steps once without a timeline and once recording one
(hvd.start_timeline / hvd.stop_timeline), in alternating order, so machine drift hits both.
Prints the median step time of each and the overhead, with the spread over rounds, and writes
JSON.
"""
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _spawn  # noqa: E402  (benchmarks/ is not a package)



def worker(args):
    import torch
    import horovod_ext.torch as hvd

    hvd.init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    trace_dir = tempfile.mkdtemp(prefix="timeline_overhead_")
    results = {}
    for kind in args.models:
        gen = torch.Generator().manual_seed(hvd.rank())
        model, make_batch, lossf = _spawn.sibling("synthetic").build(kind)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        batches = [make_batch(args.batch, gen) for _ in range(4)]

        def steps(n):
            for i in range(n):
                x, y = batches[i % len(batches)]
                opt.zero_grad()
                lossf(model(x), y).backward()
                opt.step()

        steps(args.warmup)
        times = {"off": [], "on": []}
        trace_bytes = []
        for r in range(args.rounds):
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                path = os.path.join(trace_dir, f"{kind}.{r}.json")
                if mode == "on":
                    hvd.start_timeline(path)
                hvd.barrier()
                t0 = time.perf_counter()
                steps(args.steps)
                times[mode].append((time.perf_counter() - t0) / args.steps)
                if mode == "on":
                    hvd.stop_timeline()
                    if hvd.rank() == 0:
                        trace_bytes.append(os.path.getsize(path))
                        os.unlink(path)
        # the slowest rank sets each round's pace
        every = hvd.allgather_object(times, name=f"times.{kind}")
        results[kind] = {mode: [max(rank[mode][r] for rank in every)
                                for r in range(args.rounds)] for mode in times}
        results[kind]["trace_bytes_per_step"] = (statistics.median(trace_bytes) / args.steps
                                                 if trace_bytes else 0)
    if hvd.rank() == 0:
        with open(args.result, "w") as f:
            json.dump(results, f)
    hvd.shutdown()


def main():
    args = _spawn.rounds_arguments(__doc__, "timeline_overhead.json")
    if args.worker:
        return worker(args)
    argv = _spawn.rounds_worker_argv(__file__, args)
    report = {"np": args.np, "batch_per_rank": args.batch, "steps": args.steps,
              "rounds": args.rounds, "models": {}}
    print(f"{'model':<12} {'gradients':<11} {'off ms/step':>12} {'on ms/step':>12} "
          f"{'overhead':>9} {'per-round min..max':>20} {'trace KiB/step':>15}")
    # gradient buckets (the default: one request per bucket), and one request per gradient
    # (HOROVOD_GRADIENT_BUCKET_BYTES=0: many more events per step)
    for layout, env in (("buckets", {}), ("per-tensor", {"HOROVOD_GRADIENT_BUCKET_BYTES": "0"})):
        data = _spawn.run_collect("gloo", argv, args.np, env=env)
        for kind in args.models:
            off, on = data[kind]["off"], data[kind]["on"]
            per_round = [b / a - 1 for a, b in zip(off, on)]
            row = {"off_s": off, "on_s": on, "off_median_s": statistics.median(off),
                   "on_median_s": statistics.median(on),
                   "overhead": statistics.median(on) / statistics.median(off) - 1,
                   "overhead_per_round": per_round,
                   "trace_bytes_per_step": data[kind]["trace_bytes_per_step"]}
            report["models"][f"{kind}, {layout}"] = row
            print(f"{kind:<12} {layout:<11} {row['off_median_s'] * 1e3:>12.2f} "
                  f"{row['on_median_s'] * 1e3:>12.2f} {row['overhead'] * 100:>8.1f}% "
                  f"{min(per_round) * 100:>9.1f}..{max(per_round) * 100:.1f}%{'':>4} "
                  f"{row['trace_bytes_per_step'] / 1024:>15.1f}", flush=True)
    _spawn.write_report(args.out, report)


if __name__ == "__main__":
    main()
