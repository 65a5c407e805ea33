"""Flat or hierarchical allreduce, settled by the training steps themselves.

Where the way is left open (engine.hierarchy_choice), DistributedOptimizer trains ``STEPS``
steps with the world's allreduces flat, then ``STEPS`` with them hierarchical, and keeps the way
whose median step took less on rank 0.  Timing the reductions alone does not settle it: on ranks
that share cores, the hierarchical way's in-node steps wait for the slowest local rank's
backward, and what that costs shows only in whole steps.
"""
import statistics
from typing import Dict, List, Optional, Tuple

STEPS = 5          # timed steps per way


class WayTrial:
    """The times at which step() was called under each way (False: flat, True: hierarchical)."""

    def __init__(self, steps: int = STEPS):
        self.steps = steps
        self.hierarchical = False      # the way being timed
        self.marks: Dict[bool, List[float]] = {False: [], True: []}

    def mark(self, now: float) -> Optional[str]:
        """A step() call at ``now``: "hierarchical" when the flat way has its steps (switch and
        time the other), "decide" when both have, else None."""
        marks = self.marks[self.hierarchical]
        marks.append(now)
        if len(marks) <= self.steps:
            return None
        if not self.hierarchical:
            self.hierarchical = True
            return "hierarchical"
        return "decide"

    def medians(self) -> Tuple[float, float]:
        """The median step time of the flat way and of the hierarchical way."""
        return tuple(statistics.median(b - a for a, b in zip(m[:-1], m[1:]))
                     for m in (self.marks[False], self.marks[True]))
