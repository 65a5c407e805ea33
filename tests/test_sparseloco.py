"""``hvd.SparseLoCo``: the chunked top-k compressor against a plain one written here, the op over
real Gloo and MPI ranks (3 and 2) against a simulation of every rank's error feedback, and
``hvd.DiLoCo(op=hvd.SparseLoCo(...))`` against a plain loop of all workers."""
import pytest
import torch

from tests.harness import BACKENDS, run_ranks

pytestmark = pytest.mark.timeout(120)

SHAPES = [(7, 30), (5,), (300,), (1,)]      # chunks cut across rows, a part chunk, tiny ones
SETTINGS = dict(density=0.05, bits=2, chunk=64, error_decay=0.9)
STEPS = 3


# --- the plain compressor -----------------------------------------------------------------
def ref_compress(x, density, bits, chunk):
    """What the message of ``x`` stands for, computed densely: per chunk (the last one padded
    with zeros), the k largest magnitudes, each put at the centre of its level among 2^(bits-1)
    even levels between the chunk's smallest and largest kept magnitude, with its sign."""
    x = x.float().reshape(-1)
    size = max(1, min(chunk, x.numel()))
    k = max(1, min(size, round(density * size)))
    out = torch.zeros(x.numel())
    levels = 2 ** (bits - 1)
    for start in range(0, x.numel(), size):
        piece = x[start:start + size]
        padded = torch.cat([piece, torch.zeros(size - piece.numel())])
        order = sorted(range(size), key=lambda i: -abs(float(padded[i])))[:k]
        mags = [abs(float(padded[i])) for i in order]
        low, high = min(mags), max(mags)
        step = (high - low) / levels
        for i, m in zip(order, mags):
            level = min(levels - 1, int((m - low) // step)) if step > 0 else 0
            value = low + (level + 0.5) * step
            if i < piece.numel():
                out[start + i] = -value if padded[i] < 0 else value
    return out


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_compressor_matches_the_plain_one(bits):
    from horovod_ext.algorithms.sparseloco import ChunkTopK
    config = ChunkTopK(density=0.05, chunk=64, bits=bits)
    g = torch.Generator().manual_seed(bits)
    for numel in (1, 5, 64, 100, 1000):
        x = torch.randn(numel, generator=g)
        message = config.compress(x)
        assert message.dtype == torch.uint8 and message.numel() == config.nbytes(numel)
        torch.testing.assert_close(config.decompress(message, numel),
                                   ref_compress(x, 0.05, bits, 64), rtol=1e-6, atol=1e-6)


def test_message_is_compact():
    """Positions go as offsets in the chunk (one byte up to 256 elements a chunk, two up to
    65536), values as 2-bit codes: at the paper's 4096 and 1/64, 152 bytes a chunk."""
    from horovod_ext.algorithms.sparseloco import ChunkTopK
    paper = ChunkTopK(density=1 / 64, chunk=4096, bits=2)
    assert paper.nbytes(4096 * 10) == 10 * (8 + 64 * 2 + 64 * 2 // 8)
    assert ChunkTopK(density=1 / 16, chunk=256, bits=2).nbytes(256) == 8 + 16 + 4
    x = torch.randn(4096 * 3 + 5)
    assert torch.equal(paper.decompress(paper.compress(x), x.numel()) != 0,
                       ref_compress(x, 1 / 64, 2, 4096) != 0)


def test_bad_settings_are_refused():
    import horovod_ext.torch as hvd
    for kwargs, word in ((dict(density=0.0), "density"), (dict(bits=3), "bits"),
                         (dict(chunk=1 << 17), "chunk"), (dict(error_decay=1.5), "error_decay")):
        with pytest.raises(ValueError, match=word):
            hvd.SparseLoCo(**kwargs)


# --- the op on real ranks -----------------------------------------------------------------
def _tensors(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def body_op():
    import horovod_ext.torch as hvd
    op = hvd.SparseLoCo(**SETTINGS)
    out = []
    for step in range(STEPS):
        out.append(hvd.grouped_allreduce(_tensors(hvd.rank(), step), op=op, name="g"))
    saved = op.state_dict()   # a checkpoint: the next step, then the same step after a restore
    after = hvd.grouped_allreduce(_tensors(hvd.rank(), STEPS), op=op, name="g")
    op.reset()
    op.load_state_dict(saved)
    resumed = hvd.grouped_allreduce(_tensors(hvd.rank(), STEPS), op=op, name="g")
    resumed_bitwise = all(torch.equal(a, b) for a, b in zip(after, resumed))
    alone = hvd.allreduce(torch.ones(10), op=op, name="alone")   # its own error state
    try:
        hvd.allreduce(torch.ones(3, dtype=torch.int32), op=op, name="int")
        refused = None
    except Exception as exc:   # noqa: BLE001  (the message is asserted)
        refused = str(exc)
    return out, alone, op.bytes_sent, refused, resumed_bitwise


def _simulate(size, compress=None, decay=SETTINGS["error_decay"], steps=STEPS):
    """Every rank's error feedback and messages, step by step: the mean of what they stand for
    (``compress``: what a message of a tensor stands for; SETTINGS' top-k when None)."""
    compress = compress or (lambda e: ref_compress(e, SETTINGS["density"], SETTINGS["bits"],
                                                   SETTINGS["chunk"]))
    errors = [[torch.zeros(s) for s in SHAPES] for _ in range(size)]
    results = []
    for step in range(steps):
        sent = [[None] * len(SHAPES) for _ in range(size)]
        for r in range(size):
            for i, x in enumerate(_tensors(r, step)):
                errors[r][i] = decay * errors[r][i] + x
                sent[r][i] = compress(errors[r][i]).reshape(x.shape)
                errors[r][i] = errors[r][i] - sent[r][i]
        results.append([sum(sent[r][i] for r in range(size)) / size for i in range(len(SHAPES))])
    return results


@pytest.mark.parametrize("backend,size", [("gloo", 3)] + [(b, 2) for b in BACKENDS if b != "gloo"])
def test_op_matches_a_simulation_of_every_rank(backend, size):
    from horovod_ext.algorithms.sparseloco import ChunkTopK
    results = run_ranks(body_op, size, backend)
    want = _simulate(size)
    config = ChunkTopK(SETTINGS["density"], SETTINGS["chunk"], SETTINGS["bits"])
    per_step = sum(config.nbytes(torch.Size(s).numel()) for s in SHAPES)
    for r, (steps, alone, bytes_sent, refused, resumed_bitwise) in enumerate(results):
        assert resumed_bitwise
        for got, ref in zip(steps, want):
            for g, w in zip(got, ref):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        for got, first in zip(steps, results[0][0]):
            assert all(torch.equal(g, f) for g, f in zip(got, first))   # the same bits
        # ten ones: one kept (0.05 of 10 rounds to 0: at least one is), worth 1.0 on every rank
        assert sorted(alone.tolist()) == [0.0] * 9 + [1.0]
        # the restore took the count back to before the step it repeated
        assert bytes_sent == (STEPS + 1) * per_step + config.nbytes(10)
        assert refused is not None and "int32" in refused, refused


# --- DiLoCo with SparseLoCo's outer step --------------------------------------------------
H, ROUNDS, INNER_LR = 3, 3, 0.1


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _local_step(model, opt, rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    x, y = torch.randn(6, 20, generator=g), torch.randn(6, 2, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def body_diloco():
    import horovod_ext.torch as hvd
    model = _model()
    opt = hvd.DiLoCo(torch.optim.SGD(model.parameters(), lr=INNER_LR),
                     named_parameters=model.named_parameters(), sync_every=H, outer_lr=1.0,
                     outer_momentum=0.0, op=hvd.SparseLoCo(**SETTINGS))
    for step in range(H * ROUNDS):
        _local_step(model, opt, hvd.rank(), step)
    return [p.detach().clone() for p in model.parameters()]


def test_diloco_with_sparseloco_matches_a_plain_loop():
    """Each worker's H local steps, its pseudo-gradient error-fed and compressed, the mean of
    the compressed ones as the outer step (outer_lr 1, no momentum: the paper's SparseLoCo)."""
    size = 2
    results = run_ranks(body_diloco, size, "gloo")
    models = [_model() for _ in range(size)]
    opts = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    errors = [[torch.zeros_like(a) for a in anchor] for _ in range(size)]
    for rnd in range(ROUNDS):
        sent = []
        for r, (model, opt) in enumerate(zip(models, opts)):
            for step in range(rnd * H, rnd * H + H):
                _local_step(model, opt, r, step)
            mine = []
            for i, (a, p) in enumerate(zip(anchor, model.parameters())):
                errors[r][i] = SETTINGS["error_decay"] * errors[r][i] + (a - p.detach())
                mine.append(ref_compress(errors[r][i], SETTINGS["density"], SETTINGS["bits"],
                                         SETTINGS["chunk"]).reshape(a.shape))
                errors[r][i] = errors[r][i] - mine[-1]
            sent.append(mine)
        anchor = outer_step(models, anchor, sent, 1.0)
    assert_every_rank_holds(results, anchor)


def outer_step(models, anchor, sent, outer_lr):
    """The plain outer step without momentum: the anchor moved by ``outer_lr`` times the mean of
    the workers' sent pseudo-gradients, and every worker restarted from it; the new anchor."""
    anchor = [a - outer_lr * sum(s[i] for s in sent) / len(sent) for i, a in enumerate(anchor)]
    with torch.no_grad():
        for model in models:
            for p, a in zip(model.parameters(), anchor):
                p.copy_(a)
    return anchor


def assert_every_rank_holds(results, anchor):
    for params in results:
        for got, ref in zip(params, anchor):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
