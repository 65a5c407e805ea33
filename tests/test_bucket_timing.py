"""Gradient buckets cut from measured times (horovod_ext/torch/bucket_timing.py): the dynamic
programme against every possible cut, by brute force, on random arrivals, sizes and costs; the
arrival times of several backward passes combined; a slowed pass's cut."""
import itertools
import random

import pytest

from horovod_ext.torch import bucket_timing as bt


def every_plan(n):
    """Every way to cut 0..n-1 into runs."""
    for mask in itertools.product([False, True], repeat=n - 1):
        groups, current = [], [0]
        for i, cut_here in enumerate(mask, start=1):
            if cut_here:
                groups.append(current)
                current = []
            current.append(i)
        groups.append(current)
        yield groups


def allowed(groups, nbytes, kinds, cap):
    return all((len(g) == 1 or sum(nbytes[i] for i in g) <= cap)
               and len({kinds[i] for i in g}) == 1 for g in groups)


def finish(groups, arrivals, nbytes, alpha, beta):
    """The plain serial model, written again here: each reduction starts when its last
    gradient is in and the previous reduction is done."""
    end = float("-inf")
    for g in groups:
        end = max(end, max(arrivals[i] for i in g)) + alpha + beta * sum(nbytes[i] for i in g)
    return end


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(40))
def test_cut_is_the_earliest_plan(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    arrivals = sorted(rng.uniform(0, 0.1) for _ in range(n))
    nbytes = [rng.choice([4, 400, 4000, 40000, 400000]) for _ in range(n)]
    kinds = sorted(rng.choice("ab") for _ in range(n)) if seed % 3 == 0 else ["a"] * n
    alpha = rng.choice([0.0, 1e-5, 1e-3, 2e-2])
    beta = rng.choice([0.0, 1e-9, 1e-8, 1e-7])
    cap = rng.choice([1000, 50000, 10 ** 9])
    cost = bt.LinkCost(alpha, beta)
    got = bt.cut(arrivals, nbytes, kinds, cost, cap)
    assert [i for g in got for i in g] == list(range(n))
    assert allowed(got, nbytes, kinds, cap)
    plans = [g for g in every_plan(n) if allowed(g, nbytes, kinds, cap)]
    best = min(finish(g, arrivals, nbytes, alpha, beta) for g in plans)
    assert finish(got, arrivals, nbytes, alpha, beta) == pytest.approx(best, rel=1e-9, abs=1e-12)
    faster = [a / bt.FASTER for a in arrivals]
    for k in range(len(got) - 1):   # no neighbours merge without a later finish
        merged = got[:k] + [got[k] + got[k + 1]] + got[k + 2:]
        if allowed(merged, nbytes, kinds, cap):    # on the measured or on a faster backward
            assert finish(merged, arrivals, nbytes, alpha, beta) > best * (1 + 1e-12) or \
                finish(merged, faster, nbytes, alpha, beta) > \
                finish(got, faster, nbytes, alpha, beta) * (1 + 1e-12)
    assert bt.finish_time(got, arrivals, nbytes, cost) == pytest.approx(
        finish(got, arrivals, nbytes, alpha, beta), rel=1e-12)


@pytest.mark.timeout(60)
def test_cut_follows_the_costs():
    """All gradients at once, or a latency larger than backward: one bucket.  Reductions that
    fit in backward's gaps: all but the last gradient in one bucket (more requests gain
    nothing).  A link on which each gradient takes most of a gap: neither extreme."""
    n = 6
    one = [list(range(n))]
    nbytes = [1000] * n
    assert bt.cut([0.0] * n, nbytes, ["a"] * n, bt.LinkCost(1e-4, 1e-9), 10 ** 9) == one
    spread = [0.01 * i for i in range(n)]
    assert bt.cut(spread, nbytes, ["a"] * n, bt.LinkCost(1.0, 1e-9), 10 ** 9) == one
    assert bt.cut(spread, nbytes, ["a"] * n, bt.LinkCost(1e-4, 1e-9), 10 ** 9) == \
        [list(range(n - 1)), [n - 1]]
    slow = bt.LinkCost(5e-4, 1.2e-5)
    got = bt.cut(spread, nbytes, ["a"] * n, slow, 10 ** 9)
    each = [[i] for i in range(n)]
    assert 2 < len(got) < n
    assert bt.finish_time(got, spread, nbytes, slow) < min(
        bt.finish_time(plan, spread, nbytes, slow) for plan in (one, each))


@pytest.mark.timeout(60)
def test_fit_is_the_line_through_both_probes():
    cost = bt.fit(1000, 0.002, 1_001_000, 0.012)
    assert cost.beta == pytest.approx(1e-8)
    assert cost.alpha == pytest.approx(0.002 - 1e-5)
    assert bt.fit(1000, 0.002, 2000, 0.001).beta == 0.0     # noise: never a negative cost
    calls = []
    got = bt.measure_link(lambda nbytes, name: calls.append((nbytes, name)), 64 << 20)
    assert [c[0] for c in calls] == [bt.PROBE_SMALL] * 4 + [bt.PROBE_LARGE] * 4
    assert got.alpha >= 0 and got.beta >= 0


@pytest.mark.timeout(60)
def test_host_clock_counts_from_the_first_arrival():
    import torch
    clock = bt.ArrivalClock([torch.zeros(3)])
    assert clock.device is None and clock.seconds([]) == []
    stamps = [clock.stamp() for _ in range(3)]
    seconds = clock.seconds(stamps)
    assert seconds[0] == 0 and seconds == sorted(seconds)
    assert seconds[2] == pytest.approx(stamps[2] - stamps[0])


@pytest.mark.timeout(60)
def test_each_gradient_takes_its_median_over_the_passes():
    """A pass ten times as long as the others changes nothing; the order follows the medians
    (gradients 1 and 2 swap places between passes)."""
    usual = {3: 0.0, 2: 0.001, 1: 0.004, 0: 0.007}
    slowed = {3: 0.0, 2: 0.012, 1: 0.085, 0: 0.121}
    swapped = {3: 0.0, 1: 0.0035, 2: 0.0045, 0: 0.006}
    passes = [usual, slowed, swapped]
    order, times = bt.median_arrivals(passes)
    medians = {i: sorted(p[i] for p in passes)[1] for i in usual}   # the middle of three
    assert order == sorted(usual, key=medians.get) == [3, 1, 2, 0]
    assert times == [medians[i] for i in order]
    assert bt.median_arrivals([usual]) == ([3, 2, 1, 0], [0.0, 0.001, 0.004, 0.007])


@pytest.mark.timeout(60)
def test_a_slowed_backward_keeps_the_early_bucket_apart():
    """The CNN of examples/fashion_mnist.py at 1 Gbit/s, arrival times of a pass slowed about
    ten times: its gaps hide every reduction but the last, so the measured times alone would
    merge the first layer's 0.8 MB with the convolutions'; the usual, faster backward needs
    them apart, to reduce fc1's gradients during the convolutions' backward."""
    arrivals = [0.0, 0.00007, 0.0128, 0.0129, 0.0827, 0.0828, 0.1170, 0.1171]
    nbytes = [40, 5120, 512, 802816, 51200, 128, 1600, 64]
    cost = bt.LinkCost(0.00087, 1.25e-8)
    got = bt.cut(arrivals, nbytes, ["a"] * 8, cost, 25 << 20)
    assert any(g[-1] == 3 for g in got), got            # a bucket ends with fc1's weight
    faster = [a / bt.FASTER for a in arrivals]
    assert bt.finish_time(got, faster, nbytes, cost) < bt.finish_time(
        [list(range(6)), [6, 7]], faster, nbytes, cost)
    assert bt.finish_time(got, arrivals, nbytes, cost) == pytest.approx(
        bt.finish_time([list(range(6)), [6, 7]], arrivals, nbytes, cost), rel=1e-9)
