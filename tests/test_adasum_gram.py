"""Adasum's tree from one Gram matrix (horovod_ext/algorithms/adasum/gram.py), against plain
float64 references written here: the Gram kernels, the root's weights against the tree computed
level by level on the vectors themselves, and the weighted sum.  C kernels and the torch/numpy
code (HOST_CODE off) alike.  The in-node Adasum that uses them runs over real ranks in
test_adasum.py (every process count, zeros, parallel inputs)."""
import numpy as np
import pytest
import torch

from horovod_ext.algorithms.adasum import gram as G
from horovod_ext.algorithms.adasum import operator
from horovod_ext.algorithms.adasum.operator import LayerMap

pytestmark = pytest.mark.timeout(60)

SIZES = [3, 5000, 1, 70000, 2, 300, 20, 0, 257]


def _bounds():
    bounds, off = [], 0
    for n in SIZES:
        bounds.append((off, n))
        off += n
    bounds.pop(2)   # a gap: its elements belong to no layer
    return bounds, off


def _reference_gram(vectors, bounds, lo, hi):
    """(layers, k (k + 1) / 2) float64 products over [lo, hi), one pair at a time."""
    k = len(vectors)
    out = np.zeros((len(bounds), G.pair_count(k)))
    for layer, (start, n) in enumerate(bounds):
        a, b = max(start, lo), min(start + n, hi)
        if b <= a:
            continue
        rows = [v[a:b].double() for v in vectors]
        out[layer] = [float((rows[i] * rows[j]).sum()) for i in range(k) for j in range(i, k)]
    return out


def _reference_tree(vectors, k):
    """Adasum's tree over ``k`` float64 vectors, level by level on the vectors: the fold of
    r >= p into r - p, then distance 1, 2, ...; each side weighted by the ranks it stands for;
    a zero side weighs 1."""
    vs = [v.double().clone() for v in vectors]
    stands = [1] * k
    p = 1 << (k.bit_length() - 1)
    levels = [[(r - p, r) for r in range(p, k)]] if k > p else []
    d = 1
    while d < p:
        levels.append([(i, i + d) for i in range(0, p, 2 * d)])
        d *= 2
    for pairs in levels:
        for a, b in pairs:
            x, y = vs[a], vs[b]
            total = stands[a] + stands[b]
            ab, aa, bb = float(x @ y), float(x @ x), float(y @ y)
            ca = 1 - ab / (total / stands[a] * aa) if aa > 0 else 1.0
            cb = 1 - ab / (total / stands[b] * bb) if bb > 0 else 1.0
            vs[a] = ca * x + cb * y
            stands[a] = total
    return vs[0]


@pytest.mark.parametrize("host_code", [True, False])
def test_gram_matches_float64_products(monkeypatch, host_code):
    """Tolerance: per layer, 1e-7 of the largest |x_j|^2 for float32 (the C kernel sums float32
    products over short blocks), 1e-12 for float64; vectors far outside float32's comfortable
    range (1e-25, 1e19) take the float64 products and hold 1e-12 too."""
    monkeypatch.setattr(operator, "HOST_CODE", host_code)
    bounds, n = _bounds()
    layers = LayerMap(bounds)
    lo, hi = 1, n - 5   # a piece cutting the first and last layers
    piece = layers.piece(lo, hi)
    g = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.float64):
        for k in (1, 2, 3, 4, 5, 8):
            for scale in (1.0, 1e-25, 1e19):
                vectors = [(torch.randn(n, generator=g) * scale).to(dtype) for _ in range(k)]
                if k > 1:
                    vectors[1][3:5003] = 0   # a zero layer
                got = G.gram([v[lo:hi] for v in vectors], piece)
                want = _reference_gram(vectors, bounds, lo, hi)
                diag = want[:, [i * k - i * (i - 1) // 2 for i in range(k)]]
                norm = np.maximum(diag.max(axis=1, keepdims=True), 1e-300)
                tol = 1e-7 if dtype == torch.float32 and scale == 1.0 else 1e-12
                assert (np.abs(got - want) / norm).max() < tol, (dtype, k, scale)
                assert (diag > 0).sum() >= 7   # real layers compared


def test_two_vectors_give_the_bits_of_the_pair_kernels():
    """Two vectors: the Gram matrix is operator.partial_dots' [a.b, a.a, b.b] in packed order,
    the root's weights are operator.coefficients' and mix_ is combine_, bit for bit (C
    kernels): the in-node tree at two ranks is the pair Adasum of RVH and the gather path."""
    bounds, n = _bounds()
    layers = LayerMap(bounds)
    piece = layers.piece(0, n)
    g = torch.Generator().manual_seed(8)
    for dtype in (torch.float32, torch.float64):
        a, b = (torch.randn(n, generator=g).to(dtype) for _ in range(2))
        packed = G.gram([a, b], piece)
        dots = operator.partial_dots(a, b, piece).numpy()
        assert np.array_equal(packed[:, [1, 0, 2]], dots), dtype
        weights = G.tree_weights(packed, 2)
        assert np.array_equal(weights, operator.coefficients(torch.from_numpy(dots)).numpy())
        mixed = G.mix_(torch.empty_like(a), [a, b], weights, piece)
        combined = operator.combine_(a.clone(), b, True, torch.from_numpy(weights), piece)
        inside = torch.ones(n, dtype=torch.bool)
        inside[5003] = False   # the gap: mix_ writes no element outside the layers
        assert torch.equal(mixed[inside], combined[inside]), dtype


@pytest.mark.parametrize("host_code", [True, False])
def test_root_weights_give_the_tree_computed_level_by_level(monkeypatch, host_code):
    """sum_j w_j x_j, with the weights from the Gram matrix alone, is the tree computed on the
    vectors level by level (float64, 1e-12 relative), at 2 to 8 vectors, with zero inputs,
    identical inputs (their mean: themselves) and inputs that cancel exactly (x1 = -x0: the
    pair is zero and weighs 1 at the next level, as the zero vector does level by level)."""
    monkeypatch.setattr(operator, "HOST_CODE", host_code)
    g = torch.Generator().manual_seed(9)
    m = 500
    for k in range(2, 9):
        cases = {"random": [torch.randn(m, generator=g, dtype=torch.float64)
                            for _ in range(k)]}
        same = torch.randn(m, generator=g, dtype=torch.float64)
        cases["same"] = [same.clone() for _ in range(k)]
        zero = [torch.randn(m, generator=g, dtype=torch.float64) for _ in range(k)]
        zero[k - 1] = torch.zeros(m, dtype=torch.float64)
        cases["zero"] = zero
        cancel = [torch.randn(m, generator=g, dtype=torch.float64) for _ in range(k)]
        cancel[1] = -cancel[0]
        cases["cancel"] = cancel
        for name, vectors in cases.items():
            packed = _reference_gram(vectors, [(0, m)], 0, m)
            w = G.tree_weights(packed, k)[0]
            got = sum(float(w[j]) * vectors[j] for j in range(k))
            want = _reference_tree(vectors, k)
            err = float((got - want).norm() / want.norm().clamp_min(1e-300))
            assert err < 1e-12, (k, name, err)
            if name == "same":
                assert torch.allclose(got, same, rtol=1e-12, atol=0)
    # the C code and numpy agree (the same formulas; sums may round apart)
    packed = _reference_gram([torch.randn(m, generator=g, dtype=torch.float64)
                              for _ in range(5)], [(0, m)], 0, m)
    assert np.allclose(G.tree_weights(packed, 5), G.tree_weights_numpy(packed, 5),
                       rtol=1e-13, atol=0)


@pytest.mark.parametrize("host_code", [True, False])
def test_mix_writes_the_weighted_sum_and_its_copy(monkeypatch, host_code):
    """out = sum_j w_j x_j on the piece's segments (weights rounded to the vectors' type, terms
    added in order: within 4 roundings of the float64 sum), ``copy`` the same bits; elements
    outside the segments untouched; out and copy may be among the inputs."""
    monkeypatch.setattr(operator, "HOST_CODE", host_code)
    bounds, n = _bounds()
    piece = LayerMap(bounds).piece(0, n)
    g = torch.Generator().manual_seed(10)
    for dtype in (torch.float16, torch.float32, torch.float64):
        k = 4
        vectors = [torch.randn(n, generator=g).to(dtype) for _ in range(k)]
        weights = np.random.default_rng(1).uniform(-2, 2, size=(len(bounds), k))
        want = torch.zeros(n, dtype=torch.float64)
        for layer, (start, count) in enumerate(bounds):
            for j in range(k):
                want[start:start + count] += weights[layer, j] * vectors[j][start:start + count]
        out, copy = torch.full((n,), 7.0, dtype=dtype), torch.full((n,), 7.0, dtype=dtype)
        G.mix_(out, vectors, weights, piece, copy)
        eps = torch.finfo(dtype).eps
        inside = torch.ones(n, dtype=torch.bool)
        inside[5003] = False
        scale = sum(v.double().abs() for v in vectors) * 2
        assert ((out.double() - want).abs() <= 4 * eps * scale)[inside].all(), dtype
        assert torch.equal(out, copy) and out[5003] == 7.0
        # out and copy among the inputs: the same result
        aliased = [v.clone() for v in vectors]
        G.mix_(aliased[2], aliased, weights, piece, aliased[0])
        assert torch.equal(aliased[2][inside], out[inside])
        assert torch.equal(aliased[0][inside], out[inside]), dtype


@pytest.mark.parametrize("host_code", [True, False])
def test_nearly_cancelling_inputs_keep_their_precision(monkeypatch, host_code):
    """float32 inputs at 4 ranks whose first pair nearly cancels (x1 = -x0 + 1e-5 noise): the
    tree's second level then works on a pair result 1e-5 the size of its inputs, and its
    coefficients come from differences of the Gram entries.  Within 5e-5 of the float64 tree
    (the level by level float32 tree gives about 3e-6 here, float32-block products gave 6e-4)."""
    monkeypatch.setattr(operator, "HOST_CODE", host_code)
    g = torch.Generator().manual_seed(12)
    m = 300000
    piece = LayerMap([(0, m)]).piece(0, m)
    vectors = [torch.randn(m, generator=g) for _ in range(4)]
    vectors[1] = -vectors[0] + 1e-5 * torch.randn(m, generator=g)
    weights = G.tree_weights(G.gram(vectors, piece), 4)
    got = G.mix_(torch.empty(m), vectors, weights, piece)
    want = _reference_tree(vectors, 4)
    err = float((got.double() - want).norm() / want.norm())
    assert err < 5e-5, err
