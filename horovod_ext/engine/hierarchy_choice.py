"""Whether the world's allreduces go flat or hierarchically where a hierarchy applies (several
hosts, several ranks on each).

Which is faster depends on the links: across real hosts the hierarchical way sends each byte
over the network once per host instead of once per rank, but where the "hosts" share a machine
its extra in-node steps only cost.  HOROVOD_HIERARCHICAL_ALLREDUCE decides when it is set, and
autotune when it runs; otherwise DistributedOptimizer tries both ways for a few training steps
and keeps the one that trains clearly faster (torch/reduction/plan_trial.py).  A switch runs as
one negotiated request, so every rank changes way between the same two requests.
"""
from . import runtime


def open_choice() -> bool:
    """Whether the way is left to measurement: a hierarchy applies to the world, the variable
    is not set and autotune is off."""
    config = runtime.state.config
    return (config is not None and config.hierarchical_allreduce_auto and not config.autotune
            and runtime.topology().hierarchy_applies)


def set_hierarchical(flag: bool) -> None:
    """Make the world's allreduces hierarchical (True) or flat; collective over the world."""
    def switch(topology):
        runtime.engine().comms.hierarchical_allreduce = flag
        return flag

    runtime.execute_custom(f"hierarchical_allreduce.{int(flag)}", switch)
