"""Elastic training under hvdrun's elastic mode: real worker processes on this host posing as
separate hosts (127.0.0.x, each its own HOROVOD_HOSTNAME), killed with SIGKILL at chosen points.
The training program (tests/elastic_train.py) counts in its weights how often each sample was
trained on, so every test checks that each sample of each epoch was processed exactly once."""
import json
import math
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HVDRUN = os.path.join(os.path.dirname(sys.executable), "hvdrun")
TRAIN = os.path.join(REPO, "tests", "elastic_train.py")
# 288 samples, 12 per batch: 48 or 36 a step at 4 or 3 workers, so what is left of an epoch
# always divides by 2, 3 and 4 and the sampler never pads.
SAMPLES, BATCH = 288, 12


def elastic_run(tmp_path, hosts, flags, epochs, step_s, kills="", timeout=150, env=None):
    (tmp_path / "hosts").write_text("".join(f"{h}\n" for h in hosts))
    cmd = [HVDRUN, *flags, "--host-discovery-script", f"cat {tmp_path / 'hosts'}",
           *worker_command(), TRAIN, str(tmp_path), str(SAMPLES), str(epochs), str(BATCH),
           str(step_s)] + ([kills] if kills else [])
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=dict(os.environ, **(env or {})))
    return proc, time.monotonic() - started


def worker_command():
    """How hvdrun starts the training program: through tests/_mpi_rank.py's stub, which has it
    forked from the warm fork server (a new interpreter spends seconds importing torch), or as
    a new interpreter where that server is off."""
    from tests import harness
    factory = harness._mpi_rank_factory(harness._forking())
    if factory:
        return [sys.executable, "-m", "tests._mpi_rank", factory, "--script"]
    return [sys.executable]


def result(tmp_path):
    with open(tmp_path / "result.json") as f:
        return json.load(f)


def assert_each_sample_once_per_epoch(tmp_path, epochs, proc):
    counts = result(tmp_path)["counts"]
    assert counts == [float(epochs)] * SAMPLES, (sorted(set(counts)), proc.stderr[-3000:])


def phases(sizes):
    """The run's sizes with repeats folded: [4, 4, 3, 3, 4] -> [4, 3, 4]."""
    return [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s]


@pytest.mark.timeout(180)
def test_a_killed_worker_is_dropped_and_its_host_comes_back(tmp_path):
    hosts = [f"127.0.0.{i}:1" for i in range(1, 5)]
    proc, _ = elastic_run(tmp_path, hosts, ["-np", "4", "--min-np", "3", "--max-np", "4",
                                            "--blacklist-cooldown-range", "1", "2"],
                          epochs=5, step_s=0.1, kills="2:0:2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "worker 2 (host 127.0.0.3) was killed by signal 9" in proc.stderr
    assert_each_sample_once_per_epoch(tmp_path, 5, proc)
    assert phases(result(tmp_path)["sizes"]) == [4, 3, 4], proc.stderr[-3000:]


@pytest.mark.timeout(180)
def test_a_hung_worker_is_found_by_heartbeats_and_dropped(tmp_path):
    """A worker stopped with SIGSTOP in the middle of training (a hung process) is named by its
    peers' heartbeats, killed by the driver and dropped like a dead one, in seconds: the
    communication timeout (100 s here) never comes into it."""
    hosts = [f"127.0.0.{i}:1" for i in range(1, 4)]
    proc, took = elastic_run(tmp_path, hosts, ["-np", "3", "--min-np", "2", "--max-np", "3"],
                             epochs=3, step_s=0.02, kills="1:0:2:stop",
                             env={"HOROVOD_HEARTBEAT_SECONDS": "1",
                                  "HOROVOD_GLOO_TIMEOUT_SECONDS": "100"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "worker 1 (host 127.0.0.2) stopped answering its peers' heartbeats" in proc.stderr, \
        proc.stderr[-3000:]
    assert_each_sample_once_per_epoch(tmp_path, 3, proc)
    assert phases(result(tmp_path)["sizes"]) == [3, 2], proc.stderr[-3000:]
    assert took < 60, took


@pytest.mark.timeout(180)
def test_down_to_one_worker_and_back(tmp_path):
    """Two workers, one dies: the survivor trains alone (its optimizer reduces nothing at one
    process) until the host returns, then the two reduce again."""
    hosts = ["127.0.0.1:1", "127.0.0.2:1"]
    proc, _ = elastic_run(tmp_path, hosts, ["-np", "2", "--min-np", "1",
                                            "--blacklist-cooldown-range", "1", "1.5"],
                          epochs=5, step_s=0.1, kills="1:0:2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_each_sample_once_per_epoch(tmp_path, 5, proc)
    assert phases(result(tmp_path)["sizes"]) == [2, 1, 2], proc.stderr[-3000:]


@pytest.mark.timeout(180)
def test_rank_0_dies_and_its_host_comes_back(tmp_path):
    """The worker of the first host (rank 0) dies; a fresh worker there later must not become
    rank 0 and hand its untrained state to the others."""
    hosts = [f"127.0.0.{i}:1" for i in range(1, 4)]
    proc, _ = elastic_run(tmp_path, hosts, ["-np", "3", "--min-np", "2",
                                            "--blacklist-cooldown-range", "1", "1.5"],
                          epochs=5, step_s=0.1, kills="0:0:2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_each_sample_once_per_epoch(tmp_path, 5, proc)
    assert phases(result(tmp_path)["sizes"]) == [3, 2, 3], proc.stderr[-3000:]


@pytest.mark.timeout(180)
def test_a_host_no_longer_offered_leaves_without_losing_work(tmp_path):
    """The discovery script stops listing the third host: its worker is told at the next
    re-forming that the job is over for it and exits 0; nothing is lost or repeated."""
    hosts = [f"127.0.0.{i}:1" for i in range(1, 4)]
    proc, _ = elastic_run(tmp_path, hosts, ["-np", "3", "--min-np", "2"],
                          epochs=4, step_s=0.1, kills="0:0:2:drop")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "host 127.0.0.3 slot 0 is no longer offered" in proc.stderr, proc.stderr[-3000:]
    assert "killed" not in proc.stderr and "exited with code" not in proc.stderr
    assert_each_sample_once_per_epoch(tmp_path, 4, proc)
    assert phases(result(tmp_path)["sizes"]) == [3, 2], proc.stderr[-3000:]


@pytest.mark.timeout(180)
def test_a_whole_host_dies_and_a_returning_worker_fails_again(tmp_path):
    """Both workers of the second host die at the same batch; when the host comes back, the
    first worker started there dies at its first step; the job still completes."""
    hosts = ["127.0.0.1:2", "127.0.0.2:2"]
    proc, _ = elastic_run(tmp_path, hosts, ["-np", "4", "--min-np", "2",
                                            "--blacklist-cooldown-range", "1", "1.5"],
                          epochs=5, step_s=0.1, kills="2:0:2,3:0:2,4:-1:-1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "worker 4 (host 127.0.0.2) was killed by signal 9" in proc.stderr, proc.stderr[-3000:]
    assert_each_sample_once_per_epoch(tmp_path, 5, proc)
    assert phases(result(tmp_path)["sizes"])[:2] == [4, 2]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["commit", "reset"])
def test_failure_inside_commit_or_reset(tmp_path, where):
    """A worker dies inside commit() (after saving, before the host check), or inside the
    re-forming that follows another worker's death."""
    hosts = [f"127.0.0.{i}:1" for i in range(1, 5)]
    kills = "1:0:2:commit" if where == "commit" else "3:0:2,1:-1:-1:reset"
    proc, _ = elastic_run(tmp_path, hosts, ["-np", "4", "--min-np", "2"],
                          epochs=3, step_s=0.02, kills=kills)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "worker 1 (host 127.0.0.2) was killed by signal 9" in proc.stderr
    assert_each_sample_once_per_epoch(tmp_path, 3, proc)
    assert phases(result(tmp_path)["sizes"])[-1] == (3 if where == "commit" else 2)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("optimizer", ["adasum", "onebit", "slamb", "diloco"])
def test_other_ops_go_on_at_the_new_size(tmp_path, optimizer, monkeypatch):
    """Adasum (3 ranks after 4), 1-bit Adam (its error feedback restarts from zero in the new
    world), SLAMB (masks from the step number, models averaged by the sync) and DiLoCo (an
    outer step's reduction in flight when the worker dies) keep training after a worker dies."""
    monkeypatch.setenv("ELASTIC_TEST_OPTIMIZER", optimizer)
    hosts = [f"127.0.0.{i}:1" for i in range(1, 5)]
    proc, _ = elastic_run(tmp_path, hosts, ["-np", "4", "--min-np", "3"],
                          epochs=2, step_s=0.02, kills="2:0:4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = result(tmp_path)
    assert phases(done["sizes"]) == [4, 3]
    assert done["agree"], "ranks ended with different models"
    assert "generation 3" not in proc.stderr, "the new world failed and re-formed again"
    assert all(math.isfinite(w) for w in done["counts"])


@pytest.mark.timeout(120)
def test_fewer_than_min_np_ends_the_job_with_the_reason(tmp_path):
    hosts = ["127.0.0.1:1", "127.0.0.2:1"]
    proc, seconds = elastic_run(tmp_path, hosts, ["-np", "2", "--min-np", "2",
                                                  "--elastic-timeout", "2"],
                                epochs=50, step_s=0.02, kills="1:0:2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "fewer than --min-np 2" in proc.stderr, proc.stderr[-3000:]
    assert seconds < 60


@pytest.mark.timeout(60)
def test_elastic_needs_gloo():
    proc = subprocess.run([HVDRUN, "--mpi", "-np", "2", "--min-np", "2", sys.executable, "-c",
                           "pass"], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2
    assert "runs over Gloo, not mpirun" in proc.stderr


@pytest.mark.timeout(180)
def test_torchrun_restarts_resume_from_the_checkpoint(tmp_path):
    """torchrun's restart-based elasticity: a rank dies, torchrun starts every worker again,
    they resume from the checkpoint; each sample is trained on once per epoch in the end."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    proc = subprocess.run([torchrun, "--standalone", "--nnodes=1:1", "--nproc_per_node=2",
                           "--max-restarts=1", os.path.join(REPO, "tests", "torchrun_restart.py"),
                           str(tmp_path), "3"], capture_output=True, text=True, timeout=150,
                          cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = result(tmp_path)
    assert done["started_at"] == 1, "the restarted workers did not resume from the checkpoint"
    assert done["counts"] == [3.0] * 64


@pytest.mark.timeout(120)
def test_reset_limit_ends_the_job(tmp_path):
    hosts = [f"127.0.0.{i}:1" for i in range(1, 4)]
    proc, _ = elastic_run(tmp_path, hosts, ["-np", "3", "--min-np", "1", "--reset-limit", "0"],
                          epochs=5, step_s=0.02, kills="1:0:2")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "more than --reset-limit 0 times" in proc.stderr, proc.stderr[-3000:]


def test_sampler_splits_what_is_left_and_records_every_rank():
    """ElasticSampler alone (one process, as before hvd.init()): rank r of n takes every n-th
    position of what is left; record_batch marks the batch of every rank; set_epoch starts
    over; the state round-trips."""
    import horovod_ext.torch as hvd
    sampler = hvd.elastic.ElasticSampler(range(10), shuffle=False)
    sampler.processed[[0, 4]] = True
    sampler.reset(3, 1)                  # as rank 1 of 3: [1, 2, 3, 5, 6, 7, 8, 9, 1] by 3
    assert list(sampler) == [2, 6, 9]
    sampler.record_batch(0, 2)           # positions 0..5 of every rank's list: 6 samples
    assert sampler.processed.nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    state = sampler.state_dict()
    sampler.set_epoch(1)
    assert sampler.get_processed_count() == 0 and list(sampler) == list(range(10))
    sampler.load_state_dict(state)       # one process: rank 0 of 1
    assert list(sampler) == [8, 9] and sampler.epoch == 0
