"""Lane steps: a step's gradient buckets summed in index order on a lane (backends/lane.py),
started from the hooks that fill them, without the engine's agreement round before each one.

The lane may only run a step that every rank runs, so it is turned on and off at step ends that
every rank sees alike:
- **On.** While it is off, each step of an eligible optimizer carries a ticket: a one-value Sum
  through the engine, submitted with the step's first gradient, to which every rank that trains
  this step adds 1 (a rank that has joined adds 0, as it does to every reduction).  After a step
  whose ticket counted every rank, every rank turns the lane on (making it the first time,
  collectively), so the next step is a lane step on all of them.
- **Staying on.** Each bucket carries one more value on the lane, its vote: 1 from a rank that
  trains on.  After a lane step the count is the same on every rank: every rank's, and the lane
  stays on; fewer, and it is off from the next step on every rank (tickets again).
- **Off.** A rank that calls ``hvd.join()`` with its lane on sums zeros and votes 0 on it once,
  started there and finished when the others run their next lane step (or join too), so that
  the step the others are in completes, with this rank's zeros as the engine's way would give,
  and turns the lane off for everyone.  A rank whose lane sum failed stops its engine, as on a
  lost peer (the next ``hvd.init()`` starts over, lane off).

Eligible, alike on every rank: HOROVOD_BUCKET_LANE=1 (the default; 0 sends every bucket the
engine's way) on every rank, Gloo, the optimizer over the world, the gradients' arrival times
learnt (the trial of plans runs its flat candidates on the lane, so that it weighs them as they
will train; plan_trial.py), no autotune, allreduces that are one call of the world communicator
(not hierarchical, not through shared memory: with every rank on one host the engine's way sums
there, faster than a Gloo group: benchmarks/synthetic.py's MLP at np=2 trains about 15% faster
that way than on the lane), host buckets of floats whose op sums (Sum; Average, divided as the
gradients came where Settings.bucket_divisor allows, after the sum otherwise), no scale factors,
no compression. On the timeline a lane's sum is a GLOO_ALLREDUCE on its bucket's track, with no
negotiation before it.
"""
import weakref
from typing import List, Optional, Set

import torch

from horovod_ext.backends import lane as _lane
from horovod_ext.backends.base import CommunicationError, PeerClosedError, ReduceOp
from horovod_ext.engine import runtime
from horovod_ext.ops import Sum
from ..buckets import Bucket
from ..compression import Compressor
from ..mpi_ops import allreduce_async_, synchronize as wait
from .requests import bucket_name

_ON: "weakref.WeakSet[LaneHolder]" = weakref.WeakSet()   # lanes on now, for hvd.join()


class LaneHolder:
    """An optimizer's lane for the world of one ``hvd.init()`` (``generation``), and whether
    its steps go on it now."""

    def __init__(self):
        self.lane: Optional[_lane.Lane] = None
        self.generation = -1
        self.on = False
        self.buckets: List[Bucket] = []    # the last lane step's, for a farewell
        self.farewell: List = []           # (zeros, their sum) of a farewell in flight
        self.sums = 0                      # buckets summed on a lane, over the optimizer's life

    def current(self, generation: int) -> Optional[_lane.Lane]:
        if self.generation != generation:
            self.lane, self.generation, self.buckets, self.farewell = None, generation, [], []
            self.turn(False)
        return self.lane

    def turn(self, on: bool) -> None:
        self.on = on
        if on:
            _ON.add(self)
        else:
            _ON.discard(self)

    def say_farewell(self) -> None:
        """Zeros and a vote of 0 for every bucket of a lane step, started now (hvd.join())."""
        self.turn(False)
        for bucket in self.buckets:   # in index order, as the reducer keeps them
            zeros = torch.zeros_like(bucket.storage)
            self.farewell.append((zeros, self.lane.start(zeros)))

    def farewell_done(self) -> None:
        """After the join: the farewell's sums are done (the others ran their lane step)."""
        sums, self.farewell = self.farewell, []
        for _, lane_sum in sums:
            try:
                lane_sum.wait()
            except CommunicationError:
                pass   # the others failed or left: nothing of this rank's waits on it


def before_join() -> List[LaneHolder]:
    """hvd.join() on this rank: every lane that is on says farewell; returns their holders."""
    generation = runtime.state.generation
    holders = [h for h in list(_ON) if h.current(generation) is not None and h.on]
    for holder in holders:
        holder.say_farewell()
    return holders


def after_join(holders: List[LaneHolder]) -> None:
    for holder in holders:
        holder.farewell_done()


class LaneSum:
    """A bucket's sum on the lane, kept as the reducer's other reductions are; ``op`` finishes
    it (Average divides) where its gradients were not divided as they came."""

    __slots__ = ("sum", "params", "flat", "op", "ranks")

    def __init__(self, lane_sum: _lane.LaneSum, params: List[torch.Tensor],
                 flat: Optional[torch.Tensor] = None, op=None, ranks: int = 1):
        self.sum = lane_sum
        self.params = params
        self.flat, self.op, self.ranks = flat, op, ranks

    def finish(self, compression) -> None:
        try:
            self.sum.wait()
        except CommunicationError as exc:
            # Most likely a peer's failure: the engine stops as on a lost peer, and says which
            # rank failed once that rank's notice is in.
            raise runtime.engine().fail(PeerClosedError(str(exc))) from exc
        if self.op is not None:
            self.op.finish_(self.flat, self.ranks)

    def settle(self) -> None:
        try:
            self.sum.wait()
        except CommunicationError:
            pass


def eligible(reducer) -> bool:
    """Whether ``reducer``'s steps may go on a lane (alike on every rank)."""
    config = runtime.state.config
    settings, layout, generation = reducer.settings, reducer.layout, reducer.progress.generation
    if (config is None or not config.bucket_lane or not reducer.buckets
            or settings.process_set.process_set_id != 0 or settings.process_set.size() < 2
            or runtime.state.autotuner is not None
            or layout.timing_generation != generation or layout.sparse
            or not _lane.supported(runtime.topology())):
        return False
    return all(_summed(reducer, b) for b in reducer.buckets)


def _summed(reducer, bucket: Bucket) -> bool:
    """Whether ``bucket``'s reduction is a sum on the lane, then the op's finish (Average's
    division, unless its gradients were divided as they came): a host bucket of floats whose
    allreduce the engine's way makes one call of the world communicator (not hierarchical, not
    through shared memory, which on one host beats the lane's Gloo group), under an op that
    sums (Sum, Average), with no scale factors and no compression."""
    settings, flat = reducer.settings, bucket.flat
    if (flat.is_cuda or not flat.dtype.is_floating_point
            or not runtime.engine().comms.reduces_on_world(flat)):
        return False
    return reducer.divisor(bucket) != 1 or (
        settings.op.reduce_op is ReduceOp.SUM and settings.scales() == (1.0, 1.0)
        and settings.compression.compress is Compressor.compress)


class LaneStep:
    """One reducer's lane state within the step in progress."""

    def __init__(self, reducer, holder: LaneHolder):
        self.reducer = reducer
        self.holder = holder
        self.begun = False
        self.on = False                     # this step is a lane step
        self.ticket = None                  # (handle, tensor): this step's, the lane off
        self.ready: Set[int] = set()        # bucket indices full, this lane step
        self.launched: Set[int] = set()
        first = reducer.layout.params[0]
        self.name = f"DistributedOptimizer.lane.{reducer.layout.names[id(first)]}"

    def begin(self) -> None:
        """At the step's first gradient, or in synchronize() if none came (once a step)."""
        if self.begun:
            return
        self.begun = True
        holder = self.holder
        if not eligible(self.reducer):
            holder.current(self.reducer.progress.generation)
            holder.turn(False)
            return
        if holder.current(self.reducer.progress.generation) is not None and holder.on:
            self.on = True
            holder.buckets = list(self.reducer.buckets)
            return
        vote = torch.ones(1)
        self.ticket = (allreduce_async_(vote, name=self.name, op=Sum,
                                        process_set=self.reducer.settings.process_set), vote)

    def takes(self, bucket: Bucket) -> bool:
        """Whether ``bucket`` (full now) goes on the lane (False: the engine's way)."""
        if not self.on:
            return False
        self.ready.add(bucket.index)
        pending = self.reducer.pending
        for b in self.reducer.buckets:   # in index order
            if b.index in self.launched:
                continue
            if b.index not in self.ready:
                break
            self.launched.add(b.index)
            self.holder.sums += 1
            b.vote.fill_(1)
            lane_sum = self.holder.lane.start(b.storage, f"allreduce.{bucket_name(b)}")
            finish = None if self.reducer.divisor(b) != 1 else self.reducer.settings.op
            pending[("bucket", b.index)] = LaneSum(lane_sum, b.params, b.flat, finish,
                                                   self.reducer.settings.process_set.size())
        return True

    def end(self) -> None:
        """After the step's reductions finished: the lane on or off for the next step."""
        generation = self.reducer.progress.generation
        size = self.reducer.settings.process_set.size()
        holder, ticket, on = self.holder, self.ticket, self.on
        self.ticket = None
        self.clear()
        if on:
            holder.turn(self.reducer.buckets[-1].vote.item() == size)
        elif ticket is not None and _count(ticket) == size:
            if holder.current(generation) is None:
                config, faults = runtime.state.config, runtime.state.faults
                holder.lane = _lane.open_lane(
                    runtime.topology(), config.stall_warning_s if config.stall_check else None,
                    faults.liveness if faults is not None else None)
            holder.turn(holder.lane is not None)

    def clear(self) -> None:
        """Forget this step (a ticket in flight is waited for, its errors ignored)."""
        if self.ticket is not None:
            _count(self.ticket)
        self.ticket, self.on, self.begun = None, False, False
        self.ready.clear()
        self.launched.clear()

    def failed(self) -> None:
        """After a failed step: forget it, lane off (the ranks may no longer agree on where
        the lane's steps are; the engine has stopped, or the failure was this rank's own)."""
        self.clear()
        self.holder.turn(False)


def _count(ticket) -> float:
    """A ticket's count, once back (0 where it failed)."""
    try:
        wait(ticket[0])
    except Exception:  # noqa: B902 - the engine failed: its requests say why
        return 0.0
    return ticket[1].item()
