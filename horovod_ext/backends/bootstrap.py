"""Start-up: find out how this process was launched and build the world communicator.

Recognised launches, in this order: hvdrun's elastic driver, mpirun (Open MPI, MPICH/Hydra, any
PMI or PMIx launcher, ``srun --mpi=pmi2|pmix`` included), our own launcher's HOROVOD_* variables,
torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), a Slurm job step (``srun`` without MPI:
SLURM_PROCID, SLURM_STEP_NUM_TASKS, the step's first node as the rendezvous), and a plain single
process.  The data transport is chosen separately ("mpi" or "gloo"), as Horovod's
HOROVOD_CPU_OPERATIONS does.
"""
import datetime
import itertools
import os
import re
import socket
from dataclasses import dataclass
from typing import List, Mapping, Tuple

from .base import Communicator
from .liveness import take_stopped_workers

_MPI_VARS = [("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
             ("PMIX_RANK", "OMPI_UNIVERSE_SIZE"), ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE")]


# How hvd.init() finds its world, in the order it tries (hvdrun --check-build prints this).
LAUNCH_ORDER = (
    ("comm", "hvd.init(comm=...): the given MPI communicator"),
    ("mpirun", "mpirun or a PMI/PMIx launcher, srun --mpi=pmi2|pmix included "
               "(OMPI_COMM_WORLD_*, PMI_*, PMIX_*)"),
    ("torch.distributed", "an initialised torch.distributed default group (Ray Train, "
                          "Lightning), when the data goes over Gloo"),
    ("elastic", "hvdrun's elastic driver (HOROVOD_ELASTIC_DRIVER)"),
    ("horovod", "hvdrun or horovod_ext.run (HOROVOD_RANK, HOROVOD_SIZE, "
                "HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT)"),
    ("torchrun", "torchrun, Kubeflow PyTorchJob/TrainJob (RANK, WORLD_SIZE, MASTER_ADDR, "
                 "MASTER_PORT)"),
    ("slurm", "a Slurm job step, srun (SLURM_PROCID, SLURM_STEP_NUM_TASKS, "
              "SLURM_STEP_NODELIST, SLURM_JOB_ID)"),
    ("single", "a single process"),
)


@dataclass
class Launch:
    kind: str            # "elastic", "mpirun", "horovod", "torchrun", "slurm" or "single"
    rank: int
    size: int


def _int(env, name):
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} is not an integer") from None


def detect_launch(env: Mapping[str, str] = os.environ) -> Launch:
    if "HOROVOD_ELASTIC_DRIVER" in env:   # rank and size come from the driver at each init
        return Launch("elastic", -1, -1)
    for rank_var, size_var in _MPI_VARS:
        if rank_var in env and size_var in env:
            return Launch("mpirun", _int(env, rank_var), _int(env, size_var))
    if "PMIX_RANK" in env and "SLURM_STEP_NUM_TASKS" in env:  # srun --mpi=pmix
        return Launch("mpirun", _int(env, "PMIX_RANK"), _int(env, "SLURM_STEP_NUM_TASKS"))
    if "HOROVOD_RANK" in env and "HOROVOD_SIZE" in env:
        return Launch("horovod", _int(env, "HOROVOD_RANK"), _int(env, "HOROVOD_SIZE"))
    if "RANK" in env and "WORLD_SIZE" in env:
        return Launch("torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE"))
    # A step's tasks (srun) have SLURM_STEP_NUM_TASKS; the batch script itself has SLURM_PROCID
    # and the job's SLURM_NTASKS but is one process.
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        return Launch("slurm", _int(env, "SLURM_PROCID"), _int(env, "SLURM_STEP_NUM_TASKS"))
    return Launch("single", 0, 1)


_HOSTLIST_ITEM = re.compile(r"[^,\[\]]*(?:\[[^\]]*\][^,\[\]]*)*")


def expand_hostlist(expression: str) -> List[str]:
    """The host names of a Slurm hostlist expression: ``node[01-03,07],gpu1`` -> node01,
    node02, node03, node07, gpu1 (zero padding kept; several bracket groups in one name make
    every combination, as Slurm does)."""
    hosts = []
    pos = 0
    expression = expression.strip()
    while pos < len(expression):
        m = _HOSTLIST_ITEM.match(expression, pos)
        item = m.group(0)
        if not item or (m.end() < len(expression) and expression[m.end()] != ","):
            raise ValueError(f"bad Slurm hostlist {expression!r} at {expression[pos:]!r}")
        parts = re.split(r"\[([^\]]*)\]", item)
        choices = []
        for i, part in enumerate(parts):
            choices.append([part] if i % 2 == 0 else _expand_ranges(part, expression))
        hosts.extend("".join(c) for c in itertools.product(*choices))
        pos = m.end() + 1
    return hosts


def _expand_ranges(ranges: str, expression: str) -> List[str]:
    out = []
    for piece in ranges.split(","):
        low, dash, high = piece.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"bad range {piece!r} in Slurm hostlist {expression!r}")
        if not dash:
            out.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"range {piece!r} runs backwards in Slurm hostlist {expression!r}")
        out.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return out


SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 10000


def slurm_rendezvous(env: Mapping[str, str] = os.environ) -> Tuple[str, int]:
    """(address, port) where a Slurm step's ranks meet: MASTER_ADDR / MASTER_PORT when set,
    else the step's first node (task 0 runs there) and a port derived from SLURM_JOB_ID, so
    every task of the step computes the same one (two concurrent steps of one job need
    MASTER_PORT)."""
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodelist = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                    or env.get("SLURM_NODELIST"))
        if not nodelist:
            raise RuntimeError("started by srun, but neither SLURM_STEP_NODELIST nor "
                               "SLURM_JOB_NODELIST is set: set MASTER_ADDR to the first node")
        addr = expand_hostlist(nodelist)[0]
    if "MASTER_PORT" in env:
        return addr, _int(env, "MASTER_PORT")
    if "SLURM_JOB_ID" not in env:
        raise RuntimeError("started by srun, but SLURM_JOB_ID is not set: set MASTER_PORT")
    return addr, SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID") % SLURM_PORT_SPAN


def started_by_mpirun(env: Mapping[str, str] = os.environ) -> bool:
    return detect_launch(env).kind == "mpirun"


def hostname(env: Mapping[str, str] = os.environ) -> str:
    """HOROVOD_HOSTNAME overrides the host name, so tests can make several 'nodes' on one host."""
    return env.get("HOROVOD_HOSTNAME") or socket.gethostname()


def notify_launcher(stage: str, rank: int, env: Mapping[str, str] = os.environ):
    """Tell hvdrun (HOROVOD_HVDRUN_NOTIFY=ADDR[,ADDR...]:PORT) that this rank reached ``stage``
    ("start" or "ready") of start-up, so that it can name ranks that never arrive.  Best
    effort: start-up never fails because hvdrun cannot be reached."""
    where = env.get("HOROVOD_HVDRUN_NOTIFY")
    if not where:
        return
    addrs, _, port = where.rpartition(":")
    message = f"{stage} {rank} {hostname(env)}\n".encode()
    for addr in addrs.split(","):
        try:
            with socket.create_connection((addr, int(port)), timeout=2.0) as s:
                s.sendall(message)
            return
        except (OSError, ValueError):
            continue


def create_world(transport: str, timeout: float, use_nccl: bool,
                 env: Mapping[str, str] = os.environ, mpi_comm=None) -> Communicator:
    """The communicator over every process of this job, for ``transport`` "mpi" or "gloo"."""
    if detect_launch(env).kind != "elastic":
        notify_launcher("start", detect_launch(env).rank, env)
    world = _create_world(transport, timeout, use_nccl, env, mpi_comm)
    notify_launcher("ready", world.rank, env)
    return world


def _create_world(transport, timeout, use_nccl, env, mpi_comm) -> Communicator:
    launch = detect_launch(env)
    if transport == "mpi":
        if launch.kind == "elastic":
            raise RuntimeError("elastic training runs over Gloo only: set "
                               "HOROVOD_CPU_OPERATIONS=gloo (hvdrun's elastic mode does)")
        from .mpi import MPICommunicator
        if mpi_comm is not None:
            return MPICommunicator(mpi_comm.Dup(), timeout)
        if launch.kind not in ("mpirun", "single"):
            raise RuntimeError(f"MPI operations were asked for, but this process was started by "
                               f"{launch.kind} (rank {launch.rank} of {launch.size}), not mpirun; "
                               f"start it with mpirun or set HOROVOD_CPU_OPERATIONS=gloo")
        world = MPICommunicator.world(timeout)
        if world.size != launch.size:
            raise RuntimeError(f"MPI reports {world.size} processes but the launcher said "
                               f"{launch.size}; was mpi4py built against another MPI?")
        return world
    if transport != "gloo":
        raise ValueError(f"unknown transport {transport!r}: expected 'mpi' or 'gloo'")
    return _create_gloo_world(launch, timeout, use_nccl, env, mpi_comm)


def _create_gloo_world(launch: Launch, timeout: float, use_nccl: bool, env, mpi_comm):
    import torch.distributed as dist
    from .torch_dist import TorchCommunicator

    delta = datetime.timedelta(seconds=timeout)
    if dist.is_initialized():  # the user set up torch.distributed already: use it
        return TorchCommunicator.world(use_nccl, delta)
    if launch.kind == "elastic":
        store, rank, size = _join_elastic(env, delta)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=delta)
    elif launch.kind == "torchrun":
        store = _torchrun_store(env, launch, delta)
        if store is None:
            dist.init_process_group("gloo", init_method="env://", timeout=delta)
        else:
            dist.init_process_group("gloo", store=store, rank=launch.rank,
                                    world_size=launch.size, timeout=delta)
    elif launch.kind == "single":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=delta)
    else:
        if launch.kind == "slurm":
            addr, port = slurm_rendezvous(env)
        elif launch.kind == "horovod":
            addr = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")
            port = _int(env, "HOROVOD_GLOO_RENDEZVOUS_PORT") if "HOROVOD_GLOO_RENDEZVOUS_PORT" in env else None
            if port is None:
                raise RuntimeError("HOROVOD_RANK/HOROVOD_SIZE are set but "
                                   "HOROVOD_GLOO_RENDEZVOUS_PORT is not: cannot find the peers")
        else:  # under mpirun with Gloo data: agree on a rendezvous point through MPI
            addr, port = _rendezvous_over_mpi(mpi_comm)
        store = _rendezvous_store(addr, port, launch.rank, launch.size, delta)
        dist.init_process_group("gloo", store=store, rank=launch.rank, world_size=launch.size,
                                timeout=delta)
    return TorchCommunicator.world(use_nccl, delta)


# One TCPStore per rendezvous point for the life of the process: rank 0's listens on the
# launcher's port, and a store left alive by anything still holding the last process group (a
# traceback after a failure, a user's handle) would otherwise make the next hvd.init() fail
# with EADDRINUSE.
_STORES = {}


def _rendezvous_store(addr: str, port: int, rank: int, size: int, timeout):
    """The store of this job's rendezvous point, under a prefix new to each ``hvd.init()``: the
    ranks count their inits on the store itself, so every rank of the n-th init (a rank
    started afresh included) meets under the same prefix, away from the keys of earlier ones."""
    import torch.distributed as dist
    key = (addr, port, size, rank == 0)
    store = _STORES.get(key)
    if store is None:
        store = _STORES[key] = dist.TCPStore(addr, port, size, rank == 0, timeout=timeout)
    else:
        store.set_timeout(timeout)
    generation = (store.add("horovod_ext/inits", 1) - 1) // size
    return dist.PrefixStore(f"horovod_ext/init{generation}/", store)


def _torchrun_store(env, launch: Launch, timeout):
    """Under torchrun's agent, its store with a prefix of its own per restart, or None (then
    env:// as usual).  The agent's store outlives the workers it restarts, and torch's env://
    rendezvous would read the addresses the workers of the last attempt left there."""
    import torch.distributed as dist
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in env:
        return None
    store = dist.TCPStore(env["MASTER_ADDR"], _int(env, "MASTER_PORT"), launch.size, False,
                          timeout=timeout)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"horovod_ext/torchrun/attempt{attempt}/", store)


@dataclass
class ElasticMembership:
    """This worker's place in the current generation of an elastic job (set by each init)."""
    generation: int
    rank: int
    size: int
    hosts_updates: int        # the driver's count of host changes when this generation formed
    store: object             # the driver's store (TCPStore client), unprefixed


elastic_membership = None


def _join_elastic(env, timeout):
    """Ask the elastic driver (hvdrun, HOROVOD_ELASTIC_DRIVER=ADDR:PORT) for this worker's rank
    and size in the next generation; waits while the driver gathers the workers (at most
    HOROVOD_ELASTIC_TIMEOUT seconds).  Returns (store under the generation's prefix, rank,
    size)."""
    import torch.distributed as dist
    global elastic_membership
    addr, _, port = env["HOROVOD_ELASTIC_DRIVER"].rpartition(":")
    wait = float(env.get("HOROVOD_ELASTIC_TIMEOUT", "600")) + 60.0
    # Peers that stopped answering in the last generation are named: the driver drops them.
    stopped = "".join(f" stopped:{w}" for w in take_stopped_workers())
    line = f"join {env.get('HOROVOD_ELASTIC_WORKER', '?')} {hostname(env)}{stopped}\n"
    try:
        with socket.create_connection((addr, int(port)), timeout=10.0) as conn:
            conn.sendall(line.encode())
            conn.settimeout(wait)
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    break
                reply += chunk
    except OSError as exc:
        raise RuntimeError(f"cannot reach the elastic driver at {addr}:{port}: {exc}") from None
    words = reply.decode(errors="replace").split()
    if words and words[0] == "finished":
        # The job is over for this worker (the others have completed it, or its host is no
        # longer offered): its part is done.
        import logging
        logging.getLogger("horovod_ext").warning("elastic: %s; this worker exits",
                                                 " ".join(words[1:]))
        raise SystemExit(0)
    if not words or words[0] != "member":
        reason = " ".join(words[1:]) if words else "the driver closed the connection"
        raise RuntimeError(f"the elastic driver did not admit this worker: {reason}")
    generation, rank, size, updates, store_port = map(int, words[1:6])
    key = (addr, store_port, "elastic")
    store = _STORES.get(key)
    if store is None:
        store = _STORES[key] = dist.TCPStore(addr, store_port, None, False, timeout=timeout)
    elastic_membership = ElasticMembership(generation, rank, size, updates, store)
    return dist.PrefixStore(f"horovod_ext/elastic{generation}/", store), rank, size


def _rendezvous_over_mpi(mpi_comm):
    from mpi4py import MPI
    from .control import local_ipv4_addresses
    comm = mpi_comm or MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        info = (socket.gethostname(), local_ipv4_addresses(), port)
    else:
        info = None
    host, addrs, port = comm.bcast(info, root=0)
    return ("127.0.0.1" if host == socket.gethostname() else addrs[0]), port
