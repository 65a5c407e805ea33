"""The steady-state lane of hvd.allreduce_ and hvd.allreduce (horovod_ext/fast_lane.py): the same results as the
general path, taken when it applies, and left for the general path whenever ranks disagree."""
import pytest
import torch

from tests.harness import BACKENDS, run_ranks

STEPS = 12


def _values(rank, step, n, dtype):
    """Small integers, so every reduction below is exact in every dtype used."""
    base = torch.arange(n, dtype=torch.float64) % 7
    return (base + 3 * rank + step).to(dtype)


def _expected(size, step, n, dtype, op):
    stack = torch.stack([_values(k, step, n, torch.float64) for k in range(size)])
    if op in ("sum", "by_name"):
        return stack.sum(0).to(dtype)
    if op == "max":
        return stack.max(0).values.to(dtype)
    if op == "average":
        return (stack.sum(0) / size).to(dtype)
    if op == "prescaled":
        return (stack.sum(0) * 2.0).to(dtype)
    raise ValueError(op)


def body_lane():
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    engine = runtime.engine()
    rank, size = hvd.rank(), hvd.size()
    ops = {"sum": dict(op=hvd.Sum), "max": dict(op=hvd.Max), "average": {},
           "prescaled": dict(op=hvd.Sum, prescale_factor=2.0), "by_name": dict(op="sum")}
    cases = [("f32.sum", torch.float32, "sum", (3, 5)), ("f64.max", torch.float64, "max", (17,)),
             ("f32.by_name", torch.float32, "by_name", (5,)),
             ("f32.avg", torch.float32, "average", (8,)), ("i64.sum", torch.int64, "sum", (9,)),
             ("f16.sum", torch.float16, "sum", (6,)), ("f32.pre", torch.float32, "prescaled", (4,))]
    buffers = {name: torch.empty(shape, dtype=dtype) for name, dtype, _, shape in cases}
    errors = []
    before = engine.stats["fast_lane"]
    for step in range(STEPS):
        for name, dtype, op, shape in cases:
            t = buffers[name]
            t.copy_(_values(rank, step, t.numel(), dtype).view(shape))
            out = hvd.allreduce_(t, name=name, **ops[op])
            assert out is t
            want = _expected(size, step, t.numel(), dtype, op).view(shape)
            if not torch.allclose(t.double(), want.double(), rtol=1e-6, atol=0):
                errors.append((name, step, t.tolist(), want.tolist()))
        # hvd.allreduce (a new tensor) of a fresh tensor each step, plain and fp16-compressed
        for name, compression in (("copy.avg", hvd.Compression.none),
                                  ("copy.fp16", hvd.Compression.fp16)):
            fresh = _values(rank, step, 10, torch.float32).view(2, 5)
            kept = fresh.clone()
            out = hvd.allreduce(fresh, name=name, compression=compression)
            want = _expected(size, step, 10, torch.float32, "average").view(2, 5)
            if (out.dtype != torch.float32 or out.data_ptr() == fresh.data_ptr()
                    or not torch.equal(fresh, kept)
                    or not torch.allclose(out, want, rtol=1e-3 if "fp16" in name else 1e-6)):
                errors.append((name, step, out.tolist(), want.tolist()))
    lane_calls = engine.stats["fast_lane"] - before
    prepared = engine._lane.by_name["f32.sum"]._prepared is not None

    # An op with its own algorithm (Adasum) on the lane: bitwise what the general path gives.
    adasum_same = []
    g = torch.Generator().manual_seed(rank)
    steady_ada = torch.empty(3, 40)
    for step in range(5):
        x = torch.randn(3, 40, generator=g)
        general = hvd.allreduce(x, op=hvd.Adasum)          # unnamed: the general path
        hvd.allreduce_(steady_ada.copy_(x), name="ada", op=hvd.Adasum)
        adasum_same.append(torch.equal(general, steady_ada))
    ada_lane_calls = engine.stats["fast_lane"] - before - lane_calls

    # The same name on other memory, then another shape: the general path, then the lane again.
    moved = []
    for shape in [(5,), (5,), (7,), (7,), (7,)]:
        t = torch.full(shape, float(rank + 1))
        hvd.allreduce_(t, name="moving", op=hvd.Sum)
        moved.append(t.tolist() == [size * (size + 1) / 2] * shape[0])

    # Ranks that disagree after the lane is set up: every rank gets the general path's error.
    steady = torch.ones(4)
    for _ in range(3):
        hvd.allreduce_(steady.fill_(1.0), name="steady", op=hvd.Sum)
    mismatch = {}
    for what, call in {
        "shape": lambda: hvd.allreduce_(steady if rank == 0 else torch.ones(5), name="steady",
                                        op=hvd.Sum),
        "op": lambda: hvd.allreduce_(steady, name="steady", op=hvd.Sum if rank else hvd.Max),
    }.items():
        hvd.allreduce_(steady.fill_(1.0), name="steady", op=hvd.Sum)  # the lane is set up again
        try:
            call()
            mismatch[what] = None
        except hvd.HorovodInternalError as exc:
            mismatch[what] = str(exc)

    # A request another rank has pending: the lane stands aside and the order still works out.
    pending_ok = []
    for step in range(4):
        a, b = torch.full((3,), float(rank)), torch.full((3,), 1.0)
        hvd.allreduce_(b, name="steady.b", op=hvd.Sum)
        if rank == 0:
            h = hvd.allreduce_async_(a, name="side", op=hvd.Sum)
            hvd.allreduce_(b.fill_(1.0), name="steady.b", op=hvd.Sum)
            hvd.synchronize(h)
        else:
            hvd.allreduce_(b.fill_(1.0), name="steady.b", op=hvd.Sum)
            hvd.allreduce_(a, name="side", op=hvd.Sum)
        pending_ok.append(a.tolist() == [sum(range(size))] * 3 and b.tolist() == [size] * 3)
    return dict(errors=errors, lane_calls=lane_calls, moved=moved, mismatch=mismatch,
                adasum_same=adasum_same, ada_lane_calls=ada_lane_calls, prepared=prepared,
                pending_ok=pending_ok, stats=dict(engine.stats))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend,np,hierarchical", [("mpi", 2, False), ("gloo", 3, False),
                                                     ("mpi", 4, True)])
def test_lane_gives_the_general_paths_results_and_errors(backend, np, hierarchical):
    # hierarchical: 2 nodes of 2, where the lane runs the hierarchical op, not a prepared call
    env = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"} if hierarchical else None
    hostnames = ["a", "a", "b", "b"] if hierarchical else None
    for out in run_ranks(body_lane, np, backend, env=env, hostnames=hostnames):
        assert out["errors"] == [], out["errors"][:2]
        # Every call after a name's first may take the lane; an idle cycle of a background
        # thread coinciding with a call sends it the general way, so allow a few.
        possible = 8 * (STEPS - 1)   # every case but the op given by name (general path)
        assert possible * 0.75 <= out["lane_calls"] <= possible, out["lane_calls"]
        assert all(out["moved"]), out["moved"]
        # The data call is prepared by address on flat MPI only (hierarchical runs the op).
        assert out["prepared"] == (backend == "mpi" and not hierarchical)
        assert all(out["adasum_same"]) and out["ada_lane_calls"] >= 2, out
        assert "shape" in out["mismatch"]["shape"] and "'steady'" in out["mismatch"]["shape"]
        assert "op" in out["mismatch"]["op"] and "'max'" in out["mismatch"]["op"]
        assert all(out["pending_ok"]), out["pending_ok"]
