"""Process-wide state: init and shutdown, the topology, and the running engines.

``init`` reads the environment (config.py), builds the world communicator for the chosen
transport, the local/cross topology and the control plane, and starts the background engine.
Each process set (a subgroup of the world) gets an engine of its own over its own
communicators and control plane, so requests on different sets never wait on each other.
"""
import atexit
import logging
import sys
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from horovod_ext.backends import bootstrap, context
from horovod_ext.backends.collectives import Collectives
from horovod_ext.backends.control import ControlChannel
from horovod_ext.backends.topology import Topology
from horovod_ext.config import Config, ConfigError
from horovod_ext.ops import reset_all as reset_all_ops

from . import autotune, cpu_threads, host_heap, timeline
from .engine import Engine
from .faults import FaultRouter
from .requests import HorovodInternalError, Request

_LEVELS = {"trace": logging.DEBUG, "debug": logging.DEBUG, "info": logging.INFO,
           "warning": logging.WARNING, "error": logging.ERROR, "fatal": logging.CRITICAL}


@dataclass
class _SetRuntime:
    """A registered process set on this rank; ``engine`` is None where the rank is not in it."""
    ranks: List[int]
    topology: Optional[Topology] = None
    control: Optional[object] = None
    engine: Optional[Engine] = None

    def close(self) -> List[str]:
        """Stop the set's engine (collective over the set's members); its shutdown errors."""
        if self.engine is None:
            return []
        engine, self.engine = self.engine, None
        engine.shutdown()
        self.control.close()
        self.topology.close()
        return engine.shutdown_errors


class _State:
    def __init__(self):
        self.lock = threading.RLock()
        self.config: Optional[Config] = None
        self.comms: Optional[Collectives] = None
        self.transport: Optional[str] = None
        self.owns_torch_dist = False
        self.atexit_registered = False
        # process set id -> its runtime; the world is process set 0, registered by init
        self.sets: Dict[int, _SetRuntime] = {}
        self.next_set_id = 1
        self.generation = 0   # counts inits: work begun before the latest one is void
        self.last_world_size = 0   # the world's size at the latest init (0: none yet)
        self.clock_zero_ns = 0   # time.time_ns() here at rank 0's init (the timeline's zero)
        self.autotuner: Optional[autotune.Autotuner] = None
        self.faults: Optional[FaultRouter] = None

    # The world's runtime, read through process set 0.
    @property
    def engine(self) -> Optional[Engine]:
        world = self.sets.get(0)
        return None if world is None else world.engine

    @property
    def topology(self) -> Optional[Topology]:
        world = self.sets.get(0)
        return None if world is None else world.topology

    @property
    def control(self) -> Optional[ControlChannel]:
        world = self.sets.get(0)
        return None if world is None else world.control


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
            return   # (hvd.init() shuts a stopped engine down before it comes here)
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
        cpu_threads.limit_to_share(topology.local_size)
        if config.keep_host_heap:
            host_heap.keep()
        state.config = config
        state.sets, state.next_set_id = {0: _SetRuntime(list(range(world.size)), topology)}, 1
        try:
            state.clock_zero_ns = timeline.clock_zero(world)
            # Before the engine runs: a faster rank's first submission reaches this rank's
            # negotiation as soon as the engine's loop starts, and belongs in the timeline.
            if config.timeline and config.timeline.upper() != "DYNAMIC":
                _start_timeline(config.timeline, config.timeline_mark_cycles)
            state.faults = FaultRouter.start(world, transport, config, lambda: state.sets)
            control, comms, engine = _start_engine(topology, transport, config, 0)
        except BaseException:
            timeline.stop()
            state.sets = {}
            if state.faults is not None:
                state.faults.close()
            raise
        state.comms, state.transport = comms, transport
        state.sets[0].control, state.sets[0].engine = control, engine
        state.owns_torch_dist = transport == "gloo" and not had_dist
        if state.last_world_size and state.last_world_size != world.size:
            reset_all_ops()   # their state (error feedback, factors) belongs to the old world
        state.last_world_size = world.size
        state.generation += 1
        state.autotuner = None
        if config.autotune:
            state.autotuner = autotune.Autotuner(config, autotune.Setting.of(config, comms),
                                                 topology.hierarchy_applies, world.rank)
        context.set_context(context.CommContext(topology, config.hierarchical_allreduce,
                                                execute_custom, _submit_custom))
        if not state.atexit_registered:
            atexit.register(_shutdown_at_exit)
            state.atexit_registered = True


def _start_timeline(path: str, mark_cycles: bool):
    """Record a timeline into ``path`` where this rank writes one (config.timeline_all_ranks)."""
    mine = timeline.path_for_rank(path, state.topology.rank, state.config.timeline_all_ranks)
    timeline.stop()
    if mine is not None:
        timeline.start(mine, state.topology.rank, mark_cycles, state.clock_zero_ns)


def start_timeline(path: str, mark_cycles: bool = False):
    """Start writing a timeline to ``path`` (rank 0; every rank with
    HOROVOD_TIMELINE_ALL_RANKS=1), replacing any timeline being written."""
    with state.lock:
        if state.engine is None:
            raise NotInitializedError()
        if not path:
            raise ValueError("start_timeline needs a file path")
        _start_timeline(str(path), bool(mark_cycles))


def stop_timeline():
    """Stop writing the timeline, if one is being written, and complete its file."""
    timeline.stop()


def autotune_step(nbytes: int):
    """A training step that reduced ``nbytes`` is done (DistributedOptimizer.step(), on every
    rank).  At the end of an autotune sample: rank 0 scores it and proposes the next setting,
    which every rank applies at this same step (autotune.py)."""
    tuner = state.autotuner
    if tuner is None or tuner.frozen or not tuner.count_step(nbytes):
        return
    proposal = tuner.conclude_sample() if tuner.rank == 0 else None
    world_engine = engine()

    def exchange(topology):
        t = (proposal[0].to_tensor(proposal[1]) if proposal is not None
             else autotune.Setting.empty_tensor())
        topology.world.broadcast(t, 0)
        setting, frozen = autotune.Setting.from_tensor(t)
        autotune.apply(setting, world_engine, state)
        return setting, frozen

    setting, frozen = execute_custom(f"autotune.sample.{tuner.samples}", exchange)
    tuner.begin_sample(setting, frozen)


def _start_engine(topology: Topology, transport: str, config: Config, set_id: int):
    """(control plane, collectives, engine) over ``topology``'s communicators, for process set
    ``set_id``."""
    control = _control_channel(transport, topology.world, config)
    topology.allow_shared_memory(config.shared_memory, config.timeout_s)
    comms = Collectives(topology, config.hierarchical_allreduce, config.hierarchical_allgather,
                        config.hierarchical_chunk_bytes)
    engine = Engine(comms, control, config)
    state.faults.watch(engine, set_id)
    return control, comms, engine


def _control_channel(transport: str, world, config: Config):
    """The engine's negotiation channel: MPI's own messages under MPI (a round costs far less
    than over TCP), a TCP star beside Gloo (whose own small messages are slow)."""
    if transport == "mpi":
        from horovod_ext.backends.control_mpi import MPIControlChannel
        return MPIControlChannel.connect(world.comm, config.timeout_s)
    return ControlChannel.connect(world, config.timeout_s, config.control_iface)


def shutdown():
    """Stop the engine; pending requests that cannot complete fail with an error."""
    with state.lock:
        if state.engine is None:
            return
        errors = []
        world = state.sets.pop(0)
        for set_runtime in state.sets.values():
            errors += set_runtime.close()
        state.sets = {}
        errors += world.close()
        state.faults.close()
        timeline.stop()
        if state.owns_torch_dist:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        state.comms = None
        context.set_context(None)
    if errors:
        raise HorovodInternalError("; ".join(errors))


# --- process sets -----------------------------------------------------------------------------
def add_process_set(ranks: List[int]) -> int:
    """Register the process set of world ``ranks`` (ascending) and start its engine on its
    members; its id.  A collective call on every rank of the world, with the same ranks
    everywhere; errors (ValueError) are raised alike on every rank."""
    def register(topology: Topology):
        everyone = topology.world.allgather_object(ranks)
        if any(r != ranks for r in everyone):
            differ = "; ".join(f"rank {i}: {r}" for i, r in enumerate(everyone))
            return f"hvd.add_process_set was called with different ranks on different ranks ({differ})"
        if ranks == list(range(topology.size)):
            return (f"process set {ranks} holds every rank: it is the global process set "
                    f"(hvd.global_process_set)")
        for set_id, known in state.sets.items():
            if known.ranks == ranks:
                return f"a process set with ranks {ranks} exists already (id {set_id})"
        sub = Topology.for_ranks(topology, ranks)
        set_runtime = _SetRuntime(ranks)
        if sub is not None:
            set_runtime.topology = sub
            set_runtime.control, _, set_runtime.engine = _start_engine(
                sub, state.transport, state.config, state.next_set_id)
        set_id, state.next_set_id = state.next_set_id, state.next_set_id + 1
        state.sets[set_id] = set_runtime
        return set_id

    outcome = execute_custom(f"__process_set_add__.{state.next_set_id}", register)
    if isinstance(outcome, str):
        raise ValueError(outcome)
    return outcome


def remove_process_set(set_id: int) -> bool:
    """Stop and forget process set ``set_id``; False when no such set is registered.  A
    collective call on every rank of the world."""
    def remove(topology: Topology):
        everyone = topology.world.allgather_object(set_id)
        if any(i != set_id for i in everyone):
            differ = "; ".join(f"rank {r}: id {i}" for r, i in enumerate(everyone))
            return f"hvd.remove_process_set was called for different sets on different ranks ({differ})"
        set_runtime = state.sets.pop(set_id, None) if set_id else None
        if set_runtime is None:     # the world (set 0) is not removed
            return False
        errors = set_runtime.close()
        if errors:
            logging.getLogger("horovod_ext").error("%s", "; ".join(errors))
        return True

    outcome = execute_custom(f"__process_set_remove__.{set_id}", remove)
    if isinstance(outcome, str):
        raise ValueError(outcome)
    return outcome


def allgather_object(obj, name: str) -> list:
    """Every world rank's ``obj``, in rank order, as a negotiated request named ``name``."""
    return execute_custom(name, lambda topology: topology.world.allgather_object(obj))


def process_set_ranks(set_id: int) -> Optional[List[int]]:
    """The world ranks of registered set ``set_id`` (0: the world); None when unknown."""
    if state.engine is None and set_id == 0:
        raise NotInitializedError()
    set_runtime = state.sets.get(set_id)
    return None if set_runtime is None else list(set_runtime.ranks)


def set_topology(set_id: int) -> Topology:
    """The topology of process set ``set_id`` on this rank (a ValueError where it is not a
    member or the set is not registered)."""
    return _member_runtime(set_id).topology


def engine_for(set_id: int) -> Engine:
    """The engine of process set ``set_id`` (0: the world)."""
    return _member_runtime(set_id).engine


def _member_runtime(set_id: int) -> _SetRuntime:
    if state.engine is None:
        raise NotInitializedError()
    set_runtime = state.sets.get(set_id)
    if set_runtime is None:
        raise ValueError(f"process set id {set_id} is not registered: use a set returned by "
                         f"hvd.add_process_set() or passed to hvd.init(process_sets=...), "
                         f"and not removed since")
    if set_runtime.engine is None:
        raise ValueError(f"rank {state.topology.rank} is not a member of process set "
                         f"{set_id} (ranks {set_runtime.ranks})")
    return set_runtime


def execute_custom(name, fn):
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
