"""1-bit compression, compressed allreduce, hvd.OneBit, OnebitAdam and OnebitLamb against
single-process simulations of n workers and servers written here, over real Gloo and MPI ranks.

One 4-process run per backend covers 1 to 4 ranks: groups of 2, 3 (+ 1) and 4 split from the
world run the compressed allreduce and both optimizers (``topology=``), also with elements whose
gradient is 0 through the warm-up and a 50-step MLP with a dead unit; the world also runs the
public op, the optimizers through the job's context, and the bitwise resume.  A third run checks
the hierarchical variant on 2 nodes x 2.
"""
import math
import os
import tempfile

import pytest
import torch

from tests.harness import BACKENDS, run_ranks

# (numel, layer lengths or None, dtype): odd lengths, an empty layer, fewer elements than ranks
CASES = [(1000, None, torch.float32), (37, [10, 0, 27], torch.float32), (5, None, torch.float32),
         (257, [100, 157], torch.float16), (129, None, torch.bfloat16), (64, [64], torch.float64)]
CALLS = 6
TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.float64: dict(rtol=1e-12, atol=1e-12),
       torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
OPT_TOL = dict(rtol=1e-5, atol=1e-6)   # optimizers: ranks average in another order than here
SHAPES = [(5, 7), (5,), (3,)]          # the last parameter never gets a gradient
STEPS, FREEZE = 7, 3
DEAD = [(0, (2,)), (1, (1,))]          # (parameter, index): no gradient in the warm-up (grads_dead)


def data(rank, call, numel, dtype, seed=0):
    g = torch.Generator().manual_seed(10007 * seed + 101 * call + rank)
    return (torch.randn(numel, generator=g) + 0.3).to(dtype)


# --- the reference: n workers and servers in one process ------------------------------------
def sim_scales(x, lengths):
    """||s|| / sqrt(len s) per segment s, rounded to x's dtype, as float32 (float64)."""
    sd = torch.float64 if x.dtype == torch.float64 else torch.float32
    return [(s.double().norm() / math.sqrt(len(s))).to(x.dtype).to(sd)
            for s in torch.split(x, lengths)]


def sim_compress(x, lengths):
    """sign(x) * ||s|| / sqrt(len s) per segment s, scales rounded to x's dtype."""
    return torch.cat([torch.where(s >= 0, 1.0, -1.0).to(x.dtype) * scale.to(x.dtype)
                      for s, scale in zip(torch.split(x, lengths), sim_scales(x, lengths))])


class SimAllreduce:
    """Worker errors per rank, server errors per chunk; chunks of ceil(numel / 8n) bytes."""

    def __init__(self, n, numel, lengths, dtype):
        self.n, self.numel, self.dtype = n, numel, dtype
        self.lengths = [x for x in (lengths or [numel]) if x]
        self.chunk = 8 * math.ceil(numel / (8 * n))
        self.worker = [torch.zeros(numel, dtype=dtype) for _ in range(n)]
        self.server = torch.zeros(numel, dtype=dtype)
        self.bytes = [0] * n
        self.max_scales = [torch.zeros(len(self.lengths)) for _ in range(n)]

    def pieces(self, lo, hi):
        out, pos = [], 0
        for length in self.lengths:
            a, b = max(pos, lo), min(pos + length, hi)
            if a < b:
                out.append(b - a)
            pos += length
        return out

    def __call__(self, inputs):
        n, sd = self.n, torch.float64 if self.dtype == torch.float64 else torch.float32
        sent, signs, scaled = [], [], []
        for r in range(n):
            c = self.worker[r] + inputs[r]
            sent.append(sim_compress(c, self.lengths))
            self.max_scales[r] = torch.maximum(self.max_scales[r],
                                               torch.stack(sim_scales(c, self.lengths)).float())
            self.worker[r] = c - sent[r]
            # what a server rebuilds: sign * (scale / n) in float32 (float64), 1/n in the scale
            signs.append(torch.where(c >= 0, 1.0, -1.0).to(sd))
            scaled.append(torch.cat([(scale / n).expand(length) for scale, length in
                                     zip(sim_scales(c, self.lengths), self.lengths)]))
        out = torch.empty(self.numel, dtype=self.dtype)
        for k in range(n):
            lo, hi = k * self.chunk, min((k + 1) * self.chunk, self.numel)
            pieces = self.pieces(lo, hi) if lo < hi else []
            if pieces:
                total = None
                for r in range(n):  # in rank order
                    part = signs[r][lo:hi] * scaled[r][lo:hi]
                    total = part if total is None else total + part
                s = self.server[lo:hi] + total.to(self.dtype)
                out[lo:hi] = sim_compress(s, pieces)
                self.server[lo:hi] = s - out[lo:hi]
            item = 8 if self.dtype == torch.float64 else 4
            self.bytes[k] += (n - 1) * (2 * self.chunk // 8 + (len(self.lengths) + len(pieces)) * item)
        return out


def init_params():
    g = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=g) for s in SHAPES]


def grads_of(rank, step, params):
    """Gradient of 0.5 ||p - target||^2 with a rank- and step-specific target; none for the
    last parameter."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = [p - torch.randn(p.shape, generator=g) for p in params[:-1]]
    return out + [None]


def grads_dead(rank, step, params):
    """grads_of with the DEAD elements at exactly 0 through the warm-up (a dead unit: their
    frozen variance is 0) and 100 times larger after it (the unit comes back to life)."""
    out = grads_of(rank, step, params)
    for i, index in DEAD:
        out[i][index] = 0.0 if step <= FREEZE else 100.0 * out[i][index]
    return out


def dead_mask(params):
    """Per parameter, True where grads_dead gives 0 through the warm-up: the DEAD elements and
    the last parameter."""
    masks = [torch.zeros(p.shape, dtype=torch.bool) for p in params]
    for i, index in DEAD:
        masks[i][index] = True
    masks[-1][:] = True
    return masks


class OneRank:
    """A communicator of one rank, with what the compressed allreduce calls."""
    rank, size = 0, 1

    def alltoall(self, t, send, recv):
        return t.clone()

    def allgather(self, t, counts):
        return t.clone()


def one_rank_topology():
    from horovod_ext.backends.topology import Topology
    one = OneRank()
    return Topology(world=one, local=one, cross=one, hostnames=["h"], node_of=[0],
                    local_rank=0, local_size=1, cross_rank=0, cross_size=1,
                    is_homogeneous=True)


def sim_optimizer(kind, ranks, steps, freeze, lr=0.01, betas=(0.9, 0.999), eps=1e-8, wd=0.01,
                  coeff_beta=0.9, fmin=0.5, fmax=4.0, thr=0.1, cmin=0.01, cmax=10.0,
                  grads_fn=grads_of, sims=None):
    """1-bit Adam / 1-bit LAMB as their Algorithm 1 on simulated workers (the gradients of
    ``ranks``); the parameters after each step.  Elements whose frozen variance is 0 have their
    momentum held at 0 before and after the compressed allreduce.  ``sims``: a list that gets
    the simulated allreduce."""
    b1, b2 = betas
    n = len(ranks)
    params = init_params()
    numels = [p.numel() for p in params]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    c_avg = [0.0] * len(params)
    comm = SimAllreduce(n, sum(numels), numels if kind == "adam" else None, torch.float32)
    if sims is not None:
        sims.append(comm)
    history = []
    for t in range(1, steps + 1):
        grads = [[g if g is not None else torch.zeros_like(p)
                  for g, p in zip(grads_fn(r, t, params), params)] for r in ranks]
        if t <= freeze:
            for i, p in enumerate(params):
                g = sum(grads[r][i] for r in range(n)) / n
                m[i] = b1 * m[i] + (1 - b1) * g
                v[i] = b2 * v[i] + (1 - b2) * g * g
                u = m[i] / (v[i].sqrt() + eps) + wd * p
                if kind == "adam":
                    params[i] = p - lr * u
                else:
                    pn, un = float(p.norm()), float(u.norm())
                    c = min(max(pn / un if pn > 0 and un > 0 else 1.0, cmin), cmax)
                    c_avg[i] = coeff_beta * c_avg[i] + (1 - coeff_beta) * c
                    params[i] = p - lr * c * u
            zero = [x == 0 for x in v]
            if t == freeze and kind == "lamb":
                c_frozen = [c / (1 - coeff_beta ** t) for c in c_avg]
                scales = [float(x.norm()) / math.sqrt(x.numel()) for x in m]
                united = sum(scales) / len(scales)
                coeff = [united / s if s > 0 else 1.0 for s in scales]
                v_fresh = [x.clone() for x in v]
                r_last = [1.0] * len(params)
        else:
            coeff_t = coeff if kind == "lamb" else [1.0] * len(params)
            local = [torch.cat([((b1 * m[i] + (1 - b1) * grads[r][i]) * coeff_t[i])
                                .masked_fill(zero[i], 0.0).reshape(-1)
                                for i in range(len(params))]) for r in range(n)]
            avg = torch.split(comm(local), numels)
            m_prev = m
            m = [(a.view_as(p) / coeff_t[i]).masked_fill(zero[i], 0.0)
                 for i, (a, p) in enumerate(zip(avg, params))]
            m[-1] = m[-1] * 0.0   # exp_avg_mask
            for i, p in enumerate(params):
                u = m[i] / (v[i].sqrt() + eps) + wd * p
                if kind == "adam":
                    params[i] = p - lr * u
                    continue
                g = (m[i] - b1 * m_prev[i]) / (1 - b1)
                v_fresh[i] = b2 * v_fresh[i] + (1 - b2) * g * g
                ratio = torch.where((v[i] == 0) & (v_fresh[i] == 0), 0.0, v[i] / v_fresh[i])
                r_t = min(max(float(ratio.max()), (1 - thr) * r_last[i]), (1 + thr) * r_last[i])
                r_t = min(max(r_t, fmin), fmax)
                r_last[i] = r_t
                params[i] = p - lr * r_t * c_frozen[i] * u
        history.append([p.clone() for p in params])
    return history


# --- bodies run in every rank ---------------------------------------------------------------
def _train(opt_cls, topology, steps, rank, name, weight_decay=0.01, grads_fn=grads_of, **kw):
    params = [torch.nn.Parameter(p) for p in init_params()]
    # DeepSpeed's exp_avg_mask keeps the never-trained parameter's momentum at exactly 0, which
    # one scale for the fused buffer (1-bit LAMB) cannot represent
    groups = [{"params": params[:-1]}, {"params": params[-1:], "exp_avg_mask": torch.zeros(3)}]
    opt = opt_cls(groups, lr=0.01, weight_decay=weight_decay, topology=topology,
                  hierarchical=False, name=name, **kw)
    history = []
    for t in range(1, steps + 1):
        for p, g in zip(params, grads_fn(rank, t, [p.detach() for p in params])):
            p.grad = g
        opt.step()
        history.append([p.detach().clone() for p in params])
    return history, opt.bytes_sent


MLP_STEPS, MLP_FREEZE, MLP_DEAD = 50, 4, 5   # MLP_DEAD: the hidden unit that never fires
MLP_SIZES = (2, 3)                           # groups of 2, 2 and 3, 1 (Gloo only)
MLP_LR = {"adam": 0.01, "lamb": 0.01}
MLP_LOSS_DROP = 0.75                         # mean of the last 10 losses / mean in the warm-up


def mlp_batch(rank, step):
    """A rank's regression batch; input feature 3 is always 0 (its first-layer weights are
    never used)."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    x = torch.randn(32, 4, generator=g)
    x[:, 3] = 0.0
    return x, torch.sin(x[:, :1]) + 0.5 * x[:, 1:2] - 0.3 * x[:, 2:3] ** 2


def mlp_frozen_zeros(params):
    """Per MLP parameter, where its gradient is 0 at every step: the dead unit's weights in and
    out, its bias, the weights of the unused input feature."""
    masks = [torch.zeros(p.shape, dtype=torch.bool) for p in params]
    masks[0][MLP_DEAD] = True
    masks[0][:, 3] = True
    masks[1][MLP_DEAD] = True
    masks[2][:, MLP_DEAD] = True
    return masks


def _train_mlp(opt_cls, topology, rank, name, lr, **kw):
    """4 -> 8 -> 1 ReLU MLP with a dead hidden unit: (per-step losses, parameters after the
    freeze step, final parameters)."""
    g = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        model[0].bias[MLP_DEAD] = -100.0
    opt = opt_cls(model.parameters(), lr=lr, freeze_step=MLP_FREEZE, topology=topology,
                  hierarchical=False, name=name, **kw)
    losses, at_freeze = [], None
    for t in range(1, MLP_STEPS + 1):
        x, y = mlp_batch(rank, t)
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if t == MLP_FREEZE:
            at_freeze = [p.detach().clone() for p in model.parameters()]
    return losses, at_freeze, [p.detach().clone() for p in model.parameters()]


def _groups_body(mlp):
    """Per group size: compressed allreduce cases, OnebitAdam, OnebitLamb on split groups; with
    ``mlp``, the dead-unit MLP on groups of MLP_SIZES."""
    from horovod_ext.backends import context
    from horovod_ext.backends.topology import Topology
    from horovod_ext.algorithms.onebit import ErrorFeedback, OnebitAdam, OnebitLamb, compressed_allreduce_

    def run(topology):
        r = topology.rank
        results = {}
        for size in (2, 3, 4):
            g = topology.world.split(0 if r < size else 1)
            topo = Topology(world=g, local=g, cross=g, hostnames=["h"] * g.size,
                            node_of=[0] * g.size, local_rank=g.rank, local_size=g.size,
                            cross_rank=0, cross_size=1, is_homogeneous=True)
            cases = []
            for numel, lengths, dtype in CASES:
                errors, outs = ErrorFeedback(), []
                for call in range(CALLS):
                    x = data(r, call, numel, dtype)
                    outs.append(compressed_allreduce_(x, g, errors, lengths))
                cases.append((outs, errors.worker, errors.server, errors.bytes_sent))
            adam = _train(OnebitAdam, topo, STEPS, r, f"adam{size}", freeze_step=FREEZE)
            lamb = _train(OnebitLamb, topo, STEPS, r, f"lamb{size}", freeze_step=FREEZE)
            lamb1 = _train(OnebitLamb, topo, 3, r, f"lamb1.{size}", freeze_step=1)
            results[size] = dict(group=g.size, cases=cases, adam=adam, lamb=lamb, lamb1=lamb1)
            for kind, cls in (("adam", OnebitAdam), ("lamb", OnebitLamb)):
                results[size][kind + "_dead"] = _train(cls, topo, STEPS, r, f"{kind}d{size}",
                                                       freeze_step=FREEZE, grads_fn=grads_dead)
                if mlp and size in MLP_SIZES:
                    results[size][kind + "_mlp"] = _train_mlp(cls, topo, r, f"{kind}m{size}",
                                                              MLP_LR[kind])
        return results

    return context.current().execute("test.onebit.groups", run)


def _resume(opt_cls, path, k, m, rank, **kw):
    """k steps, save (one file per rank), m more; then a fresh model and optimizer restored
    from the file run the same m steps.  Both final parameter lists."""
    def make():
        params = [torch.nn.Parameter(p) for p in init_params()]
        return params, opt_cls(params, lr=0.01, weight_decay=0.01, freeze_step=3,
                               name=f"resume.{opt_cls.__name__}", **kw)

    def steps(params, opt, first, count):
        for t in range(first, first + count):
            for p, g in zip(params, grads_of(rank, t, [p.detach() for p in params])):
                p.grad = g
            opt.step()

    params, opt = make()
    steps(params, opt, 1, k)
    torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, path)
    steps(params, opt, k + 1, m)
    straight = [p.detach().clone() for p in params]
    params, opt = make()
    saved = torch.load(path, weights_only=False)
    with torch.no_grad():
        for p, s in zip(params, saved["params"]):
            p.copy_(s)
    opt.load_state_dict(saved["opt"])
    steps(params, opt, k + 1, m)
    return straight, [p.detach().clone() for p in params]


def _world_body(tmpdir):
    """The public API on the world: hvd.OneBit (named, grouped, from DistributedOptimizer),
    optimizers through the context, resume, warm-up with bias correction."""
    import horovod_ext.torch as hvd
    from horovod_ext.algorithms.onebit import OnebitAdam, OnebitLamb
    r = hvd.rank()
    out = {"single": [], "grouped": []}
    for call in range(CALLS):
        out["single"].append(hvd.allreduce(data(r, call, 300, torch.float32, seed=1),
                                           op=hvd.OneBit, name="ob.single"))
        a, b = data(r, call, 40, torch.float32, seed=2), data(r, call, 21, torch.float32, seed=3)
        out["grouped"].append(hvd.grouped_allreduce([a, b.view(3, 7)], op=hvd.OneBit,
                                                    name="ob.grouped"))
    out["op_bytes"] = hvd.OneBit.bytes_sent
    try:
        hvd.allreduce(torch.ones(4, dtype=torch.int32), op=hvd.OneBit, name="ob.int")
        out["int_error"] = None
    except TypeError as exc:
        out["int_error"] = str(exc)
    # DistributedOptimizer(op=OneBit): one request per gradient, every rank ends equal
    model = torch.nn.Linear(6, 3)
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.OneBit)
    for t in range(3):
        opt.zero_grad()
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(100 * t + r))
        model(x).square().sum().backward()
        opt.step()
    out["dist_opt"] = [p.detach().clone() for p in model.parameters()]
    out["adam_ctx"] = _train(OnebitAdam, None, STEPS, r, None, freeze_step=FREEZE)
    out["lamb_ctx"] = _train(OnebitLamb, None, STEPS, r, None, freeze_step=FREEZE)
    out["adam_bc"] = _train(OnebitAdam, None, 3, r, "bc", freeze_step=100, bias_correction=True,
                             weight_decay=0.0)
    out["resume_adam"] = _resume(OnebitAdam, os.path.join(tmpdir, f"adam{r}.pt"), 4, 3, r)
    out["resume_lamb"] = _resume(OnebitLamb, os.path.join(tmpdir, f"lamb{r}.pt"), 4, 3, r)
    out["resume_lamb_early"] = _resume(OnebitLamb, os.path.join(tmpdir, f"lambe{r}.pt"), 2, 3, r)
    return out


def _body(tmpdir, mlp):
    return _groups_body(mlp), _world_body(tmpdir)


def _hier_body():
    import horovod_ext.torch as hvd
    from horovod_ext.algorithms.onebit import OnebitAdam
    r = hvd.rank()
    outs = [hvd.allreduce(data(r, call, 203, torch.float32, seed=4), op=hvd.OneBit, name="h")
            for call in range(CALLS)]
    params = [torch.nn.Parameter(p) for p in init_params()]
    opt = OnebitAdam(params, lr=0.01, freeze_step=1)
    for t in range(1, 4):
        for p, g in zip(params, grads_of(r, t, [p.detach() for p in params])):
            p.grad = g
        opt.step()
    # a warm-up only (hierarchical full-precision average): Adam on the averaged gradients
    warm = [torch.nn.Parameter(p) for p in init_params()]
    opt = OnebitAdam(warm, lr=0.01, eps=1e-8, freeze_step=100, bias_correction=True)
    for t in range(1, 4):
        for p, g in zip(warm, grads_of(r, t, [p.detach() for p in warm])):
            p.grad = g
        opt.step()
    return (outs, [p.detach() for p in params], hvd.local_size(), hvd.cross_size(),
            [p.detach() for p in warm])


# --- checks ---------------------------------------------------------------------------------
def adam_on_averaged_gradients(steps: int):
    """torch.optim.Adam's parameters after ``steps`` steps on the 4 ranks' averaged gradients
    (zeros where the ranks have none): what a 1-bit optimizer's warm-up must give."""
    params = [torch.nn.Parameter(p) for p in init_params()]
    ref = torch.optim.Adam(params, lr=0.01, eps=1e-8)
    for t in range(1, steps + 1):
        per_rank = [grads_of(r, t, [p.detach() for p in params]) for r in range(4)]
        with torch.no_grad():
            for i, p in enumerate(params):
                grads = [g[i] for g in per_rank]
                p.grad = sum(grads) / 4 if grads[0] is not None else torch.zeros_like(p)
        ref.step()
    return params


def check_mlp(losses, at_freeze, final, what):
    """Finite, the loss falls, the parameters that never had a gradient did not move after
    the freeze."""
    assert all(math.isfinite(x) for x in losses), (what, losses)
    assert all(torch.isfinite(p).all() for p in final), what
    first, last = sum(losses[:MLP_FREEZE]) / MLP_FREEZE, sum(losses[-10:]) / 10
    assert last < MLP_LOSS_DROP * first, (what, first, last)
    for a, b, mask in zip(final, at_freeze, mlp_frozen_zeros(final)):
        assert torch.equal(a[mask], b[mask]), what


def check_opt(history, expected, what):
    assert len(history) == len(expected)
    for t, (got, exp) in enumerate(zip(history, expected)):
        for i, (a, b) in enumerate(zip(got, exp)):
            torch.testing.assert_close(a, b, **OPT_TOL, msg=lambda m: f"{what} step {t + 1} "
                                                                       f"param {i}: {m}")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", BACKENDS)
def test_onebit_every_process_count(backend):
    with tempfile.TemporaryDirectory() as tmp:
        # the MLP runs over Gloo only: the optimizers do not depend on the backend, and 200
        # more steps cost 4 oversubscribed MPI ranks far more time
        mlp = backend == "gloo"
        results = run_ranks(_body, 4, backend, args=(tmp, mlp), timeout=120)
    groups = [g for g, _ in results]
    world = [w for _, w in results]
    for size in (2, 3, 4):
        for members in (range(0, size), range(size, 4)):
            n = len(members)
            if n == 0:
                continue
            for ci, (numel, lengths, dtype) in enumerate(CASES):
                sim = SimAllreduce(n, numel, lengths, dtype)
                expected = [sim([data(r, call, numel, dtype) for r in members])
                            for call in range(CALLS)]
                for j, r in enumerate(members):
                    res = groups[r][size]
                    assert res["group"] == n
                    outs, worker, server, sent = res["cases"][ci]
                    what = f"{backend} group {list(members)} rank {r} case {ci}"
                    for call in range(CALLS):
                        assert outs[call].dtype == dtype
                        torch.testing.assert_close(outs[call], expected[call], **TOL[dtype],
                                                   msg=lambda m: f"{what} call {call}: {m}")
                    torch.testing.assert_close(worker, sim.worker[j], **TOL[dtype])
                    lo, hi = j * sim.chunk, min((j + 1) * sim.chunk, numel)
                    if lo < hi:
                        torch.testing.assert_close(server[:hi - lo], sim.server[lo:hi], **TOL[dtype])
                    assert sent == sim.bytes[j], what
            for kind in ("adam", "lamb"):
                expected = sim_optimizer(kind, list(members), STEPS, FREEZE)
                for r in members:
                    history, sent = groups[r][size][kind]
                    check_opt(history, expected, f"{backend} {kind} n={n} rank {r}")
                    assert (sent > 0) == (n > 1)
            expected = sim_optimizer("lamb", list(members), 3, 1)
            for r in members:
                history, _ = groups[r][size]["lamb1"]
                check_opt(history, expected, f"{backend} lamb freeze_step=1 n={n}")
                # freeze_step=1 keeps moving (the frozen coefficient is not 0)
                assert not torch.equal(history[-1][0], history[-2][0])
            # frozen variance 0 (no gradient in the warm-up): no momentum step, on every rank
            for kind in ("adam", "lamb"):
                expected = sim_optimizer(kind, list(members), STEPS, FREEZE,
                                         grads_fn=grads_dead)
                for r in members:
                    history, _ = groups[r][size][kind + "_dead"]
                    check_opt(history, expected, f"{backend} {kind} frozen zeros n={n} rank {r}")
                if not mlp or size not in MLP_SIZES:
                    continue
                final = groups[members[0]][size][kind + "_mlp"][2]
                for r in members:
                    losses, at_freeze, params = groups[r][size][kind + "_mlp"]
                    check_mlp(losses, at_freeze, params, f"{backend} {kind} MLP n={n} rank {r}")
                    for a, b in zip(params, final):
                        assert torch.equal(a, b), (backend, kind, n, r)
    # the world: op, grouped op, DistributedOptimizer, optimizers via the context
    sim_single = SimAllreduce(4, 300, None, torch.float32)
    sim_group = SimAllreduce(4, 61, [40, 21], torch.float32)
    for call in range(CALLS):
        e1 = sim_single([data(r, call, 300, torch.float32, seed=1) for r in range(4)])
        e2 = sim_group([torch.cat([data(r, call, 40, torch.float32, seed=2),
                                   data(r, call, 21, torch.float32, seed=3)]) for r in range(4)])
        for r in range(4):
            torch.testing.assert_close(world[r]["single"][call], e1, **TOL[torch.float32])
            a, b = world[r]["grouped"][call]
            assert b.shape == (3, 7)
            torch.testing.assert_close(torch.cat([a, b.reshape(-1)]), e2, **TOL[torch.float32])
    for r in range(4):
        assert world[r]["int_error"] and "floating-point" in world[r]["int_error"]
        assert world[r]["op_bytes"] == sim_single.bytes[r] + sim_group.bytes[r]
        for a, b in zip(world[r]["dist_opt"], world[0]["dist_opt"]):
            assert torch.equal(a, b)
        check_opt(world[r]["adam_ctx"][0], sim_optimizer("adam", range(4), STEPS, FREEZE), "adam ctx")
        check_opt(world[r]["lamb_ctx"][0], sim_optimizer("lamb", range(4), STEPS, FREEZE), "lamb ctx")
        for key in ("resume_adam", "resume_lamb", "resume_lamb_early"):
            straight, resumed = world[r][key]
            for a, b in zip(straight, resumed):
                assert torch.equal(a, b), (backend, key, r)
    # warm-up with bias_correction=True is torch.optim.Adam on the averaged gradients
    params = adam_on_averaged_gradients(steps=3)
    for r in range(4):
        got = world[r]["adam_bc"][0][-1]
        for a, b in zip(got[:-1], params[:-1]):
            torch.testing.assert_close(a, b.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(60)
def test_hierarchical_two_nodes():
    """2 nodes x 2 ranks: exact average inside the node, compressed across the nodes."""
    results = run_ranks(_hier_body, 4, "gloo", hostnames=["a", "a", "b", "b"],
                        env={"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}, timeout=50)
    numel, shards = 203, [102, 101]
    sims = [SimAllreduce(2, length, None, torch.float32) for length in shards]
    for call in range(CALLS):
        x = [data(r, call, numel, torch.float32, seed=4) for r in range(4)]
        node_means = [(x[0] + x[1]) / 2, (x[2] + x[3]) / 2]
        parts, lo = [], 0
        for sim, length in zip(sims, shards):
            parts.append(sim([m[lo:lo + length] for m in node_means]))
            lo += length
        expected = torch.cat(parts)
        for r in range(4):
            torch.testing.assert_close(results[r][0][call], expected, **TOL[torch.float32])
    for r in range(4):
        assert results[r][2:4] == (2, 2)
        for a, b in zip(results[r][1], results[0][1]):
            assert torch.equal(a, b) and torch.isfinite(a).all()
    params = adam_on_averaged_gradients(steps=3)
    for r in range(4):
        for a, b in zip(results[r][4][:-1], params[:-1]):
            torch.testing.assert_close(a, b.detach(), rtol=1e-4, atol=1e-5)


# --- local checks (no processes) ------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_pack_unpack_against_bits(dtype):
    from horovod_ext.algorithms.onebit import compress, decompress, pack_signs, unpack_signs
    from horovod_ext.algorithms.onebit.compression import BLOCK
    # several cache blocks, segments crossing block boundaries and starting mid-byte
    for n in (1, 7, 8, 9, 64, 1001, 2 * BLOCK + 13):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
        x[::5] = 0.0                      # zero encodes as +1
        x[3::7] = -0.0                    # so does -0.0
        packed = pack_signs(x)
        assert packed.dtype == torch.uint8 and packed.numel() == (n + 7) // 8
        flags = torch.ones(8 * packed.numel(), dtype=torch.int64)
        flags[:n] = (x >= 0).long()
        expected = (flags.view(-1, 8) << torch.arange(8)).sum(1)
        assert torch.equal(packed.long(), expected), n
        assert torch.equal(unpack_signs(packed, n, dtype), torch.where(x >= 0, 1.0, -1.0).to(dtype))
        lengths = [n] if n < 3 else [n // 3, n - n // 3 - n // 5, n // 5]
        p2, scales = compress(x, lengths)
        assert torch.equal(p2, packed)
        reference = sim_compress(x, lengths)
        torch.testing.assert_close(decompress(p2, scales, lengths, dtype), reference, **TOL[dtype])
        # what the scales decompress to is exactly sign * scale
        signs = torch.where(x >= 0, 1.0, -1.0).to(dtype)
        per_elem = torch.cat([s.to(dtype).expand(k) for s, k in zip(scales, lengths)])
        assert torch.equal(decompress(p2, scales, lengths, dtype), signs * per_elem)
        # the decompressed tensor keeps each segment's l2 norm
        for seg, back in zip(torch.split(x, lengths), torch.split(reference, lengths)):
            assert math.isclose(float(seg.double().norm()), float(back.double().norm()),
                                rel_tol=1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_c_kernels_match_torch_code(dtype):
    """The C kernels (what CPUs run) against the torch code (what GPUs and builds without a
    compiler run): every value and sign bit equal, the scales within one rounding."""
    from horovod_ext.algorithms.onebit import compression as C
    assert C._LIB is not None, "onebit C kernels not built (no C compiler at install?)"
    sdtype = C.scale_dtype(dtype)

    def phases(seed, n, lengths, nparts, pending):
        g = torch.Generator().manual_seed(seed)
        error = torch.randn(n, generator=g).to(dtype)
        error[::11] = 0.0
        dense = torch.randn(n, generator=g).to(dtype)
        pend = (torch.rand(len(lengths), generator=g) + 0.1).to(sdtype) if pending else None
        parts = [(torch.randint(0, 256, (C.packed_bytes(n),), generator=g, dtype=torch.uint8),
                  (torch.rand(len(lengths), generator=g) + 0.5).to(sdtype))
                 for _ in range(nparts)]
        packed = torch.zeros(C.packed_bytes(n), dtype=torch.uint8)
        ws = C.Workspace()
        scales = C.compensate_compress_(error, lengths, packed, ws, pending=pend, dense=dense,
                                        packed=parts, divisor=max(nparts, 1))
        unit = torch.ones(len(lengths), dtype=sdtype)
        signs = C.decompress_into(packed, unit, lengths, torch.empty(n, dtype=dtype), ws)
        settled = C.settle_error_(error.clone(), unit * 0.25, lengths, ws)
        x = torch.randn(n, generator=g).to(dtype)
        x[::7] = -0.0
        p2, s2 = C.compress(x, lengths)
        return [error, packed, signs, settled, p2], [scales, s2]

    cases = [(37, [10, 0, 27]), (5, [5]), (1000, [1000]), (2 * 2048 + 13, [3, 2000, 2106]),
             (3 * C.BLOCK + 5, [C.BLOCK - 3, 2 * C.BLOCK + 8])]
    for seed, (n, lengths) in enumerate(cases):
        for nparts in (0, 1, 3):
            for pending in (False, True):
                native_exact, native_scales = phases(seed, n, lengths, nparts, pending)
                kernels, C._KERNELS = C._KERNELS, {}
                try:
                    torch_exact, torch_scales = phases(seed, n, lengths, nparts, pending)
                finally:
                    C._KERNELS = kernels
                for a, b in zip(native_exact, torch_exact):
                    assert torch.equal(a, b), (n, lengths, nparts, pending)
                for a, b in zip(native_scales, torch_scales):
                    nonzero = torch.tensor(lengths) > 0
                    torch.testing.assert_close(a[nonzero], b[nonzero], atol=0,
                                               rtol=8 * torch.finfo(dtype).eps)


@pytest.mark.timeout(30)
def test_bytes_and_error_compensation_single_process():
    from horovod_ext.algorithms.onebit import ErrorFeedback, compressed_allreduce_, compressed_bytes
    for n in (2, 3, 4, 8):
        for numel in (1 << 18, 1 << 22):   # 1 MiB and 16 MiB of float32
            ring = 2 * (n - 1) / n * 4 * numel
            assert compressed_bytes(numel, n) * 25 <= ring, (n, numel)
    # error compensation: the sum of outputs tracks the sum of inputs (telescoping errors)
    n, numel = 3, 500
    sim = SimAllreduce(n, numel, [200, 300], torch.float32)
    total_in, total_out = torch.zeros(numel), torch.zeros(numel)
    for call in range(40):
        x = [data(r, call, numel, torch.float32, seed=9) for r in range(n)]
        total_in += sum(x) / n
        total_out += sim(x)
        residual = sum(sim.worker) / n + sim.server
        torch.testing.assert_close(total_out + residual, total_in, rtol=1e-4, atol=1e-3)
        assert float((total_out - total_in).norm()) < 3 * float((sum(x) / n).norm())
    # size 1 runs the same algorithm without communication; misuse is a clear error
    errors, sim1 = ErrorFeedback(), SimAllreduce(1, 50, None, torch.float32)
    for call in range(3):
        x = data(0, call, 50, torch.float32)
        torch.testing.assert_close(compressed_allreduce_(x, OneRank(), errors), sim1([x.clone()]),
                                   rtol=0, atol=0)
    assert errors.bytes_sent == 0
    with pytest.raises(ValueError, match="error state"):
        compressed_allreduce_(torch.ones(51), OneRank(), errors)


def test_optimizer_arguments():
    from horovod_ext.algorithms.onebit import OnebitAdam, OnebitLamb
    p = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(ValueError, match="freeze_step"):
        OnebitAdam(p, freeze_step=0)
    with pytest.raises(ValueError, match="freeze_step"):
        OnebitLamb(p, freeze_step=0)
    with pytest.raises(TypeError, match="unexpected"):
        OnebitLamb(p, max_cooeff=3.0)
    OnebitLamb(p, deepspeed=None, cuda_aware=False, comm_backend_name="nccl")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_frozen_zero_variance_single_process(kind, weight_decay, caplog):
    """Regression: elements whose gradient is exactly 0 through the warm-up (a dead unit, a
    parameter never used) have a frozen variance of 0, which 1-bit compression cannot match
    (it never sends 0): ``sign * scale / (0 + eps)`` put them ~1e6 away and the parameters were
    NaN a few steps after the freeze.  Step by step against sim_optimizer (the rule written
    out) to OPT_TOL; those elements take no momentum step (weight decay only), and their
    worker error stays within the largest scale of their layer although their gradient comes
    back 100 times larger after the freeze."""
    from horovod_ext.algorithms.onebit import OnebitAdam, OnebitLamb
    steps, lr = 12, 0.01
    params = [torch.nn.Parameter(p) for p in init_params()]
    opt = (OnebitAdam if kind == "adam" else OnebitLamb)(
        params, lr=lr, weight_decay=weight_decay, freeze_step=FREEZE,
        topology=one_rank_topology(), hierarchical=False)
    history = []
    for t in range(1, steps + 1):
        for p, g in zip(params, grads_dead(0, t, [p.detach() for p in params])):
            p.grad = g
        opt.step()
        history.append([p.detach().clone() for p in params])
    assert all(torch.isfinite(p).all() for ps in history for p in ps)
    dead_count = sum(int(m.sum()) for m in dead_mask(params))
    warned = [r.getMessage() for r in caplog.records if "1-bit:" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(f"1-bit: {dead_count} of "), warned
    assert "freeze_step" in warned[0]
    sims = []
    expected = sim_optimizer(kind, [0], steps, FREEZE, lr=lr, wd=weight_decay,
                             grads_fn=grads_dead, sims=sims)
    check_opt(history, expected, f"{kind} wd={weight_decay}")
    dead = dead_mask(params)
    for p, mask in zip(params, dead):
        assert torch.equal(opt.state[p]["exp_avg_sq"] == 0, mask)   # the case is as meant
        assert not opt.state[p]["exp_avg"][mask].any()
    for t in range(FREEZE, steps):
        for i, mask in enumerate(dead):
            now, frozen = history[t][i][mask], history[FREEZE - 1][i][mask]
            if weight_decay == 0.0:
                assert torch.equal(now, frozen), (t, i)
            elif kind == "adam":   # x (1 - lr wd)^k; float32 rounding of 2 ops a step
                decayed = frozen * (1 - lr * weight_decay) ** (t + 1 - FREEZE)
                torch.testing.assert_close(now, decayed, rtol=1e-5, atol=0)
    sim = sims[0]
    worker = opt.state_dict()["onebit"]["errors"][0]["worker"]
    torch.testing.assert_close(worker, sim.worker[0], **OPT_TOL)
    flat_dead = torch.cat([m.reshape(-1) for m in dead])
    layer_of = torch.repeat_interleave(torch.arange(len(sim.lengths)), torch.tensor(sim.lengths))
    bound = sim.max_scales[0][layer_of[flat_dead]]
    assert (worker[flat_dead].abs() <= bound * (1 + 1e-6)).all(), (worker[flat_dead], bound)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("options", [{}, {"bias_correction": True}, {"eps_inside_sqrt": True}],
                         ids=["default", "bias_correction", "eps_inside_sqrt"])
@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_mlp_dead_unit_single_process(kind, options):
    """The bug as reported: a small MLP with a dead ReLU unit and an unused input, freeze_step=4,
    was NaN within 12 steps (with eps inside the square root, its dead weights moved 1e4 times
    the compressed momentum a step).  Now finite, its loss falls, and the weights that never
    had a gradient stay where the warm-up left them (the group runs check 1 to 4 processes)."""
    from horovod_ext.algorithms.onebit import OnebitAdam, OnebitLamb
    cls = OnebitAdam if kind == "adam" else OnebitLamb
    check_mlp(*_train_mlp(cls, one_rank_topology(), 0, None, MLP_LR[kind], **options),
              f"{kind} MLP {options}")
