"""The communication context that layer-2 optimizers use: custom collectives run by the engine,
ordered with the other requests on every rank."""
import pytest
import torch

from tests.harness import BACKENDS, run_ranks


def _custom_between_async():
    import horovod_ext.torch as hvd
    from horovod_ext.backends import context
    r = hvd.rank()
    # An async allreduce in flight while the custom collective runs: the engine orders both
    # the same way on every rank, so neither deadlocks nor mixes data.
    h = hvd.allreduce_async(torch.full((1000,), float(r + 1)), name="bg", op=hvd.Sum)
    got = context.current().execute(
        "custom.sum", lambda topo: topo.world.allreduce(torch.tensor([10.0 * (topo.rank + 1)])))
    bg = hvd.synchronize(h)
    return float(got[0]), float(bg[0]), context.current().topology.size


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_collective(backend):
    for got, bg, size in run_ranks(_custom_between_async, 2, backend):
        assert (got, bg, size) == (30.0, 3.0, 2)


def test_context_before_init_is_a_clear_error():
    from horovod_ext.backends import context
    with pytest.raises(RuntimeError, match="hvd.init"):
        context.current()
