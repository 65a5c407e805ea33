"""``hvd.DiLoCo`` on real ranks (np=2 and 3, Gloo and MPI) against a plain loop written here: every
worker's H local steps, then the average pseudo-gradient through an outer SGD step with Nesterov
momentum; the streaming form (fragments synced at staggered steps, reductions overlapping inner
steps, the result mixed into the parameters); bitwise resume from its state_dict; a host as one
worker (its ranks averaging gradients every step through a process set, DiLoCo across hosts)."""
import pytest
import torch

from tests.harness import BACKENDS, run_ranks

pytestmark = pytest.mark.timeout(120)

H, ROUNDS, INNER_LR, OUTER_LR, MU = 3, 3, 0.1, 0.7, 0.9


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 2)).double()


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 5, generator=g, dtype=torch.float64), \
        torch.randn(6, 2, generator=g, dtype=torch.float64)


def _local_step(model, opt, rank, step):
    x, y = _batch(rank, step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def body(outer_momentum, nesterov):
    import horovod_ext.torch as hvd
    model = _model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DiLoCo(torch.optim.SGD(model.parameters(), lr=INNER_LR),
                     named_parameters=model.named_parameters(), sync_every=H,
                     outer_lr=OUTER_LR, outer_momentum=outer_momentum, nesterov=nesterov)
    for step in range(H * ROUNDS):
        _local_step(model, opt, hvd.rank(), step)
    return [p.detach().clone() for p in model.parameters()], opt.outer_steps


def _worker_step(model, opt, ranks, step):
    """One inner step of a worker made of ``ranks``: the mean of their gradients, then SGD."""
    grads = []
    for rank in ranks:
        x, y = _batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for p, *gs in zip(model.parameters(), *grads):
        p.grad = sum(gs) / len(ranks)
    opt.step()


def _restart(models, anchor):
    """Every worker continues from the new anchor."""
    with torch.no_grad():
        for model in models:
            for p, a in zip(model.parameters(), anchor):
                p.copy_(a)


def _reference(size, outer_momentum, nesterov, per_host=1):
    """DiLoCo over ``size // per_host`` workers, each ``per_host`` consecutive ranks whose
    gradients it averages every step."""
    workers = size // per_host
    models = [_model() for _ in range(workers)]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    momentum = None
    opts = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]
    for rnd in range(ROUNDS):
        for w, (model, opt) in enumerate(zip(models, opts)):
            for step in range(rnd * H, rnd * H + H):
                _worker_step(model, opt, range(w * per_host, (w + 1) * per_host), step)
        deltas = [sum(a - p.detach() for p in ps) / workers
                  for a, ps in zip(anchor, zip(*[m.parameters() for m in models]))]
        if outer_momentum:
            momentum = ([d.clone() for d in deltas] if momentum is None else
                        [outer_momentum * b + d for b, d in zip(momentum, deltas)])
            updates = ([d + outer_momentum * b for d, b in zip(deltas, momentum)] if nesterov
                       else momentum)
        else:
            updates = deltas
        anchor = [a - OUTER_LR * u for a, u in zip(anchor, updates)]
        _restart(models, anchor)
    return anchor


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", [2, 3])
def test_matches_local_steps_plus_an_outer_nesterov_step(size, backend):
    results = run_ranks(body, size, backend, args=(MU, True))
    want = _reference(size, MU, True)
    for params, outer in results:
        assert outer == ROUNDS
        for got, ref in zip(params, want):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_local_sgd_is_outer_lr_1_without_momentum():
    results = run_ranks(body_local_sgd, 2, "gloo")
    want = _reference_plain(2)
    for params in results:
        for got, ref in zip(params, want):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def body_local_sgd():
    import horovod_ext.torch as hvd
    model = _model()
    opt = hvd.DiLoCo(torch.optim.SGD(model.parameters(), lr=INNER_LR),
                     named_parameters=model.named_parameters(), sync_every=H, outer_lr=1.0,
                     outer_momentum=0.0)
    for step in range(H * ROUNDS):
        _local_step(model, opt, hvd.rank(), step)
    return [p.detach().clone() for p in model.parameters()]


def _reference_plain(size):
    """Local SGD: every H steps the workers' parameters are averaged."""
    models = [_model() for _ in range(size)]
    opts = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]
    for rnd in range(ROUNDS):
        for rank, (model, opt) in enumerate(zip(models, opts)):
            for step in range(rnd * H, rnd * H + H):
                _local_step(model, opt, rank, step)
        avg = [sum(ps) / size for ps in zip(*[[p.detach().clone() for p in m.parameters()]
                                              for m in models])]
        _restart(models, avg)
    return avg


def body_resume():
    import copy
    import horovod_ext.torch as hvd
    model = _model()
    opt = hvd.DiLoCo(torch.optim.SGD(model.parameters(), lr=INNER_LR, momentum=0.5),
                     named_parameters=model.named_parameters(), sync_every=H)
    for step in range(4):               # stops mid-round: the round's start is in the state
        _local_step(model, opt, hvd.rank(), step)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    for step in range(4, 10):
        _local_step(model, opt, hvd.rank(), step)
    first = [p.detach().clone() for p in model.parameters()]
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    for step in range(4, 10):
        _local_step(model, opt, hvd.rank(), step)
    return all(torch.equal(a, b.detach()) for a, b in zip(first, model.parameters()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_resume(backend):
    assert run_ranks(body_resume, 2, backend) == [True, True]


def test_bad_settings():
    import horovod_ext.torch as hvd
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="sync_every must be a positive integer"):
        hvd.DiLoCo(sgd, sync_every=0)
    with pytest.raises(ValueError, match="outer_momentum"):
        hvd.DiLoCo(sgd, outer_momentum=1.0)
    with pytest.raises(ValueError, match="fragments must be an integer from 1"):
        hvd.DiLoCo(sgd, fragments=5)            # the model has 4 parameters
    with pytest.raises(ValueError, match="overlap_steps"):
        hvd.DiLoCo(sgd, sync_every=4, overlap_steps=4)
    with pytest.raises(ValueError, match="mixing"):
        hvd.DiLoCo(sgd, mixing=1.5)
    with pytest.raises(ValueError, match="does not name 2"):
        hvd.DiLoCo(sgd, named_parameters=list(model.named_parameters())[:2])
    # the same check as DistributedOptimizer's (torch/param_names.py)
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="duplicate names"):
        hvd.DiLoCo(sgd, named_parameters=[(named[0][0], p) for _, p in named])
    with pytest.raises(ValueError, match=r"\(name, parameter\) tuples"):
        hvd.DiLoCo(sgd, named_parameters=[p for _, p in named])


def body_onebit():
    import horovod_ext.torch as hvd
    model = _model()
    opt = hvd.DiLoCo(torch.optim.SGD(model.parameters(), lr=INNER_LR),
                     named_parameters=model.named_parameters(), sync_every=H, op=hvd.OneBit)
    for step in range(H * ROUNDS):
        _local_step(model, opt, hvd.rank(), step)
    return [p.detach().clone() for p in model.parameters()], hvd.OneBit.bytes_sent


def test_a_one_bit_pseudo_gradient():
    (a, sent), (b, _) = run_ranks(body_onebit, 2, "gloo")
    for x, y in zip(a, b):
        assert torch.equal(x, y)           # every rank continues from the same parameters
    exact = _reference(2, MU, True)
    assert any(not torch.allclose(x, y) for x, y in zip(a, exact))  # compressed: not exact
    numel = sum(p.numel() for p in _model().parameters())
    assert 0 < sent < ROUNDS * numel * 8  # below a float64 ring allreduce of every round


# --- streaming: 2 fragments of the 4 parameters, synced at steps 2, 6, 10 and 4, 8, 12 --------
SH, STEPS, TAU, MIX = 4, 12, 1, 0.5
FRAGMENTS = [[0], [1, 2, 3]]     # by size: the first weight (20 elements), then the rest (14)


def body_streaming(overlap):
    import horovod_ext.torch as hvd
    model = _model()
    opt = hvd.DiLoCo(torch.optim.SGD(model.parameters(), lr=INNER_LR),
                     named_parameters=model.named_parameters(), sync_every=SH,
                     outer_momentum=MU, fragments=2, overlap_steps=overlap, mixing=MIX)
    names = [n for n, _ in model.named_parameters()]
    assert opt.fragments == [[names[i] for i in f] for f in FRAGMENTS]
    for step in range(STEPS):
        _local_step(model, opt, hvd.rank(), step)
    opt.state_dict()   # waits for the reduction still in flight before the ranks shut down
    return [p.detach().clone() for p in model.parameters()], opt.outer_steps


def _reference_streaming(size, overlap):
    models = [_model() for _ in range(size)]
    opts = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    momentum = [None] * len(anchor)
    offsets = [SH // 2, SH]
    pending = {}

    def apply(f):
        _, deltas = pending.pop(f)
        for i, delta in deltas:
            momentum[i] = delta.clone() if momentum[i] is None else MU * momentum[i] + delta
            anchor[i] = anchor[i] - OUTER_LR * (delta + MU * momentum[i])
            with torch.no_grad():
                for model in models:
                    p = list(model.parameters())[i]
                    p.copy_(anchor[i] if overlap == 0 else MIX * p + (1 - MIX) * anchor[i])

    for step in range(STEPS):
        for rank, (model, opt) in enumerate(zip(models, opts)):
            _local_step(model, opt, rank, step)
        now = step + 1
        for f in [f for f, (due, _) in sorted(pending.items()) if due == now]:
            apply(f)
        for f, offset in enumerate(offsets):
            if now >= offset and (now - offset) % SH == 0:
                pending[f] = (now + overlap, [
                    (i, sum(anchor[i] - list(m.parameters())[i].detach() for m in models) / size)
                    for i in FRAGMENTS[f]])
                if overlap == 0:
                    apply(f)
    return [p.detach() for p in models[0].parameters()], [
        [p.detach() for p in m.parameters()] for m in models]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", [2, 3])
def test_streaming_fragments_with_overlap_match_a_plain_loop(size, backend):
    results = run_ranks(body_streaming, size, backend, args=(TAU,))
    _, want = _reference_streaming(size, TAU)
    for rank, (params, outer) in enumerate(results):
        assert outer == 5                   # fragment 0 at 2, 6, 10 (applied at 3, 7, 11); 1 at 4, 8
        for got, ref in zip(params, want[rank]):   # (12's is still in flight)
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_streaming_without_overlap_replaces_each_fragment():
    results = run_ranks(body_streaming, 2, "gloo", args=(0,))
    first, _ = _reference_streaming(2, 0)
    for params, outer in results:
        assert outer == 6
    # step 12 synced fragment 1 (the last parameters); fragment 0 moved on since step 10
    for got, ref in zip(results[0][0][1:], first[1:]):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(results[0][0][1:], results[1][0][1:]):
        assert torch.equal(a, b)


def body_resume_streaming():
    import copy
    import horovod_ext.torch as hvd
    model = _model()
    opt = hvd.DiLoCo(torch.optim.SGD(model.parameters(), lr=INNER_LR, momentum=0.5),
                     named_parameters=model.named_parameters(), sync_every=SH, fragments=2,
                     overlap_steps=TAU)
    for step in range(6):               # fragment 0's reduction of step 6 is in flight
        _local_step(model, opt, hvd.rank(), step)
    assert list(opt.pending) == [0]
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    for step in range(6, STEPS):
        _local_step(model, opt, hvd.rank(), step)
    first = [p.detach().clone() for p in model.parameters()]
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    for step in range(6, STEPS):
        _local_step(model, opt, hvd.rank(), step)
    opt.state_dict()
    return all(torch.equal(a, b.detach()) for a, b in zip(first, model.parameters()))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_resume_with_a_reduction_in_flight(backend):
    assert run_ranks(body_resume_streaming, 2, backend) == [True, True]


# --- a host as one worker: DistributedOptimizer over the host's process set inside DiLoCo ----
def body_host_workers(per_host):
    import horovod_ext.torch as hvd
    r = hvd.rank()
    hosts = [hvd.add_process_set(list(range(h, h + per_host)))
             for h in range(0, hvd.size(), per_host)]
    model = _model()
    inner = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=INNER_LR),
                                     named_parameters=model.named_parameters(),
                                     process_set=hosts[r // per_host])
    opt = hvd.DiLoCo(inner, named_parameters=model.named_parameters(), sync_every=H,
                     outer_lr=OUTER_LR, outer_momentum=MU)
    for step in range(H * ROUNDS):
        _local_step(model, opt, r, step)
    return [p.detach().clone() for p in model.parameters()]


def test_a_host_as_one_worker_matches_a_plain_loop():
    """2 hosts x 2 ranks: the ranks of a host average gradients every step, DiLoCo runs across
    the hosts, and every rank ends with the plain loop's parameters."""
    results = run_ranks(body_host_workers, 4, "gloo", args=(2,),
                        env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    want = _reference(4, MU, True, per_host=2)
    for params in results:
        for got, ref in zip(params, want):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
