"""The engine's control plane: an allgather of byte strings, over TCP beside Gloo and over MPI
under MPI, with messages shorter and longer than MPI's fixed first-round slot."""
import pytest

from tests.harness import BACKENDS, run_ranks


def body_control_allgather():
    from horovod_ext.engine import runtime
    from horovod_ext.backends.control import ControlChannel
    world = runtime.topology().world
    if runtime.state.transport == "mpi":
        from horovod_ext.backends.control_mpi import SLOT, MPIControlChannel
        channel = MPIControlChannel.connect(world.comm, 10.0)
    else:
        SLOT = 64
        channel = ControlChannel.connect(world, 10.0)
    r = world.rank
    makers = [lambda k: b"", lambda k: b"abc", lambda k: b"x" * (SLOT - 4),
              lambda k: b"y" * (SLOT - 3), lambda k: bytes(range(256)) * (k + 1),
              lambda k: b"z" * (k * 100), lambda k: b"\0" * (SLOT * 3 if k == 1 else 1)]
    failures = []
    for i, make in enumerate(makers):
        got = channel.allgather(make(r) + bytes([r]), caller_blocked=bool(i % 2))
        expected = [make(k) + bytes([k]) for k in range(world.size)]
        if got != expected:
            failures.append((i, [len(g) for g in got], [len(e) for e in expected]))
    channel.close()
    return failures


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_control_allgather_round_trips_every_length(backend):
    for failures in run_ranks(body_control_allgather, 3, backend):
        assert failures == []
