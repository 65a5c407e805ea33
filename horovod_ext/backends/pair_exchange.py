"""A two-rank Gloo sum as one exchange of whole tensors, and when to use it instead of the ring.

Gloo's ring takes two steps for two ranks (a reduce-scatter, then an allgather), and each waits for
the peer's go-ahead: two round trips a call. Sending the whole tensor and adding the peer's costs
the same bytes on the wire in one round trip, but gives up the ring's overlap of its sums with its
transfers. Measured between two lab hosts (benchmarks/pair_exchange.py,
docs/benchmarks/pair_exchange.json), exchange / ring from 1 KiB to 1 MiB: 0.43-1.04 without added
latency, 0.50-0.87 with 20 ms more round trip; from 4 MiB up without added latency the ring was up
to 5% faster, with 20 ms the exchange still was at 16 MiB (164 against 295 ms at 1 Gbit/s, 1430
against 1573 ms at 100 Mbit/s). So a near pair exchanges buffers up to ``NEAR_MAX_BYTES`` and a far
one (a one-value exchange of ``FAR_EXCHANGE_S`` or more: the lab's 20 ms link gives about 21 ms,
loopback and a LAN well under a millisecond) buffers up to ``FAR_MAX_BYTES`` (two ranks of one host
are near without timing): the exchange holds the peer's whole buffer beside this rank's, and a
fusion buffer is at most 64 MiB unless the user raises HOROVOD_FUSION_THRESHOLD; beyond that, one
round trip more is little against the transfer.

A sum can also be started and waited for later (``start``), as a bucket lane's are (lane.py):
the exchange runs while the caller goes on, and the addition is made by the wait.
"""
import datetime
import time

import torch

NEAR_MAX_BYTES = 1 << 20
FAR_MAX_BYTES = 1 << 26
FAR_EXCHANGE_S = 1e-3
PROBES = 5   # one-value exchanges timed to tell a far pair from a near one (the least counts)


class PairExchange:
    """Sums by exchange for ``comm``, a two-rank communicator with ``sendrecv``."""

    def __init__(self, comm):
        self._comm = comm
        self._peer = 1 - comm.rank
        self.probe_s = None       # the one-value exchange time both ranks agreed on, once timed
        self.max_bytes = None     # the largest buffer summed by exchange, once decided

    def on_one_host(self) -> None:
        """Both ranks are on one host (the topology says so, alike on both): near, without
        timing; a probe timed while other processes hold the cores can exceed a millisecond
        even on loopback."""
        self.max_bytes = NEAR_MAX_BYTES

    def decide(self) -> None:
        """Tell a near pair from a far one, unless that is known: collective (both ranks call
        it at the same point)."""
        if self.max_bytes is None:
            self.probe_s = self._probe()
            self.max_bytes = FAR_MAX_BYTES if self.far else NEAR_MAX_BYTES

    @property
    def far(self) -> bool:
        """Whether the probe found a far pair (False before it, and for a pair on one host)."""
        return self.probe_s is not None and self.probe_s >= FAR_EXCHANGE_S

    def takes(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is summed by exchange; the first call decides for the pair (both ranks
        make it at the same sum, as every collective is made in the same order)."""
        self.decide()
        return t.numel() * t.element_size() <= self.max_bytes

    def _probe(self) -> float:
        """The least of a few one-value exchange times, the larger of the two ranks' (so that
        both decide alike)."""
        sent, got = torch.zeros(1, dtype=torch.float64), torch.empty(1, dtype=torch.float64)
        took = []
        for _ in range(PROBES):
            start = time.perf_counter()
            self._comm.sendrecv(sent, self._peer, got, self._peer)
            took.append(time.perf_counter() - start)
        sent.fill_(min(took))
        self._comm.sendrecv(sent, self._peer, got, self._peer)
        return max(sent.item(), got.item())

    def sum(self, t: torch.Tensor):
        """``t`` += the peer's ``t``.  Both ranks compute a + b with the operands swapped, which
        IEEE addition makes the same bits."""
        other = torch.empty_like(t)
        self._comm.sendrecv(t, self._peer, other, self._peer)
        t.add_(other)

    def start(self, t: torch.Tensor) -> "SumInFlight":
        """Start ``t`` += the peer's ``t`` (a contiguous host tensor over Gloo); the sum is
        made when its wait returns, and ``t`` must not change until then."""
        other = torch.empty_like(t)
        return SumInFlight(t, other, self._comm.sendrecv_started(t, other, self._peer))


class SumInFlight:
    """A pair's sum by exchange, started: waited for as a torch.distributed work is (``wait``
    with a timeout raises RuntimeError when the time runs out, ``is_completed``), so that one
    wait loop serves both."""

    __slots__ = ("_t", "_other", "_batch", "_callbacks")

    def __init__(self, t: torch.Tensor, other: torch.Tensor, batch):
        self._t, self._other, self._batch = t, other, batch
        self._callbacks = []

    def is_completed(self) -> bool:
        return self._batch.done.is_set()

    def wait(self, timeout: datetime.timedelta = None) -> bool:
        """Until the exchange has ended, then adds the peer's tensor (once); raises the
        exchange's error, or RuntimeError when ``timeout`` runs out first."""
        if not self._batch.done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError("the exchange has not ended yet")
        if self._batch.errors:
            raise self._batch.errors[0]
        if self._other is not None:
            self._t.add_(self._other)
            self._other = None
            for callback in self._callbacks:
                callback()
        return True

    def add_done_callback(self, callback) -> None:
        """Call ``callback()`` once the sum is made (by the wait that makes it)."""
        self._callbacks.append(callback)
