"""plan_trial: the order in which the candidate plans are visited, which step times count, and
which plan stays.  Plain Python, no ranks: the times are made up here."""
import pytest

from horovod_ext.torch.reduction import plan_trial
from horovod_ext.torch.reduction.plan_trial import Candidate, PlanTrial, choose

TIMED, SIZE, HIER = Candidate("timed", False), Candidate("size", False), Candidate("timed", True)


@pytest.mark.timeout(10)
def test_visits_alternate_and_count_only_timed_steps():
    """Two rounds of three candidates, 3 timed steps a visit: the step before a visit's first
    mark (the first under a new plan) is not counted; each step of candidate k lasts k+1 s,
    except the untimed ones, which last 100 s."""
    trial = PlanTrial([TIMED, SIZE, HIER], steps=3, rounds=2)
    now, events, visited = 0.0, [], []
    for _ in range(2 * 3 * (3 + 1)):
        now += 100.0 if not trial.visit_marks else trial.current + 1.0
        visited.append(trial.current)
        events.append(trial.mark(now))
    assert visited == [c for _ in range(2) for c in (0, 1, 2) for _ in range(4)]
    assert events == ([None, None, None, "next"] * 6)[:-1] + ["decide"]
    assert trial.durations == [[1.0] * 6, [2.0] * 6, [3.0] * 6]
    assert trial.medians() == [1.0, 2.0, 3.0]
    assert trial.round_medians() == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]


@pytest.mark.timeout(10)
def test_round_medians_keep_each_visit_apart():
    """Candidate k's steps in round r last 10 r + k + (step index) s: each round's median is
    the median of that visit's own steps."""
    trial = PlanTrial([TIMED, SIZE], steps=3, rounds=2)
    now, step = 0.0, 0
    for _ in range(2 * 2 * (3 + 1)):
        if trial.visit_marks:
            step += 1
            now += 10.0 * (trial.visit // 2) + trial.current + step
        else:
            step, now = 0, now + 100.0
        trial.mark(now)
    assert trial.round_medians() == [[2.0, 12.0], [3.0, 13.0]]


@pytest.mark.timeout(10)
def test_the_size_buckets_stay_unless_another_is_clearly_faster():
    assert choose([TIMED, SIZE, HIER], [0.96, 1.0, 0.97]) == 1      # within 5%: DDP's plan
    assert choose([TIMED, SIZE, HIER], [0.96, 1.0, 0.90]) == 2      # 10% faster: it stays
    assert choose([TIMED, SIZE], [0.94, 1.0]) == 0
    assert choose([TIMED, SIZE], [1.2, 1.0]) == 1
    assert choose([TIMED, HIER], [1.0, 0.97]) == 0                 # no size: the first
    assert choose([TIMED, HIER], [1.0, 0.80]) == 1


@pytest.mark.timeout(10)
def test_a_candidate_must_also_win_every_round():
    """One slow visit of the size buckets (3rd argument: medians per round) makes a candidate
    look 9% faster over all; it was slower in the other round, so DDP's plan stays."""
    assert choose([TIMED, SIZE], [0.99, 1.086], [[0.99, 0.99], [1.2, 0.95]]) == 1
    assert choose([TIMED, SIZE], [0.99, 1.086], [[0.99, 0.99], [1.2, 1.05]]) == 0
    # the fastest over all fails a round, the next one displaces DDP's plan
    assert choose([TIMED, SIZE, HIER], [0.80, 1.0, 0.90],
                  [[0.7, 1.2], [1.0, 1.0], [0.9, 0.9]]) == 2
    assert choose([TIMED, SIZE, HIER], [0.80, 1.0, 0.90],
                  [[0.7, 0.8], [1.0, 1.0], [0.9, 0.9]]) == 0


@pytest.mark.timeout(10)
def test_a_visit_fills_its_time_within_its_bounds():
    """Steps ending 80 ms apart fill VISIT_SECONDS in ceil(1 / 0.08) = 13 steps, 110 ms ones in
    10; steps longer than a third of it take the fewest, 30 ms steps the most; the median length
    counts, so one slow step among them does not shorten the visit; fewer than two ends (no
    length) give the fewest."""
    def ends(*lengths):
        out = [5.0]
        for d in lengths:
            out.append(out[-1] + d)
        return out

    assert (plan_trial.STEPS, plan_trial.MAX_STEPS, plan_trial.VISIT_SECONDS) == (3, 20, 1.0)
    assert plan_trial.visit_steps(ends(0.080, 0.080)) == 13
    assert plan_trial.visit_steps(ends(0.110, 0.110)) == 10
    assert plan_trial.visit_steps(ends(0.5, 0.6)) == 3
    assert plan_trial.visit_steps(ends(0.030, 0.031)) == 20
    assert plan_trial.visit_steps(ends(0.001, 0.001, 0.001)) == 20
    assert plan_trial.visit_steps(ends(0.125, 0.9, 0.125)) == 8
    assert plan_trial.visit_steps([1.0]) == plan_trial.visit_steps([]) == 3
    assert plan_trial.visit_steps(ends(0.0, 0.0)) == 3
