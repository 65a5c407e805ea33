"""Every collective and dtype against a reference computed here, on 1, 2, 3 and 5 real ranks
(odd counts as clusters have them), Gloo and MPI."""
import pytest
import torch

from tests.harness import BACKENDS, run_ranks

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
TOL = {torch.float16: dict(rtol=1e-2, atol=1e-2), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}


def sample(rank, shape, dtype, seed):
    """Rank-specific data; small integers so that sums and products are exact in every dtype."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    low = 0 if dtype == torch.uint8 else -3
    return torch.randint(low, 4, shape, generator=g).to(dtype)


def reference(tensors, op):
    stack = torch.stack([t.double() for t in tensors])
    if op == "sum":
        out = stack.sum(0)
    elif op == "average":
        s = stack.sum(0)
        out = s / len(tensors) if tensors[0].is_floating_point() else torch.trunc(s / len(tensors))
    elif op == "min":
        out = stack.min(0).values
    elif op == "max":
        out = stack.max(0).values
    else:
        out = stack.prod(0)
    if tensors[0].dtype == torch.bool:
        return (out != 0) if op in ("sum", "max") else out.bool()
    return out.to(tensors[0].dtype)


def check(actual, expected, what):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    tol = TOL.get(expected.dtype, dict(rtol=0, atol=0))
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}", **tol)


def body_allreduce():
    import horovod_ext.torch as hvd
    r, n = hvd.rank(), hvd.size()
    ops = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max,
           "product": hvd.Product}
    seed = 0
    for dtype in FLOATS + INTS + [torch.bool]:
        for opname, op in ops.items():
            if dtype == torch.bool and opname == "average":
                continue
            seed += 1
            data = [sample(k, (5, 3), dtype, seed) for k in range(n)]
            expected = reference(data, opname)
            what = f"allreduce {opname} {dtype}"
            check(hvd.allreduce(data[r], op=op, name=f"ar.{seed}"), expected, what)
            t = data[r].clone()
            assert hvd.allreduce_(t, op=op) is t
            check(t, expected, what + " in place")
            h = hvd.allreduce_async(data[r], op=op)
            check(hvd.synchronize(h), expected, what + " async")
            t = data[r].clone()
            h = hvd.allreduce_async_(t, op=op, name=f"ari.{seed}")
            hvd.synchronize(h)
            assert hvd.poll(h)
            check(t, expected, what + " async in place")
    # deprecated average flag, prescale and postscale, scalars and empty tensors
    data = [sample(k, (7,), torch.float32, 99) for k in range(n)]
    check(hvd.allreduce(data[r], average=False), reference(data, "sum"), "average=False")
    check(hvd.allreduce(data[r], op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5 / n),
          reference(data, "sum") / n, "prescale/postscale")
    # float16 with a factor that is no power of two, the same data on every rank (Horovod's
    # prescale test): x = fp16(f * t) in float32 math, and the sum rounded once to float16,
    # the float16 value nearest n * x (at 3 and 5 ranks n * x itself often is none)
    t = torch.arange(-8.0, 9.0) * 11.0
    x = (torch.tensor(0.1915194503788923) * t).half()
    got = hvd.allreduce(t.half(), op=hvd.Sum, prescale_factor=0.1915194503788923)
    assert torch.equal(got, (x.float() * n).half()), (got, x.float() * n)
    check(hvd.allreduce(torch.tensor(float(r + 1))), torch.tensor((n + 1) / 2), "0-d tensor")
    check(hvd.allreduce(torch.zeros(0)), torch.zeros(0), "empty")
    # grouped forms: one request, tensors of different shapes
    for dtype in (torch.float32, torch.int64):
        shapes = [(3,), (2, 4), (1,)]
        data = [[sample(k, s, dtype, 50 + i) for i, s in enumerate(shapes)] for k in range(n)]
        expected = [reference([data[k][i] for k in range(n)], "sum") for i in range(3)]
        for got, exp in zip(hvd.grouped_allreduce(data[r], op=hvd.Sum), expected):
            check(got, exp, f"grouped {dtype}")
        mine = [t.clone() for t in data[r]]
        hvd.synchronize(hvd.grouped_allreduce_async_(mine, op=hvd.Sum))
        for got, exp in zip(mine, expected):
            check(got, exp, f"grouped async in place {dtype}")
        got = hvd.synchronize(hvd.grouped_allreduce_async(data[r], op=hvd.Sum))
        for g, exp in zip(got, expected):
            check(g, exp, f"grouped async {dtype}")
        mine = [t.clone() for t in data[r]]
        hvd.grouped_allreduce_(mine, op=hvd.Sum)
        for got, exp in zip(mine, expected):
            check(got, exp, f"grouped in place {dtype}")
    # compression
    data = [torch.randn(64, generator=torch.Generator().manual_seed(k)) for k in range(n)]
    exact = torch.stack(data).mean(0)
    for comp, tol in ((hvd.Compression.fp16, 2e-3), (hvd.Compression.bf16, 2e-2)):
        got = hvd.allreduce(data[r], compression=comp)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, exact, rtol=tol, atol=tol)
    return "ok"


def body_other_collectives():
    import horovod_ext.torch as hvd
    r, n = hvd.rank(), hvd.size()
    for i, dtype in enumerate(FLOATS + INTS + [torch.bool]):
        # allgather with uneven first dimensions
        data = [sample(k, (k + 1, 3), dtype, 200 + i) for k in range(n)]
        check(hvd.allgather(data[r]), torch.cat(data), f"allgather {dtype}")
        check(hvd.synchronize(hvd.allgather_async(data[r])), torch.cat(data),
              f"allgather async {dtype}")
        # broadcast from every root
        for root in range(n):
            src = [sample(k, (4, 2), dtype, 300 + i) for k in range(n)]
            check(hvd.broadcast(src[r], root), src[root], f"broadcast {dtype} root {root}")
            t = src[r].clone()
            assert hvd.broadcast_(t, root) is t
            check(t, src[root], f"broadcast_ {dtype}")
            t = src[r].clone()
            hvd.synchronize(hvd.broadcast_async_(t, root))
            check(t, src[root], f"broadcast_async_ {dtype}")
            check(hvd.synchronize(hvd.broadcast_async(src[r], root)), src[root],
                  f"broadcast_async {dtype}")
        # alltoall, even and with splits (rank k sends j+k rows to rank j)
        even = [sample(k, (2 * n, 3), dtype, 400 + i) for k in range(n)]
        out = hvd.alltoall(even[r])  # without splits: the tensor alone, as in Horovod
        check(out, torch.cat([even[k][2 * r:2 * r + 2] for k in range(n)]), f"alltoall {dtype}")
        out, splits = hvd.alltoall(even[r], splits=[2] * n)
        check(out, torch.cat([even[k][2 * r:2 * r + 2] for k in range(n)]), f"alltoall {dtype}")
        assert splits.tolist() == [2] * n
        send = [[j + k for j in range(n)] for k in range(n)]
        data = [sample(k, (sum(send[k]), 2), dtype, 500 + i) for k in range(n)]
        out, splits = hvd.synchronize(hvd.alltoall_async(data[r], splits=send[r]))
        pieces = []
        for k in range(n):
            start = sum(send[k][:r])
            pieces.append(data[k][start:start + send[k][r]])
        check(out, torch.cat(pieces), f"alltoall splits {dtype}")
        assert splits.tolist() == [send[k][r] for k in range(n)]
    # reducescatter: rows split as evenly as possible, earlier ranks get the extra
    for dtype in (torch.float32, torch.float64, torch.int32, torch.float16):
        rows = 2 * n + 1
        data = [sample(k, (rows, 2), dtype, 600) for k in range(n)]
        counts = [rows // n + (1 if k < rows % n else 0) for k in range(n)]
        start = sum(counts[:r])
        for opname, op in (("sum", hvd.Sum), ("average", hvd.Average), ("max", hvd.Max)):
            expected = reference(data, opname)[start:start + counts[r]]
            check(hvd.reducescatter(data[r], op=op), expected, f"reducescatter {opname} {dtype}")
        # prescale and postscale: powers of two for floats (exact in every dtype), integer
        # factors for integers (Horovod scales integers in float64: exact there too)
        floating = dtype.is_floating_point
        for pre, post in (((0.5, 1.0), (4.0, 0.125)) if floating else ((2.0, 1.0), (2.0, 3.0))):
            def scaled(rows_of):
                full = reference([rows_of(d) for d in data], "sum").double() * pre * post
                return full.to(dtype)
            mine = scaled(lambda d: d)[start:start + counts[r]]
            check(hvd.reducescatter(data[r], op=hvd.Sum, prescale_factor=pre,
                                    postscale_factor=post), mine, f"reducescatter x{pre},{post}")
            got = hvd.grouped_reducescatter([data[r], data[r][:n]], op=hvd.Sum,
                                            prescale_factor=pre, postscale_factor=post)
            check(got[0], mine, f"grouped reducescatter x{pre},{post} {dtype}")
            check(got[1], scaled(lambda d: d[:n])[r:r + 1], f"grouped 2nd x{pre},{post} {dtype}")
    # objects, barrier, join
    assert hvd.broadcast_object({"from": r, "list": [1, 2]}, root_rank=n - 1) == \
        {"from": n - 1, "list": [1, 2]}
    assert hvd.allgather_object(("rank", r)) == [("rank", k) for k in range(n)]
    hvd.barrier()
    # out-of-order named submission: ranks submit the same names in different orders
    names = [f"ooo.{i}" for i in range(6)]
    order = names if r % 2 == 0 else list(reversed(names))
    handles = {nm: hvd.allreduce_async(torch.full((3,), float(int(nm[-1]) + r)), name=nm,
                                       op=hvd.Sum) for nm in order}
    for nm in names:
        expected = torch.full((3,), float(n * int(nm[-1]) + n * (n - 1) / 2))
        check(hvd.synchronize(handles[nm]), expected, f"out of order {nm}")
    # join: rank 0 runs two extra allreduces; the others have joined and contribute zeros
    if r == 0:
        for step in range(2):
            got = hvd.allreduce(torch.ones(4), op=hvd.Sum, name=f"uneven.{step}")
            check(got, torch.ones(4), "allreduce with joined ranks")
    last = hvd.join()
    assert last == 0, last
    # join first on each rank in turn: the others' broadcast, allgather and reducescatter fail
    # at once (only allreduce is possible while a rank has joined), then they join too
    if n > 1:
        for first in range(n):
            if r != first:
                for name, call in (("broadcast", lambda: hvd.broadcast(torch.ones(3), r)),
                                   ("allgather", lambda: hvd.allgather(torch.ones(3))),
                                   ("reducescatter", lambda: hvd.reducescatter(torch.ones(n)))):
                    try:
                        call()
                        raise AssertionError(f"{name} with rank {first} joined did not fail")
                    except RuntimeError as exc:
                        assert "joined" in str(exc), exc
            last = hvd.join()
            assert last != first, (last, first)
            assert hvd.allgather_object(last) == [last] * n
    return "ok"


def body_topology():
    import horovod_ext.torch as hvd
    return dict(rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(),
                local_size=hvd.local_size(), cross_rank=hvd.cross_rank(),
                cross_size=hvd.cross_size(), homogeneous=hvd.is_homogeneous(),
                mpi=hvd.mpi_enabled(), gloo=hvd.gloo_enabled(), initialized=hvd.is_initialized())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("np", [1, 2, 3, 5])
def test_allreduce_every_dtype_and_op(backend, np):
    assert run_ranks(body_allreduce, np, backend) == ["ok"] * np


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("np", [1, 2, 3, 5])
def test_allgather_broadcast_alltoall_reducescatter_objects(backend, np):
    assert run_ranks(body_other_collectives, np, backend) == ["ok"] * np


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_topology_from_hostnames(backend):
    out = run_ranks(body_topology, 4, backend, hostnames=["a", "b", "a", "b"])
    assert [o["local_rank"] for o in out] == [0, 0, 1, 1]
    assert [o["cross_rank"] for o in out] == [0, 1, 0, 1]
    assert all(o["local_size"] == 2 and o["cross_size"] == 2 and o["homogeneous"] for o in out)
    assert all(o["mpi"] == (backend == "mpi") and o["gloo"] == (backend == "gloo") for o in out)
    out = run_ranks(body_topology, 3, backend, hostnames=["a", "a", "b"])
    assert [o["local_size"] for o in out] == [2, 2, 1]
    assert not any(o["homogeneous"] for o in out)


def body_two_rank_sum_bits():
    """Random floats of every width summed by two ranks, small and large (a Gloo pair sums small
    ones by one exchange of whole tensors, large ones by Gloo's ring): the exact a + b of the
    two inputs, the same bits on both."""
    import horovod_ext.torch as hvd
    r = hvd.rank()
    for dtype in FLOATS:
        for numel in (7, 1 << 18, 3 << 20):
            data = [torch.randn(numel, generator=torch.Generator().manual_seed(11 * k + numel))
                    .mul(1e3).to(dtype) for k in range(2)]
            got = hvd.allreduce(data[r], op=hvd.Sum, name=f"bits.{dtype}.{numel}")
            assert torch.equal(got, data[0] + data[1]), (dtype, numel)
            mean = hvd.allreduce(data[r], op=hvd.Average, name=f"mean.{dtype}.{numel}")
            torch.testing.assert_close(mean, (data[0] + data[1]) / 2)
            for result in (got, mean):   # rank 1 holds rank 0's bits
                theirs = hvd.broadcast(result, root_rank=0)
                assert torch.equal(result.view(torch.uint8), theirs.view(torch.uint8)), dtype
    return "ok"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks_sum_to_the_same_exact_bits(backend):
    assert run_ranks(body_two_rank_sum_bits, 2, backend) == ["ok", "ok"]


def body_pair_exchange_by_distance(far_exchange_s):
    """Gloo sums of 1 KiB and 3 MiB on the world communicator of two ranks, with the far-pair
    threshold set to ``far_exchange_s``: how each was summed, and whether it is exactly a + b."""
    from horovod_ext.backends import pair_exchange
    from horovod_ext.engine import runtime
    import horovod_ext.torch as hvd
    pair_exchange.FAR_EXCHANGE_S = far_exchange_s
    exchanged = []
    plain_sum = pair_exchange.PairExchange.sum
    pair_exchange.PairExchange.sum = lambda self, t: (exchanged.append(t.numel()),
                                                      plain_sum(self, t))
    world, r = runtime.state.comms.world, hvd.rank()
    exact = []
    for numel in (256, 3 << 18):
        data = [torch.randn(numel, generator=torch.Generator().manual_seed(5 * k + numel))
                for k in range(2)]
        got = world.allreduce(data[r].clone())
        exact.append(torch.equal(got, data[0] + data[1]))
    return world.pair.probe_s, world.pair.max_bytes, exchanged, exact


@pytest.mark.timeout(60)
@pytest.mark.parametrize("far", [True, False], ids=["far", "near"])
def test_a_far_pair_sums_every_size_by_exchange(far):
    """A two-rank Gloo group on two hosts times a one-value exchange at its first sum: a far
    pair (here: the threshold set to 0 s) sums buffers up to 64 MiB by one exchange, a near one
    (threshold infinite) only those up to 1 MiB, the 3 MiB one by Gloo's ring; both ranks time
    the same probe and decide alike, and every sum is the exact a + b."""
    results = run_ranks(body_pair_exchange_by_distance, 2, "gloo", hostnames=["a", "b"],
                        args=(0.0 if far else float("inf"),))
    (probe0, max0, exchanged0, exact0), (probe1, max1, exchanged1, exact1) = results
    assert probe0 == probe1 and probe0 > 0
    assert max0 == max1 == (1 << 26 if far else 1 << 20)
    assert exchanged0 == exchanged1 == ([256, 3 << 18] if far else [256])
    assert exact0 == exact1 == [True, True]


@pytest.mark.timeout(60)
def test_a_pair_on_one_host_is_near_without_timing():
    """Two ranks of one host never count as far, however slow a probe would be (the threshold
    at 0 s would make any probe far): no probe, sums up to 1 MiB by exchange."""
    for probe, max_bytes, exchanged, exact in run_ranks(body_pair_exchange_by_distance, 2,
                                                        "gloo", args=(0.0,)):
        assert probe is None and max_bytes == 1 << 20
        assert exchanged == [256] and exact == [True, True]
