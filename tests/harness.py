"""Run a test body in N real processes talking over real Gloo or MPI on localhost.

``run_ranks(fn, np, backend)`` starts ``np`` processes (our HOROVOD_* variables for Gloo,
mpirun for MPI), runs the module-level function ``fn`` on each after hvd.init(), and returns the
list of per-rank return values.  Any rank failing, or the whole run outliving ``timeout``, raises
an AssertionError carrying every rank's traceback and output tail.

Gloo ranks are forked from a fork server that imported torch and horovod_ext once for the whole
session (a fresh interpreter spends 1-3 s of this machine's CPU on those imports and on
torch._dynamo, which the first optimizer step imports); each rank is still a new process with
exactly its environment, and nothing has been initialised in it.  MPI ranks are started by
mpirun as small stubs that have a child of the fork server fork the rank (tests/_mpi_rank.py).
HVD_TEST_FRESH_PROCESSES=1 starts every rank as its own interpreter instead.
"""
import functools
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

from horovod_ext.launch import mpi as mpi_launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ["gloo", "mpi"]


class RanksFailed(AssertionError):
    def __init__(self, message, errors: Dict[int, str], output: str, results: list):
        super().__init__(message)
        self.results = results
        self.errors = errors
        self.output = output


def free_port() -> int:
    from horovod_ext.launch.netinfo import free_port as below_ephemeral
    return below_ephemeral("127.0.0.1")


def mpirun_path() -> str:
    found = shutil.which("mpirun") or os.path.join(os.path.dirname(sys.executable), "mpirun")
    if not os.path.exists(found):
        raise RuntimeError("mpirun not found: install the test extras (pip install -e .[mpi,test])")
    return found


@functools.lru_cache(maxsize=None)
def _mpi_kind():
    """("openmpi", major) or ("mpich", major) of the mpirun the tests use, asked once."""
    return mpi_launch.detect(mpirun_path())


def mpirun_command(np: int, extra_env: Dict[str, str], argv: Sequence[str],
                   session_dir: str) -> List[str]:
    """Open MPI's mpirun for ``np`` local ranks, its session directory under ``session_dir``, a
    folder of the caller's: Open MPI names it after mpirun's pid, and one left by a killed
    mpirun stops a later mpirun with the same pid from starting."""
    cmd = [mpirun_path(), "--oversubscribe", "-np", str(np), "--bind-to", "none",
           "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo"]
    cmd += mpi_launch.session_flags(_mpi_kind(), session_dir, [])
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    for key in extra_env:
        cmd += ["-x", key]
    return cmd + list(argv)


# Imported by the fork server before it forks ranks.  Nothing here may start threads or MPI.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "horovod_ext.torch", "tests._worker"]
# What the fork server's imports need from the environment every rank gets (OpenMP reads its
# thread count once, when torch loads it).
PRELOAD_ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
_fork_context = None


def _forking():
    """The fork server's context, started on first use; None where ranks start fresh."""
    global _fork_context
    if os.environ.get("HVD_TEST_FRESH_PROCESSES") == "1":
        return None
    if _fork_context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        saved = {k: os.environ.get(k) for k in PRELOAD_ENV}
        os.environ.update(PRELOAD_ENV)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _fork_context = context
    return _fork_context


_mpi_rank_socket = None


def _mpi_rank_factory(forking) -> Optional[str]:
    """The socket of tests/_mpi_rank.py's rank factory, started on first use as a child of the
    fork server; None where ranks start fresh or the factory did not come up."""
    global _mpi_rank_socket
    if forking is None:
        return None
    if _mpi_rank_socket is None:
        from tests import _mpi_rank
        path = os.path.join(tempfile.mkdtemp(prefix="hvd_test_ranks_"), "factory")
        listening = forking.Event()
        forking.Process(target=_mpi_rank.serve, args=(path, listening), daemon=True).start()
        _mpi_rank_socket = path if listening.wait(60) else ""
    return _mpi_rank_socket or None


class _ForkedRank:
    """A forked rank behind the part of subprocess.Popen's interface the harness uses."""

    def __init__(self, process):
        self.process = process
        self.pid = process.pid

    def poll(self):
        return self.process.exitcode

    def wait(self):
        self.process.join()
        return self.process.exitcode

    @property
    def returncode(self):
        return self.process.exitcode


def _start_rank(argv, env, log, forking):
    """One Gloo rank: forked from the fork server, or a new interpreter running ``argv``."""
    if forking is None:
        return subprocess.Popen(argv, env=env, cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    from tests._worker import run_forked
    process = forking.Process(target=run_forked, args=(*argv[3:6], env, log.name))
    process.start()
    return _ForkedRank(process)


def _session_members(sid):
    """The processes of session ``sid``."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:
                members.append(int(entry))
    return members


def _kill(proc):
    """SIGKILL everything in a rank's or mpirun's session (each starts its own): mpirun puts
    every rank in a process group of its own, and a rank it started must not outlive it."""
    for pid in {proc.pid, *_session_members(proc.pid)}:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def run_ranks(fn, np: int, backend: str = "gloo", env: Optional[Dict[str, str]] = None,
              args: Sequence = (), timeout: float = 90,
              hostnames: Optional[Sequence[str]] = None, init: bool = True,
              expect_failure: bool = False, with_output: bool = False,
              settle_on: Sequence[int] = ()):
    """Per-rank return values of ``fn(*args)`` (with with_output, also the ranks' combined
    output); with expect_failure, the RanksFailed instead.  ``settle_on``: once these ranks
    have reported, the others are stopped (a test that freezes a rank on purpose need not wait
    for the timeout)."""
    result_dir = tempfile.mkdtemp(prefix="hvd_test_")
    with open(os.path.join(result_dir, "args.pkl"), "wb") as f:
        pickle.dump((tuple(args), init), f)
    extra = {"HOROVOD_COMM_TIMEOUT_SECONDS": "20", "PYTHONPATH": REPO,
             "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if hostnames:
        extra["HVD_TEST_HOSTNAMES"] = ",".join(hostnames)
    extra.update(env or {})
    base_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("HOROVOD_", "OMPI_", "PMI", "PMIX"))
                and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    argv = [sys.executable, "-m", "tests._worker", fn.__module__, fn.__name__, result_dir]
    logs = []
    procs = []
    if backend == "mpi":
        factory = _mpi_rank_factory(_forking())
        if factory:
            argv = [sys.executable, "-m", "tests._mpi_rank", factory] + argv[3:]
        env_all = dict(base_env, **extra)
        env_all.setdefault("HOROVOD_CPU_OPERATIONS", "mpi")
        env_all["OMPI_MCA_rmaps_base_oversubscribe"] = "1"
        log = open(os.path.join(result_dir, "mpirun.log"), "w+")
        logs.append(log)
        session = os.path.join(result_dir, "mpi")
        procs.append(subprocess.Popen(mpirun_command(np, extra, argv, session), env=env_all,
                                      cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    elif backend == "gloo":
        forking = _forking()
        port = free_port()
        for rank in range(np):
            env_r = dict(base_env, **extra)
            env_r.update(HOROVOD_RANK=str(rank), HOROVOD_SIZE=str(np),
                         HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1",
                         HOROVOD_GLOO_RENDEZVOUS_PORT=str(port))
            env_r.setdefault("HOROVOD_CPU_OPERATIONS", "gloo")
            log = open(os.path.join(result_dir, f"rank{rank}.log"), "w+")
            logs.append(log)
            procs.append(_start_rank(argv, env_r, log, forking))
    else:
        raise ValueError(backend)

    def reported(rank):
        return any(os.path.exists(os.path.join(result_dir, f"{rank}.{ext}"))
                   for ext in ("pkl", "err"))

    deadline = time.monotonic() + timeout
    timed_out = False
    while any(p.poll() is None for p in procs):
        if settle_on and all(reported(r) for r in settle_on):
            break
        if time.monotonic() > deadline:
            timed_out = True
            break
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            _kill(p)
    output = ""
    for log in logs:
        log.seek(0)
        text = log.read()   # its start (what a run says first) and its end (how it ended)
        output += text if len(text) <= 8000 else text[:4000] + "\n[...]\n" + text[-4000:]
        log.close()
    results, errors = [], {}
    for rank in range(np):
        path = os.path.join(result_dir, f"{rank}.pkl")
        err = os.path.join(result_dir, f"{rank}.err")
        if os.path.exists(err):
            errors[rank] = open(err).read()
        elif os.path.exists(path):
            with open(path, "rb") as f:
                results.append(pickle.load(f))
            continue
        else:
            errors[rank] = "no result (process killed or exited early)"
        results.append(None)
    shutil.rmtree(result_dir, ignore_errors=True)
    failed = timed_out or errors or any(p.returncode != 0 for p in procs)
    if failed:
        message = (f"{fn.__name__} on {np} {backend} ranks "
                   f"{'timed out after %.0f s' % timeout if timed_out else 'failed'}:\n"
                   + "\n".join(f"--- rank {r}:\n{e}" for r, e in sorted(errors.items()))
                   + f"\n--- output tail:\n{output[-3000:]}")
        failure = RanksFailed(message, errors, output, results)
        if expect_failure:
            return failure
        raise failure
    if expect_failure:
        raise AssertionError(f"{fn.__name__} on {np} {backend} ranks was expected to fail but "
                             f"every rank succeeded")
    return (results, output) if with_output else results
