"""Two ranks' sum: Gloo's ring allreduce against one exchange of whole tensors, per link.

    python benchmarks/pair_exchange.py                        # loopback only
    python benchmarks/pair_exchange.py --links loopback,1gbit,1gbit+20ms,100mbit+20ms  # (root)

Why the communicator sums small buffers of a two-rank Gloo group by an exchange (send the whole
tensor, receive the peer's, add): Gloo's ring takes two steps for two ranks, and each step waits
for the peer's go-ahead, so it pays two round trips where the exchange pays one, for the same
bytes.  Raw torch.distributed on both sides, beside horovod_ext's communicator, which picks one
of the two by size and by how far apart the pair is (backends/pair_exchange.py).  Per size, the
three take turns in 5 blocks of back-to-back calls started by a barrier; the median of the blocks is
reported.  Links are benchmarks/_spawn.lab's (a rate, or a rate and an added round trip); each
lab link puts one rank on each of two hosts.  Prints a table and writes JSON.
"""
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _spawn  # noqa: E402
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

SIZES = [1 << 10, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24]


def worker(args):
    import torch
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    peer = 1 - rank

    def ring(t):
        dist.all_reduce(t)

    def exchange(t):
        other = torch.empty_like(t)
        works = [dist.irecv(other, peer), dist.isend(t, peer)]
        for w in works:
            w.wait()
        t.add_(other)

    from horovod_ext.backends.torch_dist import TorchCommunicator
    comm = TorchCommunicator(range(2), dist.group.WORLD)
    contenders = (("ring", ring), ("exchange", exchange), ("horovod_ext", comm.allreduce))
    rows = []
    for size in SIZES:
        t = torch.zeros(size // 4)
        calls = max(3, min(50, int(args.budget * 4e6 / size)))
        samples = {name: [] for name, _ in contenders}
        for _, fn in contenders:
            fn(t)
        for _ in range(5):
            for name, fn in contenders:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn(t)
                samples[name].append((time.perf_counter() - t0) / calls * 1000)
        rows.append({"bytes": size, "calls": calls, "ring_ms": samples["ring"],
                     "exchange_ms": samples["exchange"],
                     "horovod_ext_ms": samples["horovod_ext"]})
    dist.destroy_process_group()
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"rows": rows, "probe_s": comm.pair.probe_s,
                       "exchange_max_bytes": comm.pair.max_bytes}, f)


def run_link(link, args):
    """The worker's result on ``link`` (its rows, its pair's probe time and exchange limit):
    loopback ranks, or one rank on each of two lab hosts."""
    path = os.path.join("/tmp", f"pair_exchange_{os.getpid()}.json")
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--result", path,
            "--budget", str(args.budget)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=_spawn.REPO)
    if link == "loopback":
        port = str(_spawn.free_port())
        procs = [subprocess.Popen(argv, env=dict(env, RANK=str(r), MASTER_ADDR="127.0.0.1",
                                                 MASTER_PORT=port)) for r in range(2)]
    else:
        procs = [subprocess.Popen([_spawn.LAB, "launch", *argv], env=env)]
    for p in procs:
        if p.wait(timeout=1200) != 0:
            raise RuntimeError(f"{link}: a rank failed")
    with open(path) as f:
        result = json.load(f)
    os.unlink(path)
    return result


def main():
    p = _spawn.parser(__doc__, "pair_exchange.json")
    p.add_argument("--links", default="loopback")
    p.add_argument("--budget", type=float, default=0.2,
                   help="calls per block: about this many seconds of 1 Gbit/s")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    report = dict(_spawn.provenance(), benchmark="pair_exchange", links={})
    for link in args.links.split(","):
        with _spawn.lab(2, link) if link != "loopback" else contextlib.nullcontext():
            result = run_link(link, args)
        report["links"][link] = result
        print(f"\n{link}: a one-value exchange {result['probe_s'] * 1e3:.2f} ms, horovod_ext "
              f"exchanges up to {_spawn.human(result['exchange_max_bytes'])}\n"
              f"{'bytes':>10} {'ring ms':>9} {'exchange ms':>12} {'ratio':>6} "
              f"{'horovod_ext ms':>15}")
        for row in result["rows"]:
            ring, exch, ours = (statistics.median(row[k + "_ms"])
                                for k in ("ring", "exchange", "horovod_ext"))
            print(f"{_spawn.human(row['bytes']):>10} {ring:9.3f} {exch:12.3f} {exch / ring:6.2f} "
                  f"{ours:15.3f}", flush=True)
    _spawn.write_report(args.out, report)


if __name__ == "__main__":
    main()
