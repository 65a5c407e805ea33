"""The fused kernels (``horovod_ext.algorithms.compiled``: torch.compile, Triton on GPUs) checked
on CPU tensors through torch.compile's CPU backend (HOROVOD_FUSED_KERNELS=all), against the torch
code they replace and a plain reference written here.

Tolerances, and why:
- bitwise: signs, decompressed values, compensated errors and their updates (each element is the
  same IEEE operations on the same values; float16 intermediates are rounded as eager torch
  rounds them);
- scales rtol 1e-6 for float32, 1e-12 for float64: the fused kernels sum squares over aligned
  rows and take a segment as a difference of float64 prefix sums, the torch code sums each
  segment's rows; the last bits move;
- LAMB rtol 1e-5: the norms sum in another order than the float64 reference;
- Adasum: dots rtol 1e-12 (float64 sums in another order); the combine within one unit in the
  last place (float16) or 1e-6 (float32): ``a * c + b * d`` may round once or twice.
"""
import logging
import math

import pytest
import torch

from horovod_ext.algorithms import compiled
from horovod_ext.algorithms.lamb import Lamb, fused_lamb_steps_
from horovod_ext.algorithms.onebit import compression, fused, torch_code
from horovod_ext.config import ConfigError, fused_kernels
from tests.harness import run_ranks

SCALE_RTOL = {torch.float32: 1e-6, torch.float64: 1e-12, torch.float16: 0, torch.bfloat16: 0}
# odd sizes: a one-element segment, segments shorter than a row, a tail that is not a byte
CASES = [(4099, [1, 500, 3000, 598]), (70001, [300] * 20 + [64001]), (1000, [1000]), (5, [5])]


@pytest.fixture
def fused_everywhere(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSED_KERNELS", "all")


def _sample(numel, dtype, seed):
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _reference_scales(x, lengths):
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    return torch.stack([x[a:b].double().norm() / math.sqrt(b - a)
                        for a, b in zip(bounds, bounds[1:])])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.usefixtures("fused_everywhere")
def test_the_fused_codec_gives_the_torch_codes_values(dtype):
    """compress, decompress, the compensated compress of the compressed allreduce (pending
    error, dense input, two ranks' packed parts, divisor) and the error update, fused against
    the torch code and against a plain reference."""
    for numel, lengths in CASES:
        x = _sample(numel, dtype, numel)
        ws = compression.default_workspace()
        plan = ws.plan(numel, lengths, "cpu")
        nbytes = compression.packed_bytes(numel)
        expect_bits = torch.empty(nbytes, dtype=torch.uint8)
        expect_scales = torch_code.compress(x, plan, expect_bits, ws)
        bits = torch.empty(nbytes, dtype=torch.uint8)
        scales = fused.compress(x, lengths, bits)
        what = f"{dtype} {numel} {lengths[:3]}"
        assert torch.equal(bits, expect_bits), what
        torch.testing.assert_close(scales, expect_scales, rtol=SCALE_RTOL[dtype], atol=0)
        # the plain reference: bit i of byte i // 8 set where x >= 0; scale ||x|| / sqrt(len)
        signs = (bits[torch.arange(numel) // 8].int() >> (torch.arange(numel) % 8)) & 1
        assert torch.equal(signs.bool(), x >= 0), what
        torch.testing.assert_close(scales.double(), _reference_scales(x, lengths),
                                   rtol=1e-3 if dtype == torch.float16 else 1e-6, atol=0)

        out, expect = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
        fused.decompress_into(bits, scales, lengths, out)
        torch_code.decompress_into(bits, scales, plan, expect, ws)
        assert torch.equal(out, expect), what

        parts = [(bits, scales), (bits.flip(0), scales * 2)]
        error, expect_error = x.clone(), x.clone()
        got_bits, expect_bits = (torch.empty(nbytes, dtype=torch.uint8) for _ in range(2))
        got = fused.compensate_compress_(error, lengths, got_bits, scales, x, parts, 2)
        expect = torch_code.compensate_compress_(expect_error, plan, expect_bits, ws, scales, x,
                                                 parts, 2)
        assert torch.equal(error, expect_error) and torch.equal(got_bits, expect_bits), what
        torch.testing.assert_close(got, expect, rtol=SCALE_RTOL[dtype], atol=0)

        settled, expect_settled = error.clone(), error.clone()
        fused.settle_error_(settled, got, lengths)
        torch_code.settle_error_(expect_settled, got, plan, ws)
        assert torch.equal(settled, expect_settled), what


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("fused_everywhere")
def test_the_public_codec_functions_take_the_fused_kernels_and_compile_them(caplog):
    """HOROVOD_FUSED_KERNELS=all sends CPU tensors through the fused kernels, compiled (no
    fallback warning); float64 too."""
    caplog.set_level(logging.WARNING, logger="horovod_ext")
    x = _sample(3001, torch.float64, 1)
    bits, scales = compression.compress(x, [1000, 2001])
    back = compression.decompress(bits, scales, [1000, 2001], torch.float64)
    torch.testing.assert_close(scales, _reference_scales(x, [1000, 2001]), rtol=1e-12, atol=0)
    assert torch.equal(back[:1000].abs(), scales[0].expand(1000))
    assert torch.equal(back.sign(), torch.where(x >= 0, 1.0, -1.0).double())
    for kernel in (fused._compress, fused._decompress):
        assert kernel.compiled and all(f is not kernel.eager for f in kernel.compiled.values())
    assert "runs uncompiled" not in caplog.text


def test_a_kernel_that_cannot_compile_runs_uncompiled_with_a_warning(caplog):
    caplog.set_level(logging.WARNING, logger="horovod_ext")

    @compiled.kernel
    def doubled(t):
        torch._dynamo.graph_break()   # refused under fullgraph=True: compiling fails
        return t * 2

    assert torch.equal(doubled(torch.ones(3)), torch.full((3,), 2.0))
    assert "torch.compile of doubled failed" in caplog.text and "runs uncompiled" in caplog.text
    assert torch.equal(doubled(torch.ones(2)), torch.full((2,), 2.0))


def test_the_variable_takes_three_values_and_refuses_others():
    assert fused_kernels({}) == "cuda"
    assert fused_kernels({"HOROVOD_FUSED_KERNELS": "OFF"}) == "off"
    with pytest.raises(ConfigError, match="HOROVOD_FUSED_KERNELS='gpu' is not valid"):
        fused_kernels({"HOROVOD_FUSED_KERNELS": "gpu"})


def _plain_lamb(params, grads_per_step, lr, betas, eps, weight_decay, min_coeff, max_coeff):
    """LAMB in float64, one loop per tensor, written from the 1-bit LAMB paper's equation (2)
    with eps outside the square root (Lamb's default)."""
    x = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(t) for t in x]
    v = [torch.zeros_like(t) for t in x]
    coeffs = []
    for step, grads in enumerate(grads_per_step, start=1):
        coeffs = []
        for i, g in enumerate(grads):
            g = g.double()
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            m_hat, v_hat = m[i] / (1 - betas[0] ** step), v[i] / (1 - betas[1] ** step)
            u = m_hat / (v_hat.sqrt() + eps) + weight_decay * x[i]
            pn, un = x[i].norm().item(), u.norm().item()
            c = pn / un if pn > 0 and un > 0 else 1.0
            c = min(max(c, min_coeff), max_coeff)
            x[i] = x[i] - lr * c * u
            coeffs.append(c)
    return x, coeffs


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("fused_everywhere")
def test_the_fused_lamb_step_against_a_plain_reference():
    """Three steps of hvd.Lamb through the fused kernel (a zero bias included, whose ratio is
    1 before clipping) against LAMB written out in float64."""
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(shape, generator=g))
              for shape in [(64, 33), (33,), (7, 3)]] + [torch.nn.Parameter(torch.zeros(5))]
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(3)]
    settings = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01, min_coeff=0.01,
                    max_coeff=10.0)
    expected, coeffs = _plain_lamb(params, grads, **settings)
    opt = Lamb(params, **settings)
    opt.native_kernels = False
    for step_grads in grads:
        for p, grad in zip(params, step_grads):
            p.grad = grad
        opt.step()
    assert any(f is not fused_lamb_steps_.eager for f in fused_lamb_steps_.compiled.values())
    for p, want, c in zip(params, expected, coeffs):
        torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-7)
        assert opt.state[p]["lamb_coeff"].item() == pytest.approx(c, rel=1e-5)
        assert opt.state[p]["step"] == 3


def body_onebit(fused_kernels_value):
    import os
    os.environ["HOROVOD_FUSED_KERNELS"] = fused_kernels_value
    import horovod_ext.torch as hvd
    results = []
    for call in range(3):
        t = _sample(3001, torch.float32, 10 * call + hvd.rank())
        results.append(hvd.allreduce(t, op=hvd.OneBit, name="g"))
    return [r.tolist() for r in results]


@pytest.mark.timeout(240)
def test_the_onebit_op_over_two_ranks_fused_as_unfused():
    """hvd.OneBit at two real ranks (error feedback across three calls of one name): the fused
    kernels, compiled in each rank's engine thread, give the torch code's results."""
    fused_results = run_ranks(body_onebit, 2, "gloo", args=("all",), timeout=200)
    plain = run_ranks(body_onebit, 2, "gloo", args=("off",), timeout=60)
    assert fused_results[0] == fused_results[1]
    for got, want in zip(fused_results[0], plain[0]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("fused_everywhere")
@pytest.mark.parametrize("scaling", ["simplified", "algorithm"])
def test_the_fused_slamb_update_gives_the_torch_codes_values(scaling):
    """SLAMB's lines 10-19, fused, for a group's tensors in one call, against ``torch_update_``
    tensor by tensor: one tensor synchronised in full (no index), one with a tenth of its
    elements selected, one of another group (its own call), three steps."""
    from horovod_ext.algorithms.slamb.update import fused_updates_, torch_update_
    group = dict(betas=(0.9, 0.999), beta3=0.9, eps=1e-6, weight_decay=0.01, lr=0.01,
                 min_coeff=0.01, max_coeff=10.0, bias_correction=True, eps_inside_sqrt=False)
    other = dict(group, lr=0.003, weight_decay=0.0)
    g = torch.Generator().manual_seed(5)
    shapes = [(20, 30), (20, 30), (7, 11)]
    selected = [None, torch.randperm(600, generator=g)[:60].sort().values,
                torch.randperm(77, generator=g)[:9].sort().values]
    groups = [group, group, other]
    start = [torch.randn(shape, generator=g) for shape in shapes]

    def fresh():
        return ([p.clone() for p in start],
                [{"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p),
                  "staleness": torch.ones_like(p), "step": 0} for p in start])
    (fused, fused_states), (plain, plain_states) = fresh(), fresh()
    for step in range(3):
        grads = [torch.randn(shape, generator=g) for shape in shapes]
        for states in (fused_states, plain_states):
            for state, grad in zip(states, grads):
                state["step"] += 1
                state["exp_avg"].mul_(0.9).add_(grad, alpha=0.1)
        items = list(zip(fused, grads, selected, fused_states, groups))
        assert fused_updates_(items, 2, scaling) == []
        for p, grad, idx, state, grp in zip(plain, grads, selected, plain_states, groups):
            torch_update_(p, grad, idx, state, grp, 2, scaling)
        for k in range(len(shapes)):
            what = f"{scaling}, tensor {k}, step {step + 1}"
            torch.testing.assert_close(fused[k], plain[k], rtol=1e-5, atol=1e-7, msg=what)
            for key in ("exp_avg_sq", "staleness"):
                torch.testing.assert_close(fused_states[k][key], plain_states[k][key],
                                           rtol=1e-6, atol=0, msg=what)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_the_fused_adasum_dots_and_combine_give_the_torch_codes_values(dtype, monkeypatch):
    """Adasum's per-layer [a.b, a.a, b.b] and combine over a piece whose layers leave gaps and
    include one-element and long layers, fused against the torch code (HOST_CODE off: the code
    a GPU runs unfused) and against a plain float64 reference; gaps stay as they were."""
    from horovod_ext.algorithms.adasum import fused as adasum_fused, operator
    monkeypatch.setattr(operator, "HOST_CODE", False)
    layers = operator.LayerMap([(0, 1), (1, 700), (705, 4000), (4705, 300), (5100, 7)])
    g = torch.Generator().manual_seed(9)
    a, b = (torch.randn(5200, generator=g).to(dtype) for _ in range(2))
    for lo, hi in ((0, 5200), (600, 4800)):
        piece = layers.piece(lo, hi)
        x, y = a[lo:hi].clone(), b[lo:hi].clone()
        want = operator.partial_dots(x, y, piece)
        got = adasum_fused.partial_dots(x, y, piece)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for s in piece.segments:   # the reference: float64 sums of the segment
            u, v = x[s.start:s.end].double(), y[s.start:s.end].double()
            torch.testing.assert_close(got[s.layer], torch.stack([u @ v, u @ u, v @ v]),
                                       rtol=1e-12, atol=1e-12)
        coeffs = operator.coefficients(want)
        expect, out = x.clone(), x.clone()
        operator.combine_(expect, y, False, coeffs, piece)
        adasum_fused.combine_(out, y, coeffs.flip(1), piece)
        # a * c + b * d may round once or twice (fused multiply-add or not): one unit in the
        # last place of float16, a few of float32
        tol = dict(rtol=1e-3, atol=1e-3) if dtype == torch.float16 else dict(rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(out, expect, **tol)
        covered = torch.zeros(hi - lo, dtype=torch.bool)
        for s in piece.segments:
            covered[s.start:s.end] = True
        assert not covered.all() and torch.equal(out[~covered], x[~covered])


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("fused_everywhere")
def test_adasum_takes_the_fused_kernels_where_they_serve_the_tensors(monkeypatch):
    """With the fused kernels serving the tensors (HOROVOD_FUSED_KERNELS=all here, CUDA tensors
    by default), Adasum's operator runs them, compiled, and gives the torch code's result."""
    from horovod_ext.algorithms.adasum import fused as adasum_fused, operator
    layers = operator.LayerMap([(0, 3), (3, 900), (903, 97)])
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    got = operator.adasum_pair_(a.clone(), b, layers)
    assert adasum_fused._dots.compiled and adasum_fused._combine.compiled
    assert all(f is not adasum_fused._dots.eager for f in adasum_fused._dots.compiled.values())
    monkeypatch.setenv("HOROVOD_FUSED_KERNELS", "off")
    monkeypatch.setattr(operator, "HOST_CODE", False)
    want = operator.adasum_pair_(a.clone(), b, layers)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for lo, hi in ((0, 3), (3, 903), (903, 1000)):   # each layer: the formula in float64
        x, y = a[lo:hi].double(), b[lo:hi].double()
        ref = (1 - (x @ y) / (2 * (x @ x))) * x + (1 - (x @ y) / (2 * (y @ y))) * y
        torch.testing.assert_close(got[lo:hi].double(), ref, rtol=1e-5, atol=1e-6)
