"""Training throughput, bytes per step and compute/communication split of every optimizer, end to end.

    python benchmarks/end_to_end.py                  # whole matrix, about 16 min (lab: root)
    python benchmarks/end_to_end.py --quick          # reduced matrix, about 3 min
    python benchmarks/end_to_end.py --settings loopback-2x1,lab-1gbit-2x1 --methods adam,onebit_adam
    python benchmarks/end_to_end.py --plot docs/end_to_end_run3.json   # redraw a report's plots
    python benchmarks/end_to_end.py --markdown docs/end_to_end_run1.json docs/end_to_end_run2.json \
        docs/end_to_end_run3.json    # the tables of docs/choosing_an_op.md: medians and ranges of runs

Model: the BERT-like encoder of ``_models.py`` ("base": hidden 512, 6 layers, vocabulary 16384,
27.5 M parameters) with a masked-language-model loss on synthetic tokens, batch ``--batch`` per
rank of 128 tokens, float32, one thread per rank.

Methods (every one a real training step: forward, backward, communication, update):
  compute_adam / compute_lamb   torch Adam / hvd.Lamb without any communication (the compute)
  adam                 hvd.DistributedOptimizer(Adam, op=hvd.Average)
  adasum               hvd.DistributedOptimizer(Adam, op=hvd.Adasum)
  lamb                 hvd.DistributedOptimizer(hvd.Lamb, op=hvd.Average)
  onebit_adam_warmup   hvd.OnebitAdam in its warm-up stage (full-precision gradient average)
  onebit_adam          hvd.OnebitAdam in its compression stage (1-bit momentum)
  onebit_lamb_warmup / onebit_lamb   the same for hvd.OnebitLamb
  slamb                hvd.SLAMB(ratio=0.1, sync_interval=H): its model sync (every H steps)
                       is timed separately and spread over H steps
1-bit whole run: warm-up for ``--warmup-fraction`` of the steps (15%, about the papers' BERT
warm-ups), the compression stage for the rest: time and bytes weighted accordingly.

Settings: loopback-2x1, loopback-2x2 (2 pretend nodes of 2 ranks on localhost), and 2 emulated
hosts of tools/netlab.sh at 1 Gbit/s and 100 Mbit/s with 1 or 2 ranks each (lab-1gbit-2x1,
lab-1gbit-2x2, lab-100mbit-2x1, lab-100mbit-2x2).  2x2 runs hierarchically
(HOROVOD_HIERARCHICAL_ALLREDUCE=1: inside the node, then across).  Gloo throughout.

Measured: median step time over ``--steps`` steps after ``--warmup`` untimed ones, throughput =
global batch / step; compute = the compute-only step of the same optimizer family, comm = step -
compute (communication not hidden behind backward, plus what the method's own compression
costs).  Bytes: the payload each rank sends across nodes per step (the optimizers' own counters
for 1-bit and SLAMB; for full-precision allreduce the ring's 2 (N-1)/N x 4 bytes x numel, divided
among the ranks of a node when hierarchical); in the lab also the bytes that really left each
host's NIC (eth0 transmit counter, per rank).  Each method runs in turn in the same processes.
Progress goes to stdout; a table per setting; JSON to ``--out``; PNG plots next to it.
"""
import gc
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

METHODS = ["compute_adam", "compute_lamb", "adam", "adasum", "lamb", "onebit_adam_warmup",
           "onebit_adam", "onebit_lamb_warmup", "onebit_lamb", "slamb"]
FAMILY = {"adam": "compute_adam", "adasum": "compute_adam", "onebit_adam_warmup": "compute_adam",
          "onebit_adam": "compute_adam", "lamb": "compute_lamb",
          "onebit_lamb_warmup": "compute_lamb", "onebit_lamb": "compute_lamb",
          "slamb": "compute_lamb"}
SETTINGS = _spawn.LINK_SETTINGS
QUICK_SETTINGS = "loopback-2x1,lab-1gbit-2x1"
LR = {"adam": 1e-4, "lamb": 1e-3}


def make_optimizer(method, model, args):
    import torch
    import horovod_ext.torch as hvd

    params = model.parameters()
    if method == "compute_adam":
        return torch.optim.Adam(params, lr=LR["adam"])
    if method == "compute_lamb":
        return hvd.Lamb(params, lr=LR["lamb"])
    if method in ("adam", "adasum"):
        return hvd.DistributedOptimizer(torch.optim.Adam(params, lr=LR["adam"]),
                                        named_parameters=model.named_parameters(),
                                        op=hvd.Adasum if method == "adasum" else hvd.Average)
    if method == "lamb":
        return hvd.DistributedOptimizer(hvd.Lamb(params, lr=LR["lamb"]),
                                        named_parameters=model.named_parameters())
    if method.startswith("onebit"):
        kind = hvd.OnebitAdam if "adam" in method else hvd.OnebitLamb
        # freeze_step=1: the first (untimed) step is the warm-up, every timed one compresses.
        freeze = 10 ** 9 if method.endswith("warmup") else 1
        return kind(params, lr=LR["adam" if "adam" in method else "lamb"], freeze_step=freeze)
    if method == "slamb":
        return hvd.SLAMB(params, lr=LR["lamb"], ratio=args.ratio, sync_interval=args.interval)
    raise ValueError(f"unknown method {method!r}: one of {METHODS}")


def full_allreduce_bytes(numel: int, size: int, local_size: int, hierarchical: bool) -> float:
    """Payload each rank sends across nodes in a float32 ring allreduce of ``numel`` elements."""
    if hierarchical:
        nodes = size // local_size
        return 2 * (nodes - 1) / nodes * 4 * numel / local_size
    return 2 * (size - 1) / size * 4 * numel


def worker(args):
    import torch
    import horovod_ext.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    rank, local_size = hvd.rank(), hvd.local_size()
    hierarchical = (os.environ.get("HOROVOD_HIERARCHICAL_ALLREDUCE") == "1"
                    and hvd.cross_size() > 1 and local_size > 1)
    in_lab = os.environ.get("GLOO_SOCKET_IFNAME") == "eth0"
    gen = torch.Generator().manual_seed(rank)
    batches = None      # a few synthetic batches per rank, made once the model's shape is known
    results = {"size": hvd.size(), "local_size": local_size, "hierarchical": hierarchical,
               "methods": {}}
    for method in args.methods.split(","):
        torch.manual_seed(0)
        model = _models.bert_like(args.model)
        numel = _models.count_parameters(model)
        results["params"] = numel
        if batches is None:
            batches = [_models.mlm_batch(model, args.batch, gen) for _ in range(4)]
        opt = make_optimizer(method, model, args)
        steps, sent, wire = [], [], []
        for i in range(args.warmup + args.steps):
            hvd.barrier()
            before = opt.bytes_sent if hasattr(opt, "bytes_sent") else 0
            tx = _spawn.nic_tx_bytes() if in_lab else 0
            t0 = time.perf_counter()
            opt.zero_grad()
            _models.mlm_loss(model, batches[i % len(batches)]).backward()
            opt.step()
            elapsed = time.perf_counter() - t0
            if i >= args.warmup:
                steps.append(elapsed)
                sent.append((opt.bytes_sent - before) if hasattr(opt, "bytes_sent") else None)
                # Both ranks of a node share its NIC: read after everybody's step is done.
                hvd.barrier()
                wire.append((_spawn.nic_tx_bytes() - tx) / local_size if in_lab else None)
        row = {"step_s": statistics.median(steps), "steps_s": steps}
        if method.startswith("compute"):
            row["bytes"] = 0.0
        elif method in ("onebit_adam", "onebit_lamb", "slamb"):
            row["bytes"] = statistics.median(sent)
        else:
            row["bytes"] = full_allreduce_bytes(numel, hvd.size(), local_size, hierarchical)
        if in_lab:
            row["wire_bytes"] = statistics.median(wire)
        if method == "slamb":
            row.update(_spawn.time_model_syncs(hvd, opt, args.syncs))
        results["methods"][method] = row
        if rank == 0:
            print(f"    {method:<20} step {row['step_s'] * 1e3:8.0f} ms   "
                  f"{row['bytes'] / 1e6:8.2f} MB/rank/step", flush=True)
        del model, opt
        gc.collect()
    if rank == 0:
        import json
        with open(args.result, "w") as f:
            json.dump(results, f)
    hvd.shutdown()


BASELINE = {"adam": "adam", "adasum": "adam", "onebit_adam_warmup": "adam", "onebit_adam": "adam",
            "onebit_adam_run": "adam", "lamb": "lamb", "onebit_lamb_warmup": "lamb",
            "onebit_lamb": "lamb", "onebit_lamb_run": "lamb", "slamb": "lamb"}


def summarise(res, args):
    """Rows per method: step, throughput, compute/comm split, bytes, ratios to the baseline
    (Adam for the Adam family and Adasum, LAMB for the LAMB family), 1-bit whole-run rows."""
    m, global_batch = res["methods"], args.batch * res["size"]
    rows = {}
    for name, r in m.items():
        row = {"step_s": r["step_s"], "bytes": r["bytes"]}
        if "wire_bytes" in r:
            row["wire_bytes"] = r["wire_bytes"]
        if name == "slamb":
            row["step_s"] += r["model_sync_s"] / args.interval
            row["bytes"] += r["model_sync_bytes"] / args.interval
            row["model_sync_s"] = r["model_sync_s"]
        rows[name] = row
    w = args.warmup_fraction
    for kind in ("adam", "lamb"):
        warm, comp = rows.get(f"onebit_{kind}_warmup"), rows.get(f"onebit_{kind}")
        if warm and comp:
            rows[f"onebit_{kind}_run"] = {
                key: w * warm[key] + (1 - w) * comp[key]
                for key in ("step_s", "bytes", "wire_bytes") if key in warm and key in comp}
    for name, row in rows.items():
        row["samples_per_s"] = global_batch / row["step_s"]
        family = FAMILY.get(name.replace("_run", ""))
        if family in rows:
            row["compute_s"] = min(rows[family]["step_s"], row["step_s"])
            row["comm_s"] = row["step_s"] - row["compute_s"]
        base = rows.get(BASELINE.get(name, ""))
        if base and name != BASELINE[name]:
            row["speedup"] = base["step_s"] / row["step_s"]
            row["volume_reduction"] = base["bytes"] / row["bytes"] if row["bytes"] else None
    return rows


def print_table(title, rows):
    print(f"\n{title}")
    print(f"{'method':<20} {'samples/s':>9} {'step ms':>8} {'compute':>8} {'comm':>7} "
          f"{'MB/step':>8} {'wire MB':>8} {'speed-up':>8} {'fewer B':>8}")
    for name, r in rows.items():
        wire = f"{r['wire_bytes'] / 1e6:8.2f}" if r.get("wire_bytes") is not None else f"{'-':>8}"
        speed = f"{r['speedup']:7.2f}x" if "speedup" in r else f"{'-':>8}"
        fewer = f"{r['volume_reduction']:7.1f}x" if r.get("volume_reduction") else f"{'-':>8}"
        split = (f"{r['compute_s'] * 1e3:8.0f} {r['comm_s'] * 1e3:7.0f}" if "compute_s" in r
                 else f"{'-':>8} {'-':>7}")
        print(f"{name:<20} {r['samples_per_s']:9.2f} {r['step_s'] * 1e3:8.0f} {split} "
              f"{r['bytes'] / 1e6:8.2f} {wire} {speed} {fewer}", flush=True)


LABELS = {"adam": "Adam (Average)", "adasum": "Adam (Adasum)", "lamb": "LAMB (Average)",
          "onebit_adam": "1-bit Adam, compression stage", "onebit_adam_run": "1-bit Adam, whole run",
          "onebit_lamb": "1-bit LAMB, compression stage", "onebit_lamb_run": "1-bit LAMB, whole run",
          "slamb": "SLAMB k=0.1", "onebit_adam_warmup": "1-bit Adam, warm-up stage",
          "onebit_lamb_warmup": "1-bit LAMB, warm-up stage"}
PLOTTED = ["adam", "adasum", "onebit_adam_run", "onebit_adam", "lamb", "onebit_lamb_run",
           "onebit_lamb", "slamb"]


MARKDOWN_ORDER = ["adam", "adasum", "onebit_adam_warmup", "onebit_adam", "onebit_adam_run",
                  "lamb", "onebit_lamb_warmup", "onebit_lamb", "onebit_lamb_run", "slamb"]


def _spread(values, fmt, unit=""):
    """One value, or the median with the range of several runs: ``1.41x (1.35-1.45)``."""
    lo, mid, hi = min(values), statistics.median(values), max(values)
    if f"{lo:{fmt}}" == f"{hi:{fmt}}":  # one run, or runs that agree to the digits shown
        return f"{mid:{fmt}}{unit}"
    return f"{mid:{fmt}}{unit} ({lo:{fmt}}-{hi:{fmt}})"


def markdown(reports) -> str:
    """The reports' tables as docs/choosing_an_op.md shows them, one per setting; with several reports
    (repeated runs of the same matrix) each cell is the median and the range of the runs."""
    if isinstance(reports, dict):
        reports = [reports]
    first = reports[0]
    out = []
    for index, run in enumerate(first["runs"]):
        runs = [r["runs"][index] for r in reports]
        assert all(r["setting"] == run["setting"] for r in runs), "reports of other matrices"
        rows = [r["rows"] for r in runs]

        def values(name, key, scale=1.0):
            return [r[name][key] * scale for r in rows if name in r and key in r[name]]

        compute = ", ".join(f"{label} {_spread(values(key, 'step_s', 1e3), '.0f', ' ms')}"
                            for key, label in (("compute_adam", "Adam"), ("compute_lamb", "LAMB"))
                            if values(key, "step_s"))
        where = f"np={run['np']}" + (", hierarchical" if run["hierarchical"] else "")
        out.append(f"**{run['setting']}** ({where}; compute-only step: {compute})\n")
        out.append("| method | samples/s | step ms | comm ms | MB/rank/step "
                   "| vs baseline: speed | vs baseline: bytes |")
        out.append("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name in MARKDOWN_ORDER:
            if not values(name, "step_s"):
                continue
            label = LABELS[name]
            if name == "adasum":
                label = "Adam (Adasum, delta mode)"
            elif name == "slamb":
                label = f"SLAMB k={first['slamb_ratio']:g} (H={first['slamb_interval']})"
            comm = _spread(values(name, "comm_s", 1e3), ".0f") if values(name, "comm_s") else "-"
            speed = (_spread(values(name, "speedup"), ".2f", "x") if values(name, "speedup")
                     else "baseline")
            fewer = values(name, "volume_reduction")
            fewer = (_spread(fewer, ".1f", "x") if all(fewer) and fewer
                     else ("baseline" if not values(name, "speedup") else "-"))
            out.append(f"| {label} | {_spread(values(name, 'samples_per_s'), '.2f')} "
                       f"| {_spread(values(name, 'step_s', 1e3), '.0f')} | {comm} "
                       f"| {_spread(values(name, 'bytes', 1e-6), '.2f')} | {speed} | {fewer} |")
        out.append("")
    return "\n".join(out)


def plot(report, stem):
    """Three PNGs: throughput vs bandwidth, bytes per step, and the step's compute/comm split."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    runs = report["runs"]
    bandwidth = {"100mbit": 0.1, "1gbit": 1.0, None: None}
    written = []
    layouts = sorted({r["ranks_per_node"] for r in runs})
    fig, axes = plt.subplots(1, len(layouts), figsize=(6 * len(layouts), 4.5), squeeze=False)
    axes = axes[0]
    for ax, per_node in zip(axes, layouts):
        lab_runs = sorted((r for r in runs if r["ranks_per_node"] == per_node and r["rate"]),
                          key=lambda r: bandwidth[r["rate"]])
        loop = [r for r in runs if r["ranks_per_node"] == per_node and not r["rate"]]
        xs = [bandwidth[r["rate"]] for r in lab_runs]
        for name in PLOTTED:
            ys = [r["rows"][name]["samples_per_s"] for r in lab_runs if name in r["rows"]]
            if len(ys) == len(xs) and xs:
                line, = ax.plot(xs, ys, marker="o", label=LABELS[name],
                                linestyle="--" if name.endswith("_run") else "-")
                if loop and name in loop[0]["rows"]:
                    ax.scatter([2.5], [loop[0]["rows"][name]["samples_per_s"]], marker="s",
                               color=line.get_color())
        ax.set_xscale("log")
        ticks = sorted(set(xs)) + ([2.5] if loop else [])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(ticks)
        ax.set_xticklabels([("loopback" if t == 2.5 else f"{t:g} Gbit/s") for t in ticks])
        ax.set_xlabel("link bandwidth per host")
        ax.set_ylabel("training samples / s (all ranks)")
        ax.set_title(f"2 hosts x {per_node} rank{'s' if per_node > 1 else ''}"
                     + (" (hierarchical)" if per_node > 1 else ""))
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    fig.suptitle(f"BERT-like encoder, {report['params'] / 1e6:.1f} M parameters, batch "
                 f"{report['batch']} x 128 tokens per rank")
    fig.tight_layout()
    written.append(f"{stem}_throughput.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4.5))
    ref = next((r for r in runs if r["ranks_per_node"] == 1), runs[0])
    names = [n for n in PLOTTED if n in ref["rows"]]
    vals = [ref["rows"][n]["bytes"] / 1e6 for n in names]
    bars = ax.bar(range(len(names)), vals, color="tab:blue")
    for b, n in zip(bars, names):
        red = ref["rows"][n].get("volume_reduction")
        ax.annotate(f"{b.get_height():.1f} MB" + (f"\n{red:.1f}x less" if red else ""),
                    (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                    fontsize=7)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([LABELS[n] for n in names], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("MB sent per rank per step")
    ax.set_yscale("log")
    ax.set_title(f"Communication volume per step ({ref['setting']})")
    fig.tight_layout()
    written.append(f"{stem}_volume.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(runs), figsize=(3.2 * len(runs), 4.5), sharey=False,
                             squeeze=False)
    for ax, run in zip(axes[0], runs):
        names = [n for n in PLOTTED if n in run["rows"] and "compute_s" in run["rows"][n]]
        comp = [run["rows"][n]["compute_s"] for n in names]
        comm = [run["rows"][n]["comm_s"] for n in names]
        ax.bar(range(len(names)), comp, label="compute")
        ax.bar(range(len(names)), comm, bottom=comp, label="communication")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([LABELS[n].replace(", ", "\n") for n in names], rotation=60,
                           ha="right", fontsize=6)
        ax.set_title(run["setting"], fontsize=9)
        ax.set_ylabel("s per step")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    written.append(f"{stem}_split.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    for path in written:
        print(f"wrote {path}")


def run_setting(name, argv, args):
    env = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"} if SETTINGS[name][2] > 1 else {}
    return _spawn.run_on(name, argv, env, args.timeout)


def main():
    p = _spawn.parser(__doc__, "end_to_end.json")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--settings", default=",".join(_spawn.LAN_SETTINGS),
                   help=f"of {', '.join(SETTINGS)}")
    p.add_argument("--model", default="base", help="_models.bert_like size: tiny, base, large")
    p.add_argument("--batch", type=int, default=4, help="sequences of 128 tokens per rank")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--syncs", type=int, default=2, help="SLAMB model syncs timed")
    p.add_argument("--interval", type=int, default=100, help="SLAMB's H")
    p.add_argument("--ratio", type=float, default=0.1, help="SLAMB's k")
    p.add_argument("--warmup-fraction", type=float, default=0.15,
                   help="1-bit optimizers' warm-up share of a whole run")
    p.add_argument("--timeout", type=float, default=900, help="seconds per setting")
    p.add_argument("--plot", metavar="JSON", help="only draw the plots of an earlier report")
    p.add_argument("--markdown", metavar="JSON", nargs="+",
                   help="only print earlier reports' tables in docs/choosing_an_op.md's format "
                        "(several: repeated runs, each cell the median and range)")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.markdown:
        return print(markdown([_spawn.read_report(path) for path in args.markdown]))
    stem = os.path.splitext(args.plot or args.out)[0]
    if args.plot:
        return plot(_spawn.read_report(args.plot), stem)
    if args.quick:
        args.steps, args.warmup, args.syncs = 2, 1, 1
        if args.settings == ",".join(_spawn.LAN_SETTINGS):
            args.settings = QUICK_SETTINGS
    settings = _spawn.choices(p, args.settings, SETTINGS, "settings")
    methods = _spawn.choices(p, args.methods, METHODS, "methods")
    # Compute-only steps first: every other method's split needs its family's.
    needed = {FAMILY[m] for m in methods if m in FAMILY}
    methods = [m for m in METHODS if m in set(methods) | needed]
    argv = [os.path.abspath(__file__), "--worker", "--methods", ",".join(methods),
            "--model", args.model, "--batch", str(args.batch), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--syncs", str(args.syncs),
            "--interval", str(args.interval), "--ratio", str(args.ratio)]
    report = {"model": f"BERT-like ({args.model}), MLM loss, synthetic tokens",
              "batch": args.batch, "steps": args.steps, "warmup_steps": args.warmup,
              "slamb_interval": args.interval, "slamb_ratio": args.ratio,
              "warmup_fraction": args.warmup_fraction, "runs": []}
    start = time.monotonic()
    print(f"{len(settings)} settings x {len(methods)} methods, {args.steps} timed steps each "
          f"(after {args.warmup}); 1-bit whole run: {args.warmup_fraction:.0%} warm-up",
          flush=True)

    def record(name, res):
        rows = summarise(res, args)
        where, rate, per_node = SETTINGS[name]
        report["params"] = res["params"]
        report["runs"].append({"setting": name, "rate": rate, "ranks_per_node": per_node,
                               "np": res["size"], "hierarchical": res["hierarchical"],
                               "rows": rows, "raw": res["methods"]})
        print_table(f"{name}: np={res['size']}, {res['params'] / 1e6:.1f} M parameters "
                    f"[{time.monotonic() - start:.0f} s elapsed]", rows)
        _spawn.write_report(args.out, report)   # after every setting: an interrupted run keeps it

    for name in _spawn.by_link_rate(settings, lambda name: SETTINGS[name][1]):
        record(name, run_setting(name, argv, args))
    if report["runs"]:
        _spawn.plot_if_possible(plot, report, stem)
    print(f"total {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
