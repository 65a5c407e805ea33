"""The gradient buckets' plan, settled by the training steps themselves.

A cost model cannot see everything a plan costs: on ranks that share cores, each extra bucket's
request takes processor time from backward, and the hierarchical way's in-node steps wait for
the slowest local rank's backward. So, with HOROVOD_GRADIENT_BUCKET_PLAN=auto (the default),
across hosts, DistributedOptimizer trains with each candidate in turn: the buckets cut from the
measured times, the buckets by size alone, and, where the way of the world's allreduces is open
(engine.hierarchy_choice), the measured cut with the allreduces hierarchical. Each is visited
``ROUNDS`` times in the same order (A B C A B C A B C), so that a drift of the step time (warm
caches, another job on the hosts) falls on every candidate alike; a visit is one untimed step
under the new plan (its buffers are new; after a hierarchical visit it turns the bucket lane on
again, lane.py) and timed ones, so that a flat candidate is timed with its buckets on the lane,
as it trains once chosen, and the hierarchical one without. A visit times enough steps to fill
``VISIT_SECONDS`` at the step time measured before the trial (``visit_steps``): from ``STEPS``
for long steps to ``MAX_STEPS`` for short ones. Visits of 3 steps moved by more than the gain of
a better plan: a 30 ms CNN step took 29.7, 29.4 and 24.0 ms in three rounds, and the
hierarchical way, 7-9% faster over all at 1 Gbit/s with 110-130 ms steps, lost one round of
three by 1% in two trials of three. DDP's plan (the size buckets, flat) stays unless another
candidate's median step on rank 0 is shorter by more than ``MARGIN`` and its median was shorter
in every round too: the trial's steps do not separate plans closer than that (step times here
move by 3-5% between rounds), where a candidate won in the trial by less it often lost
afterwards, and a single slow visit of DDP's plan (another job's burst) can make a plan look 9%
faster over all that then runs 10% slower than DDP's."""
import math
import statistics
from typing import List, NamedTuple, Optional

ROUNDS = 3         # visits to each candidate
STEPS = 3          # timed steps a visit, at least
MAX_STEPS = 20     # and at most
VISIT_SECONDS = 1.0   # the timed time a visit fills, within those
MARGIN = 0.05      # how much shorter a median must be to displace DDP's plan


class Candidate(NamedTuple):
    cut: str               # "timed" (bucket_timing.cut) or "size" (the caps)
    hierarchical: bool     # the world's allreduces hierarchical


def visit_steps(step_ends: List[float]) -> int:
    """Timed steps a visit takes where steps ended at the times ``step_ends``: enough to fill
    VISIT_SECONDS at their median length, within STEPS and MAX_STEPS (STEPS where fewer than
    two ends say nothing)."""
    lengths = [b - a for a, b in zip(step_ends, step_ends[1:])]
    step = statistics.median(lengths) if lengths else 0.0
    if not 0 < step < math.inf:
        return STEPS
    return max(STEPS, min(MAX_STEPS, math.ceil(VISIT_SECONDS / step)))


class PlanTrial:
    """The times at which step() was called under each candidate, visited in turn."""

    def __init__(self, candidates: List[Candidate], steps: int = STEPS, rounds: int = ROUNDS):
        self.candidates = candidates
        self.steps = steps
        self.order = [c for _ in range(rounds) for c in range(len(candidates))]
        self.visit = 0
        self.visit_marks: List[float] = []
        self.by_visit: List[List[float]] = [[] for _ in self.order]   # timed steps, per visit

    @property
    def current(self) -> int:
        """The candidate whose plan the steps run with now."""
        return self.order[self.visit]

    def mark(self, now: float) -> Optional[str]:
        """A step() call at ``now``: "next" when the current visit has its steps and another
        follows (``current`` is its candidate now), "decide" after the last, else None.  A
        visit's first mark ends its untimed step and starts its first timed one."""
        if self.visit_marks:
            self.by_visit[self.visit].append(now - self.visit_marks[-1])
        self.visit_marks.append(now)
        if len(self.visit_marks) <= self.steps:
            return None
        self.visit_marks = []
        if self.visit + 1 < len(self.order):
            self.visit += 1
            return "next"
        return "decide"

    def visits_of(self, k: int) -> List[List[float]]:
        """Candidate ``k``'s timed steps, visit by visit (one visit a round)."""
        return [d for d, c in zip(self.by_visit, self.order) if c == k]

    @property
    def durations(self) -> List[List[float]]:
        """Each candidate's timed steps over all its visits."""
        return [sum(self.visits_of(k), []) for k in range(len(self.candidates))]

    def medians(self) -> List[float]:
        """Each candidate's median step time over all its visits."""
        return [statistics.median(d) for d in self.durations]

    def round_medians(self) -> List[List[float]]:
        """Each candidate's median step time in each round, in order."""
        return [[statistics.median(d) for d in self.visits_of(k)]
                for k in range(len(self.candidates))]


def choose(candidates: List[Candidate], medians: List[float],
           rounds: Optional[List[List[float]]] = None) -> int:
    """The candidate to keep, given each one's median step time and, in ``rounds``, its median
    in each round: the fastest of those that beat the incumbent (the size buckets, flat; else
    the first candidate) by more than ``MARGIN`` over all and in every round, else the
    incumbent."""
    incumbent = next((i for i, c in enumerate(candidates) if c == Candidate("size", False)), 0)

    def displaces(k: int) -> bool:
        return medians[k] < medians[incumbent] * (1 - MARGIN) and (
            rounds is None or all(a < b for a, b in zip(rounds[k], rounds[incumbent])))
    return min((k for k in range(len(candidates)) if displaces(k)),
               key=medians.__getitem__, default=incumbent)
