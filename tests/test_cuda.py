"""CUDA against CPU: the same collectives, ops, optimizers and mixed precision, on one rank in
this process and on two real ranks (tests/harness.py), with the results compared and checked to
stay on the GPU.

Tests marked ``cuda`` run where torch sees a GPU (``tools/gpu_check.sh`` runs them) and are
skipped elsewhere, saying so.  Two ranks run twice: over NCCL, which needs a GPU per rank (more
than one GPU), and staged through host memory over Gloo (HOROVOD_GPU_OPERATIONS=mpi), where both
ranks may share one GPU.  Two tests run everywhere: gpu_check.sh's dry run and
benchmarks/gpu.py's table on the CPU.

Tolerances, and why:
- bitwise: the collectives (they move data, and at one or two ranks each reduced element is one
  IEEE operation on two values, rounded alike on either device); DistributedOptimizer with SGD
  and Sum/Average on a quadratic loss (gradients w - t are elementwise, lr a power of two);
  GradScaler through DistributedOptimizer against the plain optimizer on the same GPU.
- rtol 1e-4, atol 1e-6: everything that takes a norm, a dot product or a matrix product
  (Adasum, OneBit, PowerSGD, LAMB, 1-bit Adam and LAMB, SLAMB): the GPU sums in another order
  than the CPU (whose C kernels sum in float64), which moves the last bits.
- RandomK at two ranks is checked for what it promises (each element the average or this rank's
  value, a fraction ``ratio`` averaged, the same elements on every rank), on both devices: its
  masks come from torch's CUDA or CPU generator, which draw different numbers.
"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import REPO, run_ranks

HAS_CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if HAS_CUDA else 0
needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA device: run tools/gpu_check.sh on a GPU machine")]
TRANSPORTS = [
    pytest.param({}, id="nccl", marks=pytest.mark.skipif(
        GPUS < 2, reason="NCCL needs a GPU per rank: two ranks need two GPUs")),
    pytest.param({"HOROVOD_GPU_OPERATIONS": "mpi"}, id="staged")]
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
CLOSE = dict(rtol=1e-4, atol=1e-6)


# --- helpers, used inside the ranks ---------------------------------------------------------
def _pin():
    """Horovod's recipe, one GPU per local rank; ranks share GPU 0 where there is one only."""
    import horovod_ext.torch as hvd
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def _sample(rank, shape, dtype, seed):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


def _bits(t):
    """The tensor's bits where it is floating (so that -0.0 differs from 0.0), else itself."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()]) if t.is_floating_point() else t


def _compare(failures, what, gpu, cpu, exact=True):
    """Record in ``failures`` where ``gpu`` is not on this rank's GPU or differs from ``cpu``."""
    here = torch.device("cuda", torch.cuda.current_device())
    if gpu.device != here:
        failures.append(f"{what}: result on {gpu.device}, not {here}")
        return
    got = gpu.detach().cpu()
    if got.shape != cpu.shape or got.dtype != cpu.dtype:
        failures.append(f"{what}: {got.dtype}{tuple(got.shape)} against "
                        f"{cpu.dtype}{tuple(cpu.shape)} on the CPU")
    elif exact and not torch.equal(_bits(got), _bits(cpu.detach())):
        diff = (got.double() - cpu.double()).abs().max().item()
        failures.append(f"{what}: not bitwise equal to the CPU's (max difference {diff:g})")
    elif not exact and not torch.allclose(got.double(), cpu.detach().double(), **CLOSE):
        diff = (got.double() - cpu.double()).abs().max().item()
        failures.append(f"{what}: max difference {diff:g} to the CPU's, beyond {CLOSE}")


def _on_both(fn):
    """fn(device) on this rank's GPU, then on the CPU."""
    return fn(_pin()), fn(torch.device("cpu"))


# --- collectives ----------------------------------------------------------------------------
def _collectives(device, dtype, seed):
    import horovod_ext.torch as hvd
    r, n = hvd.rank(), hvd.size()
    tag = f"{device.type}.{dtype}.{seed}"
    x = _sample(r, (6, 5), dtype, seed).to(device)
    out = {f"allreduce {name}": hvd.allreduce(x, op=op, name=f"ar.{name}.{tag}")
           for name, op in (("sum", hvd.Sum), ("average", hvd.Average), ("min", hvd.Min))}
    inplace = x.clone()
    hvd.synchronize(hvd.allreduce_async_(inplace, op=hvd.Sum, name=f"ari.{tag}"))
    out["allreduce_ in place"] = inplace
    out["grouped_allreduce"] = hvd.grouped_allreduce([x, x[:2] * 2], op=hvd.Sum,
                                                     name=f"gar.{tag}")[1]
    out["allgather (uneven)"] = hvd.allgather(x[:r + 1], name=f"ag.{tag}")
    out["broadcast"] = hvd.broadcast(x, root_rank=n - 1, name=f"bc.{tag}")
    splits = torch.tensor([(k % 3) + 1 for k in range(n)])
    rows = _sample(r, (int(splits.sum()), 3), dtype, seed + 1).to(device)
    out["alltoall"] = hvd.alltoall(rows, splits=splits, name=f"a2a.{tag}")[0]
    out["reducescatter sum"] = hvd.reducescatter(x, op=hvd.Sum, name=f"rs.{tag}")
    return out


def body_collectives():
    failures = []
    for seed, dtype in enumerate(FLOATS + (torch.int64,)):
        gpu, cpu = _on_both(lambda d: _collectives(d, dtype, seed))
        for what in gpu:
            _compare(failures, f"{what} {dtype}", gpu[what], cpu[what])
    return failures


# --- DistributedOptimizer with each registry op ---------------------------------------------
def _quadratic(device, dtype, seed=7):
    """Parameters (a matrix large enough for random-k's sparse path, a bias) and this rank's
    targets; loss 0.5 ||w - t||^2, whose gradient w - t is exact on either device."""
    import horovod_ext.torch as hvd
    params = [torch.nn.Parameter(_sample(0, shape, torch.float32, seed).to(dtype).to(device))
              for shape in ((160, 96), (96,))]
    targets = [_sample(hvd.rank() + 1, p.shape, torch.float32, seed + 1).to(dtype).to(device)
               for p in params]
    return params, targets


def _train(opt, params, targets, steps):
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(((p - t) ** 2).sum() * 0.5 for p, t in zip(params, targets))
        loss.backward()
        opt.step()
    return [p.detach() for p in params]


def _op(name):
    import horovod_ext.torch as hvd
    return {"average": hvd.Average, "sum": hvd.Sum, "adasum": hvd.Adasum, "onebit": hvd.OneBit,
            "randomk": hvd.RandomK(0.25), "powersgd": hvd.PowerSGD(rank=2, start_iter=1)}[name]


def _sgd(device, op_name, dtype=torch.float32, steps=4):
    import horovod_ext.torch as hvd
    params, targets = _quadratic(device, dtype)
    op = _op(op_name)
    op.reset()      # error feedback, factors, step counts: each run starts from none
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(params, lr=0.5 if op_name != "sum" else 0.25),
        named_parameters=[(f"{op_name}.{device.type}.{dtype}.{i}", p)
                          for i, p in enumerate(params)], op=op)
    return _train(opt, params, targets, steps)


def body_registry_ops(op_names):
    """Each op through DistributedOptimizer(SGD), on the GPU and on the CPU."""
    import horovod_ext.torch as hvd
    failures = []
    for name in op_names:
        exact = name in ("average", "sum")
        if name == "randomk" and hvd.size() > 1:
            continue   # its masks differ between devices: body_randomk checks it instead
        for dtype in (FLOATS if exact else (torch.float32,)):
            gpu, cpu = _on_both(lambda d: _sgd(d, name, dtype))
            for i, (g, c) in enumerate(zip(gpu, cpu)):
                _compare(failures, f"{name} {dtype} parameter {i}", g, c, exact)
    return failures


def _randomk(device, ratio=0.25):
    """Failures of hvd.allreduce(op=RandomK) on ``device`` against what the op promises."""
    import horovod_ext.torch as hvd
    r, n = hvd.rank(), hvd.size()
    mine = [_sample(k, (200, 100), torch.float32, 3).to(device) for k in range(n)]
    out = hvd.allreduce(mine[r], op=hvd.RandomK(ratio), name=f"rk.{device.type}")
    mean = torch.stack(mine).sum(0) / n
    averaged = out == mean
    problems = []
    if out.device != mine[r].device:
        problems.append(f"result on {out.device}")
    if not torch.all(averaged | (out == mine[r])):
        problems.append("elements that are neither the average nor this rank's value")
    if n > 1:
        fraction = averaged.float().mean().item()
        if not 0.22 <= fraction <= 0.28:       # 20000 draws: 0.25 +- 0.003 (one s.d.)
            problems.append(f"{fraction:.3f} of the elements averaged, not about {ratio}")
        masks = hvd.allgather(averaged.to(torch.uint8).reshape(1, -1), name=f"rkm.{device}")
        if not torch.equal(masks[0], masks[-1]):
            problems.append("the ranks averaged different elements")
    return [f"randomk on {device.type}: {p}" for p in problems]


def body_randomk():
    gpu, cpu = _on_both(_randomk)
    return gpu + cpu


# --- optimizers that communicate themselves -------------------------------------------------
def _optimizer(name, device):
    import horovod_ext.torch as hvd
    params, targets = _quadratic(device, torch.float32)
    label = f"{name}.{device.type}"
    opt = {"onebit_adam": lambda: hvd.OnebitAdam(params, lr=1e-2, freeze_step=2, name=label),
           "onebit_lamb": lambda: hvd.OnebitLamb(params, lr=1e-2, freeze_step=2, name=label),
           # k = 1: the mask is every element on either device, so the two can be compared
           "slamb": lambda: hvd.SLAMB(params, lr=1e-2, ratio=1.0, sync_interval=2),
           "lamb": lambda: hvd.DistributedOptimizer(
               hvd.Lamb(params, lr=1e-2), named_parameters=[
                   (f"{label}.{i}", p) for i, p in enumerate(params)])}[name]()
    result = _train(opt, params, targets, 5)
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return result, state


def body_optimizers(names):
    failures = []
    for name in names:
        (gpu, gpu_state), (cpu, _) = _on_both(lambda d: _optimizer(name, d))
        for i, (g, c) in enumerate(zip(gpu, cpu)):
            _compare(failures, f"{name} parameter {i}", g, c, exact=False)
        failures += [f"{name}: state on {t.device}" for t in gpu_state
                     if t.numel() > 1 and not t.is_cuda]
    return failures


def body_sparse_slamb():
    """SLAMB with k = 0.25 on the GPU: its state stays there and the model sync every 2 steps
    leaves every rank with the same parameters."""
    import horovod_ext.torch as hvd
    params, targets = _quadratic(_pin(), torch.float32)
    opt = hvd.SLAMB(params, lr=1e-2, ratio=0.25, sync_interval=2)
    result = _train(opt, params, targets, 4)
    gathered = hvd.allgather(torch.cat([p.reshape(1, -1) for p in result], 1), name="slamb.sync")
    failures = [] if torch.equal(gathered[0], gathered[-1]) else ["SLAMB ranks differ after sync"]
    return failures + [f"SLAMB: parameter on {p.device}" for p in result if not p.is_cuda]


# --- mixed precision ------------------------------------------------------------------------
def _amp_run(distributed: bool, steps=4):
    """A small MLP under autocast(float16) with GradScaler, Horovod's recipe; at step 2 one rank
    (the reference: itself) gets an infinite loss, which must skip that step everywhere."""
    import horovod_ext.torch as hvd
    device = _pin()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 8)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.125)
    if distributed:
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(32, 64, generator=g).to(device)
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        if step == 2 and (not distributed or hvd.rank() == hvd.size() - 1):
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if distributed:
            opt.synchronize()
        scaler.unscale_(opt)
        if distributed:
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            scaler.step(opt)
        scaler.update()
    return [p.detach() for p in model.parameters()], scaler.get_scale()


def body_amp():
    """Every rank sees the same data, so the average is each rank's own gradient: the result
    is the plain optimizer's, bit for bit, the skipped step included."""
    (ours, our_scale), (ref, ref_scale) = _amp_run(True), _amp_run(False)
    failures = [] if our_scale == ref_scale == 2.0 ** 11 else [
        f"GradScaler scale {our_scale} (plain optimizer: {ref_scale}; one skipped step "
        f"halves 4096 to 2048)"]
    for i, (a, b) in enumerate(zip(ours, ref)):
        _compare(failures, f"amp parameter {i}", a, b.cpu())
    return failures


# --- ranks sharing a GPU under NCCL ---------------------------------------------------------
def body_shared_gpu():
    """Both ranks on GPU 0 under NCCL: the first CUDA allreduce fails at once, naming the ranks
    and the fix; CPU tensors go on working."""
    import horovod_ext.torch as hvd
    torch.cuda.set_device(0)
    t0 = time.monotonic()
    try:
        hvd.allreduce(torch.ones(4, device="cuda"), name="shared")
        message = None
    except hvd.HorovodInternalError as exc:
        message = str(exc)
    took = time.monotonic() - t0
    cpu = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after").tolist()
    return message, took, cpu


# --- the tests: one rank in this process ----------------------------------------------------
@pytest.fixture(scope="module")
def one_rank():
    import horovod_ext.torch as hvd
    hvd.init()
    yield hvd
    hvd.shutdown()


@pytest.mark.usefixtures("one_rank")
class TestOneRank:
    pytestmark = needs_cuda

    def test_collectives(self):
        assert body_collectives() == []

    def test_registry_ops_through_distributed_optimizer(self):
        assert body_registry_ops(["average", "sum", "adasum", "onebit", "randomk",
                                  "powersgd"]) == []

    def test_randomk(self):
        assert body_randomk() == []

    def test_optimizers(self):
        assert body_optimizers(["onebit_adam", "onebit_lamb", "slamb", "lamb"]) == []
        assert body_sparse_slamb() == []

    def test_grad_scaler(self):
        assert body_amp() == []

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
    def test_adasum_operator_on_cuda_tensors(self, dtype):
        """Adasum's per-layer operator on CUDA tensors (the fused kernels) against the same on
        CPU tensors (the C kernels for float32, the torch code for float16), layers with gaps."""
        from horovod_ext.algorithms.adasum import fused
        from horovod_ext.algorithms.adasum.operator import LayerMap, adasum_pair_
        layers = LayerMap([(0, 1), (1, 70000), (70010, 333), (70400, 9)])
        g = torch.Generator().manual_seed(3)
        a, b = (torch.randn(70500, generator=g).to(dtype) for _ in range(2))
        want = adasum_pair_(a.clone(), b, layers)
        got = adasum_pair_(a.cuda(), b.cuda(), layers)
        assert got.is_cuda and fused._dots.compiled and fused._combine.compiled
        tol = dict(rtol=1e-3, atol=1e-3) if dtype == torch.float16 else dict(rtol=1e-5,
                                                                             atol=1e-6)
        torch.testing.assert_close(got.cpu(), want, **tol)
        assert torch.equal(got.cpu()[70001:70010], a[70001:70010])   # a gap: unchanged
        # every rank must get the same bits from the same operands (gather.py): no atomics
        assert torch.equal(adasum_pair_(a.cuda(), b.cuda(), layers), got)

    def test_gradient_arrivals_are_timed_on_the_gpu(self):
        """The buckets' arrival clock times kernels when they run, not when they are queued:
        matrix products queued between two stamps take the GPU's time between them."""
        from horovod_ext.torch.bucket_timing import ArrivalClock
        device = torch.device("cuda", torch.cuda.current_device())
        clock = ArrivalClock([torch.zeros(1, device=device)])
        a = torch.randn(4096, 4096, device=device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        first = clock.stamp()
        for _ in range(30):
            a = a @ a
            a = a / a.norm()
        last = clock.stamp()
        torch.cuda.synchronize()
        took = time.perf_counter() - start
        seconds = clock.seconds([first, last])
        assert seconds[0] == 0 and 0.5 * took < seconds[1] <= took, (seconds, took)


# --- the tests: two real ranks --------------------------------------------------------------
def _two_ranks(body, env, *args):
    for rank, failures in enumerate(run_ranks(body, 2, "gloo", env=env, args=args,
                                              timeout=120)):
        assert failures == [], f"rank {rank}: {failures}"


@pytest.mark.parametrize("env", TRANSPORTS)
class TestTwoRanks:
    pytestmark = needs_cuda

    def test_collectives(self, env):
        _two_ranks(body_collectives, env)

    def test_registry_ops_through_distributed_optimizer(self, env):
        _two_ranks(body_registry_ops, env, ["average", "sum", "adasum", "onebit", "powersgd"])

    def test_randomk(self, env):
        _two_ranks(body_randomk, env)

    def test_optimizers(self, env):
        _two_ranks(body_optimizers, env, ["onebit_adam", "onebit_lamb", "slamb", "lamb"])
        _two_ranks(body_sparse_slamb, env)

    def test_grad_scaler(self, env):
        _two_ranks(body_amp, env)


def body_hierarchical():
    """The collectives and the registry ops (each with a hierarchical form of its own) at 2
    nodes x 2, on the GPU and on the CPU; whether the hierarchy applied."""
    from horovod_ext.engine import runtime
    failures = body_collectives()
    failures += body_registry_ops(["average", "sum", "adasum", "onebit", "powersgd"])
    if not runtime.state.comms.topology.hierarchy_applies:
        failures.append("the hierarchy did not apply")
    return failures


@pytest.mark.timeout(240)
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device: run tools/gpu_check.sh on a "
                                         "GPU machine")
def test_hierarchical_forms_on_four_ranks_staged():
    """Two pretend nodes of two ranks on the machine's GPUs (shared where there are fewer than
    four), staged through host memory, with the hierarchical allreduce and allgather: CUDA
    tensors give the CPU tensors' results.  tests/test_staging.py runs the same staged paths
    with CPU tensors everywhere."""
    env = {"HOROVOD_GPU_OPERATIONS": "mpi", "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
           "HOROVOD_HIERARCHICAL_ALLGATHER": "1"}
    results = run_ranks(body_hierarchical, 4, "gloo", env=env, hostnames=["a", "a", "b", "b"],
                        timeout=200)
    for rank, failures in enumerate(results):
        assert failures == [], f"rank {rank}: {failures}"


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA or not dist.is_nccl_available(),
                    reason="needs a CUDA device and NCCL: run tools/gpu_check.sh on a GPU machine")
def test_ranks_sharing_a_gpu_under_nccl_fail_at_once_naming_the_fix():
    results = run_ranks(body_shared_gpu, 2, "gloo", timeout=60)
    for message, took, cpu in results:
        assert message is not None, "an allreduce of two ranks on one GPU under NCCL passed"
        assert "ranks 0 and 1 all use cuda:0" in message, message
        assert "torch.cuda.set_device(hvd.local_rank())" in message, message
        assert took < 10, f"the error took {took:.1f} s"
        assert cpu == [2.0, 2.0]


# --- everywhere: the GPU tools without a GPU ------------------------------------------------
def test_gpu_check_without_cuda_is_a_clean_dry_run(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    out = subprocess.run(["bash", os.path.join(REPO, "tools", "gpu_check.sh"), str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "gpu_check: CUDA is not available (torch " in out.stdout, out.stdout
    assert "): dry run, nothing was run on a GPU." in out.stdout, out.stdout
    assert f"results in {tmp_path}" in out.stdout
    report = (tmp_path / "environment.log").read_text()
    assert f"torch {torch.__version__}" in report and "CUDA available: False" in report
    assert "dry run" in (tmp_path / "summary.txt").read_text()
    assert not (tmp_path / "cuda_tests.log").exists(), "a dry run ran the tests"


def test_gpu_benchmark_runs_its_table_on_the_cpu(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu.py"),
                          "--device", "cpu", "--mib", "1", "--params", "20000",
                          "--allreduce-mib", "1", "--reps", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120, cwd=REPO,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "gpu.json").read_text())
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == ["copy", "onebit_compress", "onebit_decompress",
                          "onebit_compress_unfused", "onebit_decompress_unfused",
                          "randomk_select", "randomk_gather", "randomk_scatter", "adasum_pair",
                          "adasum_pair_unfused", "adam_fused",
                          "adam_foreach", "lamb", "lamb_unfused", "onebit_adam_warmup", "slamb",
                          "adam_fused_queued", "lamb_queued", "lamb_queued_combo", "allreduce"]
    assert report["device"] == "cpu" and report["torch"] == torch.__version__
    checks = report["fused_against_unfused"]
    assert checks["onebit_float32"]["bits_equal"] and checks["onebit_float16"]["values_equal"]
    assert checks["lamb_params_max_rel_diff"] < 1e-5
    assert report["commit"] and report["date"]
    copy = rows["copy"]
    assert copy["min_ms"] <= copy["median_ms"] <= copy["max_ms"] and copy["gb_per_s"] > 0
    codec = rows["onebit_compress"]
    assert codec["ratio"] == pytest.approx(codec["gb_per_s"] / copy["gb_per_s"])
    assert codec["target"] == ">= 0.5" and rows["slamb"]["target"] == "<= 1.5"
    assert rows["lamb"]["ratio"] == pytest.approx(rows["lamb"]["median_ms"]
                                                  / rows["adam_fused"]["median_ms"])
    for name in rows:
        assert f"\n{name} " in out.stdout, f"the table lacks {name}"


def test_kernel_profile_runs_on_the_cpu(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu_kernels.py"),
                          "--device", "cpu", "--params", "20000", "--mib", "1", "--steps", "1",
                          "--reps", "2", "--only", "adam_fused,lamb_cpp_combo,onebit_decompress",
                          "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=180, cwd=REPO,
                         env=dict(os.environ, OMP_NUM_THREADS="1",
                                  BENCHMARK_COMMIT="abc1234"))   # a copied tree's commit
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "gpu_kernels.json").read_text())
    assert report["commit"] == "abc1234" and report["commit_from"] == "BENCHMARK_COMMIT"
    assert [r["name"] for r in report["measurements"]] == ["adam_fused", "lamb_cpp_combo",
                                                           "onebit_decompress"]
    for r in report["measurements"]:
        assert r["wall_ms"] > 0 and r["queued_ms"] > 0, r
        assert r["launches_per_step"] == 0 and r["top"] == [], r   # no device kernels on a CPU
        assert r["host_top"] and all(h["self_us_per_step"] >= 0 for h in r["host_top"]), r
    diffs = [r["max_rel_diff_from_plain"] for r in report["measurements"]]
    assert diffs[0] is None and diffs[2] is None     # no plain torch code to compare with
    assert diffs[1] == 0.0, diffs   # on the CPU both runs take LAMB's C kernels: the same bits
    assert report["device"] == "cpu"


@pytest.mark.timeout(240)
def test_kernel_profile_lamb_in_chunks_gives_the_plain_codes_parameters(tmp_path):
    """gpu_kernels.py's chunked LAMB (flat unbacked aliases, 16 tensors a compiled call, one-
    element tensors apart), compiled on the CPU here: after three steps its parameters are the
    plain torch code's, over 20 tensors of assorted shapes (a chunk, a remainder, single values)."""
    out = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu_kernels.py"),
                          "--device", "cpu", "--params", "20000", "--many", "20", "--steps", "1",
                          "--reps", "1", "--only", "lamb_many_chunked", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=220, cwd=REPO,
                         env=dict(os.environ, OMP_NUM_THREADS="1",
                                  HOROVOD_FUSED_KERNELS="all"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "runs uncompiled" not in out.stdout + out.stderr    # compiled, within its limits
    (row,) = json.loads((tmp_path / "gpu_kernels.json").read_text())["measurements"]
    assert 0 <= row["max_rel_diff_from_plain"] < 1e-5, row
