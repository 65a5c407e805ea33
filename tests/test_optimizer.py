"""DistributedOptimizer against a single-process reference on the concatenated batch."""
import pytest
import torch

from horovod_ext.torch import bucket_timing
from tests.harness import BACKENDS, run_ranks

BATCH = 4          # samples per rank per backward pass
# the first step learns the arrival order, the next TIMING_STEPS time backward: the buckets
# cut from those times serve from this step (an index from 0) on
STEPS_TO_TIMED_PLAN = 1 + bucket_timing.TIMING_STEPS


class Net(torch.nn.Module):
    """Two layers plus one that only some steps (and ranks) use."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8)
        self.fc2 = torch.nn.Linear(8, 3)
        self.rare = torch.nn.Linear(8, 3)

    def forward(self, x, use_rare=False):
        h = torch.relu(self.fc1(x))
        out = self.fc2(h)
        return out + self.rare(h) if use_rare else out


def data(step, micro, n):
    g = torch.Generator().manual_seed(7919 * step + 31 * micro)
    return torch.randn(n * BATCH, 6, generator=g), torch.randint(0, 3, (n * BATCH,), generator=g)


def make(opt_name, seed=0):
    torch.manual_seed(seed)
    model = Net().double()
    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, opt


def body_matches_reference(opt_name, bpps, steps, compression, clip, groups):
    import horovod_ext.torch as hvd
    r, n = hvd.rank(), hvd.size()
    model, opt = make(opt_name)
    ref_model, ref_opt = make(opt_name)
    comp = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16,
            "bf16": hvd.Compression.bf16}[compression]
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   backward_passes_per_step=bpps, compression=comp,
                                   groups=groups)
    assert isinstance(opt, torch.optim.SGD if opt_name == "sgd" else torch.optim.Adam)
    lossf = torch.nn.CrossEntropyLoss()
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(bpps):
            x, y = data(step, micro, n)
            use_rare = step % 3 == 1 and (micro == 0)
            # every rank gets its slice; rank 0 alone uses the rare layer on odd steps
            mine = slice(r * BATCH, (r + 1) * BATCH)
            lossf(model(x[mine].double(), use_rare and r == 0), y[mine]).backward()
            # reference: the mean over ranks of each rank's loss, on one process
            ref = sum(lossf(ref_model(x[k * BATCH:(k + 1) * BATCH].double(),
                                      use_rare and k == 0), y[k * BATCH:(k + 1) * BATCH])
                      for k in range(n)) / n
            ref.backward()
        # As in Horovod, a parameter no rank used this step is reduced as a zero gradient (so
        # the optimizer still steps it); the reference does the same.
        for q in ref_model.parameters():
            if q.grad is None:
                q.grad = torch.zeros_like(q)
        if clip:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        ref_opt.step()
    tol = {"none": 1e-9, "fp16": 2e-3, "bf16": 2e-2}[compression]
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    # every rank holds exactly the same parameters
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0))
    assert all(torch.equal(gathered[0], gathered[k]) for k in range(n))
    return "ok"


CASES = [
    # opt, bpps, steps, compression, clip, groups
    ("sgd", 1, 4, "none", False, None),
    ("adam", 1, 4, "none", False, None),
    ("adam", 4, 3, "none", False, None),
    ("sgd", 1, 3, "fp16", False, None),
    ("adam", 1, 3, "bf16", False, None),
    ("sgd", 1, 3, "none", True, None),
    ("adam", 2, 3, "none", True, 2),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("np", [2, 3])
def test_average_matches_single_process_training(backend, np):
    # One set of ranks runs every case, to pay the process start-up once.
    assert run_ranks(body_cases, np, backend) == ["ok"] * np


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_process_reduces_nothing_and_matches(backend):
    """At one process an elementwise op leaves each gradient as it is (compression's round trip
    aside): no buckets, no engine requests, the same training as the reference."""
    assert run_ranks(body_alone, 1, backend) == ["ok"]


def body_alone():
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    body_cases()
    model, opt = make("sgd")
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   op=hvd.Average, compression=hvd.Compression.fp16,
                                   gradient_predivide_factor=4.0)
    from horovod_ext.torch.reduction import AloneReducer
    assert opt._hvd.plan.alone and isinstance(opt._hvd.reducer, AloneReducer)   # no buckets
    engine = runtime.engine_for(0)
    submitted = []
    submit = engine.submit
    engine.submit = lambda request, *a, **k: (submitted.append(request.name),
                                              submit(request, *a, **k))[1]
    x, y = data(0, 0, 1)
    torch.nn.functional.cross_entropy(model(x.double()), y).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.synchronize()
    changed = False
    for n, p in model.named_parameters():
        # what a reduction over one rank returns: the gradient through fp16 and back (the
        # predivide factor and its inverse are powers of two: exact), zeros where none came
        g = grads.get(n, torch.zeros_like(p))
        expected = g.to(torch.float16).to(g.dtype)
        assert torch.equal(p.grad, expected), n
        changed |= not torch.equal(expected, g)
    assert changed, "fp16 left every gradient as it was: the test would not see a skipped trip"
    opt.step()
    engine.submit = submit
    assert submitted == []
    return "ok"


@pytest.mark.timeout(180)
def test_without_fusion():
    assert run_ranks(body_cases, 2, "gloo", env={"HOROVOD_FUSION_THRESHOLD": "0"}) == ["ok"] * 2


def body_cases():
    for case in CASES:
        body_matches_reference(*case)
    return "ok"


@pytest.mark.timeout(180)
def test_small_gradient_buckets():
    """Buckets of at most 200 bytes: several per model, small tensors sharing one, a bigger
    tensor alone; the same results as the reference."""
    env = {"HOROVOD_GRADIENT_BUCKET_BYTES": "200"}
    assert run_ranks(body_cases, 2, "gloo", env=env) == ["ok"] * 2


def test_bucket_plan():
    """Reverse parameter order, split by size and by dtype; a bigger tensor gets its own."""
    from horovod_ext.torch.buckets import plan
    params = [torch.zeros(10), torch.zeros(30), torch.zeros(5), torch.zeros(4, dtype=torch.float64),
              torch.zeros(3, dtype=torch.float64)]
    buckets = plan(params, cap=100)   # bytes
    assert [[p.numel() for p in b.params] for b in buckets] == [[3, 4], [5], [30], [10]]
    assert [b.flat.dtype for b in buckets] == [torch.float64] + [torch.float32] * 3
    assert [b.index for b in buckets] == [0, 1, 2, 3]
    # the views are the parameters' shapes, back to back in the flat buffer
    b = buckets[0]
    assert b.views[id(params[4])].data_ptr() == b.flat.data_ptr()
    assert b.views[id(params[3])].data_ptr() == b.flat.data_ptr() + 3 * 8


def test_first_bucket_cap():
    """The first bucket (backward's first gradients: the last parameters) closes once it holds
    ``first_cap`` bytes, the gradient that crosses it included, the others hold at most
    ``cap``; 0 leaves the first as the others."""
    from horovod_ext.torch.buckets import partition
    params = [torch.zeros(n) for n in (40, 40, 10, 10, 10)]   # 160, 160, 40, 40, 40 bytes
    sizes = lambda groups: [[p.numel() for p in g] for g in groups]  # noqa: E731
    assert sizes(partition(params, cap=1000)) == [[10, 10, 10, 40, 40]]
    assert sizes(partition(params, cap=1000, first_cap=80)) == [[10, 10], [10, 40, 40]]
    assert sizes(partition(params, cap=1000, first_cap=100)) == [[10, 10, 10], [40, 40]]
    assert sizes(partition(params, cap=1000, first_cap=150)) == [[10, 10, 10, 40], [40]]
    assert sizes(partition(params, cap=1000, first_cap=0)) == [[10, 10, 10, 40, 40]]
    # a first tensor bigger than the first cap is a bucket of its own
    assert sizes(partition(params[:2], cap=400, first_cap=100)) == [[40], [40]]
    # the crossing gradient stays out where it would pass the cap of every bucket (with
    # cap=1000 the same first cap takes it in: [[10, 10, 10, 40], [40]] above)
    assert sizes(partition(params, cap=200, first_cap=150)) == [[10, 10, 10], [40], [40]]


def test_first_bucket_is_ddps():
    """With DDP's caps (1 MiB first, 25 MiB after) the first bucket holds the parameters DDP's
    own assignment puts in its first, for models whose small last layers precede a large one;
    the later buckets never pass the cap."""
    import torch.distributed as dist
    from horovod_ext.torch.buckets import partition
    first, cap = 1 << 20, 25 << 20
    gen = torch.Generator().manual_seed(0)
    shapes = [[(1024, 784), (1024,), (1024, 1024), (1024,), (10, 1024), (10,)]]   # the MLP
    for _ in range(20):
        count = int(torch.randint(2, 12, (1,), generator=gen))
        small = torch.randint(1, 1 << 17, (count,), generator=gen)   # up to 512 KiB
        large = torch.randint(0, 2, (count,), generator=gen) * 24 + 1   # some 25x that
        shapes.append([(int(n),) for n in small * large])
    for case in shapes:
        params = [torch.empty(s) for s in case]
        ours = partition(params, cap, first)
        reverse = list(reversed(params))
        theirs, _ = dist._compute_bucket_assignment_by_size(reverse, [first, cap],
                                                            [False] * len(reverse))
        assert [id(p) for p in ours[0]] == [id(reverse[i]) for i in theirs[0]], case
        assert all(sum(p.numel() * 4 for p in g) <= cap or len(g) == 1 for g in ours[1:]), case
        assert [p for g in ours for p in g] == reverse


@pytest.mark.timeout(180)
def test_small_first_bucket():
    """HOROVOD_FIRST_BUCKET_BYTES gives the same results as the reference."""
    env = {"HOROVOD_FIRST_BUCKET_BYTES": "64"}
    assert run_ranks(body_cases, 2, "gloo", env=env) == ["ok"] * 2


@pytest.mark.parametrize("grad_mode", [False, True])   # as in backward, and create_graph's
def test_bucket_adopts_whatever_gradient_it_finds(grad_mode):
    """None -> zeros, a foreign tensor -> copied in, a sparse one -> densified or refused;
    afterwards .grad is the bucket's slice."""
    with torch.set_grad_enabled(grad_mode):
        adopts_whatever_gradient_it_finds()


def adopts_whatever_gradient_it_finds():
    from horovod_ext.torch.buckets import Bucket
    p = torch.nn.Parameter(torch.zeros(2, 3))
    b = Bucket(0, [p])
    b.flat.fill_(7.0)
    b.adopt(p, sparse_ok=False, name="w")
    assert torch.equal(p.grad, torch.zeros(2, 3)) and p.grad.data_ptr() == b.flat.data_ptr()
    p.grad = torch.ones(2, 3)
    b.adopt(p, sparse_ok=False, name="w")
    assert torch.equal(b.flat, torch.ones(6)) and p.grad.data_ptr() == b.flat.data_ptr()
    p.grad.add_(1.0)                       # in place on the slice: stays the slice
    b.adopt(p, sparse_ok=False, name="w")
    assert torch.equal(b.flat, torch.full((6,), 2.0))
    sparse = torch.sparse_coo_tensor([[0], [1]], [5.0], (2, 3), check_invariants=True)
    p.grad = sparse
    with pytest.raises(ValueError, match="sparse gradient for w"):
        b.adopt(p, sparse_ok=False, name="w")
    b.adopt(p, sparse_ok=True, name="w")
    assert b.flat.tolist() == [0, 5, 0, 0, 0, 0]


@pytest.mark.parametrize("grad_mode", [False, True])
def test_bucket_divides_as_it_adopts(grad_mode):
    """With a divisor the copy divides, and a gradient already in its slice is divided there;
    with grad mode on (a create_graph backward) a gradient that requires grad is copied too."""
    from horovod_ext.torch.buckets import Bucket
    p = torch.nn.Parameter(torch.zeros(2, 3))
    b = Bucket(0, [p])
    grad = torch.randn(2, 3)
    with torch.set_grad_enabled(grad_mode):
        p.grad = grad.clone().requires_grad_(grad_mode)
        b.adopt(p, sparse_ok=False, name="w", divisor=4)
        assert torch.equal(p.grad, grad / 4) and p.grad.data_ptr() == b.flat.data_ptr()
        p.grad.add_(grad)                      # accumulated in its slice
        b.adopt(p, sparse_ok=False, name="w", divisor=4)
    assert torch.equal(b.flat.view(2, 3), (grad / 4 + grad) / 4)


@pytest.mark.parametrize("ranks,dtype,compression,predivide,op,divisor", [
    (2, torch.float32, "none", 1.0, "average", 2),
    (8, torch.float64, "none", 1.0, "average", 8),
    (4, torch.bfloat16, "none", 1.0, "average", 4),
    (3, torch.float32, "none", 1.0, "average", 1),     # 1/3 rounds: divided after the sum
    (6, torch.float32, "none", 1.0, "average", 1),
    (1, torch.float32, "none", 1.0, "average", 1),
    (2, torch.float16, "none", 1.0, "average", 1),     # fp16's subnormals start at 6e-5
    (2, torch.float32, "fp16", 1.0, "average", 1),     # the wire is fp16
    (2, torch.float32, "none", 4.0, "average", 1),     # Horovod's predivide factor applies
    (2, torch.float32, "none", 1.0, "sum", 1),
    (2, torch.float32, "none", 1.0, "max", 1),
])
def test_bucket_divisor(ranks, dtype, compression, predivide, op, divisor):
    """Gradients are divided as they enter their bucket only where dividing first and summing
    gives the average bit for bit."""
    import horovod_ext.torch as hvd
    from horovod_ext.ops import get_op
    from horovod_ext.torch.reduction.state import Settings
    settings = Settings(op=get_op(op), compression=getattr(hvd.Compression, compression),
                        process_set=hvd.global_process_set, predivide=predivide)
    assert settings.bucket_divisor(dtype, ranks) == divisor


def body_divided_buckets(set_to_none, bpps):
    """A bucket's average, with its gradients divided as they came and then summed, is bit for
    bit the average of the same flat gradients by ``hvd.allreduce(op=Average)``; returns the
    ops the buckets were reduced with."""
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    r, n = hvd.rank(), hvd.size()
    model, opt = make("sgd")
    local, _ = make("sgd")        # the same model, trained on this rank's data alone
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   backward_passes_per_step=bpps)
    engine = runtime.engine_for(0)
    submit, ops = engine.submit, set()
    engine.submit = lambda request, *a, **k: (
        ops.add(request.op) if request.name.startswith("DistributedOptimizer.bucket") else None,
        submit(request, *a, **k))[1]
    index = {id(p): i for i, p in enumerate(model.parameters())}
    lossf = torch.nn.CrossEntropyLoss()
    for step in range(3):
        opt.zero_grad(set_to_none=set_to_none)
        local.zero_grad()
        for micro in range(bpps):
            x, y = data(step, micro, n)
            mine = slice(r * BATCH, (r + 1) * BATCH)
            for m in (model, local):
                lossf(m(x[mine].double()), y[mine]).backward()
        opt.synchronize()
        [bucket] = opt._hvd.reducer.buckets
        mine = list(local.parameters())
        flat = torch.cat([mine[index[id(p)]].grad.reshape(-1)
                          if mine[index[id(p)]].grad is not None
                          else torch.zeros(p.numel(), dtype=p.dtype) for p in bucket.params])
        expected = hvd.allreduce(flat, op=hvd.Average, name=f"reference.{step}")
        assert torch.equal(bucket.flat, expected), step
        with opt.skip_synchronize():
            opt.step()
        local.load_state_dict(model.state_dict())
    engine.submit = submit
    return sorted(ops)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np,set_to_none,bpps", [(2, True, 1), (4, False, 2)])
def test_buckets_divide_before_they_sum(np, set_to_none, bpps):
    """At 2 and 4 ranks (exact divisions) the buckets are summed after their gradients were
    divided, gradients copied in (set_to_none) or accumulated in place over two passes.  The
    engine's way: bit for bit needs the reference's order of summing, and the bucket lane sums in
    Gloo's ring order (tests/test_lane.py checks its averages against a reference)."""
    assert run_ranks(body_divided_buckets, np, "gloo", args=(set_to_none, bpps),
                     env={"HOROVOD_BUCKET_LANE": "0"}) == [["sum"]] * np


def body_bucket_views():
    """Gradients live in the buckets after every step, whichever zero_grad ran (the optimizer's
    with and without set_to_none, the module's); a replaced .grad and a second backward before
    step() are handled."""
    import horovod_ext.torch as hvd
    r, n = hvd.rank(), hvd.size()
    model, opt = make("sgd")
    ref_model, ref_opt = make("sgd")
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    buckets = opt._hvd.reducer.buckets
    assert len(buckets) == 1 and len(buckets[0].params) == 6
    lossf = torch.nn.CrossEntropyLoss()
    for step in range(4):
        if step == 2:
            model.zero_grad(set_to_none=True)    # the module's zero_grad, not the optimizer's
        elif step == 1:
            opt.zero_grad(set_to_none=False)     # buckets zeroed in place, still the gradients
            assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
        else:
            opt.zero_grad()                      # torch's default: gradients become None
            assert all(p.grad is None for p in model.parameters())
        ref_opt.zero_grad()
        x, y = data(step, 0, n)
        mine = slice(r * BATCH, (r + 1) * BATCH)
        lossf(model(x[mine].double()), y[mine]).backward()
        if step == 3:
            model.fc1.bias.grad = model.fc1.bias.grad.clone()   # a user's own tensor
        ref = sum(lossf(ref_model(x[k * BATCH:(k + 1) * BATCH].double()),
                        y[k * BATCH:(k + 1) * BATCH]) for k in range(n)) / n
        ref.backward()
        for q in ref_model.parameters():
            if q.grad is None:
                q.grad = torch.zeros_like(q)
        opt.step()
        ref_opt.step()
        buckets = opt._hvd.reducer.buckets   # planned anew in arrival order after step 0
        lo = buckets[0].flat.data_ptr()
        hi = lo + buckets[0].flat.numel() * 8
        assert all(lo <= p.grad.data_ptr() < hi for p in model.parameters()), step
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9)
    opt.zero_grad()
    x, y = data(9, 0, n)
    lossf(model(x[:BATCH].double()), y[:BATCH]).backward()
    try:
        lossf(model(x[:BATCH].double()), y[:BATCH]).backward()
        again = None
    except RuntimeError as exc:
        again = str(exc)
    opt.synchronize()
    return again


@pytest.mark.timeout(120)
def test_gradients_live_in_buckets():
    for message in run_ranks(body_bucket_views, 2, "gloo"):
        assert message is not None and "computed again before step()" in message


def body_bad_names():
    import horovod_ext.torch as hvd
    model, opt = make("sgd")
    errors = []
    named = list(model.named_parameters())
    for bad in (named + named[:1], named[1:]):
        try:
            hvd.DistributedOptimizer(opt, named_parameters=bad)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


@pytest.mark.timeout(60)
def test_duplicate_or_missing_names_are_errors():
    dup, missing = run_ranks(body_bad_names, 1, "gloo")[0]
    assert "duplicate names" in dup and "fc1.weight" in dup
    assert "does not name 1" in missing


def body_delta_mode():
    """An Average op that asks for delta mode: local Adam steps, then the averaged change."""
    import horovod_ext.torch as hvd
    from horovod_ext.ops import AverageOp

    class DeltaAverage(AverageOp):
        def __init__(self):
            super().__init__()
            self.name = "delta_average_test"

        def wants_delta(self, optimizer):
            return True

    op = hvd.register_op(DeltaAverage())
    r, n = hvd.rank(), hvd.size()
    model, opt = make("adam")
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=op)
    # reference: n replicas with their own Adam state, averaged after every step
    replicas = [make("adam") for _ in range(n)]
    lossf = torch.nn.CrossEntropyLoss()
    for step in range(3):
        x, y = data(step, 0, n)
        opt.zero_grad()
        mine = slice(r * BATCH, (r + 1) * BATCH)
        lossf(model(x[mine].double()), y[mine]).backward()
        opt.step()
        starts = [p.detach().clone() for p in replicas[0][0].parameters()]
        deltas = []
        for k, (m, o) in enumerate(replicas):
            o.zero_grad()
            lossf(m(x[k * BATCH:(k + 1) * BATCH].double()), y[k * BATCH:(k + 1) * BATCH]).backward()
            o.step()
            deltas.append([p.detach() - s for p, s in zip(m.parameters(), starts)])
        with torch.no_grad():
            for m, _ in replicas:
                for i, p in enumerate(m.parameters()):
                    p.copy_(starts[i] + sum(d[i] for d in deltas) / n)
    for p, q in zip(model.parameters(), replicas[0][0].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9)
    return "ok"


@pytest.mark.timeout(120)
def test_delta_mode_with_average():
    assert run_ranks(body_delta_mode, 2, "gloo") == ["ok"] * 2


def body_broadcast_state(path):
    """Ranks start different; rank 0's model and optimizer state (Adam, SGD momentum) reach all,
    and a checkpoint saved by rank 0 restores on every rank."""
    import horovod_ext.torch as hvd
    r = hvd.rank()
    lossf = torch.nn.CrossEntropyLoss()
    out = {}
    for opt_name in ("adam", "sgd"):
        model, opt = make(opt_name, seed=r)
        for group in opt.param_groups:
            group["lr"] *= 1 + r          # hyper-parameters differ too
        x, y = data(0, 0, 1)
        lossf(model(x.double()), y).backward()
        opt.step()                         # creates state (exp_avg / momentum_buffer)
        if r == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
        hvd.barrier()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        saved = torch.load(path, weights_only=False)
        for k, v in model.state_dict().items():
            assert torch.equal(v, saved["model"][k]), k
        mine, theirs = opt.state_dict(), saved["opt"]
        assert mine["param_groups"] == theirs["param_groups"]
        for pid, st in theirs["state"].items():
            for k, v in st.items():
                got = mine["state"][pid][k]
                assert torch.equal(got, v) if torch.is_tensor(v) else got == v, (pid, k)
        # and training goes on identically everywhere
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        for step in range(2):
            opt.zero_grad()
            x, y = data(10 + step, 0, hvd.size())
            mine_rows = slice(r * BATCH, (r + 1) * BATCH)
            lossf(model(x[mine_rows].double()), y[mine_rows]).backward()
            opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        g = hvd.allgather(flat.unsqueeze(0))
        out[opt_name] = all(torch.equal(g[0], g[k]) for k in range(hvd.size()))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcast_state_and_checkpoint_restore(backend, tmp_path):
    path = str(tmp_path / "ckpt.pt")
    assert run_ranks(body_broadcast_state, 3, backend, args=(path,)) == \
        [{"adam": True, "sgd": True}] * 3


def body_check_finite():
    """Rank 1 puts a NaN into one gradient at step 2: the reduced gradient holds it on every
    rank, so every rank raises (or skips) that same step and the ranks stay equal."""
    import horovod_ext.torch as hvd
    out = {}
    for mode in ("raise", "skip"):
        model, opt = make("sgd")
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       check_finite=mode)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        events = []
        for step in range(4):
            x, y = data(step, 0, 1)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x.double()), y)
            if step == 2 and hvd.rank() == 1:
                loss = loss + model.fc2.bias.sum() * float("nan")
            loss.backward()
            before = [p.detach().clone() for p in model.parameters()]
            try:
                opt.step()
                changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
                events.append("stepped" if changed else "unchanged")
            except FloatingPointError as exc:
                events.append(str(exc))
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        out[mode] = (events, finite, [p.detach().clone() for p in model.parameters()],
                     opt.skipped_steps)
    try:
        hvd.DistributedOptimizer(make("sgd")[1], check_finite="sometimes")
        out["bad"] = None
    except ValueError as exc:
        out["bad"] = str(exc)
    return out


@pytest.mark.timeout(120)
def test_check_finite_raises_or_skips_the_same_step_on_every_rank():
    results = run_ranks(body_check_finite, 2, "gloo")
    for r, out in enumerate(results):
        events, finite, _, _ = out["raise"]
        assert events[:2] == ["stepped", "stepped"] and events[3] == "stepped", (r, events)
        assert "step 3" in events[2] and "fc2.bias" in events[2] and "NaN" in events[2], events
        assert "fc1.weight" not in events[2] and finite
        events, finite, _, skipped = out["skip"]
        assert events == ["stepped", "stepped", "unchanged", "stepped"] and skipped == 1, events
        assert finite
        assert "check_finite='sometimes'" in out["bad"], out["bad"]
    for mode in ("raise", "skip"):
        assert all(torch.equal(a, b) for a, b in zip(results[0][mode][2], results[1][mode][2]))


def test_finite_guard_tells_overflowing_sums_from_non_finite_gradients():
    """The guard tests sums first: a sum that overflows on finite gradients (float32 near its
    maximum, float16 summing past 65504) must not count, a NaN or Inf must, named."""
    from horovod_ext.torch.finite import FiniteGuard, mode_from
    params = [torch.nn.Parameter(torch.zeros(4, dtype=dtype))
              for dtype in (torch.float32, torch.float16, torch.float64)]
    guard = FiniteGuard("raise", params, {id(p): f"p{i}" for i, p in enumerate(params)})
    params[0].grad = torch.full((4,), 3e38)                          # sum overflows to inf
    params[1].grad = torch.full((4,), 60000.0, dtype=torch.float16)  # past float16's max
    params[2].grad = torch.ones(4, dtype=torch.float64)
    assert guard._non_finite([p.grad for p in params]) == []
    params[2].grad[1] = float("-inf")
    params[1].grad[0] = float("nan")
    assert guard._non_finite([p.grad for p in params]) == ["p1", "p2"]
    assert mode_from(None, {"HOROVOD_CHECK_FINITE": "Skip"}) == "skip"
    assert mode_from("0", {"HOROVOD_CHECK_FINITE": "raise"}) is None
    with pytest.raises(ValueError, match="HOROVOD_CHECK_FINITE='maybe'"):
        mode_from(None, {"HOROVOD_CHECK_FINITE": "maybe"})


def body_buckets_follow_arrival_order():
    """A model that registers its head before its body (forward: head(body(x))), so backward
    produces the head's gradients first while the reverse registration order puts the body's
    first; buckets of 600 bytes.  Per step: the parameter names of each bucket and the averaged
    gradients, against the mean of both ranks' own gradients computed here."""
    import horovod_ext.torch as hvd

    class HeadFirst(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(30, 2)    # 248 bytes of gradients
            self.body = torch.nn.Linear(4, 30)    # 600

        def forward(self, x):
            return self.head(torch.relu(self.body(x)))

    torch.manual_seed(0)
    model = HeadFirst()
    names = {id(p): n for n, p in model.named_parameters()}
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    buckets, close = [], []
    for step in range(STEPS_TO_TIMED_PLAN + 2):
        inputs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + r))
                  for r in range(2)]
        own = []
        for x in inputs:   # both ranks' gradients, computed here on a copy for the reference
            plain = HeadFirst()
            plain.load_state_dict(model.state_dict())
            plain(x).square().sum().backward()
            own.append({n: p.grad.clone() for n, p in plain.named_parameters()})
        opt.zero_grad()
        model(inputs[hvd.rank()]).square().sum().backward()
        opt.synchronize()
        close.append(all(torch.allclose(p.grad, (own[0][n] + own[1][n]) / 2, atol=1e-6)
                         for n, p in model.named_parameters()))
        buckets.append([[names[id(p)] for p in b.params] for b in opt._hvd.reducer.buckets])
        with opt.skip_synchronize():
            opt.step()
    layout = opt._hvd.layout
    order = [names[id(layout.params[i])] for i in layout.arrival_order]
    sizes = [layout.params[i].numel() * 4 for i in layout.arrival_order]
    return buckets, close, (order, sizes, layout.arrival_times, layout.link_cost)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("plan", ["size", None])
def test_buckets_follow_the_order_gradients_arrive_in(plan):
    """After the first step the buckets are planned in the order backward produced the
    gradients (rank 0's, the same on every rank), as DDP rebuilds its buckets: the head's
    bucket, whose gradients come first, becomes bucket 0; every step's average stays exact.
    On one host the default plan ("auto") keeps these size buckets: nothing is timed."""
    env = {"HOROVOD_GRADIENT_BUCKET_BYTES": "600"}   # the body's gradients fill one
    if plan is not None:
        env["HOROVOD_GRADIENT_BUCKET_PLAN"] = plan
    results = run_ranks(body_buckets_follow_arrival_order, 2, "gloo", env=env)
    assert results[0] == results[1]
    buckets, close, (_, _, times, cost) = results[0]
    assert close == [True] * len(buckets)
    assert times is None and cost is None                   # nothing timed
    head = {"head.weight", "head.bias"}
    assert buckets[0][0] == ["body.bias", "body.weight"]   # registration order, reversed
    assert not head & set(buckets[0][0])
    assert head <= set(buckets[1][0])                       # arrival order: the head's first
    assert all(b == buckets[1] for b in buckets[2:])


@pytest.mark.timeout(120)
def test_buckets_cut_from_measured_times():
    """HOROVOD_GRADIENT_BUCKET_PLAN=timed: after the steps that time backward (the second to
    1 + TIMING_STEPS) the buckets are cut from rank 0's median arrival times and probed link
    cost (the same on every rank), as bucket_timing.cut cuts them from those numbers; the cap still holds and every step's average stays exact."""
    from horovod_ext.torch import bucket_timing
    env = {"HOROVOD_GRADIENT_BUCKET_BYTES": "600", "HOROVOD_GRADIENT_BUCKET_PLAN": "timed"}
    results = run_ranks(body_buckets_follow_arrival_order, 2, "gloo", env=env)
    assert results[0] == results[1]
    buckets, close, (order, sizes, times, cost) = results[0]
    assert close == [True] * len(buckets)
    assert len(times) == len(order) == 4 and times[0] == 0 and times == sorted(times)
    assert cost.alpha > 0                                   # a real reduction takes time
    want = bucket_timing.cut(times, sizes, ["f32"] * 4, cost, 600)
    timed = buckets[STEPS_TO_TIMED_PLAN]                    # the first step with the cut
    assert timed == buckets[-1] == [[order[i] for i in g] for g in want]
    assert buckets[STEPS_TO_TIMED_PLAN - 1] == buckets[1]   # until then, the arrival order's
    assert all(len(b) == 1 or sum(sizes[order.index(n)] for n in b) <= 600 for b in timed)


VISIT_CAP = 5         # timed steps a visit at most in the trial test (plan_trial.MAX_STEPS)
TRIAL_TEST_STEPS = 70


def body_plan_chosen_by_step_times():
    """Seventy steps over 2 pretend hosts x 2 ranks, each rank's gradients its own; per step
    whether the averaged gradients match the mean of every rank's, computed here, and the plan
    after it (the buckets' cut and whether the world's allreduces are hierarchical); then the
    link cost the buckets are cut with, both ways' costs, the trial's medians and its timed
    steps a visit.  Only rank 0's step times set a visit's length: with at most 5 steps a
    visit here, rank 0's rule gives the most (any measured step is shorter than its 1e6 s),
    the others' the fewest (plan_trial.STEPS), so a visit of 5 steps on every rank shows both
    that rank 0 measured its steps (none measured gives the fewest) and that its count was
    broadcast."""
    import itertools

    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    from horovod_ext.torch import bucket_timing
    from horovod_ext.torch.reduction import plan_trial

    plan_trial.MAX_STEPS = VISIT_CAP
    plan_trial.VISIT_SECONDS = 1e6 if hvd.rank() == 0 else 0.0

    # Gradients stamped 1 us apart whatever the cores do: on shared cores a backward pass is
    # now and then preempted between two hooks, and a measured gap longer than a reduction's
    # latency would make the measured cut the size buckets, leaving nothing to try.
    ticks = itertools.count()
    bucket_timing.ArrivalClock.stamp = lambda self: next(ticks) * 1e-6

    def mlp():
        return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 4))

    torch.manual_seed(0)
    model = mlp()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    close, plans, lane_sums = [], [], []   # lane_sums: buckets summed on the lane so far
    for step in range(TRIAL_TEST_STEPS):
        inputs = [torch.randn(6, 8, generator=torch.Generator().manual_seed(10 * step + r))
                  for r in range(hvd.size())]
        own = []
        for x in inputs:
            plain = mlp()
            plain.load_state_dict(model.state_dict())
            plain(x).square().mean().backward()
            own.append([p.grad.clone() for p in plain.parameters()])
        opt.zero_grad()
        model(inputs[hvd.rank()]).square().mean().backward()
        opt.synchronize()
        close.append(all(torch.allclose(p.grad, sum(o[i] for o in own) / len(own), atol=1e-5)
                         for i, p in enumerate(model.parameters())))
        with opt.skip_synchronize():
            opt.step()
        plans.append((opt._hvd.layout.cut, runtime.engine().comms.hierarchical_allreduce))
        lane_sums.append(opt._hvd.lane.sums if opt._hvd.lane is not None else 0)
    layout = opt._hvd.layout
    return close, plans, layout.link_cost, layout.both_ways, layout.trial_medians, \
        layout.trial_rounds, lane_sums, layout.trial_visit_steps


@pytest.mark.timeout(180)
@pytest.mark.parametrize("variable", [None, "0"])
def test_plan_is_chosen_by_step_times(variable):
    """The default plan "auto": after the steps that time backward (then both ways' reduction
    costs are measured) the next steps visit each candidate three times in turn (A B C A B C
    A B C), one untimed step and (rank 0's count here) 5 timed ones a visit: the measured cut,
    the caps' buckets and, where HOROVOD_HIERARCHICAL_ALLREDUCE is unset, the measured cut over
    hierarchical allreduces;
    every rank keeps the size buckets unless another candidate's median step (rank 0's) is
    more than 5% shorter and its median was shorter in every round, and then that one, its
    buckets cut with that way's link cost.  The averages are exact every step.  A first bucket of
    1000 bytes makes the size buckets put the last layer's bias alone, which a measured cut of
    this model does not (its gradients are stamped 1 us apart, far less than a reduction's
    latency), so both are tried: a candidate giving the same buckets as another is not.  The
    flat candidates' timed steps sum their buckets on the lane, the hierarchical one's do not."""
    from horovod_ext.torch.reduction import plan_trial
    env = {"HOROVOD_FIRST_BUCKET_BYTES": "1000"}
    if variable is not None:
        env["HOROVOD_HIERARCHICAL_ALLREDUCE"] = variable
    hosts = ["nodeA", "nodeA", "nodeB", "nodeB"]
    results = run_ranks(body_plan_chosen_by_step_times, 4, "gloo", env=env,
                        hostnames=hosts, timeout=150)
    assert len({repr(r[1:]) for r in results}) == 1          # every rank alike
    close, plans, cost, (flat, hierarchical), medians, rounds, lane_sums, visit = results[0]
    assert visit == VISIT_CAP > plan_trial.STEPS     # rank 0's, measured, on every rank
    assert close == [True] * TRIAL_TEST_STEPS
    assert flat.alpha > 0
    tried = [("timed", False), ("size", False)]
    if variable is None:
        tried.append(("timed", True))
    else:
        assert hierarchical is None
    assert [tuple(c) for c in medians] == tried
    # steps 0 to TIMING_STEPS learn; the step() ending a visit switches to the next visit's
    per_visit = visit + 1
    expected = [c for _ in range(plan_trial.ROUNDS) for c in tried for _ in range(per_visit)]
    assert all(len(r) == plan_trial.ROUNDS for r in rounds.values())
    size = ("size", False)
    winners = [c for c in medians if medians[c] < 0.95 * medians[size]
               and all(a < b for a, b in zip(rounds[c], rounds[size]))]
    best = tuple(min(winners, key=medians.get)) if winners else size
    first = STEPS_TO_TIMED_PLAN - 1    # plans[] is taken after step(): the learning step's
    assert len(plans) > first + len(expected)
    assert plans[first:first + len(expected)] == expected
    # step first + 1 + j runs candidate expected[j]; its timed steps go on the bucket lane
    # where the candidate is flat, as they would once it is chosen, and never where it is not
    on_lane = [b > a for a, b in zip(lane_sums, lane_sums[1:])]   # on_lane[s - 1]: step s
    for j, candidate in enumerate(expected):
        if j % per_visit:
            assert on_lane[first + j] == (not candidate[1]), (j, candidate, lane_sums)
    assert all(p == best for p in plans[first + len(expected):])
    assert cost == (hierarchical if best[1] else flat)
