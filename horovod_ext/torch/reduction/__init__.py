"""How DistributedOptimizer reduces: its typed state (state.py), one reducer class per way of
reducing (base.py, gradients.py, local.py) and ``replan``, which chooses the reducer from the
op's declared attributes, the world and the bucket size.  The optimizer calls ``replan`` when
it is built and again where the choice may change: after a re-initialisation that makes the
world one process or more, and when autotune changes the bucket size."""
import time
from typing import Dict, List

import torch

from horovod_ext.config import Config
from horovod_ext.engine import hierarchy_choice, runtime
from .. import bucket_timing, buckets as _buckets
from .base import GradientReducer, Reducer
from .gradients import BucketReducer, GroupReducer, PerTensorReducer
from .local import AloneReducer, DeltaReducer, OutsideSetReducer
from .requests import reduce_now
from . import plan_trial
from .state import Layout, OptimizerState, Plan, Progress, Settings

__all__ = ["AloneReducer", "BucketReducer", "DeltaReducer", "GradientReducer", "GroupReducer",
           "Layout", "OptimizerState", "OutsideSetReducer", "PerTensorReducer", "Plan",
           "Progress", "Reducer", "Settings", "bucket_cap", "bucket_plan",
           "first_bucket_cap", "is_alone",
           "new_state", "replan"]


def bucket_cap() -> int:
    """The configured gradient bucket size in bytes (0: no buckets)."""
    config = runtime.state.config or Config.from_env()
    return min(config.fusion_threshold, config.gradient_bucket_bytes)


def bucket_plan() -> str:
    """How gradient buckets are planned: "auto" (the faster in training of "timed" and
    "size"), "timed" (cut from measured arrival times and link cost) or "size" (the caps)."""
    return (runtime.state.config or Config.from_env()).gradient_bucket_plan


def first_bucket_cap() -> int:
    """The configured size of the first bucket, backward's first gradients (0: as the rest)."""
    return (runtime.state.config or Config.from_env()).first_bucket_bytes


def is_alone(settings: Settings) -> bool:
    """One process in the set and an elementwise op: the reduction of each gradient is the
    gradient itself (an elastic job that shrinks to one worker, or grows from it, switches at
    its next re-initialisation)."""
    return (settings.process_set.size() == 1 and settings.op.elementwise
            and not settings.delta)


def new_state(settings: Settings, params: List[torch.Tensor], names: Dict[int, str],
              groups) -> OptimizerState:
    """The state of a new optimizer over the trainable ``params``, its reducer chosen;
    ``groups`` as DistributedOptimizer takes it."""
    if groups is None and settings.op.layer_buckets:
        # the op reduces DDP's buckets of consecutive layers together
        groups = _buckets.partition(params, bucket_cap())
    state = OptimizerState(settings, Layout.build(params, names, groups),
                           Progress(generation=runtime.state.generation))
    replan(state)
    return state


def replan(state: OptimizerState) -> None:
    """Choose the reducer for the current world and bucket size; it starts with nothing in
    flight."""
    alone, cap = is_alone(state.settings), bucket_cap()
    state.plan = Plan(reducer=_choose(state, alone, cap), alone=alone, bucket_cap=cap,
                      first_bucket_cap=first_bucket_cap())


def _choose(state: OptimizerState, alone: bool, cap: int) -> Reducer:
    settings = state.settings
    if not settings.member:
        return OutsideSetReducer(state)
    if settings.delta:
        return DeltaReducer(state)
    if alone:
        return AloneReducer(state)
    planned = _plan_buckets(state, cap)
    if planned:
        return BucketReducer(state, planned)
    if state.layout.groups:
        return GroupReducer(state)
    return PerTensorReducer(state)


def _plan_buckets(state: OptimizerState, cap: int) -> List[_buckets.Bucket]:
    """Gradient buckets of up to ``cap`` bytes, where they change nothing but speed: an
    elementwise op (per-layer ops such as Adasum or 1-bit need tensor boundaries), no explicit
    ``groups``, fusion on, dense strided parameters; sparse ones left the buckets for good."""
    settings, layout = state.settings, state.layout
    if settings.explicit_groups or not settings.op.elementwise or cap == 0:
        return []
    if (layout.timing_generation == state.progress.generation and layout.arrival_times
            and layout.cut == "timed"):
        return _timed_buckets(layout, cap)
    return _size_buckets(layout, cap)


def _size_buckets(layout: Layout, cap: int) -> List[_buckets.Bucket]:
    """Buckets by the two caps alone, in arrival order where it is known."""
    ordered = layout.params if layout.arrival_order is None else \
        [layout.params[i] for i in reversed(layout.arrival_order)]   # planned from the end
    params = [p for p in ordered if id(p) not in layout.sparse]
    if not params or not _buckets.eligible(params):
        return []
    return _buckets.plan(params, cap, first_bucket_cap())


def _timed_buckets(layout: Layout, cap: int) -> List[_buckets.Bucket]:
    """Buckets cut from the measured arrival times and link cost (bucket_timing.cut)."""
    arrived = [(layout.params[i], t) for i, t in zip(layout.arrival_order, layout.arrival_times)
               if id(layout.params[i]) not in layout.sparse]
    params = [p for p, _ in arrived]
    if not params or not _buckets.eligible(params):
        return []
    groups = bucket_timing.cut([t for _, t in arrived],
                               [p.numel() * p.element_size() for p in params],
                               [(p.dtype, p.device) for p in params], layout.link_cost, cap)
    return [_buckets.Bucket(k, [params[i] for i in g]) for k, g in enumerate(groups)]


def follow_arrival_order(state: OptimizerState, broadcast) -> None:
    """Plan the gradient buckets from what backward did, as DDP rebuilds its buckets.  After
    the first step, in the order backward produced the gradients: the order of parameter
    registration can differ (a pre-LN transformer layer registers its first norm after its
    linear layers, and backward reaches it last), and a bucket waits for its last gradient.
    After the next TIMING_STEPS (HOROVOD_GRADIENT_BUCKET_PLAN=timed), cut from when each
    gradient arrived (its median over those backward passes) and what a reduction costs
    (``probe_link``, a collective); then (plan "auto") the next steps try that cut, the caps'
    buckets and, where the way of the world's allreduces is open (hierarchy_choice), the
    hierarchical way, and keep the fastest (plan_trial.py).
    ``broadcast`` hands every rank rank 0's measurements, so that all plan alike.  Collective
    over the optimizer's process set: at the first steps of each generation of the world
    (hvd.init, an elastic reset), which every rank of that generation takes alike."""
    reducer, layout = state.plan.reducer, state.layout
    generation = state.progress.generation
    if not isinstance(reducer, BucketReducer):
        return
    if layout.arrival_generation != generation:
        before = layout.arrival_order or list(reversed(range(len(layout.params))))
        layout.arrival_order = broadcast(reducer.observed_order())
        layout.arrival_generation = generation
        layout.arrival_passes, layout.pass_ends = [], []
        if bucket_plan() == "size" or (bucket_plan() == "auto" and _one_host()):
            layout.timing_generation = generation     # nothing more to learn
        reducer.arrived.clear()                       # the next step's times are measured
        if layout.arrival_order != before:
            _replan_keeping_gradients(state)
        return
    if layout.timing_generation != generation:
        layout.arrival_passes.append(reducer.observed_pass())
        layout.pass_ends.append(time.perf_counter())
        reducer.arrived.clear()                       # the next pass is timed afresh
        if len(layout.arrival_passes) >= bucket_timing.TIMING_STEPS:
            _learn_timing(state, broadcast)
    elif layout.trial is not None:
        _continue_trial(state, broadcast)


def _one_host() -> bool:
    """All ranks on one host: reductions go through shared memory, where the size buckets
    trained faster than the measured cut (benchmarks/synthetic.py, np=2: 0.89x and 0.93x the
    size buckets' throughput), so "auto" keeps them without a trial."""
    return runtime.topology().num_nodes == 1


def _learn_timing(state: OptimizerState, broadcast) -> None:
    """After the timed passes (steps 2 to 1 + TIMING_STEPS): rank 0's median arrival times and
    link costs, and the buckets cut from them; with the plan "auto", the trial of the
    candidates begins with these, its visits as long as rank 0's steps between the timed passes
    say (plan_trial.visit_steps)."""
    layout = state.layout
    flat, hierarchical = probe_link(state)
    order, times = bucket_timing.median_arrivals(layout.arrival_passes)
    visit = plan_trial.visit_steps(layout.pass_ends)
    layout.arrival_passes, layout.pass_ends = [], []
    layout.arrival_order, layout.arrival_times, flat, hierarchical, visit = broadcast(
        (order, times, flat, hierarchical, visit))
    layout.link_cost, layout.cut = flat, "timed"
    layout.both_ways = (flat, hierarchical)
    candidates = [plan_trial.Candidate("timed", False)]
    if bucket_plan() == "auto" and not _same_buckets(layout):
        candidates.append(plan_trial.Candidate("size", False))
    if hierarchical is not None:   # the way is open: tried under "timed" too
        candidates.append(plan_trial.Candidate("timed", True))
    layout.trial = plan_trial.PlanTrial(candidates, visit) if len(candidates) > 1 else None
    layout.trial_visit_steps = visit if layout.trial is not None else None
    layout.timing_generation = state.progress.generation
    _replan_keeping_gradients(state)


def _same_buckets(layout: Layout) -> bool:
    """Whether the measured cut gives the size buckets (a small model: both one bucket), so
    that trying both would only spend steps."""
    cap = bucket_cap()
    return [[id(p) for p in b.params] for b in _timed_buckets(layout, cap)] == \
        [[id(p) for p in b.params] for b in _size_buckets(layout, cap)]


def _continue_trial(state: OptimizerState, broadcast) -> None:
    """Count a step of the trial; after each visit's steps switch to the next visit's
    candidate, and after the last keep the one plan_trial.choose picks (rank 0's medians)."""
    layout = state.layout
    trial = layout.trial
    event = trial.mark(time.perf_counter())
    if event is None:
        return
    if event == "decide":
        medians, rounds = broadcast((trial.medians(), trial.round_medians()))
        layout.trial_medians = dict(zip(trial.candidates, medians))
        layout.trial_rounds = dict(zip(trial.candidates, rounds))
        layout.trial = None
        best = plan_trial.choose(trial.candidates, medians, rounds)
        if best == trial.current:
            return                     # it is the plan already
        candidate = trial.candidates[best]
    else:
        candidate = trial.candidates[trial.current]
    if candidate.hierarchical != runtime.engine().comms.hierarchical_allreduce:
        hierarchy_choice.set_hierarchical(candidate.hierarchical)
    layout.cut = candidate.cut
    layout.link_cost = layout.both_ways[int(candidate.hierarchical)]
    _replan_keeping_gradients(state)


def probe_link(state: OptimizerState):
    """What a bucket's reduction costs (bucket_timing.LinkCost), timed on buffers of the first
    bucket's kind: the flat way, and, where the choice is open (hierarchy_choice), the
    hierarchical way too (else None), which leaves the world's allreduces flat.  Collective
    over the optimizer's process set."""
    buckets = state.plan.reducer.buckets
    first = buckets[0].flat if buckets else state.layout.params[0]
    buffers: Dict[int, torch.Tensor] = {}

    def reduce(nbytes: int, name: str) -> None:
        if nbytes not in buffers:
            buffers[nbytes] = torch.zeros(max(1, nbytes // first.element_size()),
                                          dtype=first.dtype, device=first.device)
        reduce_now(state.settings, buffers[nbytes], name)

    step_bytes = state.layout.step_bytes
    flat = bucket_timing.measure_link(reduce, step_bytes)
    if state.settings.process_set.process_set_id != 0 or not hierarchy_choice.open_choice():
        return flat, None
    hierarchy_choice.set_hierarchical(True)
    hierarchical = bucket_timing.measure_link(
        lambda nbytes, name: reduce(nbytes, name + ".hierarchical"), step_bytes)
    hierarchy_choice.set_hierarchical(False)
    return flat, hierarchical


def _replan_keeping_gradients(state: OptimizerState) -> None:
    """A new plan, into whose buckets the step's reduced gradients move."""
    replan(state)
    for bucket in getattr(state.plan.reducer, "buckets", []):
        for p in bucket.params:
            if p.grad is not None:
                bucket.adopt(p, True, state.layout.names[id(p)])
