"""The op contract (horovod_ext/ops/base.py): what each built-in op declares, checked against
plain references, and the registry's reset of every op's state."""
import pytest
import torch

pytestmark = pytest.mark.timeout(60)


def test_elementwise_ops_declare_their_reduction_and_finish():
    import horovod_ext.torch as hvd
    from horovod_ext.backends.base import ReduceOp
    declared = {op.name: (op.reduce_op, op.averages) for op in hvd.registered_ops().values()
                if op.elementwise}
    assert declared == {"sum": (ReduceOp.SUM, False), "average": (ReduceOp.SUM, True),
                        "min": (ReduceOp.MIN, False), "max": (ReduceOp.MAX, False),
                        "product": (ReduceOp.PRODUCT, False)}
    # finish_ after a sum over 3 ranks: Average divides, giving exactly the plain division
    # also where 1/size is not a power of two (Horovod's tests compare with rtol 0 at 3 ranks);
    # integers truncate toward zero, as Horovod does; the other ops leave the sum as it is
    torch.manual_seed(1234)
    summed = torch.FloatTensor(17, 17).random_(-100, 100) * 2
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        s = summed.to(dtype)
        assert torch.equal(hvd.Average.finish_(s.clone(), 3), s / 3), dtype
    assert torch.equal(hvd.Average.finish_(torch.tensor([7, -7, 3]), 3),
                       torch.tensor([2, -2, 1]))
    assert torch.equal(hvd.Sum.finish_(summed.clone(), 3), summed)
    for op in (hvd.Adasum, hvd.OneBit, hvd.RandomK(0.5), hvd.PowerSGD(rank=1), hvd.SparseLoCo(),
               hvd.Quantized()):
        assert not op.elementwise and op.reduce_op is None
        assert op.timeline_name == op.name.upper()
    assert hvd.Sum.timeline_name == "ALLREDUCE"


def test_only_adasum_asks_for_delta_mode_and_only_with_optimizer_state():
    import horovod_ext.torch as hvd
    p = [torch.nn.Parameter(torch.zeros(2))]
    plain, momentum = torch.optim.SGD(p, lr=0.1), torch.optim.SGD(p, lr=0.1, momentum=0.9)
    adam = torch.optim.Adam(p)
    assert [hvd.Adasum.wants_delta(o) for o in (plain, momentum, adam)] == [False, True, True]
    for op in (hvd.Sum, hvd.Average, hvd.OneBit, hvd.RandomK(0.5), hvd.PowerSGD(rank=1),
               hvd.SparseLoCo(), hvd.Quantized()):
        assert not any(op.wants_delta(o) for o in (plain, momentum, adam)), op


def test_state_for_checkpoints_and_reset_by_the_registry():
    import horovod_ext.torch as hvd
    from horovod_ext.ops import reset_all
    for op in (hvd.Sum, hvd.Average, hvd.Adasum):
        assert op.state_dict() is None
        op.load_state_dict(None)
        with pytest.raises(ValueError, match="keeps no state"):
            op.load_state_dict({"errors": []})
    onebit = hvd.OneBit
    onebit.load_state_dict({"errors": [(["g.0"], {"worker": torch.ones(4), "server": torch.ones(2),
                                                  "bytes_sent": 12, "calls": 1})]})
    assert onebit.bytes_sent == 12
    powersgd = hvd.PowerSGD(rank=1)
    powersgd._state(("w",))
    assert powersgd.state_dict()["states"] and onebit.state_dict() is not None
    reset_all()
    assert powersgd.state_dict()["states"] == [] and onebit.state_dict() == {"errors": []}
