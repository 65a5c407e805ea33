"""``RayExecutor``: Ray actors as horovod_ext ranks (see the package docstring)."""
import os
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("horovod_ext.ray needs Ray: pip install -e \".[ray]\" (or "
                      "pip install 'ray>=2.9')") from exc

# After the first failed worker, how long the others' outcomes are awaited, so that a dead
# worker is named rather than the peer that noticed its death first.
_SETTLE_S = 5.0


def _no_callbacks(callbacks):
    if callbacks:
        raise NotImplementedError("RayExecutor: callbacks are not provided; return what the "
                                  "workers report from the function instead")


class WorkerDied(RuntimeError):
    """A worker actor died (its process was killed or crashed); ``rank`` names it."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


@dataclass
class RaySettings:
    """What ``RayExecutor.create_settings`` returns (Horovod's settings object for Ray)."""
    timeout_s: float = 30.0                 # start-up: every rank must reach hvd.init() in it
    placement_group_timeout_s: float = 100.0
    ssh_identity_file: Optional[str] = None  # accepted for Horovod's API; Ray needs no ssh
    nics: Optional[List[str]] = None         # network interfaces for Gloo (GLOO_SOCKET_IFNAME)
    verbose: int = 1


class _Worker:
    """The actor behind one rank: holds the environment and the optional executable object."""

    def __init__(self):
        self.executable = None

    def where(self):
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def update_env_vars(self, env: Dict[str, str]):
        os.environ.update({k: str(v) for k, v in env.items()})

    def start_executable(self, cls, args, kwargs):
        self.executable = cls(*(args or []), **(kwargs or {})) if cls is not None else None

    def execute(self, fn):
        return fn(self.executable)

    def run(self, fn, args, kwargs):
        return fn(*args, **kwargs)


class RayExecutor:
    """A group of Ray actors that are the ranks of one horovod_ext job.

    ``num_workers`` (packed onto as few nodes as fit) or ``num_hosts`` with
    ``num_workers_per_host`` (spread: that many workers on each of that many nodes);
    ``cpus_per_worker`` and, with ``use_gpu``, ``gpus_per_worker`` Ray resources each."""

    @classmethod
    def create_settings(cls, timeout_s: float = 30, ssh_identity_file: Optional[str] = None,
                        ssh_str: Optional[str] = None, placement_group_timeout_s: float = 100,
                        nics: Optional[List[str]] = None) -> RaySettings:
        if ssh_str and ssh_identity_file and not os.path.exists(ssh_identity_file):
            fd = os.open(ssh_identity_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(ssh_str)
        return RaySettings(timeout_s=timeout_s, ssh_identity_file=ssh_identity_file,
                           placement_group_timeout_s=placement_group_timeout_s,
                           nics=list(nics) if nics else None)

    def __init__(self, settings: Optional[RaySettings] = None, num_workers: Optional[int] = None,
                 num_hosts: Optional[int] = None, num_workers_per_host: int = 1,
                 cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[float] = None,
                 use_current_placement_group: bool = True,
                 min_workers: Optional[int] = None, max_workers: Optional[int] = None,
                 reset_limit: Optional[int] = None, cooldown_range=None,
                 elastic_timeout: int = 1200, override_discovery: bool = True):
        if min_workers is not None or max_workers is not None:
            raise NotImplementedError("elastic RayExecutor (min_workers/max_workers) is not "
                                      "provided: use hvdrun --min-np/--max-np for elastic jobs")
        if bool(num_workers) == bool(num_hosts):
            raise ValueError("RayExecutor needs exactly one of num_workers and num_hosts")
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"RayExecutor: {name} must be a positive integer, got {value!r}")
        if cpus_per_worker is None or cpus_per_worker < 0:
            raise ValueError(f"RayExecutor: cpus_per_worker must be >= 0, got {cpus_per_worker!r}")
        if gpus_per_worker and not use_gpu:
            raise ValueError("RayExecutor: gpus_per_worker is set but use_gpu is False")
        self.settings = settings or RaySettings()
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host if num_hosts else None
        self.num_workers = num_workers or num_hosts * num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.workers: List[Any] = []      # actor handles in rank order
        self.nodes: List[str] = []        # Ray node id of each rank
        self._pg = None
        self._owns_pg = False             # False when running in the caller's placement group

    # -- start-up ---------------------------------------------------------------------------

    def _bundles(self):
        per_worker = {"CPU": self.cpus_per_worker}
        if self.use_gpu:
            per_worker["GPU"] = self.gpus_per_worker
        if self.num_hosts:
            host = {k: v * self.num_workers_per_host for k, v in per_worker.items()}
            return [host] * self.num_hosts, "STRICT_SPREAD"
        return [per_worker] * self.num_workers, "PACK"

    def start(self, executable_cls: type = None, executable_args: Optional[List] = None,
              executable_kwargs: Optional[Dict] = None,
              extra_env_vars: Optional[Dict] = None):
        """Place the workers, give each its rank and the rendezvous point, and create
        ``executable_cls(*executable_args, **executable_kwargs)`` in each (for ``execute``)."""
        if not ray.is_initialized():
            ray.init()
        bundles, strategy = self._bundles()
        current = ray.util.get_current_placement_group()
        if self.use_current_placement_group and current is not None:
            self._pg, self._owns_pg = current, False
        else:
            self._pg, self._owns_pg = placement_group(bundles, strategy=strategy), True
            try:
                ray.get(self._pg.ready(), timeout=self.settings.placement_group_timeout_s)
            except GetTimeoutError:
                remove_placement_group(self._pg)
                self._pg = None
                raise RuntimeError(
                    f"RayExecutor: the cluster could not place {len(bundles)} bundle(s) of "
                    f"{bundles[0]} ({strategy}) within {self.settings.placement_group_timeout_s:g}"
                    f" s; available: {ray.available_resources()}") from None
        per_bundle = self.num_workers_per_host if self.num_hosts else 1
        actor = ray.remote(_Worker)
        created = []
        for i in range(self.num_workers):
            bundle = i // per_bundle if self._owns_pg else -1
            created.append(actor.options(
                num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=bundle)).remote())
        where = ray.get([w.where.remote() for w in created])
        # ranks node by node, in the order the nodes first appear: local ranks are contiguous
        by_node: "OrderedDict[str, List[int]]" = OrderedDict()
        for index, (node, _) in enumerate(where):
            by_node.setdefault(node, []).append(index)
        order = [i for members in by_node.values() for i in members]
        self.workers = [created[i] for i in order]
        self.nodes = [where[i][0] for i in order]
        rendezvous_addr = where[order[0]][1]
        port = ray.get(self.workers[0].free_port.remote())
        common = {"HOROVOD_SIZE": self.num_workers, "HOROVOD_CROSS_SIZE": len(by_node),
                  "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_addr,
                  "HOROVOD_GLOO_RENDEZVOUS_PORT": port, "HOROVOD_CPU_OPERATIONS": "gloo",
                  "HOROVOD_START_TIMEOUT": self.settings.timeout_s}
        if self.settings.nics:
            common["GLOO_SOCKET_IFNAME"] = ",".join(self.settings.nics)
        common.update(extra_env_vars or {})
        calls = []
        rank = 0
        for cross_rank, members in enumerate(by_node.values()):
            for local_rank in range(len(members)):
                env = dict(common, HOROVOD_RANK=rank, HOROVOD_LOCAL_RANK=local_rank,
                           HOROVOD_LOCAL_SIZE=len(members), HOROVOD_CROSS_RANK=cross_rank,
                           HOROVOD_HOSTNAME=self.nodes[rank])
                calls.append(self.workers[rank].update_env_vars.remote(env))
                rank += 1
        ray.get(calls)
        self._gather([w.start_executable.remote(executable_cls, executable_args,
                                                executable_kwargs) for w in self.workers])

    # -- running ----------------------------------------------------------------------------

    def _check_started(self):
        if not self.workers:
            raise RuntimeError("RayExecutor: call start() first")

    def _gather(self, refs: List[Any]) -> List[Any]:
        """Every ref's value in rank order; the first failure raised naming its rank (a dead
        worker named before the peers that saw it die)."""
        index = {ref: rank for rank, ref in enumerate(refs)}
        pending, failed = list(refs), []
        while pending and not failed:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as exc:  # noqa: BLE001 (re-raised below, with the rank)
                failed.append((index[done[0]], exc))
        if failed:
            deadline = time.monotonic() + _SETTLE_S
            while pending and time.monotonic() < deadline:
                done, pending = ray.wait(pending, num_returns=1,
                                         timeout=max(0.0, deadline - time.monotonic()))
                for ref in done:
                    try:
                        ray.get(ref)
                    except Exception as exc:  # noqa: BLE001
                        failed.append((index[ref], exc))
            dead = [(r, e) for r, e in failed if isinstance(e, RayActorError)]
            rank, exc = (dead or failed)[0]
            others = sorted(r for r, _ in failed if r != rank)
            also = f"; rank(s) {', '.join(map(str, others))} failed too" if others else ""
            if dead:
                raise WorkerDied(f"RayExecutor: the worker of rank {rank} (Ray node "
                                 f"{self.nodes[rank][:12]}) died{also}: {exc}", rank) from exc
            if hasattr(exc, "add_note"):
                exc.add_note(f"RayExecutor: raised on rank {rank}{also}")
            raise exc
        return ray.get(refs)

    def execute(self, fn: Callable[[Any], Any], callbacks: Optional[List[Callable]] = None
                ) -> List[Any]:
        """``fn(executable)`` on every worker; the results in rank order."""
        _no_callbacks(callbacks)
        self._check_started()
        return self._gather([w.execute.remote(fn) for w in self.workers])

    def run(self, fn: Callable, args: Optional[List] = None, kwargs: Optional[Dict] = None,
            callbacks: Optional[List[Callable]] = None) -> List[Any]:
        """``fn(*args, **kwargs)`` on every worker; the results in rank order."""
        _no_callbacks(callbacks)
        return self._gather(self.run_remote(fn, args, kwargs))

    def run_remote(self, fn: Callable, args: Optional[List] = None,
                   kwargs: Optional[Dict] = None) -> List[Any]:
        """As ``run``, but the ObjectRefs (for ``ray.get``) instead of the results."""
        self._check_started()
        return [w.run.remote(fn, list(args or []), dict(kwargs or {})) for w in self.workers]

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only."""
        self._check_started()
        return self._gather([self.workers[0].execute.remote(fn)])[0]

    def shutdown(self):
        """Stop the workers and free their placement group."""
        for worker in self.workers:
            ray.kill(worker)
        self.workers, self.nodes = [], []
        if self._pg is not None and self._owns_pg:
            remove_placement_group(self._pg)
        self._pg = None
