"""``hvd.Quantized``: the chunked quantiser against a plain one written here, the op over real Gloo
and MPI ranks against a simulation of every rank (with and without error feedback), and
``hvd.DiLoCo(op=hvd.Quantized(...))`` against a plain loop of all workers."""
import pytest
import torch

from tests.harness import BACKENDS, run_ranks
from tests import test_sparseloco
from tests.test_sparseloco import SHAPES, _local_step, _model, _tensors

pytestmark = pytest.mark.timeout(120)

FED = dict(bits=4, chunk=64, error_decay=0.5)
PLAIN = dict(bits=8, chunk=64)
STEPS = 3


def ref_quantize(x, bits, chunk):
    """What the message of ``x`` stands for, element by element: per chunk its largest magnitude
    m, and each value put on the nearest of the levels q * m / L, L = 2^(bits-1) - 1."""
    x = x.float().reshape(-1)
    size = max(1, min(chunk, x.numel()))
    top = 2 ** (bits - 1) - 1
    out = torch.zeros(x.numel())
    for start in range(0, x.numel(), size):
        piece = x[start:start + size]
        m = max(abs(float(v)) for v in piece)
        for i, v in enumerate(piece.tolist()):
            q = max(-top, min(top, round(v * top / m))) if m > 0 else 0
            out[start + i] = q * (m / top)
    return out


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantiser_matches_the_plain_one(bits):
    from horovod_ext.algorithms.quantize import ChunkQuantize
    config = ChunkQuantize(bits=bits, chunk=64)
    g = torch.Generator().manual_seed(bits)
    for numel in (1, 5, 64, 100, 1000):
        x = torch.randn(numel, generator=g)
        message = config.compress(x)
        assert message.dtype == torch.uint8 and message.numel() == config.nbytes(numel)
        got = config.decompress(message, numel)
        torch.testing.assert_close(got, ref_quantize(x, bits, 64), rtol=1e-6, atol=1e-6)
    zeros = config.decompress(config.compress(torch.zeros(70)), 70)
    assert torch.equal(zeros, torch.zeros(70))


def test_message_is_compact():
    """One float32 scale a chunk and the codes packed: 8 bits at 256 a chunk is 260 bytes a chunk
    against 1024 in float32; 4 bits 132."""
    from horovod_ext.algorithms.quantize import ChunkQuantize
    assert ChunkQuantize(8, 256).nbytes(256 * 10) == 10 * 260
    assert ChunkQuantize(4, 256).nbytes(256 * 10) == 10 * 132
    assert ChunkQuantize(2, 256).nbytes(5) == 4 + 2 + 2     # a scale, 10 bits, padding to 4


def test_bad_settings_are_refused():
    import horovod_ext.torch as hvd
    for kwargs, word in ((dict(bits=3), "bits"), (dict(chunk=0), "chunk"),
                         (dict(error_decay=-0.5), "error_decay")):
        with pytest.raises(ValueError, match=word):
            hvd.Quantized(**kwargs)


def body_op():
    import horovod_ext.torch as hvd
    fed, plain = hvd.Quantized(**FED), hvd.Quantized(**PLAIN)
    out = [hvd.grouped_allreduce(_tensors(hvd.rank(), step), op=fed, name="g")
           for step in range(STEPS)]
    # the same tensors as requests of their own, submitted together: the engine may fuse them
    # into one buffer, and each keeps its own error all the same
    apart = []
    for step in range(STEPS):
        tensors = _tensors(hvd.rank(), step)
        handles = [hvd.allreduce_async_(t, op=fed, name=f"s.{i}") for i, t in enumerate(tensors)]
        apart.append([hvd.synchronize(h) for h in handles])
    once = hvd.grouped_allreduce(_tensors(hvd.rank(), 0), op=plain, name="p")
    again = hvd.grouped_allreduce(_tensors(hvd.rank(), 0), op=plain, name="p")
    return (out, apart, once, again, fed.bytes_sent, plain.bytes_sent,
            len(plain.state_dict()["errors"]))


def _simulate(size, settings, steps):
    """Every rank's error feedback and quantised messages, step by step: their mean."""
    return test_sparseloco._simulate(
        size, lambda e: ref_quantize(e, settings["bits"], settings["chunk"]),
        settings.get("error_decay", 0.0), steps)


@pytest.mark.parametrize("backend,size", [("gloo", 3)] + [(b, 2) for b in BACKENDS if b != "gloo"])
def test_op_matches_a_simulation_of_every_rank(backend, size):
    from horovod_ext.algorithms.quantize import ChunkQuantize
    results = run_ranks(body_op, size, backend)
    fed, plain = _simulate(size, FED, STEPS), _simulate(size, PLAIN, 1)[0]
    nbytes = [sum(ChunkQuantize(s["bits"], s["chunk"]).nbytes(torch.Size(shape).numel())
                  for shape in SHAPES) for s in (FED, PLAIN)]
    for steps, apart, once, again, fed_bytes, plain_bytes, plain_errors in results:
        for got, got_apart, ref in zip(steps, apart, fed):
            for g, a, w in zip(got, got_apart, ref):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-6)
        for g, w, a in zip(once, plain, again):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
            assert torch.equal(g, a)          # no error kept: the same input, the same result
        for got, first in zip(steps, results[0][0]):
            assert all(torch.equal(g, f) for g, f in zip(got, first))   # the same bits
        assert (fed_bytes, plain_bytes, plain_errors) == (2 * STEPS * nbytes[0], 2 * nbytes[1], 0)


H, ROUNDS, INNER_LR, OUTER_LR = 3, 3, 0.1, 0.8


def body_diloco():
    import horovod_ext.torch as hvd
    model = _model()
    opt = hvd.DiLoCo(torch.optim.SGD(model.parameters(), lr=INNER_LR),
                     named_parameters=model.named_parameters(), sync_every=H, outer_lr=OUTER_LR,
                     outer_momentum=0.0, op=hvd.Quantized(**PLAIN))
    for step in range(H * ROUNDS):
        _local_step(model, opt, hvd.rank(), step)
    return [p.detach().clone() for p in model.parameters()]


def test_diloco_with_quantized_matches_a_plain_loop():
    """Each worker's H local steps, its pseudo-gradient quantised per tensor, the mean of the
    quantised ones times the outer learning rate as the outer step."""
    size = 2
    results = run_ranks(body_diloco, size, "gloo")
    models = [_model() for _ in range(size)]
    opts = [torch.optim.SGD(m.parameters(), lr=INNER_LR) for m in models]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    for rnd in range(ROUNDS):
        sent = []
        for r, (model, opt) in enumerate(zip(models, opts)):
            for step in range(rnd * H, rnd * H + H):
                _local_step(model, opt, r, step)
            sent.append([ref_quantize(a - p.detach(), PLAIN["bits"], PLAIN["chunk"])
                         .reshape(a.shape) for a, p in zip(anchor, model.parameters())])
        anchor = test_sparseloco.outer_step(models, anchor, sent, OUTER_LR)
    test_sparseloco.assert_every_rank_holds(results, anchor)
