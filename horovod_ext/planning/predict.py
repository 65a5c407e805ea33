"""Predicted times of each op's reduction and of a training step, and the plan a user reads.

``reduction_times`` prices one reduction of a gradient buffer with every op, flat and
hierarchical; ``training_step`` adds a step's compute with the gradient buckets overlapping
backward (each bucket's reduction starts when its gradients are ready and after the previous
one, as DistributedOptimizer's hooks do); ``plan`` puts both in a table with a recommendation.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from horovod_ext.config import Config
from . import schedules as S
from .cluster import Cluster
from .profile import Profile, load
from .simulate import pattern_times

#: op name -> (description, exact gradient average?)
OPS = {
    "average": ("hvd.Average", True),
    "adasum": ("hvd.Adasum", False),
    "onebit": ("1-bit Adam / LAMB, compressed stage", False),
    "randomk": ("hvd.RandomK(0.01)", False),
    "slamb": ("hvd.SLAMB (random-k 0.1 + LAMB)", False),
    "powersgd": ("hvd.PowerSGD(rank=4)", False),
    "diloco": ("hvd.DiLoCo(sync_every=50)", False),
}
DILOCO_H = 50
#: the optimizer step each op's users run (1-bit LAMB and SLAMB: LAMB's fused kernels)
OPTIMIZER = {"onebit": "optimizer_lamb", "slamb": "optimizer_lamb"}


@dataclass
class Options:
    layers: int = 64            # tensors in a buffer (Adasum's and 1-bit's per-layer tables)
    hidden: int = 1024          # PowerSGD's matrix blocks are hidden x hidden
    randomk_ratio: float = 0.01
    slamb_ratio: float = 0.1
    powersgd_rank: int = 4
    bucket_bytes: int = Config.gradient_bucket_bytes   # DistributedOptimizer's default


def _schedule(op: str, cluster: Cluster, nbytes: float, profile: Profile, hierarchical: bool,
              o: Options) -> S.Schedule:
    if op in ("average", "diloco"):
        return S.average(cluster, nbytes, profile, hierarchical)
    if op == "adasum":
        return S.adasum(cluster, nbytes, profile, hierarchical, o.layers)
    if op == "onebit":
        return S.onebit(cluster, nbytes, profile, hierarchical, o.layers)
    if op == "randomk":
        return S.randomk(cluster, nbytes, profile, hierarchical, o.randomk_ratio, o.layers)
    if op == "slamb":
        return S.randomk(cluster, nbytes, profile, hierarchical, o.slamb_ratio, o.layers)
    if op == "powersgd":
        return S.powersgd(cluster, nbytes, profile, hierarchical, o.powersgd_rank, o.hidden,
                          o.layers)
    raise ValueError(f"unknown op {op!r}: one of {', '.join(OPS)}")


def schedule_time(schedule: S.Schedule, times, profile: Profile, cpu_share: float = 1.0) -> float:
    """Seconds of one run of ``schedule`` given the patterns' (latency, per-byte) times; local
    work and message handling take ``cpu_share`` times their one-core cost."""
    stage_times = []
    for stage in schedule.stages:
        total = 0.0
        for step in stage:
            net = 0.0
            if step.pattern is not None and step.pattern.flows:
                latency, per_byte = times[step.pattern]
                net = latency + per_byte * step.bytes
            total += step.repeat * (net + cpu_share * (step.messages * profile.per_call["message"]
                                                       + step.compute_s))
        stage_times.append(total)
    if schedule.chunks > 1:
        busiest = max(stage_times)
        return sum(stage_times) + (schedule.chunks - 1) * busiest
    return sum(stage_times)


def call_overhead(cluster: Cluster, profile: Profile) -> float:
    """One collective's fixed cost in the engine: the call itself and one negotiation round
    (a star: rank 0 hears from and answers every rank)."""
    cpu = profile.per_call["call"] + profile.per_call["control_per_rank"] * cluster.ranks
    return cluster.cpu_share * cpu + (2 * cluster.latency_s if cluster.nodes > 1 else 0.0)


@dataclass
class Reduction:
    op: str
    hierarchical: bool
    nbytes: float
    seconds: float
    sent_per_rank: float


def reduction_times(cluster: Cluster, nbytes: Sequence[float], ops: Sequence[str] = tuple(OPS),
                    hierarchical: Sequence[bool] = (False, True), profile: Optional[Profile] = None,
                    options: Optional[Options] = None) -> List[Reduction]:
    """The time of one reduction of each size in ``nbytes`` with each op and form (forms that
    do not apply to the cluster, such as hierarchical on one rank per node, are left out)."""
    profile = profile or load()
    o = options or Options()
    plans = []
    for op in ops:
        for hier in hierarchical:
            if hier and not S.hierarchy_applies(cluster):
                continue
            for size in nbytes:
                plans.append((op, hier, size, _schedule(op, cluster, size, profile, hier, o)))
    patterns = [step.pattern for *_, sch in plans for stage in sch.stages for step in stage]
    times = pattern_times(cluster, profile, patterns)
    fixed = call_overhead(cluster, profile)
    share = cluster.cpu_share
    return [Reduction(op, hier, size, schedule_time(sch, times, profile, share) + fixed,
                      sch.sent_per_rank) for op, hier, size, sch in plans]


@dataclass
class StepPrediction:
    op: str
    hierarchical: bool
    step_s: float
    comm_s: float               # the reductions' own time, overlapped or not
    sent_per_rank: float        # bytes per step


def buckets(model_bytes: float, bucket_bytes: int) -> List[float]:
    full, rest = divmod(model_bytes, bucket_bytes)
    return [float(bucket_bytes)] * int(full) + ([float(rest)] if rest else [])


def overlap(ready: Sequence[float], durations: Sequence[float]) -> float:
    """When the last of the reductions ends: each starts once its bucket is ready and the
    previous reduction has ended."""
    end = 0.0
    for at, took in zip(ready, durations):
        end = max(end, at) + took
    return end


def training_step(cluster: Cluster, model_bytes: float, compute_s: float,
                  ops: Sequence[str] = tuple(OPS), profile: Optional[Profile] = None,
                  options: Optional[Options] = None,
                  hierarchical: Sequence[bool] = (False, True),
                  optimizer_s: Optional[float] = None) -> List[StepPrediction]:
    """Predicted step time of data-parallel training of a model of ``model_bytes`` of float32
    gradients whose forward and backward take ``compute_s`` per rank (a third forward, two
    thirds backward), with each op, and whose optimizer step takes ``optimizer_s`` (None: the
    profile's per-core cost of the op's optimizer for the model's size)."""
    profile = profile or load()
    o = options or Options()
    sizes = buckets(model_bytes, o.bucket_bytes)
    # DiLoCo averages the whole model once a round; the others reduce the buckets
    wanted = sorted(set(sizes)) + ([model_bytes] if "diloco" in ops else [])
    table = {(r.op, r.hierarchical, r.nbytes): r
             for r in reduction_times(cluster, wanted, ops, hierarchical, profile, o)}
    forward, backward = compute_s / 3, 2 * compute_s / 3
    ready, done = [], 0.0
    for size in sizes:                       # backward produces the buckets one by one
        done += size
        ready.append(forward + backward * done / model_bytes)
    out = []
    for op in ops:
        for hier in hierarchical:
            if hier and not S.hierarchy_applies(cluster):
                continue
            optimizer = optimizer_s if optimizer_s is not None else \
                profile.cost(OPTIMIZER.get(op, "optimizer_adam"), model_bytes)
            if op == "diloco":
                whole = table[(op, hier, model_bytes)]
                comm = whole.seconds / DILOCO_H
                step = compute_s + optimizer + comm
                sent = whole.sent_per_rank / DILOCO_H
            else:
                per_bucket = [table[(op, hier, size)] for size in sizes]
                durations = [r.seconds for r in per_bucket]
                comm = sum(durations)
                step = max(compute_s, overlap(ready, durations)) + optimizer
                sent = sum(r.sent_per_rank for r in per_bucket)
            out.append(StepPrediction(op, hier, step, comm, sent))
    return out


@dataclass
class Plan:
    cluster: Cluster
    model_bytes: float
    compute_s: float
    rows: List[StepPrediction]
    recommendation: str
    profile_meta: Dict
    optimizer_s: Optional[float] = None

    def table(self) -> str:
        base = next((r.step_s for r in self.rows if r.op == "average" and not r.hierarchical),
                    None)
        lines = [f"cluster: {self.cluster.describe()} ({self.cluster.ranks} ranks)",
                 f"model: {self.model_bytes / 4 / 1e6:.1f} M float32 parameters "
                 f"({self.model_bytes / 2**20:.1f} MiB of gradients), compute "
                 f"{self.compute_s * 1e3:.1f} ms per step per rank, optimizer "
                 + (f"{self.optimizer_s * 1e3:.1f} ms" if self.optimizer_s is not None
                    else "at the profile's per-core cost"),
                 "",
                 f"{'op':<40} {'form':<13} {'step ms':>10} {'comm ms':>10} "
                 f"{'sent MB/step':>13} {'vs Average':>11}"]
        for r in sorted(self.rows, key=lambda r: r.step_s):
            speed = f"{base / r.step_s:.2f}x" if base else "-"
            lines.append(f"{OPS[r.op][0]:<40} {'hierarchical' if r.hierarchical else 'flat':<13} "
                         f"{r.step_s * 1e3:>10.1f} {r.comm_s * 1e3:>10.1f} "
                         f"{r.sent_per_rank / 1e6:>13.2f} {speed:>11}")
        lines += ["", "recommended: " + self.recommendation]
        meta = self.profile_meta
        if meta:
            lines.append(f"(costs calibrated on {meta.get('machine', '?')}, commit "
                         f"{meta.get('commit', '?')}, {meta.get('date', '?')}; network: SimGrid)")
        return "\n".join(lines)


def recommend(rows: Sequence[StepPrediction], compute_s: float) -> str:
    """The exact average unless another op is clearly faster (10%): the others change what
    the optimizer sees and need their own tuning."""
    exact = min((r for r in rows if OPS[r.op][1]), key=lambda r: r.step_s)
    best = min(rows, key=lambda r: r.step_s)
    form = lambda r: "hierarchical" if r.hierarchical else "flat"  # noqa: E731
    if best.step_s >= 0.9 * exact.step_s:
        why = ("communication hides behind backward or costs little here"
               if exact.step_s < 1.1 * compute_s else
               f"no other op is 10% faster ({OPS[best.op][0]} {form(best)}: "
               f"{best.step_s * 1e3:.1f} ms)")
        return f"{OPS[exact.op][0]} ({form(exact)}), {exact.step_s * 1e3:.1f} ms per step: {why}"
    return (f"{OPS[best.op][0]} ({form(best)}), {best.step_s * 1e3:.1f} ms per step, "
            f"{exact.step_s / best.step_s:.2f}x faster than the exact average "
            f"({exact.step_s * 1e3:.1f} ms): the links are the bottleneck "
            f"(it sends {best.sent_per_rank / 1e6:.1f} MB per step against "
            f"{exact.sent_per_rank / 1e6:.1f} MB); check its accuracy on your model "
            f"(docs/choosing_an_op.md)")


def plan(cluster: Cluster, model_bytes: float, compute_s: float,
         ops: Sequence[str] = tuple(OPS), profile: Optional[Profile] = None,
         options: Optional[Options] = None, optimizer_s: Optional[float] = None) -> Plan:
    profile = profile or load()
    rows = training_step(cluster, model_bytes, compute_s, ops, profile, options,
                         optimizer_s=optimizer_s)
    return Plan(cluster, model_bytes, compute_s, rows, recommend(rows, compute_s), profile.meta,
                optimizer_s)
