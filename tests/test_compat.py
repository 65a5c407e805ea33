"""compat/ (the horovod-ext-compat distribution): installed with pip, Horovod's module names are
horovod_ext's modules, ``horovodrun`` is hvdrun, a Horovod-style script and a library that
reaches Horovod through its names (pytorch-ignite's horovod backend) run without an edit, and
it refuses to install or import beside the real Horovod."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests.harness import REPO

pytestmark = pytest.mark.timeout(180)

COMPAT = os.path.join(REPO, "compat")


def _pip(*args, python=sys.executable, **kw):
    return subprocess.run([python, "-m", "pip", *args], capture_output=True, text=True,
                          timeout=150, **kw)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """compat built into a wheel by pip, with this environment's setuptools."""
    folder = str(tmp_path_factory.mktemp("wheel"))
    out = _pip("wheel", "--no-deps", "--no-build-isolation", "-w", folder, COMPAT)
    assert out.returncode == 0, out.stdout + out.stderr
    (name,) = os.listdir(folder)
    return os.path.join(folder, name)


@pytest.fixture(scope="module")
def installed(tmp_path_factory, wheel):
    """compat installed by pip into a folder of its own (that folder goes on PYTHONPATH)."""
    target = str(tmp_path_factory.mktemp("compat"))
    out = _pip("install", "--no-deps", "--target", target, wheel)
    assert out.returncode == 0, out.stdout + out.stderr
    return target


@pytest.fixture(scope="module")
def venv_template(tmp_path_factory):
    """A new, untouched virtual environment (with its pip), made once: each test that needs a
    fresh one gets a copy of it (``fresh_venv``), which is much faster than ``python -m venv``."""
    venv = tmp_path_factory.mktemp("venv_template") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    return venv


def fresh_venv(template, tmp_path):
    """A copy of ``template`` of this test's own (its python is a link to this Python, as in
    any venv; pip is used as ``python -m pip``, so no script's first line names the template)."""
    venv = tmp_path / "venv"
    shutil.copytree(template, venv, symlinks=True)
    return venv


def _env(target, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "OMPI_", "PMI"))}
    env.update(PYTHONPATH=os.pathsep.join([target, REPO]), OMP_NUM_THREADS="1", **extra)
    return env


def _python(target, code, **kw):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=_env(target),
                          capture_output=True, text=True, timeout=120, **kw)


def test_horovod_names_are_aliases(installed):
    out = _python(installed, """
        import horovod, horovod_ext, horovod_ext.torch
        import horovod.torch as hvd
        import horovod.torch.elastic, horovod.torch.mpi_ops, horovod.torch.compression
        import horovod.torch.optimizer
        from horovod.torch.mpi_ops import synchronize, Sum, Average, Adasum
        from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt
        from horovod.runner.util.threads import in_thread
        import horovod.ray
        assert hvd is horovod_ext.torch and hvd.allreduce is horovod_ext.torch.allreduce
        assert horovod.torch.elastic is horovod_ext.torch.elastic
        assert horovod.torch.mpi_ops is horovod_ext.torch.mpi_ops
        assert horovod.torch.compression.Compression is horovod_ext.torch.Compression
        assert synchronize is horovod_ext.torch.synchronize and Adasum is horovod_ext.torch.Adasum
        assert HorovodInternalError is horovod_ext.torch.HorovodInternalError
        assert HostsUpdatedInterrupt is horovod_ext.torch.HostsUpdatedInterrupt
        assert horovod.ray.RayExecutor is __import__("horovod_ext.ray").ray.RayExecutor
        assert horovod.run is horovod_ext.run
        from horovod.runner import run
        assert run is horovod_ext.run
        box = []
        in_thread(box.append, args=(1,)).join()
        assert box == [1]
        try:
            import horovod.torch.nothing
        except ModuleNotFoundError as exc:
            assert "horovod.torch.nothing" in str(exc)
        else:
            raise AssertionError("a module that does not exist was imported")
        print("VERSION", horovod.__version__)
    """)
    assert out.returncode == 0, out.stdout + out.stderr
    import horovod_ext
    assert f"VERSION 0.28.1+horovod.ext.{horovod_ext.__version__}" in out.stdout


def test_horovodrun_and_check_build_say_what_runs(installed):
    horovodrun = os.path.join(installed, "bin", "horovodrun")
    out = subprocess.run([horovodrun, "--version"], env=_env(installed), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "horovod_ext" in out.stdout and "not Horovod itself" in out.stdout, out.stdout
    out = subprocess.run([sys.executable, "-m", "horovod_ext.launch.run", "--check-build"],
                         env=_env(installed), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "import horovod: horovod_ext under Horovod's names (horovod-ext-compat 0.28.1+" \
        in out.stdout, out.stdout


SCRIPT = '''
import torch
import horovod
import horovod.torch as hvd


def train():
    hvd.init()
    model = torch.nn.Linear(4, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    torch.manual_seed(hvd.rank())
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
    return hvd.rank(), hvd.size(), round(model.weight.sum().item(), 6)


if __name__ == "__main__":
    import sys
    if sys.argv[1:] == ["run"]:          # horovod.run from a plain script
        print("RUN", horovod.run(train, num_proc=2))
    else:                                # under horovodrun
        print("RANK", train())
'''


def test_horovod_script_unchanged_under_horovodrun_and_horovod_run(installed, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    horovodrun = os.path.join(installed, "bin", "horovodrun")
    out = subprocess.run([horovodrun, "-np", "2", sys.executable, str(script)],
                         env=_env(installed), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    ranks = sorted(line.split("RANK ")[1] for line in out.stdout.splitlines() if "RANK " in line)
    assert len(ranks) == 2 and ranks[0].startswith("(0, 2, ") and ranks[1].startswith("(1, 2, ")
    assert ranks[0].split(", ")[2] == ranks[1].split(", ")[2]  # one model on both ranks
    out = subprocess.run([sys.executable, str(script), "run"], env=_env(installed),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    line = [l for l in out.stdout.splitlines() if l.startswith("RUN ")]
    results = eval(line[0][4:])  # noqa: S307 (our own printed list)
    assert [(r, s) for r, s, _ in results] == [(0, 2), (1, 2)] and results[0][2] == results[1][2]


IGNITE = '''
import ignite.distributed as idist


def training(local_rank, config):
    import torch
    total = idist.all_reduce(torch.tensor([float(idist.get_rank() + 1)]))
    gathered = idist.all_gather(torch.tensor([idist.get_rank()]))
    print("IGNITE", idist.get_rank(), idist.get_world_size(), idist.backend(), total.item(),
          gathered.tolist(), flush=True)


if __name__ == "__main__":
    with idist.Parallel(backend="horovod", nproc_per_node=2) as parallel:
        parallel.run(training, {})
'''


def test_pytorch_ignite_horovod_backend(installed, tmp_path):
    pytest.importorskip("ignite", reason="pytorch-ignite is in the test extra")
    script = tmp_path / "ignite_job.py"
    script.write_text(IGNITE)
    out = subprocess.run([sys.executable, str(script)], env=_env(installed), cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in range(2):
        assert f"IGNITE {rank} 2 horovod 3.0 [0, 1]" in out.stdout, out.stdout


def _fake_real_horovod(site):
    meta = os.path.join(site, "horovod-0.28.1.dist-info")
    os.makedirs(meta)
    with open(os.path.join(meta, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: horovod\nVersion: 0.28.1\n")


def test_refuses_to_install_beside_the_real_horovod(tmp_path, venv_template):
    venv = fresh_venv(venv_template, tmp_path)
    python = str(venv / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()
    _fake_real_horovod(site)   # what `pip install horovod` leaves: its metadata
    out = _pip("install", "--no-deps", "--no-build-isolation", COMPAT, python=python)
    assert out.returncode != 0
    assert "the real Horovod is installed here (horovod-0.28.1.dist-info)" in out.stdout + \
        out.stderr, out.stdout + out.stderr
    assert not os.path.exists(os.path.join(site, "horovod"))


def test_refuses_to_import_beside_the_real_horovod(installed, tmp_path):
    other = str(tmp_path / "site")
    _fake_real_horovod(other)
    out = subprocess.run([sys.executable, "-c", "import horovod"], capture_output=True,
                         text=True, timeout=60,
                         env=dict(_env(installed), PYTHONPATH=os.pathsep.join(
                             [installed, other, REPO])))
    assert out.returncode != 0
    assert "both the real Horovod 0.28.1 and horovod-ext-compat are installed" in out.stderr


def test_uninstalling_leaves_horovod_ext(tmp_path, wheel, venv_template):
    venv = fresh_venv(venv_template, tmp_path)
    python = str(venv / "bin" / "python")
    out = _pip("install", "--no-deps", wheel, python=python)
    assert out.returncode == 0, out.stdout + out.stderr
    assert os.path.exists(venv / "bin" / "horovodrun")
    # every file it installed is its own: the horovod package, its metadata, horovodrun
    record = _pip("show", "-f", "horovod-ext-compat", python=python).stdout
    files = [line.strip() for line in record.split("Files:", 1)[1].splitlines() if line.strip()]
    assert files and all(f.startswith(("horovod/", "horovod_ext_compat-")) or
                         f.endswith("bin/horovodrun") for f in files), files
    out = _pip("uninstall", "-y", "horovod-ext-compat", python=python)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not os.path.exists(venv / "bin" / "horovodrun")
    check = subprocess.run([python, "-c", "import horovod_ext, horovod_ext.launch.run; import horovod"],
                           capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, PYTHONPATH=REPO))
    assert "No module named 'horovod'" in check.stderr, check.stderr
    shutil.rmtree(venv)
