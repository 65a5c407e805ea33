"""Horovod behaviours of DistributedOptimizer and the state helpers: sparse gradients (gathered,
or densified with sparse_as_dense), broadcast_optimizer_state on a new optimizer, Horovod's
names for unnamed parameters, the warning for step() after synchronize().  Results are checked
against single-process references built from every rank's deterministic inputs."""
import pytest
import torch

from tests.harness import BACKENDS, run_ranks

VOCAB, DIM = 12, 3


def rank_sparse(rank, shape, sparse_dim, dtype=torch.float64):
    """Rank ``rank``'s sparse input: a few entries, duplicates included; rank 1 has none."""
    g = torch.Generator().manual_seed(101 + rank)
    nnz = 0 if rank == 1 else 5 + rank
    indices = torch.stack([torch.randint(0, shape[d], (nnz,), generator=g)
                           for d in range(sparse_dim)])
    if dtype.is_floating_point:
        values = torch.randn((nnz,) + tuple(shape[sparse_dim:]), generator=g, dtype=dtype)
    else:
        values = torch.randint(-9, 10, (nnz,) + tuple(shape[sparse_dim:]), generator=g,
                               dtype=dtype)
    return torch.sparse_coo_tensor(indices, values, shape, check_invariants=True)


CASES = [  # shape, sparse_dim, dtype, op
    ((7, 4), 2, torch.float64, "average"),
    ((7, 4), 2, torch.float32, "sum"),
    ((9, 2, 3), 1, torch.float64, "average"),     # embedding-like: whole rows
    ((6, 5), 2, torch.int64, "average"),          # integers: each index's sum truncated
]


def body_sparse_allreduce():
    import horovod_ext.torch as hvd
    from horovod_ext.torch.sparse import sparse_allreduce, sparse_allreduce_async
    r, n = hvd.rank(), hvd.size()
    handles = [sparse_allreduce_async(rank_sparse(r, shape, sd, dtype), name=f"case.{i}",
                                      op=getattr(hvd, op.capitalize()))
               for i, (shape, sd, dtype, op) in enumerate(CASES)]
    for i, (handle, (shape, sd, dtype, op)) in enumerate(zip(handles, CASES)):
        got = hvd.synchronize(handle)
        assert hvd.poll(handle) and handle() is got
        assert got.is_sparse and got.shape == shape and got.dtype == dtype
        dense_sum = sum(rank_sparse(k, shape, sd, dtype).to_dense() for k in range(n))
        if op == "sum":
            expected = dense_sum
        elif dtype.is_floating_point:
            expected = dense_sum / n
        else:
            expected = torch.div(dense_sum, n, rounding_mode="trunc")
        torch.testing.assert_close(got.to_dense(), expected, rtol=1e-6, atol=1e-6,
                                   msg=lambda m: f"case {i}: {m}")
    # the synchronous form, unnamed
    got = sparse_allreduce(rank_sparse(r, (7, 4), 2))
    expected = sum(rank_sparse(k, (7, 4), 2).to_dense() for k in range(n)) / n
    torch.testing.assert_close(got.to_dense(), expected)
    errors = []
    for bad in (lambda: sparse_allreduce_async(torch.ones(3), "dense", hvd.Average),
                lambda: sparse_allreduce_async(rank_sparse(r, (4, 4), 2), "min", hvd.Min)):
        try:
            bad()
            errors.append(None)
        except (TypeError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return errors


class EmbeddingNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embedding = torch.nn.Embedding(VOCAB, DIM, sparse=True)
        self.head = torch.nn.Linear(DIM, 2)

    def forward(self, tokens):
        return self.head(self.embedding(tokens)).sum()


def tokens(step, rank):
    """Rank ``rank``'s tokens at ``step`` (repeats included); rank 1 skips step 1 entirely."""
    if step == 1 and rank == 1:
        return None
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, 3 + rank), generator=g)


def body_sparse_training(sparse_as_dense, opt_name):
    """DistributedOptimizer over an nn.Embedding(sparse=True) beside dense layers equals one
    process stepping on the mean of the ranks' losses; the embedding's gradient stays sparse."""
    import horovod_ext.torch as hvd
    r, n = hvd.rank(), hvd.size()

    def make():
        model = EmbeddingNet().double()
        if opt_name == "sgd":
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        else:                           # SparseAdam takes the embedding only: sparse grads
            opt = torch.optim.SparseAdam(list(model.embedding.parameters()), lr=0.1)
        return model, opt

    model, opt = make()
    ref_model, ref_opt = make()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   sparse_as_dense=sparse_as_dense)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        mine = tokens(step, r)
        if mine is not None:
            model(mine).backward()
        used = [k for k in range(n) if tokens(step, k) is not None]
        (sum(ref_model(tokens(step, k)) for k in used) / n).backward()
        opt.synchronize()
        weight = model.embedding.weight.grad
        assert weight.is_sparse, (step, weight.layout)
        if sparse_as_dense:      # reduced dense, handed back sparse
            assert weight.is_coalesced()
        else:                    # gathered: every rank's lookups, one entry each
            assert weight._nnz() == sum(tokens(step, k).numel() for k in used)
        torch.testing.assert_close(weight.to_dense(), ref_model.embedding.weight.grad.to_dense())
        with opt.skip_synchronize():
            opt.step()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
    # the embedding left the gradient buckets for good; the dense layers' gradients (SGD's)
    # still live in buckets (however the plan after the second step cut them)
    bucket_of = getattr(opt._hvd.reducer, "bucket_of", {})
    assert id(model.embedding.weight) not in bucket_of
    dense = [p for n, p in model.named_parameters() if not n.startswith("embedding")]
    assert all(id(p) in bucket_of for p in dense) if opt_name == "sgd" else not bucket_of
    return "ok"


def body_sparse_all(backend_cases):
    errors = body_sparse_allreduce()
    for sparse_as_dense, opt_name in backend_cases:
        body_sparse_training(sparse_as_dense, opt_name)
    return errors


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_allreduce_and_sparse_gradients(backend):
    training = [(False, "sgd"), (True, "sgd"), (False, "sparse_adam"), (True, "sparse_adam")]
    for errors in run_ranks(body_sparse_all, 2, backend, args=(training,)):
        assert errors[0].startswith("TypeError") and "sparse COO" in errors[0]
        assert errors[1].startswith("ValueError") and "Average or Sum" in errors[1]


def body_horovod_behaviours():
    import warnings
    import horovod_ext.torch as hvd
    r, n = hvd.rank(), hvd.size()
    out = {}

    # broadcast_optimizer_state on a new optimizer: trainable parameters without a gradient
    # get a zero one (Horovod leaves them so), frozen ones keep None, nothing moves
    class Frozen(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.index = torch.nn.Parameter(torch.tensor([1, 3]), requires_grad=False)
            self.weight = torch.nn.Parameter(torch.arange(4.0) + r)

    m = Frozen()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    opt = hvd.DistributedOptimizer(opt, named_parameters=m.named_parameters())
    hvd.broadcast_parameters(m.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert m.index.grad is None
    assert torch.equal(m.weight.grad, torch.zeros(4))
    assert torch.equal(m.weight.detach(), torch.arange(4.0)) and not opt.state

    # unnamed parameters in two groups: Horovod's unique names, the same on every rank, and
    # averaging as usual
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.SGD([{"params": net[0].parameters()}, {"params": net[1].parameters()}],
                          lr=0.1)
    opt = hvd.DistributedOptimizer(opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    names = opt._parameter_names
    assert set(names) == set(net.parameters())
    out["names"] = sorted(names.values())
    xs = [torch.full((2, 3), float(k + 1)) for k in range(n)]
    net(xs[r]).sum().backward()
    (sum(ref(x).sum() for x in xs) / n).backward()

    # synchronize(), clipping, then step() outside skip_synchronize(): Horovod's warning, once,
    # and the clipped average is what steps
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    out["warnings"] = [(w.category.__name__, str(w.message)) for w in caught]
    ref_opt.step()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    # within skip_synchronize() no warning
    opt.zero_grad()
    net(xs[r]).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opt.skip_synchronize():
            opt.step()
    out["warnings_skipped"] = len(caught)
    return out


@pytest.mark.timeout(60)
def test_horovod_optimizer_behaviours():
    expected_names = sorted(f"allreduce.noname.{g}.{j}" for g in (0, 1) for j in (0, 1))
    for out in run_ranks(body_horovod_behaviours, 2, "gloo"):
        assert out["names"] == expected_names
        assert len(out["warnings"]) == 1, out["warnings"]
        category, message = out["warnings"][0]
        assert category == "UserWarning"
        assert "optimizer.step() called without optimizer.skip_synchronize()" in message
        assert out["warnings_skipped"] == 0
