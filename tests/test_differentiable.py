"""Gradients through the synchronous collectives (horovod_ext/torch/differentiable.py).

Every rank builds every rank's inputs and upstream gradients from (rank, seed), so each rank can
compute, in this process and without communication, what its own ``x.grad`` must be.  The
expected gradients are written in closed form from the conventions stated in differentiable.py
(which are Horovod's).  Where those conventions are a plain derivative, a finite-difference
check of a single-process simulation of all ranks confirms it; where Horovod scales the plain
derivative, the same check confirms the exact scale.

Which conventions are the plain derivative and which are Horovod's choice, for a per-rank loss
``L_k`` and the total ``T = sum_k L_k`` (the loss a data-parallel job really minimises, up to the
usual averaging):

- allreduce (any op, any scaling): ``x_r.grad == dT/dx_r``; the plain derivative.
- alltoall: ``x_r.grad == dT/dx_r``; the plain derivative.
- allgather and broadcast: ``x_r.grad == (1/n) dT/dx_r``, i.e. the derivative of the MEAN of the
  per-rank losses; Horovod averages the upstream gradients rather than summing them.
- reducescatter (Sum and Average): ``x_r.grad == n dT/dx_r``; Horovod gathers the upstream
  blocks and multiplies by the set size for Sum, and does not divide by it for Average.
"""
import pytest
import torch

from tests.harness import BACKENDS, run_ranks

F64 = dict(rtol=1e-10, atol=1e-10)   # closed-form references in float64: only rounding differs
FD = dict(rtol=1e-6, atol=1e-6)      # central differences, eps=1e-6, float64, smooth loss
FD_EPS = 1e-6
FP16 = dict(rtol=1e-2, atol=1e-2)    # values that went over the wire as float16


# --- deterministic data and single-process references ----------------------------------------
def data(rank, seed, *shape, dtype=torch.float64):
    """Rank ``rank``'s tensor for check ``seed``: the same on every process."""
    g = torch.Generator().manual_seed(7919 * seed + rank)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def close(actual, expected, what, tol=F64):
    assert isinstance(actual, torch.Tensor), f"{what}: got {type(actual).__name__}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != " \
                                           f"{tuple(expected.shape)}"
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}", **tol)


def offsets(counts):
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += c
    return out


def scatter_counts(rows, n):
    """reducescatter's blocks of dim 0: as even as possible, earlier ranks get the extra rows."""
    return [rows // n + (1 if k < rows % n else 0) for k in range(n)]


def alltoall_received(xs, send, j):
    """What rank j receives: from each rank k in order, the rows k sends to j."""
    return torch.cat([xs[k].narrow(0, offsets(send[k])[j], send[k][j])
                      for k in range(len(xs))])


def alltoall_grad(gs, send, r):
    """The gradient of the rows rank r sent: for each destination j, the rows of j's upstream
    gradient that hold what r sent to j."""
    n = len(gs)
    return torch.cat([gs[j].narrow(0, sum(send[k][j] for k in range(r)), send[r][j])
                      for j in range(n)])


def simulate(kind, xs, **kw):
    """Every rank's output of collective ``kind`` for inputs ``xs`` (one per rank)."""
    n = len(xs)
    if kind == "allreduce_sum":
        return [torch.stack(xs).sum(0)] * n
    if kind == "allgather":
        return [torch.cat(xs)] * n
    if kind == "broadcast":
        return [xs[kw["root"]]] * n
    if kind == "alltoall":
        return [alltoall_received(xs, kw["send"], j) for j in range(n)]
    if kind.startswith("reducescatter"):
        total = torch.stack(xs).sum(0)
        if kind == "reducescatter_average":
            total = total / n
        counts = scatter_counts(total.shape[0], n)
        return [total.narrow(0, offsets(counts)[j], counts[j]) for j in range(n)]
    raise ValueError(kind)


def loss_of(out, weight):
    """A per-rank loss that is not linear in the collective's output."""
    return (weight * torch.sin(out)).sum()


def numerical_grad(kind, xs, weights, r, scale, **kw):
    """d/dx_r of ``scale * sum_k loss_of(out_k, weights[k])``, by central differences over a
    single-process simulation of all ranks."""
    def total(inputs):
        return scale * sum(float(loss_of(o, w))
                           for o, w in zip(simulate(kind, inputs, **kw), weights))

    base = [x.clone() for x in xs]
    grad = torch.zeros_like(xs[r])
    flat, gflat = base[r].view(-1), grad.view(-1)
    for i in range(flat.numel()):
        keep = float(flat[i])
        flat[i] = keep + FD_EPS
        up = total(base)
        flat[i] = keep - FD_EPS
        down = total(base)
        flat[i] = keep
        gflat[i] = (up - down) / (2 * FD_EPS)
    return grad


def backward_through(fn, x, upstream):
    """(output, x.grad) of ``fn`` on a leaf copy of ``x``, seeding ``upstream``."""
    leaf = x.clone().requires_grad_(True)
    out = fn(leaf)
    assert out.grad_fn is not None, "a collective of a tensor requiring grad has no grad_fn"
    out.backward(upstream)
    return out.detach(), leaf.grad


def backward_grouped(fn, xs, upstreams):
    """(outputs, grads) of a grouped collective, through a weighted-sum loss."""
    leaves = [x.clone().requires_grad_(True) for x in xs]
    outs = fn(leaves)
    assert isinstance(outs, list) and len(outs) == len(xs), f"grouped result {type(outs)}"
    assert all(o.grad_fn is not None for o in outs), "grouped result without grad_fn"
    sum((o * u).sum() for o, u in zip(outs, upstreams)).backward()
    return [o.detach() for o in outs], [leaf.grad for leaf in leaves]


# --- 1: gradients against closed-form references and finite differences ----------------------
def check_allreduce(hvd, r, n):
    cases = [("sum", dict(op=hvd.Sum), 1.0, False),
             ("average", dict(op=hvd.Average), 1.0, True),
             ("default (average)", dict(), 1.0, True),
             ("average=False", dict(average=False), 1.0, False),
             ("sum scaled", dict(op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25), 0.5,
              False),
             ("average scaled", dict(op=hvd.Average, prescale_factor=3.0,
                                     postscale_factor=0.5), 1.5, True)]
    for seed, (what, kwargs, scale, mean) in enumerate(cases, start=10):
        xs = [data(k, seed, 4, 3) for k in range(n)]
        gs = [data(k, seed + 100, 4, 3) for k in range(n)]

        def reduce(ts):
            s = torch.stack(ts).sum(0)
            return scale * (s / n if mean else s)

        out, grad = backward_through(lambda x: hvd.allreduce(x, **kwargs), xs[r], gs[r])
        close(out, reduce(xs), f"allreduce {what}: value")
        # The gradient is the same collective applied to the upstream gradients.
        close(grad, reduce(gs), f"allreduce {what}: gradient")
    # Finite differences: with T = sum over ranks of the per-rank losses, dT/dx_r is exactly
    # the allreduced Sum of the upstream gradients.
    xs = [data(k, 20, 3, 2) for k in range(n)]
    ws = [data(k, 21, 3, 2) for k in range(n)]
    leaf = xs[r].clone().requires_grad_(True)
    loss_of(hvd.allreduce(leaf, op=hvd.Sum), ws[r]).backward()
    close(leaf.grad, numerical_grad("allreduce_sum", xs, ws, r, 1.0),
          "allreduce sum: gradient vs finite differences of the summed loss", FD)
    # Grouped: one fused request forward, one backward.
    shapes = [(3,), (2, 4), (1, 5)]
    for seed, (what, op, mean) in enumerate([("sum", hvd.Sum, False),
                                            ("average", hvd.Average, True)], start=30):
        xs = [[data(k, seed + i, *s) for i, s in enumerate(shapes)] for k in range(n)]
        gs = [[data(k, seed + 50 + i, *s) for i, s in enumerate(shapes)] for k in range(n)]
        outs, grads = backward_grouped(lambda ts: hvd.grouped_allreduce(ts, op=op), xs[r], gs[r])
        for i in range(len(shapes)):
            s_x = torch.stack([xs[k][i] for k in range(n)]).sum(0)
            s_g = torch.stack([gs[k][i] for k in range(n)]).sum(0)
            close(outs[i], s_x / n if mean else s_x, f"grouped_allreduce {what} [{i}]: value")
            close(grads[i], s_g / n if mean else s_g,
                  f"grouped_allreduce {what} [{i}]: gradient")


def check_allgather(hvd, r, n):
    rows = [k + 1 for k in range(n)]            # uneven first dimensions
    total = sum(rows)
    start = offsets(rows)[r]
    xs = [data(k, 40, rows[k], 3) for k in range(n)]
    gs = [data(k, 41, total, 3) for k in range(n)]
    out, grad = backward_through(hvd.allgather, xs[r], gs[r])
    close(out, torch.cat(xs), "allgather: value")
    # Horovod: the upstream gradients averaged over the ranks, this rank's rows.
    close(grad, torch.stack(gs).mean(0).narrow(0, start, rows[r]), "allgather: gradient")
    # 1-D tensors of uneven length too.
    lens = [2 * k + 1 for k in range(n)]
    xs1 = [data(k, 42, lens[k]) for k in range(n)]
    gs1 = [data(k, 43, sum(lens)) for k in range(n)]
    out, grad = backward_through(hvd.allgather, xs1[r], gs1[r])
    close(out, torch.cat(xs1), "allgather 1-D: value")
    close(grad, torch.stack(gs1).mean(0).narrow(0, offsets(lens)[r], lens[r]),
          "allgather 1-D: gradient")
    # Finite differences: the convention is the derivative of the MEAN of the per-rank losses
    # (Horovod's choice; the summed loss's derivative is n times larger).
    ws = [data(k, 44, total, 3) for k in range(n)]
    leaf = xs[r].clone().requires_grad_(True)
    loss_of(hvd.allgather(leaf), ws[r]).backward()
    close(leaf.grad, numerical_grad("allgather", xs, ws, r, 1.0 / n),
          "allgather: gradient vs finite differences of the mean loss", FD)
    close(leaf.grad * n, numerical_grad("allgather", xs, ws, r, 1.0),
          "allgather: n * gradient vs finite differences of the summed loss", FD)
    # Grouped, with different row counts and trailing shapes per tensor.
    rows_a = [k + 1 for k in range(n)]
    rows_b = [2 * (n - k) for k in range(n)]
    xa = [data(k, 45, rows_a[k], 2) for k in range(n)]
    xb = [data(k, 46, rows_b[k], 2, 2) for k in range(n)]
    ga = [data(k, 47, sum(rows_a), 2) for k in range(n)]
    gb = [data(k, 48, sum(rows_b), 2, 2) for k in range(n)]
    outs, grads = backward_grouped(hvd.grouped_allgather, [xa[r], xb[r]], [ga[r], gb[r]])
    close(outs[0], torch.cat(xa), "grouped_allgather [0]: value")
    close(outs[1], torch.cat(xb), "grouped_allgather [1]: value")
    close(grads[0], torch.stack(ga).mean(0).narrow(0, offsets(rows_a)[r], rows_a[r]),
          "grouped_allgather [0]: gradient")
    close(grads[1], torch.stack(gb).mean(0).narrow(0, offsets(rows_b)[r], rows_b[r]),
          "grouped_allgather [1]: gradient")


def check_broadcast(hvd, r, n):
    for root in range(n):
        xs = [data(k, 50 + root, 3, 2) for k in range(n)]
        gs = [data(k, 60 + root, 3, 2) for k in range(n)]
        out, grad = backward_through(lambda x: hvd.broadcast(x, root), xs[r], gs[r])
        close(out, xs[root], f"broadcast root {root}: value")
        # Horovod: the average of the upstream gradients at the root, zeros elsewhere.
        expected = torch.stack(gs).mean(0) if r == root else torch.zeros(3, 2,
                                                                          dtype=torch.float64)
        close(grad, expected, f"broadcast root {root}: gradient")
        # Finite differences: the derivative of the mean of the per-rank losses.
        ws = [data(k, 70 + root, 3, 2) for k in range(n)]
        leaf = xs[r].clone().requires_grad_(True)
        loss_of(hvd.broadcast(leaf, root), ws[r]).backward()
        close(leaf.grad, numerical_grad("broadcast", xs, ws, r, 1.0 / n, root=root),
              f"broadcast root {root}: gradient vs finite differences of the mean loss", FD)


def check_alltoall(hvd, r, n):
    # Uneven splits, zeros included: rank k sends (k + j) % n rows to rank j, plus one to
    # itself, so every rank sends and receives something.
    send = [[(k + j) % n + (1 if j == k else 0) for j in range(n)] for k in range(n)]
    xs = [data(k, 80, sum(send[k]), 3) for k in range(n)]
    recv = [sum(send[k][j] for k in range(n)) for j in range(n)]
    gs = [data(j, 81, recv[j], 3) for j in range(n)]
    leaf = xs[r].clone().requires_grad_(True)
    got = hvd.alltoall(leaf, splits=send[r])
    assert isinstance(got, tuple) and len(got) == 2, f"alltoall with splits returned {type(got)}"
    out, splits = got
    assert out.grad_fn is not None, "alltoall: no grad_fn"
    assert not splits.requires_grad, "alltoall: the received splits require grad"
    assert splits.tolist() == [send[k][r] for k in range(n)], f"alltoall splits {splits}"
    close(out.detach(), alltoall_received(xs, send, r), "alltoall splits: value")
    out.backward(gs[r])
    # The gradient goes back the way the data came.
    close(leaf.grad, alltoall_grad(gs, send, r), "alltoall splits: gradient")
    # Without splits: the tensor alone.
    even = [[2] * n for _ in range(n)]
    xs2 = [data(k, 82, 2 * n, 2) for k in range(n)]
    gs2 = [data(k, 83, 2 * n, 2) for k in range(n)]
    leaf = xs2[r].clone().requires_grad_(True)
    out = hvd.alltoall(leaf)
    assert isinstance(out, torch.Tensor), f"alltoall without splits returned {type(out)}"
    close(out.detach(), alltoall_received(xs2, even, r), "alltoall even: value")
    out.backward(gs2[r])
    close(leaf.grad, alltoall_grad(gs2, even, r), "alltoall even: gradient")
    # Finite differences: the plain derivative of the summed loss.
    ws = [data(j, 84, recv[j], 3) for j in range(n)]
    leaf = xs[r].clone().requires_grad_(True)
    loss_of(hvd.alltoall(leaf, splits=send[r])[0], ws[r]).backward()
    close(leaf.grad, numerical_grad("alltoall", xs, ws, r, 1.0, send=send),
          "alltoall: gradient vs finite differences of the summed loss", FD)


def check_reducescatter(hvd, r, n):
    seed = 90
    for rows in (2 * n, 2 * n + 1):             # divisible, and not (for n > 1)
        counts = scatter_counts(rows, n)
        start = offsets(counts)[r]
        for what, kwargs, fwd_scale, grad_scale, mean in [
                ("sum", dict(op=hvd.Sum), 1.0, n, False),
                ("average", dict(op=hvd.Average), 1.0, 1.0, True),
                ("default (average)", dict(), 1.0, 1.0, True),
                ("sum scaled", dict(op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25),
                 0.5, 0.5 * n, False)]:
            seed += 2
            xs = [data(k, seed, rows, 3) for k in range(n)]
            gs = [data(k, seed + 1, counts[k], 3) for k in range(n)]
            out, grad = backward_through(lambda x: hvd.reducescatter(x, **kwargs), xs[r], gs[r])
            total = torch.stack(xs).sum(0) * fwd_scale
            if mean:
                total = total / n
            close(out, total.narrow(0, start, counts[r]),
                  f"reducescatter {what} rows={rows}: value")
            # Horovod: every rank's upstream block gathered, times n for Sum (and times the
            # pre/post scaling), as is for Average.
            close(grad, torch.cat(gs) * grad_scale, f"reducescatter {what} rows={rows}: gradient")
        # Finite differences: Horovod's convention is n times the derivative of the summed loss.
        for kind, op in (("reducescatter_sum", hvd.Sum), ("reducescatter_average", hvd.Average)):
            seed += 2
            xs = [data(k, seed, rows, 2) for k in range(n)]
            ws = [data(k, seed + 1, counts[k], 2) for k in range(n)]
            leaf = xs[r].clone().requires_grad_(True)
            loss_of(hvd.reducescatter(leaf, op=op), ws[r]).backward()
            close(leaf.grad, numerical_grad(kind, xs, ws, r, float(n)),
                  f"{kind} rows={rows}: gradient vs n * finite differences of the summed loss",
                  FD)
    # Only Sum and Average have a gradient: the backward of Max refuses (on every rank alike).
    leaf = data(r, 120, 2 * n, 2).requires_grad_(True)
    out = hvd.reducescatter(leaf, op=hvd.Max)
    try:
        out.sum().backward()
    except NotImplementedError as exc:
        assert "Sum and Average" in str(exc), exc
    else:
        raise AssertionError("the gradient of reducescatter Max did not raise")
    # Grouped: one tensor divisible, one not, per op.
    rows_list = [2 * n, 2 * n + 1, n]
    for what, op, grad_scale, mean in (("sum", hvd.Sum, n, False),
                                       ("average", hvd.Average, 1.0, True)):
        seed += 10
        counts = [scatter_counts(rows, n) for rows in rows_list]
        xs = [[data(k, seed + i, rows, 2) for i, rows in enumerate(rows_list)] for k in range(n)]
        gs = [[data(k, seed + 5 + i, counts[i][k], 2) for i in range(len(rows_list))]
              for k in range(n)]
        outs, grads = backward_grouped(lambda ts: hvd.grouped_reducescatter(ts, op=op),
                                       xs[r], gs[r])
        for i in range(len(rows_list)):
            total = torch.stack([xs[k][i] for k in range(n)]).sum(0)
            if mean:
                total = total / n
            close(outs[i], total.narrow(0, offsets(counts[i])[r], counts[i][r]),
                  f"grouped_reducescatter {what} [{i}]: value")
            close(grads[i], torch.cat([gs[k][i] for k in range(n)]) * grad_scale,
                  f"grouped_reducescatter {what} [{i}]: gradient")


def check_edges(hvd, r, n):
    """Empty contributions, fewer rows than ranks, 0-d and non-contiguous tensors."""
    # allgather where rank 0 contributes no rows.
    rows = list(range(n))
    xs = [data(k, 170, rows[k], 2) for k in range(n)]
    gs = [data(k, 171, sum(rows), 2) for k in range(n)]
    out, grad = backward_through(hvd.allgather, xs[r], gs[r])
    close(out, torch.cat(xs), "allgather with an empty rank: value")
    close(grad, torch.stack(gs).mean(0).narrow(0, offsets(rows)[r], rows[r]),
          "allgather with an empty rank: gradient")
    # allgather of 0-d tensors: one row each; the gradient keeps the 0-d shape.
    xs = [data(k, 172, 1).view(()) for k in range(n)]
    gs = [data(k, 173, n) for k in range(n)]
    out, grad = backward_through(hvd.allgather, xs[r], gs[r])
    close(out, torch.stack(xs), "allgather 0-d: value")
    close(grad, torch.stack(gs).mean(0)[r], "allgather 0-d: gradient")
    # Non-contiguous input and upstream gradient.
    base = [data(k, 174, 3, 4) for k in range(n)]
    gs = [data(k, 175, 3, 4 * n) for k in range(n)]        # transposed below
    leaf = base[r].clone().requires_grad_(True)
    out = hvd.allgather(leaf.t())
    close(out.detach(), torch.cat([b.t() for b in base]), "allgather non-contiguous: value")
    out.backward(gs[r].t())
    close(leaf.grad, torch.stack(gs).mean(0).t().narrow(0, 4 * r, 4).t(),
          "allgather non-contiguous: gradient")
    # reducescatter of one row: only rank 0 gets a (non-empty) block.
    counts = scatter_counts(1, n)
    xs = [data(k, 176, 1, 2) for k in range(n)]
    gs = [data(k, 177, counts[k], 2) for k in range(n)]
    out, grad = backward_through(lambda x: hvd.reducescatter(x, op=hvd.Sum), xs[r], gs[r])
    close(out, torch.stack(xs).sum(0).narrow(0, offsets(counts)[r], counts[r]),
          "reducescatter of one row: value")
    close(grad, torch.cat(gs) * n, "reducescatter of one row: gradient")
    # alltoall where rank 0 sends nothing at all.
    send = [[0] * n] + [[1 + (k + j) % 2 for j in range(n)] for k in range(1, n)]
    xs = [data(k, 178, sum(send[k]), 2) for k in range(n)]
    recv = [sum(send[k][j] for k in range(n)) for j in range(n)]
    gs = [data(j, 179, recv[j], 2) for j in range(n)]
    leaf = xs[r].clone().requires_grad_(True)
    out, _ = hvd.alltoall(leaf, splits=send[r])
    close(out.detach(), alltoall_received(xs, send, r), "alltoall with a silent rank: value")
    out.backward(gs[r])
    close(leaf.grad, alltoall_grad(gs, send, r), "alltoall with a silent rank: gradient")


# --- 2: when results record a graph; compression ---------------------------------------------
def check_graph_recording(hvd, r, n):
    x = data(r, 130, 2 * n, 3)
    calls = {
        "allreduce": lambda t: [hvd.allreduce(t, op=hvd.Sum)],
        "grouped_allreduce": lambda t: hvd.grouped_allreduce([t, t * 1], op=hvd.Sum),
        "allgather": lambda t: [hvd.allgather(t)],
        "grouped_allgather": lambda t: hvd.grouped_allgather([t, t * 1]),
        "broadcast": lambda t: [hvd.broadcast(t, n - 1)],
        "alltoall": lambda t: [hvd.alltoall(t)],
        "alltoall splits": lambda t: [hvd.alltoall(t, splits=[2] * n)[0]],
        "reducescatter": lambda t: [hvd.reducescatter(t, op=hvd.Sum)],
        "grouped_reducescatter": lambda t: hvd.grouped_reducescatter([t, t * 1], op=hvd.Sum),
    }
    for what, call in calls.items():
        with_grad = call(x.clone().requires_grad_(True))
        assert all(o.grad_fn is not None and o.requires_grad for o in with_grad), \
            f"{what}: an input requiring grad gave a result without grad_fn"
        plain = call(x.clone())
        assert all(o.grad_fn is None and not o.requires_grad for o in plain), \
            f"{what}: a plain input gave a result with grad_fn"
        with torch.no_grad():
            no_grad = call(x.clone().requires_grad_(True))
        assert all(o.grad_fn is None and not o.requires_grad for o in no_grad), \
            f"{what}: under torch.no_grad() the result has grad_fn"
        for a, b, c in zip(with_grad, plain, no_grad):
            close(a.detach(), b, f"{what}: value with grad vs plain")
            close(c, b, f"{what}: value under no_grad vs plain")
    # alltoall's received splits never require grad.
    _, splits = hvd.alltoall(x.clone().requires_grad_(True), splits=[2] * n)
    assert splits.grad_fn is None and not splits.requires_grad, "alltoall splits record a graph"
    # A group mixing a tensor that requires grad and one that does not.
    xa, xb = data(r, 131, 3), data(r, 132, 3)
    ga = [data(k, 133, 3) for k in range(n)]
    gb = [data(k, 134, 3) for k in range(n)]
    a = xa.clone().requires_grad_(True)
    b = xb.clone()
    outs = hvd.grouped_allreduce([a, b], op=hvd.Sum)
    ((outs[0] * ga[r]).sum() + (outs[1] * gb[r]).sum()).backward()
    close(a.grad, torch.stack(ga).sum(0), "grouped_allreduce mixed: gradient")
    assert b.grad is None, "grouped_allreduce mixed: a plain tensor got a gradient"
    # fp16 compression of a float32 input that requires grad: float32 result and gradient.
    xs = [data(k, 140, 16, dtype=torch.float32) for k in range(n)]
    gs = [data(k, 141, 16, dtype=torch.float32) for k in range(n)]
    out, grad = backward_through(
        lambda t: hvd.allreduce(t, op=hvd.Sum, compression=hvd.Compression.fp16), xs[r], gs[r])
    close(out, torch.stack(xs).sum(0), "allreduce fp16: value", FP16)
    close(grad, torch.stack(gs).sum(0), "allreduce fp16: float32 gradient", FP16)
    outs, grads = backward_grouped(
        lambda ts: hvd.grouped_allreduce(ts, op=hvd.Average,
                                         compression=hvd.Compression.fp16), [xs[r]], [gs[r]])
    close(outs[0], torch.stack(xs).mean(0), "grouped_allreduce fp16: value", FP16)
    close(grads[0], torch.stack(gs).mean(0), "grouped_allreduce fp16: float32 gradient", FP16)
    rows = 2 * n + 1
    counts = scatter_counts(rows, n)
    xs = [data(k, 142, rows, 2, dtype=torch.float32) for k in range(n)]
    gs = [data(k, 143, counts[k], 2, dtype=torch.float32) for k in range(n)]
    out, grad = backward_through(
        lambda t: hvd.reducescatter(t, op=hvd.Sum, compression=hvd.Compression.fp16),
        xs[r], gs[r])
    close(out, torch.stack(xs).sum(0).narrow(0, offsets(counts)[r], counts[r]),
          "reducescatter fp16: value", FP16)
    close(grad, torch.cat(gs) * n, "reducescatter fp16: float32 gradient", FP16)


# --- 3: grouped allgather / reducescatter values, async forms, early errors -------------------
def check_grouped_values(hvd, r, n):
    fa = [data(k, 150, k + 1, 3, dtype=torch.float32) for k in range(n)]
    ib = [torch.arange(2 * k + 1, dtype=torch.int64) + 10 * k for k in range(n)]
    expected = [torch.cat(fa), torch.cat(ib)]
    got = hvd.grouped_allgather([fa[r], ib[r]])
    assert isinstance(got, list) and len(got) == 2, f"grouped_allgather returned {type(got)}"
    for i in range(2):
        close(got[i], expected[i], f"grouped_allgather values [{i}]")
    got = hvd.synchronize(hvd.grouped_allgather_async([fa[r], ib[r]]))
    assert isinstance(got, list) and len(got) == 2, \
        f"synchronize(grouped_allgather_async) returned {type(got)}"
    for i in range(2):
        close(got[i], expected[i], f"grouped_allgather_async values [{i}]")

    rows_list = [2 * n, 2 * n + 1, 1]
    xs = [[data(k, 151 + i, rows, 2) for i, rows in enumerate(rows_list)] for k in range(n)]
    ints = [torch.arange(6 * (2 * n + 1), dtype=torch.int32).view(2 * n + 1, 6) * (k + 1)
            for k in range(n)]
    for what, op in (("sum", hvd.Sum), ("average", hvd.Average), ("max", hvd.Max)):
        def reduce(ts):
            s = torch.stack(ts)
            return {"sum": s.sum(0), "average": s.sum(0) / n, "max": s.max(0).values}[what]

        expected = []
        for i, rows in enumerate(rows_list):
            counts = scatter_counts(rows, n)
            expected.append(reduce([xs[k][i] for k in range(n)])
                            .narrow(0, offsets(counts)[r], counts[r]))
        got = hvd.grouped_reducescatter(xs[r], op=op)
        assert isinstance(got, list) and len(got) == len(rows_list), type(got)
        for i, e in enumerate(expected):
            close(got[i], e, f"grouped_reducescatter {what} values [{i}]")
        got = hvd.synchronize(hvd.grouped_reducescatter_async(xs[r], op=op))
        assert isinstance(got, list) and len(got) == len(rows_list), type(got)
        for i, e in enumerate(expected):
            close(got[i], e, f"grouped_reducescatter_async {what} values [{i}]")
    counts = scatter_counts(2 * n + 1, n)
    got = hvd.grouped_reducescatter([ints[r]], op=hvd.Sum)
    close(got[0], sum(ints).narrow(0, offsets(counts)[r], counts[r]),
          "grouped_reducescatter int32 sum")

    # A scalar in the group: ValueError, and none of the group's requests went out.  The bad
    # calls use the name of the good call that follows: had "early.0" been sent, the good
    # call's first tensor would collide with it (or take its values).
    good = data(r, 160, 2 * n, 2)
    bad_calls = [
        ("grouped_reducescatter", lambda: hvd.grouped_reducescatter(
            [good, torch.tensor(1.0)], name="early", op=hvd.Sum)),
        ("grouped_reducescatter_async", lambda: hvd.grouped_reducescatter_async(
            [good, torch.tensor(1.0)], name="early", op=hvd.Sum)),
        ("grouped_reducescatter requiring grad", lambda: hvd.grouped_reducescatter(
            [good.clone().requires_grad_(True), torch.tensor(1.0, requires_grad=True)],
            name="early", op=hvd.Sum)),
    ]
    for what, call in bad_calls:
        try:
            call()
        except ValueError:
            pass
        else:
            raise AssertionError(f"{what} with a scalar did not raise ValueError")
    ys = [data(k, 161, n + 1, 4) for k in range(n)]
    zs = [data(k, 162, 2 * n, 2) for k in range(n)]
    got = hvd.grouped_reducescatter([ys[r], zs[r]], name="early", op=hvd.Sum)
    for i, ts in enumerate((ys, zs)):
        counts = scatter_counts(ts[0].shape[0], n)
        close(got[i], torch.stack(ts).sum(0).narrow(0, offsets(counts)[r], counts[r]),
              f"grouped_reducescatter after the rejected calls [{i}]")


def body_gradients():
    import horovod_ext.torch as hvd
    r, n = hvd.rank(), hvd.size()
    done = []
    for check in (check_allreduce, check_allgather, check_broadcast, check_alltoall,
                  check_reducescatter, check_edges, check_graph_recording,
                  check_grouped_values):
        check(hvd, r, n)
        done.append(check.__name__)
    # Everything still agrees afterwards (no stray request left on any engine).
    close(hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum),
          torch.tensor([n * (n - 1) / 2]), "allreduce after the checks")
    return done


# --- 4: process sets ---------------------------------------------------------------------------
def check_in_set(hvd, s, members, seed):
    """allreduce, allgather, broadcast (every root), reducescatter and alltoall gradients
    inside set ``s`` of world ranks ``members``; called by members only."""
    me = hvd.rank()
    m = len(members)
    i = members.index(me)                         # this rank's rank in the set
    assert s.included() and s.rank() == i and s.size() == m, (s.included(), s.rank(), s.size())
    xs = {k: data(k, seed, 3, 2) for k in members}
    gs = {k: data(k, seed + 1, 3, 2) for k in members}
    stack_x = torch.stack([xs[k] for k in members])
    stack_g = torch.stack([gs[k] for k in members])
    for what, op, mean in (("sum", hvd.Sum, False), ("average", hvd.Average, True)):
        out, grad = backward_through(lambda x: hvd.allreduce(x, op=op, process_set=s),
                                     xs[me], gs[me])
        close(out, stack_x.mean(0) if mean else stack_x.sum(0), f"set allreduce {what}: value")
        close(grad, stack_g.mean(0) if mean else stack_g.sum(0),
              f"set allreduce {what}: gradient")
    # allgather, uneven rows: offsets follow the order of the set's ranks.
    rows = {k: 1 + 2 * j for j, k in enumerate(members)}
    total = sum(rows.values())
    xa = {k: data(k, seed + 2, rows[k], 2) for k in members}
    ga = {k: data(k, seed + 3, total, 2) for k in members}
    out, grad = backward_through(lambda x: hvd.allgather(x, process_set=s), xa[me], ga[me])
    close(out, torch.cat([xa[k] for k in members]), "set allgather: value")
    start = offsets([rows[k] for k in members])[i]
    close(grad, torch.stack([ga[k] for k in members]).mean(0).narrow(0, start, rows[me]),
          "set allgather: gradient")
    # broadcast from each member; root_rank is a world rank.
    for root in members:
        out, grad = backward_through(lambda x: hvd.broadcast(x, root, process_set=s),
                                     xs[me], gs[me])
        close(out, xs[root], f"set broadcast root {root}: value")
        expected = stack_g.mean(0) if me == root else torch.zeros_like(xs[me])
        close(grad, expected, f"set broadcast root {root}: gradient")
    # reducescatter Sum (rows not divisible by the set size when m > 1) and alltoall.
    rows_rs = 2 * m + 1
    counts = scatter_counts(rows_rs, m)
    xr = {k: data(k, seed + 4, rows_rs, 2) for k in members}
    gr = {k: data(k, seed + 5, counts[j], 2) for j, k in enumerate(members)}
    out, grad = backward_through(lambda x: hvd.reducescatter(x, op=hvd.Sum, process_set=s),
                                 xr[me], gr[me])
    close(out, torch.stack([xr[k] for k in members]).sum(0).narrow(0, offsets(counts)[i],
                                                                   counts[i]),
          "set reducescatter sum: value")
    close(grad, torch.cat([gr[k] for k in members]) * m, "set reducescatter sum: gradient")
    send = [[1 + (a + b) % 2 for b in range(m)] for a in range(m)]
    xt = [data(k, seed + 6, sum(send[j]), 2) for j, k in enumerate(members)]
    recv = [sum(send[a][b] for a in range(m)) for b in range(m)]
    gt = [data(k, seed + 7, recv[j], 2) for j, k in enumerate(members)]
    leaf = xt[i].clone().requires_grad_(True)
    out, _ = hvd.alltoall(leaf, splits=send[i], process_set=s)
    close(out.detach(), alltoall_received(xt, send, i), "set alltoall: value")
    out.backward(gt[i])
    close(leaf.grad, alltoall_grad(gt, send, i), "set alltoall: gradient")


def body_process_sets():
    import horovod_ext.torch as hvd
    r, n = hvd.rank(), hvd.size()
    assert n == 3, n
    pair = hvd.add_process_set([0, 2])
    single = hvd.add_process_set([1])
    assert pair.included() == (r in (0, 2)) and single.included() == (r == 1)
    assert pair.size() == 2 and single.size() == 1
    assert pair.rank() == {0: 0, 1: -1, 2: 1}[r] and single.rank() == (0 if r == 1 else -1)
    if r in (0, 2):
        check_in_set(hvd, pair, [0, 2], 200)
        # Twice, so that the backward collectives' unnamed requests keep matching in order.
        check_in_set(hvd, pair, [0, 2], 210)
    else:
        check_in_set(hvd, single, [1], 220)
    # The world still works, gradients included, while the sets exist.
    gs = [data(k, 230, 4) for k in range(n)]
    _, grad = backward_through(lambda x: hvd.allreduce(x, op=hvd.Sum), data(r, 231, 4), gs[r])
    close(grad, torch.stack(gs).sum(0), "world allreduce gradient beside the sets")
    assert hvd.remove_process_set(pair) is True
    assert hvd.remove_process_set(single) is True
    assert pair.included() is None and single.included() is None
    return "ok"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("np", [2, 3])
def test_gradients_values_and_graph_recording(backend, np):
    expected = ["check_allreduce", "check_allgather", "check_broadcast", "check_alltoall",
                "check_reducescatter", "check_edges", "check_graph_recording",
                "check_grouped_values"]
    assert run_ranks(body_gradients, np, backend, timeout=100) == [expected] * np


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_in_process_sets(backend):
    out = run_ranks(body_process_sets, 3, backend, env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"},
                    timeout=100)
    assert out == ["ok"] * 3


def test_single_process_references():
    """The references agree with autograd on the simulation where the plain derivative is the
    convention, so the distributed checks above compare against the right numbers."""
    n = 3
    send = [[(k + j) % n + (1 if j == k else 0) for j in range(n)] for k in range(n)]
    xs = [data(k, 300, sum(send[k]), 2).requires_grad_(True) for k in range(n)]
    recv = [sum(send[k][j] for k in range(n)) for j in range(n)]
    gs = [data(j, 301, recv[j], 2) for j in range(n)]
    sum((o * g).sum() for o, g in zip(simulate("alltoall", xs, send=send), gs)).backward()
    for r in range(n):
        close(xs[r].grad, alltoall_grad(gs, send, r), f"alltoall reference rank {r}")
    ws = [data(k, 302, recv[k], 2) for k in range(n)]
    plain = [x.detach() for x in xs]
    torch.autograd.gradcheck(
        lambda *ins: sum(loss_of(o, w) for o, w in zip(simulate("alltoall", list(ins),
                                                                send=send), ws)),
        [x.clone().requires_grad_(True) for x in plain], eps=FD_EPS, atol=1e-6, rtol=1e-6)
    for r in range(n):
        leaves = [x.clone().requires_grad_(True) for x in plain]
        sum(loss_of(o, w) for o, w in zip(simulate("alltoall", leaves, send=send), ws)) \
            .backward()
        close(leaves[r].grad, numerical_grad("alltoall", plain, ws, r, 1.0, send=send),
              f"numerical_grad vs autograd rank {r}", FD)
