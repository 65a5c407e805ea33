"""Process-wide state: init and shutdown, the topology, and the running engine.

``init`` reads the environment (config.py), builds the world communicator for the chosen
transport, the local/cross topology and the control plane, and starts the background engine.
"""
import atexit
import logging
import sys
import threading
from typing import Optional

import torch

from .backends import bootstrap, context
from .backends.control import ControlChannel
from .backends.topology import Topology
from .collectives import Collectives
from .config import Config, ConfigError
from .engine import Engine, HorovodInternalError, Request

_LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO,
           "warning": logging.WARNING, "error": logging.ERROR, "fatal": logging.CRITICAL}


class _State:
    def __init__(self):
        self.lock = threading.RLock()
        self.config: Optional[Config] = None
        self.topology: Optional[Topology] = None
        self.comms: Optional[Collectives] = None
        self.control: Optional[ControlChannel] = None
        self.engine: Optional[Engine] = None
        self.transport: Optional[str] = None
        self.owns_torch_dist = False
        self.atexit_registered = False


state = _State()


class NotInitializedError(ValueError):
    def __init__(self):
        super().__init__("horovod_ext has not been initialized; call hvd.init() first")


def _setup_logging(config: Config, rank: int):
    logger = logging.getLogger("horovod_ext")
    logger.setLevel(_LEVELS[config.log_level])
    if not any(getattr(h, "_horovod_ext", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler._horovod_ext = True
        handler.setFormatter(logging.Formatter(f"[horovod_ext rank {rank}] %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False


def choose_transport(config: Config, mpi_comm=None) -> str:
    if mpi_comm is not None:
        if config.cpu_operations == "gloo":
            raise ConfigError("hvd.init(comm=...) was given an MPI communicator but "
                              "HOROVOD_CPU_OPERATIONS=gloo")
        return "mpi"
    if config.cpu_operations:
        return config.cpu_operations
    return "mpi" if bootstrap.started_by_mpirun() else "gloo"


def init(comm=None):
    """Start horovod_ext on this process; a collective call on every rank."""
    with state.lock:
        if state.engine is not None and state.engine.running:
            return
        if isinstance(comm, (list, tuple)):
            raise NotImplementedError("hvd.init(comm=[ranks]) (a subset of ranks) is not "
                                      "supported; start only the processes you need")
        config = Config.from_env()
        transport = choose_transport(config, comm)
        if transport == "mpi" and config.gpu_operations == "nccl":
            raise ConfigError("HOROVOD_GPU_OPERATIONS=nccl needs HOROVOD_CPU_OPERATIONS=gloo "
                              "(NCCL groups are built on torch.distributed)")
        import torch.distributed as dist
        had_dist = dist.is_available() and dist.is_initialized()
        use_nccl = (transport == "gloo" and config.gpu_operations != "mpi"
                    and torch.cuda.is_available() and dist.is_nccl_available())
        world = bootstrap.create_world(transport, config.timeout_s, use_nccl, mpi_comm=comm)
        _setup_logging(config, world.rank)
        topology = Topology.build(world, bootstrap.hostname())
        control = _control_channel(transport, world, config)
        comms = Collectives(topology, config.hierarchical_allreduce,
                            config.hierarchical_allgather)
        state.config, state.topology, state.comms = config, topology, comms
        state.control, state.transport = control, transport
        state.owns_torch_dist = transport == "gloo" and not had_dist
        state.engine = Engine(comms, control, config)
        context.set_context(context.CommContext(topology, config.hierarchical_allreduce,
                                                _execute_custom, _submit_custom))
        if not state.atexit_registered:
            atexit.register(_shutdown_at_exit)
            state.atexit_registered = True


def _control_channel(transport: str, world, config: Config):
    """The engine's negotiation channel: MPI's own messages under MPI (a round is ~4 us on one
    host where TCP takes ~50 us), a TCP star beside Gloo (whose small-message latency is
    0.3-2 ms here)."""
    if transport == "mpi":
        from .backends.control_mpi import MPIControlChannel
        return MPIControlChannel.connect(world.comm, config.timeout_s)
    return ControlChannel.connect(world, config.timeout_s, config.control_iface)


def shutdown():
    """Stop the engine; pending requests that cannot complete fail with an error."""
    with state.lock:
        if state.engine is None:
            return
        engine, state.engine = state.engine, None
        engine.shutdown()
        state.control.close()
        state.topology.close()
        if state.owns_torch_dist:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        state.topology = state.comms = state.control = None
        context.set_context(None)
    if engine.shutdown_errors:
        raise HorovodInternalError("; ".join(engine.shutdown_errors))


def _execute_custom(name, fn):
    """Run ``fn(topology)`` as the engine's request ``name`` on every rank; its result."""
    request = Request(name, "custom", [], fn=fn)
    return engine().submit(request, wake=False).wait()[0]


def _submit_custom(name, fn):
    """Queue ``fn(topology)`` as the engine's request ``name``; a handle whose wait() returns
    its result."""
    request = Request(name, "custom", [], fn=fn)
    handle = engine().submit(request)
    handle.post = lambda result: result[0]
    return handle


def _shutdown_at_exit():
    try:
        shutdown()
    except HorovodInternalError as exc:
        logging.getLogger("horovod_ext").error("%s", exc)


def is_initialized() -> bool:
    return state.engine is not None


def engine() -> Engine:
    if state.engine is None:
        raise NotInitializedError()
    return state.engine


def topology() -> Topology:
    if state.topology is None:
        raise NotInitializedError()
    return state.topology
