"""plan_trial: the order in which the candidate plans are visited, which step times count, and
which plan stays.  Plain Python, no ranks: the times are made up here."""
import pytest

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


@pytest.mark.timeout(10)
def test_the_size_buckets_stay_unless_another_is_clearly_faster():
    assert choose([TIMED, SIZE, HIER], [0.96, 1.0, 0.97]) == 1      # within 5%: DDP's plan
    assert choose([TIMED, SIZE, HIER], [0.96, 1.0, 0.90]) == 2      # 10% faster: it stays
    assert choose([TIMED, SIZE], [0.94, 1.0]) == 0
    assert choose([TIMED, SIZE], [1.2, 1.0]) == 1
    assert choose([TIMED, HIER], [1.0, 0.97]) == 0                 # no size: the first
    assert choose([TIMED, HIER], [1.0, 0.80]) == 1
