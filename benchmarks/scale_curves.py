"""Predicted step time against node count for two model sizes and three link rates, from the
scale model (horovod_ext.planning), with the papers' clusters computed beside their reports.

    .venv/bin/python benchmarks/scale_curves.py        # writes docs/scale/curves.json and .png

Models: BERT-Large size (340 M parameters) and 1.3 B parameters, float32 gradients, 8 ranks per
node, nodes 8 to 1024, links 1, 10 and 100 Gbit/s (25 us).  Compute per step per rank: the
1-bit Adam paper's BERT-Large profile on V100 (forward 36 ms + backward 61 ms at 16 samples per
GPU, optimizer step 75 ms, Table 1), scaled by parameter count for 1.3 B.  The reductions'
local work (sums, compression, Adasum's combine) is priced at the profile's per-core costs of
this machine, one core per rank.  For every op and node count the better of flat and
hierarchical is plotted.

Paper checks (``checks`` in the JSON): the clusters of the 1-bit Adam paper (4 GPUs per node,
40 Gbit Ethernet with 4.1 Gbit/s measured, BERT-Large fp16 gradients: its allreduce took
1.9-2.3 s at 2-16 nodes, Table 1; the compression stage ran 5.48x the Adam step at 256 GPUs,
Figure 5a) and of SLAMB (8 A100 per node at 100 Gbit/s, BERT-XLarge 2.8 B; LAMB's scaling
efficiency 53% and SLAMB's 90.5% at 1024 GPUs, Table 1) predicted with the same model.  The
papers ran NCCL or MPI on GPUs; the model runs our Gloo schedules with this machine's CPU costs,
so the comparison shows where the schedules alone agree, not a reproduction.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _spawn  # noqa: E402  (benchmarks/ is not a package)

NODES = [8, 16, 32, 64, 128, 256, 512, 1024]
RATES = ["1gbit", "10gbit", "100gbit"]
MODELS = {"BERT-Large (340 M)": 340e6, "1.3 B": 1.3e9}
BERT_COMPUTE_S = 0.036 + 0.061
BERT_OPTIMIZER_S = 0.075
BERT_PARAMS = 340e6
OPS = ["average", "adasum", "onebit", "slamb", "powersgd", "diloco"]


def per_rank_times(params):
    """(forward + backward, optimizer) seconds of a BERT-like model of ``params`` parameters."""
    scale = params / BERT_PARAMS
    return BERT_COMPUTE_S * scale, BERT_OPTIMIZER_S * scale


def curves(profile):
    from horovod_ext.planning import Cluster, parse_rate, training_step
    rows = []
    for model, params in MODELS.items():
        compute, optimizer = per_rank_times(params)
        for rate in RATES:
            for nodes in NODES:
                started = time.perf_counter()
                cluster = Cluster(nodes, 8, parse_rate(rate), 25e-6)
                predictions = training_step(cluster, 4 * params, compute, OPS, profile,
                                            optimizer_s=optimizer)
                for op in OPS:
                    best = min((p for p in predictions if p.op == op), key=lambda p: p.step_s)
                    rows.append({"model": model, "params": params, "rate": rate, "nodes": nodes,
                                 "op": op, "hierarchical": best.hierarchical,
                                 "step_s": best.step_s, "compute_s": compute,
                                 "sent_per_rank": best.sent_per_rank})
                print(f"{model:<20} {rate:>8} {nodes:>5} nodes  "
                      + "  ".join(f"{r['op']} {r['step_s'] * 1e3:.0f} ms" for r in rows[-len(OPS):])
                      + f"  [{time.perf_counter() - started:.1f} s]", flush=True)
    return rows


def checks(profile):
    from horovod_ext.planning import Cluster, parse_rate, reduction_times, training_step
    out = []
    bert_fp16 = 2 * BERT_PARAMS
    for nodes in (2, 4, 8, 16):
        cluster = Cluster(nodes, 4, parse_rate("4.1gbit") / profile.efficiency, 50e-6)
        (flat, hier) = [r for r in reduction_times(cluster, [bert_fp16], ["average"],
                                                  [False, True], profile)]
        out.append({"paper": "1-bit Adam, Table 1", "what": "Adam allreduce of BERT-Large fp16",
                    "cluster": f"{nodes} nodes x 4, 4.1 Gbit/s effective",
                    "reported_s": {2: 1.897, 4: 2.133, 8: 2.173, 16: 2.206}[nodes],
                    "predicted_s": min(flat.seconds, hier.seconds)})
    cluster = Cluster(64, 4, parse_rate("4.1gbit") / profile.efficiency, 50e-6)
    adam, onebit = training_step(cluster, bert_fp16, BERT_COMPUTE_S, ["average", "onebit"],
                                 profile, hierarchical=[True], optimizer_s=BERT_OPTIMIZER_S)
    out.append({"paper": "1-bit Adam, Figure 5a", "what": "compression stage over Adam step",
                "cluster": "64 nodes x 4, 4.1 Gbit/s effective", "reported": 5.48,
                "predicted": adam.step_s / onebit.step_s})
    xl = 2.8e9
    compute, optimizer = per_rank_times(xl)
    one = training_step(Cluster(1, 8, parse_rate("100gbit"), 5e-6), 4 * xl, compute,
                        ["average", "slamb"], profile, hierarchical=[False],
                        optimizer_s=optimizer)
    big = training_step(Cluster(128, 8, parse_rate("100gbit"), 5e-6), 4 * xl, compute,
                        ["average", "slamb"], profile, hierarchical=[True],
                        optimizer_s=optimizer)
    for (op, name, reported), a, b in zip([("average", "LAMB", 0.53), ("slamb", "SLAMB", 0.905)],
                                          one, big):
        out.append({"paper": "SLAMB, Table 1", "what": f"{name} scaling efficiency, 8 -> 1024 GPUs",
                    "cluster": "128 nodes x 8, 100 Gbit/s", "reported": reported,
                    "predicted": a.step_s / b.step_s})
    return out


def plot(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(MODELS), len(RATES), figsize=(13, 7.5), sharex=True)
    for i, model in enumerate(MODELS):
        for j, rate in enumerate(RATES):
            ax = axes[i][j]
            for op in OPS:
                pts = [(r["nodes"], r["step_s"]) for r in report["rows"]
                       if r["model"] == model and r["rate"] == rate and r["op"] == op]
                ax.plot(*zip(*pts), marker="o", ms=3, label=op)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{model}, {rate}", fontsize=9)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("predicted step time (s)")
            if i == len(MODELS) - 1:
                ax.set_xlabel("nodes (8 ranks each)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Scale model (commit {report['commit']}, {report['date']}; profile "
                 f"{report['profile'].get('commit', '?')})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def markdown(report, shown=(8, 64, 1024)):
    """Step times at a few node counts, and the paper checks, as docs/scale.md shows them."""
    lines = []
    for model in report["models"]:
        lines += [f"\n**{model}** (predicted step time, ms; best form; H: hierarchical)\n",
                  "| op | " + " | ".join(f"{rate} {n} nodes" for rate in report["rates"]
                                         for n in shown) + " |",
                  "|---|" + "---|" * (len(report["rates"]) * len(shown))]
        for op in OPS:
            cells = []
            for rate in report["rates"]:
                for n in shown:
                    (r,) = [r for r in report["rows"] if r["model"] == model
                            and r["rate"] == rate and r["nodes"] == n and r["op"] == op]
                    cells.append(f"{r['step_s'] * 1e3:.0f}{' H' if r['hierarchical'] else ''}")
            lines.append(f"| {op} | " + " | ".join(cells) + " |")
    lines += ["", "| paper | what | cluster | reported | predicted |", "|---|---|---|---|---|"]
    for c in report["checks"]:
        reported = c.get("reported_s", c.get("reported"))
        predicted = c.get("predicted_s", c.get("predicted"))
        unit = " s" if "reported_s" in c else ""
        lines.append(f"| {c['paper']} | {c['what']} | {c['cluster']} | {reported:.3g}{unit} | "
                     f"{predicted:.3g}{unit} |")
    return "\n".join(lines)


def main():
    p = _spawn.parser(__doc__, "scale_curves.json")
    p.set_defaults(out=os.path.join(_spawn.REPO, "docs", "scale", "curves.json"))
    p.add_argument("--profile", help="calibrated profile (default: the package's)")
    p.add_argument("--plot", metavar="JSON", help="only redraw the plot of an earlier report")
    p.add_argument("--markdown", metavar="JSON", help="only print an earlier report's tables")
    args = p.parse_args()
    if args.markdown:
        return print(markdown(_spawn.read_report(args.markdown)))
    if args.plot:
        with open(args.plot) as f:
            report = json.load(f)
        return _spawn.plot_if_possible(plot, report, args.plot[:-5] + ".png")
    from horovod_ext.planning import load_profile
    profile = load_profile(args.profile)
    report = {"profile": profile.meta, "nodes": NODES, "rates": RATES, "models": MODELS,
              "rows": curves(profile), "checks": checks(profile)}
    for c in report["checks"]:
        print(c)
    _spawn.write_report(args.out, report)
    with open(args.out) as f:
        report = json.load(f)
    _spawn.plot_if_possible(plot, report, args.out[:-5] + ".png")


if __name__ == "__main__":
    main()
