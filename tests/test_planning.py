"""The scale model: schedules timed on SimGrid against closed forms, the plan's table and CLI,
bad input.  Profiles here are written in the test (round numbers), so the expected times
follow from the formulas alone."""
import os
import subprocess
import sys

import pytest

from horovod_ext import planning
from horovod_ext.planning import Cluster, Profile, reduction_times
from horovod_ext.planning import schedules as S
from horovod_ext.planning.profile import PER_BYTE, PER_CALL
from horovod_ext.planning.simulate import EngineMissing, locate_simgrid

pytestmark = pytest.mark.timeout(120)

try:
    locate_simgrid()
    MISSING = None
except EngineMissing as e:
    MISSING = str(e)
needs_simgrid = pytest.mark.skipif(MISSING is not None, reason=f"SimGrid missing: {MISSING}")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HVDRUN = os.path.join(os.path.dirname(sys.executable), "hvdrun")
MiB = 1 << 20
LINK = 100e6 / 8            # 100 Mbit/s in bytes per second
LATENCY = 100e-6
NEGOTIATION = 2 * LATENCY   # the engine's control round before each collective: there and back


def profile(reduce=0.0, message=0.0, loopback=4e9, efficiency=1.0, **per_byte):
    costs = {k: 0.0 for k in PER_BYTE}
    costs.update(reduce=reduce, **per_byte)
    calls = {k: 0.0 for k in PER_CALL}
    calls["message"] = message
    return Profile(per_byte=costs, per_call=calls, flops_per_s=1e10, loopback_Bps=loopback,
                   loopback_latency_s=10e-6, efficiency=efficiency)


def one(cluster, nbytes, op, prof, hierarchical=False):
    (r,) = reduction_times(cluster, [nbytes], [op], [hierarchical], prof)
    return r


@needs_simgrid
def test_ring_allreduce_two_nodes_matches_the_formula():
    """2 ranks: 2 steps of half the buffer each way at once, each the link's latency plus the
    half at the link's rate; the reduce-scatter step adds its half (1 ns per byte here)."""
    prof = profile(reduce=1e-9, message=20e-6)
    s = 4 * MiB
    r = one(Cluster(2, 1, LINK, LATENCY), s, "average", prof)
    expected = NEGOTIATION + 2 * (LATENCY + 20e-6 + (s / 2) / LINK) + 1e-9 * s / 2
    assert r.seconds == pytest.approx(expected, rel=1e-6)
    assert r.sent_per_rank == s


@needs_simgrid
def test_flat_ring_over_two_nodes_of_two_ranks():
    """4 ranks in node order: each of the 6 steps moves a quarter through each NIC (one flow
    each way) while the in-node hops use loopback; a 90% efficient TCP stretches the wire."""
    prof = profile(efficiency=0.9)
    s = 8 * MiB
    r = one(Cluster(2, 2, LINK, LATENCY), s, "average", prof)
    assert r.seconds == pytest.approx(NEGOTIATION + 6 * (LATENCY + (s / 4) / (0.9 * LINK)),
                                      rel=1e-6)


@needs_simgrid
def test_oversubscribed_racks_slow_the_ring_that_crosses_them():
    """Two racks of two nodes: the ring crosses each rack uplink once per direction; at 4:1 an
    uplink carries 2 * link / 4 = half a link, so each step takes twice as long."""
    prof = profile()
    s = 4 * MiB
    flat = one(Cluster(4, 1, LINK, LATENCY), s, "average", prof).seconds
    racked = one(Cluster(4, 1, LINK, LATENCY, nodes_per_rack=2, oversubscription=4), s,
                 "average", prof).seconds
    assert flat == pytest.approx(NEGOTIATION + 6 * (LATENCY + (s / 4) / LINK), rel=1e-6)
    assert racked == pytest.approx(NEGOTIATION + 6 * (LATENCY + (s / 4) / (LINK / 2)), rel=1e-6)


@needs_simgrid
def test_hierarchical_average_pipelines_its_three_stages():
    """2 nodes x 2 ranks, 32 MiB: 8 chunks of 4 MiB; per chunk the cross ring moves 1 MiB
    shards in 2 steps (2 MiB rings, one per local rank, sharing the NIC), and the shared-memory
    stages cost what the profile says; total = sum of the stages + 7 x the slowest."""
    shm, copy = 2e-9, 1e-9
    prof = profile(shm_reduce=shm, copy=copy)
    s = 32 * MiB
    r = one(Cluster(2, 2, LINK, LATENCY), s, "average", prof, hierarchical=True)
    chunk = s / 8
    cross = 2 * (LATENCY + 2 * (chunk / 2 / 2) / LINK)   # two rings share each NIC
    stages = [shm * chunk, cross, copy * chunk / 2]
    assert r.seconds == pytest.approx(NEGOTIATION + sum(stages) + 7 * max(stages), rel=1e-6)
    assert r.sent_per_rank == pytest.approx(s / 2)      # 2 (n - 1) / n of the shard, n = 2


@needs_simgrid
def test_shared_cores_stretch_local_work_not_the_wire():
    """Two ranks on one shared core: the reduce-scatter's local sum takes twice as long, the
    transfers and their latency do not change."""
    prof = profile(reduce=1e-9)
    s = 4 * MiB
    own = one(Cluster(2, 1, LINK, LATENCY), s, "average", prof).seconds
    shared = one(Cluster(2, 1, LINK, LATENCY, shared_cores=1), s, "average", prof).seconds
    assert shared - own == pytest.approx(1e-9 * s / 2, rel=1e-6)
    assert Cluster(8, 1, LINK, shared_cores=2).cpu_share == 4
    assert Cluster(2, 1, LINK, shared_cores=4).cpu_share == 1


def test_ops_own_work_is_priced_on_each_ranks_share():
    """The profile's fit for an op adds call + per_byte * bytes + per_tensor * tensors once per
    reduction, on the whole buffer flat and on the rank's shard hierarchically."""
    fit = {"call": 1e-3, "per_byte": 1e-9, "per_tensor": 1e-4}
    without, with_fit = profile(), profile()
    with_fit.per_op = {op: fit for op in ("adasum", "onebit", "randomk", "powersgd")}
    s, layers = 8 * MiB, 16

    def local(schedule):
        return sum(step.compute_s * step.repeat for stage in schedule.stages for step in stage)
    for hier, share in ((False, s), (True, s / 2)):
        cluster = Cluster(2, 2, LINK, LATENCY)
        for build in (lambda p: S.adasum(cluster, s, p, hier, layers),
                      lambda p: S.onebit(cluster, s, p, hier, layers),
                      lambda p: S.randomk(cluster, s, p, hier, 0.01, layers),
                      lambda p: S.powersgd(cluster, s, p, hier, 4, 512, layers)):
            added = local(build(with_fit)) - local(build(without))
            assert added == pytest.approx(1e-3 + 1e-9 * share + 1e-4 * layers, rel=1e-9)


def test_fit_of_an_ops_own_work():
    """Exact points give back their terms; where noise would make a term negative, it is left
    out (0) and the others fitted without it."""
    from horovod_ext.planning.calibrate import fit_op_work
    exact = [(b, t, 2e-3 + 1e-10 * b + 5e-5 * t) for b, t in
             ((2 * MiB, 8), (8 * MiB, 8), (8 * MiB, 32), (4 * MiB, 64), (32 * MiB, 8))]
    fit = fit_op_work(exact)
    assert fit["call"] == pytest.approx(2e-3, rel=1e-6)
    assert fit["per_byte"] == pytest.approx(1e-10, rel=1e-6)
    assert fit["per_tensor"] == pytest.approx(5e-5, rel=1e-6)
    # more tensors, less time: an unconstrained fit gives a negative per-tensor cost
    noisy = [(2 * MiB, 8, 1.0e-3), (8 * MiB, 8, 2.0e-3), (8 * MiB, 64, 1.8e-3)]
    fit = fit_op_work(noisy)
    assert min(fit.values()) >= 0 and fit["per_tensor"] == 0
    assert fit["per_byte"] > 0


def test_hierarchical_chunks_grow_with_the_ranks():
    """An eighth of the buffer (1 to 16 MiB) on a few nodes; on many, chunks large enough that
    each cross-node ring step carries MIN_RING_PIECE per rank, up to one chunk for the buffer."""
    from horovod_ext.backends.partition import MIN_RING_PIECE, pipeline_chunk_bytes
    assert pipeline_chunk_bytes(32 * MiB, ranks=4) == 4 * MiB
    assert pipeline_chunk_bytes(32 * MiB, ranks=256) == MIN_RING_PIECE * 256
    assert pipeline_chunk_bytes(32 * MiB, configured=3 * MiB, ranks=512) == 3 * MiB
    assert S.pipeline_chunks(Cluster(2, 2, LINK), 32 * MiB) == 8
    assert S.pipeline_chunks(Cluster(64, 8, LINK), 25 * MiB) == 1


def test_adasum_sends_what_a_ring_sends_and_onebit_a_32nd():
    """Recursive halving and doubling move 2 (p - 1) / p of the buffer per rank, as a ring
    does; 1-bit's compressed stage sends one bit per element to each of the two phases."""
    prof = profile()
    cluster = Cluster(8, 1, LINK, LATENCY)
    s = 64 * MiB
    ring = S.average(cluster, s, prof, False).sent_per_rank
    assert S.adasum(cluster, s, prof, False, layers=4).sent_per_rank == pytest.approx(ring)
    assert S.onebit(cluster, s, prof, False, layers=4).sent_per_rank == \
        pytest.approx(2 * 7 / 8 * s / 32)


@needs_simgrid
def test_patterns_dealt_among_children_give_what_one_child_gives(monkeypatch):
    """The patterns of a big cluster are simulated in several children, each with its own
    platform; the times are the same as from one."""
    from horovod_ext.planning import simulate
    cluster = Cluster(4, 2, LINK, LATENCY, nodes_per_rack=2, oversubscription=2)
    groups = S.world(cluster)
    patterns = [S.alltoall_pattern(cluster, groups), S.ring_pattern(groups),
                S.pair_pattern(groups, 1, cluster), S.pair_pattern(groups, 2, cluster)]
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    monkeypatch.setattr(simulate, "FLOWS_PER_CHILD", 1)
    dealt = simulate.pattern_times(cluster, profile(), patterns)
    monkeypatch.setattr(simulate, "FLOWS_PER_CHILD", 10 ** 9)
    alone = simulate.pattern_times(cluster, profile(), patterns)
    assert len(simulate._deal(patterns, 3)) == 3
    assert dealt.keys() == alone.keys() and len(alone) == 4
    for pattern, (latency, per_byte) in alone.items():   # the clocks start elsewhere: rounding
        assert dealt[pattern] == pytest.approx((latency, per_byte), rel=1e-9)


def test_alltoall_pattern_keeps_each_nics_load():
    """Folded flows carry all pieces: every rank sends n - 1 pieces in all, and what leaves a
    node is what the full exchange sends off it."""
    cluster = Cluster(4, 2, LINK, LATENCY, nodes_per_rack=2)
    pattern = S.alltoall_pattern(cluster, S.world(cluster))
    sent = {}
    off_node = {}
    for src, dst, weight in pattern.flows:
        sent[src] = sent.get(src, 0) + weight
        if src // 2 != dst // 2:
            off_node[src // 2] = off_node.get(src // 2, 0) + weight
    assert sent == {r: 7.0 for r in range(8)}
    assert off_node == {n: 2 * 6.0 for n in range(4)}


@needs_simgrid
def test_training_step_overlaps_buckets_with_backward():
    """Compute 300 ms (100 forward, 200 backward) and two buckets: the first bucket's reduction
    hides behind backward, the last one's does not."""
    prof = profile()
    cluster = Cluster(2, 1, LINK, LATENCY)
    model = 50 * MiB
    opts = planning.Options(bucket_bytes=25 * MiB)
    (row,) = planning.training_step(cluster, model, 0.3, ["average"], prof, opts, [False])
    bucket = one(cluster, 25 * MiB, "average", prof).seconds
    # first bucket ready at 0.2 s, second at 0.3 s; each reduction takes `bucket`
    end = max(max(0.2 + bucket, 0.3) + bucket, 0.3)
    assert row.step_s == pytest.approx(end, rel=1e-6)
    assert row.comm_s == pytest.approx(2 * bucket, rel=1e-6)
    # a stated optimizer step follows the last reduction
    (timed,) = planning.training_step(cluster, model, 0.3, ["average"], prof, opts, [False],
                                      optimizer_s=0.05)
    assert timed.step_s == pytest.approx(end + 0.05, rel=1e-6)


@needs_simgrid
def test_plan_recommends_the_exact_average_when_compute_dominates():
    result = planning.predict.plan(Cluster(4, 1, 100e9 / 8, 5e-6), 4 * 1e6, 2.0,
                                   profile=profile())
    assert result.recommendation.startswith("hvd.Average")
    assert "hides behind backward" in result.recommendation
    table = result.table()
    for op in planning.OPS.values():
        assert op[0] in table


@needs_simgrid
def test_plan_recommends_compression_on_a_slow_link():
    result = planning.predict.plan(Cluster(8, 1, 100e6 / 8, 100e-6), 4 * 100e6, 0.05,
                                   ops=["average", "onebit"], profile=profile())
    assert "1-bit" in result.recommendation and "faster than the exact average" in \
        result.recommendation


@needs_simgrid
def test_hvdrun_plan_prints_the_table(tmp_path):
    path = tmp_path / "profile.json"
    profile(reduce=1e-10).save(str(path))
    proc = subprocess.run([HVDRUN, "--plan", "--model-size", "25M", "--compute-ms", "50",
                           "--optimizer-ms", "7.5", "--nodes", "4", "--ranks-per-node", "2", "--link", "1gbit",
                           "--plan-profile", str(path)], capture_output=True, text=True,
                          timeout=100, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "4 nodes x 2 ranks, 1 Gbit/s links" in proc.stdout
    assert "compute 50.0 ms per step per rank, optimizer 7.5 ms" in proc.stdout
    assert "recommended:" in proc.stdout
    assert proc.stdout.count("hierarchical") >= len(planning.OPS)


@pytest.mark.parametrize("flags, message", [
    (["--model-size", "lots"], "model size 'lots'"),
    (["--model-size", "25M", "--link", "fast"], "link rate 'fast'"),
    (["--model-size", "25M", "--latency", "soon"], "time 'soon'"),
    (["--model-size", "25M", "--plan-ops", "average,magic"], "unknown ops ['magic']"),
    (["--model-size", "25M", "--plan-profile", "/nonexistent.json"], "no profile at"),
    ([], "--plan needs --model-size"),
])
def test_hvdrun_plan_bad_input_names_the_problem(flags, message):
    proc = subprocess.run([HVDRUN, "--plan", *flags], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 2
    assert message in proc.stderr, proc.stderr


def test_cluster_rejects_impossible_shapes():
    with pytest.raises(ValueError, match="at least one node"):
        Cluster(0, 1, LINK)
    with pytest.raises(ValueError, match="oversubscription"):
        Cluster(4, 1, LINK, nodes_per_rack=2, oversubscription=0.5)
    with pytest.raises(ValueError, match="shared_cores"):
        Cluster(4, 1, LINK, shared_cores=-1)
    assert planning.parse_rate("25Gbit/s") == 25e9 / 8
    assert planning.parse_time("1.5ms") == 1.5e-3
    assert planning.parse_size("1.3B") == 1.3e9


def test_missing_engine_says_how_to_get_it(tmp_path):
    code = ("import sys; sys.modules['simgrid'] = None\n"
            "from horovod_ext.planning import simulate\n"
            "simulate.SYSTEM_FOLDERS = ()\n"
            "try:\n    simulate.locate_simgrid()\n"
            "except simulate.EngineMissing as e:\n    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert "apt-get install python3-simgrid" in proc.stdout, proc.stderr
