"""Process sets on real ranks, Gloo and MPI: disjoint and overlapping sets, static and dynamic
registration, ops inside a set (Adasum, hierarchical), and the errors Horovod raises."""
import pytest
import torch

from tests.harness import BACKENDS, run_ranks

DYNAMIC = {"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}


def data(rank, seed, shape=(6,)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * seed + rank),
                       dtype=torch.float64)


def body_disjoint_and_overlapping():
    import horovod_ext.torch as hvd
    r, n = hvd.rank(), hvd.size()
    even = hvd.add_process_set([k for k in range(n) if k % 2 == 0])
    odd = hvd.add_process_set([k for k in range(n) if k % 2 == 1])
    front = hvd.add_process_set([0, 1, 2])        # overlaps both
    out = {"ids": [even.process_set_id, odd.process_set_id, front.process_set_id],
           "front": (front.included(), front.rank(), front.size())}
    mine = even if r % 2 == 0 else odd
    for step in range(3):
        got = hvd.allreduce(data(r, step), op=hvd.Sum, name=f"x{step}", process_set=mine)
        want = sum(data(k, step) for k in mine.ranks)
        assert torch.allclose(got, want), (step, got, want)
        if front.included():
            got = hvd.allreduce(data(r, 10 + step), process_set=front)   # unnamed, Average
            want = sum(data(k, 10 + step) for k in front.ranks) / 3
            assert torch.allclose(got, want)
    # allgather, broadcast (root is a world rank), alltoall, reducescatter in the set
    gathered = hvd.allgather(torch.full((r + 1, 2), float(r)), process_set=mine)
    assert gathered.shape[0] == sum(k + 1 for k in mine.ranks)
    root = mine.ranks[-1]
    assert hvd.broadcast(torch.tensor([float(r)]), root, process_set=mine).item() == root
    received = hvd.alltoall(torch.arange(mine.size(), dtype=torch.float32) + 10 * r,
                            process_set=mine)
    assert received.tolist() == [10.0 * k + mine.rank() for k in mine.ranks]
    scattered = hvd.reducescatter(torch.ones(2 * mine.size()), op=hvd.Sum, process_set=mine)
    assert scattered.tolist() == [float(mine.size())] * 2
    assert hvd.broadcast_object({"from": root} if r == root else None, root,
                                process_set=mine) == {"from": root}
    hvd.barrier(process_set=mine)
    # A request left pending in one set holds up neither another set nor the global set:
    # rank 0 submits to `front` and `mine`; ranks 1 and 2 submit their half of `front` only
    # after a global allreduce that rank 0 reaches after `mine` has completed.
    if front.included():
        if r == 0:
            pending = hvd.allreduce_async(torch.ones(1), name="late", process_set=front)
            hvd.allreduce(torch.ones(1), name="mine_first", process_set=mine)
            assert not pending.done()
            hvd.allreduce(torch.ones(1), name="after")
            assert hvd.synchronize(pending).item() == 1.0
        else:
            if r % 2 == 0:
                hvd.allreduce(torch.ones(1), name="mine_first", process_set=mine)
            hvd.allreduce(torch.ones(1), name="after")
            hvd.allreduce(torch.ones(1), name="late", process_set=front)
    else:
        if r % 2 == 0:
            hvd.allreduce(torch.ones(1), name="mine_first", process_set=mine)
        hvd.allreduce(torch.ones(1), name="after")
    for s in (front, odd, even):
        assert hvd.remove_process_set(s)
    out["after_remove"] = (even.process_set_id, even.size())
    out["global_remove"] = hvd.remove_process_set(hvd.global_process_set)
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", BACKENDS)
def test_disjoint_and_overlapping_sets_at_np4(backend):
    results = run_ranks(body_disjoint_and_overlapping, 4, backend, env=DYNAMIC, timeout=120)
    assert all(res["ids"] == results[0]["ids"] for res in results)
    assert len(set(results[0]["ids"])) == 3
    assert [res["front"] for res in results] == [(True, 0, 3), (True, 1, 3), (True, 2, 3),
                                                 (False, -1, 3)]
    assert all(res["after_remove"] == (None, None) for res in results)
    assert not any(res["global_remove"] for res in results)


def body_static_sets_and_errors(backend):
    import horovod_ext.torch as hvd
    pair = hvd.ProcessSet([2, 0])
    single = hvd.ProcessSet([1])
    hvd.init(process_sets=[pair, single])
    r = hvd.rank()
    out = {"pair": (pair.ranks, pair.included(), pair.rank(), pair.size())}
    if pair.included():
        got = hvd.allreduce(data(r, 1), op=hvd.Sum, process_set=pair)
        assert torch.allclose(got, data(0, 1) + data(2, 1))
    else:
        got = hvd.allreduce(data(r, 1), op=hvd.Sum, process_set=single)
        assert torch.equal(got, data(1, 1))
    errors = {}
    checks = {
        "not_member": lambda: hvd.allreduce(torch.ones(1), process_set=single if r != 1 else pair),
        "not_dynamic": lambda: hvd.add_process_set([0, 1]),
        "root_outside": lambda: hvd.broadcast(torch.ones(1), 1, process_set=pair) if r != 1
        else hvd.broadcast(torch.ones(1), 0, process_set=single),
        "unregistered": lambda: hvd.allreduce(torch.ones(1), process_set=hvd.ProcessSet([0])),
    }
    for key, call in checks.items():
        try:
            call()
            errors[key] = None
        except ValueError as exc:
            errors[key] = str(exc)
    out["errors"] = errors
    hvd.shutdown()
    out["after_shutdown"] = (pair.process_set_id, pair.included())
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_static_sets_from_init_and_errors(backend):
    results = run_ranks(body_static_sets_and_errors, 3, backend, init=False, args=(backend,),
                        timeout=90)
    assert [res["pair"] for res in results] == [([0, 2], True, 0, 2), ([0, 2], False, -1, 2),
                                                ([0, 2], True, 1, 2)]
    for r, res in enumerate(results):
        errors = res["errors"]
        assert "is not a member of process set" in errors["not_member"], errors
        assert "HOROVOD_DYNAMIC_PROCESS_SETS=1" in errors["not_dynamic"], errors
        assert "is not one of the set's ranks" in errors["root_outside"], errors
        assert "is not registered" in errors["unregistered"], errors
        assert res["after_shutdown"] == (None, None)


def body_collective_errors():
    import horovod_ext.torch as hvd
    r = hvd.rank()
    errors = {}
    # ranks disagree on the set: every rank gets the same error, and nothing is registered
    try:
        hvd.add_process_set([0, 1] if r == 0 else [0, 2])
    except ValueError as exc:
        errors["mismatch"] = str(exc)
    s = hvd.add_process_set([0, 1])
    for key, ranks in (("duplicate", [1, 0]), ("everyone", [0, 1, 2]), ("range", [0, 5])):
        try:
            hvd.add_process_set(ranks)
        except ValueError as exc:
            errors[key] = str(exc)
    assert hvd.remove_process_set(s)
    assert not hvd.remove_process_set(s)   # no longer registered
    again = hvd.add_process_set([0, 1])    # the same ranks may be added again after removal
    if again.included():
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=again).item() == 2.0
    hvd.remove_process_set(again)
    return errors


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_disagreements_fail_alike_on_every_rank(backend):
    results = run_ranks(body_collective_errors, 3, backend, env=DYNAMIC, timeout=90)
    for errors in results:
        assert "different ranks on different ranks" in errors["mismatch"], errors
        assert "exists already" in errors["duplicate"], errors
        assert "global process set" in errors["everyone"], errors
        assert "must be distinct ranks in 0..2" in errors["range"], errors


def adasum_pair(a, b):
    dot = float(a @ b)
    return (1 - dot / (2 * float(a @ a))) * a + (1 - dot / (2 * float(b @ b))) * b


def body_ops_inside_sets():
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    r = hvd.rank()
    # 5 ranks on hosts a a b b c: the set [0..3] spans two nodes of two ranks each
    quad = hvd.add_process_set([0, 1, 2, 3])
    pair = hvd.add_process_set([3, 4])
    out = {}
    if quad.included():
        t = runtime.set_topology(quad.process_set_id)
        out["quad_topology"] = (t.local_rank, t.local_size, t.cross_rank, t.cross_size)
        got = hvd.allreduce(data(r, 5, (1000,)), op=hvd.Sum, name="h", process_set=quad)
        want = sum(data(k, 5, (1000,)) for k in range(4))
        assert torch.allclose(got, want), "hierarchical allreduce inside the set"
    if pair.included():
        a, b = data(3, 6, (50,)), data(4, 6, (50,))
        got = hvd.allreduce(data(r, 6, (50,)), op=hvd.Adasum, name="a", process_set=pair)
        assert torch.allclose(got, adasum_pair(a, b), rtol=1e-10, atol=1e-12), "Adasum"
    hvd.remove_process_set(pair)
    hvd.remove_process_set(quad)
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", BACKENDS)
def test_hierarchical_and_adasum_inside_sets(backend):
    env = dict(DYNAMIC, HOROVOD_HIERARCHICAL_ALLREDUCE="1")
    results = run_ranks(body_ops_inside_sets, 5, backend, env=env, timeout=120,
                        hostnames=["a", "a", "b", "b", "c"])
    assert [res.get("quad_topology") for res in results[:4]] == [(0, 2, 0, 2), (1, 2, 0, 2),
                                                                 (0, 2, 1, 2), (1, 2, 1, 2)]


def body_optimizer_in_a_set():
    import horovod_ext.torch as hvd
    r = hvd.rank()
    first = hvd.add_process_set([0, 1])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=first)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(r))
    model(x).pow(2).sum().backward()
    opt.step()
    weights = hvd.allgather(model.weight.detach().reshape(1, -1))
    hvd.remove_process_set(first)
    return weights


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_distributed_optimizer_on_a_set(backend):
    weights = run_ranks(body_optimizer_in_a_set, 3, backend, env=DYNAMIC, timeout=90)[0]
    # ranks 0 and 1 averaged their gradients and agree; rank 2 stepped on its own
    assert torch.equal(weights[0], weights[1])
    assert not torch.allclose(weights[0], weights[2])


def body_sets_from_communicators():
    from mpi4py import MPI
    import horovod_ext.torch as hvd
    world = MPI.COMM_WORLD.Get_rank()
    # each rank passes the communicator it is in: ranks 0-1 and rank 2
    mine = hvd.ProcessSet(MPI.COMM_WORLD.Split(0 if world < 2 else 1, world))
    hvd.init(process_sets=[mine])
    got = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, process_set=mine)
    return mine.ranks, mine.process_set_id, got.item()


@pytest.mark.timeout(90)
def test_sets_from_mpi_communicators():
    results = run_ranks(body_sets_from_communicators, 3, "mpi", init=False, timeout=60)
    assert results == [([0, 1], 1, 3.0), ([0, 1], 1, 3.0), ([2], 2, 3.0)]


def body_compressed_ops_inside_a_set():
    import horovod_ext.torch as hvd
    r = hvd.rank()
    pair = hvd.add_process_set([0, 2])
    out = None
    if pair.included():
        x = data(r, 7, (4096,)).float()
        # With error feedback the outputs of repeated calls average out to the set's mean
        # (one call alone takes ties from the rank with the larger norm).
        outputs = [hvd.allreduce(x, op=hvd.OneBit, name="onebit", process_set=pair)
                   for _ in range(20)]
        onebit = torch.stack(outputs).mean(0)
        mean = (data(0, 7, (4096,)) + data(2, 7, (4096,))).float() / 2
        other = (data(0, 7, (4096,)) + data(1, 7, (4096,))).float() / 2   # not the set

        def cosine(a, b):
            return float(a @ b / (a.norm() * b.norm()))
        small = hvd.allreduce(x[:100], op=hvd.RandomK(0.1), name="rk", process_set=pair)
        out = (onebit, (cosine(onebit, mean), cosine(onebit, other)),
               torch.allclose(small, mean[:100], atol=1e-6))
    hvd.remove_process_set(pair)
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
def test_onebit_and_randomk_inside_a_set(backend):
    results = run_ranks(body_compressed_ops_inside_a_set, 3, backend, env=DYNAMIC, timeout=60)
    (first, (to_set, to_other), exact), outside, (second, _, _) = results
    assert outside is None
    assert torch.equal(first, second), "1-bit result differs between the set's ranks"
    # the two means share rank 0's data: a cosine of 0.5 between them
    assert to_set > 0.95 and to_other < 0.7, (to_set, to_other)
    assert exact                      # tensors this small are averaged in full by random-k
