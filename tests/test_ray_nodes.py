"""RayExecutor on a real Ray cluster of two nodes (``ray.cluster_utils.Cluster``: a head and a
second raylet on this machine, one CPU each): ranks follow the nodes the workers land on, so
local and cross ranks, and the hierarchical allreduce, see two nodes."""
import pytest

from tests.harness import REPO

ray = pytest.importorskip("ray", reason="Ray is in the test extra (pip install -e .[mpi,test])")

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster
    env = {"env_vars": {"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "object_store_memory": 100 * 1024 * 1024})
    cluster.add_node(num_cpus=1, object_store_memory=100 * 1024 * 1024)
    ray.init(address=cluster.address, runtime_env=env, log_to_driver=False)
    cluster.wait_for_nodes()
    yield
    ray.shutdown()
    cluster.shutdown()


def where_am_i():
    import torch
    import horovod_ext.torch as hvd
    hvd.init()
    total = hvd.allreduce(torch.arange(6, dtype=torch.float32) * (hvd.rank() + 1), op=hvd.Sum)
    out = (hvd.rank(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(),
           total.tolist())
    hvd.shutdown()
    return out


@pytest.mark.parametrize("placement", [
    {"num_workers": 2, "cpus_per_worker": 1},           # packed, but one CPU per node
    {"num_hosts": 2, "num_workers_per_host": 1},        # spread on purpose
])
def test_ranks_follow_the_ray_nodes(two_nodes, placement):
    from horovod_ext.ray import RayExecutor
    ex = RayExecutor(RayExecutor.create_settings(timeout_s=30), **placement)
    ex.start(extra_env_vars={"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"})
    try:
        assert len(set(ex.nodes)) == 2, ex.nodes
        expected = [float(i * 3) for i in range(6)]  # (1 + 2) x arange
        assert ex.run(where_am_i) == [(0, 0, 1, 0, 2, expected), (1, 0, 1, 1, 2, expected)]
    finally:
        ex.shutdown()
