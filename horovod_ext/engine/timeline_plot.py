"""Draw a timeline file as a PNG, for a machine without a trace viewer (needs matplotlib).

    .venv/bin/python -m horovod_ext.engine.timeline_plot trace.json trace.png [--zoom ADASUM]

One row per tensor track, activities as bars (nested ones drawn thinner inside their parent),
each rank's submission during negotiation as a tick.  ``--zoom NAME`` adds a second panel
around the last activity of that name (e.g. one ADASUM or ONEBIT step).  Reads files cut short
by a crash as well.
"""
import argparse
from typing import Dict, List, Optional, Tuple

from .timeline import load


def _rows(events) -> Tuple[List[str], Dict[int, List[dict]]]:
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    by_pid: Dict[int, List[dict]] = {pid: [] for pid in names}
    for e in events:
        if e.get("ph") in ("X", "i") and e.get("pid") in by_pid:
            by_pid[e["pid"]].append(e)
    order = sorted(by_pid, key=lambda pid: min((e["ts"] for e in by_pid[pid]), default=0))
    return [names[p] for p in order], {i: by_pid[p] for i, p in enumerate(order)}


def _depths(spans: List[dict]) -> List[int]:
    """Nesting depth of each complete event among those of its track."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i]["ts"], -spans[i]["dur"]))
    open_ends: List[float] = []
    depth = [0] * len(spans)
    for i in order:
        start, end = spans[i]["ts"], spans[i]["ts"] + spans[i]["dur"]
        while open_ends and open_ends[-1] <= start:
            open_ends.pop()
        depth[i] = len(open_ends)
        open_ends.append(end)
    return depth


def _draw(ax, labels, rows, colours, window: Optional[Tuple[float, float]], origin: float):
    for y, events in rows.items():
        spans = [e for e in events if e["ph"] == "X"]
        # parents first: a nested activity is drawn over its parent
        for d, e in sorted(zip(_depths(spans), spans), key=lambda de: de[0]):
            if window and (e["ts"] + e["dur"] < window[0] or e["ts"] > window[1]):
                continue
            height = 0.8 * (0.7 ** d)
            ax.broken_barh([((e["ts"] - origin) / 1e3, max(e["dur"], 0.5) / 1e3)],
                           (y - height / 2, height), facecolors=colours[e["name"]],
                           edgecolors="none")
        ticks = [(e["ts"] - origin) / 1e3 for e in events if e["ph"] == "i"
                 and (not window or window[0] <= e["ts"] <= window[1])]
        ax.plot(ticks, [y + 0.45] * len(ticks), "|", color="black", markersize=4)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    if window:
        ax.set_xlim((window[0] - origin) / 1e3, (window[1] - origin) / 1e3)


def plot(path: str, out: str, zoom: Optional[str] = None, title: Optional[str] = None,
         start: Optional[str] = None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = load(path)
    labels, rows = _rows(events)
    spans = [e for es in rows.values() for e in es if e["ph"] == "X"]
    if not spans:
        raise SystemExit(f"{path} holds no activities")
    origin = min(e["ts"] for e in spans)
    if start:
        origin = min((e["ts"] for e in spans if e["name"] == start), default=origin)
    end = max(e["ts"] + e["dur"] for e in spans)
    kinds = sorted({e["name"] for e in spans})
    palette = [plt.get_cmap(m)(i) for m in ("tab20", "tab20b", "tab20c") for i in range(20)]
    colours = {k: palette[i % len(palette)] for i, k in enumerate(kinds)}
    window = None
    if zoom:
        marked = [e for e in spans if e["name"] == zoom]
        if not marked:
            raise SystemExit(f"no activity named {zoom} in {path}")
        last = max(marked, key=lambda e: e["ts"])
        pad = 0.1 * last["dur"] + 50
        window = (last["ts"] - pad, last["ts"] + last["dur"] + pad)
    panels = 2 if window else 1
    height = 0.3 * len(labels) + 1.5
    fig, axes = plt.subplots(panels, 1, figsize=(13, height * panels + 1), squeeze=False)
    _draw(axes[0][0], labels, rows, colours, (origin, end), origin)
    axes[0][0].set_title(title or path, fontsize=9)
    if window:
        _draw(axes[1][0], labels, rows, colours, window, origin)
        axes[1][0].set_title(f"zoom: the last {zoom}", fontsize=9)
    fig.legend(handles=[Patch(color=colours[k], label=k) for k in kinds], loc="lower center",
               ncol=4, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.04 + 0.012 * (len(kinds) // 4), 1, 1))
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace")
    p.add_argument("out")
    p.add_argument("--zoom", help="also show the last activity of this name up close")
    p.add_argument("--start", help="begin the first panel at the first activity of this name")
    p.add_argument("--title")
    args = p.parse_args(argv)
    plot(args.trace, args.out, args.zoom, args.title, args.start)


if __name__ == "__main__":
    main()
