"""Entry point of one test rank: ``python -m tests._worker MODULE FUNCTION RESULT_DIR``, or
``run_forked`` in a child of the harness's fork server, or forked for an MPI rank by
tests/_mpi_rank.py (see tests/harness.py).

Runs ``MODULE.FUNCTION(*args)`` between hvd.init() and hvd.shutdown() and leaves the pickled
return value (or the traceback) in RESULT_DIR for the harness to read.
"""
import atexit
import importlib
import os
import pickle
import sys
import traceback


def main(module_name, func_name, result_dir):
    from horovod_ext.backends.bootstrap import detect_launch
    rank = detect_launch().rank
    hostnames = os.environ.get("HVD_TEST_HOSTNAMES")
    if hostnames:
        os.environ["HOROVOD_HOSTNAME"] = hostnames.split(",")[rank]
    with open(os.path.join(result_dir, "args.pkl"), "rb") as f:
        args, init = pickle.load(f)
    try:
        func = getattr(importlib.import_module(module_name), func_name)
        if init:
            import horovod_ext.torch as hvd
            hvd.init()
        result = func(*args)
        if init:
            hvd.shutdown()
        path = os.path.join(result_dir, f"{rank}.pkl")
        with open(path + ".part", "wb") as f:
            pickle.dump(result, f)
        os.replace(path + ".part", path)  # whole or absent: the harness may read it at once
    except BaseException:
        path = os.path.join(result_dir, f"{rank}.err")
        with open(path + ".part", "w") as f:
            f.write(traceback.format_exc())
        os.replace(path + ".part", path)
        sys.stderr.write(f"[rank {rank}] " + traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)


def become_rank(env, out_fd, err_fd):
    """Set this forked child up as ``python -m tests._worker`` would be: exactly ``env``,
    output to the given descriptors, line-buffered."""
    os.environ.clear()          # in place: functions hold os.environ as a default argument
    os.environ.update(env)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    for fd in {out_fd, err_fd} - {1, 2}:
        os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)


def run_forked(module_name, func_name, result_dir, env, log_path):
    """``main`` in a fresh child of the fork server, in its own session (the harness kills the
    group), output to ``log_path``, and the exit functions run at the end as at a normal exit."""
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    become_rank(env, fd, fd)
    try:
        main(module_name, func_name, result_dir)
    finally:
        atexit._run_exitfuncs()


if __name__ == "__main__":
    main(*sys.argv[1:4])
