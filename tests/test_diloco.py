"""``hvd.DiLoCo`` on real ranks (np=2 and 3, Gloo and MPI) against a plain loop written here: every
worker's H local steps, then the average pseudo-gradient through an outer SGD step with Nesterov
momentum; bitwise resume from its state_dict."""
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


def _reference(size, outer_momentum, nesterov):
    models = [_model() for _ in range(size)]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    momentum = None
    opts = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]
    for rnd in range(ROUNDS):
        for rank, (model, opt) in enumerate(zip(models, opts)):
            for step in range(rnd * H, rnd * H + H):
                _local_step(model, opt, rank, step)
        deltas = [sum(a - p.detach() for p in ps) / size
                  for a, ps in zip(anchor, zip(*[m.parameters() for m in models]))]
        if outer_momentum:
            momentum = ([d.clone() for d in deltas] if momentum is None else
                        [outer_momentum * b + d for b, d in zip(momentum, deltas)])
            updates = ([d + outer_momentum * b for d, b in zip(deltas, momentum)] if nesterov
                       else momentum)
        else:
            updates = deltas
        anchor = [a - OUTER_LR * u for a, u in zip(anchor, updates)]
        with torch.no_grad():
            for model in models:
                for p, a in zip(model.parameters(), anchor):
                    p.copy_(a)
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
        with torch.no_grad():
            for model in models:
                for p, a in zip(model.parameters(), avg):
                    p.copy_(a)
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
    with pytest.raises(NotImplementedError, match="fragments"):
        hvd.DiLoCo(sgd, fragments=2)
    with pytest.raises(ValueError, match="does not name 2"):
        hvd.DiLoCo(sgd, named_parameters=list(model.named_parameters())[:2])


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
