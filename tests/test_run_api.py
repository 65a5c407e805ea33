"""``horovod_ext.run``: a function run on real worker processes (Gloo and MPI on localhost), its
results returned in rank order, a worker's exception or death raised in the caller naming the
rank, and the call made from a plain script's ``__main__`` and from a real Jupyter kernel."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import horovod_ext
from horovod_ext.launch import api
from tests.harness import REPO

pytestmark = pytest.mark.timeout(120)

MODES = [pytest.param({}, id="gloo"), pytest.param({"use_mpi": True}, id="mpi")]


def allreduce_and_rank(scale):
    import torch
    import horovod_ext.torch as hvd
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]) * scale, op=hvd.Sum)
    rank, size = hvd.rank(), hvd.size()
    hvd.shutdown()
    return {"rank": rank, "size": size, "sum": total.item()}


def fail_on_rank_1():
    import torch
    import horovod_ext.torch as hvd
    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("bad batch on this worker")
    hvd.allreduce(torch.ones(4))  # rank 0 waits here for a rank that never comes
    return "unreachable"


def killed_on_rank_1():
    import torch
    import horovod_ext.torch as hvd
    hvd.init()
    if hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    hvd.allreduce(torch.ones(4))
    return "unreachable"


@pytest.mark.parametrize("mode", MODES)
def test_results_in_rank_order(mode):
    results = horovod_ext.run(allreduce_and_rank, args=(2.0,), num_proc=2, **mode)
    # ranks contribute 1 and 2, times 2
    assert results == [{"rank": 0, "size": 2, "sum": 6.0}, {"rank": 1, "size": 2, "sum": 6.0}]


@pytest.mark.parametrize("mode", MODES)
def test_exception_on_one_rank_names_it(mode):
    start = time.monotonic()
    with pytest.raises(api.RunError) as info:
        horovod_ext.run(fail_on_rank_1, np=2, **mode)
    took = time.monotonic() - start
    assert took < 30, f"the error took {took:.1f} s to reach the caller"
    err = info.value
    assert err.rank == 1
    assert "rank 1 raised ValueError: bad batch on this worker" in str(err)
    assert "fail_on_rank_1" in err.remote_traceback and "ValueError" in err.remote_traceback
    assert isinstance(err.__cause__, ValueError)


def test_dead_worker_ends_the_call_naming_it():
    start = time.monotonic()
    with pytest.raises(api.RunError) as info:
        horovod_ext.run(killed_on_rank_1, np=2)
    assert time.monotonic() - start < 30
    assert info.value.rank == 1
    assert "rank 1" in str(info.value) and "signal 9" in str(info.value)


def test_keyword_arguments_and_bad_arguments():
    assert horovod_ext.run(allreduce_and_rank, kwargs={"scale": 1.0}, np=1) == [
        {"rank": 0, "size": 1, "sum": 1.0}]
    with pytest.raises(ValueError, match="positive integer"):
        horovod_ext.run(allreduce_and_rank, np=0)
    with pytest.raises(ValueError, match="exclusive"):
        horovod_ext.run(allreduce_and_rank, np=2, use_gloo=True, use_mpi=True)


def test_import_horovod_ext_as_horovod():
    import horovod_ext as horovod
    assert horovod.run is api.run
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        horovod.nothing


SCRIPT = textwrap.dedent('''
    import io, sys
    import horovod_ext as horovod

    def train(base):  # defined in __main__: travels by value
        import horovod_ext.torch as hvd
        hvd.init()
        print(f"hello from {hvd.rank()}")
        return base + hvd.rank()

    class TextOnly(io.TextIOBase):  # like a Jupyter kernel's stdout: text, no .buffer
        def __init__(self):
            self.parts = []
        def write(self, s):
            self.parts.append(s)
            return len(s)

    out = TextOnly()
    real, sys.stdout = sys.stdout, out
    try:
        results = horovod.run(train, args=(10,), np=2)
    finally:
        sys.stdout = real
    print("RESULTS", results)
    print("CAPTURED", sorted(line for line in "".join(out.parts).splitlines() if "hello" in line))
''')


def test_function_from_a_scripts_main(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path), capture_output=True,
                          text=True, timeout=90, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "RESULTS [10, 11]" in proc.stdout
    assert ("CAPTURED ['[0]<stdout>:hello from 0', '[1]<stdout>:hello from 1']"
            in proc.stdout), proc.stdout


CELL = textwrap.dedent('''
    import horovod_ext as horovod

    def train():
        import torch
        import horovod_ext.torch as hvd
        hvd.init()
        return hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()

    print("RESULTS", horovod.run(train, np=2))
''')


def test_from_a_jupyter_kernel(tmp_path):
    jupyter_client = pytest.importorskip(
        "jupyter_client", reason="jupyter_client is in the test extra (pip install -e .[test])")
    pytest.importorskip("ipykernel", reason="ipykernel is in the test extra")
    # "python3" is ipykernel's own kernel: this interpreter
    km = jupyter_client.KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=REPO))
    client = km.client()
    try:
        client.start_channels()
        client.wait_for_ready(timeout=60)
        out = []
        reply = client.execute_interactive(
            CELL, timeout=90,
            output_hook=lambda msg: out.append(msg["content"].get("text", "")
                                               if msg["msg_type"] == "stream" else ""))
        assert reply["content"]["status"] == "ok", reply["content"]
        assert "RESULTS [1.0, 1.0]" in "".join(out), out
    finally:
        client.stop_channels()
        km.shutdown_kernel(now=True)


def test_elastic_arguments_start_the_elastic_driver():
    # min_np/max_np: the workers join through hvdrun's elastic driver and learn their ranks at
    # hvd.init(); the results still come back in rank order
    results = horovod_ext.run(allreduce_and_rank, args=(1.0,), num_proc=2, min_num_proc=2,
                              max_num_proc=2, hosts="localhost:2")
    assert results == [{"rank": 0, "size": 2, "sum": 3.0}, {"rank": 1, "size": 2, "sum": 3.0}]
