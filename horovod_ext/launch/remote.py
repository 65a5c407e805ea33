"""Other hosts: the ssh command line, the check that every host answers, and remote ranks.

The remote shell is ``ssh`` or any stand-in called as ``CMD [OPTIONS] HOST COMMAND`` (the
network lab's ``nsrsh``, the tests' local shim).  COMMAND is one ``sh -c`` string so that the
remote login shell does not matter.  A remote rank runs under ``agent.py`` (shipped as source),
which takes signals from hvdrun over the ssh connection's stdin.
"""
import inspect
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from typing import Dict, List, Sequence, Tuple

from . import agent, netinfo

# Not forwarded to other hosts: they describe this login or this machine, or are secrets that
# would show up in the remote process list.
_LOCAL_ONLY = {"HOME", "HOSTNAME", "LOGNAME", "MAIL", "OLDPWD", "PWD", "SHELL", "SHLVL", "TERM",
               "TMPDIR", "USER", "_"}
_LOCAL_PREFIXES = ("BASH_FUNC_", "SSH_", "XDG_", "DISPLAY")
_SECRET = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL", re.I)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def ssh_prefix(o) -> List[str]:
    cmd = list(o.ssh)
    if o.ssh_command is None:  # the real ssh: fail instead of prompting for a password or key
        cmd += ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no"]
    if o.ssh_port:
        cmd += ["-p", str(o.ssh_port)]
    if o.ssh_identity_file:
        cmd += ["-i", o.ssh_identity_file]
    return cmd


def forwarded_env(env: Dict[str, str]) -> Dict[str, str]:
    """The part of the launcher's environment a remote rank gets (as horovodrun does)."""
    return {k: v for k, v in env.items()
            if _NAME.match(k) and k not in _LOCAL_ONLY and not k.startswith(_LOCAL_PREFIXES)
            and not _SECRET.search(k)}


def python_script(module, args: Sequence[str], env: Dict[str, str] = None,
                  cwd: str = None) -> str:
    """A ``sh -c`` string that runs ``module``'s source with the first Python it finds (this
    interpreter's path, then python3, python)."""
    lines = []
    if cwd:
        lines.append(f"cd {shlex.quote(cwd)} >/dev/null 2>&1")
    for key, value in (env or {}).items():
        lines.append(f"export {key}={shlex.quote(value)}")
    pythons = " ".join(shlex.quote(p) for p in (sys.executable, "python3", "python"))
    # -I: the module needs the standard library only, whatever PYTHONPATH was passed on
    run = " ".join(shlex.quote(a) for a in ["-I", "-c", inspect.getsource(module)] + list(args))
    lines.append(f'for p in {pythons}; do command -v "$p" >/dev/null 2>&1 && exec "$p" {run}; '
                 f'done')
    lines.append('echo "hvdrun: no python on $(hostname)" >&2; exit 127')
    return "sh -c " + shlex.quote("\n".join(lines))


def rank_command(prefix: List[str], host: str, command: Sequence[str], env: Dict[str, str],
                 cwd: str) -> List[str]:
    return prefix + [host, python_script(agent, command, env, cwd)]


class Unreachable(RuntimeError):
    pass


def check_hosts(prefix: List[str], hosts: Sequence[str], interfaces,
                timeout: float) -> Dict[str, Tuple[int, List[Tuple[str, str]]]]:
    """Runs netinfo.py on every host in parallel: {host: (a free port, [(interface, address)])}.
    Raises Unreachable naming every host that did not answer within ``timeout``."""
    script = python_script(netinfo, [",".join(interfaces)])
    procs = {host: subprocess.Popen(prefix + [host, script], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
             for host in hosts}
    deadline = time.monotonic() + timeout
    failures, found = [], {}
    for host, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            failures.append(f"{host}: no answer within {timeout:g} s (--start-timeout)")
            continue
        fields = out.decode(errors="replace").split()
        if proc.returncode != 0:
            detail = err.decode(errors="replace").strip().splitlines()
            failures.append(f"{host}: {prefix[0]} exited with {proc.returncode}"
                            + (f": {detail[-1]}" if detail else ""))
        elif not fields or not fields[0].isdigit():
            failures.append(f"{host}: unexpected answer {out.decode(errors='replace')[-200:]!r}")
        else:
            found[host] = (int(fields[0]), [tuple(f.split("=", 1)) for f in fields[1:]])
    if failures:
        raise Unreachable("cannot reach " + "; ".join(failures))
    return found
