"""MPI test ranks forked from a warm process instead of started as new interpreters.

mpirun must start every rank itself (each gets its PMIx identity in its environment), and a
new interpreter spends 2-4 s of this machine's CPU importing torch and horovod_ext before it
runs a line of the test.  So mpirun starts this module as a stub, ``python -m tests._mpi_rank
SOCKET MODULE FUNCTION RESULT_DIR``, which imports only the standard library: it hands its
environment, working directory and output to the rank factory listening on SOCKET and waits.
The factory (``serve``, a child of the harness's fork server, so torch is already imported)
forks a child that takes exactly that environment, which makes it the MPI rank mpirun started,
and runs ``tests._worker.main``; with ``--script PATH ARGS...`` the stub stands for a program
instead (hvdrun's workers in the elastic tests).  The stub exits with the child's exit code (or
dies of the child's signal), so mpirun sees the rank end as it ended; when the stub dies (mpirun
aborting, the harness killing the job), the factory kills the child.  A stub that cannot reach
the factory runs the rank itself.
"""
import ctypes
import os
import pickle
import select
import signal
import socket
import struct
import sys

_HEADER = struct.Struct("!I")
_EXIT = struct.Struct("!i")


def _read_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the stub closed its connection")
        data += chunk
    return data


def stub_main(socket_path, *what):
    """What mpirun (or hvdrun) runs as the rank: ask the factory for the rank, end as it ends.
    ``what``: MODULE FUNCTION RESULT_DIR (a test body, as ``tests._worker`` runs it), or
    ``--script PATH ARGS...`` (a program, as ``python PATH ARGS...`` runs it)."""
    if what[0] == "--script":
        job, fallback = ("script", what[1:]), list(what[1:])
    else:
        job, fallback = ("body", what[:3]), ["-m", "tests._worker", *what[:3]]
    request = pickle.dumps((job, dict(os.environ), os.getcwd()))
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(socket_path)
        socket.send_fds(sock, [_HEADER.pack(len(request))], [1, 2])
        sock.sendall(request)
    except OSError:
        os.execv(sys.executable, [sys.executable, *fallback])
    reply = b""
    while len(reply) < _EXIT.size:
        chunk = sock.recv(_EXIT.size - len(reply))
        if not chunk:
            sys.exit(1)   # the factory went away without reporting: the rank did not finish
        reply += chunk
    code = _EXIT.unpack(reply)[0]
    if code < 0:   # killed by a signal: so is the stub, for whoever waits on it
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code if code >= 0 else 128 - code)


def _run_rank(conn_fds, request, out_fds):
    """In the forked child: become the rank the stub stands for, run it, never return."""
    code = 1
    try:
        for fd in conn_fds:
            os.close(fd)
        # PR_SET_PDEATHSIG: a rank outlives neither the factory nor, through it, its stub
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        (kind, args), env, cwd = pickle.loads(request)
        os.chdir(cwd)
        from tests._worker import become_rank, main
        become_rank(env, out_fds[0], out_fds[1])
        if kind == "script":
            code = _run_script(args)
        else:
            main(*args)
            code = 0
    finally:
        import atexit
        atexit._run_exitfuncs()
        # mpi4py finalizes MPI from the interpreter's own exit, which os._exit skips; mpirun
        # counts a rank that ends without finalizing as failed.
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
        os._exit(code)


def _run_script(argv):
    """Run ``python argv[0] argv[1:]``'s program in this process; its exit code."""
    import runpy
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:   # noqa: BLE001  (reported as the interpreter would)
        import traceback
        traceback.print_exc()
        return 1
    return 0


def _accept(listener, children):
    conn, _ = listener.accept()
    conn.settimeout(10)
    msg, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 2)
    request = _read_exact(conn, _HEADER.unpack(msg)[0])
    conn.settimeout(None)
    pid = os.fork()
    if pid == 0:
        _run_rank([listener.fileno(), conn.fileno(), *[c.fileno() for c in children]],
                  request, fds)
    for fd in fds:
        os.close(fd)
    children[conn] = pid


def _reap(children):
    """Tell each finished child's stub how it ended."""
    by_pid = {pid: conn for conn, pid in children.items()}
    while by_pid:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = by_pid.pop(pid, None)
        if conn is None:
            continue
        try:
            conn.sendall(_EXIT.pack(os.waitstatus_to_exitcode(status)))
        except OSError:
            pass
        conn.close()
        del children[conn]


def serve(socket_path, listening):
    """The factory: fork a rank for every stub that connects, until its parent is gone.
    ``listening`` (an Event) is set once stubs can connect."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    listening.set()
    children = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([listener, *children], [], [], 0.05)
        for sock in ready:
            if sock is listener:
                try:
                    _accept(listener, children)
                except (OSError, ValueError, struct.error):
                    pass
            elif not sock.recv(1):
                # Its stub is gone (mpirun aborted or the harness killed the job): so is the rank.
                try:
                    os.kill(children[sock], signal.SIGKILL)
                except ProcessLookupError:
                    pass
        _reap(children)


if __name__ == "__main__":
    stub_main(*sys.argv[1:])
