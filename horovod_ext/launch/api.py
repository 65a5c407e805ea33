"""``horovod_ext.run``: run a Python function on ``np`` workers and return their results, with
``horovod.run``'s signature; the workers start exactly as hvdrun starts them (local processes or
ssh with Gloo, mpirun with MPI, the elastic driver with ``min_np``/``max_np``)."""
import contextlib
import io
import sys
from typing import Callable, List, Optional

from . import driver, netinfo, options
from . import run as hvdrun
from .supervise import Failure


class RunError(RuntimeError):
    """A worker of ``horovod_ext.run`` raised, died or returned nothing.  ``rank`` is the rank
    that failed first (None when it cannot be told), ``remote_traceback`` its traceback."""

    def __init__(self, message: str, rank: Optional[int] = None, remote_traceback: str = ""):
        super().__init__(message)
        self.rank, self.remote_traceback = rank, remote_traceback


def _argv(np, min_np, max_np, slots, reset_limit, hosts, hostfile, start_timeout, ssh_port,
          ssh_identity_file, disable_cache, output_filename, verbose, use_gloo, use_mpi,
          mpi_args, network_interface) -> List[str]:
    argv = ["-np", str(np)]
    for flag, value in (("-H", hosts), ("--hostfile", hostfile),
                        ("--start-timeout", start_timeout), ("--ssh-port", ssh_port),
                        ("--ssh-identity-file", ssh_identity_file),
                        ("--output-filename", output_filename), ("--mpi-args", mpi_args),
                        ("--network-interfaces", network_interface), ("--min-np", min_np),
                        ("--max-np", max_np), ("--slots-per-host", slots),
                        ("--reset-limit", reset_limit)):
        if value is not None:
            argv += [flag, str(value)]
    for flag, on in (("--disable-cache", disable_cache), ("--verbose", verbose),
                     ("--gloo", use_gloo), ("--mpi", use_mpi)):
        if on:
            argv.append(flag)
    return argv


def _parse(argv):
    """hvdrun's checks, as a ValueError instead of an exit."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return options.parse(argv)
    except SystemExit:
        message = err.getvalue().strip().splitlines()
        raise ValueError(message[-1].replace("hvdrun: error: ", "horovod_ext.run: ")
                         if message else f"horovod_ext.run: bad arguments {argv}") from None


def run(func: Callable, args=(), kwargs=None, num_proc: int = 1,
        min_num_proc: Optional[int] = None, max_num_proc: Optional[int] = None,
        slots: Optional[int] = None, reset_limit: Optional[int] = None, cooldown_range=None,
        hosts: Optional[str] = None, hostfile: Optional[str] = None,
        start_timeout: Optional[float] = None, ssh_port: Optional[int] = None,
        ssh_identity_file: Optional[str] = None, disable_cache: Optional[bool] = None,
        output_filename: Optional[str] = None, verbose: Optional[bool] = None,
        use_gloo: Optional[bool] = None, use_mpi: Optional[bool] = None,
        mpi_args: Optional[str] = None, network_interface: Optional[str] = None,
        executable: Optional[str] = None, np: Optional[int] = None,
        min_np: Optional[int] = None, max_np: Optional[int] = None) -> list:
    """Run ``func(*args, **kwargs)`` on ``num_proc`` workers and return their return values in
    rank order.  The other arguments are hvdrun's flags (``hosts="a:2,b:2"``, ``use_mpi=True``,
    ``min_num_proc``/``max_num_proc`` for an elastic job, ...); ``np``, ``min_np`` and
    ``max_np`` are the older names Horovod still accepts; ``executable`` is the workers' Python
    (default: this one).  ``func`` usually calls ``hvd.init()``; it travels to the workers by
    value (cloudpickle), its return value back.

    Raises RunError naming the rank when a worker raises (with its traceback), dies, or ends
    without a result, once the launcher has stopped the others; ValueError for bad arguments."""
    if np is not None and num_proc == 1:
        num_proc = np
    min_num_proc = min_np if min_num_proc is None else min_num_proc
    max_num_proc = max_np if max_num_proc is None else max_num_proc
    if use_gloo and use_mpi:
        raise ValueError("horovod_ext.run: use_gloo and use_mpi are exclusive")
    if hosts is not None and hostfile is not None:
        raise ValueError("horovod_ext.run: give hosts or hostfile, not both")
    argv = _argv(num_proc, min_num_proc, max_num_proc, slots, reset_limit, hosts, hostfile,
                 start_timeout, ssh_port, ssh_identity_file, disable_cache, output_filename,
                 verbose, use_gloo, use_mpi, mpi_args, network_interface)
    if cooldown_range is not None:
        argv += ["--blacklist-cooldown-range"] + [str(v) for v in cooldown_range]
    o = _parse(argv + [executable or sys.executable, "-m", "horovod_ext.launch.task"])
    remote = bool(hvdrun._remote_hosts(o, netinfo.ipv4_addresses())) or o.elastic
    bind, reach = driver.caller_addresses(remote)
    server = driver.Server(driver.dumps((func, tuple(args), dict(kwargs or {}))), bind)
    o.extra_env = {"HOROVOD_RUN_DRIVER": driver.describe(reach, server.port),
                   "HOROVOD_RUN_KEY": server.key_hex}
    failures: List[Failure] = []
    try:
        status = hvdrun.launch(o, failures)
    finally:
        server.close()
    return _outcome(server, status, failures, o)


def _outcome(server: driver.Server, status: int, failures: List[Failure], o) -> list:
    reported = {r for r, _, _ in server.errors} | set(server.results)
    dead = failures[0].rank if failures else None
    if dead is not None and dead not in reported:
        # it died without a word; the errors of the others are what they saw of its death
        others = sorted({r for r, _, _ in server.errors})
        seen = (f"; then rank(s) {', '.join(map(str, others))} failed: "
                f"{_first_line(server.errors[0])}" if others else "")
        raise RunError(f"horovod_ext.run: {failures[0].message}{seen}", dead)
    if server.errors:
        rank, exc, text = server.errors[0]
        others = sorted({r for r, _, _ in server.errors[1:]} - {rank})
        message = (f"horovod_ext.run: rank {rank} raised "
                   f"{type(exc).__name__ if exc is not None else 'an exception'}"
                   + (f": {exc}" if exc is not None else "")
                   + (f" (rank(s) {', '.join(map(str, others))} raised too)" if others else "")
                   + f"\n\nTraceback on rank {rank}:\n{text}")
        raise RunError(message, rank, text) from exc
    expected = range(o.np) if not o.elastic else sorted(server.results)
    missing = [r for r in expected if r not in server.results]
    if status != 0 or missing:
        why = "; ".join(f.message for f in failures) or \
            f"the launcher ended with exit status {status}"
        rank = failures[0].rank if failures else None
        raise RunError(f"horovod_ext.run: {why}"
                       + (f"; no result from rank(s) {', '.join(map(str, missing))}"
                          if missing else ""), rank if rank is not None else
                       (missing[0] if len(missing) == 1 else None))
    return [server.results[r] for r in expected]


def _first_line(error) -> str:
    _, exc, text = error
    if exc is not None:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "an exception"
