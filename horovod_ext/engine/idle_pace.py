"""How often a rank with nothing to do runs a cycle: every ``IDLE_CYCLE_S``.

A peer that wants a round waits for every rank's message, but it rarely needs an idle rank to
cycle: whatever the peer submitted, this rank submits too (collectives are matched by name), and
its own submission starts a cycle at once.  Idle rounds only carry what an idle rank must learn
without submitting anything: a peer's shutdown, rank 0's aborts of stalled requests, the stall
and deadlock reports.  None of those is urgent at this interval, so it is long: in a training
step the ranks reach each gradient at slightly different times, and an idle rank that cycled
every few milliseconds would make its peers run a round per cycle (nothing ready, one rank still
in backward), each taking CPU from the forward and backward passes where ranks outnumber cores
(``benchmarks/ddp_parity.py``: 3 rounds a step for the transformer instead of 6-9 at a 10-80 ms
interval).  A rank with a request pending cycles at the busy cadence (``HOROVOD_CYCLE_TIME``).
"""

IDLE_CYCLE_S = 0.1
