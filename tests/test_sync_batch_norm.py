"""``hvd.SyncBatchNorm`` on 2 real ranks against one torch BatchNorm over the concatenated
batch: outputs, input gradients, the summed parameter gradients and the running statistics."""
import pytest
import torch

from tests.harness import BACKENDS, run_ranks

pytestmark = pytest.mark.timeout(120)

SHAPES = {"1d": (6, 3), "2d": (4, 3, 5, 5), "3d": (2, 3, 2, 3, 4)}


def _data(shape, rank):
    g = torch.Generator().manual_seed(100 + rank)
    # channels on different scales and offsets, so wrong statistics would show
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    scale = torch.tensor([1.0, 10.0, 0.1], dtype=torch.float64).view([1, 3] + [1] * (len(shape) - 2))
    return x * scale + 3.0, torch.randn(shape, generator=g, dtype=torch.float64)


def body(kind):
    import horovod_ext.torch as hvd
    shape = SHAPES[kind]
    bn = hvd.SyncBatchNorm(3, momentum=0.3).double()
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.5, 2.0, -1.0]))
        bn.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    x, upstream = _data(shape, hvd.rank())
    x.requires_grad_(True)
    outs = []
    for _ in range(2):  # twice: the running statistics move twice
        out = bn(x)
        (out * upstream).sum().backward()
        outs.append(out.detach())
    weight_grad = hvd.allreduce(bn.weight.grad, op=hvd.Sum)
    bias_grad = hvd.allreduce(bn.bias.grad, op=hvd.Sum)
    bn.eval()
    evaluated = bn(x.detach())
    return (outs, x.grad, weight_grad, bias_grad, bn.running_mean.clone(),
            bn.running_var.clone(), int(bn.num_batches_tracked), evaluated)


def _reference(kind, size):
    shape = SHAPES[kind]
    layer = {1: torch.nn.BatchNorm1d, 2: torch.nn.BatchNorm2d, 3: torch.nn.BatchNorm3d}[
        len(shape) - 2 if len(shape) > 2 else 1]
    bn = layer(3, momentum=0.3).double()
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.5, 2.0, -1.0]))
        bn.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    parts = [_data(shape, r) for r in range(size)]
    x = torch.cat([p[0] for p in parts]).requires_grad_(True)
    upstream = torch.cat([p[1] for p in parts])
    outs = []
    for _ in range(2):
        out = bn(x)
        (out * upstream).sum().backward()
        outs.append(out.detach())
    bn.eval()
    return outs, x.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var, bn(
        x.detach())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(SHAPES))
def test_matches_one_batchnorm_over_the_whole_batch(kind, backend):
    results = run_ranks(body, 2, backend, args=(kind,))
    outs, x_grad, w_grad, b_grad, r_mean, r_var, evaluated = _reference(kind, 2)
    rows = SHAPES[kind][0]
    close = dict(rtol=1e-9, atol=1e-9)  # float64 throughout
    for rank, (got_outs, got_x_grad, got_w, got_b, got_mean, got_var, tracked, got_eval) in \
            enumerate(results):
        mine = slice(rank * rows, (rank + 1) * rows)
        for got, want in zip(got_outs, outs):
            torch.testing.assert_close(got, want[mine], **close)
        torch.testing.assert_close(got_x_grad, x_grad[mine], **close)
        torch.testing.assert_close(got_w, w_grad, **close)
        torch.testing.assert_close(got_b, b_grad, **close)
        torch.testing.assert_close(got_mean, r_mean, **close)
        torch.testing.assert_close(got_var, r_var, **close)
        torch.testing.assert_close(got_eval, evaluated[mine], **close)
        assert tracked == 2


def test_one_rank_and_bad_input():
    import horovod_ext.torch as hvd
    hvd.init()
    try:
        bn = hvd.SyncBatchNorm(3)
        x = torch.randn(4, 3, 2)
        torch.testing.assert_close(bn(x), torch.nn.functional.batch_norm(
            x, None, None, bn.weight, bn.bias, True, 0.1, 1e-5))
        with pytest.raises(ValueError, match="at least 2 dimensions"):
            bn(torch.randn(3))
        model = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 1), torch.nn.BatchNorm2d(3))
        converted = hvd.SyncBatchNorm.convert_sync_batchnorm(model)
        assert isinstance(converted[1], hvd.SyncBatchNorm)
        assert converted[1].weight is model[1].weight
    finally:
        hvd.shutdown()
