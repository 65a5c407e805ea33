"""Ranks that share a GPU under NCCL fail at once, naming the ranks and the fix
(horovod_ext/backends/devices.py): the layout check alone, and its gathering over real Gloo
ranks.  Runs on the CPU; tests/test_cuda.py checks the same on a GPU, through hvd.allreduce."""
import pytest

from horovod_ext.backends.devices import FIX, Gpu, shared_gpu_message, shared_gpus
from tests.harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def test_distinct_gpus_are_fine():
    assert shared_gpus([("a", 0), ("a", 1), ("a", 2), ("a", 3)]) == []
    assert shared_gpu_message([("a", 0), ("a", 1)]) is None
    assert shared_gpu_message([Gpu("a", "GPU-1", 0), Gpu("a", "GPU-2", 0)]) is None


def test_two_hosts_may_use_the_same_index():
    assert shared_gpu_message([("a", 0), ("a", 1), ("b", 0), ("b", 1)]) is None


def test_two_ranks_on_one_gpu_are_named_with_the_fix():
    message = shared_gpu_message([("a", 0), ("a", 0)])
    assert message.startswith("NCCL cannot run two ranks of one job on the same GPU, and "
                               "ranks 0 and 1 all use cuda:0 on host a. ")
    assert message.endswith(FIX)
    assert "torch.cuda.set_device(hvd.local_rank())" in message
    assert "HOROVOD_GPU_OPERATIONS=mpi" in message


def test_every_shared_gpu_is_named_and_only_those():
    # host a: ranks 0, 2, 3 on cuda:0, rank 1 alone on cuda:1; host b: ranks 5 and 6 share
    # cuda:1, rank 4 has cuda:0
    gpus = [("a", 0), ("a", 1), ("a", 0), ("a", 0), ("b", 0), ("b", 1), ("b", 1)]
    assert shared_gpus(gpus) == [("a", "cuda:0", [0, 2, 3]), ("b", "cuda:1", [5, 6])]
    message = shared_gpu_message(gpus)
    assert "ranks 0, 2 and 3 all use cuda:0 on host a; ranks 5 and 6 all use cuda:1 on host b." \
        in message
    assert "rank 1" not in message and "4" not in message.split(". ")[0]


def test_a_uuid_decides_over_the_index():
    """One GPU under two indices (CUDA_VISIBLE_DEVICES differs per rank) is shared; two GPUs
    that each process calls cuda:0 are not."""
    one = [Gpu("a", "GPU-x", 0), Gpu("a", "GPU-x", 1)]
    assert shared_gpus(one) == [("a", "cuda:0 (GPU GPU-x)", [0, 1])]
    assert shared_gpu_message([Gpu("a", "GPU-x", 0), Gpu("a", "GPU-y", 0)]) is None


def test_ranks_are_named_as_given_and_the_list_is_cut_short():
    assert shared_gpus([("a", 0), ("a", 0)], ranks=[4, 6]) == [("a", "cuda:0", [4, 6])]
    gpus = [("h%d" % (i // 2), 0) for i in range(12)]      # six hosts, two ranks on each GPU
    message = shared_gpu_message(gpus, shown=2)
    assert "ranks 0 and 1 all use cuda:0 on host h0; ranks 2 and 3 all use cuda:0 on host h1; " \
           "4 more GPUs are shared likewise." in message


def body_gather(layout):
    """Each rank states its GPU as ``layout`` gives it; the world communicator gathers them."""
    import horovod_ext.torch as hvd
    from horovod_ext.engine import runtime
    return runtime.state.comms.world.shared_gpu_error(Gpu(*layout[hvd.rank()]))


def test_the_layout_is_gathered_over_gloo_and_every_rank_gets_the_same_answer():
    shared = run_ranks(body_gather, 3, "gloo", args=([("a", 0), ("a", 1), ("a", 1)],))
    assert shared[0] == shared[1] == shared[2] == shared_gpu_message([("a", 0), ("a", 1),
                                                                      ("a", 1)])
    assert "ranks 1 and 2 all use cuda:1 on host a" in shared[0]
    assert run_ranks(body_gather, 2, "gloo", args=([("a", 0), ("b", 0)],)) == ["", ""]


class _CudaLike:
    """Stands in for a CUDA tensor where _group_for looks: is_cuda and device."""
    is_cuda = True
    device = "cuda:0"


def body_group_for(same):
    """A world communicator with a stand-in NCCL group, each rank's GPU as ``same`` says: what
    _group_for gives a CUDA tensor, first as a collective, then in a send/receive."""
    import torch.distributed as dist
    import horovod_ext.torch as hvd
    from horovod_ext.backends import devices
    from horovod_ext.backends.torch_dist import TorchCommunicator
    nccl = object()
    comm = TorchCommunicator(range(hvd.size()), dist.group.WORLD, nccl)
    devices.local_gpu = lambda device: Gpu("host", 0 if same else hvd.rank(), 0)
    outcomes = []
    for collective in (True, False):
        try:
            outcomes.append(comm._group_for(_CudaLike(), collective)[0] is nccl)
        except devices.SharedGpuError as exc:
            outcomes.append(str(exc))
    return outcomes


def test_the_first_nccl_collective_checks_and_every_later_call_uses_the_answer():
    shared = run_ranks(body_group_for, 2, "gloo", args=(True,))
    message = shared_gpu_message([("host", 0), ("host", 0)])
    assert shared == [[message, message]] * 2
    assert run_ranks(body_group_for, 2, "gloo", args=(False,)) == [[True, True]] * 2
