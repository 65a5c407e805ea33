"""How often an idle rank cycles (horovod_ext/engine/idle_pace.py): less and less often while
every rank is idle, back to the short interval at any activity."""
import time

import pytest
import torch

from tests.harness import run_ranks

IDLE_S = 0.8


def test_the_interval_doubles_while_the_ranks_agree_and_resets_at_anything_else():
    from horovod_ext.engine.idle_pace import IDLE_CYCLE_S, IDLE_MAX_S, IdlePace
    pace = IdlePace()
    seen = []
    for _ in range(8):
        pace.after_round(agreed=True, settled=True)
        seen.append(pace.interval)
    assert seen[0] == 2 * IDLE_CYCLE_S and seen[-1] == IDLE_MAX_S
    assert seen == sorted(seen)
    for agreed, settled in ((False, True), (True, False)):
        pace.after_round(agreed=True, settled=True)
        pace.after_round(agreed, settled)
        assert pace.interval == IDLE_CYCLE_S


def body_idle_then_reduce():
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    from horovod_ext.engine.idle_pace import IDLE_MAX_S
    engine = runtime.engine()
    hvd.allreduce(torch.ones(3), name="warm")
    before = engine.stats["cycles"]
    time.sleep(IDLE_S)   # the idle period whose rounds are counted
    idle_rounds = engine.stats["cycles"] - before
    out = hvd.allreduce(torch.full((4,), float(hvd.rank())), name="after.idle", op=hvd.Sum)
    return dict(idle_rounds=idle_rounds, max_s=IDLE_MAX_S, out=out.tolist())


@pytest.mark.timeout(60)
def test_idle_ranks_cycle_rarely_and_a_request_after_a_long_idle_still_runs():
    for out in run_ranks(body_idle_then_reduce, 2, "gloo"):
        # at 10 ms a round the idle period would take about 80 rounds
        assert out["idle_rounds"] <= IDLE_S / out["max_s"] + 6, out
        assert out["out"] == [1.0] * 4
