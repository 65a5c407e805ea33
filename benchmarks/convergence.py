"""Sample-wise convergence on Fashion-MNIST, np = 4: do compressed optimizers match their baselines?

    python benchmarks/convergence.py                 # all 8 methods, 3 epochs: about 13 min here
    python benchmarks/convergence.py --quick         # 20 k samples, 1 epoch: about 2 min
    python benchmarks/convergence.py --methods adam,onebit_adam --epochs 1
    python benchmarks/convergence.py --plot benchmarks/results/convergence.json  # redraw plots

Data: Fashion-MNIST from Debian's ``dataset-fashion-mnist`` package (/usr/share/datasets/
fashion-mnist, or ``--data-dir``), through ``examples/fashion_mnist.py``'s loader: without it,
scikit-learn's digits, and the output says so (``--max-train``: a fixed random subset).  Model:
that example's CNN (``--model net``, 215 k parameters, ReLU) or LeNet-5 (``--model lenet5``),
one thread per rank, Gloo on localhost, ``--np`` ranks (4).

Every method is a separate training run, in the same processes one after the other, from the
same initial weights (``--seed``) over the same data order (one permutation per epoch; rank r
takes the r-th slice of each global batch); a comparison shares every hyper-parameter its
methods have in common:
  Adam vs 1-bit Adam        adam: DistributedOptimizer(torch Adam, op=Average); onebit_adam:
                            hvd.OnebitAdam, warm-up (full-precision gradients) for
                            ``--warmup-fraction`` (15%) of the steps, then 1-bit momentum; no
                            bias correction, as the paper (``--onebit-bias-correction`` adds
                            it): its early steps are up to ~6x larger than Adam's
  LAMB vs 1-bit LAMB vs SLAMB   lamb: DistributedOptimizer(hvd.Lamb, op=Average); onebit_lamb:
                            hvd.OnebitLamb (the same warm-up); slamb: hvd.SLAMB(ratio=k,
                            sync_interval=H), its models averaged at the end; all with LAMB's
                            trust-ratio bounds (SLAMB's "simplified" scaling clips the same
                            ratio as LAMB; ``--slamb-scaling algorithm`` for Algorithm 1's)
  Average vs Sum vs Adasum  DistributedOptimizer(momentum SGD, op=Average / Sum / Adasum) at a
                            large batch per rank (``--large-batch`` 128) with a warm-up +
                            linear-decay schedule whose peak is tuned for ONE process (the
                            Adasum paper's LeNet-5 case study; one process, 20 k samples: 0.05,
                            0.1, 0.2 all reach 81-82%, 0.4 diverges).  Average keeps that rate
                            (np times fewer steps of the same size); Sum is Average with the
                            rate scaled by ``np`` (the linear scaling rule), so it steps ``np``
                            times farther; Adasum adapts the step
Adam and LAMB runs decay their learning rate linearly to 0.  eps is 1e-4 for both Adams and 1e-3
for every LAMB: at torch's 1e-8 (hvd.Lamb's 1e-6) 1-bit Adam (1-bit LAMB) diverges a few steps
after the warm-up on this ReLU network, while the uncompressed runs train; ``--adam-eps 1e-8
--lamb-eps 1e-6`` shows it.  (Elements whose gradients are tiny or zero, e.g. of dead ReLU units,
have a tiny frozen variance; the 1-bit momentum gives every element of a tensor the same
magnitude, so their update m / (sqrt(v) + eps) explodes.)

Recorded per method: training loss every few steps (averaged over ranks), test accuracy and
loss at ``--evals`` points (of the average of the ranks' models, which only SLAMB lets differ
between its model syncs; the largest relative distance of a rank's model to that average is
kept as ``max_spread``: 0 for every other method), training time (without the evaluations),
the samples after which the loss was first not finite.  Progress goes to stdout; a table per
comparison; JSON to ``--out``; ``_loss.png`` and ``_accuracy.png`` next to it.
"""
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _spawn  # noqa: E402  (benchmarks/ is not a package; also fixes sys.path for the packages)

GROUPS = [("Adam vs 1-bit Adam", ["adam", "onebit_adam"]),
          ("LAMB vs 1-bit LAMB vs SLAMB", ["lamb", "onebit_lamb", "slamb"]),
          ("Average vs Sum vs Adasum, large batch, LR tuned for 1 process",
           ["average", "sum", "adasum"])]
SGD_METHODS = ("average", "sum", "adasum")
METHODS = [m for _, members in GROUPS for m in members]
BASELINE = {m: members[0] for _, members in GROUPS for m in members}
LABELS = {"adam": "Adam", "onebit_adam": "1-bit Adam", "lamb": "LAMB",
          "onebit_lamb": "1-bit LAMB", "slamb": "SLAMB", "average": "SGD, Average",
          "sum": "SGD, Sum", "adasum": "SGD, Adasum"}
LAMB_MIN_COEFF, LAMB_MAX_COEFF = 0.01, 10.0     # hvd.Lamb's trust-ratio bounds


def examples():
    """examples/fashion_mnist.py and examples/adasum_scaling.py as modules (not a package)."""
    folder = os.path.join(_spawn.REPO, "examples")
    sys.path.insert(0, folder)
    try:
        import adasum_scaling
        import fashion_mnist
    finally:
        sys.path.remove(folder)
    return fashion_mnist, adasum_scaling


def hyper_parameters(method, args, total):
    """What a method runs with, as recorded in the report."""
    if method in SGD_METHODS:
        return {"optimizer": "SGD", "lr": args.sgd_lr, "momentum": 0.9,
                "schedule": f"linear warm-up {args.sgd_warmup:.0%}, then linear decay to 0",
                "batch_per_rank": args.large_batch}
    adam = "adam" in method
    hp = {"lr": args.adam_lr if adam else args.lamb_lr,
          "eps": args.adam_eps if adam else args.lamb_eps,
          "schedule": "linear decay to 0", "batch_per_rank": args.batch}
    if method.startswith("onebit"):
        hp["freeze_step"] = max(1, round(args.warmup_fraction * total))
        hp["bias_correction"] = args.onebit_bias_correction
    if "lamb" in method:
        hp.update(min_coeff=LAMB_MIN_COEFF, max_coeff=LAMB_MAX_COEFF)
    if method == "slamb":
        hp.update(ratio=args.ratio, sync_interval=args.interval, scaling=args.slamb_scaling)
    return hp


def make_optimizer(method, model, hp):
    import torch
    import horovod_ext.torch as hvd

    params, named = model.parameters(), model.named_parameters()
    if method == "adam":
        return hvd.DistributedOptimizer(torch.optim.Adam(params, lr=hp["lr"], eps=hp["eps"]),
                                        named_parameters=named, op=hvd.Average)
    if method == "onebit_adam":
        return hvd.OnebitAdam(params, lr=hp["lr"], eps=hp["eps"], freeze_step=hp["freeze_step"],
                              bias_correction=hp["bias_correction"])
    lamb = dict(lr=hp["lr"], eps=hp.get("eps"), min_coeff=LAMB_MIN_COEFF,
                max_coeff=LAMB_MAX_COEFF)
    if method == "lamb":
        return hvd.DistributedOptimizer(hvd.Lamb(params, **lamb), named_parameters=named,
                                        op=hvd.Average)
    if method == "onebit_lamb":
        return hvd.OnebitLamb(params, freeze_step=hp["freeze_step"],
                              bias_correction=hp["bias_correction"], **lamb)
    if method == "slamb":
        return hvd.SLAMB(params, ratio=hp["ratio"], sync_interval=hp["sync_interval"],
                         scaling=hp["scaling"], **lamb)
    if method in SGD_METHODS:
        op = {"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum}[method]
        return hvd.DistributedOptimizer(
            torch.optim.SGD(params, lr=hp["lr"], momentum=hp["momentum"]),
            named_parameters=named, op=op)
    raise ValueError(f"unknown method {method!r}: one of {METHODS}")


def evaluate(model, x, y):
    """(accuracy, loss) on the test set of the ranks' average model, and the largest relative
    distance of a rank's model to that average.  The training parameters are put back."""
    import torch
    import horovod_ext.torch as hvd

    mine = torch.arange(hvd.rank(), len(y), hvd.size())
    totals, spread = evaluate_averaged(model, lambda net: classification_totals(net, x, y, mine))
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item(), spread


def classification_totals(model, x, y, indices):
    """float64 sums (correct answers, cross-entropy, count) of ``model`` on the samples
    ``indices`` of (x, y), 500 at a time."""
    import torch
    import torch.nn.functional as F

    totals = torch.zeros(3, dtype=torch.float64)
    for i in range(0, len(indices), 500):
        idx = indices[i:i + 500]
        logits = model(x[idx])
        totals += torch.tensor([float((logits.argmax(1) == y[idx]).sum()),
                                float(F.cross_entropy(logits, y[idx], reduction="sum")),
                                float(len(idx))], dtype=torch.float64)
    return totals


def evaluate_averaged(model, score):
    """``score(model)`` (a float64 tensor of sums over this rank's share of the test data) of
    the ranks' average model, summed over the ranks, and the largest relative distance of a
    rank's model to that average.  The training parameters are put back."""
    import torch
    import horovod_ext.torch as hvd

    params = list(model.parameters())
    with torch.no_grad():
        own = torch.cat([p.detach().reshape(-1) for p in params])
        avg = hvd.allreduce(own, op=hvd.Average, name="convergence.params")
        spread = hvd.allreduce(((own - avg).norm() / avg.norm().clamp(min=1e-30)).reshape(1),
                               op=hvd.Max, name="convergence.spread")
        _copy_into(params, avg)
        model.eval()
        totals = score(model)
        model.train()
        _copy_into(params, own)
    return hvd.allreduce(totals, op=hvd.Sum, name="convergence.eval"), spread.item()


def _copy_into(params, flat):
    """In place (the optimizers hold these tensors): params = flat, split by their sizes."""
    offset = 0
    for p in params:
        p.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def train(method, data, args, log):
    """One training run of ``method``: its loss curve, evaluations and times."""
    import torch
    import torch.nn.functional as F
    import horovod_ext.torch as hvd

    fashion_mnist, adasum_scaling = examples()
    tx, ty, vx, vy = data
    rank, size = hvd.rank(), hvd.size()
    large = method in SGD_METHODS
    batch = args.large_batch if large else args.batch
    per_epoch = len(ty) // (batch * size)
    total = per_epoch * args.epochs
    hp = hyper_parameters(method, args, total)
    torch.manual_seed(args.seed)
    model = adasum_scaling.LeNet5() if args.model == "lenet5" else fashion_mnist.Net()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = make_optimizer(method, model, hp)
    warmup = args.sgd_warmup if large else 0.0
    log_every = max(1, total // args.points)
    evals = {max(1, round(total * (i + 1) / args.evals)) for i in range(args.evals)}
    progress = {max(1, round(total * i / 10)) for i in range(1, 10)}
    row = {"hyper_parameters": hp, "steps": total, "global_batch": batch * size,
           "samples": [], "loss": [], "eval_samples": [], "accuracy": [], "test_loss": [],
           "max_spread": 0.0, "params": sum(p.numel() for p in model.parameters())}
    running, count, evaluating = 0.0, 0, 0.0
    start = time.perf_counter()
    for step in range(total):
        epoch, i = divmod(step, per_epoch)
        if i == 0:
            order = torch.randperm(len(ty), generator=torch.Generator().manual_seed(
                args.seed + epoch))
        idx = order[(i * size + rank) * batch:(i * size + rank + 1) * batch]
        for group in opt.param_groups:
            group["lr"] = adasum_scaling.schedule(step, total, hp["lr"], warmup)
        opt.zero_grad()
        loss = F.cross_entropy(model(tx[idx]), ty[idx])
        loss.backward()
        opt.step()
        running, count = running + loss.item(), count + 1
        done = step + 1
        if done % log_every == 0 or done == total:
            mean = hvd.allreduce(torch.tensor([running / count]), name="convergence.loss")
            row["samples"].append(done * batch * size)
            row["loss"].append(mean.item())
            running, count = 0.0, 0
        if done == total and method == "slamb":
            opt.average_parameters()            # SLAMB's own final model sync: one model
        if done in evals:
            t0 = time.perf_counter()
            accuracy, test_loss, spread = evaluate(model, vx, vy)
            row["eval_samples"].append(done * batch * size)
            row["accuracy"].append(accuracy)
            row["test_loss"].append(test_loss)
            row["max_spread"] = max(row["max_spread"], spread)
            evaluating += time.perf_counter() - t0
        if done in progress:
            log(f"      {method:<12} {100 * done // total:3d}%  step {done}/{total}  "
                f"loss {row['loss'][-1]:.4f}  [{time.perf_counter() - start:.0f} s]")
    row["train_s"] = time.perf_counter() - start - evaluating
    row["eval_s"] = evaluating
    blown = [n for n, value in zip(row["samples"], row["loss"]) if not math.isfinite(value)]
    row["diverged_at_samples"] = blown[0] if blown else None
    row["final_accuracy"], row["final_test_loss"] = row["accuracy"][-1], row["test_loss"][-1]
    row["final_train_loss"] = row["loss"][-1]
    if hasattr(opt, "bytes_sent"):
        row["bytes_sent"] = opt.bytes_sent
    return row


def worker(args):
    import torch
    import horovod_ext.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    fashion_mnist, _ = examples()
    tx, ty, vx, vy, source = fashion_mnist.load_data(args.data_dir)
    order = torch.randperm(len(ty), generator=torch.Generator().manual_seed(args.seed))
    if args.max_train:      # a fixed random subset, the same for every method
        order = order[:args.max_train]
    tx, ty = tx[order], ty[order]
    if args.max_test:
        vx, vy = vx[:args.max_test], vy[:args.max_test]
    rank = hvd.rank()

    def log(line):
        if rank == 0:
            print(line, flush=True)

    results = {"data": source, "np": hvd.size(), "train_samples": len(ty),
               "test_samples": len(vy), "methods": {}}
    log(f"    data: {source}; {len(ty)} training, {len(vy)} test samples; np={hvd.size()}")
    for method in args.methods.split(","):
        row = train(method, (tx, ty, vx, vy), args, log)
        results["methods"][method] = row
        results["params"] = row.pop("params")
        log(f"    {method:<12} test accuracy {100 * row['final_accuracy']:6.2f} %  "
            f"test loss {row['final_test_loss']:.4f}  train loss {row['final_train_loss']:.4f}  "
            f"{row['steps']} steps in {row['train_s']:.0f} s (+{row['eval_s']:.0f} s eval)")
    if rank == 0:
        import json
        with open(args.result, "w") as f:
            json.dump(results, f)
    hvd.shutdown()


def print_tables(report):
    runs = report["methods"]
    for title, members in GROUPS:
        present = [m for m in members if m in runs]
        if not present:
            continue
        print(f"\n{title}")
        print(f"{'method':<12} {'test acc %':>10} {'vs base':>8} {'test loss':>9} "
              f"{'vs base':>8} {'train loss':>10} {'steps':>6} {'train s':>8}  settings")
        for m in present:
            r, base = runs[m], runs.get(BASELINE[m])
            diff = (f"{100 * (r['final_accuracy'] - base['final_accuracy']):+8.2f}"
                    f" {r['final_test_loss'] - base['final_test_loss']:+8.4f}"
                    if base and m != BASELINE[m] else f"{'-':>8} {'-':>8}")
            acc, tl = diff.split()
            hp = r["hyper_parameters"]
            extra = ", ".join(f"{k}={v}" for k, v in hp.items()
                              if k in ("lr", "eps", "freeze_step", "sync_interval", "ratio",
                                       "bias_correction", "scaling", "batch_per_rank"))
            print(f"{m:<12} {100 * r['final_accuracy']:10.2f} {acc:>8} "
                  f"{r['final_test_loss']:9.4f} {tl:>8} {r['final_train_loss']:10.4f} "
                  f"{r['steps']:6d} {r['train_s']:8.0f}  {extra}")
            if r.get("diverged_at_samples") is not None:
                print(f"{'':<12} diverged: loss not finite after {r['diverged_at_samples']} "
                      f"samples")
    spread = {m: r["max_spread"] for m, r in runs.items() if r["max_spread"] > 0}
    if spread:
        print("\nranks' models differed at an evaluation (largest ||x_r - mean|| / ||mean||; "
              "expected for SLAMB between model syncs, a bug for any other method): "
              + ", ".join(f"{m} {s:.2e}" for m, s in spread.items()))


def plot(report, stem):
    """Two PNGs, a panel per comparison: training loss and test accuracy vs samples seen."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    runs = report["methods"]
    thousands = lambda x, _: f"{x / 1000:g}k" if x else "0"  # noqa: E731
    groups = [(t, [m for m in ms if m in runs]) for t, ms in GROUPS]
    groups = [(t, ms) for t, ms in groups if ms]
    title = (f"{report['model']} on {report['data'].split(' from ')[0].split(' (')[0]}, "
             f"np={report['np']}, {report['train_samples']} training samples")
    written = []
    for kind, key, xkey, ylabel in (("loss", "loss", "samples", "training loss (mean over ranks)"),
                                    ("accuracy", "accuracy", "eval_samples", "test accuracy (%)")):
        fig, axes = plt.subplots(1, len(groups), figsize=(max(5 * len(groups), 7), 4.3),
                                 squeeze=False)
        for ax, (group, members) in zip(axes[0], groups):
            for m in members:
                ys = runs[m][key]
                ys = [100 * y for y in ys] if kind == "accuracy" else ys
                final = (f"{ys[-1]:.2f}{' %' if kind == 'accuracy' else ''}"
                         if runs[m].get("diverged_at_samples") is None else "diverged")
                ax.plot(runs[m][xkey], ys, marker="o" if kind == "accuracy" else None,
                        markersize=3, label=f"{LABELS[m]} ({final})")
                freeze = runs[m]["hyper_parameters"].get("freeze_step")
                if freeze:
                    ax.axvline(freeze * runs[m]["global_batch"], color=ax.lines[-1].get_color(),
                               linestyle=":", linewidth=1)
            if kind == "loss":
                ax.set_yscale("log")
                # a diverging run would stretch the axis over dozens of decades
                finite = [v for m in members for v in runs[m]["loss"] if math.isfinite(v)]
                start = max(runs[m]["loss"][0] for m in members)
                if finite and math.isfinite(start):
                    ax.set_ylim(0.8 * min(finite), min(max(finite), 3 * start) * 1.2)
            else:
                low = min(min(runs[m][key]) for m in members)
                ax.set_ylim(max(0, 100 * low - 2), None)
            ax.xaxis.set_major_formatter(ticker.FuncFormatter(thousands))
            ax.set_title(group, fontsize=9)
            ax.set_xlabel("training samples seen (all ranks)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(title + ("\ndotted: end of the 1-bit optimizers' warm-up" if any(
            runs[m]["hyper_parameters"].get("freeze_step") for m in runs) else ""), fontsize=9)
        fig.tight_layout()
        written.append(f"{stem}_{kind}.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    for path in written:
        print(f"wrote {path}")


def main():
    p = _spawn.parser(__doc__, "convergence.json")
    p.add_argument("--methods", default=",".join(METHODS), help=f"of {', '.join(METHODS)}")
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--model", default="net", choices=("net", "lenet5"))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-train", type=int, default=0, help="training samples (0: all 60 k)")
    p.add_argument("--max-test", type=int, default=0, help="test samples (0: all 10 k)")
    p.add_argument("--batch", type=int, default=32, help="per rank (Adam and LAMB families)")
    p.add_argument("--large-batch", type=int, default=128, help="per rank (Sum vs Adasum)")
    p.add_argument("--adam-lr", type=float, default=1e-3)
    p.add_argument("--adam-eps", type=float, default=1e-4,
                   help="Adam and 1-bit Adam (torch's 1e-8 makes 1-bit Adam diverge here)")
    p.add_argument("--lamb-lr", type=float, default=1e-2)
    p.add_argument("--lamb-eps", type=float, default=1e-3,
                   help="all LAMBs (hvd.Lamb's 1e-6 makes 1-bit LAMB diverge here)")
    p.add_argument("--sgd-lr", type=float, default=0.1,
                   help="peak learning rate of Sum/Adasum, tuned for one process")
    p.add_argument("--sgd-warmup", type=float, default=0.17, help="fraction of the steps")
    p.add_argument("--warmup-fraction", type=float, default=0.15,
                   help="1-bit optimizers' full-precision warm-up (freeze_step) share of steps")
    p.add_argument("--onebit-bias-correction", action="store_true",
                   help="bias_correction=True for the 1-bit optimizers (the papers have none)")
    p.add_argument("--interval", type=int, default=50, help="SLAMB's H (model sync interval)")
    p.add_argument("--ratio", type=float, default=0.1, help="SLAMB's k")
    p.add_argument("--slamb-scaling", default="simplified", choices=("simplified", "algorithm"))
    p.add_argument("--evals", type=int, default=8, help="test evaluations per method")
    p.add_argument("--points", type=int, default=60, help="loss curve points per method")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--timeout", type=float, default=2700, help="seconds for the whole run")
    p.add_argument("--plot", metavar="JSON", help="only draw the plots of an earlier report")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    stem = os.path.splitext(args.plot or args.out)[0]
    if args.plot:
        report = _spawn.read_report(args.plot)
        print_tables(report)
        return plot(report, stem)
    methods = args.methods.split(",")
    if [m for m in methods if m not in METHODS]:
        p.error(f"unknown methods {[m for m in methods if m not in METHODS]}: "
                f"choose from {', '.join(METHODS)}")
    if args.quick:
        args.epochs, args.evals, args.interval = 1, 4, 20
        args.max_train, args.max_test = args.max_train or 20000, args.max_test or 2000
    forwarded = ("np", "model", "epochs", "max_train", "max_test", "batch", "large_batch",
                 "adam_lr", "adam_eps", "lamb_lr", "lamb_eps", "sgd_lr", "sgd_warmup",
                 "warmup_fraction", "interval", "ratio", "slamb_scaling", "evals", "points",
                 "seed", "data_dir")
    argv = [os.path.abspath(__file__), "--worker", "--methods", ",".join(methods)]
    for key in forwarded:
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if args.onebit_bias_correction:
        argv.append("--onebit-bias-correction")
    print(f"{len(methods)} methods at np={args.np}, {args.epochs} epoch(s) each"
          f"{f' of {args.max_train} samples' if args.max_train else ''}; the 1-bit optimizers "
          f"warm up for {args.warmup_fraction:.0%} of the steps; SLAMB k={args.ratio}, "
          f"H={args.interval}", flush=True)
    start = time.monotonic()
    res = _spawn.run_collect("gloo", argv, args.np, timeout=args.timeout)
    report = dict(res, model={"net": "examples/fashion_mnist.py's CNN",
                              "lenet5": "LeNet-5"}[args.model],
                  settings={k: getattr(args, k) for k in forwarded if k != "data_dir"},
                  wall_s=time.monotonic() - start)
    report["settings"]["onebit_bias_correction"] = args.onebit_bias_correction
    print_tables(report)
    _spawn.write_report(args.out, report)
    plot(report, stem)
    print(f"total {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
