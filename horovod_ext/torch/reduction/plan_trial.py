"""The gradient buckets' plan, settled by the training steps themselves.

A cost model cannot see everything a plan costs: on ranks that share cores, each extra bucket's
request takes processor time from backward, and the hierarchical way's in-node steps wait for the
slowest local rank's backward. So, with HOROVOD_GRADIENT_BUCKET_PLAN=auto (the default), across
hosts, DistributedOptimizer trains ``STEPS`` timed steps with each candidate: the buckets cut from
the measured times, the buckets by size alone, and, where the way of the world's allreduces is open
(engine.hierarchy_choice), the measured cut with the allreduces hierarchical; the candidate whose
median step took least on rank 0 stays."""
import statistics
from typing import List, NamedTuple, Optional

STEPS = 5          # timed steps per candidate


class Candidate(NamedTuple):
    cut: str               # "timed" (bucket_timing.cut) or "size" (the caps)
    hierarchical: bool     # the world's allreduces hierarchical


class PlanTrial:
    """The times at which step() was called under each candidate, tried in turn."""

    def __init__(self, candidates: List[Candidate], steps: int = STEPS):
        self.candidates = candidates
        self.steps = steps
        self.current = 0
        self.marks: List[List[float]] = [[] for _ in candidates]

    def mark(self, now: float) -> Optional[str]:
        """A step() call at ``now``: "next" when the current candidate has its steps and
        another is to be tried (``current`` is that one now), "decide" when all have, else
        None.  A candidate's first mark starts its first timed step."""
        marks = self.marks[self.current]
        marks.append(now)
        if len(marks) <= self.steps:
            return None
        if self.current + 1 < len(self.candidates):
            self.current += 1
            return "next"
        return "decide"

    def medians(self) -> List[float]:
        """Each candidate's median step time."""
        return [statistics.median(b - a for a, b in zip(m[:-1], m[1:])) for m in self.marks]
