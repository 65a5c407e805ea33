"""The reducers that send gradients over the network during backward: one request per gradient,
one per group of gradients (``groups=``, or an op's ``layer_buckets``), or one per gradient
bucket (buckets.py).  Each starts a request as soon as its gradients are in, so communication
overlaps the rest of backward; synchronize() submits what never came and waits."""
from typing import Dict, Hashable, List, Set

import torch

from .. import bucket_timing, buckets as _buckets
from .base import GradientReducer
from .lane import LaneHolder, LaneStep
from .requests import drain, reduce_bucket, reduce_gradients
from .state import OptimizerState


class PerTensorReducer(GradientReducer):
    """Each gradient is its own request (Horovod's way; the engine fuses those that arrive in
    the same cycle)."""

    def __init__(self, state: OptimizerState):
        super().__init__(state)
        self.pending: Dict[Hashable, object] = {}    # key -> DenseReduction or SparseGather

    def on_gradient(self, p: torch.Tensor) -> None:
        if self.count_pass(p):
            self.submit(p)

    def submit(self, p: torch.Tensor) -> None:
        if p.grad is not None and p.grad.is_sparse:
            self.layout.sparse[id(p)] = p.grad.sparse_dim()
        self.route(p)

    def route(self, p: torch.Tensor) -> None:
        """Start (or prepare) the request that reduces ``p``'s gradient."""
        self.reduce(id(p), [p], f"DistributedOptimizer.{self.layout.names[id(p)]}", False)

    def reduce(self, key: Hashable, params: List[torch.Tensor], name: str,
               grouped: bool) -> None:
        if key in self.pending:
            raise RuntimeError(self.again_message(params))
        self.pending[key] = reduce_gradients(self.settings, self.layout, params, name, grouped)

    def started(self) -> Set[int]:
        """ids of the parameters whose gradient is submitted, or waits for its group's."""
        return {id(p) for reduction in self.pending.values() for p in reduction.params}

    def synchronize(self) -> None:
        """Wait for every gradient's reduction; parameters whose gradient never came this step
        are reduced with zeros, so ranks that skipped a layer never leave the others waiting."""
        started = self.started()
        for p in self.layout.params:
            if id(p) not in started:
                self.submit(p)
        try:
            for reduction in self.pending.values():
                reduction.finish(self.settings.compression)
        except BaseException:
            # A failed step (a peer lost, a shutdown) leaves nothing half-done behind: the
            # next backward pass, after hvd.init() again if need be, starts from scratch.
            drain(self.pending.values())
            self.reset()
            raise
        self.reduced()
        self.pending.clear()
        self.progress.passes.clear()
        self.progress.synchronized = True

    def reduced(self) -> None:
        """Every request of the step finished."""

    def reset(self) -> None:
        super().reset()
        self.pending.clear()

    def zero_grad(self, set_to_none: bool) -> bool:
        if self.pending:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize()")
        return False


class GroupReducer(PerTensorReducer):
    """The gradients of a group are one grouped request, started once all are in; parameters
    in no group are reduced one by one."""

    def __init__(self, state: OptimizerState):
        super().__init__(state)
        self.ready: Dict[int, List[torch.Tensor]] = {gi: [] for gi in self.layout.group_members}

    def route(self, p: torch.Tensor) -> None:
        gi = self.layout.groups.get(id(p))
        if gi is None:
            super().route(p)
            return
        ready = self.ready[gi]
        ready.append(p)
        members = self.layout.group_members[gi]
        if len(ready) == len(members):
            self.ready[gi] = []
            self.reduce(f"group.{gi}", members, f"DistributedOptimizer.group.{gi}", True)

    def started(self) -> Set[int]:
        return super().started() | {id(p) for ready in self.ready.values() for p in ready}

    def reset(self) -> None:
        super().reset()
        for ready in self.ready.values():
            ready.clear()


class BucketReducer(GroupReducer):
    """Gradients live in flat buckets (buckets.py), each reduced in place by one request once
    all its gradients are in; a parameter whose gradient comes sparse leaves its bucket for good
    and goes the per-gradient (or group) way."""

    def __init__(self, state: OptimizerState, buckets: List[_buckets.Bucket]):
        super().__init__(state)
        self.buckets = buckets
        self.bucket_of = {id(p): b for b in buckets for p in b.params}
        # id -> when its gradient came (the clock's stamp), in the order backward produced
        # them, until the order and times are learnt (bounded however many steps pass before)
        self.arrived: Dict[int, object] = {}
        self.clock = bucket_timing.ArrivalClock(self.layout.params)
        # bucket index -> Settings.bucket_divisor in this world, from the bucket's first
        # gradient until reset() (a new world)
        self.divisors: Dict[int, int] = {}
        if state.lane is None:
            state.lane = LaneHolder()
        self.lane = LaneStep(self, state.lane)

    def observed_order(self) -> List[int]:
        """Indices into the layout's parameters in the order their gradients arrived, those
        that never came last (in reverse parameter order, as buckets are planned by default)."""
        index = {id(p): i for i, p in enumerate(self.layout.params)}
        order = [index[i] for i in self.arrived if i in index]
        came = set(order)
        return order + [i for i in reversed(range(len(self.layout.params))) if i not in came]

    def observed_pass(self) -> Dict[int, float]:
        """This backward pass's arrivals: index into the layout's parameters -> seconds after
        the first gradient, in ``observed_order``; those that never came at the last one's time."""
        index = {id(p) for p in self.layout.params}
        times = self.clock.seconds([t for i, t in self.arrived.items() if i in index])
        last = times[-1] if times else 0.0
        order = self.observed_order()
        return dict(zip(order, times + [last] * (len(order) - len(times))))

    def route(self, p: torch.Tensor) -> None:
        if not self.lane.begun:
            self.lane.begin()
        if self.layout.timing_generation != self.progress.generation \
                and id(p) not in self.arrived:
            self.arrived[id(p)] = self.clock.stamp()
        if p.grad is not None and p.grad.is_sparse and id(p) in self.bucket_of:
            self.leave(p)
        bucket = self.bucket_of.get(id(p))
        if bucket is None:
            super().route(p)
            return
        if id(p) in bucket.ready:
            raise RuntimeError(self.again_message([p]))
        bucket.adopt(p, self.settings.sparse_as_dense, self.layout.names[id(p)],
                     self.divisor(bucket))
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params):
            self.reduce_bucket(bucket)

    def divisor(self, bucket: _buckets.Bucket) -> int:
        """What ``bucket``'s gradients are divided by as they come (Settings.bucket_divisor),
        in this world."""
        divisor = self.divisors.get(bucket.index)
        if divisor is None:
            divisor = self.divisors[bucket.index] = self.settings.bucket_divisor(
                bucket.flat.dtype, self.settings.process_set.size())
        return divisor

    def synchronize(self) -> None:
        self.lane.begin()   # where no gradient came: before the buckets it decides about
        super().synchronize()

    def reduce_bucket(self, bucket: _buckets.Bucket) -> None:
        if not self.lane.takes(bucket):
            self.reduce_by_engine(bucket)

    def reduce_by_engine(self, bucket: _buckets.Bucket) -> None:
        key = ("bucket", bucket.index)
        if key in self.pending:
            raise RuntimeError(self.again_message(bucket.params))
        divided = self.divisor(bucket) != 1
        self.pending[key] = reduce_bucket(self.settings, bucket, divided)

    def leave(self, p: torch.Tensor) -> None:
        """Take ``p``, whose gradient came sparse, out of its bucket for good: a bucket slice
        can only hold a dense gradient.  Buckets are planned before any gradient exists, so this
        happens at the first sparse one (an nn.Embedding(sparse=True)), at the same point of
        backward on every rank; the bucket keeps its index and name, one slot shorter."""
        old = self.bucket_of.pop(id(p))
        at = self.buckets.index(old)
        rest = [q for q in old.params if q is not p]
        if not rest:
            del self.buckets[at]
            return
        new = _buckets.Bucket(old.index, rest)
        with torch.no_grad():
            for q in rest:
                if id(q) in old.ready:
                    new.views[id(q)].copy_(old.views[id(q)])
                    q.grad = new.views[id(q)]
        # gradients still pointing at the old slices are copied in when adopted
        new.ready = old.ready - {id(p)}
        self.buckets[at] = new
        for q in rest:
            self.bucket_of[id(q)] = new
        if len(new.ready) == len(new.params):
            self.reduce_bucket(new)

    def started(self) -> Set[int]:
        return super().started() | {i for b in self.buckets for i in b.ready}

    def reduced(self) -> None:
        self.lane.end()
        for b in self.buckets:
            b.ready.clear()
            # a .grad replaced after its hook ran was not reduced: the reduced slice wins
            for p in b.params:
                if p.grad is None or p.grad.data_ptr() != b.views[id(p)].data_ptr():
                    p.grad = b.views[id(p)]

    def reset(self) -> None:
        super().reset()
        self.lane.failed()
        self.arrived.clear()
        self.divisors.clear()
        for b in self.buckets:
            b.ready.clear()

    def zero_grad(self, set_to_none: bool) -> bool:
        """With ``set_to_none`` autograd hands each parameter a fresh gradient, which its hook
        copies into the bucket: one copy is cheaper than zeroing the bucket and then
        accumulating into it.  Otherwise the buckets are zeroed in place and stay the
        gradients."""
        super().zero_grad(set_to_none)
        if set_to_none or not self.buckets:
            return False
        for bucket in self.buckets:
            bucket.zero_()
            for p in bucket.params:
                p.grad = bucket.views[id(p)]
        for p in self.layout.params:
            if id(p) not in self.bucket_of and p.grad is not None:
                p.grad.detach_().zero_()
        return True
