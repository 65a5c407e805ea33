"""Lane steps (torch/reduction/lane.py): with HOROVOD_BUCKET_LANE=1 a settled optimizer sums
its gradient buckets in index order on a Gloo group of its own, without an agreement round per
bucket, in the steps whose ticket counts every rank; the results are those of the engine's way
(checked against a single-process reference), and a step where a rank has joined, or where a
rank's gradients never came, goes the engine's way or fills in as before."""
import copy

import pytest
import torch

from tests.harness import run_ranks

# small buckets: several per step; no first bucket of its own; no shared memory, so that the
# engine's way is a call of the world communicator on this one host, as across hosts (through
# shared memory the engine's way is faster than the lane, which then stays off)
LANE = {"HOROVOD_BUCKET_LANE": "1", "HOROVOD_GRADIENT_BUCKET_BYTES": "8192",
        "HOROVOD_FIRST_BUCKET_BYTES": "0", "HOROVOD_SHARED_MEMORY": "0"}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _batch(step, k):
    return torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * step + k))


def _reference_step(ref, ref_opt, step, ranks, size, loss=None):
    """The step DistributedOptimizer takes, in one process: the sum of the gradients of
    ``ranks`` (zeros where a parameter got none) over ``size`` ranks (a joined rank adds
    zeros)."""
    loss = loss or (lambda model, k: model(_batch(step, k)).pow(2).mean())
    grads = []
    for k in ranks:
        ref_opt.zero_grad()
        loss(ref, k).backward()
        grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone()
                      for p in ref.parameters()])
    for i, p in enumerate(ref.parameters()):
        p.grad = sum(g[i] for g in grads) / size
    ref_opt.step()


def _pair(hvd, model, op=None):
    """``model`` under DistributedOptimizer (SGD, ``op`` or Average) and a copy with its plain
    SGD, the reference."""
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   op=op or hvd.Average)
    return model, ref, opt, torch.optim.SGD(ref.parameters(), lr=0.1)


def _largest_difference(model, ref):
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))


def body_lane_steps(steps=8, op_name="Average"):
    """Train ``steps`` steps beside the reference; returns the largest parameter difference,
    the buckets summed on the lane and the buckets per step."""
    import horovod_ext.torch as hvd
    r, n = hvd.rank(), hvd.size()
    model, ref, opt, ref_opt = _pair(hvd, _model(), getattr(hvd, op_name))
    for step in range(steps):
        opt.zero_grad()
        model(_batch(step, r)).pow(2).mean().backward()
        opt.step()
        _reference_step(ref, ref_opt, step, range(n), n if op_name == "Average" else 1)
    return _largest_difference(model, ref), opt._hvd.lane.sums, len(opt._hvd.reducer.buckets)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np,op_name", [(2, "Average"), (4, "Average"), (3, "Average"),
                                        (2, "Sum")])
def test_lane_steps_give_the_reference_result(np, op_name):
    """Average at 2 and 4 ranks sums gradients divided as they came; at 3 ranks it divides
    after the sum; Sum only sums."""
    results = run_ranks(body_lane_steps, np, "gloo", env=LANE, args=(8, op_name))
    for err, sums, buckets in results:
        assert buckets >= 3
        assert err < 1e-6
        # the lane is made after the first full ticket (step 2 on one host): steps 3-8 on it
        assert sums == 6 * buckets, (sums, buckets)


@pytest.mark.timeout(120)
def test_without_the_variable_no_lane():
    env = dict(LANE, HOROVOD_BUCKET_LANE="0")
    for err, sums, _ in run_ranks(body_lane_steps, 2, "gloo", env=env):
        assert err < 1e-6 and sums == 0


@pytest.mark.timeout(120)
def test_through_shared_memory_no_lane():
    """All ranks on one host with shared memory (the default): the engine's way sums the
    buckets there, which is faster than the lane's Gloo group, so no step goes on the lane."""
    env = dict(LANE, HOROVOD_SHARED_MEMORY="1")
    for err, sums, buckets in run_ranks(body_lane_steps, 2, "gloo", env=env, args=(8, "Average")):
        assert buckets >= 3
        assert err < 1e-6 and sums == 0


def body_lane_sums_of(op_name, compression_name):
    """The buckets summed on the lane over 8 steps of an optimizer with this op and
    compression."""
    import horovod_ext.torch as hvd
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   op=getattr(hvd, op_name),
                                   compression=getattr(hvd.Compression, compression_name))
    for step in range(8):
        opt.zero_grad()
        model(_batch(step, hvd.rank())).pow(2).mean().backward()
        opt.step()
    return opt._hvd.lane.sums


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op_name,compression_name", [("Sum", "fp16"), ("Average", "fp16"),
                                                      ("Max", "none")])
def test_ops_that_do_not_sum_stay_off_the_lane(op_name, compression_name):
    assert run_ranks(body_lane_sums_of, 2, "gloo", env=LANE,
                     args=(op_name, compression_name)) == [0, 0]


def body_join(steps_of):
    """Rank k trains ``steps_of[k]`` steps, then joins: its farewell on the lane gives the
    others' next step its zeros and turns the lane off; their steps after that go the engine's
    way (their tickets count fewer than every rank), with the joined rank's zeros too."""
    import horovod_ext.torch as hvd
    r, n = hvd.rank(), hvd.size()
    model, ref, opt, ref_opt = _pair(hvd, _model())
    for step in range(steps_of[r]):
        opt.zero_grad()
        model(_batch(step, r)).pow(2).mean().backward()
        opt.step()
        _reference_step(ref, ref_opt, step, [k for k in range(n) if steps_of[k] > step], n)
    hvd.join()
    return _largest_difference(model, ref), opt._hvd.lane.sums, len(opt._hvd.reducer.buckets)


@pytest.mark.timeout(120)
def test_steps_after_a_rank_joined_go_the_engines_way():
    results = run_ranks(body_join, 2, "gloo", env=LANE, args=([8, 5],))
    for err, _, _ in results:
        assert err < 1e-6
    # steps 3-5 on the lane; rank 0's step 6 too, with rank 1's farewell; 7-8 the engine's
    assert [sums for _, sums, _ in results] == [4 * results[0][2], 3 * results[1][2]], results


def body_all_join(steps):
    """Every rank trains the same steps and joins: the farewells meet each other."""
    import horovod_ext.torch as hvd
    from horovod_ext.torch.reduction import lane
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for step in range(steps):
        opt.zero_grad()
        model(_batch(step, hvd.rank())).pow(2).mean().backward()
        opt.step()
    on_before = opt._hvd.lane.on
    last = hvd.join()
    return on_before, opt._hvd.lane.on, last in range(hvd.size()), len(lane._ON)


@pytest.mark.timeout(120)
def test_every_rank_joining_at_once_meets_on_the_lane():
    assert run_ranks(body_all_join, 2, "gloo", env=LANE, args=(5,)) == [(True, False, True, 0)] * 2


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(32, 64)
        self.heads = torch.nn.ModuleList([torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)])

    def forward(self, x, head):
        return self.heads[head](torch.relu(self.trunk(x)))


def body_unused_head(steps=8):
    """Each step every rank trains one of two heads, a different one on each rank: the other
    head's gradients never come and are reduced as zeros, on the lane too."""
    import horovod_ext.torch as hvd
    r, n = hvd.rank(), hvd.size()
    model, ref, opt, ref_opt = _pair(hvd, TwoHeads())
    for step in range(steps):
        def loss(m, k):
            return m(_batch(step, k), (step + k) % 2).pow(2).mean()
        opt.zero_grad()
        loss(model, r).backward()
        opt.step()
        _reference_step(ref, ref_opt, step, range(n), n, loss)
    return _largest_difference(model, ref), opt._hvd.lane.sums, len(opt._hvd.reducer.buckets)


@pytest.mark.timeout(120)
def test_gradients_that_never_came_are_zeros_on_the_lane():
    for err, sums, buckets in run_ranks(body_unused_head, 2, "gloo", env=LANE):
        assert buckets >= 2
        assert err < 1e-6
        assert sums == 6 * buckets, (sums, buckets)


def body_rank_fails_on_the_lane(how, far):
    """Rank 1 fails in its second lane step, having started its first bucket on the lane:
    ``how`` "dies" (exits) or "stops" (SIGSTOP).  Rank 0, waiting for that bucket's sum with a
    30-minute lane timeout, fails (at once, or once rank 1's heartbeats stop), naming rank 1.
    ``far``: the pair is taken for a far one (any probe counts as far), whose lane sums by
    exchange; else the ring.  Returns (step, message, seconds into the step, the pair's far)."""
    import os
    import signal
    import time
    import horovod_ext.torch as hvd
    from horovod_ext.backends import lane, pair_exchange
    if far:
        pair_exchange.FAR_EXCHANGE_S = 0.0
    r = hvd.rank()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    buckets = len(opt._hvd.reducer.buckets)
    if r == 1:
        start, started = lane.Lane.start, []

        def start_then_fail(self, tensor, *args):
            if len(started) == buckets + 1:    # the second lane step's second bucket
                if how == "dies":
                    os._exit(3)
                os.kill(os.getpid(), signal.SIGSTOP)
            started.append(1)
            return start(self, tensor, *args)
        lane.Lane.start = start_then_fail
    began = time.monotonic()
    try:
        for step in range(20):
            began = time.monotonic()
            opt.zero_grad()
            model(_batch(step, r)).pow(2).mean().backward()
            opt.step()
    except hvd.HorovodInternalError as exc:
        return step, str(exc), time.monotonic() - began, opt._hvd.lane.lane.comm.pair.far
    return None


def _fail_on_the_lane(how, far, beat):
    """Rank 0's result of body_rank_fails_on_the_lane.  A far pair runs on two pretend hosts
    (a pair on one host is near without timing), with size buckets, so that the lane starts
    without a trial of plans."""
    env = dict(LANE, HOROVOD_HEARTBEAT_SECONDS=str(beat), HOROVOD_COMM_TIMEOUT_SECONDS="60")
    if far:
        env["HOROVOD_GRADIENT_BUCKET_PLAN"] = "size"
    failure = run_ranks(body_rank_fails_on_the_lane, 2, "gloo", env=env, args=(how, far),
                        expect_failure=True, timeout=60, settle_on=[0],
                        hostnames=["a", "b"] if far else None)
    step, message, took, was_far = failure.results[0]
    assert was_far == far
    assert "rank 1" in message, message
    return step, message, took


@pytest.mark.timeout(120)
@pytest.mark.parametrize("far", [False, True], ids=["ring", "exchange"])
def test_a_rank_dying_on_the_lane_is_reported_at_once(far):
    step, message, took = _fail_on_the_lane("dies", far, beat=1.0)
    assert step == 3 or (far and step > 3), (step, message)   # one host: the lane from step 2
    assert took < 10, took                 # not the 60 s timeout


@pytest.mark.timeout(120)
def test_a_rank_stopped_on_the_lane_is_named_within_two_heartbeats():
    beat = 1.0
    step, message, took = _fail_on_the_lane("stops", True, beat)
    assert step >= 3, (step, message)
    assert "has stopped answering" in message, message
    assert took < 2 * beat + 2.0, took        # a step's compute, then two heartbeats


def body_reinit():
    """Five steps, hvd.shutdown() and hvd.init(), five more: the new world makes its own lane
    (after its first full ticket), and the results stay the reference's."""
    import horovod_ext.torch as hvd
    r, n = hvd.rank(), hvd.size()
    model, ref, opt, ref_opt = _pair(hvd, _model())
    sums = []
    for step in range(10):
        if step == 5:
            sums.append(opt._hvd.lane.sums)
            hvd.shutdown()
            hvd.init()
        opt.zero_grad()
        model(_batch(step, r)).pow(2).mean().backward()
        opt.step()
        _reference_step(ref, ref_opt, step, range(n), n)
    sums.append(opt._hvd.lane.sums)
    return _largest_difference(model, ref), sums, len(opt._hvd.reducer.buckets)


@pytest.mark.timeout(120)
def test_a_new_world_makes_its_own_lane():
    for err, sums, buckets in run_ranks(body_reinit, 2, "gloo", env=LANE):
        assert err < 1e-6
        # steps 3-5 on the first world's lane; in the second, step 6 learns the order again,
        # step 7 has the first full ticket, steps 8-10 go on the new lane
        assert sums == [3 * buckets, 6 * buckets], (sums, buckets)


def body_timeline(path, steps=6):
    """Train ``steps`` steps with a timeline recording from the start; returns the buckets per
    step and the lane's sums."""
    import horovod_ext.torch as hvd
    r = hvd.rank()
    hvd.start_timeline(path)
    model, _, opt, _ = _pair(hvd, _model())
    for step in range(steps):
        opt.zero_grad()
        model(_batch(step, r)).pow(2).mean().backward()
        opt.step()
    hvd.stop_timeline()
    return len(opt._hvd.reducer.buckets), opt._hvd.lane.sums


@pytest.mark.timeout(120)
def test_lane_sums_show_on_the_timeline(tmp_path):
    """Each lane sum is a GLOO_ALLREDUCE on its bucket's track, outside any engine execution
    and without a negotiation: a bucket's track holds the engine's two steps (a negotiation
    and an ALLREDUCE each), then the lane's four."""
    from horovod_ext.engine import timeline
    path = str(tmp_path / "lane.json")
    (buckets, sums), _ = run_ranks(body_timeline, 2, "gloo", env=LANE, args=(path,))
    assert sums == 4 * buckets                      # steps 3-6 on the lane
    events = timeline.load(path)
    pids = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    for index in range(buckets):
        track = f"allreduce.DistributedOptimizer.bucket.{index}"
        on_track = [e for e in events if pids.get(e.get("pid")) == track]
        engine = [e for e in on_track if e["name"] == "ALLREDUCE"]   # an engine execution
        alone = [e for e in on_track if e["name"] == "GLOO_ALLREDUCE" and not any(
            x["ts"] <= e["ts"] <= x["ts"] + x["dur"] for x in engine)]
        negotiations = [e for e in on_track if e["name"] == "NEGOTIATE_ALLREDUCE"]
        assert len(engine) == 2 and len(negotiations) == 2, (track, on_track)
        assert len(alone) == 4, (track, on_track)
        assert all(e["ts"] > x["ts"] for e in alone for x in engine)
        assert all(e["dur"] >= 0 and e["args"]["bytes"] > 0 for e in alone)


def body_late_rank(late, late_s):
    """Rank ``late`` starts its sixth step (a lane step) ``late_s`` late; returns each rank's
    lane sums and its warnings about the lane."""
    import logging
    import time
    import horovod_ext.torch as hvd
    r = hvd.rank()
    warnings = []

    class Keep(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())
    logging.getLogger("horovod_ext").addHandler(Keep(logging.WARNING))
    model, _, opt, _ = _pair(hvd, _model())
    for step in range(7):
        if step == 5 and r == late:
            time.sleep(late_s)       # the late rank itself, not a wait for the others
        opt.zero_grad()
        model(_batch(step, r)).pow(2).mean().backward()
        opt.step()
    return opt._hvd.lane.sums, [w for w in warnings if "on the lane has waited" in w]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("late,disabled", [(1, False), (0, False), (1, True)])
def test_a_late_rank_is_named_at_the_stall_check_time(late, disabled):
    """A lane sum that waits HOROVOD_STALL_CHECK_TIME_SECONDS warns once, naming the rank that
    had not started it by its last heartbeat (rank 0 knows every rank's progress; the others
    learn it from rank 0's beats), and never with HOROVOD_STALL_CHECK_DISABLE=1."""
    env = dict(LANE, HOROVOD_STALL_CHECK_TIME_SECONDS="1", HOROVOD_HEARTBEAT_SECONDS="0.2",
               HOROVOD_STALL_CHECK_DISABLE="1" if disabled else "0")
    results = run_ranks(body_late_rank, 2, "gloo", env=env, args=(late, 2.5))
    assert results[0][0] == results[1][0] > 0
    assert results[late][1] == []
    warned = results[1 - late][1]
    if disabled:
        assert warned == []
    else:
        assert len(warned) == 1, warned
        assert f"waited 1 s for rank {late}, which had not started it" in warned[0], warned


def body_lane_pair_sums(far):
    """Sums of several sizes and dtypes started together on a two-rank lane, then waited for
    in order; returns, per sum, whether it went by exchange, and whether it equals a Gloo
    all_reduce of the same values bitwise.  ``far``: the pair is taken for a far one (any
    probe counts as far), with 1 MiB for its largest exchange, so that one test holds both
    ways without a 64 MiB buffer."""
    import torch.distributed as dist
    import horovod_ext.torch as hvd
    from horovod_ext.backends import lane, pair_exchange
    from horovod_ext.engine import runtime
    if far:
        pair_exchange.FAR_EXCHANGE_S, pair_exchange.FAR_MAX_BYTES = 0.0, 1 << 20
    r = hvd.rank()
    the_lane = lane.open_lane(runtime.topology(), None)
    plain = dist.new_group([0, 1], backend="gloo")
    sizes = [(0, torch.float32), (1, torch.float32), (1000, torch.float16),
             (3000, torch.bfloat16), (1 << 18, torch.float32),        # 1 MiB: by exchange
             ((1 << 18) + 1, torch.float32), (5, torch.float64)]     # one float more: ring
    made = [torch.randn(n, generator=torch.Generator().manual_seed(10 * r + i)).to(dtype)
            for i, (n, dtype) in enumerate(sizes)]
    wanted = [t.clone() for t in made]
    sums = [the_lane.start(t) for t in made]
    for w in wanted:
        dist.all_reduce(w, group=plain)
    for s in sums:
        s.wait()
    return [(isinstance(s._work, pair_exchange.SumInFlight), torch.equal(t, w))
            for s, t, w in zip(sums, made, wanted)]


@pytest.mark.timeout(120)
def test_a_far_pair_sums_its_buckets_on_the_lane_by_exchange():
    """A far pair: up to its limit by one exchange of whole buffers, larger ones on Gloo's
    ring, all in flight together, each the bits of a plain all_reduce.  A near pair (two
    pretend hosts on loopback) keeps the ring for every one."""
    env = {"HOROVOD_SHARED_MEMORY": "0"}
    for result in run_ranks(body_lane_pair_sums, 2, "gloo", env=env, hostnames=["a", "b"],
                            args=(True,)):
        assert result == [(True, True)] * 5 + [(False, True), (True, True)], result
    for result in run_ranks(body_lane_pair_sums, 2, "gloo", env=env, hostnames=["a", "b"],
                            args=(False,)):
        assert result == [(False, True)] * 7, result
