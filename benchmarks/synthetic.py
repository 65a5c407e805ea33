"""Synthetic training throughput: hvd.DistributedOptimizer next to torch DDP, same model and data.

    python benchmarks/synthetic.py                  # np = 1, 2, 4; MLP and small transformer
    python benchmarks/synthetic.py --np 2 --quick

In the spirit of Horovod's pytorch_synthetic_benchmark: random data, a fixed number of timed
steps after warm-up.  Every method runs inside the same ranks (Gloo, one torch.distributed
process group that horovod_ext shares), taking turns in rounds, so machine drift hits all alike:
  hvd        hvd.DistributedOptimizer (gradient buckets, the default)
  ddp        DistributedDataParallel (defaults)
  ddp_view   DistributedDataParallel(gradient_as_bucket_view=True), its closest setting to ours
  ddp_alone  DDP again, with horovod_ext shut down for the round (hvd.shutdown(), then
             hvd.init() again after it): what horovod_ext's idle engine costs DDP's turns
Prints a table (samples/s over all ranks, ratios, and scaling efficiency against np=1) and
writes JSON.
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _spawn  # noqa: E402  (benchmarks/ is not a package)


def build(kind):
    import torch
    torch.manual_seed(0)
    if kind == "mlp":
        model = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 10))
        make_batch = lambda b, g: (torch.randn(b, 784, generator=g),  # noqa: E731
                                   torch.randint(0, 10, (b,), generator=g))
        return model, make_batch, torch.nn.functional.cross_entropy

    class Encoder(torch.nn.Module):
        def __init__(self, vocab=2000, d=128, layers=2, seq=64):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, d)
            self.pos = torch.nn.Parameter(torch.zeros(seq, d))
            layer = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
            self.body = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = torch.nn.Linear(d, vocab)

        def forward(self, tokens):
            return self.head(self.body(self.embed(tokens) + self.pos))

    model = Encoder()
    make_batch = lambda b, g: (torch.randint(0, 2000, (b, 64), generator=g),  # noqa: E731
                               torch.randint(0, 2000, (b, 64), generator=g))
    loss = lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa
    return model, make_batch, loss


def worker(args):
    import torch
    import torch.distributed as dist

    hvd = _spawn.start_beside_ddp()
    size = hvd.size()
    results = {}
    for kind in args.models:
        gen = torch.Generator().manual_seed(hvd.rank())
        runners = {}
        model, make_batch, lossf = build(kind)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        runners["hvd"] = (model, opt)
        for name, view in (("ddp", False), ("ddp_view", True)):
            base, _, _ = build(kind)
            ddp = (torch.nn.parallel.DistributedDataParallel(base, gradient_as_bucket_view=view)
                   if size > 1 else base)
            runners[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01))
        runners["ddp_alone"] = runners["ddp"]
        batches = [make_batch(args.batch, gen) for _ in range(4)]

        def steps(name, n):
            m, o = runners[name]
            for i in range(n):
                x, y = batches[i % len(batches)]
                o.zero_grad()
                lossf(m(x), y).backward()
                o.step()

        for name in ("hvd", "ddp", "ddp_view"):
            steps(name, args.warmup)
        times = {name: [] for name in runners}
        for _ in range(args.rounds):
            for name in runners:
                if name == "ddp_alone":
                    hvd.shutdown()
                if size > 1:
                    dist.barrier()
                t0 = time.perf_counter()
                steps(name, args.steps)
                times[name].append(time.perf_counter() - t0)
                if name == "ddp_alone":
                    hvd.init()
        # the slowest rank sets the pace
        every = [None] * size
        dist.all_gather_object(every, {n: statistics.median(ts) for n, ts in times.items()})
        results[kind] = {name: max(r[name] for r in every) for name in runners}
        results[kind]["params"] = sum(p.numel() for p in model.parameters())
    _spawn.finish_beside_ddp(hvd, results, args.result)


def main():
    p = _spawn.parser(__doc__, "synthetic.json")
    p.add_argument("--np", default="1,2,4")
    p.add_argument("--models", default="mlp,transformer")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    args.models = args.models.split(",") if isinstance(args.models, str) else args.models
    if args.worker:
        return worker(args)
    if args.quick:
        args.steps, args.rounds, args.warmup = 4, 2, 2

    report = {"batch_per_rank": args.batch, "steps": args.steps, "rounds": args.rounds,
              "runs": {}}
    methods = ("hvd", "ddp", "ddp_view", "ddp_alone")
    print(f"{'model':<12} {'np':>3} " + " ".join(f"{m + ' /s':>13}" for m in methods)
          + f" {'hvd/ddp':>8} {'hvd/view':>9} {'ddp/alone':>10} {'hvd eff':>8} {'ddp eff':>8}",
          flush=True)
    base = {}
    for np_ in [int(x) for x in args.np.split(",")]:
        argv = [os.path.abspath(__file__), "--worker", "--models", ",".join(args.models),
                "--batch", str(args.batch), "--steps", str(args.steps),
                "--warmup", str(args.warmup), "--rounds", str(args.rounds)]
        data = _spawn.run_collect("gloo", argv, np_, env={"BENCH_DDP_PORT": str(_spawn.free_port())})
        report["runs"][np_] = data
        for kind in args.models:
            row = data[kind]
            rate = {m: args.batch * np_ * args.steps / row[m] for m in methods}
            if np_ == 1:
                base[kind] = rate
            eff = {m: rate[m] / (np_ * base[kind][m]) if kind in base else float("nan")
                   for m in ("hvd", "ddp")}
            row.update({f"{m}_samples_per_s": rate[m] for m in rate})
            row.update({f"{m}_efficiency": eff[m] for m in eff})
            print(f"{kind:<12} {np_:>3} " + " ".join(f"{rate[m]:>13.1f}" for m in methods)
                  + f" {rate['hvd'] / rate['ddp']:>8.3f} {rate['hvd'] / rate['ddp_view']:>9.3f}"
                  f" {rate['ddp'] / rate['ddp_alone']:>10.3f} {eff['hvd']:>8.2f}"
                  f" {eff['ddp']:>8.2f}", flush=True)
    _spawn.write_report(args.out, report)


if __name__ == "__main__":
    main()
