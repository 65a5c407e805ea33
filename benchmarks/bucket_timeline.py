"""Where a training step's reductions spend their time: ours against DDP's, event by event.

    python benchmarks/bucket_timeline.py                       # loopback 2 x 1, the MLP and CNN
    python benchmarks/bucket_timeline.py --settings lab-1gbit-2x1 --models mlp   # root

The same models and ranks as ddp_parity.py.  Each step, every rank notes (monotonic clock, ms
from the start of backward) when each gradient bucket was handed over (ours: the bucket's hook
submits it; DDP: its comm hook calls ``all_reduce``), when our engine's agreement round for it
began and ended (``control.agree``), when its transfer started and ended (the engine's executor;
a transfer left running ends at its callback), when DDP's allreduce of it ended, and when
backward and the step ended.  After ``--warmup`` steps of each method, ``--blocks`` blocks of
``--steps`` steps, the methods in turn.  Prints each rank's median of each event per method and
writes JSON.  The events come from wrapping the engine's own functions in the worker (nothing
is changed in the package): a way to see what a cell of ddp_parity.py spends, not a speed
measure of its own.
"""
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _spawn  # noqa: E402  (benchmarks/ is not a package; also fixes sys.path for the packages)
sys.path.insert(0, HERE)
import ddp_parity  # noqa: E402
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

BUCKET = "DistributedOptimizer.bucket."   # the requests of DistributedOptimizer's buckets


def _instrument(events):
    """Wrap the engine's functions so that they note their events in ``events`` (a list of
    (name, monotonic seconds)): bucket hand-over, agreement rounds, transfers."""
    from horovod_ext.backends import control
    from horovod_ext.engine import Handle, execution
    from horovod_ext.torch.reduction import gradients
    clock = time.monotonic

    def count(prefix):
        return sum(1 for name, _ in events if name.startswith(prefix))

    reduce_bucket = gradients.BucketReducer.reduce_bucket

    def handed_over(self, bucket):
        events.append((f"b{bucket.index} handed over", clock()))
        return reduce_bucket(self, bucket)
    gradients.BucketReducer.reduce_bucket = handed_over

    run_allreduce = execution.Executor._run_allreduce

    def transfer(self, members):
        events.append((f"b{members[0].name.rsplit('.', 1)[-1]} transfer starts", clock()))
        return run_allreduce(self, members)
    execution.Executor._run_allreduce = transfer

    finish = Handle._finish

    def finished(self, *args, **kwargs):
        if self.name.startswith(BUCKET):
            events.append((f"b{self.name[len(BUCKET):]} transfer ends", clock()))
        return finish(self, *args, **kwargs)
    Handle._finish = finished

    agree = control.ControlChannel.agree

    def agreement(self, payload, caller_blocked=False):
        k = count("agreement") // 2
        events.append((f"agreement {k} begins", clock()))
        try:
            return agree(self, payload, caller_blocked)
        finally:
            events.append((f"agreement {k} ends", clock()))
    control.ControlChannel.agree = agreement


def _ddp_hook(events, size):
    """DDP's default allreduce hook, noting when each bucket is handed over and reduced."""
    import torch.distributed as dist

    def hook(_, bucket):
        i = bucket.index()
        events.append((f"b{i} handed over", time.monotonic()))
        future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()

        def ended(f):
            events.append((f"b{i} transfer ends", time.monotonic()))
            return f.value()[0].div_(size)
        return future.then(ended)
    return hook


def worker(args):
    import torch.distributed as dist
    hvd = _spawn.start_beside_ddp()
    events = []
    _instrument(events)
    results = {}
    for kind in args.models:
        runners, loss = ddp_parity.runners(kind, args.batch, hvd, _ddp_hook(events, hvd.size()))
        steps = {name: [] for name in runners}
        for name, (model, optimizer) in runners.items():
            dist.barrier()
            ddp_parity.step_times(model, optimizer, loss, args.warmup)
        for _ in range(args.blocks):
            for name, (model, optimizer) in runners.items():
                dist.barrier()
                for _ in range(args.steps):
                    step = _timed_step(model, optimizer, loss, events)
                    if name == "ddp":   # our engine's idle rounds, not DDP's
                        step = {e: t for e, t in step.items() if not e.startswith("agreement")}
                    steps[name].append(step)
        every = [None] * hvd.size()
        dist.all_gather_object(every, steps)
        results[kind] = {"per_rank": [{name: _medians(s) for name, s in r.items()}
                                      for r in every]}
    _spawn.finish_beside_ddp(hvd, results, args.result)


def _timed_step(model, optimizer, loss, events):
    """One step's events, ms from the start of backward (the first of each name)."""
    events.clear()
    optimizer.zero_grad()
    value = loss(model)
    start = time.monotonic()
    value.backward()
    events.append(("backward ends", time.monotonic()))
    optimizer.step()
    events.append(("step ends", time.monotonic()))
    step = {}
    for name, t in events:
        step.setdefault(name, (t - start) * 1e3)
    return step


def _medians(steps):
    """Each event's median over the steps that had it, in the order of those medians."""
    names = {name for s in steps for name in s}
    medians = {n: statistics.median(s[n] for s in steps if n in s) for n in names}
    return dict(sorted(medians.items(), key=lambda item: item[1]))


def table(report) -> str:
    lines = []
    for setting, models in report["settings"].items():
        for kind, result in models.items():
            lines += [f"\n**{setting}, {kind}** (ms from the start of backward, median of "
                      f"{report['blocks'] * report['steps']} steps)\n",
                      "| rank | method | events |", "|---|---|---|"]
            for rank, methods in enumerate(result["per_rank"]):
                for name, medians in methods.items():
                    cells = ", ".join(f"{e} {t:.1f}" for e, t in medians.items())
                    lines.append(f"| {rank} | {name} | {cells} |")
    return "\n".join(lines)


def main():
    p = _spawn.parser(__doc__, "bucket_timeline.json")
    p.add_argument("--settings", default="loopback-2x1",
                   help=f"of {', '.join(_spawn.LINK_SETTINGS)} (lab ones need root)")
    p.add_argument("--models", default="mlp,cnn")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--warmup", type=int, default=45, help="untimed steps of each method first")
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="steps of a method in a block")
    args = p.parse_args()
    args.models = args.models.split(",") if isinstance(args.models, str) else args.models
    if args.worker:
        return worker(args)
    if args.quick:
        args.warmup, args.blocks, args.steps = 8, 1, 5
    report = {"models": args.models, "batch_per_rank": args.batch, "warmup": args.warmup,
              "blocks": args.blocks, "steps": args.steps, "settings": {}}
    names = _spawn.choices(p, args.settings, _spawn.LINK_SETTINGS, "settings")
    for setting in _spawn.by_link_rate(names, lambda n: _spawn.LINK_SETTINGS[n][1]):
        argv = [os.path.abspath(__file__), "--worker", "--models", ",".join(args.models),
                "--batch", str(args.batch), "--warmup", str(args.warmup),
                "--blocks", str(args.blocks), "--steps", str(args.steps)]
        env = {"BENCH_DDP_PORT": str(_spawn.free_port())}
        report["settings"][setting] = _spawn.run_on(setting, argv, env, 1200)
    print(table(report))
    _spawn.write_report(args.out, report)


if __name__ == "__main__":
    main()
