"""Where a GPU step's time goes: the device kernels and host operations of one optimizer step
(torch's fused Adam, ``hvd.Lamb``, ``hvd.SLAMB``, on the parameters of ``benchmarks/gpu.py``: 25M
in 1024-wide matrices) and of the 1-bit codec, from torch.profiler.

    python benchmarks/gpu_kernels.py --out DIR          # table; DIR/gpu_kernels.json
    python benchmarks/gpu_kernels.py --out DIR --code   # also Inductor's generated kernels
    python benchmarks/gpu_kernels.py --only lamb,lamb_cpp_combo

Per measurement: the wall time of one call with the device synchronised around it (as ``gpu.py``'s
rows) and per call of 10 queued before one synchronisation (as a training loop queues them), the
kernel launches per call, the kernels' summed device time per call, the kernels that take the most
of it and the host operations with the most time of their own. Device time well under the wall time
means the call waits on the host (Python, launches); device time near it means the kernels
themselves (their memory traffic) set the time. ``hvd.Lamb`` and ``hvd.SLAMB`` are also measured
with their fused kernels compiled under other Inductor options (combo kernels: several tensors'
kernels in one launch; the C++ wrapper: kernels launched from C++), and LAMB as two compiled passes
(``LambSplit``), to choose between them; each of these also reports how far its parameters are
after 3 steps from the plain torch code's (``max_rel_diff_from_plain``). ``--code`` logs the source
Inductor writes (to stderr). Without CUDA it says so and exits 0; ``--device cpu`` runs on the CPU
(no device kernels: only the wall times mean anything).
"""
import contextlib
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _spawn  # noqa: E402  (benchmarks/ is not a package)
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

TOP = 8   # kernels (and host ops) listed per measurement
ANNOTATIONS = ("Optimizer.", "ProfilerStep")
gpu = _spawn.sibling("gpu")   # the same parameters, description and timing


def _device_us(event) -> float:
    """An event's own device time in microseconds (the attribute's name moved across torch
    versions)."""
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, attr):
            return float(getattr(event, attr))
    return 0.0


def profile_steps(step, steps: int, device) -> dict:
    """Kernels of ``steps`` calls of ``step`` (after two untimed ones), per step."""
    step()
    step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    # the optimizer's own annotation shows on the device's timeline too: not a kernel
    kernels = [e for e in events
               if _device_us(e) > 0 and e.device_type == torch.autograd.DeviceType.CUDA
               and not e.key.startswith(ANNOTATIONS)]
    kernels.sort(key=_device_us, reverse=True)
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU
            and not e.key.startswith(ANNOTATIONS)]
    host.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return {"launches_per_step": sum(e.count for e in kernels) / steps,
            "device_us_per_step": sum(_device_us(e) for e in kernels) / steps,
            "top": [{"kernel": e.key[:120], "launches_per_step": e.count / steps,
                     "us_per_step": _device_us(e) / steps} for e in kernels[:TOP]],
            "host_top": [{"op": e.key[:120], "calls_per_step": e.count / steps,
                          "self_us_per_step": e.self_cpu_time_total / steps}
                         for e in host[:TOP]]}


def wall_ms(step, reps: int, sync) -> float:
    """Median wall time of one synchronised step, in ms."""
    return statistics.median(gpu.timed(step, reps, sync)) * 1e3


class LambSplit:
    """``hvd.Lamb``'s step (default hyper-parameters) as two compiled functions, to compare
    with its one: the moments and both norms of every tensor (one pass over g, m, v, x), then
    the update recomputed from m, v, x (a second pass), so that no u is ever stored."""

    def __init__(self, params):
        from horovod_ext.algorithms import lamb as lamb_math
        self.lamb, self.params, self.t = lamb_math, params, 0
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.coeffs = torch.compile(self._coeffs, dynamic=True, fullgraph=True)
        self.apply = torch.compile(self._apply, dynamic=True, fullgraph=True)

    def _coeffs(self, ps, gs, ms, vs, bc1, bc2):
        out = []
        for p, g, m, v in zip(ps, gs, ms, vs):
            self.lamb.update_moments_(m, v, g, 0.9, 0.999)
            u = self.lamb.corrected_direction(m, v, bc1, bc2, 1e-6, False)
            out.append(self.lamb.lamb_coefficient(p, u, self.lamb.DEFAULT_MIN_COEFF,
                                                  self.lamb.DEFAULT_MAX_COEFF))
        return out

    def _apply(self, ps, ms, vs, coeffs, bc1, bc2, lr):
        for p, m, v, c in zip(ps, ms, vs, coeffs):
            u = self.lamb.corrected_direction(m, v, bc1, bc2, 1e-6, False)
            p.sub_(u * (c * lr))

    @torch.no_grad()
    def step(self):
        self.t += 1
        bc1, bc2 = self.lamb.bias_corrections(self.t, 0.9, 0.999)
        coeffs = self.coeffs(self.params, [p.grad for p in self.params], self.m, self.v,
                             bc1, bc2)
        self.apply(self.params, self.m, self.v, coeffs, bc1, bc2, 1e-3)


CHUNK = 16       # tensors per compiled call in lamb_in_chunks
MANY = 200       # tensors of the many-tensor parameter set


@contextlib.contextmanager
def lamb_in_chunks():
    """``hvd.Lamb``'s fused step on CHUNK tensors at a time, each passed as a flat alias
    (``compiled.flat_aliases``) whose size is unbacked (no guards on sizes), tensors of one
    element apart: so that a few compiled graphs serve any model, where one graph over all
    tensors takes longer to compile the more tensors there are."""
    from horovod_ext.algorithms import compiled, lamb as lamb_module
    kept = lamb_module.fused_lamb_steps_
    kernel = compiled.kernel(kept.eager)

    def flat(ts):
        out = compiled.flat_aliases(ts)
        for t in out:
            torch._dynamo.decorators.mark_unbacked(t, 0)
        return out

    def in_chunks(params, grads, exp_avgs, exp_avg_sqs, hyper, eps_inside_sqrt):
        coeffs = [None] * len(params)
        for single in (False, True):   # one-element tensors apart: their size specialises
            group = [i for i, p in enumerate(params) if (p.numel() <= 1) == single]
            for lo in range(0, len(group), CHUNK):
                ids = group[lo:lo + CHUNK]
                got = kernel(*(flat([ts[i] for i in ids]) for ts in (params, grads, exp_avgs,
                                                                      exp_avg_sqs)),
                             hyper, eps_inside_sqrt)
                for i, c in zip(ids, got):
                    coeffs[i] = c
        return coeffs
    lamb_module.fused_lamb_steps_ = in_chunks
    try:
        yield
    finally:
        lamb_module.fused_lamb_steps_ = kept


@contextlib.contextmanager
def slamb_per_tensor():
    """``hvd.SLAMB``'s fused update in one compiled call per tensor instead of per chunk of
    tensors."""
    from horovod_ext.algorithms.slamb import update as slamb_update
    kept = slamb_update.CHUNK
    slamb_update.CHUNK = 1
    try:
        yield
    finally:
        slamb_update.CHUNK = kept


def many_parameters(count: int, device, tensors: int = MANY):
    """About ``count`` parameters in ``tensors`` tensors of assorted shapes (matrices, vectors,
    convolution kernels, single values), gradients set: a model's many small tensors."""
    g = torch.Generator().manual_seed(1)
    rows = max(2, count // tensors // gpu.WIDTH)
    kinds = [(rows, gpu.WIDTH), (rows // 2 + 1, gpu.WIDTH), (gpu.WIDTH,), (64, 32, 3, 3), (1,)]
    picks = torch.randint(len(kinds), (tensors,), generator=g).tolist()
    params = []
    for k in picks:
        p = torch.nn.Parameter((torch.randn(kinds[k], generator=g) * 0.02).to(device))
        p.grad = (torch.randn(kinds[k], generator=g) * 1e-3).to(device)
        params.append(p)
    return params


COMBO = {"combo_kernels": True}                 # several tensors' kernels in one launch
CPP = {"cpp_wrapper": True}                     # kernels launched from C++, not Python
CPP_COMBO = {**CPP, **COMBO}


CHECK_PARAMS = 200_000   # parameters of the comparison with the plain torch code
CHECK_STEPS = 3


def differs_from_plain(make, plain, device, parameters) -> float:
    """The largest difference, relative to each tensor's largest value, between parameters
    after CHECK_STEPS steps of ``make``'s optimizer and of ``plain``'s under the plain torch
    code (HOROVOD_FUSED_KERNELS=off), from the same start."""
    def run(maker):
        params = parameters(CHECK_PARAMS, device)
        opt = maker(params)
        for _ in range(CHECK_STEPS):
            opt.step()
        return params
    got = run(make)
    with gpu.unfused():
        want = run(plain)
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want))


def measurements():
    """(name, what, options, make): ``make(args, device)`` returns the step to measure, under
    the Inductor ``options`` (a dict; a function giving a context manager: another way to call
    the kernels; None: as shipped), and where the step has a plain torch code to compare
    with, a function saying how far its results are from that code's (``differs_from_plain``)."""
    import horovod_ext.torch as hvd

    def optimizer(make, plain=None, many=False):
        def setup(args, device):
            def parameters(count, device):
                return (many_parameters(count, device, args.many) if many
                        else gpu._parameters(count, device))
            step = make(parameters(args.params, device)).step
            return step, plain and (lambda: differs_from_plain(make, plain, device, parameters))
        return setup

    def codec(which):
        def setup(args, device):
            from horovod_ext.algorithms.onebit import compress, decompress
            x = torch.randn(args.mib * gpu.MIB // 4, device=device)
            packed = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8, device=device)
            scales = compress(x, out=packed)[1]
            if which == "compress":
                return (lambda: compress(x, out=packed)), None
            dst = torch.empty_like(x)
            return (lambda: decompress(packed, scales, [x.numel()], x.dtype, out=dst)), None
        return setup
    lamb, slamb = (lambda p: hvd.Lamb(p)), (lambda p: hvd.SLAMB(p, ratio=0.1, overlap=False))
    return [("adam_fused", "torch Adam, fused", None,
             optimizer(lambda p: torch.optim.Adam(p, fused=True))),
            ("lamb", "hvd.Lamb", None, optimizer(lamb, lamb)),
            ("lamb_combo", "hvd.Lamb, combo kernels", COMBO, optimizer(lamb, lamb)),
            ("lamb_cpp", "hvd.Lamb, C++ wrapper", CPP, optimizer(lamb, lamb)),
            ("lamb_cpp_combo", "hvd.Lamb, C++ wrapper and combo kernels", CPP_COMBO,
             optimizer(lamb, lamb)),
            ("lamb_split", "LAMB in two compiled passes", None, optimizer(LambSplit, lamb)),
            ("lamb_chunked", f"hvd.Lamb, {CHUNK} flat tensors a compiled call", lamb_in_chunks,
             optimizer(lamb, lamb)),
            ("lamb_many", "hvd.Lamb, --many tensors", None,
             optimizer(lamb, lamb, many=True)),
            ("lamb_many_chunked", f"hvd.Lamb, --many tensors, {CHUNK} a compiled call",
             lamb_in_chunks, optimizer(lamb, lamb, many=True)),
            ("slamb", "hvd.SLAMB, k = 0.1", None, optimizer(slamb, slamb)),
            ("slamb_per_tensor", "hvd.SLAMB, a compiled call per tensor", slamb_per_tensor,
             optimizer(slamb, slamb)),
            ("slamb_many", "hvd.SLAMB, --many tensors", None, optimizer(slamb, slamb, many=True)),
            ("slamb_many_per_tensor", "hvd.SLAMB, --many tensors, a compiled call per tensor",
             slamb_per_tensor, optimizer(slamb, slamb, many=True)),
            ("slamb_cpp_combo", "hvd.SLAMB, C++ wrapper and combo kernels", CPP_COMBO,
             optimizer(slamb, slamb)),
            ("onebit_compress", "1-bit compress, --mib MiB", None, codec("compress")),
            ("onebit_decompress", "1-bit decompress, --mib MiB", None, codec("decompress"))]


def main(argv=None):
    p = _spawn.parser(__doc__, "gpu_kernels.json")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--params", type=int, default=25_000_000)
    p.add_argument("--steps", type=int, default=5, help="profiled steps per optimizer")
    p.add_argument("--reps", type=int, default=10, help="timed steps per optimizer")
    p.add_argument("--mib", type=int, default=256, help="tensor of the codec rows")
    p.add_argument("--many", type=int, default=MANY, help="tensors of the lamb_many rows")
    p.add_argument("--only", type=lambda v: v.split(","), default=None,
                   help="comma-separated names of the measurements to run")
    p.add_argument("--code", action="store_true", help="log Inductor's generated code")
    args = p.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        print(f"gpu_kernels.py: CUDA is not available (torch {torch.__version__}); nothing "
              f"profiled. Run it on a GPU machine, or with --device cpu.")
        return 0
    if args.quick:
        args.params, args.steps, args.reps = min(args.params, 1_000_000), 2, 3
        args.mib = min(args.mib, 16)
    if args.code:
        torch._logging.set_logs(output_code=True)
    device = torch.device("cuda" if args.device != "cpu" else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    import horovod_ext.torch as hvd
    hvd.init()      # SLAMB's sync runs on the engine
    about = gpu.describe(device)
    results = []
    for name, what, options, setup in measurements():
        if args.only and name not in args.only:
            continue
        if options is None:
            context = contextlib.nullcontext()
        else:
            context = (gpu.inductor_options(**options) if isinstance(options, dict)
                       else options())
        with context:
            step, check = setup(args, device)
            t0 = time.perf_counter()
            step()      # compiles the fused kernels, if any
            first_s = time.perf_counter() - t0
            diff = check() if check else None
            found = profile_steps(step, args.steps, device)
            results.append({"name": name, "what": what, "first_step_s": first_s,
                            "max_rel_diff_from_plain": diff,
                            "wall_ms": wall_ms(step, args.reps, sync),
                            "queued_ms": statistics.median(
                                gpu.timed_queued(step, args.reps, sync)) * 1e3, **found})
        del step
    hvd.shutdown()
    print(f"{about['name']} ({about['device']}): torch {about['torch']}; commit "
          f"{about['commit']}, {about['date']}")
    for r in results:
        print(f"\n{r['name']}: wall {r['wall_ms']:.3f} ms ({r['queued_ms']:.3f} queued), "
              f"device "
              f"{r['device_us_per_step'] / 1e3:.3f} ms in {r['launches_per_step']:.0f} "
              f"launches per step (first step {r['first_step_s']:.1f} s)")
        if r["max_rel_diff_from_plain"] is not None:
            print(f"  parameters after {CHECK_STEPS} steps against the plain torch code: "
                  f"{r['max_rel_diff_from_plain']:.1e} relative")
        for k in r["top"]:
            print(f"  {k['us_per_step']:9.1f} us {k['launches_per_step']:5.1f}x  {k['kernel']}")
        print("  host, own time:")
        for k in r["host_top"]:
            print(f"  {k['self_us_per_step']:9.1f} us {k['calls_per_step']:5.1f}x  {k['op']}")
    out = args.out
    if os.path.isdir(out) or not out.endswith(".json"):
        out = os.path.join(out, "gpu_kernels.json")
    _spawn.write_report(out, {**about, "settings": {k: getattr(args, k) for k in (
        "params", "mib", "many", "steps", "reps")}, "measurements": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
