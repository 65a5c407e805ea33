"""Gradient buckets cut from measured times: when each gradient arrives in backward, and what a
reduction costs (a fixed latency plus a cost per byte).

Fixed-size buckets trade two costs that depend on the model: small buckets start reducing early
in backward but pay the per-request latency many times; large ones pay it once but wait for their
last gradient.  Here the trade is made for the model at hand.  The reductions run one after
another, each once its bucket's last gradient is in and the previous one has finished, so the
bucket ending at gradient ``j`` finishes at ``max(end of the previous bucket, t_j) + alpha +
beta * bytes``; ``cut`` chooses the cut points that make the last end earliest, by dynamic
programming over the gradients in arrival order (one vectorised pass per gradient), and then
merges neighbouring buckets wherever that ends no later (on the measured times and on a
backward ``FASTER`` times faster): a bucket the model finds free (its reduction fits in a gap of
backward) still costs a request's work.

The inputs are rank 0's (``LinkCost`` from ``measure_link``'s probe allreduces, the arrival times
from ``TIMING_STEPS`` backward passes), handed to every rank, so that every rank cuts alike.  One
pass is not enough: where ranks share cores a backward pass now and then takes several times
its usual length (a 1 Gbit/s lab run of the CNN measured 121 ms where others took 8-14 ms), and
its gaps then look wide enough to hide any reduction, so the cut merges the buckets that should
overlap backward.  Each gradient's median over the passes ignores one such pass, and the merge
test on a faster backward keeps the overlap where every timed pass was slowed (the first steps
of a job often are).
"""
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np
import torch

PROBE_SMALL = 1024          # bytes: the latency's probe
PROBE_LARGE = 1 << 20       # bytes at most: the per-byte cost's probe
PROBE_REPEATS = 3
TIMING_STEPS = 3            # backward passes whose arrival times are combined
# Merging two buckets must not end later on a backward this many times faster than measured
# either: in a slowed pass the gaps hide any reduction, so a merge looks free there that takes
# the overlap away from the usual pass (the measured gaps are an upper bound, never a lower one).
FASTER = 4.0


class ArrivalClock:
    """Stamps of gradient arrivals, turned into seconds after the first.  Host time for CPU
    models; CUDA events where a parameter lives on a GPU, since a gradient's hook runs when
    backward's kernels are queued, which can be long before they are done."""

    def __init__(self, params: Sequence[torch.Tensor]):
        cuda = [p.device for p in params if p.device.type == "cuda"]
        self.device = cuda[0] if cuda else None

    def stamp(self):
        if self.device is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, stamps: Sequence) -> List[float]:
        if not stamps:
            return []
        if self.device is None:
            return [t - stamps[0] for t in stamps]
        stamps[-1].synchronize()
        return [stamps[0].elapsed_time(e) / 1e3 for e in stamps]


def median_arrivals(passes: Sequence[Dict[int, float]]) -> Tuple[List[int], List[float]]:
    """Each gradient's median arrival over ``passes`` (one dict per backward pass: gradient
    index -> seconds after that pass's first gradient; the last pass holds every gradient), in
    the order of those medians (ties in the last pass's order): indices, then seconds."""
    last = list(passes[-1])
    median = {i: statistics.median(p[i] for p in passes if i in p) for i in last}
    order = sorted(last, key=median.__getitem__)
    return order, [median[i] for i in order]


@dataclass(frozen=True)
class LinkCost:
    """A reduction of ``n`` bytes takes ``alpha + beta * n`` seconds."""
    alpha: float
    beta: float

    def seconds(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes


def fit(small: float, small_s: float, large: float, large_s: float) -> LinkCost:
    """The line through two timed reductions (never a negative cost)."""
    beta = max(0.0, (large_s - small_s) / (large - small)) if large > small else 0.0
    return LinkCost(alpha=max(0.0, small_s - beta * small), beta=beta)


def measure_link(allreduce: Callable[[int, str], None], step_bytes: int) -> LinkCost:
    """Time ``allreduce(nbytes, name)`` (a synchronous reduction of that many bytes, a
    collective) at two sizes, medians of ``PROBE_REPEATS`` after one untimed call each."""
    large = max(PROBE_SMALL * 4, min(PROBE_LARGE, step_bytes))
    medians = []
    for nbytes in (PROBE_SMALL, large):
        name = f"DistributedOptimizer.bucket_probe.{nbytes}"
        allreduce(nbytes, name)
        times = []
        for _ in range(PROBE_REPEATS):
            start = time.perf_counter()
            allreduce(nbytes, name)
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    return fit(PROBE_SMALL, medians[0], large, medians[1])


def finish_time(groups: Sequence[Sequence[int]], arrivals: Sequence[float],
                nbytes: Sequence[int], cost: LinkCost) -> float:
    """When the last of the buckets ``groups`` (runs of indices in arrival order) is reduced."""
    bounds = [0] + list(np.cumsum([len(g) for g in groups]))
    total = np.concatenate([[0], np.cumsum(np.asarray(nbytes, dtype=np.float64))])
    return _last_end(bounds, np.maximum.accumulate(np.asarray(arrivals, dtype=np.float64)),
                     total, cost)


def _last_end(bounds: Sequence[int], t: np.ndarray, total: np.ndarray, cost: LinkCost) -> float:
    """The end of the last reduction of the buckets between ``bounds`` (0, the cuts, n), from
    the arrival times ``t`` (non-decreasing) and the byte prefix sums ``total``."""
    end = -np.inf
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        end = max(end, t[hi - 1]) + cost.alpha + cost.beta * (total[hi] - total[lo])
    return float(end)


def cut(arrivals: Sequence[float], nbytes: Sequence[int], kinds: Sequence[object],
        cost: LinkCost, cap: int) -> List[List[int]]:
    """Buckets (runs of indices 0..n-1, in arrival order) that finish the last reduction
    earliest.  ``arrivals[i]``: when gradient ``i`` is in (non-decreasing); ``kinds[i]``: its
    dtype and device (a bucket holds one kind); a bucket holds at most ``cap`` bytes unless it is
    one gradient.  No two neighbouring buckets of the result merge into one without a later
    finish."""
    n = len(arrivals)
    if n == 0:
        return []
    t = np.maximum.accumulate(np.asarray(arrivals, dtype=np.float64))
    total = np.concatenate([[0], np.cumsum(np.asarray(nbytes, dtype=np.float64))])
    # end[j]: the earliest finish of the first j gradients; start[j]: where its last bucket starts
    end = np.full(n + 1, np.inf)
    end[0] = -np.inf
    start = np.zeros(n + 1, dtype=np.int64)
    run_start = 0                      # where the current run of one kind begins
    for j in range(1, n + 1):
        if j > 1 and kinds[j - 1] != kinds[j - 2]:
            run_start = j - 1
        lo = max(run_start, int(np.searchsorted(total, total[j] - cap, side="left")))
        lo = min(lo, j - 1)            # one gradient alone, whatever its size
        finish = np.maximum(end[lo:j], t[j - 1]) + cost.alpha + cost.beta * (total[j] - total[lo:j])
        pick = int(np.argmin(finish))  # the first of equals: the largest last bucket
        end[j], start[j] = finish[pick], lo + pick
    bounds = [n]
    while bounds[-1] > 0:
        bounds.append(int(start[bounds[-1]]))
    bounds = _merge(bounds[::-1], t, total, kinds, cost, cap)
    return [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]


def _merge(bounds: List[int], t: np.ndarray, total: np.ndarray, kinds: Sequence[object],
           cost: LinkCost, cap: int) -> List[int]:
    """Drop cut points (``bounds``: 0, the cuts, n) while the last reduction ends no later, on
    the measured times and on the same backward ``FASTER`` times faster."""
    timelines = (t, t / FASTER)
    best = [_last_end(bounds, times, total, cost) for times in timelines]
    merged = True
    while merged:
        merged = False
        for k in range(1, len(bounds) - 1):
            lo, hi = bounds[k - 1], bounds[k + 1]
            if total[hi] - total[lo] > cap or kinds[lo] != kinds[hi - 1]:
                continue
            trial = bounds[:k] + bounds[k + 1:]
            ends = [_last_end(trial, times, total, cost) for times in timelines]
            if all(e <= b * (1 + 1e-12) + 1e-15 for e, b in zip(ends, best)):
                bounds, best, merged = trial, [min(e, b) for e, b in zip(ends, best)], True
                break
    return bounds
