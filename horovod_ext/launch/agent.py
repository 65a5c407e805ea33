"""Runs one rank and obeys hvdrun over stdin: ``python agent.py COMMAND...``.

hvdrun starts every Gloo-mode rank under this agent, on other hosts as source through ssh
(``python -c SOURCE COMMAND...``), so it uses the standard library only.  The rank runs in its
own session with SIGINT and SIGQUIT at their default actions (a shell started without a terminal
would leave them ignored).  Each line hvdrun writes to stdin names a signal (``INT``, ``TERM``,
``KILL``) for the rank's process group; end of input (hvdrun gone, even killed with SIGKILL; ssh
connection lost) terminates the rank, and kills it a few seconds later.  The exit status is the
rank's (128 + N when signal N ended it).
"""
import os
import signal
import subprocess
import sys
import threading

KILL_AFTER_S = 3.0


def _signal_group(pid, signum):
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _default_signals():
    for signum in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)


def main(command):
    try:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True,
                                 preexec_fn=_default_signals)
    except OSError as exc:
        sys.stderr.write(f"hvdrun: cannot start {command[0]!r}: {exc.strerror}\n")
        sys.exit(127)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda s, _f: _signal_group(child.pid, s))

    def obey():
        for line in sys.stdin:
            name = line.strip().upper()
            if name in ("INT", "TERM", "KILL", "QUIT"):
                _signal_group(child.pid, getattr(signal, "SIG" + name))
        _signal_group(child.pid, signal.SIGTERM)
        try:
            child.wait(KILL_AFTER_S)
        except subprocess.TimeoutExpired:
            _signal_group(child.pid, signal.SIGKILL)

    threading.Thread(target=obey, daemon=True).start()
    code = child.wait()
    os._exit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main(sys.argv[1:])
