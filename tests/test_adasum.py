"""Adasum against its formula and the tree reference computed here, over real Gloo and MPI ranks.

One 8-process run per backend covers every process count from 2 to 8: the world, and
sub-communicators of 2, 3, 4, 5 and 6 ranks split from it, each running the same AdasumRVH code
that ``hvd.allreduce(op=hvd.Adasum)`` runs on the world.
"""
import pytest
import torch

from tests.harness import BACKENDS, run_ranks

LAYERS = [(3, 5), (17,), (1,), (64, 9), (0,), (1000,), (7, 7, 3)]  # odd sizes, an empty one
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
# relative error (norm of the difference / norm of the reference) allowed per dtype
REL_TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5, torch.float64: 1e-12}


# --- the reference: Adasum by its formula, the tree over ranks ------------------------------
def ref_pair(a, b, shapes):
    """Adasum of two lists of tensors, layer by layer, in float64."""
    out = []
    for x, y in zip(a, b):
        x, y = x.double().reshape(-1), y.double().reshape(-1)
        ab, aa, bb = float(x @ y), float(x @ x), float(y @ y)
        ca = 1 - ab / (2 * aa) if aa > 0 else 1.0
        cb = 1 - ab / (2 * bb) if bb > 0 else 1.0
        out.append(ca * x + cb * y)
    return [o.reshape(s) for o, s in zip(out, shapes)]


def ref_tree(per_rank, shapes):
    """Ranks r >= p folded into r - p, then (0,1), (2,3), ... and so on up the tree."""
    xs = list(per_rank)
    p = 1 << (len(xs).bit_length() - 1)
    for r in range(p, len(xs)):
        xs[r - p] = ref_pair(xs[r - p], xs[r], shapes)
    xs = xs[:p]
    while len(xs) > 1:
        xs = [ref_pair(xs[i], xs[i + 1], shapes) for i in range(0, len(xs), 2)]
    return xs[0]


def rel_err(actual, expected):
    a = torch.cat([t.double().reshape(-1) for t in actual])
    e = torch.cat([t.double().reshape(-1) for t in expected])
    return float((a - e).norm() / e.norm().clamp_min(1e-300))


def layers_for(rank, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return [torch.randn(s, generator=g).to(dtype) for s in LAYERS]


# --- bodies run in every rank -------------------------------------------------------------
def _rvh_every_count():
    """Layer 2 (adasum_allreduce_) on sub-communicators of every size, plus the public API on
    the world; returns what each rank computed, for the test process to compare."""
    import horovod_ext.torch as hvd
    from horovod_ext.backends import context
    from adasum import adasum_allreduce_
    from tests.test_adasum import layers_for
    r, n = hvd.rank(), hvd.size()
    out = {}

    def run_split(topology):
        world = topology.world
        results = {}
        for size in (2, 3, 4, 5, 6):
            # ranks [0, size) form one group, the rest another (also a valid size)
            group = world.split(0 if r < size else 1)
            layers = layers_for(r, seed=size)
            flat = torch.cat([t.reshape(-1) for t in layers])
            bounds, off = [], 0
            for t in layers:
                bounds.append((off, t.numel()))
                off += t.numel()
            adasum_allreduce_(flat, bounds, group)
            results[size] = (group.size, flat)
        return results

    out["split"] = context.current().execute("test.adasum.split", run_split)
    # The public API over the world: fused (grouped) and one by one, every dtype.
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        layers = layers_for(r, seed=50, dtype=dtype)
        fused = hvd.grouped_allreduce(layers, op=hvd.Adasum, name=f"fused.{dtype}")
        alone = [hvd.allreduce(t, op=hvd.Adasum, name=f"alone.{dtype}.{i}")
                 for i, t in enumerate(layers)]
        out[str(dtype)] = (fused, alone)
    # Orthogonal inputs give the sum, identical inputs the input itself.
    ortho = torch.zeros(n * 5)
    ortho[r * 5:(r + 1) * 5] = torch.arange(1.0, 6.0) * (r + 1)
    out["ortho"] = hvd.allreduce(ortho, op=hvd.Adasum, name="ortho")
    same = torch.linspace(-3, 3, 101)
    out["same"] = hvd.allreduce(same, op=hvd.Adasum, name="same")
    # Zero tensors: one rank all zeros, and all ranks zeros.
    z = torch.zeros(33) if r == 1 else torch.randn(33, generator=torch.Generator().manual_seed(r))
    out["one_zero"] = (z, hvd.allreduce(z, op=hvd.Adasum, name="one_zero"))
    out["all_zero"] = hvd.allreduce(torch.zeros(10), op=hvd.Adasum, name="all_zero")
    try:
        hvd.allreduce(torch.ones(3, dtype=torch.int32), op=hvd.Adasum, name="int")
        out["int_error"] = None
    except Exception as exc:  # refused with a message naming the problem
        out["int_error"] = str(exc)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
def test_adasum_every_process_count(backend):
    results = run_ranks(_rvh_every_count, 8, backend, timeout=200)
    n = len(results)
    shapes = [torch.Size(s) for s in LAYERS]
    for size in (2, 3, 4, 5, 6):
        for members in (range(0, size), range(size, n)):
            inputs = [layers_for(r, seed=size) for r in members]
            expected = ref_tree(inputs, shapes)
            for r in members:
                group_size, flat = results[r]["split"][size]
                assert group_size == len(members)
                got = list(torch.split(flat, [s.numel() for s in shapes]))
                err = rel_err(got, expected)
                assert err < 1e-5, (backend, size, list(members), r, err)
    for dtype in DTYPES:
        expected = ref_tree([layers_for(r, 50, dtype) for r in range(n)], shapes)
        for r in range(n):
            fused, alone = results[r][str(dtype)]
            assert all(t.dtype == dtype and t.shape == s for t, s in zip(fused, shapes))
            assert rel_err(fused, expected) < REL_TOL[dtype], (dtype, r, rel_err(fused, expected))
            assert rel_err(alone, expected) < REL_TOL[dtype], (dtype, r)
            # fused and unfused agree (to rounding: the pieces fall differently)
            assert rel_err(fused, alone) < REL_TOL[dtype] * 2, (dtype, r)
    ortho_sum = torch.cat([torch.arange(1.0, 6.0) * (q + 1) for q in range(n)])
    zeros_in = [results[r]["one_zero"][0] for r in range(n)]
    expected_zero = ref_tree([[t] for t in zeros_in], [torch.Size([33])])[0]
    for r in range(n):
        assert torch.equal(results[r]["ortho"], ortho_sum)
        assert torch.allclose(results[r]["same"], torch.linspace(-3, 3, 101), rtol=1e-6, atol=1e-6)
        assert torch.isfinite(results[r]["one_zero"][1]).all()
        assert rel_err([results[r]["one_zero"][1]], [expected_zero]) < 1e-6
        assert torch.equal(results[r]["all_zero"], torch.zeros(10))
        assert "adasum" in results[r]["int_error"] and "int32" in results[r]["int_error"]
