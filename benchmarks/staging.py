"""A staged allreduce over Gloo against the same allreduce of CPU tensors, by chunks in flight.

    .venv/bin/python benchmarks/staging.py                  # 4, 16 and 64 MiB, np=2
    .venv/bin/python benchmarks/staging.py --quick          # 64 MiB only, fewer blocks

Where the transport cannot read device memory (Gloo; an MPI that is not CUDA-aware), a CUDA
tensor's allreduce goes through pinned host memory chunk by chunk
(``horovod_ext/backends/staging.py``), each chunk a collective of its own.  One after the other,
each chunk pays Gloo's round trips again; ``GLOO_IN_FLIGHT`` chunks' collectives are started at
once instead.  Two local ranks over Gloo, with the in-node shared memory off
(``HOROVOD_SHARED_MEMORY=0``: the transport that carries staged chunks between hosts), each call
``hvd.allreduce_`` Sum, timed from a barrier:

- ``cpu``: CPU tensors, unstaged: the baseline;
- ``staged_N``: the staged tensors with N chunks in flight (1: one after the other).  CUDA
  tensors (``HOROVOD_GPU_OPERATIONS=mpi``) where CUDA is present; elsewhere CPU tensors staged
  as CUDA tensors are (``STAGE_HOST_TENSORS``: their copies to and from the host buffer are
  plain, synchronous memory copies, where a GPU's overlap the collectives);
- ``chunks_N``: the CPU tensor's own chunks, no copies, N in flight: what chunking alone costs
  the transport, on any machine.

The methods take turns block by block; a block is ``--calls`` calls, its time per call the
sample.  Prints each size's medians, spreads and ratios to ``cpu``, and writes JSON (the device,
the commit, the date and every sample).
"""
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _spawn  # noqa: E402
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

MIB = 1 << 20


def worker(args):
    import json
    import torch
    import torch.distributed as dist
    import horovod_ext.torch as hvd
    from horovod_ext.backends import staging
    from horovod_ext.engine import runtime
    hvd.init()
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    world = runtime.state.comms.world
    default_in_flight = staging.GLOO_IN_FLIGHT
    sizes = {}
    for size in args.sizes:
        # zeros: repeated sums leave them as they are (ones doubled each call, up to inf)
        cpu = torch.zeros(size // 4)
        staged = cpu.cuda() if on_gpu else cpu.clone()

        def plain():
            hvd.allreduce_(cpu, op=hvd.Sum, name="bench.staging.cpu")

        def staged_with(depth):
            def call():
                staging.GLOO_IN_FLIGHT = depth
                staging.STAGE_HOST_TENSORS = not on_gpu
                try:
                    hvd.allreduce_(staged, op=hvd.Sum, name="bench.staging.staged")
                    sync()
                finally:
                    staging.STAGE_HOST_TENSORS = False
            return call

        def chunks_with(depth):
            def call():
                waits = []
                for start, stop in staging.chunk_bounds(cpu.numel(), cpu.dtype):
                    waits.append(world._start(dist.all_reduce, cpu[start:stop],
                                              group=world._cpu_group))
                    if len(waits) >= depth:
                        waits.pop(0)()
                for wait in waits:
                    wait()
            return call

        methods = {"cpu": plain}
        methods.update({f"staged_{d}": staged_with(d) for d in args.in_flight})
        methods.update({f"chunks_{d}": chunks_with(d) for d in args.in_flight})
        samples = _spawn.interleaved_blocks(methods, args.calls, args.blocks, hvd.barrier)
        sizes[str(size)] = {name: [s * 1e3 for s in ms] for name, ms in samples.items()}
        staging.GLOO_IN_FLIGHT = default_in_flight
    if hvd.rank() == 0:
        about = {"device": "cuda" if on_gpu else "cpu", "cores": os.cpu_count(),
                 "name": torch.cuda.get_device_name() if on_gpu else "staged CPU tensors",
                 "torch": torch.__version__, "chunk_bytes": staging.CHUNK_BYTES,
                 "gloo_in_flight_default": default_in_flight}
        with open(args.result, "w") as f:
            json.dump({"about": about, "ms": sizes}, f)
    hvd.shutdown()


def print_table(report) -> None:
    about = report["about"]
    print(f"np={report['np']} over Gloo, no shared memory; staged: {about['name']} "
          f"({about['device']}); chunks of {_spawn.human(about['chunk_bytes'])}; "
          f"commit {report['commit']}, {report['date']}")
    for size, methods in report["ms"].items():
        base = statistics.median(methods["cpu"])
        print(f"\n{_spawn.human(int(size))}: median ms (min-max of {len(methods['cpu'])} blocks),"
              f" ratio to cpu")
        for name, ms in methods.items():
            med = statistics.median(ms)
            print(f"  {name:<10} {med:9.2f} ({min(ms):.2f}-{max(ms):.2f}) {med / base:7.3f}")


def main():
    p = _spawn.parser(__doc__, "staging.json", sizes=[4 * MIB, 16 * MIB, 64 * MIB])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--in-flight", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 2, 3, 4], help="chunks in flight, comma separated")
    p.add_argument("--calls", type=int, default=3, help="calls per block")
    p.add_argument("--blocks", type=int, default=9)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.sizes, args.blocks = [64 * MIB], 5
    argv = [os.path.abspath(__file__), "--worker", "--calls", str(args.calls),
            "--blocks", str(args.blocks), "--sizes", ",".join(map(str, args.sizes)),
            "--in-flight", ",".join(map(str, args.in_flight))]
    result = _spawn.run_collect("gloo", argv, args.np, env={
        "HOROVOD_SHARED_MEMORY": "0", "HOROVOD_GPU_OPERATIONS": "mpi"}, timeout=1800)
    report = dict(_spawn.provenance(), benchmark="staging", np=args.np, **result)
    print_table(report)
    _spawn.write_report(args.out, report)


if __name__ == "__main__":
    main()
