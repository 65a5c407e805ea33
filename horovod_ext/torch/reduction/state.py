"""DistributedOptimizer's state, one typed object in groups: the settings it was built with, the
parameters and how their gradients are grouped, the progress of the step in progress, and the
plan (which reducer reduces, for which bucket size and world)."""
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Type

import torch

from horovod_ext.engine.process_sets import ProcessSet
from horovod_ext.ops.base import Op
from ..compression import Compressor

EXACTLY_HALVED = (torch.float32, torch.float64, torch.bfloat16)

if TYPE_CHECKING:
    from .base import Reducer
    from .lane import LaneHolder


@dataclass
class Settings:
    """What the optimizer was asked for; fixed once it is built."""
    op: Op
    compression: Type[Compressor]
    process_set: ProcessSet
    backward_passes_per_step: int = 1
    # Horovod's gradient_predivide_factor: an averaging op divides by it before the reduction
    # and multiplies after, so that sums of large gradients stay in range.
    predivide: float = 1.0
    sparse_as_dense: bool = False
    # The user passed ``groups=``: the grouping is theirs, so no gradient buckets regroup it.
    explicit_groups: bool = False
    # A rank outside the process set trains on its own gradients, as in Horovod.
    member: bool = True
    # The op reduces the change of the parameters after a local step (``op.wants_delta``).
    delta: bool = False

    def scales(self):
        """The (prescale, postscale) factors of every request."""
        if self.op.averages and self.predivide != 1.0:
            return 1.0 / self.predivide, self.predivide
        return 1.0, 1.0

    def bucket_divisor(self, dtype: torch.dtype, ranks: Optional[int]) -> int:
        """What a gradient bucket's gradients are divided by as they are copied into it, and
        then summed (``op.sum_of_divided``), or 1: reduced by ``op`` itself.  Only where that
        is the same result bit for bit: a power-of-two count of ranks (an exact division, which
        commutes with the sum's roundings) in a dtype with float32's range (float16 gradients
        would fall into its subnormals), with nothing between the bucket and the wire."""
        if (self.op.sum_of_divided is None or self.predivide != 1.0 or not ranks or ranks < 2
                or ranks & (ranks - 1) or dtype not in EXACTLY_HALVED
                or self.compression.compress is not Compressor.compress):
            return 1
        return ranks


@dataclass
class Layout:
    """The trainable parameters, their request names and their reduction groups."""
    params: List[torch.Tensor]                     # in param_groups order
    names: Dict[int, str]                          # id(param) -> request name
    groups: Dict[int, int] = field(default_factory=dict)      # id(param) -> group index
    group_members: Dict[int, List[torch.Tensor]] = field(default_factory=dict)
    # id(param) -> sparse_dim of the sparse gradients it had: kept for good, since such a
    # parameter leaves the buckets and is reduced as sparse (or zeros of its kind) from then on
    sparse: Dict[int, int] = field(default_factory=dict)
    step_bytes: int = 0                            # what a step reduces, for autotune
    # indices into params in the order backward produced their gradients (rank 0's, learnt
    # at the first step of each generation of the world): gradient buckets follow it; None
    # until then
    arrival_order: Optional[List[int]] = None
    arrival_generation: int = -1
    # when each gradient of arrival_order arrived (seconds after the first), and what a
    # reduction costs (bucket_timing.LinkCost), rank 0's, measured at the steps after the first of
    # each generation: the buckets are cut from them (HOROVOD_GRADIENT_BUCKET_PLAN=timed)
    arrival_times: Optional[List[float]] = None
    arrival_passes: List[Dict[int, float]] = field(default_factory=list)  # until they are learnt
    pass_ends: List[float] = field(default_factory=list)   # when each of those steps ended
    link_cost: Optional[object] = None
    # the flat and the hierarchical way's cost (None where the way is not open:
    # hierarchy_choice); which cut the buckets follow ("timed" or "size"); the trial of
    # candidate plans in progress (plan_trial.PlanTrial), and each candidate's median step time
    # once it has ended, over all and per round (rank 0's)
    both_ways: Optional[tuple] = None
    cut: str = "size"
    trial: Optional[object] = None
    trial_medians: Optional[dict] = None
    trial_rounds: Optional[dict] = None
    trial_visit_steps: Optional[int] = None       # timed steps a visit (rank 0's step time)
    timing_generation: int = -1

    @classmethod
    def build(cls, params: List[torch.Tensor], names: Dict[int, str], groups) -> "Layout":
        """``groups``: None, an int (that many groups) or lists of parameters."""
        mapping = group_map(params, groups)
        members: Dict[int, List[torch.Tensor]] = {}
        for p in params:
            gi = mapping.get(id(p))
            if gi is not None:
                members.setdefault(gi, []).append(p)
        return cls(params=params, names=names, groups=mapping, group_members=members,
                   step_bytes=sum(p.numel() * p.element_size() for p in params))


def group_map(params: List[torch.Tensor], groups) -> Dict[int, int]:
    """id(param) -> group index, from an int (that many groups) or lists of parameters."""
    if groups is None:
        return {}
    if isinstance(groups, int):
        if groups < 1:
            raise ValueError("groups must be a positive int or a list of parameter lists")
        size = -(-len(params) // groups)
        return {id(p): i // size for i, p in enumerate(params)}
    mapping = {}
    for gi, group in enumerate(groups):
        for p in group:
            if id(p) in mapping:
                raise ValueError("a parameter appears in two groups")
            mapping[id(p)] = gi
    return mapping


@dataclass
class Progress:
    """Where the step in progress stands.  Kept here, not in a reducer, so that it outlives a
    new plan (autotune changing the bucket size between steps)."""
    generation: int                # the hvd.init() whose engine the requests in flight belong to
    passes: Dict[int, int] = field(default_factory=dict)   # id(param) -> backward passes so far
    synchronized: bool = False     # synchronize() ran since the last step()
    skip_sync: bool = False        # inside ``with skip_synchronize():``
    local_steps: int = 0           # delta mode: local steps since the last reduction
    starts: Optional[List[torch.Tensor]] = None   # delta mode: parameters at the last reduction


@dataclass
class Plan:
    """The reducer chosen for the world and bucket size it was chosen for."""
    reducer: "Reducer"
    alone: bool                    # one process and an elementwise op: nothing to reduce
    bucket_cap: int                # bytes per gradient bucket, 0: none
    first_bucket_cap: int = 0      # bytes in backward's first bucket, 0: as the others


@dataclass
class OptimizerState:
    """Everything DistributedOptimizer keeps (``optimizer._hvd``)."""
    settings: Settings
    layout: Layout
    progress: Progress
    plan: Optional[Plan] = None
    hooks: list = field(default_factory=list)     # the post-accumulate-grad hook handles
    lane: Optional["LaneHolder"] = None           # its lane, once a bucket reducer made one

    @property
    def reducer(self) -> "Reducer":
        return self.plan.reducer
