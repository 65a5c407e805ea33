"""LAMB, the random-k mask, hvd.RandomK and SLAMB, on 2, 3 and 4 real ranks over Gloo
and MPI, checked against single-process simulations written plainly here.

One spawn per (backend, np) runs every check and returns everything; at np = 4 the ranks form 2
emulated nodes of 2 with hierarchical allreduce on, which covers the hierarchical paths.
"""
import copy
import io
import math

import pytest
import torch

from tests.harness import BACKENDS, run_ranks

SCALINGS = ("algorithm", "simplified")
TOL = 2e-5          # float32 results of a few steps, compared after different summation orders
K = 0.3             # mask density used in the tests (enough selected and unselected elements)
STEPS = 6
H = 3               # model sync every H steps: syncs after steps 3 and 6
OP_SHAPES = [(110, 120), (50,), (10, 10), (97, 131)]    # masked, 1-D, small, odd masked
HOSTS4 = ["a", "a", "b", "b"]


def make_model():
    torch.manual_seed(0)
    # 63x151 = 9513 and 151x70 = 10570 elements: masked; 70x5 and the biases: in full
    return torch.nn.Sequential(torch.nn.Linear(63, 151), torch.nn.Tanh(),
                               torch.nn.Linear(151, 70), torch.nn.Tanh(), torch.nn.Linear(70, 5))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 63, generator=g), torch.randn(16, 5, generator=g)


def grads_at(params, rank, step):
    model = make_model()
    with torch.no_grad():
        for p, v in zip(model.parameters(), params):
            p.copy_(v)
    x, y = batch(rank, step)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def op_data(rank, shape, call):
    g = torch.Generator().manual_seed(7919 * rank + 31 * call + len(shape))
    return torch.randn(*shape, generator=g)


SLAMB_CONFIGS = {
    # name: (SLAMB keyword arguments, reference settings)
    "k1_simplified": dict(ratio=1.0, sync_interval=1, sync_gradients=True, scaling="simplified",
                          weight_decay=0.01),
    "k1_algorithm": dict(ratio=1.0, sync_interval=1, sync_gradients=True, scaling="algorithm",
                         min_coeff=0.0, max_coeff=math.inf),
    # small buckets: each large weight is synchronised on its own while backward goes on
    "sparse_algorithm": dict(ratio=K, sync_interval=H, scaling="algorithm", weight_decay=0.01,
                             max_coeff=10.0, bucket_bytes=20000),
    # the same without overlap: everything in step(), one allreduce
    "sparse_algorithm_in_step": dict(ratio=K, sync_interval=H, scaling="algorithm",
                                     weight_decay=0.01, max_coeff=10.0, overlap=False),
    "sparse_simplified_gsync": dict(ratio=K, sync_interval=H, scaling="simplified",
                                    sync_gradients=True),
}
COMMON = dict(lr=0.02, betas=(0.9, 0.999), beta3=0.93, eps=1e-6)


# --- what every rank runs ------------------------------------------------------------------------
def _train(opt_factory, steps, rank, snapshots=(), mode="plain", dtype=torch.float32):
    """``mode``: "plain"; "skip": each step follows a backward whose step() was skipped (as
    GradScaler does on an inf); "accumulate": each step's gradient from two backward passes
    over the batch's halves."""
    model = make_model()
    opt = opt_factory(model)
    snaps = {}
    loss = torch.nn.functional.mse_loss
    for t in range(1, steps + 1):
        opt.zero_grad()
        x, y = (d.to(dtype) for d in batch(rank, t))
        if mode == "skip":
            loss(model(x + 1.0), y).backward()      # a step that never happens
            opt.zero_grad()
        if mode == "accumulate":
            for half in (slice(0, 8), slice(8, 16)):
                (loss(model(x[half]), y[half]) / 2).backward()
        else:
            loss(model(x), y).backward()
        opt.step()
        if t in snapshots:
            snaps[t] = [p.detach().clone() for p in model.parameters()]
    return model, opt, snaps


def body_everything():
    import horovod_ext.torch as hvd
    from horovod_ext.algorithms.slamb import SLAMB, random_k_indices
    r = hvd.rank()
    out = {"size": hvd.size(), "mask": random_k_indices(10007, 0.1, 5, 3, "layer.x")}

    # hvd.RandomK via hvd.grouped_allreduce: two calls, so the per-layer step changes the mask.
    op = hvd.RandomK(K)
    out["same_op"] = hvd.RandomK(K) is op and op.name == f"randomk_{K:g}"
    out["op"] = [hvd.grouped_allreduce([op_data(r, s, call) for s in OP_SHAPES], name="rk",
                                       op=op) for call in (1, 2)]
    out["op_by_name"] = hvd.allreduce(op_data(r, OP_SHAPES[0], 3), name="rk1", op=op.name)

    # hvd.RandomK from DistributedOptimizer: the gradients it hands to the optimizer.
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=op)
    x, y = batch(r, 1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.synchronize()
    out["dopt_grads"] = [p.grad.detach().clone() for p in model.parameters()]

    # SLAMB, flat (hierarchical=False) in every configuration; parameters at every step.
    for name, cfg in SLAMB_CONFIGS.items():
        _, o, snaps = _train(lambda m: SLAMB(m.parameters(), hierarchical=False, **COMMON, **cfg),
                             STEPS, r, snapshots=range(1, STEPS + 1))
        out[name] = snaps
        out[name + "_bytes"] = o.last_step_bytes, o.bytes_sent, o.last_synced_model
    # Overlap with backward keeps the semantics of step(): a skipped step changes nothing,
    # accumulated gradients count once, with or without backward_passes_per_step.
    variants = {"skip": ("skip", {}), "accumulate": ("accumulate", {}),
                "accumulate_bpps": ("accumulate", {"backward_passes_per_step": 2})}
    for name, (mode, extra) in variants.items():
        _, _, out["variant_" + name] = _train(
            lambda m: SLAMB(m.parameters(), hierarchical=False, **COMMON,
                            **SLAMB_CONFIGS["sparse_algorithm"], **extra),
            STEPS, r, snapshots=range(1, STEPS + 1), mode=mode)
    # Hierarchical SLAMB (np = 4, two nodes): node-averaged gradients, sparse across nodes.
    if hvd.size() == 4:
        _, o, out["hier"] = _train(lambda m: SLAMB(m.parameters(), **COMMON,
                                                   **SLAMB_CONFIGS["sparse_algorithm"]),
                                   STEPS, r, snapshots=range(1, STEPS + 1))
        out["hier_bytes"] = o.last_step_bytes, o.last_step_node_bytes

    # State round trip: 2 steps, save, restore into a fresh model and optimizer, 3 more steps.
    def factory(m):
        return SLAMB(m.parameters(), hierarchical=False, **COMMON, **SLAMB_CONFIGS["sparse_algorithm"])
    straight, _, _ = _train(factory, 5, r)
    first, o1, _ = _train(factory, 2, r)
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": o1.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    model = make_model()
    model.load_state_dict(saved["model"])
    opt = factory(model)
    opt.load_state_dict(saved["opt"])
    for t in (3, 4, 5):
        opt.zero_grad()
        x, y = batch(r, t)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    out["resume_bitwise"] = all(torch.equal(a, b) for a, b in
                                zip(straight.parameters(), model.parameters()))
    return out


def body_size_one():
    """One process: SLAMB runs without peers and equals LAMB at k = 1."""
    from horovod_ext.algorithms.lamb import Lamb
    from horovod_ext.algorithms.slamb import SLAMB
    a, _, _ = _train(lambda m: SLAMB(m.parameters(), **COMMON, **SLAMB_CONFIGS["k1_simplified"]),
                     4, 0)
    b, _, _ = _train(lambda m: Lamb(m.parameters(), lr=COMMON["lr"], eps=COMMON["eps"],
                                    weight_decay=0.01, min_coeff=0.01, max_coeff=0.4), 4, 0)
    sparse, o, _ = _train(lambda m: SLAMB(m.parameters(), **COMMON), 3, 0)
    finite = all(torch.isfinite(p).all() for p in sparse.parameters())
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters())), finite


def body_kernels_match_torch():
    """One process: lines 10-19 through the C kernels and through the torch code, every option
    that changes the arithmetic, float32 and float64; the largest relative difference (norm of
    the difference over norm) of the parameters and of v and c after 4 steps, per dtype."""
    import itertools
    from horovod_ext.algorithms import lamb
    from horovod_ext.algorithms.slamb import SLAMB
    worst = {}
    for dtype in (torch.float32, torch.float64):
        for scaling, inside, bias, wd in itertools.product(SCALINGS, (False, True), (True, False),
                                                           (0.0, 0.01)):
            cfg = dict(COMMON, ratio=K, scaling=scaling, eps_inside_sqrt=inside,
                       bias_correction=bias, weight_decay=wd, max_coeff=10.0)
            out = []
            for use_kernels in (True, False):
                def factory(m, use_kernels=use_kernels):
                    m.to(dtype)
                    opt = SLAMB(m.parameters(), **cfg)
                    opt.native_kernels = use_kernels
                    return opt
                model, opt, _ = _train(factory, 4, 0, dtype=dtype)
                out.append([p.detach() for p in model.parameters()]
                           + [opt.state[p][k] for p in model.parameters()
                              for k in ("exp_avg_sq", "staleness")])
            err = max(float((a - b).norm() / b.norm().clamp(min=1e-30)) for a, b in zip(*out))
            worst[str(dtype)] = max(worst.get(str(dtype), 0.0), err)
    return bool(lamb.KERNELS), worst


# --- single-process references -------------------------------------------------------------------
def ref_randomk(datas, shapes, step, name, nodes):
    """Per rank: selected elements -> global mean, others -> own value (or node mean)."""
    from horovod_ext.algorithms.slamb import random_k_indices, syncs_in_full
    n = len(datas)
    out = [[None] * len(shapes) for _ in range(n)]
    for j, shape in enumerate(shapes):
        stack = torch.stack([d[j].reshape(-1) for d in datas])
        mean = stack.sum(0) / n
        sel = torch.ones(stack.shape[1], dtype=torch.bool)
        if not syncs_in_full(shape):
            sel = torch.zeros_like(sel)
            sel[random_k_indices(stack.shape[1], K, 0, step, f"{name}.{j}" if len(shapes) > 1
                                 else name)] = True
        for r in range(n):
            local = stack[r] if nodes is None else \
                stack[[q for q in range(n) if nodes[q] == nodes[r]]].mean(0)
            out[r][j] = torch.where(sel, mean, local).reshape(shape)
    return out


def ref_slamb(n_ranks, nodes, ratio, sync_interval, scaling, sync_gradients=False,
              weight_decay=0.0, min_coeff=0.01, max_coeff=0.4, steps=STEPS):
    """Algorithm 1 for ``units`` (ranks, or nodes whose ranks' gradients are averaged), with
    boolean masks and plain norms.  Returns the parameters of every rank after every step."""
    from horovod_ext.algorithms.slamb import random_k_indices, syncs_in_full
    lr, (b1, b2), b3, eps = COMMON["lr"], COMMON["betas"], COMMON["beta3"], COMMON["eps"]
    groups = [[r for r in range(n_ranks) if (nodes or list(range(n_ranks)))[r] == u]
              for u in sorted(set(nodes or range(n_ranks)))]
    n = len(groups)
    xs = [[p.detach().clone() for p in make_model().parameters()] for _ in range(n)]
    ms = [[torch.zeros_like(p) for p in xs[0]] for _ in range(n)]
    vs = [[torch.zeros_like(p) for p in xs[0]] for _ in range(n)]
    cs = [[torch.ones_like(p) for p in xs[0]] for _ in range(n)]
    full = [syncs_in_full(p.shape) for p in xs[0]]
    history = {}
    for t in range(1, steps + 1):
        gs = []
        for u, members in enumerate(groups):
            per_rank = [grads_at(xs[u], r, t) for r in members]
            gs.append([sum(g[j] for g in per_rank) / len(members) for j in range(len(xs[0]))])
        sizes = [p.numel() for p, f in zip(xs[0], full) if not f]
        flat = torch.zeros(sum(sizes), dtype=torch.bool)
        flat[random_k_indices(sum(sizes), ratio, 0, t, "SLAMB")] = True
        pieces = iter(flat.split(sizes))
        masks = [torch.ones_like(p, dtype=torch.bool) if f else next(pieces).reshape(p.shape)
                 for p, f in zip(xs[0], full)]
        for j, mask in enumerate(masks):
            for u in range(n):
                ms[u][j] = b1 * ms[u][j] + (1 - b1) * gs[u][j]
            mbar = sum(ms[u][j] for u in range(n)) / n
            gbar = sum(gs[u][j] for u in range(n)) / n
            for u in range(n):
                ms[u][j] = torch.where(mask, mbar, ms[u][j])
                g = torch.where(mask, gbar, gs[u][j]) if sync_gradients else gs[u][j]
                vs[u][j] = b2 * vs[u][j] + (1 - b2) * g * g
                cs[u][j] = torch.where(mask, torch.ones_like(g), b3 * cs[u][j])
                x, c = xs[u][j], cs[u][j]
                upd = (ms[u][j] / (1 - b1 ** t)) / ((vs[u][j] / (1 - b2 ** t)).sqrt() + eps) \
                    + weight_decay * x

                def ratio_of(a, b):
                    r = a / b if a > 0 and b > 0 else torch.tensor(1.0)
                    return r.clamp(min_coeff, max_coeff)
                un = upd.norm()
                k = un if scaling == "algorithm" else 1.0
                pmax = ratio_of(x[mask].norm() * k, upd[mask].norm())
                pmin = ratio_of(x[~mask].norm() * k, upd[~mask].norm())
                phi = pmax * c + pmin * (1 - c)
                eta = lr * c + lr / math.sqrt(n) * (1 - c)
                xs[u][j] = x - eta * phi * upd / k
        if t % sync_interval == 0:
            for j in range(len(xs[0])):
                mean = sum(xs[u][j] for u in range(n)) / n
                for u in range(n):
                    xs[u][j] = mean.clone()
        history[t] = [copy.deepcopy(xs[next(u for u, g in enumerate(groups) if r in g)])
                      for r in range(n_ranks)]
    return history


def ref_lamb_on_averaged(n, **lamb_args):
    from horovod_ext.algorithms.lamb import Lamb
    model = make_model()
    opt = Lamb(model.parameters(), lr=COMMON["lr"], eps=COMMON["eps"], **lamb_args)
    history = {}
    for t in range(1, STEPS + 1):
        params = [p.detach().clone() for p in model.parameters()]
        per_rank = [grads_at(params, r, t) for r in range(n)]
        for j, p in enumerate(model.parameters()):
            p.grad = sum(g[j] for g in per_rank) / n
        opt.step()
        history[t] = [p.detach().clone() for p in model.parameters()]
    return history


def close(a, b, tol=TOL):
    return all(torch.allclose(x, y, rtol=tol, atol=tol) for x, y in zip(a, b))


# --- tests ---------------------------------------------------------------------------------------
def test_mask_density_and_determinism():
    from horovod_ext.algorithms.slamb.mask import random_k_indices, split_indices
    for k in (0.5, 0.1, 0.01):
        n = 400_000
        idx = random_k_indices(n, k, 1, 2, "w")
        assert torch.equal(idx, random_k_indices(n, k, 1, 2, "w"))
        assert not torch.equal(idx[:100], random_k_indices(n, k, 1, 3, "w")[:100])
        assert (idx[1:] > idx[:-1]).all() and 0 <= int(idx[0]) and int(idx[-1]) < n
        # Bernoulli(k): count within 6 standard deviations of k n
        assert abs(idx.numel() - k * n) < 6 * math.sqrt(n * k * (1 - k)), (k, idx.numel())
    assert torch.equal(random_k_indices(7, 1.0, 0, 1, "w"), torch.arange(7))
    assert random_k_indices(0, 0.1, 0, 1, "w").numel() == 0
    parts = split_indices(torch.tensor([0, 4, 5, 9]), [5, 3, 2])
    assert [p.tolist() for p in parts] == [[0, 4], [0], [1]]
    with pytest.raises(ValueError, match="ratio"):
        random_k_indices(10, 0.0, 0, 1, "w")


def test_lamb_matches_formula_and_zero_norms():
    from horovod_ext.algorithms.lamb import Lamb, trust_ratio
    assert trust_ratio(torch.tensor(0.0), torch.tensor(2.0), 0.01, 10).item() == 1.0
    assert trust_ratio(torch.tensor(3.0), torch.tensor(0.0)).item() == 1.0
    assert trust_ratio(torch.tensor(300.0), torch.tensor(1.0), 0.01, 10).item() == 10.0
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.randn(20, 7))
    x0 = p.detach().clone()
    opt = Lamb([p], lr=0.1, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, min_coeff=0.01,
               max_coeff=10)
    g1, g2 = torch.randn(20, 7), torch.randn(20, 7)
    m = v = torch.zeros(20, 7)
    x = x0
    for t, g in ((1, g1), (2, g2)):
        p.grad = g
        opt.step()
        m = 0.8 * m + 0.2 * g
        v = 0.99 * v + 0.01 * g * g
        u = (m / (1 - 0.8 ** t)) / ((v / (1 - 0.99 ** t)).sqrt() + 1e-6) + 0.1 * x
        x = x - 0.1 * min(max((x.norm() / u.norm()).item(), 0.01), 10) * u
    assert torch.allclose(p.detach(), x, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="betas"):
        Lamb([p], betas=(1.0, 0.9))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lamb_c_kernels_match_torch_code(dtype):
    """hvd.Lamb through the C kernels (what CPUs run) and through the torch code, every option
    that changes the arithmetic: parameters, moments and coefficients after 4 steps."""
    import itertools
    from horovod_ext.algorithms.lamb import KERNELS, Lamb
    assert KERNELS, "LAMB C kernels not built (no C compiler at install?)"
    for inside, bias, wd in itertools.product((False, True), (True, False), (0.0, 0.01)):
        runs = []
        for use_kernels in (True, False):
            torch.manual_seed(3)
            params = [torch.nn.Parameter(torch.randn(33, 17, dtype=dtype)),
                      torch.nn.Parameter(torch.zeros(17, dtype=dtype))]
            opt = Lamb(params, lr=0.05, eps=1e-6, weight_decay=wd, bias_correction=bias,
                       eps_inside_sqrt=inside, max_coeff=10.0)
            opt.native_kernels = use_kernels
            gen = torch.Generator().manual_seed(4)
            for _ in range(4):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen, dtype=dtype)
                opt.step()
            runs.append([p.detach().clone() for p in params]
                        + [opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
                        + [opt.state[p]["lamb_coeff"].double() for p in params])
        # float32: the torch code's norms are float32, the kernels' float64
        tol = 1e-6 if dtype == torch.float32 else 1e-12
        for a, b in zip(*runs):
            assert a.dtype == b.dtype or a.dim() == 0
            assert float((a - b).norm() / b.norm().clamp(min=1e-30)) < tol, (inside, bias, wd)


_REFS = {}


def _references(n, nodes):
    key = (n, tuple(nodes or ()))
    if key not in _REFS:
        refs = {
            "k1_simplified": ref_lamb_on_averaged(n, weight_decay=0.01, min_coeff=0.01,
                                                  max_coeff=0.4),
            "k1_algorithm": ref_lamb_on_averaged(n, min_coeff=0.0, max_coeff=math.inf),
            "k1_algorithm_ref": ref_slamb(n, None, 1.0, 1, "algorithm", True,
                                          min_coeff=0.0, max_coeff=math.inf),
            "sparse_algorithm": ref_slamb(n, None, K, H, "algorithm", weight_decay=0.01,
                                          max_coeff=10.0),
            "sparse_simplified_gsync": ref_slamb(n, None, K, H, "simplified", True),
        }
        refs["sparse_algorithm_in_step"] = refs["sparse_algorithm"]
        if nodes:
            refs["hier"] = ref_slamb(n, nodes, K, H, "algorithm", weight_decay=0.01,
                                     max_coeff=10.0)
        _REFS[key] = refs
    return _REFS[key]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("np_", [2, 3, 4])
def test_randomk_and_slamb(backend, np_):
    from horovod_ext.algorithms.slamb import random_k_indices, syncs_in_full
    nodes = [0, 0, 1, 1] if np_ == 4 else None
    env = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"} if nodes else None
    res = run_ranks(body_everything, np_, backend, env=env,
                    hostnames=HOSTS4 if nodes else None, timeout=120)
    assert [o["size"] for o in res] == [np_] * np_
    # the mask is the same on every rank
    assert all(torch.equal(o["mask"], res[0]["mask"]) for o in res)
    assert all(o["same_op"] for o in res)

    # RandomK equals the simulation (flat, or node average + sparse across nodes at np = 4)
    for call in (1, 2):
        datas = [[op_data(r, s, call) for s in OP_SHAPES] for r in range(np_)]
        want = ref_randomk(datas, OP_SHAPES, call, "rk", nodes)
        for r in range(np_):
            assert close(res[r]["op"][call - 1], want[r]), f"RandomK call {call} rank {r}"
    want = ref_randomk([[op_data(r, OP_SHAPES[0], 3)] for r in range(np_)], OP_SHAPES[:1], 1,
                       "rk1", nodes)
    assert all(close([res[r]["op_by_name"]], want[r]) for r in range(np_))

    # RandomK under DistributedOptimizer: every element is either the mean over ranks (the same
    # on all ranks: a fraction ~K of each large tensor) or the rank's own (or node's) gradient.
    model = make_model()
    params = [p.detach().clone() for p in model.parameters()]
    local = [grads_at(params, r, 1) for r in range(np_)]
    for j, p in enumerate(params):
        mean = sum(g[j] for g in local) / np_
        got = [o["dopt_grads"][j] for o in res]
        synced = torch.isclose(got[0], mean, rtol=TOL, atol=1e-7)
        for r in range(np_):
            own = local[r][j] if nodes is None else \
                sum(local[q][j] for q in range(np_) if nodes[q] == nodes[r]) / 2
            assert torch.where(synced, torch.isclose(got[r], mean, rtol=TOL, atol=1e-7),
                               torch.isclose(got[r], own, rtol=TOL, atol=1e-7)).all()
        frac = synced.float().mean().item()
        if syncs_in_full(p.shape):
            assert frac == 1.0
        else:
            assert abs(frac - K) < 0.05, (j, frac)

    refs = _references(np_, nodes)
    for name in SLAMB_CONFIGS:
        for t in range(1, STEPS + 1):
            for r in range(np_):
                want = refs[name][t] if name.startswith("k1") else refs[name][t][r]
                assert close(res[r][name][t], want), f"{name} step {t} rank {r}"
                if name == "k1_algorithm":
                    assert close(res[r][name][t], refs["k1_algorithm_ref"][t][r])
            # right after a model sync every rank holds the same parameters, bitwise
            same = all(all(torch.equal(a, b) for a, b in zip(o[name][t], res[0][name][t]))
                       for o in res)
            if t % H == 0 or name.startswith("k1"):
                assert same, f"{name}: ranks differ at step {t}"
        if not name.startswith("k1"):
            assert not all(torch.equal(a, b) for a, b in zip(res[0][name][1], res[1][name][1]))

    for name in ("variant_skip", "variant_accumulate", "variant_accumulate_bpps"):
        for t in range(1, STEPS + 1):
            for r in range(np_):
                assert close(res[r][name][t], refs["sparse_algorithm"][t][r]), \
                    f"{name} step {t} rank {r}"

    # bytes of the last step (6 = a model-sync step): masked momentum (and gradients) + the
    # tensors synced in full + every parameter for the model sync
    shapes = [p.shape for p in make_model().parameters()]
    n_full = sum(math.prod(s) for s in shapes if syncs_in_full(s))
    n_all = sum(math.prod(s) for s in shapes)
    n_sel = random_k_indices(n_all - n_full, K, 0, STEPS, "SLAMB").numel()
    for r in range(np_):
        last, total, synced = res[r]["sparse_algorithm_bytes"]
        assert synced and last == 4 * (n_sel + n_full + n_all), (last, n_sel, n_full, n_all)
        last, _, _ = res[r]["sparse_simplified_gsync_bytes"]
        assert last == 4 * (2 * (n_sel + n_full) + n_all)

    if nodes:
        # across nodes, the two ranks of a node send one share each of the sparse buffer and
        # of the model; inside the node, every gradient
        assert sum(res[r]["hier_bytes"][0] for r in (0, 1)) == 4 * (n_sel + n_full + n_all)
        assert all(res[r]["hier_bytes"][1] == 4 * n_all for r in range(np_))
        for t in range(1, STEPS + 1):
            for r in range(np_):
                assert close(res[r]["hier"][t], refs["hier"][t][r]), f"hier step {t} rank {r}"
            # ranks of a node hold bitwise the same parameters at every step
            for a, b in ((0, 1), (2, 3)):
                assert all(torch.equal(x, y) for x, y in zip(res[a]["hier"][t], res[b]["hier"][t]))

    assert all(o["resume_bitwise"] for o in res)


@pytest.mark.timeout(120)
def test_c_kernels_match_torch_code():
    built, worst = run_ranks(body_kernels_match_torch, 1, "gloo", timeout=100)[0]
    assert built, "LAMB C kernels not built (no C compiler at install?)"
    # float32: the torch code's norms are float32, the kernels' float64
    assert worst[str(torch.float32)] < 1e-6 and worst[str(torch.float64)] < 1e-12, worst


@pytest.mark.timeout(60)
def test_slamb_size_one_equals_lamb():
    diff, finite = run_ranks(body_size_one, 1, "gloo")[0]
    assert diff < 1e-6 and finite
