"""Start-up as users do it: torchrun, mpirun with MPI data, mpirun with Gloo data."""
import os
import subprocess
import sys

import pytest

from tests.harness import REPO, mpirun_command

EXAMPLE = os.path.join(REPO, "examples", "hello_allreduce.py")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "OMPI_", "PMI"))}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", **extra)
    return env


def _check(out, transport, np):
    for rank in range(np):
        line = f"rank {rank}/{np} (local {rank}/{np}, {transport}): sum={np * (np - 1) // 2} "
        assert line in out, out


@pytest.mark.timeout(120)
def test_torchrun_starts_gloo_ranks():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", EXAMPLE], env=_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    _check(out.stdout, "Gloo", 2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["MPI", "Gloo"])
def test_mpirun_starts_ranks(transport, tmp_path):
    extra = {"HOROVOD_CPU_OPERATIONS": transport.lower()}
    cmd = mpirun_command(3, dict(extra, PYTHONPATH="", OMP_NUM_THREADS=""),
                         [sys.executable, EXAMPLE], str(tmp_path))
    out = subprocess.run(cmd, env=_env(**extra), cwd=REPO, capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    _check(out.stdout, transport, 3)
