"""A benchmark on this checkout and on another commit, taking turns, so both meet the same machine.

    python benchmarks/against_commit.py --commit e798c81 --bench synthetic --runs 3 -- --np 2 --quick
    python benchmarks/against_commit.py --commit e798c81 --bench allreduce --runs 3 -- --quick
    python benchmarks/against_commit.py --commit e798c81 --bench onebit --runs 3 -- --quick \
        --nps 2

The other commit is checked out into a temporary git worktree (its optional C kernels built in
place when a compiler is present) and its own copy of the benchmark runs there, with that tree
first on the path of every rank.  Runs alternate, other commit first, ``--runs`` times each.
Prints, for every measured figure, the median of each side, the new/old ratio, and the spread
(min-max over runs) of each side, then writes JSON with every run's figures.
Figures: ``synthetic``: samples/s of hvd.DistributedOptimizer and of DDP per model and process
count, and their ratio in each run (DDP runs in the same ranks, turn about, so the ratio cancels
the machine's drift); ``onebit``: the 1-bit compressed allreduce's and the float32 Sum's
time per call (ms) per transport, process count and size, and their ratio; ``allreduce``:
horovod_ext's time per call (us) per transport and size, back to back and after the gap, the
raw transport's, and horovod_ext's against the raw block next to it (the median over block
pairs, which cancels the transport's own drift).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _spawn  # noqa: E402  (benchmarks/ is not a package)


def figures(bench: str, report: dict) -> dict:
    """name -> value of the figures compared, from one run's JSON report."""
    out = {}
    if bench == "synthetic":
        for np_, models in report["runs"].items():
            for model, row in models.items():
                for method in ("hvd", "ddp"):
                    key = f"{method}_samples_per_s"
                    if key in row:
                        out[f"{model} np={np_} {method} samples/s"] = row[key]
                if "hvd_samples_per_s" in row and "ddp_samples_per_s" in row:
                    # DDP ran in the same ranks, turn about: the ratio cancels the machine's drift
                    out[f"{model} np={np_} hvd/ddp"] = (row["hvd_samples_per_s"]
                                                        / row["ddp_samples_per_s"])
    elif bench == "onebit":
        for kind, rows in report["local"].items():
            for r in rows:
                size = _spawn.human(r["size"])
                for col in ("onebit_ms", "sum_ms"):
                    out[f"{kind} {size} {col}"] = r[col]
                # the two ops took turns block by block: their ratio cancels the machine's drift
                out[f"{kind} {size} onebit/sum"] = r["onebit_ms"] / r["sum_ms"]
    else:
        for kind, rows in report["local"].items():
            for r in rows:
                size = _spawn.human(r["size"])
                for col in ("hvd_us", "hvd_gap_us", "raw_us"):
                    out[f"{kind} {size} {col}"] = r[col]
                # each hvd block against the raw block next to it: the transport's drift cancels
                out[f"{kind} {size} hvd/raw"] = 1.0 + r["paired_overhead_pct"] / 100.0
    return out


def prepare(commit: str) -> str:
    tree = tempfile.mkdtemp(prefix="hvd-against-")
    os.rmdir(tree)
    subprocess.run(["git", "worktree", "add", "--detach", tree, commit], cwd=_spawn.REPO,
                   check=True, capture_output=True)
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                           cwd=tree, capture_output=True, text=True)
    if build.returncode != 0:
        print(f"note: {commit}'s C kernels did not build; it runs its torch code", flush=True)
    return tree


def run_once(tree: str, bench: str, extra: list) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, os.path.join(tree, "benchmarks", f"{bench}.py"), *extra, "--out", out]
    env = dict(os.environ, PYTHONPATH=tree)
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        report = json.load(f)
    os.unlink(out)
    return figures(bench, report)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--commit", required=True, help="the commit to compare with")
    p.add_argument("--bench", choices=("synthetic", "allreduce", "onebit"), required=True)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=os.path.join(_spawn.HERE, "results", "against_commit.json"))
    p.add_argument("extra", nargs=argparse.REMAINDER,
                   help="after --: the benchmark's own flags, for both sides")
    args = p.parse_args()
    extra = [a for a in args.extra if a != "--"]
    old_tree = prepare(args.commit)
    runs = {"old": [], "new": []}
    try:
        for i in range(args.runs):
            for side, tree in (("old", old_tree), ("new", _spawn.REPO)):
                runs[side].append(run_once(tree, args.bench, extra))
                print(f"run {i + 1}/{args.runs} {side} done", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", old_tree], cwd=_spawn.REPO,
                       capture_output=True)
        shutil.rmtree(old_tree, ignore_errors=True)
    names = [n for n in runs["new"][0] if all(n in r for r in runs["old"] + runs["new"])]
    print(f"\n{'figure':<36} {'old':>10} {'new':>10} {'new/old':>8} "
          f"{'old spread':>19} {'new spread':>19}")
    rows = []
    for n in names:
        old = [r[n] for r in runs["old"]]
        new = [r[n] for r in runs["new"]]
        row = {"figure": n, "old_median": statistics.median(old),
               "new_median": statistics.median(new), "old": old, "new": new}
        row["ratio"] = row["new_median"] / row["old_median"]
        rows.append(row)
        print(f"{n:<36} {row['old_median']:>10.4g} {row['new_median']:>10.4g} "
              f"{row['ratio']:>8.3f} {min(old):>9.4g}-{max(old):<9.4g} "
              f"{min(new):>9.4g}-{max(new):<9.4g}")
    # "against": the other commit; write_report adds this checkout's commit and the date
    _spawn.write_report(args.out, {"bench": args.bench, "against": args.commit,
                                   "flags": extra, "runs": args.runs, "rows": rows})


if __name__ == "__main__":
    main()
