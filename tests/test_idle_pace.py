"""How often an idle rank cycles (horovod_ext/engine/idle_pace.py): rarely, whether every rank is
idle or a peer waits for a request this rank has not submitted yet, and requests still run at
once when submitted."""
import time

import pytest
import torch

from tests.harness import run_ranks

IDLE_S = 0.8
LAG_S = 0.5


def body_idle_then_reduce():
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    from horovod_ext.engine.idle_pace import IDLE_CYCLE_S
    engine = runtime.engine()
    hvd.allreduce(torch.ones(3), name="warm")
    before = engine.stats["cycles"]
    time.sleep(IDLE_S)   # the idle period whose rounds are counted
    idle_rounds = engine.stats["cycles"] - before
    out = hvd.allreduce(torch.full((4,), float(hvd.rank())), name="after.idle", op=hvd.Sum)
    return dict(idle_rounds=idle_rounds, interval=IDLE_CYCLE_S, out=out.tolist())


@pytest.mark.timeout(60)
def test_idle_ranks_cycle_rarely_and_a_request_after_a_long_idle_still_runs():
    for out in run_ranks(body_idle_then_reduce, 2, "gloo"):
        # at 10 ms a round the idle period would take about 80 rounds
        assert out["idle_rounds"] <= IDLE_S / out["interval"] + 3, out
        assert out["out"] == [1.0] * 4


def body_peer_lags():
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    from horovod_ext.engine.idle_pace import IDLE_CYCLE_S
    engine = runtime.engine()
    hvd.allreduce(torch.ones(3), name="warm")
    before = engine.stats["cycles"]
    started = time.monotonic()
    if hvd.rank() == 1:
        time.sleep(LAG_S)  # rank 0's request waits for this rank's while this rank is idle
    out = hvd.allreduce(torch.full((2,), float(hvd.rank() + 1)), name="lagged", op=hvd.Sum)
    return dict(rounds=engine.stats["cycles"] - before, waited=time.monotonic() - started,
                interval=IDLE_CYCLE_S, out=out.tolist())


@pytest.mark.timeout(60)
def test_a_peer_waiting_for_a_late_rank_does_not_make_it_cycle_at_the_busy_pace():
    early, late = run_ranks(body_peer_lags, 2, "gloo")
    assert early["out"] == late["out"] == [3.0, 3.0]
    # every round needs both ranks, so both count the same rounds: the idle rank's timer and
    # its own submission, not one per busy cycle of the waiting rank (~100 over 0.5 s)
    assert early["rounds"] <= LAG_S / early["interval"] + 3, early
    # the late rank's submission starts its cycle at once: no extra wait for its idle interval
    assert early["waited"] < LAG_S + early["interval"], early


def body_woken_during_a_caller_cycle():
    import threading

    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    from horovod_ext.engine.idle_pace import IDLE_CYCLE_S
    engine = runtime.engine()
    hvd.allreduce(torch.ones(3), name="warm")
    asleep = threading.Event()   # the background thread waits with no timeout
    wait, locked_cycle = engine._cond.wait, engine._locked_cycle

    def recording_wait(timeout=None):
        if timeout is None and threading.current_thread() is engine._thread:
            asleep.set()
        return wait(timeout)

    def caller_cycle(caller_blocked=False):
        if threading.current_thread() is threading.main_thread():
            # a wake-up (another thread's submission) lands while the caller runs the cycle
            with engine._cond:
                engine._cond.notify()
            asleep.wait(5)
        return locked_cycle(caller_blocked)

    engine._cond.wait, engine._locked_cycle = recording_wait, caller_cycle
    out = hvd.allreduce(torch.ones(2), name="caller.cycle", op=hvd.Sum)
    engine._locked_cycle = locked_cycle
    before, deadline = engine.stats["cycles"], time.monotonic() + 20 * IDLE_CYCLE_S
    while engine.stats["cycles"] < before + 2 and time.monotonic() < deadline:
        time.sleep(IDLE_CYCLE_S / 10)   # polls for idle rounds, bounded by the deadline
    return dict(woken=asleep.is_set(), idle_rounds=engine.stats["cycles"] - before,
                out=out.tolist())


@pytest.mark.timeout(60)
def test_an_idle_rank_keeps_cycling_after_its_thread_was_woken_during_a_caller_cycle():
    # Both ranks idle afterwards (as in steps summed on the bucket lane): a background thread
    # left sleeping with no timeout never cycles again, and a peer's idle round then waits for
    # it until the control plane's timeout.
    for out in run_ranks(body_woken_during_a_caller_cycle, 2, "gloo"):
        assert out["out"] == [2.0, 2.0]
        assert out["woken"], "the test did not put the background thread to sleep"
        assert out["idle_rounds"] >= 2, out
