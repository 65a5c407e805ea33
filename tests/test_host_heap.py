"""hvd.init keeps freed host memory in the process (engine/host_heap.py): a step that frees and
allocates the same memory again does not fault its pages in again."""
import json
import os
import subprocess
import sys

import pytest

from horovod_ext.config import Config, ConfigError
from horovod_ext.engine import host_heap
from tests.harness import REPO

MIB = 1024 * 1024
PAGES_PER_STEP = 8 * 20 * MIB // 4096   # eight 20 MiB tensors a step


def minor_faults() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def body_faults_per_step():
    """Whether a 20 MiB tensor, the first after ``hvd.init()``, lies in the heap (below the
    program break) rather than in a mapping of its own; then the minor faults of the last steps
    of a pattern that glibc's default limits may hand back to the kernel every step: 160 MiB in
    tensors of 20 MiB allocated, written and freed."""
    import ctypes
    import torch
    libc = host_heap._glibc()
    libc.sbrk.restype = ctypes.c_void_p
    first = torch.empty(20 * MIB // 4)
    in_heap = first.data_ptr() < libc.sbrk(0)
    del first
    faults = []
    for _ in range(8):
        before = minor_faults()
        tensors = [torch.ones(20 * MIB // 4) for _ in range(8)]
        del tensors
        faults.append(minor_faults() - before)
    return {"in_heap": in_heap, "faults": faults[-2:]}


def faults_after_init(keep: str):
    """``body_faults_per_step`` in a process of its own after ``hvd.init()`` (a fresh
    interpreter: a forked one carries its parent's heap)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD_", "MALLOC_", "OMPI_", "PMI"))}
    env.pop("GLIBC_TUNABLES", None)
    env.update(HOROVOD_KEEP_HOST_HEAP=keep, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    code = ("import json, horovod_ext.torch as hvd; hvd.init(); "
            "from tests.test_host_heap import body_faults_per_step as f; "
            "print(json.dumps(f())); hvd.shutdown()")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, timeout=60,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.timeout(150)
@pytest.mark.skipif(host_heap._glibc() is None,
                    reason="the C library is not glibc: its allocator keeps its own limits")
def test_freed_memory_is_not_faulted_in_again():
    kept, default = faults_after_init("1"), faults_after_init("0")
    # glibc's own limits map a fresh process's 20 MiB allocation afresh (its threshold starts
    # at 128 KiB), and whether it trims the heap depends on what else lies at its top; kept,
    # the tensor comes from the heap and the freed pages stay (a few faults for Python's own)
    assert not default["in_heap"], default
    assert kept["in_heap"], kept
    assert max(kept["faults"]) < PAGES_PER_STEP // 100, (kept, default)


def test_user_settings_and_bad_values():
    assert host_heap.user_chose({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert host_heap.user_chose({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    assert not host_heap.user_chose({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})
    assert not host_heap.keep({"MALLOC_MMAP_THRESHOLD_": "131072"})
    assert Config.from_env({"HOROVOD_KEEP_HOST_HEAP": "0"}).keep_host_heap is False
    with pytest.raises(ConfigError, match="HOROVOD_KEEP_HOST_HEAP"):
        Config.from_env({"HOROVOD_KEEP_HOST_HEAP": "maybe"})
