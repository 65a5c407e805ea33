"""A real single-node Slurm (Debian's slurmctld, slurmd and munge, started here as root on
localhost with a configuration of their own in a temporary folder): ``srun -n 2`` runs the
example, each task finding its rank and the rendezvous from Slurm's variables alone.

It needs the daemons installed (``.ci/run`` installs them with apt when it runs as root) and
root; elsewhere it is skipped, saying which is missing.  Where both are there, daemons that do
not come up are a failure, with their logs."""
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.harness import REPO


EXAMPLE = os.path.join(REPO, "examples", "hello_allreduce.py")
DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sinfo")
START_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _missing():
    missing = [d for d in DAEMONS
               if not shutil.which(d) and not os.path.exists(f"/usr/sbin/{d}")]
    if missing:
        return (f"Slurm is not installed here ({', '.join(missing)} missing; "
                "apt-get install slurmd slurmctld slurm-client munge)")
    if os.geteuid() != 0:
        return "starting slurmctld/slurmd/munged needs root"
    return None


def _binary(name):
    return shutil.which(name) or f"/usr/sbin/{name}"


def _write_config(folder, host):
    for sub in ("state", "spool", "munge"):
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
    munge_socket = os.path.join(folder, "munge", "munge.socket")
    conf = f"""\
ClusterName=hvdtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
    path = os.path.join(folder, "slurm.conf")
    with open(path, "w") as f:
        f.write(conf)
    return path, munge_socket


pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]


@pytest.fixture
def slurm(tmp_path):
    folder = str(tmp_path)
    host = socket.gethostname().split(".")[0]
    conf, munge_socket = _write_config(folder, host)
    key = os.path.join(folder, "munge", "munge.key")
    with open(key, "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(key, 0o400)
    env = dict(os.environ, SLURM_CONF=conf)
    procs = []
    try:
        procs.append(subprocess.Popen(
            [_binary("munged"), "--foreground", "--force", f"--socket={munge_socket}",
             f"--key-file={key}", f"--pid-file={folder}/munge/munged.pid",
             f"--log-file={folder}/munge/munged.log", f"--seed-file={folder}/munge/seed"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        procs.append(subprocess.Popen([_binary("slurmctld"), "-D", "-i", "-f", conf], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        procs.append(subprocess.Popen([_binary("slurmd"), "-D", "-f", conf, "-N", host],
                                      env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT))
        deadline = time.monotonic() + START_S
        state = ""
        while time.monotonic() < deadline:
            dead = [p.args[0] for p in procs if p.poll() is not None]
            if dead:
                break
            out = subprocess.run([_binary("sinfo"), "-h", "-N", "-o", "%T"], env=env,
                                 capture_output=True, text=True, timeout=10)
            state = out.stdout.strip()
            if state == "idle":
                break
            time.sleep(0.5)  # polling the daemons' state, not synchronising with them
        if state != "idle":
            logs = ""
            for name in ("slurmctld.log", "slurmd.log", "munge/munged.log"):
                try:
                    with open(os.path.join(folder, name)) as f:
                        logs += f"\n--- {name}\n" + f.read()[-1500:]
                except OSError:
                    pass
            pytest.fail(f"the local Slurm did not come up within {START_S:g} s (node state "
                        f"{state!r}); its logs:{logs}")
        yield env
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_srun_runs_the_example(slurm):
    env = {k: v for k, v in slurm.items()
           if not k.startswith(("HOROVOD_", "OMPI_", "PMI", "MASTER_"))
           and k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    out = subprocess.run([_binary("srun"), "-N1", "-n2", "--mpi=none", "--time=2",
                          sys.executable, EXAMPLE], env=env, capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for rank in range(2):
        assert f"rank {rank}/2 (local {rank}/2, Gloo): sum=1 " in out.stdout, out.stdout
