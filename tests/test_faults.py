"""Failures between ranks end in errors that name the culprit within seconds: a rank whose op
raises, a rank that dies, a rank that stops answering (SIGSTOP).  Real processes over real
Gloo and MPI; each test's timeout bounds it."""
import os
import signal
import time

import pytest
import torch

from tests.harness import BACKENDS, run_ranks

FAIL_FAST_S = 2.0


def body_op_raises_on_some_ranks(failing):
    """Ranks in ``failing`` raise inside a registered op; the others are in the middle of the
    collective (waiting for them in shared memory or in Gloo)."""
    import horovod_ext.torch as hvd
    from horovod_ext.ops import Op

    class FailsOnSomeRanks(Op):
        name = "test_fails_on_some_ranks"

        def allreduce(self, buffer, layers, comms):
            if hvd.rank() in failing:
                raise RuntimeError(f"injected failure on rank {hvd.rank()}")
            return comms.allreduce(buffer)

    op = hvd.register_op(FailsOnSomeRanks())
    assert hvd.allreduce(torch.ones(4), op=hvd.Sum, name="before").tolist() == [hvd.size()] * 4
    start = time.monotonic()
    try:
        hvd.allreduce(torch.ones(1 << 16), op=op, name="doomed")
        error = None
    except hvd.HorovodInternalError as exc:
        error = str(exc)
    took = time.monotonic() - start
    try:   # the engine has stopped on every rank: later calls say so at once
        hvd.allreduce(torch.ones(2), name="later")
        later = None
    except hvd.HorovodInternalError as exc:
        later = str(exc)
    hvd.shutdown()
    hvd.init()   # a fresh start works (the elastic path does this after restoring)
    after = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after").tolist()
    return error, took, later, after


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shared_memory", ["1", "0"])
def test_op_failing_on_two_of_four_ranks_fails_every_rank_at_once(shared_memory):
    """Ranks 2 and 3 raise inside the op while ranks 0 and 1 wait in the collective for them
    (in shared memory, or in Gloo's receive): all four raise within 2 s, the others naming the
    failing rank and its error; all four work again after hvd.init()."""
    env = {"HOROVOD_SHARED_MEMORY": shared_memory, "HOROVOD_COMM_TIMEOUT_SECONDS": "60"}
    results = run_ranks(body_op_raises_on_some_ranks, 4, "gloo", env=env,
                        args=((2, 3),), timeout=100)
    for r, (error, took, later, after) in enumerate(results):
        assert error is not None, f"rank {r} did not fail"
        assert took < FAIL_FAST_S, (r, took, error)
        if r < 2:
            assert "'doomed' failed" in error and "injected failure on rank" in error, error
            assert "rank 2 failed" in error or "rank 3 failed" in error, error
        else:   # its own failure, or, where a peer's news reached it before its op ran
            # (4 ranks on 2 cores under load), the other failing rank's or a closed connection
            assert ("'doomed' failed" in error and ("injected failure on rank 2" in error
                                                    or "injected failure on rank 3" in error)
                    or "closed its connection" in error), error
        assert later is not None and "stopped" in later, later
        assert after == [4.0, 4.0], after


def body_stacks_on_failure(tmp):
    """Rank 1's op raises while rank 0 waits in the collective; every rank's stderr (fd 2) goes
    to a file, whose text is returned."""
    path = os.path.join(tmp, f"stderr.{os.environ['HOROVOD_RANK']}")
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
    try:
        body_op_raises_on_some_ranks((1,))
    finally:
        with open(path) as f:
            return f.read()


@pytest.mark.timeout(120)
def test_a_failure_at_debug_level_shows_where_every_thread_was(tmp_path):
    """HOROVOD_LOG_LEVEL=debug: when the engine stops, every thread's stack goes to stderr, so
    a rank stuck in a transfer when a peer's failure notice arrives shows where (rank 0 here,
    its engine thread in the collective that rank 1 left)."""
    env = {"HOROVOD_LOG_LEVEL": "debug", "HOROVOD_SHARED_MEMORY": "0"}
    texts = run_ranks(body_stacks_on_failure, 2, "gloo", env=env, args=(str(tmp_path),),
                      timeout=100)
    for text in texts:
        assert "injected failure on rank 1" in text, text
        assert "Thread 0x" in text and "Current thread" in text, text
    assert "engine.py" in texts[0] and "_run" in texts[0], texts[0]
    plain = run_ranks(body_stacks_on_failure, 2, "gloo", env={"HOROVOD_SHARED_MEMORY": "0"},
                      args=(str(tmp_path),), timeout=100)
    assert all("injected failure" in t and "Thread 0x" not in t for t in plain), plain


def body_refused_on_every_rank(whole_job):
    """Every rank's op refuses the request alike before moving any data (as the shared-GPU
    check does): what that request and the next one on CPU tensors give."""
    import horovod_ext.torch as hvd
    from horovod_ext.backends.base import RefusedOnEveryRank
    from horovod_ext.ops import Op

    class RefusesEverywhere(Op):
        name = "test_refuses_everywhere"

        def allreduce(self, buffer, layers, comms):
            raise RefusedOnEveryRank("refused alike on every rank", whole_job=whole_job)

    op = hvd.register_op(RefusesEverywhere())
    outcomes = []
    for name, request_op in (("refused", op), ("next", hvd.Sum)):
        try:
            outcomes.append(hvd.allreduce(torch.ones(3), op=request_op, name=name).tolist())
        except hvd.HorovodInternalError as exc:
            outcomes.append(str(exc))
    return outcomes


@pytest.mark.timeout(90)
def test_a_refusal_made_alike_on_every_rank_fails_only_its_request():
    """A refusal every rank of the job derives alike fails that request on every rank and the
    engine goes on; a refusal within a subgroup stops the engine like any error."""
    for refused, following in run_ranks(body_refused_on_every_rank, 2, "gloo", args=(True,)):
        assert "'refused' failed: refused alike on every rank" in refused, refused
        assert following == [2.0, 2.0, 2.0]
    for refused, following in run_ranks(body_refused_on_every_rank, 2, "gloo", args=(False,)):
        assert "'refused' failed: refused alike on every rank" in refused, refused
        assert "stopped" in following, following


def body_rank_stops_mid_collective(heartbeat_s, staged=False):
    """Rank 1 stops (SIGSTOP) inside an op, after rank 0 has entered the collective: rank 0 is
    left waiting in a transfer for it, with a minute's timeout.  ``staged``: the tensor goes
    through host memory in 16 chunks, several in flight (staging.py); rank 0 then also says
    whether the host buffer of the failed call was kept for reuse."""
    import horovod_ext.torch as hvd
    from horovod_ext.backends import staging
    from horovod_ext.ops import Op
    staging.CHUNK_BYTES, staging.STAGE_HOST_TENSORS = 1024, staged

    class StopsOnRankOne(Op):
        name = "test_stops_on_rank_one"

        def allreduce(self, buffer, layers, comms):
            if hvd.rank() == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
            return comms.allreduce(buffer)

    op = hvd.register_op(StopsOnRankOne())
    hvd.allreduce(torch.ones(4), op=hvd.Sum, name="before")
    buffers = staging.stager().buffers
    kept = buffers.idle
    start = time.monotonic()
    try:
        hvd.allreduce(torch.ones(1 << 12), op=op, name="stalled")
        return None
    except hvd.HorovodInternalError as exc:
        return str(exc), time.monotonic() - start, buffers.idle - kept, len(buffers._lent)


@pytest.mark.timeout(60)
def test_a_rank_stopped_during_a_staged_allreduce_is_reported_and_its_buffer_dropped():
    """Staged through host memory over Gloo, chunks in flight: the peer is named within two
    heartbeats as unstaged, and the host buffer the chunks' collectives may still write into
    is never lent again."""
    beat = 1.0
    env = {"HOROVOD_HEARTBEAT_SECONDS": str(beat), "HOROVOD_COMM_TIMEOUT_SECONDS": "60",
           "HOROVOD_SHARED_MEMORY": "0"}
    failure = run_ranks(body_rank_stops_mid_collective, 2, "gloo", args=(beat, True), env=env,
                        expect_failure=True, timeout=50, settle_on=[0])
    message, took, idle, lent = failure.results[0]
    assert "rank 1" in message and "has stopped answering" in message, message
    assert took < 2 * beat + 1.0, took
    assert (idle, lent) == (0, 0), f"{idle} more buffers kept, {lent} lent after the failure"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_stopped_rank_is_reported_within_two_heartbeats(backend):
    """A rank stopped in the middle of a collective is named by its peer within two heartbeats
    (plus a second of scheduling), not at the one-minute timeout.  Under MPI,
    whose calls cannot be left, the job ends with the same reason."""
    beat = 1.0
    env = {"HOROVOD_HEARTBEAT_SECONDS": str(beat), "HOROVOD_COMM_TIMEOUT_SECONDS": "60"}
    start = time.monotonic()
    failure = run_ranks(body_rank_stops_mid_collective, 2, backend, args=(beat,), env=env,
                        expect_failure=True, timeout=60, settle_on=[0])
    if backend == "mpi":
        assert "rank 1" in failure.output and "has stopped answering" in failure.output
        assert "aborting the job" in failure.output, failure.output
        assert time.monotonic() - start < 30
        return
    message, took, _, _ = failure.results[0]
    assert "rank 1" in message and "has stopped answering" in message, message
    assert "HOROVOD_HEARTBEAT_SECONDS=1" in message, message
    assert took < 2 * beat + 1.0, took


def body_slow_rank(beat):
    """Rank 1 computes in pure Python (holding the interpreter) for three heartbeats before
    joining the allreduce."""
    import horovod_ext.torch as hvd
    if hvd.rank() == 1:
        until, x = time.monotonic() + 3 * beat, 0
        while time.monotonic() < until:
            x += 1
    return hvd.allreduce(torch.ones(2), op=hvd.Sum, name="late").tolist()


@pytest.mark.timeout(60)
def test_slow_rank_is_not_reported():
    env = {"HOROVOD_HEARTBEAT_SECONDS": "0.5"}
    for result in run_ranks(body_slow_rank, 2, "gloo", args=(0.5,), env=env):
        assert result == [2.0, 2.0]


@pytest.mark.timeout(120)
def test_op_failing_on_one_rank_ends_an_mpi_job_at_once():
    """Under MPI a failed op ends the job, as a deadlock does (a blocked MPI call cannot be
    left): within seconds, with the failing rank and its error, not at the watchdog's timeout."""
    start = time.monotonic()
    failure = run_ranks(body_op_raises_on_some_ranks, 2, "mpi", args=((1,),),
                        env={"HOROVOD_COMM_TIMEOUT_SECONDS": "60"}, expect_failure=True,
                        timeout=90)
    assert "rank 1 failed: allreduce of 'doomed' failed: injected failure on rank 1" \
        in failure.output, failure.output
    assert "aborting the job" in failure.output
    assert time.monotonic() - start < 30


class _Work:
    """A Gloo work's waiting surface, scripted: ``slices`` waits run out before the call ends;
    ``finish_in_gap`` makes it end between a slice running out and the check that follows, the
    race a long call over a slow link meets at some slice; ``error`` makes the call fail."""

    def __init__(self, slices, finish_in_gap=False, error=None):
        self.slices, self.finish_in_gap, self.error, self.done = slices, finish_in_gap, error, False

    def wait(self, timeout=None):
        if timeout is not None and self.slices > 0:
            self.slices -= 1
            if self.slices == 0 and self.finish_in_gap:
                self.done = True
            raise RuntimeError("Operation timed out!")
        self.done = True
        if self.error:
            raise RuntimeError(self.error)

    def is_completed(self):
        return self.done or (self.slices == 0 and self.error is not None)


@pytest.mark.timeout(10)
def test_a_call_that_outlasts_its_wait_slices_succeeds():
    """Waiting in slices (so that an abort is seen at once) never turns a call that succeeds
    into an error, however its end falls against the slices; a call that fails raises its own
    error, and an abort ends the wait."""
    from horovod_ext.backends.base import CommunicationError
    from horovod_ext.backends.torch_dist import TorchCommunicator
    comm = TorchCommunicator.__new__(TorchCommunicator)   # only its waiting is exercised
    comm._aborted, comm._cuda_group, comm.rank = None, None, 0
    for work in (_Work(0), _Work(3), _Work(3, finish_in_gap=True)):
        comm._wait(work, group=object())
        assert work.done
    with pytest.raises(RuntimeError, match="peer closed"):
        comm._wait(_Work(2, error="peer closed"), group=object())
    comm._aborted = "rank 1 has died"
    with pytest.raises(CommunicationError, match="rank 1 has died"):
        comm._wait(_Work(5), group=object())


def body_long_exchange_under_short_slices(marker):
    """A send/receive of 16 MiB each way while the wait slice is 1 ms (every exchange outlasts
    many slices), then an exchange whose peer never sends, ended by an abort from a thread;
    rank 1 stays up (its exit would end the receive) until rank 0 writes ``marker``."""
    import datetime
    import threading
    import horovod_ext.backends.torch_dist as torch_dist
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    torch_dist._WAIT_SLICE = datetime.timedelta(milliseconds=1)
    world, me = runtime.state.comms.world, hvd.rank()
    peer = 1 - me
    sent = torch.arange(4 << 20, dtype=torch.float32) * (me + 1)
    got = torch.empty_like(sent)
    for _ in range(3):
        world.sendrecv(sent, peer, got, peer)
    exchanged = torch.equal(got, torch.arange(4 << 20, dtype=torch.float32) * (peer + 1))
    hvd.barrier()
    error, took = None, None
    if me == 0:   # rank 1 never sends: only the abort ends this wait
        threading.Timer(0.5, world.abort, ("rank 1 stopped answering",)).start()
        start = time.monotonic()
        try:
            world.sendrecv(None, None, got[:4], peer)
        except Exception as exc:   # noqa: BLE001  (the type is asserted by the test)
            error = f"{type(exc).__name__}: {exc}"
        took = time.monotonic() - start
        with open(marker, "w") as f:
            f.write("done")
    else:
        deadline = time.monotonic() + 30
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
    return exchanged, error, took


@pytest.mark.timeout(60)
def test_send_receive_outlasting_wait_slices_succeeds_and_abort_ends_it(tmp_path):
    """Over Gloo a send/receive cannot be waited for in slices (a wait that runs out closes the
    pair, and the exchange then fails after the group's timeout): three 16 MiB exchanges under
    1 ms slices arrive whole, and an abort still ends a receive whose peer never sends within
    a second of it."""
    results = run_ranks(body_long_exchange_under_short_slices, 2, "gloo",
                        env={"HOROVOD_COMM_TIMEOUT_SECONDS": "30"},
                        args=(str(tmp_path / "rank0_done"),), timeout=50)
    assert [exchanged for exchanged, _, _ in results] == [True, True]
    _, error, took = results[0]
    assert error is not None and "rank 1 stopped answering" in error, error
    assert took < 1.5, f"the abort ended the wait after {took:.1f} s"


def body_closed_connection_waits_for_the_cause():
    """This rank's engine finds a peer's connection closed; the peer's failure notice arrives
    0.1 s later (its heartbeat thread ran late), then, after a restart, never arrives."""
    import threading
    import horovod_ext.torch as hvd
    from horovod_ext.backends.base import PeerClosedError
    from horovod_ext.engine.runtime import state
    closed = PeerClosedError("rank 1 closed its connection: it has died or shut down")
    engine = state.engine
    own = threading.Thread(target=engine.fail, args=(closed,))
    own.start()
    own.join(0.1)    # the engine's own failure goes first; the notice comes after it
    engine.fail_from_peer("rank 1 failed: injected failure on rank 1")
    own.join(10)
    explained = str(engine.failure)
    hvd.shutdown()
    hvd.init()
    start = time.monotonic()
    state.engine.fail(closed)        # no notice follows: the closed socket it is
    return explained, time.monotonic() - start, str(state.engine.failure)


@pytest.mark.timeout(60)
def test_a_closed_connection_reports_the_peers_failure_when_its_notice_follows():
    """A rank that finds a peer's connection closed reports the failure that peer announced,
    when the announcement comes within PEER_NOTICE_GRACE_S, and the closed connection, within
    that bound, when none comes (a peer that shut down)."""
    from horovod_ext.engine.engine import PEER_NOTICE_GRACE_S
    explained, took, unexplained = run_ranks(body_closed_connection_waits_for_the_cause, 1,
                                             "gloo", timeout=50)[0]
    assert "rank 1 failed: injected failure on rank 1" in explained, explained
    assert "closed its connection" in unexplained, unexplained
    assert PEER_NOTICE_GRACE_S * 0.9 <= took < PEER_NOTICE_GRACE_S + FAIL_FAST_S, took
