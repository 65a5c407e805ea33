"""A lane: a Gloo group of its own over the world's ranks, for sums that every rank starts in the
same order without the engine's agreement round before each one.

The engine agrees on every request before it moves a byte, which costs a round trip through rank
0 and two thread hand-offs per request (0.5-2 ms a gradient bucket where two ranks share two
cores, ``benchmarks/bucket_timeline.py``); DDP needs none, because every rank calls all_reduce
on its buckets in the same order.  A lane gives DistributedOptimizer that way for the steps
where it knows every rank takes part (torch/reduction/lane.py decides which): its calls are
matched by their order in the lane's own group, so they never mix with the engine's calls on
the world's group.  The lane is made collectively, belongs to the topology of one ``hvd.init()``
(aborted and closed with it), and is waited for in slices, so that a peer's failure ends a wait
at once (liveness.py aborts it) and a silent peer ends it at ``LANE_TIMEOUT``.

Two ranks that are a far pair (a one-value exchange takes a millisecond or more) sum a bucket of
up to 64 MiB by exchanging whole buffers, as the engine's Gloo sums do (pair_exchange.py), rather
than on Gloo's ring, whose two steps cost two round trips; both give the same bits.  Over the
lab's 100 Mbit/s link with 20 ms more round trip, 2 hosts x 1 rank, that is about one round trip
less a bucket than DDP's ring: the CNN's and the transformer's steps take 0.89x DDP's, the MLP's
0.97x (docs/benchmarks/ddp_parity.md, "Over a far link").  A near pair keeps the ring: there
the lane's buckets are in flight together, and exchanging them gained nothing on loopback or at
1 Gbit/s, while at 100 Mbit/s the transformer's 7-10 buckets of up to 580 KiB took its step
from 0.84-0.89x DDP's to 0.93-0.99x (three runs each way).
"""
import datetime
import logging
import time
from typing import Optional

import torch
import torch.distributed as dist

from . import trace
from .base import CommunicationError
from .liveness import Liveness
from .topology import Topology
from .torch_dist import TorchCommunicator


# How long a lane's sum waits for a peer that is alive: torch's default for Gloo groups, which
# DDP's buckets wait for.  The engine's way waits for a slow peer (rank 0 writing a checkpoint
# while the others start the next step) as long as it takes; a peer that died is noticed by its
# heartbeat at once either way (liveness.py aborts the lane's waits).
LANE_TIMEOUT = datetime.timedelta(minutes=30)
_SLICE = datetime.timedelta(milliseconds=100)   # how soon a wait sees an abort
log = logging.getLogger("horovod_ext")


def supported(topology: Topology) -> bool:
    """Whether the world of ``topology`` can have a lane: torch.distributed's whole world
    (not MPI), two ranks or more."""
    world = topology.world
    return (isinstance(world, TorchCommunicator) and world.size > 1
            and world.global_ranks == list(range(world.size)))


def open_lane(topology: Topology, warn_after_s: Optional[float],
              watch: Optional[Liveness] = None) -> Optional["Lane"]:
    """A new lane over the world of ``topology``, or None where it cannot have one
    (``supported``); a sum that waits ``warn_after_s`` says so (None: never, as the engine's
    stall check with HOROVOD_STALL_CHECK_DISABLE), naming the ranks that ``watch`` (the world's
    heartbeats) heard had not started it.  Collective over the world: every rank calls it at
    the same point."""
    if not supported(topology):
        return None
    ranks = list(range(topology.world.size))
    comm = TorchCommunicator(ranks, dist.new_group(ranks, timeout=LANE_TIMEOUT, backend="gloo"),
                             None, LANE_TIMEOUT)
    comm._owns_groups = True
    topology.attach(comm)
    if comm.pair is not None:
        if len(set(topology.hostnames)) == 1:
            comm.pair.on_one_host()
        comm.pair.decide()   # collective now, rather than inside the first step's backward
    return Lane(comm, warn_after_s, watch)


class Lane:
    """Sums of host tensors in the lane's own Gloo group, in the order they are started."""

    def __init__(self, comm: TorchCommunicator, warn_after_s: Optional[float],
                 watch: Optional[Liveness] = None):
        self.comm = comm
        self.warn_after_s = warn_after_s
        self.watch = watch

    def start(self, tensor: torch.Tensor, track: Optional[str] = None) -> "LaneSum":
        """Start summing ``tensor`` (a contiguous host tensor) over the world, in place; on a
        recording timeline, a GLOO_ALLREDUCE on ``track`` from now until the sum is done."""
        number = self.watch.advance() if self.watch is not None else 0
        pair = self.comm.pair
        by_exchange = pair is not None and pair.far and pair.takes(tensor)
        if by_exchange:
            work = pair.start(tensor)
        else:
            work = dist.all_reduce(tensor, group=self.comm._cpu_group, async_op=True)
        if track is not None and trace.recorder is not None:
            span = trace.transfer(self.comm, "ALLREDUCE", tensor, tracks=(track,))
            span.__enter__()
            if by_exchange:   # the wait that adds the peer's buffer ends it
                work.add_done_callback(lambda: span.__exit__(None, None, None))
            else:   # Gloo's thread ends it when the sum completes, not when the step waits
                work.get_future().add_done_callback(lambda _: span.__exit__(None, None, None))
        return LaneSum(self, work, number)


class LaneSum:
    """One sum in flight on a lane; ``number``: its place among the transfers this rank
    started in the order every rank starts them (Liveness.advance), 0 where none counts."""

    __slots__ = ("_lane", "_work", "_number")

    def __init__(self, lane: Lane, work, number: int = 0):
        self._lane = lane
        self._work = work
        self._number = number

    def wait(self) -> None:
        """Until the sum is done; CommunicationError when it failed or the lane was aborted.
        After the lane's ``warn_after_s`` of waiting it says so once, naming the ranks that
        had not started this sum at their last heartbeat."""
        comm, since = self._lane.comm, time.monotonic()
        warn_after = self._lane.warn_after_s
        warned = warn_after is None
        while True:
            comm._raise_if_aborted()
            try:
                self._work.wait(timeout=_SLICE)
                return
            except RuntimeError:
                # the slice ran out, or the sum failed (a completed work's wait says which)
                if self._work.is_completed():
                    self._raise_failure()
                    return
            if not warned and time.monotonic() - since > warn_after:
                warned = True
                log.warning("rank %d: a gradient bucket's sum on the lane has waited %.0f s "
                            "for %s", comm.rank, warn_after, self._late())

    def _late(self) -> str:
        late = None
        if self._lane.watch is not None and self._number:
            late = self._lane.watch.behind(self._number)
        if not late:
            return ("a rank that has not reached this step (HOROVOD_BUCKET_LANE=0 sends "
                    "buckets the engine's way, whose stall check names it)")
        if len(late) == 1:
            return f"rank {late[0]}, which had not started it by its last heartbeat"
        return (f"ranks {', '.join(str(k) for k in late)}, which had not started it by their "
                f"last heartbeats")

    def _raise_failure(self) -> None:
        try:
            self._work.wait()
        except RuntimeError as failure:
            comm = self._lane.comm
            raise CommunicationError(f"a gradient bucket's sum on the lane failed on rank "
                                     f"{comm.rank} of {comm.size}: {failure}") from failure
