"""Staging through host memory (horovod_ext/backends/staging.py): the chunks a staged allreduce
cuts, the pinned-buffer cache, and the staged collectives of both communicators against the
unstaged ones over real Gloo and MPI, at 3 ranks and at 2 (a subgroup of the same launch), with
CPU tensors staged as CUDA tensors are (``STAGE_HOST_TENSORS``).  Tests marked ``cuda`` run the
pinned, streamed path on a GPU against the CPU (skipped elsewhere, saying so).

Bitwise where the reduction of an element is exact whatever its order (Min, Max; Sum of small
integers, in any dtype: chunking changes which ring segment an element falls in, hence the order
in which a ring allreduce adds its three values); Average to rounding.
"""

import pytest
import torch

from horovod_ext.backends import staging
from horovod_ext.backends.base import ReduceOp
from tests.harness import BACKENDS, run_ranks

HAS_CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA device: run tools/gpu_check.sh on a GPU machine")
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int16, torch.int32,
          torch.int64, torch.uint8]
# Average: a sum of three values rounded in the dtype, then divided (as tests/test_collectives.py)
CLOSE = {torch.float16: dict(rtol=1e-2, atol=1e-2), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
         torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}


def _bits(t):
    """The bits of a floating tensor (so that -0.0 differs from 0.0 and NaNs compare), else t."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()]) if t.is_floating_point() else t


def _sample(rank, numel, dtype, seed, exact):
    """Rank-specific data: small integers where ``exact`` (sums exact in any dtype and order),
    else normal floats (integers where the dtype has no fractions)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if exact or not dtype.is_floating_point:
        return torch.randint(0 if dtype == torch.uint8 else -3, 4, (numel,), generator=g).to(dtype)
    return torch.randn(numel, generator=g).to(dtype)


# --- chunks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int8, torch.int64, torch.bool])
@pytest.mark.parametrize("chunk_bytes", [None, 1, 6, 48, 1000])
def test_chunks_cover_the_tensor_exactly_in_order(dtype, chunk_bytes):
    per = max(1, (chunk_bytes or staging.CHUNK_BYTES) // dtype.itemsize)
    for numel in (0, 1, 2, 7, per - 1, per, per + 1, 3 * per + 5, 1001):
        bounds = staging.chunk_bounds(numel, dtype, chunk_bytes)
        assert bounds == staging.chunk_bounds(numel, dtype, chunk_bytes)
        assert len(bounds) == -(-numel // per), (numel, per, bounds[:3])
        if numel == 0:
            continue
        b = torch.tensor(bounds, dtype=torch.int64)           # (chunks, 2): start, stop
        assert b[0, 0] == 0 and b[-1, 1] == numel, (numel, bounds[:2], bounds[-2:])
        assert torch.equal(b[1:, 0], b[:-1, 1]), "chunks not consecutive"
        sizes = b[:, 1] - b[:, 0]
        assert bool((sizes[:-1] == per).all()) and 0 < sizes[-1] <= per, (numel, sizes)


def test_chunks_follow_the_byte_size_not_the_element_count():
    half = staging.chunk_bounds(10 ** 7, torch.float16)
    single = staging.chunk_bounds(10 ** 7, torch.float32)
    assert half[0] == (0, staging.CHUNK_BYTES // 2) and single[0] == (0, staging.CHUNK_BYTES // 4)
    assert len(single) == 10 and len(half) == 5


# --- the staged allreduce, one process, a stand-in collective ---------------------------------
def test_staged_allreduce_passes_every_chunk_through_a_host_buffer():
    stager = staging.Stager(staging.HostBuffers(pin=False))
    x = torch.arange(1001, dtype=torch.float32)
    lo, hi = x.data_ptr(), x.data_ptr() + x.numel() * 4
    seen = []

    def collective(chunk):
        seen.append((chunk.data_ptr(), chunk.numel()))
        chunk.mul_(3).add_(1)

    assert stager.allreduce(x, collective, chunk_bytes=40) is x
    assert torch.equal(x, torch.arange(1001, dtype=torch.float32) * 3 + 1)
    assert [n for _, n in seen] == [10] * 100 + [1]
    assert not any(lo <= p < hi for p, _ in seen), "a chunk was the tensor itself, not staged"
    assert stager.buffers.allocations == 1 and stager.buffers.idle == 1
    # non-contiguous: reduced as a contiguous copy and written back
    y = torch.arange(20, dtype=torch.int64).reshape(4, 5).t()
    stager.allreduce(y, lambda c: c.neg_(), chunk_bytes=24)
    assert torch.equal(y, -torch.arange(20).reshape(4, 5).t())
    # nothing to reduce: no collective at all (every rank has the same count)
    stager.allreduce(torch.empty(0), lambda c: seen.append("called"))
    assert "called" not in seen


def test_a_failing_collective_returns_the_buffer_and_raises():
    stager = staging.Stager(staging.HostBuffers(pin=False))
    calls = []

    def failing(chunk):
        calls.append(chunk.numel())
        if len(calls) == 2:
            raise RuntimeError("peer died")

    with pytest.raises(RuntimeError, match="peer died"):
        stager.allreduce(torch.ones(100), failing, chunk_bytes=100)
    assert calls == [25, 25]
    assert stager.buffers.idle == 1, "the buffer of the failed call was not returned"
    x = torch.ones(100)
    stager.allreduce(x, lambda c: c.add_(1), chunk_bytes=100)
    assert torch.equal(x, torch.full((100,), 2.0)) and stager.buffers.allocations == 1


def _stand_in_started(log, fail_at=None):
    """A stand-in collective that starts at its call and reduces (x3 + 1) only when waited for,
    so that a chunk copied back before its wait keeps its old values; ``log`` records
    ("start", k) and ("wait", k); the wait of chunk ``fail_at`` raises."""
    def start(chunk):
        k = sum(1 for e in log if e[0] == "start")
        log.append(("start", k))

        def wait():
            log.append(("wait", k))
            if k == fail_at:
                raise RuntimeError("peer died")
            chunk.mul_(3).add_(1)
        return wait
    return start


@pytest.mark.parametrize("in_flight", [1, 2, 3, 7, 200])
def test_chunks_in_flight_are_waited_for_oldest_first_before_more_start(in_flight):
    stager = staging.Stager(staging.HostBuffers(pin=False))
    x = torch.arange(1001, dtype=torch.float32)
    log = []
    stager.allreduce(x, _stand_in_started(log), chunk_bytes=40, in_flight=in_flight)
    assert torch.equal(x, torch.arange(1001, dtype=torch.float32) * 3 + 1)
    chunks = 101
    assert [k for e, k in log if e == "start"] == list(range(chunks))
    assert [k for e, k in log if e == "wait"] == list(range(chunks)), "not oldest first"
    waited, most = 0, 0
    for event, k in log:
        if event == "start":
            most = max(most, k + 1 - waited)
        else:
            waited += 1
    assert most == min(in_flight, chunks), f"{most} chunks in flight at once, not {in_flight}"
    assert stager.buffers.allocations == 1 and stager.buffers.idle == 1


def test_a_failed_chunk_in_flight_raises_and_its_buffer_is_never_lent_again():
    stager = staging.Stager(staging.HostBuffers(pin=False))
    log = []
    with pytest.raises(RuntimeError, match="peer died"):
        stager.allreduce(torch.ones(100), _stand_in_started(log, fail_at=1), chunk_bytes=40,
                         in_flight=3)
    assert log[-1] == ("wait", 1) and ("start", 3) in log and ("start", 4) not in log, log
    # chunks 2 and 3 may still be written by their collectives: the buffer is dropped
    assert stager.buffers.idle == 0 and stager.buffers._lent == {}
    x = torch.ones(100)
    stager.allreduce(x, _stand_in_started([]), chunk_bytes=40, in_flight=3)
    assert torch.equal(x, torch.full((100,), 4.0)) and stager.buffers.allocations == 2


# --- the buffer cache -----------------------------------------------------------------------
def test_the_cache_reuses_buffers_across_sizes_and_dtypes_of_one_class():
    cache = staging.HostBuffers(pin=False)
    first = cache.take(1000, torch.float32)
    address = first.data_ptr()
    cache.give(first)
    for numel, dtype in [(1000, torch.float32), (1020, torch.float32), (2040, torch.float16),
                         (500, torch.float64), (1, torch.int8)]:
        t = cache.take(numel, dtype)
        assert (t.numel(), t.dtype, t.data_ptr()) == (numel, dtype, address)
        cache.give(t)
    assert cache.allocations == 1 and cache.takes == 6
    assert cache.pin == HAS_CUDA and staging.HostBuffers().pin == HAS_CUDA


def test_buffers_in_use_are_never_lent_twice():
    cache = staging.HostBuffers(pin=False)
    a, b = cache.take(100, torch.float32), cache.take(100, torch.float32)
    assert a.data_ptr() != b.data_ptr() and cache.allocations == 2
    cache.give(a)
    cache.give(b)
    c = cache.take(100, torch.float32)
    assert c.data_ptr() in (a.data_ptr(), b.data_ptr()) and cache.allocations == 2


def test_the_cache_stays_bounded():
    cache = staging.HostBuffers(pin=False, entries=3, max_bytes=1 << 20)
    for shift in range(12, 22):                    # 4 KiB .. 2 MiB, a class each
        for _ in range(3):
            cache.give(cache.take((1 << shift) - 5, torch.uint8))
            assert cache.idle <= 3 and cache.idle_bytes <= 1 << 20, (shift, cache.idle)
    # each class allocated once and reused, except 2 MiB: above max_bytes alone, never kept
    assert cache.allocations == 9 + 3


def test_the_cache_drops_the_least_recently_returned_first():
    cache = staging.HostBuffers(pin=False, entries=3, max_bytes=1 << 30)
    held = [cache.take(1 << shift, torch.uint8) for shift in (12, 13, 14, 15)]
    for t in held:
        cache.give(t)
    assert cache.idle == 3 and cache.allocations == 4
    cache.give(cache.take(1 << 15, torch.uint8))       # kept: returned last
    cache.give(cache.take(1 << 13, torch.uint8))
    assert cache.allocations == 4
    cache.give(cache.take(1 << 12, torch.uint8))       # dropped: returned first
    assert cache.allocations == 5 and cache.idle == 3


# --- staged against unstaged, real ranks ----------------------------------------------------
def _ops_against_unstaged(comm, numels, seed):
    """Failures of the staged allreduce of ``comm`` against the unstaged one and a reference."""
    failures = []
    members = comm.size
    for dtype in DTYPES:
        for numel in numels:
            for op in (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, "average"):
                if op == "average" and not dtype.is_floating_point:
                    continue
                seed += 1
                exact = op == ReduceOp.SUM
                data = [_sample(k, numel, dtype, seed, exact) for k in range(members)]
                outs = []
                for stage in (False, True):
                    staging.STAGE_HOST_TENSORS = stage
                    t = comm.allreduce(data[comm.rank].clone(),
                                       ReduceOp.SUM if op == "average" else op)
                    outs.append(t.div_(members) if op == "average" else t)
                staging.STAGE_HOST_TENSORS = False
                what = f"{op} {dtype} numel {numel} at {members} ranks"
                stack = torch.stack([d.double() for d in data])
                ref = {ReduceOp.SUM: lambda: stack.sum(0), ReduceOp.MIN: lambda: stack.min(0)[0],
                       ReduceOp.MAX: lambda: stack.max(0)[0],
                       "average": lambda: stack.sum(0) / members}[op]().to(dtype)
                if op != "average" and not torch.equal(_bits(outs[1]), _bits(outs[0])):
                    failures.append(f"{what}: staged differs from unstaged")
                if op == "average" and not torch.allclose(outs[1], outs[0], **CLOSE[dtype]):
                    failures.append(f"{what}: staged {outs[1][:4]} unstaged {outs[0][:4]}")
                if not torch.allclose(outs[1].double(), ref.double(),
                                      **CLOSE.get(dtype, dict(rtol=0, atol=0))):
                    failures.append(f"{what}: staged {outs[1][:4]} reference {ref[:4]}")
    return failures


def _others_against_unstaged(comm):
    """Failures of the staged allgather, alltoall, broadcast, reduce_scatter and sendrecv."""
    failures = []
    r, n = comm.rank, comm.size
    for dtype in (torch.float32, torch.float16, torch.int16):
        x = _sample(r, 3 * (r + n), dtype, 77, False).reshape(r + n, 3)
        calls = {
            "allgather": lambda: comm.allgather(x, [k + n for k in range(n)]),
            "alltoall": lambda: comm.alltoall(x[:n], [1] * n, [1] * n),
            "broadcast": lambda: comm.broadcast(x[:2].clone(), root=n - 1),
            "reduce_scatter": lambda: comm.reduce_scatter(
                _sample(0, 2 * n + 1, dtype, 78, True) + r, [2] * (n - 1) + [3]),
            "sendrecv": lambda: _ring(comm, x[:2].clone())}
        for name, call in calls.items():
            outs = []
            for stage in (False, True):
                staging.STAGE_HOST_TENSORS = stage
                outs.append(call())
            staging.STAGE_HOST_TENSORS = False
            if not torch.equal(_bits(outs[1]), _bits(outs[0])):
                failures.append(f"{name} {dtype} at {n} ranks: staged differs from unstaged")
    return failures


def _ring(comm, t):
    recv = torch.empty_like(t)
    comm.sendrecv(t, (comm.rank + 1) % comm.size, recv, (comm.rank - 1) % comm.size)
    return recv


def body_staged_against_unstaged():
    """In every rank: the collectives of the world (3 ranks) and of ranks 0 and 1, staged and
    not, with chunks of 48 bytes (a few elements: many chunks on small tensors).  Returns the
    failures, the chunks each staged allreduce cut (world, pair), the buffers taken from the
    stager by the world's allreduces and the buffers it keeps."""
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    staging.CHUNK_BYTES = 48
    cut = {"world": [], "pair": [], "engine": []}
    phase = "world"

    def recording(numel, dtype, chunk_bytes=None, _bounds=staging.chunk_bounds):
        cut[phase].append(_bounds(numel, dtype, chunk_bytes))
        return cut[phase][-1]
    staging.chunk_bounds = recording
    world = runtime.state.comms.world
    pair = world.subgroup([0, 1]) if world.rank < 2 else None
    takes = staging.stager().buffers.takes
    failures = _ops_against_unstaged(world, (0, 1, 7, 100), 0)
    takes = staging.stager().buffers.takes - takes
    failures += _others_against_unstaged(world)
    if pair is not None:
        phase = "pair"
        failures += _ops_against_unstaged(pair, (1, 13, 100), 1000)
        failures += _others_against_unstaged(pair)
    # through the engine too: fusion buffers of several tensors, Average, staged
    phase = "engine"
    xs = [_sample(hvd.rank(), 50 + k, torch.float32, 5, False) for k in range(3)]
    outs = []
    for stage in (False, True):
        staging.STAGE_HOST_TENSORS = stage
        outs.append(hvd.grouped_allreduce(xs, op=hvd.Average, name=f"g{stage}"))
    staging.STAGE_HOST_TENSORS = False
    failures += [f"grouped Average {k}" for k, (a, b) in enumerate(zip(*outs))
                 if not torch.allclose(a, b, **CLOSE[torch.float32])]
    return failures, cut, takes, staging.stager().buffers.idle


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
def test_staged_collectives_equal_unstaged_at_3_and_2_ranks(backend):
    results = run_ranks(body_staged_against_unstaged, 3, backend, timeout=200)
    for rank, (failures, cut, takes, idle) in enumerate(results):
        assert failures == [], f"rank {rank}: {failures[:10]}"
        assert cut["world"] == results[0][1]["world"], f"rank {rank} cut other chunks"
        # a buffer for each non-empty staged allreduce of the world: 8 dtypes x 3 sizes x
        # (Sum, Min, Max) and 4 float dtypes x 3 sizes x Average
        assert takes == 84, f"rank {rank}: {takes} staged allreduces of the world, not 84"
        assert 1 <= idle <= staging.CACHE_ENTRIES
    assert results[0][1]["pair"] == results[1][1]["pair"] != []
    assert results[2][1]["pair"] == []
    assert all(r[1]["engine"] == results[0][1]["engine"] != [] for r in results)
    assert max(len(b) for b in results[0][1]["world"]) == 100 * 8 // 48 + 1  # float64: 17


def body_staged_in_one_node(shared_memory):
    """Large staged allreduces (Sum, Max) at ranks of one host: whether they reached the world
    communicator, how many host buffers they took, and whether they equal the unstaged ones."""
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    world = runtime.state.comms.world
    calls = []
    plain = world._allreduce
    world._allreduce = lambda t, op: (calls.append(t.numel()), plain(t, op))[1]
    results = []
    takes = staging.stager().buffers.takes
    for k, (dtype, op) in enumerate([(torch.float32, hvd.Sum), (torch.float16, hvd.Max)]):
        x = _sample(hvd.rank(), 300_001, dtype, 40 + k, True)
        outs = []
        for stage in (False, True):
            staging.STAGE_HOST_TENSORS = stage
            outs.append(hvd.allreduce(x, op=op, name=f"big{k}.{stage}"))
        staging.STAGE_HOST_TENSORS = False
        results.append(torch.equal(_bits(outs[0]), _bits(outs[1])))
    return results, calls, staging.stager().buffers.takes - takes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shared_memory", ["1", "0"])
def test_staged_allreduces_in_one_node_go_through_shared_memory(shared_memory):
    """Ranks of one host: a staged allreduce (a GPU buffer without NCCL; here CPU tensors
    staged alike) crosses through the shared-memory group, as a CPU buffer does, not over the
    world communicator; with shared memory off it goes over the communicator, chunk by chunk."""
    env = {"HOROVOD_SHARED_MEMORY": shared_memory}
    for equal, calls, takes in run_ranks(body_staged_in_one_node, 2, "gloo", args=(shared_memory,),
                                         env=env, timeout=100):
        assert equal == [True, True]
        assert takes == 2, f"{takes} host buffers taken for 2 staged allreduces"
        if shared_memory == "1":
            assert calls == [], f"the world communicator carried {calls}"
        else:
            assert len(calls) == 4 and all(n > 0 for n in calls), calls


def body_gloo_chunks_in_flight():
    """A staged Sum over Gloo (no shared memory) in chunks of 4 KiB: the most chunk collectives
    started and not yet waited for at once, the chunks, and whether it equals the unstaged
    Sum."""
    from horovod_ext.backends.torch_dist import TorchCommunicator
    from horovod_ext.engine import runtime
    world = runtime.state.comms.world
    staging.CHUNK_BYTES = 4096
    counts = {"open": 0, "most": 0, "started": 0}
    start, wait = TorchCommunicator._start, TorchCommunicator._wait

    def counting_start(self, *args, **kwargs):
        counts["open"] += 1
        counts["started"] += 1
        counts["most"] = max(counts["most"], counts["open"])
        return start(self, *args, **kwargs)

    def counting_wait(self, work, group):
        wait(self, work, group)
        counts["open"] -= 1
    TorchCommunicator._start, TorchCommunicator._wait = counting_start, counting_wait
    x = _sample(world.rank, 100_000, torch.float32, 3, True)
    staging.STAGE_HOST_TENSORS = True
    staged = world.allreduce(x.clone())
    staging.STAGE_HOST_TENSORS = False
    TorchCommunicator._start, TorchCommunicator._wait = start, wait
    return counts, torch.equal(staged, world.allreduce(x.clone()))


@pytest.mark.timeout(120)
def test_staged_chunks_over_gloo_are_in_flight_together():
    """Over Gloo a staged allreduce keeps GLOO_IN_FLIGHT chunks' collectives started at once
    (one after the other, each chunk pays Gloo's round trips again), and its sum is the
    unstaged one's."""
    results = run_ranks(body_gloo_chunks_in_flight, 2, "gloo",
                        env={"HOROVOD_SHARED_MEMORY": "0"}, timeout=100)
    for rank, (counts, same) in enumerate(results):
        assert same, f"rank {rank}: staged differs from unstaged"
        assert counts["started"] == len(staging.chunk_bounds(100_000, torch.float32, 4096))
        assert counts["most"] == staging.GLOO_IN_FLIGHT and counts["open"] == 0, counts


def body_hierarchical_staged():
    """At 2 nodes x 2 with the hierarchical allreduce and allgather on: the engine's allreduces
    (Sum, Average, Min, Adasum, grouped) and allgather of staged tensors against the same
    unstaged, and whether the hierarchy applied.  Shared memory off, as on GPUs, whose buffers
    it does not take: the node's reduce-scatter and all-gather and the nodes' allreduce are
    then calls of the local and cross communicators, each staged."""
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    staging.CHUNK_BYTES = 64
    r = hvd.rank()
    failures, takes = [], staging.stager().buffers.takes
    for dtype in (torch.float32, torch.float16, torch.int64):
        for numel in (1, 7, 300):
            x = _sample(r, numel, dtype, numel, dtype != torch.float32)
            calls = {"sum": lambda t, tag: hvd.allreduce(t, op=hvd.Sum, name=tag),
                     "min": lambda t, tag: hvd.allreduce(t, op=hvd.Min, name=tag),
                     "allgather": lambda t, tag: hvd.allgather(t[:r + 1], name=tag),
                     "grouped": lambda t, tag: hvd.grouped_allreduce(
                         [t, t[:1]], op=hvd.Sum, name=tag)[1]}
            if dtype.is_floating_point:
                calls["average"] = lambda t, tag: hvd.allreduce(t, op=hvd.Average, name=tag)
                calls["adasum"] = lambda t, tag: hvd.allreduce(t, op=hvd.Adasum, name=tag)
            for name, call in calls.items():
                outs = []
                for stage in (False, True):
                    staging.STAGE_HOST_TENSORS = stage
                    outs.append(call(x.clone(), f"{name}.{dtype}.{numel}.{stage}"))
                staging.STAGE_HOST_TENSORS = False
                if not torch.equal(_bits(outs[0]), _bits(outs[1])):
                    failures.append(f"{name} {dtype} numel {numel}: staged differs")
    return (failures, runtime.state.comms.topology.hierarchy_applies,
            staging.stager().buffers.takes > takes)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
def test_hierarchical_staged_collectives_equal_unstaged(backend):
    env = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_HIERARCHICAL_ALLGATHER": "1",
           "HOROVOD_SHARED_MEMORY": "0"}
    results = run_ranks(body_hierarchical_staged, 4, backend, env=env,
                        hostnames=["a", "a", "b", "b"], timeout=200)
    for rank, (failures, hierarchical, staged) in enumerate(results):
        assert failures == [], f"rank {rank}: {failures[:10]}"
        assert hierarchical and staged, (rank, hierarchical, staged)


# --- on a GPU: the pinned, streamed path --------------------------------------------------------
@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("caller_stream", ["default", "side"])
def test_pinned_streamed_allreduce_on_a_gpu_equals_the_cpu(dtype, caller_stream):
    """A CUDA tensor still being written on the caller's stream when the call starts, reduced
    by a stand-in host collective (x2): the chunks the collective gets are pinned, the result
    equals the CPU's bit for bit, and later work on the caller's stream sees it."""
    stager = staging.Stager()
    stream = torch.cuda.current_stream() if caller_stream == "default" else torch.cuda.Stream()
    for numel in (1, 1000, 3 * 1024 + 17, 5_000_000):
        src = _sample(0, numel, dtype, numel, True)
        pinned = []

        def collective(chunk):
            pinned.append(chunk.is_pinned())
            chunk.mul_(2)

        with torch.cuda.stream(stream):
            x = src.cuda()
            torch.cuda._sleep(20_000_000)      # the caller's stream busy for a while, then ...
            x.add_(1)                          # ... the last write the staging must wait for
            stager.allreduce(x, collective, chunk_bytes=4096 if numel < 10 ** 6 else None)
            after = x * 1                      # queued on the caller's stream after the call
        torch.cuda.synchronize()
        expected = (src + 1) * 2
        assert torch.equal(_bits(x.cpu()), _bits(expected)), (dtype, numel)
        assert torch.equal(_bits(after.cpu()), _bits(expected)), (dtype, numel)
        assert pinned and all(pinned)
        assert len(pinned) == len(staging.chunk_bounds(
            numel, dtype, 4096 if numel < 10 ** 6 else None))
    assert stager.buffers.idle >= 1


def body_cuda_two_ranks(mib):
    """``mib`` MiB on each rank's GPU (ranks may share one): the staged allreduce of the world
    against the CPU tensor's.  Its speed is measured by benchmarks/gpu.py, not here."""
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    world = runtime.state.comms.world
    cpu = _sample(hvd.rank(), mib << 18, torch.float32, 9, False)
    gpu = cpu.cuda()
    takes = staging.stager().buffers.takes
    world.allreduce(gpu)
    staged = staging.stager().buffers.takes > takes    # not so with a CUDA-aware MPI
    world.allreduce(cpu)
    return torch.equal(_bits(gpu.cpu()), _bits(cpu)), staged   # two ranks: a + b in any order


@pytest.mark.cuda
@cuda_only
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks_on_gpus_staged_equal_the_cpu(backend):
    results = run_ranks(body_cuda_two_ranks, 2, backend, args=(64,), timeout=200,
                        env={"HOROVOD_GPU_OPERATIONS": "mpi"})
    for rank, (same, staged) in enumerate(results):
        assert same, f"rank {rank}: the staged allreduce differs from the CPU tensor's"
        if backend == "gloo":
            assert staged, "HOROVOD_GPU_OPERATIONS=mpi over Gloo did not stage"

