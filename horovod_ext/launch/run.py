"""``hvdrun``: start a horovod_ext job (the console script's entry point is ``main``).

Gloo mode (the default) starts every rank itself under an agent (agent.py), locally or through
ssh, with its HOROVOD_* variables, rank 0's host being the rendezvous point; MPI mode builds and
runs mpirun.  Either way the processes are supervised by ``supervise.Supervisor``.  torch is never
imported here (only by --check-build), so that hvdrun starts in a fraction of a second.
"""
import contextlib
import os
import sys
import tempfile

from . import hosts as hostlib
from . import agent, mpi, netinfo, options, remote
from .supervise import Output, Supervisor

AGENT = os.path.abspath(agent.__file__)
NOTIFY_VAR = "HOROVOD_HVDRUN_NOTIFY"
# Inherited variables that would make a rank believe another launcher started it.
_STALE = ("OMPI_COMM_WORLD_", "PMI_", "PMIX_", "MV2_COMM_WORLD_")


class LaunchError(RuntimeError):
    pass


def version() -> str:
    import horovod_ext  # the package root is light: no torch
    return horovod_ext.__version__


def _horovod_module() -> str:
    """What ``import horovod`` gives here: our compatibility package, the real Horovod or
    nothing."""
    from importlib import metadata
    for dist, what in (("horovod-ext-compat", "horovod_ext under Horovod's names "
                                              "(horovod-ext-compat {version})"),
                       ("horovod", "the real Horovod {version}")):
        try:
            return what.format(version=metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
    return "not installed (.venv/bin/pip install ./compat makes Horovod scripts run unchanged)"


def check_build() -> int:
    import torch
    import horovod_ext.torch as hvd  # torch only here: hvdrun itself stays fast to start

    def row(ok, what):
        print(f"    [{'X' if ok else ' '}] {what}")

    try:
        mpirun = mpi.find_mpirun()
        kind, major = mpi.detect(mpirun)
        launcher = f"{mpirun} ({'Open MPI' if kind == 'openmpi' else 'MPICH/Hydra'} {major})"
    except mpi.MPIError:
        launcher = None
    print(f"horovod_ext v{version()}:\n")
    print("Available Frameworks:")
    row(True, f"PyTorch {torch.__version__}")
    print("\nAvailable Controllers:")
    row(hvd.mpi_built(), "MPI")
    row(hvd.gloo_built(), "Gloo")
    print("\nAvailable Tensor Operations:")
    row(hvd.nccl_built() and torch.cuda.is_available(), "NCCL")
    row(hvd.mpi_built(), "MPI")
    row(hvd.gloo_built(), "Gloo")
    print("\nRegistered reduction ops:")
    for name in sorted(hvd.registered_ops()):
        row(True, name)
    print(f"\nmpirun for --mpi: {launcher or 'not found'}")
    print(f"import horovod: {_horovod_module()}")
    from horovod_ext.backends.bootstrap import LAUNCH_ORDER, detect_launch
    here = detect_launch().kind
    print("\nhvd.init() finds its world from, in this order:")
    for kind, description in LAUNCH_ORDER:
        print(f"    {description}" + ("   <- this process" if kind == here else ""))
    return 0


def _base_env(o) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_STALE)}
    env.setdefault("PYTHONUNBUFFERED", "1")  # rank output shows up as it is printed
    env.update(options.horovod_env(o))
    env.update(getattr(o, "extra_env", {}))  # horovod_ext.run's driver address and key
    return env


def _say(message: str):
    print(f"hvdrun: {message}", file=sys.stderr, flush=True)


def _remote_hosts(o, local_addrs):
    used = []
    for slot in o.slots:
        if slot.host not in used:
            used.append(slot.host)
    return [h for h in used if not hostlib.is_local(h, local_addrs)]


def _network(o, remote_hosts):
    """(rendezvous address, port, {host: interface for torch's Gloo}, hvdrun's own addresses
    for remote ranks).  Every remote host is asked for a free port and its interfaces; rank 0's
    host offers the address closest to all others, and each host uses its interface nearest to
    that address unless --network-interfaces or GLOO_SOCKET_IFNAME says otherwise."""
    if not remote_hosts:
        return "127.0.0.1", netinfo.free_port(), {}, []
    found = remote.check_hosts(remote.ssh_prefix(o), remote_hosts, o.interfaces,
                               o.start_timeout)
    mine = netinfo.interfaces(o.interfaces or None)
    my_addrs = [a for _, a in mine if not a.startswith("127.")]
    where = f" on {','.join(o.interfaces)}" if o.interfaces else ""
    if not my_addrs:
        raise LaunchError(f"this host has no IPv4 address other than loopback{where}: the "
                          f"other hosts could not report back to hvdrun")
    hosts = list(dict.fromkeys(slot.host for slot in o.slots))
    ifaces = {h: found[h][1] if h in found else mine for h in hosts}
    first = hosts[0]
    port = found[first][0] if first in found else netinfo.free_port()
    addr = netinfo.rendezvous_address([a for _, a in ifaces[first]],
                                      [[a for _, a in ifaces[h]] for h in hosts[1:]])
    if addr is None:
        raise LaunchError(f"host {first} (rank 0) has no IPv4 address other than loopback"
                          f"{where}: the other hosts could not reach it")
    gloo_ifaces = {}
    if not o.interfaces and "GLOO_SOCKET_IFNAME" not in os.environ:
        gloo_ifaces = {h: netinfo.nearest_interface(ifaces[h], addr) for h in hosts}
    return addr, port, gloo_ifaces, my_addrs


def run_gloo(o, failures=None) -> int:
    remote_hosts = _remote_hosts(o, netinfo.ipv4_addresses())
    prefix = remote.ssh_prefix(o)
    addr, port, gloo_ifaces, mine = _network(o, remote_hosts)
    if o.verbose:
        _say(f"{o.np} ranks on {', '.join(f'{h}:{s}' for h, s in o.host_list)}; rendezvous "
             f"{addr}:{port}; remote hosts: {', '.join(remote_hosts) or 'none'}"
             + "".join(f"; {h} uses {i}" for h, i in gloo_ifaces.items()))

    sup = Supervisor(Output(o.output_filename, len(str(o.np - 1))), o.start_timeout,
                     {s.rank: s.host for s in o.slots}, o.verbose, failures)
    notify_port = sup.listen("0.0.0.0" if remote_hosts else "127.0.0.1")
    base = _base_env(o)
    base.update(HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_RENDEZVOUS_ADDR=addr,
                HOROVOD_GLOO_RENDEZVOUS_PORT=str(port))
    cwd = os.getcwd()
    for slot in o.slots:
        env = dict(base, **slot.env())
        if gloo_ifaces.get(slot.host):
            env.update(GLOO_SOCKET_IFNAME=gloo_ifaces[slot.host],
                       HOROVOD_GLOO_IFACE=gloo_ifaces[slot.host])
        name = f"rank {slot.rank} (host {slot.host})"
        try:
            if slot.host in remote_hosts:
                env[NOTIFY_VAR] = f"{','.join(mine)}:{notify_port}"
                argv = remote.rank_command(prefix, slot.host, o.command,
                                           remote.forwarded_env(env), cwd)
                sup.start(name, argv, dict(os.environ), agent=True, rank=slot.rank,
                          shown=" ".join(argv[:-1] + ["..."] + list(o.command)))
            else:
                env[NOTIFY_VAR] = f"127.0.0.1:{notify_port}"
                sup.start(name, [sys.executable, "-I", AGENT] + list(o.command), env, agent=True,
                          rank=slot.rank, shown=" ".join(o.command))
        except OSError as exc:
            _say(f"cannot start {name}: {exc}")
            for proc in sup.procs:
                proc.kill()
            return 127
    return sup.run()


def run_mpi(o, failures=None) -> int:
    mpirun = mpi.find_mpirun()
    kind = mpi.detect(mpirun)
    local_addrs = netinfo.ipv4_addresses()
    remote_hosts = _remote_hosts(o, local_addrs)
    if remote_hosts:
        remote.check_hosts(remote.ssh_prefix(o), remote_hosts, o.interfaces, o.start_timeout)
    sup = Supervisor(Output(None, 0), o.start_timeout, {s.rank: s.host for s in o.slots},
                     o.verbose, failures)
    notify_port = sup.listen("0.0.0.0" if remote_hosts else "127.0.0.1")
    reach = [a for a in local_addrs if not a.startswith("127.")] if remote_hosts else []
    env = _base_env(o)
    env[NOTIFY_VAR] = f"{','.join(reach + ['127.0.0.1'])}:{notify_port}"
    if o.output_filename and kind[0] == "mpich":  # Hydra does not create the folders
        for slot in o.slots:
            os.makedirs(os.path.join(o.output_filename, f"rank.{slot.rank}"), exist_ok=True)
    # Every rank here: a session directory of this job's own (mpi.session_flags).  Other hosts
    # keep their own TMPDIR, which this host cannot create or clean.
    own_session = contextlib.nullcontext() if remote_hosts else \
        tempfile.TemporaryDirectory(prefix="hvdrun-mpi-", ignore_cleanup_errors=True)
    with own_session as session:
        cmd = mpi.command(mpirun, kind, o, env, os.geteuid() == 0, session)
        try:
            sup.start("mpirun", cmd, env, agent=False, pipe_output=False)
        except OSError as exc:
            raise LaunchError(f"cannot start {mpirun}: {exc}") from None
        return sup.run()


def print_plan(o) -> int:
    """hvdrun --plan: the scale model's table for the stated cluster and model."""
    from horovod_ext import planning
    ops = o.plan_ops.split(",") if o.plan_ops else tuple(planning.OPS)
    try:
        result = planning.plan(model_size=o.model_size, compute_ms=o.compute_ms,
                               optimizer_ms=o.optimizer_ms, nodes=o.nodes,
                               ranks_per_node=o.ranks_per_node, link=o.link, latency=o.latency,
                               nodes_per_rack=o.nodes_per_rack,
                               oversubscription=o.oversubscription, ops=ops,
                               profile=o.plan_profile)
    except (ValueError, FileNotFoundError, planning.EngineMissing) as exc:
        _say(f"--plan: {exc}")
        return 2
    print(result.table())
    return 0


def launch(o, failures=None) -> int:
    """Start and supervise the job that options ``o`` describe; its exit status.  What ended
    it, when a rank failed, is appended to ``failures`` (``supervise.Failure``s)."""
    if o.elastic:
        from .elastic import ElasticDriver
        return ElasticDriver(o, _base_env(o), AGENT).run()
    return run_mpi(o, failures) if o.mpi else run_gloo(o, failures)


def main(argv=None) -> int:
    o = options.parse(argv)
    if o.version:
        print(f"hvdrun (horovod_ext) {version()}")
        return 0
    if o.check_build:
        return check_build()
    if o.plan:
        return print_plan(o)
    try:
        return launch(o)
    except (LaunchError, remote.Unreachable, mpi.MPIError) as exc:
        _say(str(exc))
        return 1
    except KeyboardInterrupt:  # before the ranks started; afterwards the Supervisor handles it
        return 130


if __name__ == "__main__":
    sys.exit(main())
