"""The in-node steps through shared memory (backends/shm.py): results against a reference, the
hierarchical allreduce over it, a local rank that dies, and nothing left in /dev/shm."""
import glob
import os
import signal
import subprocess
import time

import pytest
import torch

from tests.harness import BACKENDS, run_ranks

SEGMENTS = "/dev/shm/horovod_ext-*"


def sample(rank, n, dtype, seed):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    return torch.randint(-3, 4, (n,), generator=g).to(dtype)


def body_in_node_reductions():
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    from horovod_ext.backends.base import ReduceOp
    comms = runtime.state.comms
    group = comms.topology.in_node(torch.zeros(1))
    assert group is not None, "shared memory not used"
    local = comms.topology.local
    members = [r for r in range(hvd.size()) if comms.topology.node_of[r]
               == comms.topology.node_of[hvd.rank()]]
    seed = 0
    # sizes: fewer elements than ranks, odd, growing past the segment (it is re-made)
    for n in (1, 3, 1001, 300_000, 1_500_000):
        for dtype in (torch.float32, torch.float64, torch.int64, torch.float16, torch.bool):
            for op in (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
                seed += 1
                mine = sample(hvd.rank(), n, dtype, seed)
                stack = torch.stack([sample(r, n, dtype, seed).double() for r in members])
                want = {ReduceOp.SUM: stack.sum(0), ReduceOp.MIN: stack.min(0).values,
                        ReduceOp.MAX: stack.max(0).values, ReduceOp.PRODUCT: stack.prod(0)}[op]
                if dtype == torch.bool:
                    want = (want != 0) if op in (ReduceOp.SUM, ReduceOp.MAX) else want.bool()
                got = group.allreduce(mine.clone(), op)
                assert torch.equal(got, want.to(dtype)), (n, dtype, op)
                if n > 1000 and op is ReduceOp.SUM:   # many chunks, ends mid-shard
                    got = group.allreduce(mine.clone(), op, chunk_elements=777)
                    assert torch.equal(got, want.to(dtype)), (n, dtype, op, "chunked")
    assert local.size == len(members)
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_in_node_allreduce_matches_reference(backend):
    before = set(glob.glob(SEGMENTS))
    assert all(run_ranks(body_in_node_reductions, 3, backend, timeout=90))
    assert set(glob.glob(SEGMENTS)) <= before, "a segment was left in /dev/shm"


def body_hierarchical(expect_shared: bool):
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    r, n = hvd.rank(), hvd.size()
    for step, numel in enumerate((10, 4097, 2_000_000)):
        x = sample(r, numel, torch.float64, step)
        got = hvd.allreduce(x, op=hvd.Sum, name=f"h{step}")
        want = sum(sample(k, numel, torch.float64, step) for k in range(n))
        assert torch.equal(got, want), step
        got = hvd.allreduce(sample(r, numel, torch.int32, step), op=hvd.Max, name=f"m{step}")
        want = torch.stack([sample(k, numel, torch.int32, step) for k in range(n)]).max(0).values
        assert torch.equal(got, want), step
    # several tensors fused into one buffer, packed straight into the shared slot
    grouped = [sample(r, k * 1000 + 7, torch.float32, 50 + k) for k in range(6)]
    fused_before = runtime.state.engine.stats["fused_buffers"]
    got = hvd.grouped_allreduce(grouped, op=hvd.Average, name="g")
    for k, g in enumerate(got):
        want = sum(sample(q, k * 1000 + 7, torch.float32, 50 + k) for q in range(n)) / n
        assert torch.allclose(g, want, rtol=1e-6, atol=1e-6), k
    assert runtime.state.engine.stats["fused_buffers"] > fused_before
    comms = runtime.state.comms
    # hosts a, a, b, b: the ranks on the other host (Adasum's exchanges with them go whole)
    assert comms.topology.other_hosts == ({2, 3} if r < 2 else {0, 1})
    target = comms.pack_target(100, torch.float32)
    if expect_shared:
        assert target.data_ptr() == comms.topology._in_node._slots[hvd.local_rank()].data_ptr()
    else:
        assert target is None
    return (comms.topology._in_node is not None) == expect_shared


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shared,chunk", [("1", "0"), ("1", "12344"), ("0", "0")])
def test_hierarchical_allreduce_2x2(backend, shared, chunk):
    # chunk 12344 bytes: hundreds of pipeline chunks, none a multiple of the element size
    env = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_SHARED_MEMORY": shared,
           "HOROVOD_HIERARCHICAL_CHUNK_BYTES": chunk}
    assert all(run_ranks(body_hierarchical, 4, backend, env=env, args=(shared == "1",),
                         hostnames=["a", "a", "b", "b"], timeout=120))


def body_single_host(expect_shared: bool):
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    r, n = hvd.rank(), hvd.size()
    comms = runtime.state.comms
    large = comms.world.shared_memory_from_bytes // 4 + 1001     # float32 elements
    for step, numel in enumerate((10, 4097, large)):
        got = hvd.allreduce(sample(r, numel, torch.float32, step), op=hvd.Sum, name=f"s{step}")
        want = sum(sample(k, numel, torch.float32, step) for k in range(n))
        assert torch.equal(got, want), step
        x = sample(r, numel, torch.int64, step)
        hvd.allreduce_(x, op=hvd.Min, name=f"m{step}")
        want = torch.stack([sample(k, numel, torch.int64, step) for k in range(n)]).min(0).values
        assert torch.equal(x, want), step
    # fused tensors packed into the slot when the buffer is large enough
    sizes = [large // 3, large // 3, large - 2 * (large // 3)]
    got = hvd.grouped_allreduce([sample(r, k, torch.float32, 70 + i) for i, k in enumerate(sizes)],
                                op=hvd.Average, name="g")
    for i, (k, g) in enumerate(zip(sizes, got)):
        want = sum(sample(q, k, torch.float32, 70 + i) for q in range(n)) / n
        assert torch.allclose(g, want, rtol=1e-6, atol=1e-6), i
    return (comms.topology._in_node is not None) == expect_shared


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shared", ["1", "0"])
def test_single_host_allreduce_through_shared_memory(backend, shared):
    """All ranks on one host, not hierarchical: large elementwise allreduces take the
    shared-memory group (HOROVOD_SHARED_MEMORY=0 keeps them on the transport)."""
    assert all(run_ranks(body_single_host, 3, backend, args=(shared == "1",),
                         env={"HOROVOD_SHARED_MEMORY": shared}, timeout=100))


def body_single_host_adasum():
    """hvd.allreduce(op=Adasum) of a small and a large single-layer buffer, then a grouped
    allreduce of three large layers: which went through the segment, which of those were packed
    in this rank's slot, and each result's error against the tree computed here."""
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    from horovod_ext.ops import adasum as adasum_op
    from tests.test_adasum import ref_tree, rel_err
    r, n = hvd.rank(), hvd.size()
    world = runtime.state.comms.world
    through_segment, in_slot = [], []
    in_node = adasum_op.in_node_adasum_

    def counted(x, bounds, group):
        through_segment[-1] = True
        out = in_node(x, bounds, group)
        in_slot[-1] = x.data_ptr() == group.slot_address(group.rank)   # and it stayed there
        return out

    adasum_op.in_node_adasum_ = counted
    large = max(world.whole_vector_steps_in_shared_memory_from_bytes // 4, 4096) + 1001
    errors = []
    for step, sizes in enumerate(([1001], [large], [large // 2, large // 2 + 5, 999])):
        through_segment.append(False)
        in_slot.append(False)
        inputs = [[torch.randn(numel, generator=torch.Generator().manual_seed(10 * step + k))
                   for numel in sizes] for k in range(n)]
        if len(sizes) == 1:
            got = [hvd.allreduce(inputs[r][0], op=hvd.Adasum, name=f"adasum{step}")]
        else:
            got = hvd.grouped_allreduce(inputs[r], op=hvd.Adasum, name=f"adasum{step}")
        errors.append(rel_err(got, ref_tree(inputs, [torch.Size([numel]) for numel in sizes])))
    return through_segment, in_slot, errors


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shared", ["1", "0"])
def test_single_host_adasum_through_shared_memory_by_size(backend, shared):
    """All ranks on one host: Adasum goes through the segment from the world communicator's
    threshold on (Gloo: every size; MPI: from 4 MiB, below which its own exchanges are
    faster), never with HOROVOD_SHARED_MEMORY=0, and a fusion buffer of several tensors is
    packed straight into the rank's slot there; every result is the tree's."""
    results = run_ranks(body_single_host_adasum, 3, backend, env={"HOROVOD_SHARED_MEMORY": shared}, timeout=100)
    small_too = backend == "gloo"
    for through_segment, in_slot, errors in results:
        assert through_segment == ([small_too, True, True] if shared == "1" else [False] * 3)
        assert in_slot == [False, False, shared == "1"]
        assert max(errors) < 1e-5, errors


def body_segment_too_large(directory: str):
    """A 16 MiB allreduce whose segment ``directory`` cannot hold: (the error, its seconds)."""
    import horovod_ext.torch as hvd
    from horovod_ext.backends import shm
    shm.SEGMENT_DIR = directory
    start = time.monotonic()
    try:
        hvd.allreduce(torch.ones(4 << 20), op=hvd.Sum, name="big")
    except Exception as exc:   # the error the user sees
        return str(exc), time.monotonic() - start
    return None, time.monotonic() - start


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_segment_larger_than_its_file_system_fails_clearly_on_every_rank(tmp_path):
    """A segment that does not fit /dev/shm (a container's 64 MiB, say) ends in an error on
    every rank that names the room needed and the two ways out, at once, where writing into
    the unreserved pages killed a rank with SIGBUS."""
    directory = tmp_path / "shm"
    directory.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(directory)],
                   check=True, timeout=20)
    try:
        results = run_ranks(body_segment_too_large, 2, "gloo", args=(str(directory),),
                            timeout=50)
    finally:
        subprocess.run(["umount", str(directory)], check=True, timeout=20)
    for message, seconds in results:
        assert message is not None, "a 32 MiB segment fitted in 8 MiB"
        assert "needs 32 MiB (2 local ranks x 16 MiB)" in message, message
        assert "8 MiB free" in message and "HOROVOD_SHARED_MEMORY=0" in message, message
        assert seconds < 20, seconds


def body_room_at_start(directory: str):
    """Shared memory in ``directory`` (8 MiB), from before hvd.init(): Sum and Adasum of 1 MiB
    and of 16 MiB; (results right, the segment's capacity after each size, the room agreed)."""
    import horovod_ext.torch as hvd
    from horovod_ext.backends import shm
    from horovod_ext.engine import runtime
    shm.SEGMENT_DIR = directory
    hvd.init()
    topology = runtime.state.comms.topology
    right, capacity = [], []
    for numel in (1 << 18, 4 << 20):
        x = torch.full((numel,), float(hvd.rank() + 1))
        right.append(torch.equal(hvd.allreduce(x, op=hvd.Sum, name=f"s{numel}"),
                                 torch.full((numel,), 3.0)))
        # parallel vectors: Adasum gives their mean
        right.append(torch.allclose(hvd.allreduce(x, op=hvd.Adasum, name=f"a{numel}"),
                                    torch.full((numel,), 1.5)))
        capacity.append(topology._in_node._capacity if topology._in_node else 0)
    return right, capacity, topology.shared_memory_room


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_buffers_too_large_for_the_room_at_start_go_through_the_transport(tmp_path):
    """A /dev/shm too small for a buffer's segment (a container's 64 MiB, say) no longer stops
    the job: the local ranks agree at start-up on the room each slot may have, and larger
    buffers are reduced through the transport, with a warning naming the fix."""
    directory = tmp_path / "shm"
    directory.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(directory)],
                   check=True, timeout=20)
    try:
        results, output = run_ranks(body_room_at_start, 2, "gloo", args=(str(directory),),
                                    init=False, with_output=True, timeout=50)
    finally:
        subprocess.run(["umount", str(directory)], check=True, timeout=20)
    for right, capacity, room in results:
        assert right == [True] * 4, right
        assert room == 3 << 20, room            # (8 MiB - the header) / 2, in whole MiB
        # 1 MiB and Adasum's tables beside it: 2 MiB; the 16 MiB calls did not grow it
        assert capacity == [2 << 20, 2 << 20], f"the segment's capacity: {capacity}"
    assert output.count("does not fit the in-node shared memory") == 1, output[-2000:]
    assert "--shm-size" in output


def body_lane_beside_a_small_room(directory: str):
    """Shared memory in ``directory`` (8 MiB) from before hvd.init(), the bucket lane on: 8
    steps of a model whose 4 MiB layer makes a bucket too large for the room; (the largest
    difference from the plain optimizer on the ranks' summed gradients, lane sums)."""
    import horovod_ext.torch as hvd
    from horovod_ext.backends import shm
    shm.SEGMENT_DIR = directory
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh(),
                                torch.nn.Linear(1024, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh(),
                              torch.nn.Linear(1024, 2))
    ref.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def batch(step, k):
        return torch.randn(4, 1024, generator=torch.Generator().manual_seed(10 * step + k))
    for step in range(8):
        opt.zero_grad()
        model(batch(step, r)).pow(2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        sum(ref(batch(step, k)).pow(2).mean() for k in range(n)).div(n).backward()
        ref_opt.step()
    err = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    return err, opt._hvd.lane.sums


@pytest.mark.timeout(90)
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_bucket_too_large_for_the_room_takes_the_lane(tmp_path):
    """On one host the engine's way sums buckets through shared memory, which keeps the lane
    off; a bucket too large for the room the local ranks agreed on is one call of the world
    communicator instead, so the lane takes it, and the steps stay the plain optimizer's."""
    directory = tmp_path / "shm"
    directory.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(directory)],
                   check=True, timeout=20)
    env = {"HOROVOD_BUCKET_LANE": "1", "HOROVOD_GRADIENT_BUCKET_PLAN": "size"}
    try:
        results = run_ranks(body_lane_beside_a_small_room, 2, "gloo", args=(str(directory),),
                            init=False, env=env, timeout=70)
    finally:
        subprocess.run(["umount", str(directory)], check=True, timeout=20)
    for err, sums in results:
        assert err < 1e-5, err
        assert sums > 0, "no bucket went on the lane"


def body_local_rank_dies():
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    from horovod_ext.backends.base import CommunicationError
    group = runtime.state.comms.topology.in_node(torch.zeros(1))
    group.allreduce(torch.ones(8))                 # the segment exists on both ranks
    if hvd.rank() == 1:
        os._exit(5)
    started = time.monotonic()
    try:
        group.allreduce(torch.ones(8))
        return "completed", 0.0
    except CommunicationError as exc:
        return str(exc), time.monotonic() - started


@pytest.mark.timeout(60)
def test_a_local_rank_that_dies_is_named_at_once():
    # heartbeats off: they would report the death first (test_faults.py); this is the
    # segment's own check of its peers' processes
    failure = run_ranks(body_local_rank_dies, 2, "gloo", expect_failure=True, settle_on=[0],
                        env={"HOROVOD_COMM_TIMEOUT_SECONDS": "30",
                             "HOROVOD_HEARTBEAT_SECONDS": "0"}, timeout=45)
    message, seconds = failure.results[0]
    assert "local rank 1" in message and "has died" in message, message
    assert seconds < 5, seconds      # found by its pid, long before the 30 s timeout


def body_killed_mid_job():
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    group = runtime.state.comms.topology.in_node(torch.zeros(1))
    group.allreduce(torch.ones(1 << 16))
    if hvd.rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    group.allreduce(torch.ones(1 << 16))
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_segment_left_after_kill_9(backend):
    before = set(glob.glob(SEGMENTS))
    run_ranks(body_killed_mid_job, 2, backend, expect_failure=True, timeout=40,
              env={"HOROVOD_COMM_TIMEOUT_SECONDS": "5"})
    assert set(glob.glob(SEGMENTS)) <= before, "a segment was left in /dev/shm"


def body_hierarchical_allgather():
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    r, n = hvd.rank(), hvd.size()
    for step, (rows, dtype) in enumerate(((lambda k: k + 1, torch.float32),
                                          (lambda k: 0 if k == 1 else 3, torch.int64),
                                          (lambda k: 40_000 * (k + 1), torch.float64),
                                          (lambda k: 2, torch.bool))):
        data = [sample(k, rows(k) * 5, dtype, step).view(rows(k), 5) for k in range(n)]
        got = hvd.allgather(data[r], name=f"ag{step}")
        assert torch.equal(got, torch.cat(data)), step
    return runtime.state.comms.topology._in_node is not None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_hierarchical_allgather_through_shared_memory(backend):
    env = {"HOROVOD_HIERARCHICAL_ALLGATHER": "1"}
    assert all(run_ranks(body_hierarchical_allgather, 4, backend, env=env,
                         hostnames=["a", "b", "a", "b"], timeout=100))
