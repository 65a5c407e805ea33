"""Start-up under cluster managers, with exactly the environment each one gives its processes:
a Slurm job step (``srun`` without MPI), a Kubeflow MPIJob's launcher (mpirun with the operator's
variables and hostfile), and Kubeflow Trainer's torchrun (two "pods" on localhost); plus the
parsing of Slurm's variables and hostlist expressions."""
import os
import random
import socket
import subprocess
import sys

import pytest

from horovod_ext.backends import bootstrap
from tests.harness import REPO, free_port, mpirun_path

pytestmark = pytest.mark.timeout(120)

EXAMPLE = os.path.join(REPO, "examples", "hello_allreduce.py")


@pytest.mark.parametrize("expression, hosts", [
    ("node07", ["node07"]),
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("gpu[8-11],cpu1", ["gpu8", "gpu9", "gpu10", "gpu11", "cpu1"]),
    ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
    ("a-1,b.example.com", ["a-1", "b.example.com"]),
])
def test_hostlist_expressions(expression, hosts):
    assert bootstrap.expand_hostlist(expression) == hosts


@pytest.mark.parametrize("expression", ["node[01-", "node[a-b]", "node[05-01]", "node[1]x]"])
def test_bad_hostlist_expressions_name_the_problem(expression):
    with pytest.raises(ValueError, match="Slurm hostlist"):
        bootstrap.expand_hostlist(expression)


STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1",
        "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "node[03-04]",
        "SLURM_JOB_NODELIST": "node[01-04]"}


def test_slurm_variables():
    launch = bootstrap.detect_launch(STEP)
    assert (launch.kind, launch.rank, launch.size) == ("slurm", 1, 4)  # the step's size
    assert bootstrap.slurm_rendezvous(STEP) == ("node03", 20000 + 4242 % 10000)
    assert bootstrap.slurm_rendezvous(dict(STEP, MASTER_PORT="29400")) == ("node03", 29400)
    assert bootstrap.slurm_rendezvous(dict(STEP, MASTER_ADDR="10.0.0.9"))[0] == "10.0.0.9"
    no_step_list = {k: v for k, v in STEP.items() if k != "SLURM_STEP_NODELIST"}
    assert bootstrap.slurm_rendezvous(no_step_list)[0] == "node01"
    with pytest.raises(RuntimeError, match="SLURM_JOB_ID"):
        bootstrap.slurm_rendezvous({k: v for k, v in STEP.items() if k != "SLURM_JOB_ID"})
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        bootstrap.slurm_rendezvous({k: v for k, v in STEP.items() if "NODELIST" not in k})
    with pytest.raises(ValueError, match="SLURM_PROCID='x' is not an integer"):
        bootstrap.detect_launch(dict(STEP, SLURM_PROCID="x"))


def test_what_wins_inside_a_slurm_job():
    batch_script = {k: v for k, v in STEP.items() if not k.startswith("SLURM_STEP")}
    assert bootstrap.detect_launch(batch_script).kind == "single"  # one process, not a step
    pmix = dict(STEP, PMIX_RANK="3")                                # srun --mpi=pmix
    assert bootstrap.detect_launch(pmix) == bootstrap.Launch("mpirun", 3, 4)
    pmi2 = dict(STEP, PMI_RANK="2", PMI_SIZE="4")                   # srun --mpi=pmi2
    assert bootstrap.detect_launch(pmi2) == bootstrap.Launch("mpirun", 2, 4)
    hvdrun_rank = dict(STEP, HOROVOD_RANK="5", HOROVOD_SIZE="6")    # hvdrun inside a step
    assert bootstrap.detect_launch(hvdrun_rank) == bootstrap.Launch("horovod", 5, 6)
    torchrun_rank = dict(STEP, RANK="0", WORLD_SIZE="2")             # srun ... torchrun
    assert bootstrap.detect_launch(torchrun_rank) == bootstrap.Launch("torchrun", 0, 2)


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD_", "OMPI_", "PMI", "SLURM_", "PET_", "MASTER_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", **extra)
    return env


def _check(outputs, np, transport="Gloo"):
    text = "".join(outputs)
    for rank in range(np):
        assert f"rank {rank}/{np} (local {rank}/{np}, {transport}): sum={np * (np - 1) // 2} " \
            in text, text


def _run_all(commands, timeout=100):
    procs = [subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for argv, env in commands]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outputs.append(out)
            assert proc.returncode == 0, out[-3000:]
    finally:
        for proc in procs:
            proc.kill()
    return outputs


def _job_id_with_free_port() -> int:
    """A Slurm job id whose derived rendezvous port can be bound here now."""
    for job in random.Random().sample(range(100000, 200000), 50):
        _, port = bootstrap.slurm_rendezvous({"SLURM_JOB_ID": str(job),
                                              "SLURM_STEP_NODELIST": "localhost"})
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return job
    raise AssertionError("no free port in the Slurm range")


def test_srun_step_environment_runs_the_example():
    """What slurmd gives each task of ``srun -N1 -n2 python hello_allreduce.py``."""
    job = str(_job_id_with_free_port())
    commands = []
    for task in range(2):
        env = _clean_env(SLURM_JOB_ID=job, SLURM_JOBID=job, SLURM_STEP_ID="0",
                         SLURM_PROCID=str(task), SLURM_LOCALID=str(task), SLURM_NODEID="0",
                         SLURM_STEP_NUM_TASKS="2", SLURM_NTASKS="2", SLURM_NPROCS="2",
                         SLURM_STEP_NUM_NODES="1", SLURM_NNODES="1",
                         SLURM_STEP_NODELIST="localhost", SLURM_JOB_NODELIST="localhost",
                         SLURM_NODELIST="localhost", SLURM_TASKS_PER_NODE="2")
        commands.append(([sys.executable, EXAMPLE], env))
    _check(_run_all(commands), 2)


def test_kubeflow_mpijob_launcher_environment(tmp_path):
    """The launcher pod of a Kubeflow MPIJob (Open MPI): the operator's variables, its hostfile
    at OMPI_MCA_orte_default_hostfile, and the command of docs/launching.md's manifest."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    env = _clean_env(OMPI_MCA_orte_default_hostfile=str(hostfile),
                     OMPI_MCA_plm_rsh_args="-o ConnectionAttempts=10",
                     OMPI_MCA_orte_keep_fqdn_hostnames="true",
                     OMPI_MCA_orte_set_default_slots="2", K_MPI_JOB_ROLE="launcher",
                     OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    argv = [mpirun_path(), "--hostfile", str(hostfile), "-np", "2", "--bind-to", "none",
            "--mca", "btl_tcp_if_include", "lo", sys.executable, EXAMPLE]
    _check(_run_all([(argv, env)]), 2, "MPI")


def test_kubeflow_trainer_torchrun_as_two_pods():
    """Kubeflow Trainer's TrainJob runs ``torchrun train.py`` in every pod with PET_NNODES,
    PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and PET_MASTER_PORT set (torchrun reads
    them as its flags); two such pods, here two processes on localhost."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    port = str(free_port())
    commands = [([torchrun, EXAMPLE],
                 _clean_env(PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_NODE_RANK=str(pod),
                            PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=port))
                for pod in range(2)]
    # both "pods" have this machine's host name, so they are one node here
    _check(_run_all(commands), 2)


def test_kubeflow_pytorchjob_environment():
    """A PyTorchJob without nprocPerNode: the operator sets RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT in the master and worker pods and runs the command as it is."""
    port = str(free_port())
    commands = [([sys.executable, EXAMPLE],
                 _clean_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=port, PYTHONUNBUFFERED="1"))
                for rank in range(2)]
    _check(_run_all(commands), 2)
