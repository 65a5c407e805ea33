"""``hvd.PowerSGD``: real ranks (np=2 and 3, Gloo and MPI) against a single-process simulation of
all workers written here (torch's hook: plain average for ``start_iter`` rounds, then P = M Q,
P summed and orthonormalised, Q = average of M^T P, result P Q^T, error feedback over the whole
buffer, warm start), and bitwise resume through the DistributedOptimizer's state_dict."""
import zlib

import pytest
import torch

from tests.harness import BACKENDS, run_ranks

pytestmark = pytest.mark.timeout(120)

# one grouped request: a matrix worth compressing, a bias, a small matrix averaged in full
GROUP = [(16, 12), (16,), (3, 2)]
CONV = (8, 4, 3, 3)          # a separate request, viewed as 8 x 36
STEPS, START = 5, 2


def _grad(rank, step, shape):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + len(shape))
    return torch.randn(shape, generator=g, dtype=torch.float64)


def body(rank_r, warm):
    import horovod_ext.torch as hvd
    op = hvd.PowerSGD(rank=rank_r, start_iter=START, warm_start=warm)
    me = hvd.rank()
    out = []
    for step in range(STEPS):
        group = hvd.grouped_allreduce([_grad(me, step, s) for s in GROUP], name="group", op=op)
        conv = hvd.allreduce(_grad(me, step, CONV), name="conv", op=op)
        out.append([t.clone() for t in group] + [conv])
    return out, op.bytes_sent


def _orth(m):
    q, _ = torch.linalg.qr(m)
    return q


def _random(numel, key, round_index):
    g = torch.Generator().manual_seed(zlib.crc32(f"0/{key}/{round_index}".encode()))
    return torch.randn(numel, generator=g, dtype=torch.float64)


def _simulate(size, shapes, key, rank_r, warm, grad=None, q_order=None):
    """Per step, per worker: the reduced tensors of one request of ``shapes``; ``grad(worker,
    step, shape)`` gives the workers' gradients (default: the ranks'); ``q_order``: the
    compressed tensors' indices in the order their random Q are drawn (default: in order)."""
    grad = grad or _grad
    numels = [int(torch.Size(s).numel()) for s in shapes]
    compress = []
    for s, numel in zip(shapes, numels):
        n, m = (s[0], numel // s[0]) if len(s) >= 2 else (0, 0)
        r = min(n, m, rank_r)
        compress.append(len(s) >= 2 and (n + m) * r * 2.0 < n * m)
    errors = [[torch.zeros(n, dtype=torch.float64) for n in numels] for _ in range(size)]
    qs = None
    results = []
    for step in range(STEPS):
        grads = [[grad(r, step, s).reshape(-1) for s in shapes] for r in range(size)]
        if step < START:
            avg = [sum(grads[r][i] for r in range(size)) / size for i in range(len(shapes))]
            results.append([[a.clone() for a in avg] for _ in range(size)])
            continue
        ms = [[grads[r][i] + errors[r][i] for i in range(len(shapes))] for r in range(size)]
        outs = [[None] * len(shapes) for _ in range(size)]
        if qs is None or not warm:   # the same random numbers as the op, for every matrix
            flat = _random(sum(numels[i] // shapes[i][0] * min(shapes[i][0], numels[i] //
                                                                  shapes[i][0], rank_r)
                               for i in range(len(shapes)) if compress[i]), key, step)
            qs, at = {}, 0
            for i in (q_order or range(len(shapes))):
                if compress[i]:
                    n = shapes[i][0]
                    m, r = numels[i] // n, min(n, numels[i] // n, rank_r)
                    qs[i] = flat[at:at + m * r].view(m, r)
                    at += m * r
        for i in range(len(shapes)):
            if not compress[i]:
                avg = sum(ms[r][i] for r in range(size)) / size
                for r in range(size):
                    outs[r][i] = avg.clone()
                continue
            n = shapes[i][0]
            mats = [ms[r][i].view(n, -1) for r in range(size)]
            q = _orth(qs[i])
            p = _orth(sum(mat @ q for mat in mats))
            qs[i] = sum(mat.t() @ p for mat in mats) / size
            approx = (p @ qs[i].t()).reshape(-1)
            for r in range(size):
                outs[r][i] = approx.clone()
        for r in range(size):
            errors[r] = [ms[r][i] - outs[r][i] for i in range(len(shapes))]
        results.append(outs)
    return results


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", [2, 3])
def test_matches_a_simulation_of_all_workers(size, backend):
    rank_r, warm = 2, True
    results = run_ranks(body, size, backend, args=(rank_r, warm))
    group = _simulate(size, GROUP, "group.0/group.1/group.2", rank_r, warm)
    conv = _simulate(size, [CONV], "conv", rank_r, warm)
    for r, (steps, _) in enumerate(results):
        for step, got in enumerate(steps):
            for i, shape in enumerate(GROUP):
                torch.testing.assert_close(got[i].reshape(-1), group[step][r][i],
                                           rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(got[3].reshape(-1), conv[step][r][0], rtol=1e-9,
                                       atol=1e-9)
    # compressed rounds send the factors, not the matrices: far less than a full allreduce
    full = 2 * (size - 1) / size * 8 * (192 + 16 + 6 + 288) * STEPS
    assert results[0][1] < 0.75 * full


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_1_without_warm_start(backend):
    results = run_ranks(body, 2, backend, args=(1, False))
    group = _simulate(2, GROUP, "group.0/group.1/group.2", 1, False)
    for r, (steps, _) in enumerate(results):
        for step, got in enumerate(steps):
            for i in range(len(GROUP)):
                torch.testing.assert_close(got[i].reshape(-1), group[step][r][i],
                                           rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hierarchical_is_a_node_average_then_powersgd_across_nodes(backend):
    """Two pretend nodes of 2 ranks: every rank of node n ends with what one PowerSGD worker
    whose gradient is its node's average would get; each local rank takes its share of the
    layers across nodes (by size: local rank 0 the 16 x 12 matrix, local rank 1 the rest), so
    each layer crosses once per node."""
    results = run_ranks(body, 4, backend, args=(2, True), hostnames=["a", "a", "b", "b"],
                        env={"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"})

    def node_grad(node, step, shape):
        return (_grad(2 * node, step, shape) + _grad(2 * node + 1, step, shape)) / 2

    first = _simulate(2, GROUP[:1], "group.0", 2, True, node_grad)
    rest = _simulate(2, GROUP[1:], "group.1/group.2", 2, True, node_grad)
    for r, (steps, sent) in enumerate(results):
        for step, got in enumerate(steps):
            want = first[step][r // 2] + rest[step][r // 2]
            for i in range(len(GROUP)):
                torch.testing.assert_close(got[i].reshape(-1), want[i], rtol=1e-9, atol=1e-9)
    # the shares add up to one PowerSGD worker's traffic per node, not one per rank
    flat = run_ranks(body, 2, backend, args=(2, True))
    assert results[0][1] + results[1][1] == flat[0][1]


# matrices of one shape (16 x 12) at positions 0, 2 and 5, batched into one bmm
BATCHED = [(16, 12), (16,), (16, 12), (3, 2), (8, 10), (16, 12)]


def body_batched():
    import horovod_ext.torch as hvd
    op = hvd.PowerSGD(rank=2, start_iter=START, batch_tensors_with_same_shape=True)
    me = hvd.rank()
    return [[t.clone() for t in hvd.grouped_allreduce(
        [_grad(me, step, s) for s in BATCHED], name="batched", op=op)]
        for step in range(STEPS)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_same_shape_matrices_match_the_simulation(backend):
    results = run_ranks(body_batched, 2, backend)
    key = "/".join(f"batched.{i}" for i in range(len(BATCHED)))
    # the batch of 16 x 12 matrices first, then the 8 x 10 one: their Q memory's order
    want = _simulate(2, BATCHED, key, 2, True, q_order=[0, 2, 5, 4])
    for r, steps in enumerate(results):
        for step, got in enumerate(steps):
            for i in range(len(BATCHED)):
                torch.testing.assert_close(got[i].reshape(-1), want[step][r][i],
                                           rtol=1e-9, atol=1e-9)


def body_buckets():
    import horovod_ext.torch as hvd
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    op = hvd.PowerSGD(rank=1, start_iter=0, seed=7)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=op)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(hvd.rank()))
    model(x).square().mean().backward()
    local = [p.grad.clone() for p in model.parameters()]
    opt.step()
    return list(op.state_dict()["states"]), local, [p.grad.clone() for p in model.parameters()]


def test_the_optimizer_hands_it_one_bucket_of_all_layers():
    """The model's four gradients are one request (DDP's bucket), reduced as the simulation
    reduces one request of those shapes."""
    results = run_ranks(body_buckets, 2, "gloo")
    states = results[0][0]
    assert len(states) == 1 and len(states[0][0]) == 4
    shapes = [(16, 12), (16,), (3, 16), (3,)]
    locals_ = [[g.reshape(-1) for g in r[1]] for r in results]
    want = _simulate_one_step(locals_, shapes, "/".join(states[0][0]), seed=7)
    for r, (_, _, reduced) in enumerate(results):
        for got, ref in zip(reduced, want[r]):
            torch.testing.assert_close(got.reshape(-1), ref, rtol=1e-6, atol=1e-6)


def _simulate_one_step(grads, shapes, key, seed):
    """The first compressed round (rank 1, zero error, random Q) of one request, float32."""
    size = len(grads)
    numels = [int(torch.Size(s).numel()) for s in shapes]
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{key}/0".encode()))
    compressed = [i for i, s in enumerate(shapes) if len(s) >= 2 and
                  (s[0] + numels[i] // s[0]) * 2.0 < numels[i]]
    flat_q = torch.randn(sum(numels[i] // shapes[i][0] for i in compressed), generator=g)
    outs = [[None] * len(shapes) for _ in range(size)]
    at = 0
    for i, s in enumerate(shapes):
        if i not in compressed:
            avg = sum(grads[r][i] for r in range(size)) / size
            for r in range(size):
                outs[r][i] = avg
            continue
        n, m = s[0], numels[i] // s[0]
        q = flat_q[at:at + m].view(m, 1)
        at += m
        q = q / q.norm()
        mats = [grads[r][i].view(n, m) for r in range(size)]
        p = sum(mat @ q for mat in mats)
        p = p / p.norm()
        q = sum(mat.t() @ p for mat in mats) / size
        for r in range(size):
            outs[r][i] = (p @ q.t()).reshape(-1)
    return outs


def body_resume():
    import copy
    import horovod_ext.torch as hvd
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    op = hvd.PowerSGD(rank=2, start_iter=2, seed=5)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), op=op)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.Generator().manual_seed(hvd.rank())
    batches = [(torch.randn(8, 12, generator=data), torch.randint(0, 3, (8,), generator=data))
               for _ in range(8)]

    def train(steps):
        for x, y in steps:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    train(batches[:4])
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    assert "horovod_ext_op_state" in saved[1]
    train(batches[4:])
    first = [p.detach().clone() for p in model.parameters()]
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    train(batches[4:])
    second = [p.detach().clone() for p in model.parameters()]
    op.reset()   # without its state the same steps give other parameters
    model.load_state_dict(saved[0])
    opt.load_state_dict({k: v for k, v in saved[1].items() if k != "horovod_ext_op_state"})
    train(batches[4:])
    third = [p.detach().clone() for p in model.parameters()]
    return (all(torch.equal(a, b) for a, b in zip(first, second)),
            all(torch.equal(a, b) for a, b in zip(first, third)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_resume_from_the_optimizer_state(backend):
    for bitwise, without_state in run_ranks(body_resume, 2, backend):
        assert bitwise and not without_state


def test_bad_settings_and_names():
    import horovod_ext.torch as hvd
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        hvd.PowerSGD(rank=0)
    op = hvd.PowerSGD(rank=4, start_iter=3)
    assert op is hvd.PowerSGD(rank=4, start_iter=3) and op is not hvd.PowerSGD(rank=1)
    with pytest.raises(ValueError, match="cannot be loaded"):
        op.load_state_dict(hvd.PowerSGD(rank=1).state_dict())
