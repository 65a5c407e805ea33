"""horovod_ext on a Ray cluster: ``RayExecutor``, with the API of Horovod 0.28's
``horovod.ray.RayExecutor``.

Workers are Ray actors placed with a placement group (``num_workers``: packed onto as few nodes
as fit; ``num_hosts`` x ``num_workers_per_host``: that many on each of that many nodes).  Their
ranks follow the Ray nodes they land on (the workers of a node are consecutive ranks, so local
and cross ranks describe the real nodes), and they meet over Gloo at rank 0's node, exactly as
ranks started by hvdrun do: a function run on them calls ``hvd.init()`` as usual.

    import ray
    from horovod_ext.ray import RayExecutor

    ray.init()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    executor.start()
    results = executor.run(train_fn)          # one result per rank, in rank order
    executor.shutdown()

Ray is an optional extra (``pip install -e ".[ray]"``).  Elastic Ray jobs (``min_workers`` /
``max_workers``) are not provided: hvdrun's elastic mode is.
"""
from horovod_ext.launch.ray import RayExecutor, RaySettings, WorkerDied  # noqa: F401

__all__ = ["RayExecutor", "RaySettings", "WorkerDied"]
