"""hvdrun, the launcher: real hvdrun processes starting real ranks (Gloo and MPI, local and through
a substitute ssh command), checked from the outside.

Where the launcher itself is under test the ranks are tiny scripts without torch (written to a
temporary folder); a few end-to-end runs use real horovod_ext ranks and check their allreduce
against a reference computed here.  The network lab (tools/netlab.sh) is not used here: it needs
root and namespaces, so it is a manual check (docs/launching.md, hvdrun section).
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from horovod_ext.launch import mpi as mpilib
from horovod_ext.launch import netinfo, options
from tests.harness import REPO

HVDRUN = [sys.executable, "-m", "horovod_ext.launch.run"]

RANK_TOOL = r'''
import json, os, signal, sys, time
rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))
mode, folder = sys.argv[1], sys.argv[2]
if mode == "env":
    keep = {k: v for k, v in os.environ.items()
            if k.startswith(("HOROVOD_", "OMPI_COMM_WORLD_", "GLOO_", "NCCL_"))}
    print("ENV " + json.dumps(keep), flush=True)
elif mode == "output":
    print(f"out {rank}", flush=True)
    print(f"err {rank}", file=sys.stderr, flush=True)
    sys.stdout.write(f"\rbar {rank} 50%")
    sys.stdout.flush()
    sys.stdout.write(f"\rbar {rank} 100%\n")
    sys.stdout.write(f"tail {rank}")  # no newline at the end
else:  # "wait": stay up until stopped; FAIL_RANK exits with FAIL_CODE once all are up
    if str(rank) in os.environ.get("IGNORE_INT", "").split(","):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    with open(os.path.join(folder, f"pid.{rank}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.rename(os.path.join(folder, f"pid.{rank}.tmp"), os.path.join(folder, f"pid.{rank}"))
    if str(rank) == os.environ.get("FAIL_RANK"):
        size = int(os.environ.get("HOROVOD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
        deadline = time.monotonic() + 30
        while not all(os.path.exists(os.path.join(folder, f"pid.{r}")) for r in range(size)):
            if time.monotonic() > deadline:
                sys.exit(99)
            time.sleep(0.02)
        sys.exit(int(os.environ.get("FAIL_CODE", "3")))
    time.sleep(120)
'''

HVD_RANK = r'''
import json, os, sys, time
rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
if "HANG_RANK" in os.environ and rank == os.environ["HANG_RANK"]:
    time.sleep(120)  # never reaches hvd.init()
import torch
import horovod_ext.torch as hvd
hvd.init()
x = torch.arange(6, dtype=torch.float64) * (hvd.rank() + 1)
out = {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
       "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
       "cross_size": hvd.cross_size(), "mpi": hvd.mpi_enabled(),
       "sum": hvd.allreduce(x, op=hvd.Sum, name="s").tolist(),
       "avg": hvd.allreduce(x, name="a").tolist(),
       "gathered": hvd.allgather(torch.tensor([hvd.rank()]), name="g").tolist(),
       "threads": torch.get_num_threads()}
print("RESULT " + json.dumps(out), flush=True)
hvd.shutdown()
'''

SSH_SHIM = r'''#!/bin/sh
# ssh stand-in for the tests: runs the command on this machine; "down*" hosts are unreachable
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
case "$host" in down*) echo "ssh: Could not resolve hostname $host" >&2; exit 255;; esac
exec /bin/sh -c "$*"
'''


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    d = tmp_path_factory.mktemp("hvdrun_tools")
    (d / "rank_tool.py").write_text(RANK_TOOL)
    (d / "hvd_rank.py").write_text(HVD_RANK)
    (d / "ssh").write_text(SSH_SHIM)
    os.chmod(d / "ssh", 0o755)
    return {"tool": str(d / "rank_tool.py"), "hvd": str(d / "hvd_rank.py"), "ssh": str(d / "ssh")}


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD_", "OMPI_", "PMI", "PMIX"))}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}   # None: unset it


def hvdrun(args, timeout=60, **extra):
    """(exit status, stdout, stderr) of hvdrun ARGS; bytes are decoded here because text mode
    would turn '\r' into '\n'."""
    proc = subprocess.Popen(HVDRUN + list(args), env=_env(**extra), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # hvdrun passes SIGTERM on, so no rank outlives the test
        out, err = proc.communicate(timeout=15)
        raise AssertionError(f"hvdrun {args} timed out after {timeout} s:\n"
                             f"{out.decode()[-2000:]}\n{err.decode()[-3000:]}") from None
    return proc.returncode, out.decode(), err.decode()


def _lines(stdout, marker):
    return [json.loads(line.split(marker, 1)[1]) for line in stdout.splitlines() if marker in line]


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has ended
    except (FileNotFoundError, ProcessLookupError):  # gone before or while reading
        return True


def _wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# --- command line ---------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_bad_values_exit_2_with_a_message(tmp_path, capsys):
    from horovod_ext.launch.run import main
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=two\n")
    cases = [(["-np", "0", "x"], "-np/--num-proc: expected a positive integer"),
             (["-np", "2", "-H", "a:x", "x"], "bad slot count in 'a:x'"),
             (["-np", "5", "-H", "a:2,b:2", "x"], "more processes than the 4 slots"),
             (["--hostfile", str(hostfile), "x"], "line 2: bad slot count"),
             (["--hostfile", str(tmp_path / "none"), "x"], "No such file"),
             (["-np", "2", "--log-level", "loud", "x"], "--log-level: expected one of"),
             (["-np", "2", "--fusion-threshold-mb", "-1", "x"], "expected a non-negative"),
             (["-np", "2", "--cycle-time-ms", "abc", "x"], "--cycle-time-ms"),
             (["-np", "2", "--start-timeout", "0", "x"], "--start-timeout"),
             (["-np", "2", "-p", "70000", "x"], "port number"),
             (["-np", "2", "--gloo", "--mpi", "x"], "not allowed with argument"),
             (["-np", "2", "--hierarchical-allreduce", "--no-hierarchical-allreduce", "x"],
              "not allowed with argument"),
             (["-np", "2"], "no command given"),
             (["python", "x.py"], "-np is required")]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2, (argv, err)
        assert message in err, (argv, err)
    # the installed console script behaves the same
    script = os.path.join(os.path.dirname(sys.executable), "hvdrun")
    assert os.path.exists(script), "pip install -e . installs the hvdrun console script"
    out = subprocess.run([script, "-np", "0", "true"], capture_output=True, text=True,
                         timeout=30, env=_env())
    assert out.returncode == 2 and "expected a positive integer" in out.stderr
    out = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=30,
                         env=_env())
    assert out.returncode == 0 and out.stdout.startswith("hvdrun (horovod_ext) ")
    # hvdrun starts fast: torch is imported by the ranks (and --check-build), never by hvdrun
    probe = ("import sys, horovod_ext.launch.run, horovod_ext.launch.elastic, "
             "horovod_ext.launch.api; horovod_ext.launch.run.options.parse(['-np', '2', 'x']); "
             "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=30, env=_env(), cwd=REPO)
    assert out.stdout.strip() == "False", out.stderr


def test_flags_map_to_horovod_variables():
    o = options.parse(["-np", "2", "--fusion-threshold-mb", "1.5", "--cycle-time-ms", "2.5",
                       "--cache-capacity", "7", "--hierarchical-allreduce",
                       "--no-hierarchical-allgather", "--timeline-filename", "/tmp/tl.json",
                       "--no-stall-check", "--stall-check-shutdown-time-seconds", "9",
                       "--log-level", "DEBUG", "--network-interfaces", "eth1,eth2",
                       "--start-timeout", "12", "python", "t.py", "--lr", "1"])
    assert options.horovod_env(o) == {
        "HOROVOD_START_TIMEOUT": "12", "HOROVOD_FUSION_THRESHOLD": str(int(1.5 * 2 ** 20)),
        "HOROVOD_CYCLE_TIME": "2.5", "HOROVOD_CACHE_CAPACITY": "7",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_HIERARCHICAL_ALLGATHER": "0",
        "HOROVOD_TIMELINE": "/tmp/tl.json", "HOROVOD_STALL_CHECK_DISABLE": "1",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "9", "HOROVOD_LOG_LEVEL": "debug",
        "HOROVOD_GLOO_IFACE": "eth1", "GLOO_SOCKET_IFNAME": "eth1",
        "NCCL_SOCKET_IFNAME": "eth1,eth2"}
    assert o.command == ["python", "t.py", "--lr", "1"]
    o = options.parse(["--stall-check-warning-time-seconds", "5", "--disable-cache", "-H",
                       "a:2,b,a:1", "x"])
    assert o.np == 4 and o.host_list == [("a", 3), ("b", 1)]
    env = options.horovod_env(o)
    assert env["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "5" and env["HOROVOD_CACHE_CAPACITY"] == "0"
    # Horovod's local/cross ranks: 3 ranks on a, 1 on b
    layout = [(s.host, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in o.slots]
    assert layout == [("a", 0, 3, 0, 2), ("a", 1, 3, 0, 1), ("a", 2, 3, 0, 1), ("b", 0, 1, 1, 2)]
    tuned = options.parse(["-np", "1", "--autotune", "--autotune-log-file", "at.csv",
                       "--autotune-warmup-samples",
                       "0", "--autotune-steps-per-sample", "4",
                       "--autotune-bayes-opt-max-samples", "9",
                       "--autotune-gaussian-process-noise", "0.25", "--timeline-mark-cycles",
                       "--timeline-all-ranks", "x"])
    assert options.horovod_env(tuned) == {
        "HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "at.csv",
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "0", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "4",
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "9",
        "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.25",
        "HOROVOD_TIMELINE_MARK_CYCLES": "1", "HOROVOD_TIMELINE_ALL_RANKS": "1",
        "HOROVOD_START_TIMEOUT": "30"}


def test_rendezvous_address_and_interface_choice():
    # rank 0's host has a docker bridge and the cluster network; the others only the latter
    first = ["172.17.0.1", "10.1.0.5", "127.0.0.1"]
    peers = [["10.1.0.6", "127.0.0.1"], ["192.168.9.9", "10.1.0.7"]]
    assert netinfo.rendezvous_address(first, peers) == "10.1.0.5"
    assert netinfo.rendezvous_address(first, []) == "127.0.0.1"
    assert netinfo.rendezvous_address(["127.0.0.1"], peers) is None
    ifaces = [("lo", "127.0.0.1"), ("wlan0", "192.168.9.9"), ("eth0", "10.1.0.7")]
    assert netinfo.nearest_interface(ifaces, "10.1.0.5") == "eth0"
    assert netinfo.nearest_interface([("lo", "127.0.0.1")], "10.1.0.5") is None
    assert all(a.count(".") == 3 for a in netinfo.ipv4_addresses())


def test_mpirun_commands_for_open_mpi_and_mpich():
    o = options.parse(["-np", "3", "-H", "n1:2,n2:2", "--mpi", "--mpi-args", "--mca foo 1",
                       "--ssh-command", "/lab/nsrsh", "--network-interfaces", "eth0",
                       "python", "t.py"])
    env = {"HOROVOD_FUSION_THRESHOLD": "1", "PATH": "/bin", "HOME": "/root", "GLOO_X": "y"}
    ompi = mpilib.command("mpirun", ("openmpi", 5), o, env, is_root=True)
    assert ompi[:3] == ["mpirun", "-np", "3"]
    for flags in (["--allow-run-as-root"], ["--oversubscribe"], ["--bind-to", "none"],
                  ["-H", "n1:2,n2:2"], ["--output", "tag"], ["--mca", "plm_ssh_agent",
                  "/lab/nsrsh"], ["--mca", "btl_tcp_if_include", "eth0"],
                  ["-x", "HOROVOD_FUSION_THRESHOLD"], ["-x", "PATH"], ["-x", "GLOO_X"]):
        assert any(ompi[i:i + len(flags)] == flags for i in range(len(ompi))), (flags, ompi)
    assert "HOME" not in ompi and ompi[-4:] == ["--mca", "foo", "1", "python", "t.py"][-4:]
    assert "--allow-run-as-root" not in mpilib.command("mpirun", ("openmpi", 5), o, env, False)
    assert "--prtemca" not in ompi  # no session directory of hvdrun's own across hosts
    own = mpilib.command("mpirun", ("openmpi", 5), o, env, False, session_base="/tmp/s")
    flags = ["--prtemca", "prte_tmpdir_base", "/tmp/s"]
    assert any(own[i:i + 3] == flags for i in range(len(own))), own
    assert ["--mca", "orte_tmpdir_base", "/tmp/s"] == mpilib.session_flags(
        ("openmpi", 4), "/tmp/s", [])
    assert mpilib.session_flags(("openmpi", 5), "/tmp/s", ["--prtemca", "prte_tmpdir_base",
                                                           "/mine"]) == []
    o.output_filename = "/tmp/out"
    assert ["--output", "tag,dir=/tmp/out"] == \
        [a for a in mpilib.command("m", ("openmpi", 5), o, env, False) if "tag" in a or
         a == "--output"]
    assert "--output-filename" in mpilib.command("m", ("openmpi", 4), o, env, False)

    hydra = mpilib.command("mpiexec", ("mpich", 4), o, env, is_root=True)
    assert hydra[:5] == ["mpiexec", "-np", "3", "-hosts", "n1:2,n2:2"]
    for flags in (["-genv", "HOROVOD_FUSION_THRESHOLD", "1"], ["-genv", "PATH", "/bin"],
                  ["-launcher", "ssh", "-launcher-exec", "/lab/nsrsh"], ["-iface", "eth0"],
                  ["-outfile-pattern", "/tmp/out/rank.%r/stdout"]):
        assert any(hydra[i:i + len(flags)] == flags for i in range(len(hydra))), (flags, hydra)
    assert "--allow-run-as-root" not in hydra and "-x" not in hydra and "--bind-to" not in hydra
    assert hydra[-2:] == ["python", "t.py"]

    assert mpilib.flavour("mpirun (Open MPI) 5.0.11\n\nReport bugs to ...") == ("openmpi", 5)
    assert mpilib.flavour("HYDRA build details:\n    Version:  4.1.2\n") == ("mpich", 4)
    with pytest.raises(mpilib.MPIError, match="cannot tell which MPI"):
        mpilib.flavour("something else 1.0")


# --- local ranks ---------------------------------------------------------------------------
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["gloo", "mpi"])
def test_np_1_to_4_environment_seen_by_each_rank(mode, tools):
    for np in (1, 2, 3, 4):
        rc, out, err = hvdrun(["-np", str(np), f"--{mode}", "--fusion-threshold-mb", "2",
                               "--log-level", "info", sys.executable, tools["tool"], "env", "-"])
        assert rc == 0, err
        seen = _lines(out, "ENV ")
        assert len(seen) == np, out
        by_rank = {}
        for line in out.splitlines():  # each line is tagged with the rank that printed it
            if "ENV " in line:
                tag, _, body = line.partition("ENV ")
                by_rank[tag] = json.loads(body)
        for rank in range(np):
            env = by_rank[f"[{rank}]<stdout>:" if mode == "gloo" else f"[1,{rank}]<stdout>: "]
            assert env["HOROVOD_FUSION_THRESHOLD"] == str(2 * 2 ** 20)
            assert env["HOROVOD_LOG_LEVEL"] == "info"
            if mode == "gloo":
                assert {k: env[k] for k in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK",
                                            "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK",
                                            "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME",
                                            "HOROVOD_CPU_OPERATIONS",
                                            "HOROVOD_GLOO_RENDEZVOUS_ADDR")} == {
                    "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(np),
                    "HOROVOD_LOCAL_RANK": str(rank), "HOROVOD_LOCAL_SIZE": str(np),
                    "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1",
                    "HOROVOD_HOSTNAME": "localhost", "HOROVOD_CPU_OPERATIONS": "gloo",
                    "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1"}
                assert int(env["HOROVOD_GLOO_RENDEZVOUS_PORT"]) > 0
            else:
                assert env["OMPI_COMM_WORLD_RANK"] == str(rank)
                assert env["OMPI_COMM_WORLD_SIZE"] == str(np)
                assert "HOROVOD_RANK" not in env
        ports = {e.get("HOROVOD_GLOO_RENDEZVOUS_PORT") for e in seen}
        assert len(ports) == 1  # one rendezvous point for all ranks


@pytest.mark.timeout(60)
def test_output_prefixed_per_rank_and_written_to_files(tools, tmp_path):
    rc, out, err = hvdrun(["-np", "2", "--output-filename", str(tmp_path / "logs"),
                           sys.executable, tools["tool"], "output", "-"])
    assert rc == 0, err
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:out {rank}\n" in out
        assert f"[{rank}]<stderr>:err {rank}\n" in err
        # a progress bar's carriage returns start a new prefixed line; a last line without a
        # newline is still printed. (The '\r' before "bar 50%" ends the line "out" is on: another
        # rank's whole line may come between the two, so it is not part of the checked string.)
        assert f"[{rank}]<stdout>:bar {rank} 50%\r[{rank}]<stdout>:bar {rank} 100%\n" in out
        assert f"[{rank}]<stdout>:tail {rank}\n" in out
        folder = tmp_path / "logs" / f"rank.{rank}"
        assert (folder / "stdout").read_bytes().decode() == \
            f"out {rank}\n\rbar {rank} 50%\rbar {rank} 100%\ntail {rank}"
        assert (folder / "stderr").read_bytes().decode() == f"err {rank}\n"
    pieces = [line for line in out.splitlines() if line]  # splits at '\r' too
    assert len(pieces) == 8 and all(line.startswith(("[0]", "[1]")) for line in pieces), out


# --- failures and signals ------------------------------------------------------------------
def _pids(folder, np):
    return [int((folder / f"pid.{r}").read_text()) for r in range(np)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["gloo", "mpi"])
def test_failing_rank_stops_the_others(mode, tools, tmp_path):
    start = time.monotonic()
    rc, out, err = hvdrun(["-np", "4", f"--{mode}", sys.executable, tools["tool"], "wait",
                           str(tmp_path)], FAIL_RANK="2", FAIL_CODE="7")
    took = time.monotonic() - start
    assert rc == 7, err
    if mode == "gloo":
        assert "hvdrun: rank 2 (host localhost) exited with code 7; stopping the other ranks" \
            in err
    else:  # mpirun names the rank itself
        assert "Exit code:    7" in err and "hvdrun: mpirun exited with code 7" in err
    pids = _pids(tmp_path, 4)
    _wait_for(lambda: all(_gone(p) for p in pids), 5, "every rank to end")
    assert took < 20, took


@pytest.mark.timeout(60)
def test_killed_mpirun_leaves_no_session_directory(tmp_path):
    """Open MPI keeps $TMPDIR/ompi.<mpirun's pid> while it runs; one left behind by a killed
    mpirun stops the next mpirun that gets the same pid from starting.  Here the rank kills
    mpirun (its parent) outright, so Open MPI cannot clean up: hvdrun must."""
    killer = tmp_path / "kill_parent.py"
    parent = tmp_path / "parent"
    killer.write_text("import os, signal, sys\n"
                      "with open(sys.argv[1], 'w') as f:\n"
                      "    f.write(open(f'/proc/{os.getppid()}/comm').read().strip())\n"
                      "os.kill(os.getppid(), signal.SIGKILL)\n")
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    rc, out, err = hvdrun(["-np", "1", "--mpi", sys.executable, str(killer), str(parent)],
                          TMPDIR=str(tmpdir))
    assert parent.read_text() in ("prterun", "mpirun"), (out, err)
    assert rc != 0 and "hvdrun: mpirun was killed by signal 9 (SIGKILL)" in err, err
    assert sorted(p.name for p in tmpdir.iterdir()) == [], err


@pytest.mark.timeout(60)
def test_ctrl_c_and_sigterm_reach_every_rank(tools, tmp_path):
    """Ranks on this host and on an ssh 'host'; rank 1 ignores SIGINT and is killed after the
    grace period.  Even when hvdrun itself is killed (SIGKILL), its ranks end."""
    for signum, hosts, np in ((signal.SIGINT, "localhost:2,hostB:2", 4),
                              (signal.SIGTERM, "hostA:2", 2),
                              (signal.SIGKILL, "localhost:1,hostB:1", 2)):
        folder = tmp_path / signum.name
        folder.mkdir()
        proc = subprocess.Popen(HVDRUN + ["-H", hosts, "--ssh-command", tools["ssh"],
                                          sys.executable, tools["tool"], "wait", str(folder)],
                                env=_env(IGNORE_INT="1"), cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        _wait_for(lambda: all((folder / f"pid.{r}").exists() for r in range(np)), 30,
                  "every rank to start")
        pids = _pids(folder, np)
        start = time.monotonic()
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=20)
        took = time.monotonic() - start
        if signum == signal.SIGKILL:
            assert proc.returncode == -signal.SIGKILL
        else:
            assert proc.returncode == 128 + signum, err
            assert f"hvdrun: got {signum.name}: passing it to the ranks" in err
        _wait_for(lambda: all(_gone(p) for p in pids), 5, "every rank to end")
        assert took < 10, took
        if signum == signal.SIGINT:  # Python's KeyboardInterrupt on the ranks that take it
            for rank in (0, 2, 3):
                assert f"[{rank}]<stderr>:KeyboardInterrupt" in err, err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["gloo", "mpi"])
def test_rank_that_never_starts_fails_the_start(mode, tools):
    start = time.monotonic()
    rc, out, err = hvdrun(["-np", "2", f"--{mode}", "--start-timeout", "2", sys.executable,
                           tools["hvd"]], HANG_RANK="1")
    took = time.monotonic() - start
    assert rc == 1, err
    assert ("hvdrun: rank(s) 1 (host localhost) did not reach hvd.init() within "
            "--start-timeout 2 s of the first rank that did; stopping all ranks") in err, err
    assert took < 25, took


@pytest.mark.timeout(60)
def test_unreachable_host_reported_before_anything_starts(tools, tmp_path):
    rc, out, err = hvdrun(["-H", "hostA:1,down1:1,down2:1", "--ssh-command", tools["ssh"],
                           sys.executable, tools["tool"], "wait", str(tmp_path)])
    assert rc == 1
    assert "hvdrun: cannot reach down1: " in err and "down2: " in err, err
    assert "Could not resolve hostname down1" in err
    assert "hostA" not in err and list(tmp_path.iterdir()) == []  # no rank was started


# --- real horovod_ext ranks -----------------------------------------------------------------
def _check_results(results, np, hostnames, mpi):
    assert sorted(r["rank"] for r in results) == list(range(np))
    total = [float(i * sum(range(1, np + 1))) for i in range(6)]
    for r in results:
        host = hostnames[r["rank"]]
        same = [i for i, h in enumerate(hostnames) if h == host]
        hosts = list(dict.fromkeys(hostnames))
        assert (r["size"], r["local_rank"], r["local_size"], r["cross_rank"], r["cross_size"],
                r["mpi"]) == (np, same.index(r["rank"]), len(same), hosts.index(host),
                              len(hosts), mpi)
        assert r["sum"] == pytest.approx(total, abs=1e-12)
        assert r["avg"] == pytest.approx([t / np for t in total], abs=1e-12)
        assert r["gathered"] == list(range(np))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["gloo", "mpi"])
def test_allreduce_through_hvdrun(mode, tools):
    """Also: two ranks on this host without OMP_NUM_THREADS share its cores (torch would give
    each all of them); with OMP_NUM_THREADS set (under MPI here), the ranks keep that."""
    chosen = None if mode == "gloo" else "2"
    rc, out, err = hvdrun(["-np", "2", f"--{mode}", sys.executable, tools["hvd"]], timeout=100,
                          OMP_NUM_THREADS=chosen)
    assert rc == 0, err
    results = _lines(out, "RESULT ")
    _check_results(results, 2, ["h"] * 2, mode == "mpi")
    cores = len(os.sched_getaffinity(0))
    expected = 2 if chosen else max(1, cores // 2)
    assert [r["threads"] for r in results] == [expected] * 2, (cores, results)


def test_share_of_cores():
    from horovod_ext.engine.cpu_threads import share_of_cores
    assert share_of_cores(2, 16, 16) == 8
    assert share_of_cores(3, 16, 16) == 5
    assert share_of_cores(4, 2, 2) == 1    # more ranks than cores: one thread each
    assert share_of_cores(4, 3, 16) == 3   # bound by the launcher to 3 cores: all of them


@pytest.mark.timeout(120)
def test_two_hosts_through_a_substitute_ssh_command(tools):
    rc, out, err = hvdrun(["-H", "hostA:2,hostB:2", "--ssh-command", tools["ssh"], "--verbose",
                           sys.executable, tools["hvd"]], timeout=100)
    assert rc == 0, err
    assert "hvdrun: 4 ranks on hostA:2, hostB:2; rendezvous " in err
    assert f"hvdrun: rank 3 (host hostB): {tools['ssh']} hostB ..." in err
    _check_results(_lines(out, "RESULT "), 4, ["hostA", "hostA", "hostB", "hostB"], False)


@pytest.mark.timeout(120)
def test_readme_example_and_check_build(tools):
    rc, out, err = hvdrun(["-np", "2", sys.executable, "examples/fashion_mnist.py",
                           "--max-train", "2000"], timeout=100)
    assert rc == 0, err
    accuracy = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines()
                if line.startswith("[0]<stdout>:test accuracy: ")]
    assert len(accuracy) == 1 and accuracy[0] > 0.5, out
    assert "[0]<stderr>:epoch 1/1: 100%" in err, err  # the progress bar, prefixed
    rc, out, err = hvdrun(["--check-build"])
    assert rc == 0, err
    for line in ("Available Controllers:", "    [X] MPI", "    [X] Gloo", "    [ ] NCCL",
                 "    [X] average", "    [X] sum"):
        assert line + "\n" in out, out
    from horovod_ext.backends.bootstrap import LAUNCH_ORDER
    order = out.split("hvd.init() finds its world from, in this order:\n")[1].splitlines()
    assert [line.strip().split("   <-")[0] for line in order[:len(LAUNCH_ORDER)]] == [
        description for _, description in LAUNCH_ORDER], out
    assert "a single process   <- this process" in out, out
