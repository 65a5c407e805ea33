"""Synthetic training throughput: hvd.DistributedOptimizer next to torch DDP, same model and data.

    python benchmarks/synthetic.py                  # np = 1, 2, 4; MLP and small transformer
    python benchmarks/synthetic.py --np 2 --quick

In the spirit of Horovod's pytorch_synthetic_benchmark: random data, a fixed number of timed
steps after warm-up.  Both methods run inside the same ranks (Gloo), taking turns in rounds, so
machine drift hits both.  Prints a table (samples/s over all ranks, and scaling efficiency
against np=1) and writes JSON.
"""
import json
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
    import horovod_ext.torch as hvd

    hvd.init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    results = {}
    for kind in args.models:
        gen = torch.Generator().manual_seed(hvd.rank())
        runners = {}
        model, make_batch, lossf = build(kind)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        runners["hvd"] = (model, opt)
        ddp_base, _, _ = build(kind)
        ddp = (torch.nn.parallel.DistributedDataParallel(ddp_base) if hvd.size() > 1
               else ddp_base)
        runners["ddp"] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01))
        batches = [make_batch(args.batch, gen) for _ in range(4)]

        def steps(name, n):
            m, o = runners[name]
            for i in range(n):
                x, y = batches[i % len(batches)]
                o.zero_grad()
                lossf(m(x), y).backward()
                o.step()

        for name in runners:
            steps(name, args.warmup)
        times = {name: [] for name in runners}
        for _ in range(args.rounds):
            for name in runners:
                if hvd.size() > 1:
                    dist.barrier()
                t0 = time.perf_counter()
                steps(name, args.steps)
                times[name].append(time.perf_counter() - t0)
        # the slowest rank sets the pace
        results[kind] = {name: max(hvd.allgather_object(statistics.median(ts)))
                         for name, ts in times.items()}
        results[kind]["params"] = sum(p.numel() for p in model.parameters())
    if hvd.rank() == 0:
        with open(args.result, "w") as f:
            json.dump(results, f)
    hvd.shutdown()


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

    report = {"batch_per_rank": args.batch, "steps": args.steps, "runs": {}}
    print(f"{'model':<12} {'np':>3} {'hvd samples/s':>14} {'ddp samples/s':>14} "
          f"{'hvd/ddp':>8} {'hvd eff':>8} {'ddp eff':>8}", flush=True)
    base = {}
    for np_ in [int(x) for x in args.np.split(",")]:
        argv = [os.path.abspath(__file__), "--worker", "--models", ",".join(args.models),
                "--batch", str(args.batch), "--steps", str(args.steps),
                "--warmup", str(args.warmup), "--rounds", str(args.rounds)]
        data = _spawn.run_collect("gloo", argv, np_)
        report["runs"][np_] = data
        for kind in args.models:
            row = data[kind]
            rate = {m: args.batch * np_ * args.steps / row[m] for m in ("hvd", "ddp")}
            if np_ == 1:
                base[kind] = rate
            eff = {m: rate[m] / (np_ * base[kind][m]) if kind in base else float("nan")
                   for m in rate}
            row.update({f"{m}_samples_per_s": rate[m] for m in rate})
            row.update({f"{m}_efficiency": eff[m] for m in eff})
            print(f"{kind:<12} {np_:>3} {rate['hvd']:>14.1f} {rate['ddp']:>14.1f} "
                  f"{rate['hvd'] / rate['ddp']:>8.3f} {eff['hvd']:>8.2f} {eff['ddp']:>8.2f}",
                  flush=True)
    _spawn.write_report(args.out, report)


if __name__ == "__main__":
    main()
