"""How often a rank with nothing to do runs a cycle.

An idle rank cycles so that a peer with something to negotiate gets its rounds answered.  After
a round in which every rank sent the same message and nothing was left pending (all idle, or
all running the same requests: a training step's steady state), the interval doubles, up to
``IDLE_MAX_S``: the forward and backward passes, where the engine has nothing to do, then cost
a round or two instead of one every ``IDLE_CYCLE_S``, which on a machine with fewer cores than
ranks takes CPU from the passes.  Any other round brings the interval back to ``IDLE_CYCLE_S``
on every rank alike (the gathered messages and the pending table are the same everywhere), so a
peer that starts a round alone waits at most ``IDLE_MAX_S`` for the others' next cycle, and
``IDLE_CYCLE_S`` after that.  A rank that submits a request cycles at once, whatever the
interval, and a rank with a request pending cycles at the busy cadence.
"""

IDLE_CYCLE_S = 0.01
IDLE_MAX_S = 0.08


class IdlePace:
    """The current interval between an idle rank's cycles, in seconds."""

    def __init__(self):
        self.interval = IDLE_CYCLE_S

    def after_round(self, agreed: bool, settled: bool) -> None:
        """After each negotiation round: ``agreed``, whether every rank sent the same message;
        ``settled``, whether nothing was pending, joined or to abort on any rank."""
        self.interval = (min(2.0 * self.interval, IDLE_MAX_S) if agreed and settled
                         else IDLE_CYCLE_S)
