"""Hierarchical allreduce/allgather on 2 emulated nodes of 2, fusion, the response cache, and a
user-registered op that plugs its own cross-node step into the hierarchical path."""
import pytest
import torch

from tests.harness import BACKENDS, run_ranks
from tests.test_collectives import check, reference, sample


def body_hierarchical():
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    r, n = hvd.rank(), hvd.size()
    comms = runtime.state.comms
    for i, dtype in enumerate((torch.float32, torch.float64, torch.int64, torch.float16)):
        for numel in (1, 3, 17, 1000):
            data = [sample(k, (numel,), dtype, 10 * i + numel) for k in range(n)]
            for opname, op in (("sum", hvd.Sum), ("average", hvd.Average), ("max", hvd.Max)):
                check(hvd.allreduce(data[r], op=op), reference(data, opname),
                      f"hierarchical {opname} {dtype} {numel}")
        data = [sample(k, (k + 1, 2), dtype, 77 + i) for k in range(n)]
        check(hvd.allgather(data[r]), torch.cat(data), f"hierarchical allgather {dtype}")
    return comms.topology.hierarchy_applies


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "b", "a", "b"]])
def test_hierarchical_matches_flat_reference(backend, hosts):
    env = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_HIERARCHICAL_ALLGATHER": "1"}
    assert run_ranks(body_hierarchical, 4, backend, env=env, hostnames=hosts) == [True] * 4


@pytest.mark.timeout(120)
def test_hierarchical_flag_changes_nothing_on_one_node():
    env = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_HIERARCHICAL_ALLGATHER": "1"}
    assert run_ranks(body_hierarchical, 2, "gloo", env=env) == [False] * 2


def body_every_op_on_tiny_tensors():
    """Every registry op on tensors of 0, 1 and 2 elements (fewer than a node has ranks: some
    ranks' parts of the node's sum are empty), each the first call of its size class: the
    failures, and the results of the ops that promise every rank the same one."""
    import horovod_ext.torch as hvd
    r, n = hvd.rank(), hvd.size()
    ops = {"sum": hvd.Sum, "average": hvd.Average, "adasum": hvd.Adasum, "onebit": hvd.OneBit,
           "randomk": hvd.RandomK(0.5), "powersgd": hvd.PowerSGD(rank=1),
           "quantized": hvd.Quantized(bits=4)}
    failures, same = [], {}
    for numel in (0, 1, 2):
        data = [sample(k, (numel,), torch.float32, numel) for k in range(n)]
        for name, op in ops.items():
            what = f"{name} of {numel} elements"
            try:
                out = hvd.allreduce(data[r], op=op, name=f"tiny.{name}.{numel}")
            except Exception as exc:  # noqa: B902 - each failure is named, then the rest runs
                failures.append(f"{what}: {type(exc).__name__}: {str(exc)[:200]}")
                if "stopped" in str(exc):
                    break
                continue
            if out.shape != (numel,) or not bool(torch.isfinite(out).all()):
                failures.append(f"{what}: {out}")
            elif name in ("sum", "average"):
                expected = reference(data, name).to(torch.float32)
                if not torch.allclose(out, expected):
                    failures.append(f"{what}: {out} against {expected}")
            elif name != "randomk":   # random-k keeps this rank's values where not averaged
                same[what] = out
    return failures, same


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend,hosts,shm", [
    ("gloo", "a a b b", "1"), ("gloo", "a b b c a c", "0"), ("mpi", "a a b b", "1")])
def test_every_op_takes_empty_and_one_element_tensors_hierarchically(backend, hosts, shm):
    """Before, at 2 x 2 an empty Sum failed in the shared-memory pipeline, an empty OneBit
    found no segment, and a one-element Adasum hung until the timeout stopped the job."""
    hosts = hosts.split()
    results = run_ranks(body_every_op_on_tiny_tensors, len(hosts), backend, hostnames=hosts,
                        env={"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_SHARED_MEMORY": shm},
                        timeout=120)
    for rank, (failures, same) in enumerate(results):
        assert failures == [], f"rank {rank}: {failures}"
        for what, out in same.items():
            assert torch.equal(out, results[0][1][what]), f"rank {rank}, {what}: {out}"


def body_custom_cross_step():
    """A user op: Sum whose cross-node step is supplied by the op and records what it saw."""
    import horovod_ext.torch as hvd
    from horovod_ext.backends import ReduceOp

    seen = []

    class RecordingSum(hvd.Op):
        name = "recording_sum"

        def allreduce(self, buffer, layers, comms):
            def cross_step(shard, offset, topology):
                seen.append((offset, shard.numel(), topology.cross.size))
                return topology.cross.allreduce(shard, ReduceOp.SUM)
            return comms.allreduce(buffer, ReduceOp.SUM, cross_step=cross_step)

    class StepSum(hvd.Op):          # docs/api.md's example: one step, flat or hierarchical
        name = "step_sum"

        def allreduce(self, buffer, layers, comms):
            def step(part, span):
                seen.append(("step", span.offset, part.numel(), span.comm.size))
                return span.comm.allreduce(part, ReduceOp.SUM)
            return comms.reduce(buffer, step, node_average=False)

    op = hvd.register_op(RecordingSum())
    hvd.register_op(StepSum())
    r, n = hvd.rank(), hvd.size()
    data = [sample(k, (10,), torch.float32, 5) for k in range(n)]
    check(hvd.allreduce(data[r], op=op), reference(data, "sum"), "custom op")
    check(hvd.allreduce(data[r], op="recording_sum", name="by_name"), reference(data, "sum"),
          "custom op by name")
    check(hvd.allreduce(data[r], op="step_sum", name="step"), reference(data, "sum"),
          "op with one step")
    return seen


@pytest.mark.timeout(120)
def test_user_op_supplies_the_cross_node_step():
    out = run_ranks(body_custom_cross_step, 4, "gloo", hostnames=["a", "a", "b", "b"],
                    env={"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"})
    # local rank 0 owns elements 0..4, local rank 1 owns 5..9; the step runs across 2 nodes
    assert out[0] == out[2] == [(0, 5, 2)] * 2 + [("step", 0, 5, 2)]
    assert out[1] == out[3] == [(5, 5, 2)] * 2 + [("step", 5, 5, 2)]


def body_fusion_and_cache(steps):
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    r, n = hvd.rank(), hvd.size()
    engine = runtime.engine()
    shapes = [(4,), (3, 3), (100,), (2,)]
    for step in range(steps):
        data = [[sample(k, s, torch.float32, 100 * step + i) for i, s in enumerate(shapes)]
                for k in range(n)]
        handles = [hvd.allreduce_async(t, name=f"grad.{i}", op=hvd.Sum)
                   for i, t in enumerate(data[r])]
        for i, h in enumerate(handles):
            check(hvd.synchronize(h), reference([data[k][i] for k in range(n)], "sum"),
                  f"step {step} tensor {i}")
    return dict(engine.stats)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fusion_and_response_cache(backend):
    # A long cycle makes all four async requests land in one cycle, so they are fused.
    stats = run_ranks(body_fusion_and_cache, 2, backend, args=(5,),
                      env={"HOROVOD_CYCLE_TIME": "50"})
    for s in stats:
        assert s["fused_buffers"] >= 4, s          # at least one fused buffer per step
        assert s["announced"] == 4, s              # full descriptions only the first time
        assert s["cache_hits"] == 16, s            # then cache ids
    # Fusion disabled: every tensor goes alone, results still right.
    stats = run_ranks(body_fusion_and_cache, 2, backend, args=(2,),
                      env={"HOROVOD_CYCLE_TIME": "50", "HOROVOD_FUSION_THRESHOLD": "0"})
    assert all(s["fused_buffers"] == 0 for s in stats), stats
