"""Allreduces left running: the engine starts an in-place elementwise allreduce (a gradient
bucket) over Gloo at three ranks or more and negotiates the next one while it runs, as DDP
keeps its buckets in flight together; results as before, failures within the same bound."""
import os
import select
import time

import pytest
import torch

from tests.harness import run_ranks

# two pretend hosts, allreduces flat: every one is a call of the world communicator
HOSTS = ["a", "a", "b", "b"]
FLAT = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}


def data(rank):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(1 << 18, generator=g), torch.randn(3000, generator=g).double()


def body_buckets_in_flight():
    """Two in-place requests at once, Sum and Average, then a third on the same tensor: each
    gives the reference sum or mean; returns how many transfers were left running."""
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    r, n = hvd.rank(), hvd.size()
    everyone = [data(k) for k in range(n)]
    a, b = data(r)
    ha = hvd.allreduce_async_(a, op=hvd.Sum, name="a")
    hb = hvd.allreduce_async_(b, op=hvd.Average, name="b")
    hvd.synchronize(hb)
    hvd.synchronize(ha)
    torch.testing.assert_close(a, sum(x for x, _ in everyone), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b, sum(y for _, y in everyone) / n, rtol=1e-12, atol=1e-12)
    hvd.allreduce_(a, op=hvd.Sum, name="a.again")
    torch.testing.assert_close(a, n * sum(x for x, _ in everyone), rtol=1e-5, atol=1e-4)
    return runtime.engine().stats["left_running"]


@pytest.mark.timeout(90)
def test_transfers_left_running_give_the_reference_results():
    counts = run_ranks(body_buckets_in_flight, 4, "gloo", env=FLAT, hostnames=HOSTS)
    assert all(c >= 2 for c in counts), counts   # a and b at least, on every rank


def body_two_ranks():
    """Two ranks on two hosts, a near pair: buffers above the pair's exchange limit are summed
    by Gloo's ring, left running (as DDP's buckets); a small one is exchanged, not left
    running.  Returns the transfers left running."""
    import horovod_ext.torch as hvd
    from horovod_ext.backends import pair_exchange
    from horovod_ext.engine import runtime
    pair_exchange.FAR_EXCHANGE_S = float("inf")   # near, however slow the probe on 2 cores
    r = hvd.rank()
    everyone = [[torch.randn(n, generator=torch.Generator().manual_seed(10 * k + i))
                 for i, n in enumerate((1 << 19, 3 << 17, 256))] for k in range(2)]
    mine = [t.clone() for t in everyone[r]]
    handles = [hvd.allreduce_async_(t, op=op, name=f"t{i}")
               for i, (t, op) in enumerate(zip(mine, (hvd.Sum, hvd.Average, hvd.Sum)))]
    for h in handles:
        hvd.synchronize(h)
    a, b = everyone
    for got, want in zip(mine, (a[0] + b[0], (a[1] + b[1]) / 2, a[2] + b[2])):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert runtime.engine().comms.world.pair.max_bytes == pair_exchange.NEAR_MAX_BYTES
    return runtime.engine().stats["left_running"]


@pytest.mark.timeout(90)
def test_two_ranks_leave_the_ring_sums_running():
    counts = run_ranks(body_two_ranks, 2, "gloo", env=FLAT, hostnames=["a", "b"])
    assert counts == [2, 2], counts   # the 2 MiB and 1.5 MiB ones; not the 1 KiB exchange


def body_rank_dies_while_in_flight(fifo):
    """Rank 3 dies where it would start its transfer, after negotiating it, once the three
    others have left theirs running (each writes a byte to ``fifo`` when its transfer has
    started): those transfers wait for it, and fail at once with a message naming it."""
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    engine = runtime.engine()
    world = engine.comms.world
    if hvd.rank() == 3:
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)

        def die(*args):
            got, deadline = b"", time.monotonic() + 30
            while len(got) < 3 and select.select([reader], [], [], deadline - time.monotonic())[0]:
                got += os.read(reader, 3 - len(got))
            os._exit(3)
        world.allreduce_started = die
    else:
        start_transfer = world.allreduce_started

        def start_and_tell(*args):
            started = start_transfer(*args)
            with open(fifo, "wb") as out:
                out.write(b"1" if started else b"0")
            return started
        world.allreduce_started = start_and_tell
    start = time.monotonic()
    try:
        hvd.synchronize(hvd.allreduce_async_(torch.ones(1 << 16), op=hvd.Sum, name="stalled"))
        return None
    except hvd.HorovodInternalError as exc:
        return str(exc), time.monotonic() - start, engine.stats["left_running"]


@pytest.mark.timeout(120)
def test_rank_dying_during_a_transfer_left_running_is_reported(tmp_path):
    env = dict(FLAT, HOROVOD_HEARTBEAT_SECONDS="1", HOROVOD_COMM_TIMEOUT_SECONDS="60")
    fifo = str(tmp_path / "started")
    os.mkfifo(fifo)
    # held open for reading and writing here, so no rank's open of it waits for another's
    keep = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        failure = run_ranks(body_rank_dies_while_in_flight, 4, "gloo", env=env, args=(fifo,),
                            hostnames=HOSTS, expect_failure=True, timeout=60,
                            settle_on=[0, 1, 2])
    finally:
        os.close(keep)
    results = [failure.results[rank] for rank in (0, 1, 2)]
    assert [started for _, _, started in results] == [1, 1, 1], results
    for message, took, _ in results:
        assert "rank 3" in message and "has died" in message, message
        assert took < 10, took                 # not the 60 s transfer timeout
