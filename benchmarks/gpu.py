"""GPU baseline: copy bandwidth, the 1-bit codec, random-k, optimizer steps, staged allreduce.

    python benchmarks/gpu.py --out DIR             # on a GPU: the whole table, about a minute
    python benchmarks/gpu.py --device cpu --quick  # the same table on the CPU, small sizes

One process (np=1).  Each measurement is timed ``--reps`` times after one warm-up call, the device
synchronised before and after each call; the table shows the median and the min-max spread.  The
issue's targets are ratios, so each row is also a ratio to a baseline measured in the same run:
GB/s against the bandwidth of a plain device copy of the same bytes (the 1-bit codec: at least
0.5x), optimizer steps against torch's fused Adam on the same 25M parameters (LAMB, SLAMB: at
most 1.5x).  GB/s counts the bytes of the input once (a copy moves them twice: read and write).

Rows: ``copy`` (``dst.copy_(src)``, --mib MiB of float32); ``onebit_compress`` and
``onebit_decompress`` (``horovod_ext.algorithms.onebit.compress``/``decompress`` of the same
tensor, one scale: the fused kernels on a GPU), and the same ``_unfused`` (the plain torch code,
HOROVOD_FUSED_KERNELS=off); ``randomk_select`` (the shared mask at ``--ratio``:
``random_k_indices``), ``randomk_gather`` (``index_select`` of the selected values) and
``randomk_scatter`` (``index_copy_`` back); ``adasum_pair`` and ``adasum_pair_unfused`` (Adasum of
two such tensors in 100 layers: dot products, then the combine; fused on a GPU, and the plain
torch code); ``adam_fused``, ``adam_foreach``,
``lamb`` (``hvd.Lamb``: the fused kernels on a GPU), ``lamb_unfused`` (its plain torch code),
``onebit_adam_warmup`` (``hvd.OnebitAdam`` before its freeze step) and ``slamb`` (``hvd.SLAMB``,
``overlap=False`` so that its sync is part of the step) on ``--params`` parameters in 1024-wide
matrices with gradients set; ``adam_fused_queued``, ``lamb_queued`` and ``lamb_queued_combo``
(Inductor's ``combo_kernels``): 10 steps queued before one synchronisation, per step, as a training
loop queues them; ``allreduce`` of --allreduce-mib MiB (``hvd.allreduce_``, Sum) on a device tensor
and on a CPU tensor: at np=1 nothing crosses a wire, so this is the engine's own cost per call;
``host_staging``: the same tensor through the staged allreduce of ``horovod_ext.backends.staging``
with no collective (pinned buffer, chunks, copies on two side streams): what staging alone costs.
Two ranks, started by this script over Gloo on
this machine (sharing GPU 0 where it has one), each ``hvd.allreduce_`` Sum of --allreduce-mib MiB:
``allreduce_np2_cpu`` (CPU tensors: in one node, through shared memory), ``allreduce_np2_staged``
(CUDA tensors with HOROVOD_GPU_OPERATIONS=mpi: staged through host memory over Gloo; the issue's
target, at most 1.2x the CPU tensors'), and with HOROVOD_SHARED_MEMORY=0 ``allreduce_np2_gloo_cpu``
(CPU tensors over Gloo, the staged path's transport) and ``allreduce_np2_gloo_staged`` (against
it: what staging adds to its transport).

Last, ``fused_against_unfused``: the fused kernels' results against the plain torch code's on
odd sizes (bitwise for signs, values and errors; the scales' and LAMB parameters' largest
relative differences).

Without CUDA it says so and exits 0 (``--device cpu`` runs the table on the CPU).  Writes JSON
(``--out``: a file, or a folder to hold gpu.json) naming the device, torch, CUDA and NCCL
versions, the commit and the date.
"""
import contextlib
import datetime
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _spawn  # noqa: E402  (benchmarks/ is not a package)

import torch  # noqa: E402

MIB = 1024 * 1024
WIDTH = 1024               # optimizer benchmark: parameters are WIDTH-wide matrices


@contextlib.contextmanager
def unfused():
    """The plain torch code instead of the fused kernels (HOROVOD_FUSED_KERNELS=off)."""
    before = os.environ.get("HOROVOD_FUSED_KERNELS")
    os.environ["HOROVOD_FUSED_KERNELS"] = "off"
    try:
        yield
    finally:
        if before is None:
            del os.environ["HOROVOD_FUSED_KERNELS"]
        else:
            os.environ["HOROVOD_FUSED_KERNELS"] = before


def timed_unfused(fn, reps: int, sync):
    with unfused():
        return timed(fn, reps, sync)


def timed(fn, reps: int, sync):
    """Seconds of each of ``reps`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def row(name, what, times, nbytes=None, baseline=None, target=None):
    """One measurement: median and spread in ms, GB/s where it moves ``nbytes``, and the ratio
    to ``baseline`` = (its name, its row) with ``target`` = ("<=" or ">=", value)."""
    median = statistics.median(times)
    out = {"name": name, "what": what, "median_ms": median * 1e3,
           "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3, "reps": len(times)}
    if nbytes is not None:
        out["gb_per_s"] = nbytes / median / 1e9
    if baseline is not None:
        base_name, base = baseline
        # bandwidths compare as rates (higher is better), steps as times (lower is better)
        rates = "gb_per_s" in out and "gb_per_s" in base
        out["ratio"] = (out["gb_per_s"] / base["gb_per_s"] if rates
                        else median * 1e3 / base["median_ms"])
        out["ratio_of"] = f"{base_name} GB/s" if rates else f"{base_name} time"
    if target is not None:
        sign, value = target
        out["target"] = f"{sign} {value}"
        out["meets_target"] = out["ratio"] >= value if sign == ">=" else out["ratio"] <= value
    return out


def bandwidth_rows(args, device, sync):
    """Copy, the 1-bit codec and random-k on one tensor of --mib MiB of float32."""
    from horovod_ext.algorithms.onebit import compress, decompress
    from horovod_ext.algorithms.slamb.mask import random_k_indices
    numel = args.mib * MIB // 4
    nbytes = numel * 4
    x = torch.randn(numel, device=device)
    dst = torch.empty_like(x)
    copy = row("copy", f"{args.mib} MiB float32 device copy", timed(lambda: dst.copy_(x),
                                                                    args.reps, sync), nbytes)
    base = ("copy", copy)
    packed = torch.empty((numel + 7) // 8, dtype=torch.uint8, device=device)
    scales = compress(x, out=packed)[1]
    rows = [copy,
            row("onebit_compress", "1-bit compress (signs + scale)",
                timed(lambda: compress(x, out=packed), args.reps, sync), nbytes, base,
                (">=", 0.5)),
            row("onebit_decompress", "1-bit decompress",
                timed(lambda: decompress(packed, scales, [numel], x.dtype, out=dst),
                      args.reps, sync), nbytes, base, (">=", 0.5)),
            row("onebit_compress_unfused", "1-bit compress, the plain torch code",
                timed_unfused(lambda: compress(x, out=packed), args.reps, sync), nbytes, base),
            row("onebit_decompress_unfused", "1-bit decompress, the plain torch code",
                timed_unfused(lambda: decompress(packed, scales, [numel], x.dtype, out=dst),
                              args.reps, sync), nbytes, base)]
    idx = random_k_indices(numel, args.ratio, 0, 1, "bench", device)
    values = x.index_select(0, idx)
    rows += [row("randomk_select", f"random-k mask, k={args.ratio:g}",
                 timed(lambda: random_k_indices(numel, args.ratio, 0, 1, "bench", device),
                       args.reps, sync), None, base),
             row("randomk_gather", "gather the selected values",
                 timed(lambda: x.index_select(0, idx), args.reps, sync), None, base),
             row("randomk_scatter", "scatter them back",
                 timed(lambda: dst.index_copy_(0, idx, values), args.reps, sync), None, base)]
    return rows + adasum_rows(args, x, base, sync)


def adasum_rows(args, x, base, sync):
    """Adasum of two vectors of --mib MiB in 100 layers (the per-layer dot products, then the
    combine): what runs (the fused kernels on a GPU) and the plain torch code."""
    from horovod_ext.algorithms.adasum.operator import LayerMap, adasum_pair_
    numel = x.numel()
    step = max(1, numel // 100)
    layers = LayerMap([(lo, min(step, numel - lo)) for lo in range(0, numel, step)])
    a, b = x.clone(), x.flip(0).clone()
    what = f"Adasum of two {args.mib} MiB float32 vectors, {layers.count} layers"
    return [row("adasum_pair", what, timed(lambda: adasum_pair_(a, b, layers), args.reps, sync),
                numel * 4, base),
            row("adasum_pair_unfused", f"{what}, the plain torch code",
                timed_unfused(lambda: adasum_pair_(a, b, layers), args.reps, sync), numel * 4,
                base)]


def _parameters(count: int, device):
    """About ``count`` parameters as WIDTH-wide matrices (and a WIDTH bias), gradients set."""
    g = torch.Generator().manual_seed(0)
    rows = max(1, count // WIDTH // 8)
    shapes = [(rows, WIDTH)] * max(1, count // (rows * WIDTH)) + [(WIDTH,)]
    params = []
    for shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=g) * 0.02).to(device))
        p.grad = (torch.randn(shape, generator=g) * 1e-3).to(device)
        params.append(p)
    return params


def fused_checks(device) -> dict:
    """The fused kernels against the plain torch code on this device, on odd sizes and several
    segments: whether signs, decompressed values and compensated errors are bitwise equal, the
    largest relative difference of scales, and of parameters after three LAMB steps."""
    import horovod_ext.torch as hvd
    from horovod_ext.algorithms.onebit.compression import (compensate_compress_, compress,
                                                           decompress, default_workspace)
    out = {}
    for dtype in (torch.float32, torch.float16):
        lengths = [1, 500, 3000, 598] + [300] * 50
        x = torch.randn(sum(lengths), generator=torch.Generator().manual_seed(1)).to(dtype)
        x = x.to(device)

        with unfused():
            bits, scales = compress(x, lengths)
        parts = [(bits, scales), (bits.flip(0), scales * 2)]

        def codec():   # every step from the same inputs: the plain code's signs and scales
            own_bits, own_scales = compress(x, lengths)
            back = decompress(bits, scales, lengths, dtype)
            error, sent = x.clone(), torch.empty_like(bits)
            again = compensate_compress_(error, lengths, sent, default_workspace(), scales, x,
                                         parts, 2)
            return own_bits, own_scales, back, error, sent, again
        fast = codec()
        with unfused():
            plain = codec()
        def rel(a, b):
            return ((a.double() - b.double()).abs() / b.double().abs()).max().item()
        out[f"onebit_{str(dtype)[6:]}"] = {
            "bits_equal": bool(torch.equal(fast[0], plain[0]) and torch.equal(fast[4], plain[4])),
            "values_equal": bool(torch.equal(fast[2], plain[2]) and torch.equal(fast[3], plain[3])),
            "scales_max_rel_diff": max(rel(fast[1], plain[1]), rel(fast[5], plain[5]))}

    def lamb_params():
        params = _parameters(200_000, device)
        opt = hvd.Lamb(params, lr=0.01, weight_decay=0.01)
        for _ in range(3):
            opt.step()
        return params
    fast = lamb_params()
    with unfused():
        plain = lamb_params()
    out["lamb_params_max_rel_diff"] = max(
        ((a - b).abs().max() / b.abs().max()).item() for a, b in zip(fast, plain))
    return out


def optimizer_rows(args, device, sync):
    """One step of each optimizer over the same parameters, as ratios to fused Adam."""
    import horovod_ext.torch as hvd
    makers = [
        ("adam_fused", "torch Adam, fused=True", lambda p: torch.optim.Adam(p, fused=True)),
        ("adam_foreach", "torch Adam, foreach=True",
         lambda p: torch.optim.Adam(p, foreach=True)),
        ("lamb", "hvd.Lamb", lambda p: hvd.Lamb(p)),
        ("lamb_unfused", "hvd.Lamb, the plain torch code", lambda p: hvd.Lamb(p)),
        ("onebit_adam_warmup", "hvd.OnebitAdam, warm-up steps",
         lambda p: hvd.OnebitAdam(p, freeze_step=10 ** 9)),
        ("slamb", "hvd.SLAMB, k=0.1, overlap=False",
         lambda p: hvd.SLAMB(p, ratio=0.1, overlap=False))]
    rows, base = [], None
    for name, what, make in makers:
        params = _parameters(args.params, device)
        opt = make(params)
        n = sum(p.numel() for p in params)
        target = ("<=", 1.5) if name in ("lamb", "slamb") else None
        timer = timed_unfused if name.endswith("_unfused") else timed
        r = row(name, f"{what}, {n / 1e6:.1f}M parameters", timer(opt.step, args.reps, sync),
                None, base, target if base else None)
        base = base or ("adam_fused", r)
        rows.append(r)
        del opt, params
    return rows + back_to_back_rows(args, device, sync)


BACK_TO_BACK = 10   # steps queued without synchronising, as a training loop queues them


def timed_queued(fn, reps: int, sync):
    """Seconds per call of ``fn`` with BACK_TO_BACK calls queued before one synchronisation,
    ``reps`` times: where launching overlaps the device's work, as in training."""
    return [t / BACK_TO_BACK for t in timed(lambda: [fn() for _ in range(BACK_TO_BACK)], reps,
                                            sync)]


@contextlib.contextmanager
def inductor_options(**options):
    """The fused LAMB and SLAMB kernels compiled afresh with these Inductor options added."""
    from horovod_ext.algorithms import compiled, lamb as lamb_module
    from horovod_ext.algorithms.slamb import update as slamb_update
    kept = compiled._OPTIONS, lamb_module.fused_lamb_steps_, slamb_update._fused_updates
    compiled._OPTIONS = {**kept[0], **options}
    lamb_module.fused_lamb_steps_ = compiled.kernel(kept[1].eager)
    slamb_update._fused_updates = compiled.kernel(kept[2].eager)
    try:
        yield
    finally:
        compiled._OPTIONS, lamb_module.fused_lamb_steps_, slamb_update._fused_updates = kept


def back_to_back_rows(args, device, sync):
    """Fused Adam and hvd.Lamb with BACK_TO_BACK steps queued before one synchronisation, per
    step: where launching overlaps the device's work, as in training; and hvd.Lamb so with
    Inductor's combo kernels (several tensors' kernels in one launch), to measure that option."""
    import horovod_ext.torch as hvd
    params = _parameters(args.params, device)
    adam = row("adam_fused_queued", f"torch Adam, fused=True, {BACK_TO_BACK} steps queued",
               timed_queued(torch.optim.Adam(params, fused=True).step, args.reps, sync))
    base = ("adam_fused_queued", adam)
    rows = [adam, row("lamb_queued", f"hvd.Lamb, {BACK_TO_BACK} steps queued",
                      timed_queued(hvd.Lamb(params).step, args.reps, sync), None, base,
                      ("<=", 1.5))]
    with inductor_options(combo_kernels=True):
        rows.append(row("lamb_queued_combo", f"hvd.Lamb, combo kernels, {BACK_TO_BACK} steps "
                        f"queued", timed_queued(hvd.Lamb(params).step, args.reps, sync), None,
                        base, ("<=", 1.5)))
    return rows


def allreduce_rows(args, device, sync):
    """hvd.allreduce_ at np=1 on a device tensor and a CPU tensor; the host staging copies."""
    import horovod_ext.torch as hvd
    numel = args.allreduce_mib * MIB // 4
    on_device = torch.ones(numel, device=device)
    on_host = torch.ones(numel)
    what = f"hvd.allreduce_ {args.allreduce_mib} MiB, np=1"
    rows = [row("allreduce", f"{what}, {device.type} tensor",
                timed(lambda: hvd.allreduce_(on_device, op=hvd.Sum, name="bench.dev"),
                      args.reps, sync))]
    if device.type == "cuda":
        from horovod_ext.backends import staging
        stager = staging.Stager()
        rows.append(row("allreduce_cpu", f"{what}, CPU tensor",
                        timed(lambda: hvd.allreduce_(on_host, op=hvd.Sum, name="bench.cpu"),
                              args.reps, sync), None, ("allreduce", rows[0])))
        rows.append(row("host_staging", f"{args.allreduce_mib} MiB staged to host and back, "
                        f"no collective (staging.Stager.allreduce)",
                        timed(lambda: stager.allreduce(on_device, lambda chunk: None),
                              args.reps, sync), numel * 4))
        rows += staging_np2_rows(args)
    return rows


def staging_rank(out_path: str, mib: int, reps: int, tensors) -> None:
    """One of the two ranks of ``staging_np2_rows``: ``hvd.allreduce_`` Sum of ``mib`` MiB on
    each kind of tensor in ``tensors`` ("cpu", "cuda"), interleaved, each call timed from a
    barrier to its end; rank 0 writes {kind: [seconds]} to ``out_path``."""
    import json
    import horovod_ext.torch as hvd
    hvd.init()
    on_gpu = "cuda" in tensors
    if on_gpu:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    made = {kind: torch.ones(mib * MIB // 4, device=kind) for kind in tensors}
    times = {kind: [] for kind in tensors}
    for rep in range(reps + 1):                 # the first round warms up
        for kind, tensor in made.items():
            hvd.barrier()
            sync()
            t0 = time.perf_counter()
            hvd.allreduce_(tensor, op=hvd.Sum, name=f"bench.np2.{kind}")
            sync()
            if rep:
                times[kind].append(time.perf_counter() - t0)
    if hvd.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(times, f)
    hvd.shutdown()


def staging_np2_rows(args, tensors=("cpu", "cuda")):
    """Two ranks over Gloo, twice (in-node shared memory on, then off): the rows of CPU tensors
    against CUDA tensors staged through host memory (HOROVOD_GPU_OPERATIONS=mpi)."""
    import json
    import tempfile
    measured = {}
    for shm in ("1", "0"):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "times.json")
            code = (f"import sys; sys.path.insert(0, {HERE!r}); import _spawn; "
                    f"_spawn.sibling('gpu').staging_rank({out!r}, {args.allreduce_mib}, "
                    f"{args.reps}, {tuple(tensors)!r})")
            _spawn.run_gloo(["-c", code], 2, timeout=600, env={
                "HOROVOD_GPU_OPERATIONS": "mpi", "HOROVOD_SHARED_MEMORY": shm})
            with open(out) as f:
                measured[shm] = json.load(f)
    what = f"hvd.allreduce_ {args.allreduce_mib} MiB, np=2"
    cpu = row("allreduce_np2_cpu", f"{what}, CPU tensors (shared memory)", measured["1"]["cpu"])
    gloo = row("allreduce_np2_gloo_cpu", f"{what}, CPU tensors over Gloo (no shared memory)",
               measured["0"]["cpu"], None, ("allreduce_np2_cpu", cpu))
    rows = [cpu]
    if "cuda" in tensors:
        rows.append(row("allreduce_np2_staged", f"{what}, CUDA tensors staged over Gloo",
                        measured["1"]["cuda"], None, ("allreduce_np2_cpu", cpu), ("<=", 1.2)))
    rows.append(gloo)
    if "cuda" in tensors:
        rows.append(row("allreduce_np2_gloo_staged", f"{what}, CUDA tensors staged over Gloo, "
                        f"against CPU tensors over Gloo", measured["0"]["cuda"], None,
                        ("allreduce_np2_gloo_cpu", gloo), ("<=", 1.2)))
    return rows


def describe(device) -> dict:
    """The device, the software and where this run comes from."""
    about = {"device": device.type, "torch": torch.__version__, "cuda": torch.version.cuda,
             "python": platform.python_version(), "host": platform.node()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        about.update(name=torch.cuda.get_device_name(device),
                     capability=f"{props.major}.{props.minor}",
                     memory_gib=round(props.total_memory / 2 ** 30, 1),
                     devices=torch.cuda.device_count())
        try:
            about["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):
            about["nccl"] = None
    else:
        about.update(name=platform.processor() or platform.machine(), cores=os.cpu_count())
    try:
        about.update(_spawn.provenance())
    except OSError:     # no git on this machine
        pass
    about["commit"] = about.get("commit") or "unknown (no git checkout)"
    about["time"] = datetime.datetime.now().isoformat(timespec="seconds")
    about.setdefault("date", about["time"][:10])
    return about


def print_table(about: dict, rows) -> None:
    print(f"{about['name']} ({about['device']}): torch {about['torch']}, CUDA {about['cuda']}, "
          f"NCCL {about.get('nccl')}; commit {about['commit']}, {about['date']}")
    print(f"{'measurement':<20} {'median ms':>10} {'min-max ms':>17} {'GB/s':>8} "
          f"{'ratio':>22} {'target':>14}")
    for r in rows:
        spread = f"{r['min_ms']:.3f}-{r['max_ms']:.3f}"
        rate = f"{r['gb_per_s']:.1f}" if "gb_per_s" in r else ""
        ratio = f"{r['ratio']:.2f}x {r['ratio_of']}" if "ratio" in r else ""
        target = ""
        if "target" in r:
            target = r["target"] + ("" if r["meets_target"] else " MISSED")
        print(f"{r['name']:<20} {r['median_ms']:>10.3f} {spread:>17} {rate:>8} {ratio:>22} "
              f"{target:>14}")


def main(argv=None):
    p = _spawn.parser(__doc__, "gpu.json")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: cuda where torch sees a GPU, else say so and stop")
    p.add_argument("--mib", type=int, default=256, help="tensor of the bandwidth rows")
    p.add_argument("--params", type=int, default=25_000_000, help="optimizer rows")
    p.add_argument("--allreduce-mib", type=int, default=64)
    p.add_argument("--ratio", type=float, default=0.01, help="random-k density")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        why = "a CPU-only build" if torch.version.cuda is None else "no GPU visible"
        print(f"gpu.py: CUDA is not available (torch {torch.__version__}: {why}); nothing "
              f"measured. Run it on a GPU machine, or with --device cpu for the CPU table.")
        return 0
    if args.quick:
        args.mib, args.params = min(args.mib, 16), min(args.params, 1_000_000)
        args.allreduce_mib, args.reps = min(args.allreduce_mib, 4), min(args.reps, 3)
    device = torch.device("cuda" if args.device != "cpu" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
        sync = torch.cuda.synchronize
    else:
        sync = lambda: None  # noqa: E731  (CPU calls return when done)
    import horovod_ext.torch as hvd
    hvd.init()      # one process: OnebitAdam, SLAMB and the allreduce run on the engine
    about = describe(device)
    rows = (bandwidth_rows(args, device, sync) + optimizer_rows(args, device, sync)
            + allreduce_rows(args, device, sync))
    checks = fused_checks(device)
    hvd.shutdown()
    print_table(about, rows)
    print("fused kernels against the plain torch code:", checks)
    out = args.out
    if os.path.isdir(out) or not out.endswith(".json"):
        out = os.path.join(out, "gpu.json")
    _spawn.write_report(out, {**about, "settings": {k: getattr(args, k) for k in (
        "mib", "params", "allreduce_mib", "ratio", "reps")}, "rows": rows,
        "fused_against_unfused": checks})
    return 0


if __name__ == "__main__":
    sys.exit(main())
