"""Head to head on slow links: torch DDP's hooks and local SGD against every horovod_ext op.

    python benchmarks/head_to_head.py --lab              # CNN: loopback, 1 Gbit/s, 100 Mbit/s;
                                                         # 2 hosts x 1 and x 2, 3 repetitions
    python benchmarks/head_to_head.py --lab --settings lab-100mbit-2x1,loopback-2x1
    python benchmarks/head_to_head.py --workload lm --lab  # the transformer language model
    python benchmarks/head_to_head.py --quick            # loopback, 4 methods, 1 repetition
    python benchmarks/head_to_head.py --markdown docs/head_to_head_cnn.json  # tables of a report
    python benchmarks/head_to_head.py --plot docs/head_to_head_cnn.json      # redraw its plot

Workloads (the same model, data, batch and number of samples for every method):
  cnn  examples/fashion_mnist.py's CNN (215 k parameters) on Fashion-MNIST (Debian's
       ``dataset-fashion-mnist``); quality = test accuracy on the 10 k test images
  lm   a causal transformer over bytes (``_models.CharLM``: 0.44 M parameters, context 64) on
       the fortune cookies of Debian's ``fortunes`` package (/usr/share/games/fortunes, 2.5 MB
       of English text: the last 10% of each file held out); quality = held-out loss in bits
       per byte
Global batch fixed (``--global-batch``), split among the ranks, so that every setting trains
the same number of samples in the same number of steps.  Learning rate decays linearly to 0.

Methods (inner optimizer Adam, lr ``--adam-lr``, unless said):
  ddp                DistributedDataParallel (bucket_cap_mb=25, as our buckets), no hook
  ddp_fp16           DDP + fp16_compress_hook
  ddp_powersgd_r1/4  DDP + powerSGD_hook, matrix_approximation_rank 1 / 4, start after 10% of the
                     steps (torch's advice), warm start, error feedback
  ddp_local_sgd      DDP + post_localSGD_hook and PostLocalSGDOptimizer with a
                     PeriodicModelAverager (period ``--period``, after 10% of the steps): torch's
                     local SGD; 2 x 2: gradients averaged inside the node between averagings
  average, adasum    hvd.DistributedOptimizer(op=hvd.Average / hvd.Adasum)
  onebit_adam/lamb   hvd.OnebitAdam / hvd.OnebitLamb, warm-up 15% of the steps (LAMB lr
                     ``--lamb-lr``)
  slamb              hvd.SLAMB(ratio=0.1, sync_interval=50) (LAMB lr)
  powersgd_r1/4      hvd.DistributedOptimizer(op=hvd.PowerSGD(rank=1 / 4)), the hook's settings
  diloco_h10/h50     hvd.DiLoCo(Adam, sync_every=10 / 50), outer lr 0.7, Nesterov momentum 0.9
  diloco_h50_onebit  the same with op=hvd.OneBit: the pseudo-gradient sent at 1 bit per element
  sparseloco_h50     hvd.DiLoCo(Adam, sync_every=50, outer lr 1, no outer momentum,
                     op=hvd.SparseLoCo()): 1/64 of each 4096-element chunk at 2 bits, error
                     feedback decayed by 0.95 (SparseLoCo's settings)
  ..._q8/_q4/_q2     op=hvd.Quantized(bits=8 / 4 / 2): the pseudo-gradient as codes of that
                     many bits with a float32 scale every 256 elements
  variants           diloco_h<H>[_onebit|_sparseloco[_d<density>]|_q8|_q4|_q2][_lr<outer lr>]
                     [_m<outer momentum>][_warm<inner warm-up steps>][_ilr<inner peak lr>]
                     [_b<Adam's beta1>][_node], e.g. diloco_h50_lr1_m0; _node: each host is
                     one worker, its ranks averaging every step's gradients
                     (hvd.DistributedOptimizer over the host's process set inside DiLoCo)
                     (local SGD): any H and outer settings, for sweeps; listed after the
                     methods above
2 x 2 runs ours hierarchically (HOROVOD_HIERARCHICAL_ALLREDUCE=1); DDP has no such mode.

Settings: loopback-2x1 / 2x2 (localhost, unshaped: the "fast network"), and 2 emulated hosts of
tools/netlab.sh (root) at 1 Gbit/s and 100 Mbit/s with 1 or 2 ranks each; by name only, links as
the internet has them: 100 Mbit/s with 20 ms more round trip (lab-100mbit-20ms-2x1 / 2x2) and
10 Mbit/s with 100 ms (lab-10mbit-100ms-2x1 / 2x2).  Each setting starts
its ranks once; the methods take turns, repetition by repetition (``--reps``, seeds 1, 2, ...:
initial weights and data order), so drift on this shared machine hits them alike.

Measured per run: quality every ``--eval-every`` steps on the first ``--eval-samples`` test
samples (2000 of the CNN's; of the ranks' average model: every method's models are equal there,
the local methods' sync periods divide it), the final quality on the whole test set, training
time (evaluations excluded), time to ``--target`` (the training time at the first evaluation
that reaches it), throughput, and in the lab the bytes that left the hosts' NICs while training
(eth0 transmit counters, evaluations excluded).  JSON to ``--out``; a plot of quality against
training time per setting next to it.
"""
import os
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _spawn  # noqa: E402  (benchmarks/ is not a package; also fixes sys.path for the packages)
sys.path.insert(0, HERE)
import _models  # noqa: E402
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

METHODS = ["ddp", "ddp_fp16", "ddp_powersgd_r1", "ddp_powersgd_r4", "ddp_local_sgd", "average",
           "adasum", "onebit_adam", "onebit_lamb", "slamb", "powersgd_r1", "powersgd_r4",
           "diloco_h10", "diloco_h50", "diloco_h50_onebit", "sparseloco_h50"]
QUICK_METHODS = ["ddp", "ddp_powersgd_r1", "average", "powersgd_r1", "diloco_h10"]
SETTINGS = _spawn.LINK_SETTINGS
WORKLOADS = {  # name: default steps, global batch, target, Adam's lr, quality, higher is better
    "cnn": dict(steps=450, global_batch=128, target=0.85, adam_lr=2e-3, quality="test accuracy",
                higher=True),
    "lm": dict(steps=600, global_batch=32, target=3.6, adam_lr=3e-3,
               quality="held-out bits per byte", higher=False)}
FORTUNES = "/usr/share/games/fortunes"
LAMB_METHODS = ("onebit_lamb", "slamb")
SLAMB_INTERVAL = 50
PLAIN_START_FRACTION = 0.1   # plain steps before PowerSGD and local SGD start
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"


# --- data and models -------------------------------------------------------------------------

def fortunes_corpus(folder=FORTUNES):
    """(training bytes, held-out bytes) as uint8 tensors: the fortune files in name order, the
    last 10% of each held out."""
    import torch
    if not os.path.isdir(folder):
        raise SystemExit(f"no fortunes in {folder}: apt-get install fortunes")
    train, held = [], []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".dat") or os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        cut = int(0.9 * len(data))
        train.append(data[:cut])
        held.append(data[cut:])
    as_tensor = lambda chunks: torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)  # noqa: E731
    return as_tensor(train), as_tensor(held)


class Workload:
    """A model factory, batches by sample index and a quality score, for one workload."""

    def __init__(self, name, args):
        import torch
        self.name = name
        if name == "cnn":
            fashion_mnist, _ = _spawn.sibling("convergence").examples()
            self.make_model = fashion_mnist.Net
            tx, ty, vx, vy, self.source = fashion_mnist.load_data(args.data_dir)
            self.train, self.test = (tx, ty), (vx, vy)
            self.samples = len(ty)
        else:
            train, held = fortunes_corpus()
            self.make_model = _models.CharLM
            seq = _models.CharLM.CONTEXT + 1
            # training samples: every window start; held-out: fixed, non-overlapping windows
            self.corpus = train.long()
            self.samples = len(train) - seq
            self.seq = seq
            starts = torch.arange(0, len(held) - seq, seq)[:args.lm_held_out]
            self.test = held.long()[starts[:, None] + torch.arange(seq)]
            self.source = (f"fortunes ({FORTUNES}): {len(train)} training bytes, "
                           f"{len(self.test)} held-out windows of {seq - 1}")

    def batch(self, indices):
        import torch
        if self.name == "cnn":
            x, y = self.train
            return x[indices], y[indices]
        return self.corpus[indices[:, None] + torch.arange(self.seq)]

    def loss(self, model, batch):
        import torch.nn.functional as F
        if self.name == "cnn":
            x, y = batch
            return F.cross_entropy(model(x), y)
        return _models.lm_loss(model, batch)

    def score(self, model, part=None):
        """This rank's share of the test data (``part``: its first ``part`` samples): float64
        sums (quality, loss, count)."""
        import math
        import torch
        import horovod_ext.torch as hvd

        if self.name == "cnn":
            x, y = self.test
            mine = torch.arange(hvd.rank(), min(part or len(y), len(y)), hvd.size())
            return _spawn.sibling("convergence").classification_totals(model, x, y, mine)
        totals = torch.zeros(3, dtype=torch.float64)
        mine = self.test[:part or len(self.test)][hvd.rank()::hvd.size()]
        for i in range(0, len(mine), 64):
            chunk = mine[i:i + 64]
            nats = float(_models.lm_loss(model, chunk, reduction="sum"))
            count = float(chunk[:, 1:].numel())
            totals += torch.tensor([nats / math.log(2), nats, count], dtype=torch.float64)
        return totals


# --- methods ---------------------------------------------------------------------------------

def build(method, net, args, total, seed, per_node):
    """(module to call, optimizer) of ``method`` around the fresh model ``net``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook
    from torch.nn.parallel import DistributedDataParallel
    import horovod_ext.torch as hvd

    start = max(1, round(PLAIN_START_FRACTION * total))
    named = list(net.named_parameters())
    adam = lambda: torch.optim.Adam(net.parameters(), lr=args.adam_lr, eps=args.adam_eps)  # noqa: E731
    lamb = dict(lr=args.lamb_lr, eps=args.lamb_eps, min_coeff=0.01, max_coeff=10.0)
    if method.startswith("ddp"):
        # 25 MB buckets with no 1 MB first bucket, the plan of our own buckets.  With DDP's
        # default first bucket the transformer has two buckets, and the PowerSGD hook's chained
        # collectives of two buckets reach Gloo in a different order on each rank (a crash:
        # "Received data size doesn't match expected size").  The CNN has one bucket either way.
        ddp = DistributedDataParallel(net, bucket_cap_mb=25)
        opt = adam()
        if method == "ddp_fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif method.startswith("ddp_powersgd"):
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=int(method[-1]),
                start_powerSGD_iter=start, min_compression_rate=2, warm_start=True,
                use_error_feedback=True, random_seed=seed)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        elif method == "ddp_local_sgd":
            from torch.distributed.algorithms.model_averaging.averagers import (
                PeriodicModelAverager)
            from torch.distributed.optim import PostLocalSGDOptimizer
            size = dist.get_world_size()
            # a node's ranks are consecutive (the launcher places them so)
            node, _ = dist.new_subgroups_by_enumeration(
                [list(range(n, n + per_node)) for n in range(0, size, per_node)])
            # averagings after optimizer steps W + 1, W + 1 + period, ...: with W + 1 a
            # multiple of the period they fall on the evaluation steps
            warmup = -(-(start + 1) // args.period) * args.period - 1
            state = post_localSGD_hook.PostLocalSGDState(
                process_group=None, subgroup=node, start_localSGD_iter=warmup,
                post_local_gradient_allreduce=per_node > 1)
            ddp.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
            opt = PostLocalSGDOptimizer(opt, PeriodicModelAverager(period=args.period,
                                                                   warmup_steps=warmup))
        return ddp, opt
    if method in ("average", "adasum"):
        op = hvd.Average if method == "average" else hvd.Adasum
        return net, hvd.DistributedOptimizer(adam(), named_parameters=named, op=op)
    if method.startswith("powersgd"):
        op = hvd.PowerSGD(rank=int(method[-1]), start_iter=start, seed=seed)
        return net, hvd.DistributedOptimizer(adam(), named_parameters=named, op=op)
    freeze = max(1, round(args.warmup_fraction * total))
    if method == "onebit_adam":
        return net, hvd.OnebitAdam(net.parameters(), lr=args.adam_lr, eps=args.adam_eps,
                                   freeze_step=freeze)
    if method == "onebit_lamb":
        return net, hvd.OnebitLamb(net.parameters(), freeze_step=freeze, **lamb)
    if method == "slamb":
        return net, hvd.SLAMB(net.parameters(), ratio=0.1, sync_interval=SLAMB_INTERVAL,
                              total_steps=total, **lamb)
    local = local_method(method)
    if local is not None:
        op = {"": lambda: hvd.Average, "onebit": lambda: hvd.OneBit,
              "sparseloco": lambda: hvd.SparseLoCo(density=local["density"]),
              "q8": lambda: hvd.Quantized(bits=8), "q4": lambda: hvd.Quantized(bits=4),
              "q2": lambda: hvd.Quantized(bits=2)}[local["op"]]()
        inner = torch.optim.Adam(net.parameters(), lr=local["inner_lr"] or args.adam_lr,
                                 eps=args.adam_eps, betas=(local["beta1"], 0.999))
        if local["node"]:   # a host is one worker: its ranks average every step's gradients
            inner = hvd.DistributedOptimizer(inner, named_parameters=named, op=hvd.Average,
                                             process_set=node_process_set(per_node))
        return net, hvd.DiLoCo(inner, named_parameters=named, sync_every=local["every"], op=op,
                               outer_lr=local["outer_lr"], outer_momentum=local["momentum"])
    raise ValueError(f"unknown method {method!r}")


LOCAL_METHOD = re.compile(r"diloco_h(\d+)(?:_(onebit|sparseloco|q8|q4|q2)(?:_d([\d.]+))?)?"
                          r"(?:_lr([\d.]+))?(?:_m([\d.]+))?(?:_warm(\d+))?(?:_ilr([\d.]+))?"
                          r"(?:_b([\d.]+))?(_node)?")


_NODE_SETS = {}   # ranks per node -> this rank's node's process set


def node_process_set(per_node: int):
    """The process set of this rank's node (its ranks are consecutive, as the launcher places
    them), registered once per worker: every rank registers every node's, in node order."""
    import horovod_ext.torch as hvd

    if per_node not in _NODE_SETS:
        nodes = [hvd.add_process_set(list(range(n, n + per_node)))
                 for n in range(0, hvd.size(), per_node)]
        _NODE_SETS[per_node] = nodes[hvd.rank() // per_node]
    return _NODE_SETS[per_node]


def local_method(method: str):
    """DiLoCo's settings of a method name (see the module), or None for other methods."""
    if method == "sparseloco_h50":
        return dict(every=50, op="sparseloco", density=1 / 64, outer_lr=1.0, momentum=0.0,
                    warmup=0, inner_lr=None, beta1=0.9, node=False)
    found = LOCAL_METHOD.fullmatch(method)
    if found is None:
        return None
    every, op, density, lr, momentum, warmup, inner_lr, beta1, node = found.groups()
    return dict(every=int(every), op=op or "", density=float(density or 1 / 64),
                outer_lr=float(lr or 0.7),
                momentum=float(0.9 if momentum is None else momentum), warmup=int(warmup or 0),
                inner_lr=float(inner_lr) if inner_lr else None, beta1=float(beta1 or 0.9),
                node=bool(node))


def method_order(present):
    """The methods in ``present`` in the module's order, variants after them."""
    return [m for m in METHODS if m in present] + sorted(m for m in present if m not in METHODS)


def train(method, work, args, rep, log):
    """One run: its evaluations (step, training seconds, quality, NIC bytes so far)."""
    import torch
    import horovod_ext.torch as hvd

    convergence = _spawn.sibling("convergence")
    rank, size = hvd.rank(), hvd.size()
    per_rank = args.global_batch // size
    total, seed = args.steps, rep
    torch.manual_seed(seed)
    net = work.make_model()
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    module, opt = build(method, net, args, total, seed, hvd.local_size())
    order = torch.randperm(work.samples, generator=torch.Generator().manual_seed(seed))
    peak_lr = args.lamb_lr if method in LAMB_METHODS else args.adam_lr
    local = local_method(method) or {}
    peak_lr = local.get("inner_lr") or peak_lr
    warm = local.get("warmup", 0)   # a variant's inner warm-up
    row = {"evals": [], "losses": []}
    # only the host's first rank counts its NIC (ranks of a host share it)
    counting = args.count_nic and hvd.local_rank() == 0
    train_s, sent, running, counted = 0.0, 0, 0.0, 0
    hvd.barrier()
    t0, nic0 = time.perf_counter(), _spawn.nic_tx_bytes() if counting else 0
    for step in range(total):
        first = (step * args.global_batch) % work.samples
        idx = order[first + rank * per_rank:first + (rank + 1) * per_rank]
        for group in opt.param_groups:
            group["lr"] = peak_lr * (total - step) / total * min(1.0, (step + 1) / max(1, warm))
        opt.zero_grad()
        loss = work.loss(module, work.batch(idx))
        loss.backward()
        opt.step()
        running, counted = running + loss.item(), counted + 1
        done = step + 1
        if done % args.eval_every == 0 or done == total:
            train_s += time.perf_counter() - t0
            if counting:
                sent += _spawn.nic_tx_bytes() - nic0
            totals, spread = convergence.evaluate_averaged(
                net, lambda model: work.score(model, args.eval_samples))
            mean_loss = hvd.allreduce(torch.tensor([running / counted]), op=hvd.Average,
                                      name="head_to_head.loss")
            quality = (totals[0] / totals[2]).item()
            row["evals"].append({"step": done, "train_s": train_s, "quality": quality,
                                 "spread": spread, "nic_bytes": sent})
            row["losses"].append(mean_loss.item())
            running, counted = 0.0, 0
            log(f"      {method:<18} rep {rep} step {done:4d}/{total}  "
                f"{'acc' if work.name == 'cnn' else 'bpb'} {quality:.4f}  "
                f"train loss {mean_loss.item():.4f}  [{train_s:.1f} s]")
            hvd.barrier()
            t0, nic0 = time.perf_counter(), _spawn.nic_tx_bytes() if counting else 0
    totals, _ = convergence.evaluate_averaged(net, work.score)
    row["final_quality"] = (totals[0] / totals[2]).item()
    # every host's count, summed: the bytes on the wire
    host_bytes = torch.tensor([float(e["nic_bytes"]) for e in row["evals"]], dtype=torch.float64)
    wire = hvd.allreduce(host_bytes, op=hvd.Sum, name="head_to_head.nic")
    for e, b in zip(row["evals"], wire.tolist()):
        e["nic_bytes"] = b
    row["train_s"] = train_s
    return row


def worker(args):
    import torch
    import torch.distributed as dist
    import horovod_ext.torch as hvd

    torch.set_num_threads(1)
    # the _node variants' process sets are registered once their run starts
    hvd.init(process_sets="dynamic" if "_node" in args.methods else None)
    if not dist.is_initialized():
        raise SystemExit("head_to_head needs horovod_ext over torch.distributed (Gloo)")
    work = Workload(args.workload, args)
    rank = hvd.rank()

    def log(line):
        if rank == 0:
            print(line, flush=True)

    results = {"data": work.source, "np": hvd.size(), "local_size": hvd.local_size(),
               "params": _models.count_parameters(work.make_model()), "runs": []}
    log(f"    {work.source}; np={hvd.size()}, {results['params']} parameters")
    methods = args.methods.split(",")
    for rep in range(1, args.reps + 1):
        for method in methods:
            row = train(method, work, args, rep, log)
            results["runs"].append({"method": method, "rep": rep, **row})
    if rank == 0:
        import json
        with open(args.result, "w") as f:
            json.dump(results, f)
    hvd.shutdown()


# --- reports ---------------------------------------------------------------------------------

def summarise(run, target, higher, global_batch):
    """One run's figures: final quality, time and bytes to ``target``, throughput, bytes."""
    evals = run["evals"]
    reached = [e for e in evals if (e["quality"] >= target if higher else e["quality"] <= target)]
    last = evals[-1]
    return {"final": run["final_quality"], "train_s": run["train_s"],
            "samples_per_s": last["step"] * global_batch / run["train_s"],
            "to_target_s": reached[0]["train_s"] if reached else None,
            "to_target_step": reached[0]["step"] if reached else None,
            "nic_bytes": last["nic_bytes"] or None,
            "nic_bytes_to_target": (reached[0]["nic_bytes"] or None) if reached else None}


def summary(report):
    """{setting: {method: {figure: [value per repetition]}}}."""
    out = {}
    for setting in report["settings"]:
        per = out.setdefault(setting["setting"], {})
        for run in setting["runs"]:
            figures = summarise(run, report["target"], report["higher_is_better"],
                                report["global_batch"])
            row = per.setdefault(run["method"], {})
            for key, value in figures.items():
                row.setdefault(key, []).append(value)
    return out


def _median(values):
    known = [v for v in values if v is not None]
    return statistics.median(known) if len(known) == len(values) and known else None


def _cell(values, fmt, scale=1.0):
    """median (min-max) of the repetitions; "not reached" where a repetition has no value."""
    known = [v * scale for v in values if v is not None]
    if len(known) < len(values) or not known:
        return f"not reached ({len(known)}/{len(values)})" if known else "not reached"
    text = format(statistics.median(known), fmt)
    if len(known) > 1:
        text += f" ({format(min(known), fmt)}-{format(max(known), fmt)})"
    return text


def _scale(report) -> float:
    """Quality as printed: the CNN's accuracy in percent, the language model's bits as they are."""
    return 100.0 if report["workload"] == "cnn" else 1.0


def table_rows(report, rows):
    """Rows of one setting's table: each figure's median and range over the repetitions."""
    base = _median(rows["ddp"]["samples_per_s"]) if "ddp" in rows else None
    quality = "acc %" if report["workload"] == "cnn" else "bits/byte"
    scale = _scale(report)
    out = []
    for method in method_order(rows):
        r = rows[method]
        speed = _median(r["samples_per_s"])
        out.append({"method": method,
                    f"final {quality}": _cell(r["final"], ".2f" if scale > 1 else ".3f", scale),
                    "to target s": _cell(r["to_target_s"], ".1f"),
                    "samples/s": _cell(r["samples_per_s"], ".0f"),
                    "vs ddp": f"{speed / base:.2f}x" if base and speed else "-",
                    "wire MB": (_cell(r["nic_bytes"], ".1f", 1e-6)
                                if any(r["nic_bytes"]) else "-"),
                    "wire MB to target": (_cell(r["nic_bytes_to_target"], ".1f", 1e-6)
                                          if any(r["nic_bytes"]) else "-")})
    return out


def print_tables(report):
    apart = sorted({(s["setting"], r["method"]) for s in report["settings"] for r in s["runs"]
                    if max(e["spread"] for e in r["evals"]) > 1e-6})
    if apart:
        print(f"ranks' models differed at an evaluation (a bug): {apart}")
    for setting, rows in summary(report).items():
        table = table_rows(report, rows)
        if not table:
            continue
        keys = list(table[0])
        widths = {k: max(len(k), *(len(str(row[k])) for row in table)) for k in keys}
        print(f"\n{setting} (target {report['target']} {report['quality']}, "
              f"{report['reps']} repetitions: median (min-max))")
        print("  ".join(k.ljust(widths[k]) for k in keys))
        for row in table:
            print("  ".join(str(row[k]).ljust(widths[k]) for k in keys))


def markdown(report) -> str:
    """The tables of docs/choosing_an_op.md: one per setting."""
    lines = []
    for setting, rows in summary(report).items():
        table = table_rows(report, rows)
        if not table:
            continue
        keys = list(table[0])
        lines += [f"\n**{setting}**\n", "| " + " | ".join(keys) + " |",
                  "|" + "|".join("---" for _ in keys) + "|"]
        lines += ["| " + " | ".join(str(row[k]) for k in keys) + " |" for row in table]
    return "\n".join(lines)


def derived(report) -> dict:
    """The figures the method choice turns on, from the repetitions' medians, per lab setting
    and method: ``penalty`` (time to target over Average's on loopback with as many ranks per
    host), ``fewer_bytes`` (Average's wire bytes to target over the method's), ``final_vs_average``
    (quality difference; percentage points for the CNN), and for our PowerSGD
    ``throughput_vs_hook`` and ``final_vs_hook`` against DDP's hook of the same rank."""
    table = summary(report)
    scale = _scale(report)
    medians = {setting: {method: {key: _median(values) for key, values in figures.items()}
                         for method, figures in rows.items()}
               for setting, rows in table.items()}
    out = {}
    for setting, rows in medians.items():
        if not setting.startswith("lab-"):
            continue
        loop = medians.get("loopback-" + setting.rsplit("-", 1)[1], {}).get("average", {})
        base, avg = loop.get("to_target_s"), rows.get("average") or loop
        avg_bytes = _average_bytes_to_target(report, setting, rows.get("average"), loop)
        per = out[setting] = {}
        for method, m in rows.items():
            per[method] = {
                "penalty": m["to_target_s"] / base if m["to_target_s"] and base else None,
                "fewer_bytes": (avg_bytes / m["nic_bytes_to_target"]
                                if m["nic_bytes_to_target"] and avg_bytes else None),
                "final_vs_average": (scale * (m["final"] - avg["final"])
                                     if avg.get("final") is not None else None)}
            hook = rows.get("ddp_" + method)
            if method.startswith("powersgd") and hook:
                per[method]["throughput_vs_hook"] = m["samples_per_s"] / hook["samples_per_s"]
                per[method]["final_vs_hook"] = scale * (m["final"] - hook["final"])
    return {"medians": medians, "against": out}


def _average_bytes_to_target(report, setting, lab_average, loop_average):
    """Average's wire bytes to the target on ``setting``: measured when Average ran there, else
    its wire bytes a step from an earlier report (``--average-wire-from``; that link, else
    another with as many hosts and ranks) times the steps it took to the target on loopback
    (the same steps: a run is deterministic for its seed)."""
    if lab_average:
        return lab_average.get("nic_bytes_to_target")
    known = report.get("average_wire_bytes_per_step", {})
    layout = setting.rsplit("-", 1)[1]   # the bytes a step depend on hosts x ranks, not the link
    per_step = known.get(setting) or next(
        (v for k, v in sorted(known.items()) if k.endswith("-" + layout)), None)
    steps = loop_average.get("to_target_step")
    return per_step * steps if per_step and steps else None


def average_wire_per_step(path) -> dict:
    """{lab setting: Average's wire bytes a step} from the report at ``path`` (median over its
    repetitions of the whole run's bytes over its steps)."""
    report = _spawn.read_report(path)
    out = {}
    for setting in report["settings"]:
        runs = [r for r in setting["runs"]
                if r["method"] == "average" and r["evals"][-1]["nic_bytes"]]
        if runs:
            out[setting["setting"]] = statistics.median(
                r["evals"][-1]["nic_bytes"] / r["evals"][-1]["step"] for r in runs)
    return out


def comparisons(report) -> str:
    """``derived``'s comparisons as markdown tables, one per lab setting."""
    unit = "pp" if report["workload"] == "cnn" else "bits/byte"
    lines = []
    for setting, rows in derived(report)["against"].items():
        tabled = any(r["penalty"] or r["fewer_bytes"] for r in rows.values())
        if not tabled:
            lines.append(f"\n**{setting}**")
        else:
            lines += [f"\n**{setting}**: against Average (penalty: time to target over Average's "
                      f"on loopback)", "", "| method | slow-link penalty | wire bytes to target "
                      f"| final vs Average ({unit}) |", "|---|---|---|---|"]
        for method in method_order(rows) if tabled else []:
            r = rows[method]
            penalty = f"{r['penalty']:.2f}x" if r["penalty"] else "not reached"
            fewer = ("-" if not r["fewer_bytes"] else f"{r['fewer_bytes']:.1f}x fewer"
                     if r["fewer_bytes"] >= 1 else f"{1 / r['fewer_bytes']:.1f}x more")
            final = ("-" if r["final_vs_average"] is None else f"{r['final_vs_average']:+.2f}")
            lines.append(f"| {method} | {penalty} | {fewer} | {final} |")
        for method in [m for m in METHODS if "throughput_vs_hook" in rows.get(m, {})]:
            r = rows[method]
            lines.append(f"\n{method} against ddp_{method}: throughput "
                         f"{r['throughput_vs_hook']:.2f}x, final {r['final_vs_hook']:+.2f} {unit}")
    return "\n".join(lines)


def plot(report, stem):
    """One PNG: a panel per setting, quality against training time, median over repetitions."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    settings = report["settings"]
    cols = min(3, len(settings))
    rows = (len(settings) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows), squeeze=False)
    scale = _scale(report)
    tab20 = plt.get_cmap("tab20")
    colours = lambda i: tab20((2 * i) % 20 + (2 * i) // 20)  # noqa: E731  (hues apart first)
    for ax, setting in zip(axes.flat, settings):
        by_method = {}
        for run in setting["runs"]:
            by_method.setdefault(run["method"], []).append(run["evals"])
        for i, method in enumerate(method_order(by_method)):
            reps = by_method[method]
            points = min(len(r) for r in reps)
            xs = [statistics.median(r[j]["train_s"] for r in reps) for j in range(points)]
            ys = [scale * statistics.median(r[j]["quality"] for r in reps) for j in range(points)]
            ax.plot(xs, ys, marker="o", markersize=2.5, linewidth=1.2, color=colours(i),
                    linestyle="--" if method.startswith("ddp") else "-", label=method)
        ax.axhline(scale * report["target"], color="grey", linewidth=0.8, linestyle=":")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_title(setting["setting"], fontsize=9)
        ax.set_xlabel("training time, s (log; evaluations excluded)")
        ax.set_ylabel(report["quality"] + (" (%)" if scale > 1 else ""))
        if report["higher_is_better"]:
            ax.set_ylim(scale * (report["target"] - 0.1), None)
        else:
            ax.set_ylim(None, report["target"] + 1.0)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(settings):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=6.5, ncol=2)
    fig.suptitle(f"{report['workload']}: {report['quality']} against training time "
                 f"(median of {report['reps']} repetitions; dashed: torch DDP; dotted line: the "
                 f"target); commit {report.get('commit', '?')}, {report.get('date', '?')}",
                 fontsize=9)
    fig.tight_layout()
    path = f"{stem}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def appended(parser, path, report) -> dict:
    """The earlier report at ``path``, ready to take the settings of ``report`` (a new run of
    the same workload and options); each setting keeps the commit and date it was run on."""
    earlier = _spawn.read_report(path)
    differ = [k for k in ("workload", "reps", "steps", "global_batch", "options")
              if earlier.get(k) != report[k]]
    if differ:
        parser.error(f"--append-to {path}: this run differs from it in {differ}")
    for setting in earlier["settings"]:
        setting.setdefault("commit", earlier.get("commit"))
        setting.setdefault("date", earlier.get("date"))
    earlier.update({k: report[k] for k in ("average_wire_bytes_per_step", "average_wire_from")
                    if k in report})
    return earlier


def run_setting(name, argv, args):
    where, _, per_node = SETTINGS[name]
    env = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"} if per_node > 1 else {}
    return _spawn.run_on(name, argv + (["--count-nic"] if where == "lab" else []), env,
                         args.timeout)


FORWARDED = ("workload", "reps", "steps", "global_batch", "eval_every", "eval_samples", "target",
             "period", "adam_lr", "adam_eps", "lamb_lr", "lamb_eps", "warmup_fraction",
             "lm_held_out", "data_dir")   # the options every worker gets


def parser():
    import argparse

    p = _spawn.parser(__doc__, "head_to_head.json")
    p.add_argument("--workload", default="cnn", choices=sorted(WORKLOADS))
    p.add_argument("--methods", default=",".join(METHODS), help=f"of {', '.join(METHODS)}")
    p.add_argument("--lab", action="store_true",
                   help="also the emulated hosts (root): every setting without added latency "
                        "unless --settings")
    p.add_argument("--settings", help=f"of {', '.join(SETTINGS)} (default: loopback-2x1; "
                                      f"with --lab all)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, help="training steps per run (cnn 450, lm 600)")
    p.add_argument("--global-batch", type=int, help="samples per step, all ranks (cnn 128, "
                                                    "lm 32 windows)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-samples", type=int, default=2000,
                   help="test samples of the evaluations during training (the final one "
                        "takes all)")
    p.add_argument("--target", type=float,
                   help="quality to reach at an evaluation (cnn 0.85 test accuracy, lm 3.6 "
                        "bits per byte)")
    p.add_argument("--period", type=int, default=10, help="ddp_local_sgd's averaging period")
    p.add_argument("--adam-lr", type=float, help="Adam's and 1-bit Adam's peak lr (cnn 2e-3, "
                                                 "lm 3e-3)")
    p.add_argument("--adam-eps", type=float, default=1e-4)
    p.add_argument("--lamb-lr", type=float, default=1e-2)
    p.add_argument("--lamb-eps", type=float, default=1e-3)
    p.add_argument("--warmup-fraction", type=float, default=0.15,
                   help="1-bit optimizers' warm-up share of the steps")
    p.add_argument("--lm-held-out", type=int, default=256, help="held-out windows (lm)")
    p.add_argument("--data-dir", default=FASHION_MNIST)
    p.add_argument("--timeout", type=float, default=5400, help="seconds per setting")
    p.add_argument("--count-nic", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plot", metavar="JSON", help="only redraw the plot of an earlier report")
    p.add_argument("--markdown", metavar="JSON", nargs="+",
                   help="only print earlier reports' tables, one report after another")
    p.add_argument("--loopback-only", default="", metavar="METHODS",
                   help="of --methods, those run on the loopback settings only (the reference "
                        "of a long run over slow lab links)")
    p.add_argument("--lab-only", default="", metavar="METHODS",
                   help="of --methods, those run on the lab settings only")
    p.add_argument("--average-wire-from", metavar="JSON[,JSON]",
                   help="earlier reports with Average on lab settings: its wire bytes a step "
                        "stand in for Average's where --loopback-only keeps it off them")
    p.add_argument("--append-to", metavar="JSON",
                   help="add these settings to an earlier report of the same workload, steps, "
                        "repetitions and options (written back to it; --out is ignored)")
    p.add_argument("--derive", metavar="JSON",
                   help="only recompute an earlier report's medians and comparisons, in place")
    return p


def planned(p, args):
    """(settings, methods, {"loopback"/"lab": methods run only there}) of a run's options;
    refuses (``p.error``) options that cannot give comparable runs."""
    if args.quick:
        args.reps, args.steps = 1, min(args.steps, 100)
        if args.methods == ",".join(METHODS):
            args.methods = ",".join(QUICK_METHODS)
    settings = _spawn.choices(p, args.settings or (",".join(_spawn.LAN_SETTINGS) if args.lab
                                                   else "loopback-2x1"), SETTINGS, "settings")
    methods = _spawn.choices(p, args.methods, METHODS + [m for m in args.methods.split(",")
                                                         if local_method(m)], "methods")
    periods = {m: local_method(m)["every"] for m in methods if local_method(m)}
    periods.update({"slamb": SLAMB_INTERVAL, "ddp_local_sgd": args.period})
    misaligned = [m for m in methods if args.eval_every % periods.get(m, 1)]
    if misaligned:
        p.error(f"--eval-every {args.eval_every} is not a multiple of the sync period of "
                f"{misaligned}: their ranks' models would differ at the evaluations")
    if args.global_batch % 4:
        p.error("--global-batch must split among 4 ranks")
    only = {where: set(filter(None, names.split(",")))
            for where, names in (("loopback", args.loopback_only), ("lab", args.lab_only))}
    for where, names in only.items():
        if names - set(methods):
            p.error(f"--{where}-only {sorted(names - set(methods))} not in --methods")
    return settings, methods, only


def new_report(args, defaults) -> dict:
    """The report's header: the workload, the options, Average's wire bytes from elsewhere."""
    report = {"workload": args.workload, "quality": defaults["quality"],
              "higher_is_better": defaults["higher"], "target": args.target,
              "reps": args.reps, "steps": args.steps, "global_batch": args.global_batch,
              "options": {k: getattr(args, k) for k in FORWARDED if k != "data_dir"},
              "settings": []}
    if args.average_wire_from:
        report["average_wire_bytes_per_step"] = {}
        for path in args.average_wire_from.split(","):
            report["average_wire_bytes_per_step"].update(average_wire_per_step(path))
        report["average_wire_from"] = args.average_wire_from
    return report


def run(args, report, settings, methods, only):
    """Every setting in turn (slowest link last), the report written after each."""
    argv = [os.path.abspath(__file__), "--worker"]
    for key in FORWARDED:
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    start = time.monotonic()
    print(f"{args.workload}: {len(settings)} settings x {len(methods)} methods x {args.reps} "
          f"repetitions, {args.steps} steps of {args.global_batch} samples", flush=True)
    for name in _spawn.by_link_rate(settings, lambda name: SETTINGS[name][1]):
        elsewhere = only["lab" if SETTINGS[name][0] != "lab" else "loopback"]
        here = [m for m in methods if m not in elsewhere]
        res = run_setting(name, argv + ["--methods", ",".join(here)], args)
        report["data"], report["params"] = res["data"], res["params"]
        report["settings"].append({"setting": name, "rate": SETTINGS[name][1], "np": res["np"],
                                   "ranks_per_node": SETTINGS[name][2], "runs": res["runs"],
                                   **_spawn.provenance()})
        print(f"[{time.monotonic() - start:.0f} s elapsed]")
        print_tables({**report, "settings": report["settings"][-1:]})
        report["derived"] = derived(report)
        _spawn.write_report(args.out, report)  # an interrupted run keeps what it has
    print(f"total {time.monotonic() - start:.0f} s")


def main():
    p = parser()
    args = p.parse_args()
    defaults = WORKLOADS[args.workload]
    args.steps = args.steps or defaults["steps"]
    args.global_batch = args.global_batch or defaults["global_batch"]
    args.target = defaults["target"] if args.target is None else args.target
    args.adam_lr = args.adam_lr or defaults["adam_lr"]
    if args.worker:
        return worker(args)
    if args.markdown:
        for path in args.markdown:
            report = _spawn.read_report(path)
            print(markdown(report) + "\n" + comparisons(report))
        return
    if args.derive:
        report = _spawn.read_report(args.derive)
        report["derived"] = derived(report)
        return _spawn.write_report(args.derive, report)
    stem = os.path.splitext(args.plot or args.out)[0]
    if args.plot:
        return plot(_spawn.read_report(args.plot), stem)
    settings, methods, only = planned(p, args)
    report = new_report(args, defaults)
    if args.append_to:
        report, args.out, stem = appended(p, args.append_to, report), args.append_to, None
    run(args, report, settings, methods, only)
    if stem:
        _spawn.plot_if_possible(plot, _spawn.read_report(args.out), stem)  # with commit and date


if __name__ == "__main__":
    main()
