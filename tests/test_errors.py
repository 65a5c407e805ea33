"""Bad input ends in a clear error on every rank within a bounded time, never a hang."""
import time

import pytest
import torch

from horovod_ext.config import Config, ConfigError
from tests.harness import BACKENDS, run_ranks


def body_mismatches():
    import horovod_ext.torch as hvd
    r = hvd.rank()
    messages = {}
    cases = {
        "shape": lambda: hvd.allreduce(torch.ones(3 + r), name="bad.shape"),
        "dtype": lambda: hvd.allreduce(torch.ones(3, dtype=torch.float32 if r else torch.float64),
                                       name="bad.dtype"),
        "op": lambda: hvd.allreduce(torch.ones(3), op=hvd.Sum if r else hvd.Max, name="bad.op"),
        "root": lambda: hvd.broadcast(torch.ones(3), root_rank=r, name="bad.root"),
        "kind": lambda: (hvd.allreduce(torch.ones(3), name="bad.kind") if r else
                         hvd.allgather(torch.ones(3), name="bad.kind")),
    }
    for key, call in cases.items():
        try:
            call()
            messages[key] = None
        except hvd.HorovodInternalError as exc:
            messages[key] = str(exc)
    # the runtime keeps working after a mismatch
    assert torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), 2.0))
    return messages


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_mismatched_requests_fail_on_every_rank(backend):
    for messages in run_ranks(body_mismatches, 2, backend):
        assert "shape" in messages["shape"] and "bad.shape" in messages["shape"]
        assert "ranks [0]" in messages["shape"] and "ranks [1]" in messages["shape"]
        assert "dtype" in messages["dtype"] and "float64" in messages["dtype"]
        assert "op" in messages["op"] and "'max'" in messages["op"]
        assert "root rank" in messages["root"]
        assert "kind" in messages["kind"] and "allgather" in messages["kind"]


def body_unmatched_at_shutdown():
    import horovod_ext.torch as hvd
    handle = None
    if hvd.rank() == 0:
        handle = hvd.allreduce_async(torch.ones(2), name="lonely")
    hvd.barrier()
    try:
        hvd.shutdown()
        shutdown_error = None
    except hvd.HorovodInternalError as exc:
        shutdown_error = str(exc)
    handle_error = None
    if handle is not None:
        try:
            hvd.synchronize(handle)
        except hvd.HorovodInternalError as exc:
            handle_error = str(exc)
    return shutdown_error, handle_error


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_name_submitted_by_some_ranks_fails_at_shutdown(backend):
    out = run_ranks(body_unmatched_at_shutdown, 3, backend, init=True)
    for rank, (shutdown_error, handle_error) in enumerate(out):
        assert shutdown_error and "lonely" in shutdown_error, (rank, shutdown_error)
        assert "ranks [0]" in shutdown_error and "ranks [1, 2]" in shutdown_error
    assert "lonely" in out[0][1]


def body_peer_lost(how, lane=False):
    """Rank 1 dies (``exit``) or freezes (``stop``) after a first allreduce; rank 0 reports how
    long its next allreduce took to fail, and with what message.  ``lane``: the calls are a
    recurring hvd.allreduce_, which takes the engine's steady-state lane (fast_lane.py)."""
    import os
    import signal
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    steady = torch.ones(1)
    for _ in range(3 if lane else 1):
        hvd.allreduce_(steady, name="warmup")
    if lane:
        assert runtime.engine().stats["fast_lane"] >= 1
    if hvd.rank() == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGSTOP)
    start = time.monotonic()
    try:
        if lane:
            hvd.allreduce_(steady, name="warmup")
        else:
            hvd.allreduce(torch.ones(1), name="after_loss")
        return None
    except hvd.HorovodInternalError as exc:
        return str(exc), time.monotonic() - start


@pytest.mark.timeout(120)
def test_dead_peer_becomes_an_error():
    # Gloo only: under mpirun, Open MPI itself ends the job when a rank exits.
    failure = run_ranks(body_peer_lost, 2, "gloo", args=("exit",), expect_failure=True)
    message, elapsed = failure.results[0]
    assert "rank 1" in message and ("closed" in message or "died" in message), message
    assert elapsed < 15


@pytest.mark.timeout(120)
@pytest.mark.parametrize("lane", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_silent_peer_times_out_with_its_rank_named(backend, lane):
    """The communication timeout alone (heartbeats off; test_faults.py has them find it)."""
    failure = run_ranks(body_peer_lost, 2, backend, args=("stop", lane), expect_failure=True,
                        timeout=40, settle_on=[0],
                        env={"HOROVOD_COMM_TIMEOUT_SECONDS": "4",
                             "HOROVOD_HEARTBEAT_SECONDS": "0"})
    message, elapsed = failure.results[0]
    assert "rank 1" in message and "did not answer within 4 s" in message, message
    assert elapsed < 10


def body_data_call_hangs(prepared):
    """Rank 0 enters an MPI allreduce that rank 1 never joins (straight on the communicator,
    past the engine's negotiation, which would otherwise catch the missing rank first)."""
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    world = runtime.state.comms.world
    if hvd.rank() == 0:
        t = torch.ones(4)
        if prepared:
            world.prepare_allreduce_by_address(t)()
        else:
            world.allreduce(t)
    else:
        time.sleep(60)  # stays alive, outside MPI, until the watchdog ends the job
    return "returned"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prepared", [False, True])
def test_mpi_watchdog_ends_a_data_call_that_outlives_the_timeout(prepared):
    start = time.monotonic()
    failure = run_ranks(body_data_call_hangs, 2, "mpi", args=(prepared,), expect_failure=True,
                        timeout=40, env={"HOROVOD_COMM_TIMEOUT_SECONDS": "2"})
    assert ("MPI allreduce on rank 0 of 2 did not finish within 2 s" in failure.output
            and "aborting the job" in failure.output), failure.output
    assert "returned" not in [r for r in failure.results if r]
    assert time.monotonic() - start < 30


def body_stall():
    import horovod_ext.torch as hvd
    if hvd.rank() == 0:
        handle = hvd.allreduce_async(torch.ones(2), name="slow", op=hvd.Sum)
        aborted = hvd.allreduce_async(torch.ones(2), name="never", op=hvd.Sum)
    else:
        time.sleep(1.6)  # rank 1 is late on purpose: this creates the stall being checked
        handle = hvd.allreduce_async(torch.ones(2), name="slow", op=hvd.Sum)
    result = hvd.synchronize(handle).tolist()
    error = None
    if hvd.rank() == 0:
        try:
            hvd.synchronize(aborted)
        except hvd.HorovodInternalError as exc:
            error = str(exc)
    hvd.barrier()
    from horovod_ext.backends import trace
    # the timeline forgets the aborted request's negotiation (nothing left waiting in it)
    return result, error, sorted(trace.recorder._negotiating)


@pytest.mark.timeout(120)
def test_stall_warning_names_missing_ranks_and_stall_shutdown_aborts(tmp_path):
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "3",
           "HOROVOD_TIMELINE": str(tmp_path / "timeline.json"), "HOROVOD_TIMELINE_ALL_RANKS": "1"}
    results, output = run_ranks(body_stall, 2, "gloo", env=env, with_output=True)
    assert results[0][0] == results[1][0] == [2.0, 2.0]
    assert results[0][2] == results[1][2] == []
    assert "stall: tensor 'slow'" in output and "not by ranks [1]" in output, output
    assert "'never'" in results[0][1] and "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" in results[0][1]


DEADLOCK_S = 1.5


def body_deadlock():
    import horovod_ext.torch as hvd
    r = hvd.rank()
    start = time.monotonic()
    error = None
    try:  # as after an assertion failed on some ranks only: the ranks call different things
        if r == 1:
            hvd.reducescatter(torch.ones(6), name="skipped_by_the_others")
        else:
            hvd.barrier()
    except hvd.HorovodInternalError as exc:
        error = str(exc)
    took = time.monotonic() - start
    try:  # every later call fails too, until hvd.init() starts afresh
        hvd.allreduce(torch.ones(2), name="too_late")
        later = None
    except hvd.HorovodInternalError as exc:
        later = str(exc)
    if r % 2:  # hvd.init() alone starts afresh too (Horovod's tests call it in every test)
        hvd.shutdown()
    hvd.init()
    after = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after").tolist()
    # A slow rank is no deadlock: rank 0 computes (a sleep stands for it) while the others
    # wait twice the deadlock time for it.
    if r == 0:
        time.sleep(2 * DEADLOCK_S)
    slow = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="slow").tolist()
    return error, took, later, after, slow


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_deadlocked_ranks_fail_naming_what_each_submitted(backend):
    """Three ranks, two of them in a barrier and one in a reducescatter: every rank raises
    within the deadlock time (plus cycles), naming both tensors and who submitted them; the
    ranks work again after hvd.init(), and a rank that is merely slow is waited for.  Under
    MPI the job ends instead, with the same reason."""
    env = {"HOROVOD_DEADLOCK_TIME_SECONDS": str(DEADLOCK_S)}
    if backend == "mpi":  # MPI's convention: the job ends, every rank saying why
        start = time.monotonic()
        failure = run_ranks(body_deadlock, 3, backend, env=env, timeout=90,
                            expect_failure=True)
        assert "deadlock: every rank has been blocked" in failure.output, failure.output
        assert "'skipped_by_the_others' submitted by ranks [1]" in failure.output
        assert "aborting the job" in failure.output and time.monotonic() - start < 60
        assert not any(failure.results), failure.results
        return
    results = run_ranks(body_deadlock, 3, backend, env=env, timeout=90)
    for r, (error, took, later, after, slow) in enumerate(results):
        assert error is not None, f"rank {r} did not fail"
        assert "deadlock" in error and "HOROVOD_DEADLOCK_TIME_SECONDS" in error, error
        assert "'skipped_by_the_others' submitted by ranks [1], not by ranks [0, 2]" in error
        assert "'barrier" in error and "submitted by ranks [0, 2], not by ranks [1]" in error
        assert DEADLOCK_S <= took < DEADLOCK_S + 10, (r, took)
        assert later is not None and "deadlock" in later and "hvd.init() again" in later, later
        assert after == [3.0, 3.0] and slow == [3.0], (after, slow)


def test_bad_environment_values_are_named():
    with pytest.raises(ConfigError, match="HOROVOD_FUSION_THRESHOLD"):
        Config.from_env({"HOROVOD_FUSION_THRESHOLD": "lots"})
    with pytest.raises(ConfigError, match="HOROVOD_CYCLE_TIME"):
        Config.from_env({"HOROVOD_CYCLE_TIME": "-1"})
    with pytest.raises(ConfigError, match="HOROVOD_CPU_OPERATIONS"):
        Config.from_env({"HOROVOD_CPU_OPERATIONS": "carrier-pigeon"})
    with pytest.raises(ConfigError, match="HOROVOD_HIERARCHICAL_ALLREDUCE"):
        Config.from_env({"HOROVOD_HIERARCHICAL_ALLREDUCE": "maybe"})
    with pytest.raises(ConfigError, match="HOROVOD_GRADIENT_BUCKET_BYTES"):
        Config.from_env({"HOROVOD_GRADIENT_BUCKET_BYTES": "-5"})
    with pytest.raises(ConfigError, match="HOROVOD_DEADLOCK_TIME_SECONDS"):
        Config.from_env({"HOROVOD_DEADLOCK_TIME_SECONDS": "soon"})
    with pytest.raises(ConfigError, match="HOROVOD_LOG_LEVEL='loud'"):
        Config.from_env({"HOROVOD_LOG_LEVEL": "loud"})
    with pytest.raises(ConfigError, match="HOROVOD_GRADIENT_BUCKET_PLAN='fast'"):
        Config.from_env({"HOROVOD_GRADIENT_BUCKET_PLAN": "fast"})
    c = Config.from_env({"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_CYCLE_TIME": "2.5",
                         "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
                         "HOROVOD_GRADIENT_BUCKET_BYTES": "4096", "HOROVOD_LOG_LEVEL": "Debug",
                         "HOROVOD_GRADIENT_BUCKET_PLAN": "size"})
    assert (c.fusion_threshold, c.cycle_time_ms, c.hierarchical_allreduce,
            c.gradient_bucket_bytes, c.log_level, c.gradient_bucket_plan) == \
        (0, 2.5, True, 4096, "debug", "size")


def body_bad_arguments():
    import horovod_ext.torch as hvd
    errors = {}
    checks = {
        "unknown_op": lambda: hvd.allreduce(torch.ones(2), op="nope"),
        "both_op_and_average": lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum, average=True),
        "complex": lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64)),
        "bool_average": lambda: hvd.allreduce(torch.ones(2, dtype=torch.bool)),
        "root": lambda: hvd.broadcast(torch.ones(2), root_rank=hvd.size()),
        "splits": lambda: hvd.alltoall(torch.ones(5), splits=[1] * hvd.size()),
        "not_tensor": lambda: hvd.allreduce([1, 2]),
        "process_set": lambda: hvd.allreduce(torch.ones(2), process_set=hvd.ProcessSet([0])),
        "reducescatter_adasum": lambda: hvd.reducescatter(torch.ones(4), op=hvd.Adasum),
    }
    for key, call in checks.items():
        try:
            call()
            errors[key] = None
        except (ValueError, TypeError, NotImplementedError) as exc:
            errors[key] = f"{type(exc).__name__}: {exc}"
    # Rank 1 submits "dup" only after rank 0's second submission, so rank 0's first one is
    # certainly still in flight then ("sync" is reduced while "dup" waits).
    if hvd.rank() == 0:
        h = hvd.allreduce_async(torch.ones(2), name="dup")
        try:
            hvd.allreduce_async(torch.ones(2), name="dup")
            errors["duplicate"] = None
        except ValueError as exc:
            errors["duplicate"] = str(exc)
        hvd.allreduce(torch.ones(1), name="sync")
    else:
        hvd.allreduce(torch.ones(1), name="sync")
        h = hvd.allreduce_async(torch.ones(2), name="dup")
    hvd.synchronize(h)
    return errors


@pytest.mark.timeout(120)
def test_bad_arguments_are_rejected_before_anything_is_sent():
    errors = run_ranks(body_bad_arguments, 2, "gloo")[0]
    assert "unknown reduction op 'nope'" in errors["unknown_op"]
    assert "not both" in errors["both_op_and_average"]
    assert "complex64" in errors["complex"]
    assert "bool" in errors["bool_average"]
    assert "root_rank 2" in errors["root"]
    assert "splits" in errors["splits"]
    assert "torch.Tensor" in errors["not_tensor"]
    assert "is not registered" in errors["process_set"]
    assert errors["reducescatter_adasum"].startswith("NotImplementedError")
    assert "already in flight" in errors["duplicate"]


def body_init_only():
    return "never"


@pytest.mark.timeout(60)
def test_init_rejects_bad_environment_in_a_real_process():
    failure = run_ranks(body_init_only, 1, "gloo", env={"HOROVOD_CYCLE_TIME": "fast"},
                        expect_failure=True)
    assert "HOROVOD_CYCLE_TIME='fast' is not valid" in failure.errors[0]
