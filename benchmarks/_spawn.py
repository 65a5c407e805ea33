"""Start benchmark ranks: local processes over Gloo, mpirun, or hosts of the network lab.

Benchmarks only use the public API inside the ranks; this module starts processes the way a
launcher would (HOROVOD_* variables for Gloo, mpirun for MPI, `ip netns exec` for lab hosts) and
holds what the benchmarks share: timing in blocks, reports, options.
"""
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# Benchmarks are named after what they measure (adasum.py, onebit.py, slamb.py), which are also
# package names: with this folder first on sys.path, `import adasum` would find the script.
# Every benchmark imports this module first, so it takes the folder off the path for them.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
if REPO not in sys.path:
    sys.path.insert(0, REPO)
LAB = os.path.join(REPO, "tools", "netlab.sh")


def free_port() -> int:
    from horovod_ext.launch.netinfo import free_port as below_ephemeral
    return below_ephemeral("127.0.0.1")


def _clean_env(extra: Dict[str, str]) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HOROVOD_", "OMPI_", "PMI", "PMIX"))
           and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _wait_all(procs, timeout):
    try:
        for p in procs:
            p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        raise RuntimeError(f"benchmark ranks did not finish within {timeout} s")
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
    bad = [i for i, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise RuntimeError(f"benchmark ranks {bad} failed (exit codes "
                           f"{[procs[i].returncode for i in bad]})")


def run_gloo(argv: Sequence[str], np: int, env: Optional[Dict[str, str]] = None,
             hosts: Optional[List[str]] = None, timeout: float = 1200,
             hostnames: Optional[List[str]] = None):
    """``np`` local ranks over Gloo; ``hosts`` (one per rank) names lab namespaces to run in;
    ``hostnames`` (one per rank, without ``hosts``) groups loopback ranks into pretend nodes
    through HOROVOD_HOSTNAME."""
    port = free_port()
    addr = "127.0.0.1"
    if hosts:
        addr = "10.200.0.1"
    procs = []
    for rank in range(np):
        e = _clean_env(dict(env or {}))
        e.update(HOROVOD_RANK=str(rank), HOROVOD_SIZE=str(np), HOROVOD_CPU_OPERATIONS="gloo",
                 HOROVOD_GLOO_RENDEZVOUS_ADDR=addr, HOROVOD_GLOO_RENDEZVOUS_PORT=str(port))
        cmd = [sys.executable] + list(argv)
        if hostnames:
            e["HOROVOD_HOSTNAME"] = hostnames[rank]
        if hosts:
            e.update(HOROVOD_HOSTNAME=hosts[rank], GLOO_SOCKET_IFNAME="eth0",
                     HOROVOD_GLOO_IFACE="eth0")
            cmd = ["ip", "netns", "exec", hosts[rank]] + cmd
        procs.append(subprocess.Popen(cmd, env=e, cwd=REPO, start_new_session=True))
    _wait_all(procs, timeout)


def mpirun_binary() -> str:
    found = shutil.which("mpirun") or os.path.join(os.path.dirname(sys.executable), "mpirun")
    if not os.path.exists(found):
        raise RuntimeError("mpirun not found: pip install -e .[mpi]")
    return found


def run_mpi(argv: Sequence[str], np: int, env: Optional[Dict[str, str]] = None,
            timeout: float = 1200, lab: bool = False):
    """``np`` ranks under mpirun; ``lab``: across the hosts of the running lab (ranks dealt
    to the hosts in turn, TCP over the lab's links)."""
    e = _clean_env(dict(env or {}))
    e["HOROVOD_CPU_OPERATIONS"] = "mpi"
    extra = ["HOROVOD_CPU_OPERATIONS"]
    if np > (os.cpu_count() or 1):
        # More ranks than cores (the lab's hosts share this machine's): a rank that busy-polls
        # while it waits takes the core from the rank it waits for.  Without this, a flat
        # allreduce of 4 ranks on 2 cores ran 10-20x slower than its wire time.
        e["OMPI_MCA_mpi_yield_when_idle"] = "1"
        extra.append("OMPI_MCA_mpi_yield_when_idle")
    if lab:
        e["MPIRUN"] = mpirun_binary()
        cmd = [LAB, "mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(np)]
    else:
        cmd = [mpirun_binary(), "--oversubscribe", "--bind-to", "none", "-np", str(np)]
    if os.geteuid() == 0 and not lab:
        cmd.append("--allow-run-as-root")
    for k in ("PYTHONPATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED", *extra, *(env or {}).keys()):
        cmd += ["-x", k]
    proc = subprocess.Popen(cmd + [sys.executable] + list(argv), env=e, cwd=REPO,
                            start_new_session=True)
    _wait_all([proc], timeout)


@contextlib.contextmanager
def lab(hosts: int, rate: str):
    """An emulated cluster from tools/netlab.sh, always taken down again (also on Ctrl-C).
    ``rate``: a link rate ("1gbit"), or a rate and an added round trip ("100mbit+20ms")."""
    if os.geteuid() != 0:
        raise RuntimeError("the network lab needs root")
    if not os.path.exists(LAB):
        raise RuntimeError(f"network lab not found at {LAB}")
    subprocess.run([LAB, "down"], check=False, capture_output=True)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        rate, _, round_trip = rate.partition("+")
        subprocess.run([LAB, "up", str(hosts), rate], check=True, capture_output=True)
        if round_trip:
            subprocess.run([LAB, "delay", round_trip], check=True, capture_output=True)
        yield [f"nl-{i}" for i in range(hosts)]
    finally:
        subprocess.run([LAB, "down"], check=False, capture_output=True)
        signal.signal(signal.SIGTERM, previous)


def nic_tx_bytes(dev: str = "eth0") -> int:
    """Bytes sent by ``dev`` of this process's network namespace (0 if it has none)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == dev:
                return int(counters.split()[8])
    return 0


def by_link_rate(settings: Sequence[str], rate_of):
    """Yield the names of ``settings`` grouped by link rate (``rate_of(name)``: "1gbit",
    "100mbit" or None for loopback), with the lab of 2 hosts up at that rate while its group
    runs; says which one starts."""
    groups: Dict[Optional[str], List[str]] = {}
    for name in settings:
        groups.setdefault(rate_of(name), []).append(name)
    done = 0
    for rate, names in groups.items():
        with lab(2, rate) if rate else contextlib.nullcontext():
            for name in names:
                done += 1
                print(f"\n[{done}/{len(settings)}] {name} ...", flush=True)
                yield name


def plot_if_possible(draw, *args) -> None:
    """``draw(*args)`` where matplotlib is installed; else say how to get it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: no plots (pip install -e .[examples])")
        return
    draw(*args)


def run_collect(kind: str, argv: Sequence[str], np: int, env: Optional[Dict[str, str]] = None,
                hosts: Optional[List[str]] = None, hostnames: Optional[List[str]] = None,
                timeout: float = 1200):
    """Run a benchmark worker (``argv`` takes ``--result PATH``) and return the JSON that rank 0
    wrote there.  ``hosts``: the lab host of each rank (MPI: a list of one name, repeated, deals
    the ranks to the hosts in turn)."""
    import json
    import tempfile
    fd, result = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        argv = list(argv) + ["--result", result]
        if kind == "mpi":
            env = dict(env or {})
            if hosts and len(set(hosts)) > 1 and hosts == sorted(hosts):
                # ranks placed host by host, as the list has them (same count on each)
                env["NL_SLOTS"] = str(hosts.count(hosts[0]))
            run_mpi(argv, np, env, timeout=timeout, lab=bool(hosts))
        else:
            run_gloo(argv, np, env, hosts=hosts, hostnames=hostnames, timeout=timeout)
        with open(result) as f:
            return json.load(f)
    finally:
        os.unlink(result)


# Two hosts, on loopback (ranks posing as hosts) or in the lab at a rate, with 1 or 2 ranks each:
# the settings of the benchmarks that train across hosts.  name: (where, rate, ranks per host);
# a rate may carry an added round trip ("100mbit+20ms": a link within a region; "10mbit+100ms":
# across continents).
LINK_SETTINGS = {
    "loopback-2x1": ("loopback", None, 1), "loopback-2x2": ("loopback", None, 2),
    "lab-1gbit-2x1": ("lab", "1gbit", 1), "lab-1gbit-2x2": ("lab", "1gbit", 2),
    "lab-100mbit-2x1": ("lab", "100mbit", 1), "lab-100mbit-2x2": ("lab", "100mbit", 2),
    "lab-100mbit-20ms-2x1": ("lab", "100mbit+20ms", 1),
    "lab-100mbit-20ms-2x2": ("lab", "100mbit+20ms", 2),
    "lab-10mbit-100ms-2x1": ("lab", "10mbit+100ms", 1),
    "lab-10mbit-100ms-2x2": ("lab", "10mbit+100ms", 2)}
# What a benchmark runs unless told (--settings): the datacenter-like links.  The wide-area ones
# take many times longer (a 10 Mbit/s step moves 100x slower) and are asked for by name.
LAN_SETTINGS = [name for name, (_, rate, _) in LINK_SETTINGS.items() if "+" not in (rate or "")]


def run_on(setting: str, argv: Sequence[str], env: Optional[Dict[str, str]] = None,
           timeout: float = 1200):
    """``run_collect`` of a Gloo worker on the two hosts of ``setting`` (LINK_SETTINGS): the
    running lab's, or loopback ranks grouped into pretend hosts."""
    where, _, per_node = LINK_SETTINGS[setting]
    np = 2 * per_node
    if where == "lab":
        return run_collect("gloo", argv, np, env=env, timeout=timeout,
                           hosts=[f"nl-{i // per_node}" for i in range(np)])
    return run_collect("gloo", argv, np, env=env, timeout=timeout,
                       hostnames=[f"node{i // per_node}" for i in range(np)])


def per_call(fn, calls, barrier, gap_s=0.0):
    """Seconds per call over ``calls`` calls started together on every rank; with ``gap_s``,
    each call follows that much busy work (not counted), as a training step computes between
    its reductions.  One call first, not counted: the method before this one (eight buffers
    for hvd_x8) has evicted this one's buffer from the caches, and at 16 MiB that first cold
    call alone would add ~10% to a block of eight."""
    fn()
    barrier()
    clock = time.perf_counter
    t0 = clock()
    for _ in range(calls):
        if gap_s:
            until = clock() + gap_s
            while clock() < until:
                pass
        fn()
    return (clock() - t0) / calls - gap_s


def median_per_call(fn, calls: int, blocks: int, barrier):
    """Median over ``blocks`` samples of one function's seconds per call (``per_call``), and
    the samples."""
    samples = [per_call(fn, calls, barrier) for _ in range(blocks)]
    return statistics.median(samples), samples


def interleaved_blocks(methods, calls: int, blocks: int, barrier):
    """Seconds per call of each method (name -> function), ``blocks`` samples each: a sample
    is ``calls`` back-to-back calls started together on every rank (``per_call``), and the
    methods take turns block by block, so that drift on this shared machine hits them alike.
    Every rank must pass the same ``calls`` and ``blocks``."""
    samples = {name: [] for name in methods}
    for _ in range(blocks):
        for name, fn in methods.items():
            samples[name].append(per_call(fn, calls, barrier))
    return samples


def sibling(name: str):
    """Another benchmark of this folder as a module (the folder is off sys.path: see above)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # its first lines put this folder back on the path (the import of this module is cached)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
    return module


def parser(doc: str, out_name: str, sizes=None):
    """The options every benchmark has: the hidden worker ones, --quick, --out (JSON under
    benchmarks/results/ by default) and, given default ``sizes``, --sizes."""
    import argparse
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    if sizes is not None:
        p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=sizes,
                       help="bytes, comma separated")
    p.add_argument("--quick", action="store_true", help="a reduced run")
    p.add_argument("--out", default=os.path.join(HERE, "results", out_name))
    return p


def rounds_arguments(doc: str, out_name: str):
    """The options of a benchmark that times training steps of synthetic.py's models in rounds
    (timeline_overhead.py, finite_guard.py): parsed, ``models`` a list, --quick applied."""
    p = parser(doc, out_name)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--models", default="mlp,transformer")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    args.models = args.models.split(",") if isinstance(args.models, str) else args.models
    if args.quick and not args.worker:
        args.steps, args.rounds, args.warmup = 5, 2, 2
    return args


def rounds_worker_argv(script: str, args) -> List[str]:
    """The worker command line of such a benchmark, carrying its options."""
    return [os.path.abspath(script), "--worker", "--models", ",".join(args.models),
            "--batch", str(args.batch), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--rounds", str(args.rounds)]


def choices(parser, value: str, known, what: str) -> List[str]:
    """The comma-separated names in ``value``, all of them in ``known`` (else the parser's
    error names the unknown ones)."""
    chosen = value.split(",")
    unknown = [c for c in chosen if c not in known]
    if unknown:
        parser.error(f"unknown {what} {unknown}: choose from {', '.join(known)}")
    return chosen


def human(n) -> str:
    """A byte count as 4 KiB, 16 MiB, ..."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:g} {unit}"
        n /= 1024
    return f"{n:g} TiB"


def provenance() -> Dict[str, str]:
    """The commit (with "+changes" when tracked files differ from it) and today's date.  A copy
    of a checkout without its history (a GPU machine's, say) names its commit in
    BENCHMARK_COMMIT, which is then recorded as given."""
    import datetime
    given = os.environ.get("BENCHMARK_COMMIT")
    if given:
        return {"commit": given, "commit_from": "BENCHMARK_COMMIT",
                "date": datetime.date.today().isoformat()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           cwd=REPO, capture_output=True, text=True).stdout.strip()
    return {"commit": commit + ("+changes" if dirty else ""),
            "date": datetime.date.today().isoformat()}


def write_report(path: str, report) -> None:
    """Write a benchmark's JSON report, with the commit and date it was made on, and say
    where."""
    import json
    if isinstance(report, dict) and "commit" not in report:
        report = {**provenance(), **report}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {path}")


def start_beside_ddp():
    """In a worker: torch.distributed's default Gloo group for DDP, on the port the launch put
    in BENCH_DDP_PORT (the job's own, so DDP keeps it while horovod_ext is shut down), then
    ``hvd.init()`` and as many threads as this machine has cores per rank: every rank of a
    benchmark runs here, those of pretend hosts and lab hosts too, and more threads than cores
    would leave each rank's step to the scheduler.  Returns hvd."""
    import torch
    import torch.distributed as dist
    import horovod_ext.torch as hvd
    rank, size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=size,
                            init_method=f"tcp://{os.environ['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:"
                                        f"{os.environ['BENCH_DDP_PORT']}")
    hvd.init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.size()))
    return hvd


def finish_beside_ddp(hvd, results, path: str) -> None:
    """Rank 0 writes ``results`` to ``path`` (JSON); both runtimes shut down."""
    import json
    import torch.distributed as dist
    if hvd.rank() == 0:
        with open(path, "w") as f:
            json.dump(results, f)
    hvd.shutdown()
    dist.destroy_process_group()


def time_model_syncs(hvd, opt, count: int) -> Dict[str, float]:
    """SLAMB's model sync (``opt.average_parameters()``) ``count`` times in a row, inside a
    worker: its median time in seconds and the bytes it sends per sync."""
    syncs, before = [], opt.bytes_sent
    for _ in range(count):
        hvd.barrier()
        t0 = time.perf_counter()
        opt.average_parameters()
        syncs.append(time.perf_counter() - t0)
    return {"model_sync_s": statistics.median(syncs),
            "model_sync_bytes": (opt.bytes_sent - before) / count}


def read_report(path: str):
    """A benchmark's JSON report, as ``write_report`` wrote it (for ``--plot``)."""
    import json
    with open(path) as f:
        return json.load(f)
