"""The exact average against DistributedDataParallel: step time, same model, data and ranks.

    python benchmarks/ddp_parity.py                          # loopback, 2 hosts x 1 and x 2
    python benchmarks/ddp_parity.py --lab                    # also 1 Gbit/s and 100 Mbit/s (root)
    python benchmarks/ddp_parity.py --variants default,first1m=HOROVOD_FIRST_BUCKET_BYTES:1048576
    python benchmarks/ddp_parity.py --markdown FILE.json     # the tables of an earlier report

What a DDP user measures first: ``hvd.DistributedOptimizer(Adam, op=hvd.Average)`` next to
``DistributedDataParallel`` (its defaults: 25 MB buckets and a 1 MB first bucket) in the same
ranks. Each method first runs the same untimed steps, ``--warmup`` at least, more where ours has
not yet ended its plan trial (DDP rebuilds its buckets after its first step; ours tries its bucket
plans until the 40th to the 193rd, its visits being longer where steps are short), then the two
take turns in ``--blocks`` blocks (Adam, random data, ``--batch`` samples per rank), the order
swapped every block. A block runs ``--steps`` steps of one method, its step time being the median
of the last ``--timed`` on the slowest rank; the ratio is taken block by block against the other
method's block next to it, so that drift of the machine between blocks cancels. Models: ``mlp``
(784-1024-1024-10, 1.86 M parameters), ``cnn`` (examples/fashion_mnist.py's CNN, 0.22 M) and
``transformer`` (``_models.CharLM``, 0.44 M). Every variant of ours (``--variants``:
``label=VAR:value+VAR:value``, or ``default`` for no variables) starts its own ranks with DDP
beside it, so each ratio compares methods of one run. Prints a table per setting and writes JSON,
which also keeps rank 0's median phases of a step per method and block (``phases_rank0``: zero_grad
and forward, backward, opt.step(); DDP reduces inside backward, ours mostly waits in opt.step()),
rank 0's processor time per step (``cpu_rank0``: every thread of the process, per method and block:
on ranks that share cores the step time follows it), the plan trial's medians (over all, and per
round: ``trial_rounds``) and timed steps a visit (``trial_visit_steps``), the untimed steps each
method ran (``warmup_steps``), and every rank's block medians, phases and processor time
(``by_rank``).
"""
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _spawn  # noqa: E402  (benchmarks/ is not a package; also fixes sys.path for the packages)
sys.path.insert(0, HERE)
import _models  # noqa: E402
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

SETTINGS = _spawn.LINK_SETTINGS
MAX_WARMUP = 400   # untimed steps at most, should ours never end its plan trial


def build(kind, batch):
    """A model and its loss on a fixed batch of random data: ``loss(model)``."""
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "transformer":
        chunk = torch.randint(0, 256, (batch, _models.CharLM.CONTEXT + 1), generator=g)
        return _models.CharLM(), lambda m: _models.lm_loss(m, chunk)
    labels = torch.randint(0, 10, (batch,), generator=g)
    if kind == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 10))
        x = torch.randn(batch, 784, generator=g)
    else:
        sys.path.insert(0, os.path.join(_spawn.REPO, "examples"))
        from fashion_mnist import Net
        model, x = Net(), torch.randn(batch, 1, 28, 28, generator=g)
    return model, lambda m: F.cross_entropy(m(x), labels)


def runners(kind, batch, hvd, ddp_hook=None):
    """The same model twice, as DDP (with ``ddp_hook`` as its comm hook, if given) and in
    ours with op=hvd.Average, each with Adam: ({"ddp": (model, optimizer), "hvd": (model,
    DistributedOptimizer)}, the loss function)."""
    import torch
    base, loss = build(kind, batch)
    ddp = torch.nn.parallel.DistributedDataParallel(base)
    if ddp_hook is not None:
        ddp.register_comm_hook(None, ddp_hook)
    ours, _ = build(kind, batch)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(ours.parameters(), lr=1e-4),
                                   named_parameters=ours.named_parameters(), op=hvd.Average)
    return {"ddp": (ddp, torch.optim.Adam(ddp.parameters(), lr=1e-4)), "hvd": (ours, opt)}, loss


def _labels(by_candidate) -> dict:
    """The plan trial's figures by candidate, keyed by a readable label."""
    return {c.cut + (", hierarchical" if c.hierarchical else ""): v
            for c, v in (by_candidate or {}).items()}


def step_times(model, opt, loss, steps):
    """Per-step wall times of ``steps`` training steps, each with its phases: zero_grad and
    forward, backward (DDP's reductions run inside it), and opt.step() (ours wait there)."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        value = loss(model)
        t1 = time.perf_counter()
        value.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        times.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2))
    return times


def _plan_settled(opt) -> bool:
    """Whether ours has learnt its buckets and ended its plan trial (every rank alike)."""
    state = opt._hvd
    return state.layout.trial is None and \
        state.layout.timing_generation == state.progress.generation


def warm_up(methods, loss, least):
    """Untimed steps, the same number for each method: DDP rebuilds its buckets after its first
    step, ours learns its plan and then tries its candidates (its trial's visits are longer
    where steps are short), so ours runs until that has ended, and ``least`` steps at least."""
    import torch.distributed as dist

    ours, opt = methods["hvd"]
    dist.barrier()
    step_times(ours, opt, loss, least)
    count = least
    while not _plan_settled(opt) and count < MAX_WARMUP:
        step_times(ours, opt, loss, 1)
        count += 1
    for name in methods:
        if name != "hvd":
            dist.barrier()
            step_times(*methods[name], loss, count)
    return count


def worker(args):
    import torch.distributed as dist

    hvd = _spawn.start_beside_ddp()
    from horovod_ext.engine import runtime
    size = hvd.size()
    results = {}
    for kind in args.models:
        methods, loss = runners(kind, args.batch, hvd)
        ours, opt = methods["hvd"]
        medians = {name: [] for name in methods}
        phases = {name: [] for name in methods}   # this rank's median forward, backward, step
        stats = runtime.engine().stats
        cpu = {}
        cycles = []   # the engine's negotiation rounds per step, each block of ours
        warmup = warm_up(methods, loss, args.warmup)
        lane_before = opt._hvd.lane.sums if opt._hvd.lane is not None else 0
        for block in range(args.blocks):
            order = list(methods) if block % 2 == 0 else list(reversed(list(methods)))
            for name in order:
                dist.barrier()
                before = stats["cycles"]
                cpu0 = time.process_time()
                times = step_times(*methods[name], loss, args.steps)[-args.timed:]
                cpu.setdefault(name, []).append((time.process_time() - cpu0) / args.steps)
                medians[name].append(statistics.median(t[0] for t in times))
                phases[name].append([statistics.median(t[i] for t in times) for i in (1, 2, 3)])
                if name == "hvd":
                    cycles.append((stats["cycles"] - before) / args.steps)
        per_rank = [None] * size
        dist.all_gather_object(per_rank, (medians, phases, cpu))
        every = [m for m, _, _ in per_rank]
        # the slowest rank sets the pace
        results[kind] = {name: [max(r[name][i] for r in every) for i in range(args.blocks)]
                         for name in methods}
        results[kind]["phases_rank0"] = phases
        results[kind]["cpu_rank0"] = cpu
        # every rank's step times, phases and processor time, by rank: which rank sets the pace
        results[kind]["by_rank"] = [{"step": m, "phases": p, "cpu": c} for m, p, c in per_rank]
        results[kind]["warmup_steps"] = warmup
        results[kind]["trial_visit_steps"] = opt._hvd.layout.trial_visit_steps
        results[kind]["params"] = sum(p.numel() for p in ours.parameters())
        results[kind]["cycles_per_step"] = cycles
        results[kind]["hierarchical"] = bool(runtime.engine().comms.hierarchical_allreduce)
        # the buckets the last block ran with (rank 0's plan is every rank's)
        results[kind]["bucket_bytes"] = [b.flat.numel() * b.flat.element_size()
                                         for b in getattr(opt._hvd.reducer, "buckets", [])]
        # what the plan trial measured (rank 0's median step per candidate, over all and per
        # round), where it ran
        results[kind]["trial_medians"] = _labels(opt._hvd.layout.trial_medians)
        results[kind]["trial_rounds"] = _labels(opt._hvd.layout.trial_rounds)
        # buckets summed on the bucket lane (HOROVOD_BUCKET_LANE) over every step of ours, and
        # in the timed blocks alone (the plan trial runs its flat candidates on the lane)
        lane_sums = opt._hvd.lane.sums if opt._hvd.lane is not None else 0
        results[kind]["lane_sums"] = lane_sums
        results[kind]["lane_sums_timed"] = lane_sums - lane_before
    _spawn.finish_beside_ddp(hvd, results, args.result)


def _cell(values, scale=1e3, fmt=".1f"):
    text = format(statistics.median(values) * scale, fmt)
    return text + f" ({format(min(values) * scale, fmt)}-{format(max(values) * scale, fmt)})"


def _buckets(row) -> str:
    """How many gradient buckets, and the largest in KiB."""
    sizes = row["bucket_bytes"]
    way = ", hierarchical" if row.get("hierarchical") else ""
    # a hierarchical plan never runs on the lane: reports without the timed count had its sums
    # from the trial's flat visits only
    on_lane = row.get("lane_sums_timed", row.get("lane_sums")) and not row.get("hierarchical")
    way += ", on the lane" if on_lane else ""
    return (f"{len(sizes)}, up to {max(sizes) / 1024:.0f} KiB" if sizes else "none") + way


def markdown(report) -> str:
    """One table per setting: each model and variant's step times, their ratio block by block
    and in how many blocks ours was faster, and the buckets of the last block."""
    out = []
    for setting, variants in report["settings"].items():
        out += [f"**{setting}** (step ms, median (min-max) of {report['blocks']} blocks)", "",
                "| model | variant | ddp ms | hvd ms | hvd / ddp | hvd faster | buckets |",
                "|---|---|---|---|---|---|---|"]
        for variant, models in variants.items():
            for kind, row in models.items():
                ratios = [h / d for h, d in zip(row["hvd"], row["ddp"])]
                out.append(f"| {kind} | {variant} | {_cell(row['ddp'])} | {_cell(row['hvd'])} | "
                           f"{_cell(ratios, 1.0, '.3f')} | {sum(r < 1 for r in ratios)} of "
                           f"{len(ratios)} | {_buckets(row)} |")
        out.append("")
    return "\n".join(out + _summary(report))


def _summary(report) -> list:
    """Over every cell: the geometric mean of the block ratios, how many cells' median ratio
    is at most 1, and how many cells ours was faster, or slower, in every block."""
    cells = [[h / d for h, d in zip(row["hvd"], row["ddp"])]
             for variants in report["settings"].values() for models in variants.values()
             for row in models.values()]
    if len(cells) < 2:
        return []
    logs = [math.log(r) for ratios in cells for r in ratios]
    return [f"**All {len(cells)} cells**: hvd / ddp {math.exp(statistics.fmean(logs)):.3f} "
            f"(geometric mean of {len(logs)} block ratios); median ratio at most 1 in "
            f"{sum(statistics.median(c) <= 1 for c in cells)} of {len(cells)} cells; ours "
            f"faster in every block in {sum(max(c) < 1 for c in cells)}, slower in every "
            f"block in {sum(min(c) > 1 for c in cells)}", ""]


VARIANT_ENV = {"default": {}}


def _variant(spec: str) -> str:
    """``label=VAR:value+VAR:value`` (or a bare label known already): remember its variables,
    return its label."""
    label, _, assignments = spec.partition("=")
    if assignments:
        VARIANT_ENV[label] = dict(a.split(":", 1) for a in assignments.split("+"))
    if label not in VARIANT_ENV:
        raise SystemExit(f"--variants: {label!r} has no variables (label=VAR:value)")
    return label


def run(args, setting, variant):
    # debug: a rank that fails prints every thread's stack, so a stuck one shows where
    env = {"BENCH_DDP_PORT": str(_spawn.free_port()), "HOROVOD_LOG_LEVEL": "debug",
           **VARIANT_ENV[variant]}
    argv = [os.path.abspath(__file__), "--worker", "--models", ",".join(args.models),
            "--batch", str(args.batch), "--steps", str(args.steps), "--timed", str(args.timed),
            "--warmup", str(args.warmup), "--blocks", str(args.blocks)]
    return _spawn.run_on(setting, argv, env, args.timeout)


def main():
    p = _spawn.parser(__doc__, "ddp_parity.json")
    p.add_argument("--lab", action="store_true", help="also the lab's 1 Gbit/s and 100 Mbit/s")
    p.add_argument("--settings", help=f"of {', '.join(SETTINGS)}")
    p.add_argument("--models", default="mlp,cnn,transformer")
    p.add_argument("--variants", default="default",
                   help="label=VAR:value+VAR:value, comma separated ('default': no variables)")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--warmup", type=int, default=45,
                   help="untimed steps of each method first, at least")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="steps of a method in a block")
    p.add_argument("--timed", type=int, default=8, help="the last steps of each block timed")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--markdown", metavar="JSON", help="only print an earlier report's tables")
    args = p.parse_args()
    args.models = args.models.split(",") if isinstance(args.models, str) else args.models
    if args.worker:
        return worker(args)
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown(json.load(f)))
        return
    if args.quick:
        args.warmup, args.blocks, args.steps, args.timed = 8, 2, 6, 4
    names = (args.settings.split(",") if args.settings else
             [s for s in _spawn.LAN_SETTINGS if args.lab or SETTINGS[s][0] == "loopback"])
    variants = [_variant(v) for v in args.variants.split(",")]
    report = {"variants": {v: VARIANT_ENV[v] for v in variants}, "models": args.models,
              "batch_per_rank": args.batch, "warmup": args.warmup, "blocks": args.blocks,
              "steps": args.steps, "timed": args.timed, "settings": {}}
    for setting in _spawn.by_link_rate(names, lambda n: SETTINGS[n][1]):
        report["settings"][setting] = {v: run(args, setting, v) for v in variants}
        print(markdown({"blocks": args.blocks,
                        "settings": {setting: report["settings"][setting]}}), flush=True)
        _spawn.write_report(args.out, report)   # after every setting: a failure keeps the rest


if __name__ == "__main__":
    main()
