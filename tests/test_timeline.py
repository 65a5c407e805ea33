"""The timeline (horovod_ext/timeline.py): Horovod's Chrome trace, written as the run goes, with
the phases of every op in the registry, readable after a crash, one file per rank on request."""
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from tests.harness import BACKENDS, REPO, run_ranks

pytestmark = pytest.mark.timeout(180)


def _events(path):
    with open(path) as f:
        return json.load(f)   # strict JSON: the file was completed at shutdown


def _tracks(events):
    """Track name -> its events (metadata left out)."""
    names = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}
    by_track = {}
    for e in events:
        if e["ph"] != "M" and e["pid"] in names:
            by_track.setdefault(names[e["pid"]], []).append(e)
    return by_track


def _named(events, name):
    return [e for e in events if e["name"] == name]


def body_every_op(path):
    import horovod_ext.torch as hvd
    rank = hvd.rank()
    # three small tensors in one request: one fusion buffer
    fused = hvd.grouped_allreduce([torch.full((64,), float(rank + i)) for i in range(3)],
                                  name="fused", op=hvd.Sum)
    steady = torch.ones(256)
    for _ in range(4):   # the first call is negotiated, the later ones take the steady lane
        hvd.allreduce_(steady.fill_(1.0), name="steady", op=hvd.Sum)
    gathered = hvd.allgather(torch.full((2, 3), float(rank)), name="gathered")
    hvd.broadcast(torch.full((5,), float(rank)), root_rank=0, name="bcast")
    adasum = hvd.allreduce(torch.randn(300_000, generator=torch.Generator().manual_seed(rank)),
                           name="adasum", op=hvd.Adasum)
    onebit = hvd.allreduce(torch.randn(4096), name="onebit", op=hvd.OneBit)
    randomk = hvd.allreduce(torch.randn(128, 128), name="randomk", op=hvd.RandomK(0.25))
    hvd.shutdown()   # completes the file
    return ([t.sum().item() for t in fused], steady.sum().item(), gathered.shape[0],
            adasum.shape[0], onebit.shape[0], randomk.shape[0], hvd.RandomK(0.25).bytes_sent)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_op_writes_its_phases_on_its_tensors_track(backend, tmp_path):
    path = str(tmp_path / "timeline.json")
    results = run_ranks(body_every_op, 2, backend, args=(path,),
                        env={"HOROVOD_TIMELINE": path, "HOROVOD_TIMELINE_MARK_CYCLES": "1"})
    assert results[0][0] == [64 * 1.0, 64 * 3.0, 64 * 5.0]   # the reductions are unchanged
    assert results[0][1] == 512.0
    assert os.listdir(tmp_path) == ["timeline.json"]       # rank 0 writes, alone
    events = _events(path)
    meta = events[0]
    assert meta["ph"] == "M" and "start_time_since_epoch_in_micros" in meta["args"]
    tracks = _tracks(events)
    wire = "MPI" if backend == "mpi" else "GLOO"
    # under Gloo, a single host's allreduces go through its shared memory
    reduced = "MPI" if backend == "mpi" else "SHM"

    # negotiation: one span per request, and an instant per rank as it submitted
    for name in ("allreduce.fused.0", "allreduce.steady", "allgather.gathered",
                 "broadcast.bcast", "allreduce.adasum", "allreduce.onebit", "allreduce.randomk"):
        kind = name.split(".")[0].upper()
        assert _named(tracks[name], f"NEGOTIATE_{kind}"), (name, tracks[name])
        assert {e["name"] for e in tracks[name] if e["ph"] == "i"} >= {"0", "1"}

    # a fused buffer: every tensor's track shows the copy in, the transfer and the copy out
    for i in range(3):
        names = [e["name"] for e in tracks[f"allreduce.fused.{i}"]]
        for activity in ("ALLREDUCE", "MEMCPY_IN_FUSION_BUFFER", f"{reduced}_ALLREDUCE",
                         "MEMCPY_OUT_FUSION_BUFFER"):
            assert activity in names, (i, names)
        top = _named(tracks[f"allreduce.fused.{i}"], "ALLREDUCE")[0]
        inner = _named(tracks[f"allreduce.fused.{i}"], f"{reduced}_ALLREDUCE")[0]
        assert top["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= top["ts"] + top["dur"] + 1
        assert inner["args"]["bytes"] == 3 * 64 * 4    # the whole buffer

    steady = tracks["allreduce.steady"]
    assert len(_named(steady, "STEADY_STATE_ALLREDUCE")) == 3
    assert len(_named(steady, "NEGOTIATE_ALLREDUCE")) == 4
    assert _named(tracks["allgather.gathered"], f"{wire}_ALLGATHER")[0]["args"]["bytes"] == 24
    assert _named(tracks["broadcast.bcast"], f"{wire}_BROADCAST")

    adasum = {e["name"] for e in tracks["allreduce.adasum"]}
    if backend == "mpi":   # recursive vector-halving over MPI's exchanges
        level = _named(tracks["allreduce.adasum"], "ADASUM_LEVEL_0")[0]
        assert {"ADASUM", "ADASUM_LEVEL_0", "ADASUM_EXCHANGE", "ADASUM_DOT_PRODUCTS",
                "ADASUM_COMBINE", "ADASUM_ALLGATHER"} <= adasum, adasum
        assert level["args"]["bytes"] == 150_000 * 4    # half the vector goes to the partner
    else:                  # one host under Gloo: the tree from the Gram matrix, in shared memory
        assert {"ADASUM", "SHM_ADASUM", "ADASUM_PUBLISH", "ADASUM_GRAM", "ADASUM_GRAM_SUM",
                "ADASUM_COMBINE", "ADASUM_RESULT"} <= adasum, adasum
        gram = _named(tracks["allreduce.adasum"], "ADASUM_GRAM")[0]
        assert gram["args"]["bytes"] == 2 * 150_000 * 4    # both vectors' shards of this rank

    onebit = {e["name"] for e in tracks["allreduce.onebit"]}
    assert {"ONEBIT", "ONEBIT_COMPRESS", f"{wire}_ALLTOALL", "ONEBIT_SERVER_AVERAGE",
            f"{wire}_ALLGATHER", "ONEBIT_DECOMPRESS"} <= onebit, onebit
    sent = _named(tracks["allreduce.onebit"], f"{wire}_ALLTOALL")[0]["args"]["bytes"]
    assert sent == 2048 // 8 + 4                     # the partner's half of the signs, one scale

    randomk = {e["name"] for e in tracks["allreduce.randomk"]}
    assert {"RANDOMK_0.25", "RANDOMK_MASK", "RANDOMK_GATHER", f"{wire}_ALLREDUCE",
            "RANDOMK_SCATTER"} <= randomk, randomk
    moved = _named(tracks["allreduce.randomk"], f"{wire}_ALLREDUCE")[0]["args"]["bytes"]
    assert moved == results[0][6] and moved < 128 * 128 * 4 // 3   # about a quarter

    assert any(e["name"] == "CYCLE_START" and e["ph"] == "i" for e in events)


def body_hierarchical():
    import horovod_ext.torch as hvd
    hvd.allreduce(torch.ones(1 << 16), name="big", op=hvd.Sum)          # pipelined, through shm
    hvd.allreduce(torch.ones(1 << 16), name="ada", op=hvd.Adasum)       # Adasum across nodes
    hvd.allreduce(torch.ones(1 << 16), name="rk", op=hvd.RandomK(0.5))   # a cross step
    hvd.allgather(torch.ones(2, 3), name="rows")
    hvd.shutdown()


def test_hierarchical_steps_are_named(tmp_path):
    path = str(tmp_path / "hier.json")
    run_ranks(body_hierarchical, 4, "gloo", hostnames=["a", "a", "b", "b"],
              env={"HOROVOD_TIMELINE": path, "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
                   "HOROVOD_HIERARCHICAL_ALLGATHER": "1"}, timeout=120)
    tracks = _tracks(_events(path))
    big = {e["name"] for e in tracks["allreduce.big"]}
    assert {"SHM_HIERARCHICAL_ALLREDUCE", "GLOO_CROSS_ALLREDUCE"} <= big, big
    ada = {e["name"] for e in tracks["allreduce.ada"]}
    # two nodes: the pair swaps its shards whole (adasum/rvh.py: PAIR_SWAP_LIMIT)
    assert {"SHM_NODE_REDUCESCATTER", "ADASUM_CROSS", "ADASUM_PAIR_SWAP",
            "SHM_NODE_ALLGATHER"} <= ada, ada
    rk = {e["name"] for e in tracks["allreduce.rk"]}
    assert {"SHM_NODE_REDUCESCATTER", "CROSS_STEP", "RANDOMK_GATHER", "SHM_NODE_ALLGATHER"} <= rk, rk
    rows = {e["name"] for e in tracks["allgather.rows"]}
    assert {"NODE_ALLGATHER", "GLOO_CROSS_ALLGATHER"} <= rows, rows


def body_straggler():
    import time
    import horovod_ext.torch as hvd
    hvd.barrier()   # both leave init together: rank 0 may return from it later than rank 1
    if hvd.rank() == 1:
        time.sleep(0.4)   # a straggler on purpose: negotiation must show it
    hvd.allreduce(torch.ones(8), name="late")
    hvd.shutdown()


def test_all_ranks_write_files_on_one_clock_and_show_the_straggler(tmp_path):
    path = str(tmp_path / "trace.json")
    run_ranks(body_straggler, 2, "gloo",
              env={"HOROVOD_TIMELINE": path, "HOROVOD_TIMELINE_ALL_RANKS": "1"})
    assert sorted(os.listdir(tmp_path)) == ["trace.rank0.json", "trace.rank1.json"]
    views = [_tracks(_events(str(tmp_path / f"trace.rank{r}.json")))["allreduce.late"]
             for r in range(2)]
    mine = views[0]
    submissions = {e["name"]: e["ts"] for e in mine if e["ph"] == "i"}
    assert submissions["1"] - submissions["0"] > 300_000          # microseconds
    negotiation = _named(mine, "NEGOTIATE_ALLREDUCE")[0]
    assert negotiation["dur"] > 300_000
    # the transfer ends at nearly the same moment in both ranks' files: one clock
    ends = [_named(v, "SHM_ALLREDUCE")[0] for v in views]   # one host: shared memory
    ends = [e["ts"] + e["dur"] for e in ends]
    assert abs(ends[0] - ends[1]) < 50_000, ends


def body_crash(path):
    import time
    import horovod_ext.torch as hvd
    for step in range(20):
        hvd.allreduce(torch.ones(16), name=f"before.{step}")
    if hvd.rank() == 0:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:   # until the writer has put the events out
            with open(path) as f:
                if "allreduce.before.19" in f.read():
                    break
            time.sleep(0.05)
        os.kill(os.getpid(), 9)
    hvd.allreduce(torch.ones(16), name="after")


def test_a_crashed_job_leaves_a_readable_timeline(tmp_path):
    from horovod_ext.engine import timeline
    path = str(tmp_path / "crash.json")
    run_ranks(body_crash, 2, "gloo", args=(path,), env={"HOROVOD_TIMELINE": path},
              expect_failure=True, timeout=60)
    with open(path) as f:
        text = f.read()
    assert not text.rstrip().endswith("]")          # never completed
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    events = timeline.load(path)
    tracks = _tracks(events)
    assert all(_named(tracks[f"allreduce.before.{s}"], "SHM_ALLREDUCE") for s in range(20))


def test_load_drops_a_partly_written_last_line(tmp_path):
    from horovod_ext.engine import timeline
    path = str(tmp_path / "cut.json")
    t = timeline.Timeline(path, 0)
    t.submitted(("x",), 0)
    t.negotiated(("x",), "allreduce")
    t.flush()
    with open(path, "a") as f:
        f.write(',{"name":"MPI_ALLRED')       # the writer was killed mid-line
    events = timeline.load(path)
    assert [e["name"] for e in events if e["ph"] != "M"] == ["0", "NEGOTIATE_ALLREDUCE"]
    t.stop()


def body_start_stop(paths):
    import horovod_ext.torch as hvd
    first, second = paths
    hvd.start_timeline(first, mark_cycles=True)
    hvd.allreduce(torch.tensor([1.0, 2.0, 3.0]), name="test_allreduce")
    hvd.stop_timeline()
    hvd.allreduce(torch.tensor([1.0]), name="between")    # recorded nowhere
    hvd.start_timeline(second, mark_cycles=False)
    hvd.allreduce(torch.tensor([1.0, 2.0, 3.0]), name="test_allreduce")
    hvd.stop_timeline()
    hvd.shutdown()
    return True


def test_start_and_stop_timeline_at_run_time(tmp_path):
    paths = [str(tmp_path / "one.json"), str(tmp_path / "two.json")]
    run_ranks(body_start_stop, 2, "gloo", args=(paths,), env={"HOROVOD_TIMELINE": "DYNAMIC"})
    assert sorted(os.listdir(tmp_path)) == ["one.json", "two.json"]
    for path, cycles in zip(paths, (True, False)):
        with open(path) as f:
            text = f.read()
        json.loads(text)
        assert "allreduce.test_allreduce" in text and "NEGOTIATE_ALLREDUCE" in text
        assert "start_time_since_epoch_in_micros" in text
        assert ("CYCLE_START" in text) == cycles
        assert "allreduce.between" not in text


def test_start_timeline_needs_init():
    code = ("import horovod_ext.torch as hvd\n"
            "try:\n    hvd.start_timeline('/tmp/never.json')\n"
            "except ValueError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, PYTHONPATH=REPO))
    assert "refused: horovod_ext has not been initialized" in out.stdout, out.stderr


def test_bad_timeline_variables_are_named():
    from horovod_ext.config import Config, ConfigError
    with pytest.raises(ConfigError, match="HOROVOD_TIMELINE_MARK_CYCLES='sometimes'"):
        Config.from_env({"HOROVOD_TIMELINE_MARK_CYCLES": "sometimes"})
    with pytest.raises(ConfigError, match="HOROVOD_TIMELINE_ALL_RANKS"):
        Config.from_env({"HOROVOD_TIMELINE_ALL_RANKS": "2"})


def test_hvdrun_timeline_filename(tmp_path):
    path = tmp_path / "run.json"
    script = tmp_path / "train.py"
    script.write_text("import torch, horovod_ext.torch as hvd\nhvd.init()\n"
                      "for i in range(3):\n    hvd.allreduce(torch.ones(4), name='w')\n")
    hvdrun = os.path.join(os.path.dirname(sys.executable), "hvdrun")
    out = subprocess.run([hvdrun, "-np", "2", "--timeline-filename", str(path),
                          "--timeline-mark-cycles", sys.executable, str(script)],
                         cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr
    events = _events(str(path))
    assert len(_named(_tracks(events)["allreduce.w"], "NEGOTIATE_ALLREDUCE")) == 3
    assert _named(events, "CYCLE_START")
