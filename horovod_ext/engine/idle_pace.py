"""How often a rank with nothing to do runs a cycle.

An idle rank cycles so that a peer with something to negotiate gets its rounds answered.  While
every rank is idle (a round in which no rank sent anything and nothing is pending anywhere: the
same on every rank), the interval doubles, up to ``IDLE_MAX_S``: a training step's forward and
backward passes, where the engine has nothing to do, then cost a round or two instead of one
every ``IDLE_CYCLE_S``, which on a machine with fewer cores than ranks takes CPU from the
passes.  Any other round brings the interval back to ``IDLE_CYCLE_S``.  A rank that submits a
request cycles at once, whatever the interval, and a peer waiting for a request submits it
itself, so the longer interval delays no reduction.
"""

IDLE_CYCLE_S = 0.01
IDLE_MAX_S = 0.08


class IdlePace:
    """The current interval between an idle rank's cycles, in seconds."""

    def __init__(self):
        self.interval = IDLE_CYCLE_S

    def after_round(self, nothing_sent: bool, settled: bool) -> None:
        """After each negotiation round: ``nothing_sent``, whether every rank sent an empty
        message; ``settled``, whether nothing is pending, joined or to abort on any rank."""
        self.interval = (min(2.0 * self.interval, IDLE_MAX_S) if nothing_sent and settled
                         else IDLE_CYCLE_S)
