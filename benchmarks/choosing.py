"""The numbers behind docs/choosing_an_op.md and README's plot, from the head-to-head data.

    .venv/bin/python benchmarks/choosing.py            # print the page's tables
    .venv/bin/python benchmarks/choosing.py --plot     # also redraw docs/link_speedup.png

Nothing is measured here: every figure is derived from the head-to-head reports in docs/
(``benchmarks/head_to_head.py`` made them, each with its commit, date and repetitions).  Time to
target counts training time only; a method that reached the target in fewer than all of its
repetitions says so ("1/3"), and its time is the median of those that did.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from head_to_head import METHODS, summary  # noqa: E402

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
REPORTS = {"cnn 2x1": "head_to_head_cnn.json", "lm 2x1": "head_to_head_lm.json",
           "lm 2x2": "head_to_head_lm_2x2.json"}
# settings from the fastest link to the slowest, as the plot's x axis
LINKS = [("loopback", "loopback"), ("lab-1gbit", "1 Gbit/s"), ("lab-100mbit", "100 Mbit/s")]
PLOTTED = ["ddp", "ddp_fp16", "adasum", "onebit_adam", "slamb", "powersgd_r4", "diloco_h50"]


def load(name):
    with open(os.path.join(DOCS, REPORTS[name])) as f:
        return json.load(f)


def _setting(report, link):
    per_node = report["settings"][0]["ranks_per_node"]
    return f"{link}-2x{per_node}"


def to_target(report):
    """{setting: {method: (median time to target of the runs that reached it or None,
    runs that reached it, runs)}}."""
    out = {}
    for setting, rows in summary(report).items():
        out[setting] = {}
        for method, figures in rows.items():
            reached = [t for t in figures["to_target_s"] if t is not None]
            out[setting][method] = (statistics.median(reached) if reached else None,
                                    len(reached), len(figures["to_target_s"]))
    return out


def penalty_rows(report):
    """Time to target over Average's on loopback, per lab setting (the datacenter yardstick)."""
    times = to_target(report)
    base = times[_setting(report, "loopback")]["average"][0]
    rows = []
    for method in [m for m in METHODS if m in times[_setting(report, "loopback")]]:
        cells = []
        for link, _ in LINKS[1:]:
            t, hit, reps = times[_setting(report, link)][method]
            if not hit:
                cells.append(f"not reached (0/{reps})")
            else:
                cells.append(f"{t / base:.2f}x" + ("" if hit == reps else f" ({hit}/{reps})"))
        rows.append((method, cells))
    return rows


def markdown(name):
    report = load(name)
    head = [label for _, label in LINKS[1:]]
    lines = [f"**{name}** ({REPORTS[name]}: commit {report['commit']}, {report['date']}, "
             f"{report['reps']} repetitions of {report['steps']} steps; target "
             f"{report['target']:g} {report['quality']})", "",
             "| method | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    lines += [f"| {method} | " + " | ".join(cells) + " |" for method, cells in penalty_rows(report)]
    return "\n".join(lines)


def speedups(report):
    """{method: [(median, low, high) or None per link]}: Average's median time to target on
    the same link over the method's, with the range over the method's repetitions."""
    rows = summary(report)
    out = {}
    for method in PLOTTED:
        points = []
        for link, _ in LINKS:
            setting = rows.get(_setting(report, link), {})
            if method not in setting:
                points.append(None)
                continue
            avg = [t for t in setting["average"]["to_target_s"] if t is not None]
            mine = [t for t in setting[method]["to_target_s"] if t is not None]
            if not avg or len(mine) < len(setting[method]["to_target_s"]):
                points.append(None)
                continue
            base = statistics.median(avg)
            points.append((base / statistics.median(mine), base / max(mine), base / min(mine)))
        out[method] = points
    return out


def plot(path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    names = list(REPORTS)
    fig, axes = plt.subplots(1, len(names), figsize=(4.6 * len(names), 3.9), sharey=True)
    for ax, name in zip(axes, names):
        report = load(name)
        for method, points in speedups(report).items():
            xs = [i for i, p in enumerate(points) if p]
            ys = [points[i][0] for i in xs]
            err = [[points[i][0] - points[i][1] for i in xs], [points[i][2] - points[i][0]
                                                               for i in xs]]
            ax.errorbar(xs, ys, yerr=err, marker="o", markersize=3.5, capsize=2.5,
                        linestyle="--" if method.startswith("ddp") else "-", label=method)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xticks(range(len(LINKS)), [label for _, label in LINKS])
        ax.set_yscale("log")
        ax.set_yticks([0.5, 1, 2, 4, 8])
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%gx"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_title(f"{name}: commit {report['commit']}, {report['date']}", fontsize=8.5)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speedup over Average on the same link\n(time to target, log)")
    axes[0].legend(fontsize=7)
    fig.suptitle("Speedup over the exact average, by link (median and range of 3 repetitions; "
                 "a missing point did not reach the target in every repetition)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plot", action="store_true", help="redraw docs/link_speedup.png")
    args = p.parse_args(argv)
    print("\n\n".join(markdown(name) for name in REPORTS))
    if args.plot:
        plot(os.path.join(DOCS, "link_speedup.png"))


if __name__ == "__main__":
    main()
