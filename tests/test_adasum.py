"""Adasum against its formula and the tree reference computed here, over real Gloo and MPI ranks.

One 8-process run per backend covers every process count from 2 to 8: the world, and
sub-communicators of 2, 3, 4, 5 and 6 ranks split from it, each running the same code that
``hvd.allreduce(op=hvd.Adasum)`` runs on the world, by both of its paths: AdasumRVH and the
gather path that small messages take; float16 and bfloat16 RVH too, and the device-generic torch
code (what CUDA tensors run) on CPU tensors.  At counts that are not powers of two the tree is
weighted by the ranks each side stands for (rvh.py), so parallel inputs give their mean; at powers
of two the results are those of the unweighted code, bit for bit.
"""
import hashlib

import pytest
import torch

from tests.harness import BACKENDS, run_ranks

LAYERS = [(3, 5), (17,), (1,), (64, 9), (0,), (1000,), (7, 7, 3)]  # odd sizes, an empty one
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
# Splits that also run 16-bit RVH and the device-generic torch code: their two groups have
# 2, 6, 3 and 5 ranks (pairs, folds, two levels), for two fifths of the cost of all splits.
EXTRA_SIZES = (2, 3)
# relative error (norm of the difference / norm of the reference) allowed per dtype
REL_TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5, torch.float64: 1e-12}
# Splits whose groups (3 and 5 ranks) also combine parallel inputs, which must give their mean,
# within PARALLEL_TOL per layer (relative).
PARALLEL_SIZES = (3, 5)
PARALLEL_TOL = {torch.float32: 1e-6, torch.float64: 1e-12}
# Rank r's layer l is PARALLEL_SCALES[(r + l) % 8] times a vector shared by all ranks: small
# dyadic factors times multiples of 1/256, so the inputs are exactly parallel even in float32.
PARALLEL_SCALES = (1.0, 1.5, 0.75, 2.0, 1.25, 0.5, 1.75, 0.625)


# --- the reference: Adasum by its formula, the tree over ranks ------------------------------
def ref_pair(a, b, shapes, ranks_a=1, ranks_b=1):
    """Adasum of two lists of tensors, layer by layer, in float64, the sides standing for
    ``ranks_a`` and ``ranks_b`` ranks: (1 - w_a a.b/|a|^2) a + (1 - w_b a.b/|b|^2) b with
    w_a = ranks_a / (ranks_a + ranks_b); equal sides give the usual 1 - a.b/(2|a|^2)."""
    w_a, w_b = ranks_a / (ranks_a + ranks_b), ranks_b / (ranks_a + ranks_b)
    out = []
    for x, y in zip(a, b):
        x, y = x.double().reshape(-1), y.double().reshape(-1)
        ab, aa, bb = float(x @ y), float(x @ x), float(y @ y)
        ca = 1 - w_a * ab / aa if aa > 0 else 1.0
        cb = 1 - w_b * ab / bb if bb > 0 else 1.0
        out.append(ca * x + cb * y)
    return [o.reshape(s) for o, s in zip(out, shapes)]


def ref_tree(per_rank, shapes):
    """Ranks r >= p folded into r - p (two single ranks: the usual Adasum), then (0,1), (2,3),
    ... and so on up the tree, each pair weighted by the ranks its two sides stand for."""
    xs = list(per_rank)
    p = 1 << (len(xs).bit_length() - 1)
    ranks = [1] * p
    for r in range(p, len(xs)):
        xs[r - p] = ref_pair(xs[r - p], xs[r], shapes)
        ranks[r - p] = 2
    xs = xs[:p]
    while len(xs) > 1:
        xs = [ref_pair(xs[i], xs[i + 1], shapes, ranks[i], ranks[i + 1])
              for i in range(0, len(xs), 2)]
        ranks = [ranks[i] + ranks[i + 1] for i in range(0, len(ranks), 2)]
    return xs[0]


def rel_err(actual, expected):
    a = torch.cat([t.detach().double().reshape(-1) for t in actual])
    e = torch.cat([t.detach().double().reshape(-1) for t in expected])
    return float((a - e).norm() / e.norm().clamp_min(1e-300))


def layers_for(rank, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return [torch.randn(s, generator=g).to(dtype) for s in LAYERS]


def exact_vector(numel, seed):
    """Multiples of 1/256 in [-3.9, 3.9], from integers only: the same values on every machine
    and exact in float16 and up (no random generator, whose stream may change between versions)."""
    i = torch.arange(numel, dtype=torch.int64)
    return (((i * 7919 + (seed + 1) * 104729) % 2001) - 1000).double() / 256


def parallel_layers(rank, dtype):
    """Rank ``rank``'s layers, each a multiple of the same layer on every rank (see
    PARALLEL_SCALES)."""
    return [(exact_vector(torch.Size(s).numel(), seed=l)
             * PARALLEL_SCALES[(rank + l) % len(PARALLEL_SCALES)]).to(dtype).reshape(s)
            for l, s in enumerate(LAYERS)]


def parallel_mean(members):
    """The mean of ``parallel_layers`` over ``members``, per layer, in float64."""
    return [sum(parallel_layers(r, torch.float64)[l] for r in members) / len(members)
            for l in range(len(LAYERS))]


# --- bodies run in every rank -------------------------------------------------------------
def _rvh_every_count():
    """Layer 2 (adasum_allreduce_) on sub-communicators of every size, plus the public API on
    the world; returns what each rank computed, for the test process to compare."""
    import horovod_ext.torch as hvd
    from horovod_ext.backends import context
    import horovod_ext.algorithms.adasum.rvh as rvh_module
    import horovod_ext.algorithms.adasum.shared_memory as shm_module
    from horovod_ext.algorithms.adasum import adasum_allreduce_, in_node_adasum_
    from horovod_ext.algorithms.adasum import operator
    from horovod_ext.backends.shm import SharedMemoryGroup
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
            rvh = adasum_allreduce_(flat.clone(), bounds, group, gather_limit=0)
            gathered = adasum_allreduce_(flat.clone(), bounds, group, gather_limit=1 << 30)
            segment = SharedMemoryGroup(group, timeout=60)   # the one-host path
            in_node = in_node_adasum_(flat.clone(), bounds, segment)
            # over MPI, the first exchange of every level in chunks (cut across layers, odd
            # lengths) whose products are summed as they arrive; twice, so the second call
            # runs the exchanges prepared by the first (Gloo exchanges are never chunked); then
            # with every peer taken as another host's, whose exchanges go whole (a pair of
            # such ranks would swap whole vectors instead: test_flat_adasum_over_hosts...)
            chunk, rvh_module.CHUNK_ELEMENTS = rvh_module.CHUNK_ELEMENTS, 37
            swap, rvh_module.PAIR_SWAP_LIMIT = rvh_module.PAIR_SWAP_LIMIT, -1
            try:
                chunked = [adasum_allreduce_(flat.clone(), bounds, group, gather_limit=0)
                           for _ in range(2)]
                others = frozenset(range(group.size)) - {group.rank}
                chunked.append(adasum_allreduce_(flat.clone(), bounds, group, gather_limit=0,
                                                 remote=others))
            finally:
                rvh_module.CHUNK_ELEMENTS, rvh_module.PAIR_SWAP_LIMIT = chunk, swap
            # in shared memory in chunks of 301 elements (cut across layers, odd shards), by
            # address and with the torch code
            chunk, shm_module.CHUNK_BYTES = shm_module.CHUNK_BYTES, 301 * flat.element_size()
            try:
                for host in (True, False):
                    operator.HOST_CODE = host
                    chunked.append(in_node_adasum_(flat.clone(), bounds, segment))
            finally:
                shm_module.CHUNK_BYTES, operator.HOST_CODE = chunk, True
            extra = {"chunks": {bool(key[-1]): [len(level.chunks) for level in plan.levels]
                                for key, plan in rvh_module.layer_map(bounds).plans.items()
                                if key[0] == "rvh" and key[7] == 37 and key[6] is group}}
            if size in PARALLEL_SIZES:
                # parallel inputs, C kernels and torch code, RVH and gather: checked for the mean
                for dtype in (torch.float32, torch.float64):
                    x = torch.cat([t.reshape(-1) for t in parallel_layers(r, dtype)])
                    for host in (True, False):
                        operator.HOST_CODE = host
                        try:
                            extra[("parallel", str(dtype), host)] = [
                                adasum_allreduce_(x.clone(), bounds, group, gather_limit=g)
                                for g in (0, 1 << 30)] + [
                                in_node_adasum_(x.clone(), bounds, segment)]
                        finally:
                            operator.HOST_CODE = True
            if size not in EXTRA_SIZES:
                segment.close()
                results[size] = (group.size, rvh, gathered, chunked, extra, in_node)
                continue
            # 16-bit floats through RVH's exchanges (over MPI: as int16, see backends/mpi.py)
            for dtype in (torch.float16, torch.bfloat16):
                half = torch.cat([t.reshape(-1) for t in layers_for(r, seed=size, dtype=dtype)])
                extra[str(dtype)] = adasum_allreduce_(half, bounds, group, gather_limit=0)
            # the torch code CUDA tensors run (no C kernels, numpy or C weights), both paths
            operator.HOST_CODE = False
            try:
                extra["generic"] = [adasum_allreduce_(flat.clone(), bounds, group, gather_limit=g)
                                    for g in (0, 1 << 30)]
                half = torch.cat([t.reshape(-1)
                                  for t in layers_for(r, seed=size, dtype=torch.float16)])
                extra["generic float16"] = adasum_allreduce_(half, bounds, group, gather_limit=0)
                extra["generic shm float16"] = in_node_adasum_(half.clone(), bounds, segment)
            finally:
                operator.HOST_CODE = True
            segment.close()
            results[size] = (group.size, rvh, gathered, chunked, extra, in_node)
        return results

    def run_moves(topology):
        """16-bit floats and bools moved by the world's collectives, bits unchanged (MPI gets
        int16 and uint8 views): every rank's values, special ones included."""
        world = topology.world
        special = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-7, 65504.0])
        moved = {}
        for dtype in (torch.float16, torch.bfloat16, torch.bool):
            mine = (special + r).to(dtype)
            gathered = world.allgather(mine.view(1, -1))
            cast = mine.clone() if r == 3 else torch.zeros_like(mine)
            world.broadcast(cast, root=3)
            got = torch.zeros_like(mine)
            world.sendrecv(mine, (r + 1) % n, got, (r - 1) % n)
            moved[str(dtype)] = (mine, gathered, cast, got)
        return moved

    out["split"] = context.current().execute("test.adasum.split", run_split)
    out["moves"] = context.current().execute("test.adasum.moves", run_moves)
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
    from horovod_ext.algorithms import adasum
    from horovod_ext.algorithms.adasum import operator
    results = run_ranks(_rvh_every_count, 8, backend, timeout=200)
    n = len(results)
    # RVH's prepared schedules (and their chunks) belong to the C kernels' path
    native = operator.kernels_for(torch.zeros(1)) is not None
    shapes = [torch.Size(s) for s in LAYERS]
    for size in (2, 3, 4, 5, 6):
        for members in (range(0, size), range(size, n)):
            inputs = [layers_for(r, seed=size) for r in members]
            expected = ref_tree(inputs, shapes)
            def flat_of(r, path):  # RVH, gather, chunked RVH, chunked RVH prepared before,
                split = results[r]["split"][size]   # shm, RVH with every peer remote, shm in
                return {1: split[1], 2: split[2], 3: split[3][0], 4: split[3][1], 5: split[5],
                        6: split[3][2], 7: split[3][3], 8: split[3][4]}[path]  # chunks (C, torch)

            p = adasum.largest_power_of_two(len(members))
            for r in members:
                # chunked over MPI with peers on this host, never with remote ones; a rank
                # folded into another (n not a power of two) runs no levels, so has no plans
                chunks = results[r]["split"][size][4]["chunks"]
                assert set(chunks) == ({False, True} if native and r - members[0] < p
                                       else set()), chunks
                for level, (near, far) in enumerate(zip(chunks.get(False, []),
                                                        chunks.get(True, []))):
                    assert far == 1, (r, level, chunks)
                    assert near > 1 if backend == "mpi" else near == 1, (r, level, chunks)
            for path in (1, 2, 3, 4, 5, 6, 7, 8):
                for r in members:
                    group_size, flat = results[r]["split"][size][0], flat_of(r, path)
                    assert group_size == len(members)
                    got = list(torch.split(flat, [s.numel() for s in shapes]))
                    err = rel_err(got, expected)
                    assert err < 1e-5, (backend, size, path, list(members), r, err)
                    # every rank holds the same bits, or replicas drift apart
                    assert torch.equal(flat, flat_of(members[0], path))
            extras = (("torch.float16", torch.float16), ("torch.bfloat16", torch.bfloat16),
                      ("generic", torch.float32), ("generic float16", torch.float16),
                      ("generic shm float16", torch.float16))
            for key, dtype in extras if size in EXTRA_SIZES else ():
                expected_d = ref_tree([layers_for(r, size, dtype) for r in members], shapes)
                first = results[members[0]]["split"][size][4][key]
                for r in members:
                    outs = results[r]["split"][size][4][key]
                    for i, flat in enumerate(outs if isinstance(outs, list) else [outs]):
                        assert flat.dtype == dtype
                        got = list(torch.split(flat, [s.numel() for s in shapes]))
                        err = rel_err(got, expected_d)
                        assert err < REL_TOL[dtype], (backend, size, key, i, r, err)
                        assert torch.equal(flat, first[i] if isinstance(first, list) else first)
            # Parallel inputs give their mean (Adasum's design), here at 3 and 5 ranks, where
            # the unweighted tree gave other weights (1/4, 1/2, 1/4 at 3 ranks).
            for dtype in (torch.float32, torch.float64) if size in PARALLEL_SIZES else ():
                mean = parallel_mean(members)
                for host in (True, False):
                    key = ("parallel", str(dtype), host)
                    for r in members:
                        paths = results[r]["split"][size][4][key]
                        assert len(paths) == 3
                        for path, flat in zip(("rvh", "gather", "shm"), paths):
                            assert flat.dtype == dtype
                            got = torch.split(flat, [s.numel() for s in shapes])
                            errs = [rel_err([g], [e]) for g, e in zip(got, mean) if e.numel()]
                            assert max(errs) < PARALLEL_TOL[dtype], (backend, size, key, path, r,
                                                                     max(errs))
    for dtype in DTYPES:
        expected = ref_tree([layers_for(r, 50, dtype) for r in range(n)], shapes)
        for r in range(n):
            fused, alone = results[r][str(dtype)]
            assert all(t.dtype == dtype and t.shape == s for t, s in zip(fused, shapes))
            assert rel_err(fused, expected) < REL_TOL[dtype], (dtype, r, rel_err(fused, expected))
            assert rel_err(alone, expected) < REL_TOL[dtype], (dtype, r)
            # fused and unfused agree (to rounding: the pieces fall differently)
            assert rel_err(fused, alone) < REL_TOL[dtype] * 2, (dtype, r)
    for dtype in ("torch.float16", "torch.bfloat16", "torch.bool"):
        inputs = [results[r]["moves"][dtype][0] for r in range(n)]
        bits = (lambda t: t.view(torch.int16)) if dtype != "torch.bool" else (lambda t: t)
        for r in range(n):
            _, gathered, cast, got = results[r]["moves"][dtype]
            assert torch.equal(bits(gathered), bits(torch.stack(inputs))), (backend, dtype, r)
            assert torch.equal(bits(cast), bits(inputs[3])), (backend, dtype, r)
            assert torch.equal(bits(got), bits(inputs[(r - 1) % n])), (backend, dtype, r)
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


def test_c_kernels_match_torch_code():
    """The C kernels (float32/float64 on the CPU) and the torch code agree, on many layers with
    small ones grouped and big ones chunked, zero layers included; CI builds the kernels."""
    from horovod_ext.algorithms.adasum import operator
    from horovod_ext.algorithms.adasum.operator import LayerMap, adasum_pair_, partial_dots
    assert operator._LIB is not None, "adasum C kernels not built (no C compiler at install?)"
    sizes = [3, 5000, 1, 0, 70000, 2, 300, 131073]
    bounds, off = [], 0
    for n in sizes:
        bounds.append((off, n))
        off += n
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64):
        a = torch.randn(off, generator=g).to(dtype)
        b = torch.randn(off, generator=g).to(dtype)
        b[3:5003] = 0  # a zero layer on one side passes the other through
        layers = LayerMap(bounds)
        piece = layers.piece(100, off - 7)  # a piece cutting the first and last layers
        native_dots = partial_dots(a[100:off - 7], b[100:off - 7], piece)
        native = adasum_pair_(a.clone(), b, layers)
        kernels, operator._KERNELS = operator._KERNELS, {}
        try:
            torch_dots = partial_dots(a[100:off - 7], b[100:off - 7], piece)
            torch_out = adasum_pair_(a.clone(), b, LayerMap(bounds))
        finally:
            operator._KERNELS = kernels
        # float32 products are summed in float32 over short blocks by the kernel (1e-9 here):
        # errors are measured against max(|a|^2, |b|^2) per layer, which bounds every entry.
        scale = torch_dots[:, 1:].amax(dim=1).clamp_min(1.0).unsqueeze(1)
        dots_tol = 1e-7 if dtype == torch.float32 else 1e-12
        assert ((native_dots - torch_dots).abs() / scale).max() < dots_tol, dtype
        tol = 1e-6 if dtype == torch.float32 else 1e-13
        assert rel_err([native], [torch_out]) < tol, dtype
        assert torch.equal(native[3:5003], a[3:5003])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("k", [2, 3, 5])
def test_kernels_by_address_give_the_bits_of_the_tensor_calls(k):
    """HostTree (the in-node path's kernels on addresses, made once per layout) gives the bits
    of gram() and mix_() on the same vectors, for two vectors (the pair's dot products,
    reordered) and more (the Gram kernel), copy or not, on a piece that cuts layers."""
    import numpy as np
    from horovod_ext.algorithms.adasum.gram import HostTree, gram, mix_, tree_weights
    from horovod_ext.algorithms.adasum.operator import LayerMap
    sizes = [3, 5000, 1, 0, 70000, 2, 300, 4099]
    bounds, off = [], 0
    for n in sizes:
        bounds.append((off, n))
        off += n
    layers = LayerMap(bounds)
    lo, hi = 100, off - 7
    piece = layers.piece(lo, hi)
    g = torch.Generator().manual_seed(k)
    for dtype in (torch.float32, torch.float64):
        vectors = [torch.randn(off, generator=g).to(dtype) for _ in range(k)]
        shards = [v[lo:hi] for v in vectors]
        host = HostTree.for_tensor(vectors[0], k, layers.count)
        assert host is not None, "adasum C kernels not built (no C compiler at install?)"
        for j, v in enumerate(vectors):
            host.vectors[j] = v.data_ptr() + lo * v.element_size()
        expected = gram(shards, piece)
        # two shards' tables summed, then packed, as the in-node path does
        first = host.gram(piece).copy()   # gram() refills one table every call
        got = host.packed(first + host.gram(piece))
        assert np.array_equal(got, expected + expected), (k, dtype)
        weights = tree_weights(expected, k)
        out, copy = torch.empty(off, dtype=dtype), torch.empty(off, dtype=dtype)
        want_out, want_copy = torch.zeros(hi - lo, dtype=dtype), torch.zeros(hi - lo, dtype=dtype)
        mix_(want_out, shards, weights, piece, want_copy)
        host.mix(out.data_ptr() + lo * out.element_size(),
                 copy.data_ptr() + lo * copy.element_size(), piece, weights)
        assert torch.equal(out[lo:hi], want_out) and torch.equal(copy[lo:hi], want_copy)
        mix_(want_out, shards, weights, piece)   # in place over the first vector, no copy
        host.mix(host.vectors[0], None, piece, weights)
        assert torch.equal(vectors[0][lo:hi], want_out), (k, dtype)


@pytest.mark.timeout(60)
def test_device_generic_code_matches_cpu_code(monkeypatch):
    """The torch code that CUDA tensors run (HOST_CODE off: no C kernels, numpy reduceat or C
    weights), on CPU tensors, against the CPU code and against the formula, with layers grouped
    into runs (segment sums), chunked big layers and a piece cutting the first and last layers.

    Tolerances: per-layer [a.b, a.a, b.b] within 1e-12 of max(|a|^2, |b|^2) (1e-7 for float32,
    whose C kernel sums float32 products in short float32 blocks); the coefficients bitwise (the
    same formula in float64); results bitwise for 16-bit inputs (both paths run the same torch
    combine and their float64 dots differ by summation order only, far below a 16-bit rounding),
    else within 1e-6 (float32: the C combine rounds differently) and 1e-13 (float64)."""
    from horovod_ext.algorithms.adasum import operator
    from horovod_ext.algorithms.adasum.operator import (LayerMap, Run, adasum_pair_, coefficients,
                                                        partial_dots)
    sizes = [3, 5000, 1, 0, 70000, 2, 300, 131073, 17, 4095, 4096, 9, 1, 1]
    bounds, off = [], 0
    for n in sizes:
        bounds.append((off, n))
        off += n
    shapes = [torch.Size([n]) for n in sizes]
    lo, hi = 1, off - 1
    g = torch.Generator().manual_seed(11)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        a = torch.randn(off, generator=g).to(dtype)
        b = torch.randn(off, generator=g).to(dtype)
        b[3:5003] = 0  # a zero layer on one side passes the other through
        piece = LayerMap(bounds).piece(lo, hi)
        assert any(isinstance(item, Run) and len(item.lengths) > 1 for item in piece.items)

        def run_both():
            dots = partial_dots(a[lo:hi], b[lo:hi], piece)
            return dots, coefficients(dots), adasum_pair_(a.clone(), b, LayerMap(bounds))

        host_dots, host_coeffs, host = run_both()
        monkeypatch.setattr(operator, "HOST_CODE", False)
        generic_dots, generic_coeffs, generic = run_both()
        assert torch.equal(run_both()[2], generic), dtype  # deterministic: ranks agree
        generic_of_host_dots = coefficients(host_dots)
        monkeypatch.setattr(operator, "HOST_CODE", True)

        scale = host_dots[:, 1:].amax(dim=1).clamp_min(1e-300).unsqueeze(1)
        dots_tol = 1e-7 if dtype == torch.float32 else 1e-12
        assert ((generic_dots - host_dots).abs() / scale).max() < dots_tol, dtype
        assert (host_dots[:, 1:] > 0).sum() > 8  # the comparison covers real layers
        assert torch.equal(generic_of_host_dots, coefficients(host_dots)), dtype
        if dtype in (torch.float16, torch.bfloat16):
            assert torch.equal(generic, host), dtype
        else:
            tol = 1e-6 if dtype == torch.float32 else 1e-13
            assert rel_err([generic], [host]) < tol, (dtype, rel_err([generic], [host]))
        expected = ref_pair(list(torch.split(a, sizes)), list(torch.split(b, sizes)), shapes)
        assert rel_err([generic], expected) < REL_TOL[dtype], dtype
        assert torch.equal(generic[3:5003], a[3:5003])


@pytest.mark.timeout(30)
def test_mpi_handover_stages_and_types():
    """What MPI is given, per device, dtype, CUDA-awareness and reduction: never a 16-bit float
    (bfloat16 has no MPI type, float16's is optional and a CUDA-aware Open MPI refused it on
    GPU buffers), nor bool; staged only for GPU buffers that MPI cannot read.  And the CPU
    views MPI moves: the same memory, the same bytes."""
    from horovod_ext.backends.mpi import MPICommunicator, handover
    standard = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float32,
                torch.float64}
    dtypes = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32,
              torch.int64, torch.uint8, torch.int8, torch.bool]
    for device in ("cpu", "cuda"):
        for dtype in dtypes:
            for aware in (False, True):
                moved = handover(device, dtype, aware, reduce=False)
                assert moved.staged == (device == "cuda" and not aware), (device, dtype, aware)
                assert moved.dtype in standard, (device, dtype, aware)
                size = torch.empty(0, dtype=dtype).element_size()
                assert torch.empty(0, dtype=moved.dtype).element_size() == size  # a view
                if dtype == torch.bool:
                    continue  # reduced as uint8 by Communicator.allreduce before it gets here
                reduced = handover(device, dtype, aware, reduce=True)
                assert reduced.staged == moved.staged
                widened = dtype in (torch.float16, torch.bfloat16)
                assert reduced.dtype == (torch.float32 if widened else dtype), (device, dtype)
    assert handover("mps", torch.float32, True, False).staged  # only CUDA is read in place
    for dtype in dtypes:
        t = torch.arange(6).to(dtype)
        array = MPICommunicator._array(t)
        assert array.dtype.itemsize == t.element_size()
        assert array.ctypes.data == t.data_ptr()  # no copy
        assert torch.equal(torch.from_numpy(array).view(dtype), t)


def test_float32_dots_hold_float64_precision_at_extreme_magnitudes():
    """Values whose float32 squares overflow (1e25) or underflow (1e-25): the dot products are
    float64's, so identical inputs still give the input and orthogonal ones their sum."""
    from horovod_ext.algorithms.adasum.operator import LayerMap, adasum_pair_, partial_dots
    g = torch.Generator().manual_seed(5)
    n = 4096
    layers = LayerMap([(0, n), (n, n)])
    for scale in (1e25, 1e-25, 1.0):
        a = (torch.randn(2 * n, generator=g, dtype=torch.float64) * scale).float()
        b = (torch.randn(2 * n, generator=g, dtype=torch.float64) * scale).float()
        dots = partial_dots(a, b, layers.piece(0, 2 * n))
        a64, b64 = a.double().view(2, n), b.double().view(2, n)
        expected = torch.stack([(a64 * b64).sum(1), (a64 * a64).sum(1), (b64 * b64).sum(1)], 1)
        assert torch.isfinite(dots).all() and (expected[:, 1:] > 0).all(), scale
        # At ordinary magnitudes the kernel's float32 blocks are within ~1e-9 (see above).
        tol = 1e-7 if scale == 1.0 else 1e-12
        assert ((dots - expected).abs() / expected[:, 1:].amax(1, keepdim=True)).max() < tol
        same = adasum_pair_(a.clone(), a.clone(), layers)
        assert rel_err([same], [a]) < 1e-6, scale   # Adasum(a, a) = a
        ortho_a, ortho_b = a.clone(), b.clone()
        ortho_a[1::2] = 0
        ortho_b[0::2] = 0
        ortho = adasum_pair_(ortho_a.clone(), ortho_b, layers)
        assert rel_err([ortho], [ortho_a + ortho_b]) < 1e-6, scale


# --- the weighted tree: unchanged bits at powers of two, the mean of parallel inputs -----------
class _LocalComm:
    """Every rank's vector in one process, seen from rank 0: what gather_adasum_ asks of a
    communicator (the allgather, and at two ranks the exchange)."""

    def __init__(self, rows):
        self.rows, self.size, self.rank = rows, len(rows), 0

    def allgather(self, t):
        return torch.stack(self.rows)

    def sendrecv(self, send, dst, recv, src):
        recv.copy_(self.rows[src])


def _gather_locally(rows):
    """gather_adasum_ (the tree every rank runs on the small-message path) over ``rows``."""
    from horovod_ext.algorithms.adasum.gather import gather_adasum_
    from horovod_ext.algorithms.adasum.operator import LayerMap
    bounds, off = [], 0
    for s in LAYERS:
        bounds.append((off, torch.Size(s).numel()))
        off += bounds[-1][1]
    return gather_adasum_(rows[0].clone(), LayerMap(bounds), _LocalComm(rows),
                          tuple(range(len(rows))))


# sha256 (first 16 hex digits) of _gather_locally's output on exact_vector inputs (rank r: seed r),
# taken from the unweighted code before the tree was weighted.  Its C-kernel path gives the same
# bits on every x86 build (_kernels.c), so at powers of two these must come out unchanged.
UNWEIGHTED_DIGESTS = {
    (2, torch.float32): "57c9553750159fa6", (2, torch.float64): "dbc7ca820ab88945",
    (4, torch.float32): "334044ad242384f4", (4, torch.float64): "e801dbc83b2f6db2",
    (8, torch.float32): "e00a73c6adc94caf", (8, torch.float64): "3a24b88e62fd6f60"}


@pytest.mark.timeout(60)
def test_weighted_tree(monkeypatch):
    """The weights of the tree's pairs, and what they do, in one process.

    At 2, 4, 8 and 16 ranks every pair's divisors are exactly (2.0, 2.0), and with them the
    coefficients (C and torch code) are bitwise the unweighted 1 - a.b/(2|a|^2); the gather
    tree's output equals digests pinned from the unweighted code.  At 3 to 7 ranks the gather
    tree gives the weighted reference (REL_TOL) and the mean of parallel inputs (PARALLEL_TOL
    per layer)."""
    from horovod_ext.algorithms.adasum import operator
    from horovod_ext.algorithms.adasum.gather import tree_divisors
    from horovod_ext.algorithms.adasum.operator import coefficients
    for n in (2, 4, 8, 16):
        d = 1
        while d < n:
            for lo in range(0, n, 2 * d):
                assert tree_divisors(n, lo, d) == (2.0, 2.0), (n, lo, d)
            d *= 2
    # sides of 2 and 1 ranks (3 and 6 ranks), 3 and 2 (5 ranks), equal sides next to them
    assert tree_divisors(3, 0, 1) == (1.5, 3.0) and tree_divisors(6, 0, 2) == (1.5, 3.0)
    assert tree_divisors(5, 0, 1) == (1.5, 3.0) and tree_divisors(5, 2, 1) == (2.0, 2.0)
    assert tree_divisors(5, 0, 2) == (5 / 3, 2.5) and tree_divisors(6, 0, 1) == (2.0, 2.0)

    # [a.b, a.a, b.b] rows: signs, a zero side, magnitudes whose 2|a|^2 overflows
    dots = torch.tensor([[1.5, 2.0, 3.0], [-7.25, 0.3, 11.0], [0.0, 5.0, 0.0], [1e-3, 1e-300, 4.0],
                         [3e307, 1e308, 9e307], [-2.0, 1e300, 1e-5], [0.1, 0.2, 0.7]],
                        dtype=torch.float64)

    def plain(ab, side):
        return 1 - ab / (2 * side) if side > 0 else 1.0
    unweighted = torch.tensor([[plain(ab, aa), plain(ab, bb)] for ab, aa, bb in dots.tolist()],
                              dtype=torch.float64)
    for host in (True, False):
        monkeypatch.setattr(operator, "HOST_CODE", host)
        assert torch.equal(coefficients(dots), unweighted), host
        assert torch.equal(coefficients(dots, (2.0, 2.0)), unweighted), host
        # unequal sides: 1 - w a.b/|side|^2, here w = 2/3 and 1/3 (rows of ordinary magnitude:
        # d |side|^2 overflows near 1e308, as 2 |side|^2 always did)
        ordinary = dots[dots[:, 1:].amax(1) < 1e305]
        weighted = torch.tensor([[1 - 2 / 3 * ab / aa if aa > 0 else 1.0,
                                  1 - 1 / 3 * ab / bb if bb > 0 else 1.0]
                                 for ab, aa, bb in ordinary.tolist()], dtype=torch.float64)
        assert torch.allclose(coefficients(ordinary, (1.5, 3.0)), weighted, rtol=1e-15, atol=0)
    monkeypatch.setattr(operator, "HOST_CODE", True)

    total = sum(torch.Size(s).numel() for s in LAYERS)
    shapes = [torch.Size(s) for s in LAYERS]
    for dtype in (torch.float32, torch.float64):
        for n in (2, 4, 8):
            out = _gather_locally([exact_vector(total, seed=r).to(dtype) for r in range(n)])
            if operator._LIB is not None:  # the digests are the C kernels' bits
                digest = hashlib.sha256(out.numpy().tobytes()).hexdigest()[:16]
                assert digest == UNWEIGHTED_DIGESTS[(n, dtype)], (n, dtype)
        for n in range(3, 8):
            inputs = [layers_for(r, seed=80 + n, dtype=dtype) for r in range(n)]
            out = _gather_locally([torch.cat([t.reshape(-1) for t in x]) for x in inputs])
            err = rel_err(torch.split(out, [s.numel() for s in shapes]), ref_tree(inputs, shapes))
            assert err < REL_TOL[dtype], (n, dtype, err)
            rows = [torch.cat([t.reshape(-1) for t in parallel_layers(r, dtype)]) for r in range(n)]
            got = torch.split(_gather_locally(rows), [s.numel() for s in shapes])
            errs = [rel_err([g], [e]) for g, e in zip(got, parallel_mean(range(n))) if e.numel()]
            assert max(errs) < PARALLEL_TOL[dtype], (n, dtype, max(errs))


# --- hierarchical: average inside each node, Adasum across nodes in node order ----------------
def _hierarchical():
    import horovod_ext.torch as hvd
    from tests.test_adasum import layers_for
    r = hvd.rank()
    fused = hvd.grouped_allreduce(layers_for(r, seed=70), op=hvd.Adasum, name="h.fused")
    single = hvd.allreduce(torch.arange(11.0) * (r + 1) - r * 3, op=hvd.Adasum, name="h.one")
    # one element: the node's second rank has an empty part and must still join the node's
    # sums of dot products
    tiny = hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Adasum, name="h.tiny")
    return fused, single, tiny, hvd.local_rank(), hvd.cross_rank()


# Node numbers follow the lowest rank of each host; "b a b c a c" puts the cross communicators'
# ranks out of node order, so a tree taken in communicator order would give another result.
HIER_CASES = {"2x2": ["a", "a", "b", "b"], "3x2 interleaved": ["a", "b", "b", "c", "a", "c"]}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend,case", [("gloo", "2x2"), ("mpi", "2x2"),
                                          ("gloo", "3x2 interleaved")])
def test_hierarchical_adasum(backend, case):
    hosts = HIER_CASES[case]
    results = run_ranks(_hierarchical, len(hosts), backend, hostnames=hosts,
                        env={"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}, timeout=150)
    nodes = list(dict.fromkeys(hosts))               # node order: by lowest rank
    members = [[r for r, h in enumerate(hosts) if h == node] for node in nodes]
    shapes = [torch.Size(s) for s in LAYERS]

    def node_average(per_rank):
        return [[sum(per_rank[r][i].double() for r in m) / len(m) for i in range(len(per_rank[0]))]
                for m in members]

    expected = ref_tree(node_average([layers_for(r, 70) for r in range(len(hosts))]), shapes)
    singles = [[torch.arange(11.0) * (r + 1) - r * 3] for r in range(len(hosts))]
    expected_single = ref_tree(node_average(singles), [torch.Size([11])])
    tinies = [[torch.tensor([r + 1.0])] for r in range(len(hosts))]
    expected_tiny = ref_tree(node_average(tinies), [torch.Size([1])])
    for r, (fused, single, tiny, _, _) in enumerate(results):
        assert rel_err(fused, expected) < 1e-5, (r, rel_err(fused, expected))
        assert rel_err([single], expected_single) < 1e-5, r
        assert rel_err([tiny], expected_tiny) < 1e-6, (r, tiny, expected_tiny)
    # a flat tree over all ranks is a different result: the check above can tell them apart
    flat = ref_tree([layers_for(r, 70) for r in range(len(hosts))], shapes)
    assert rel_err(flat, expected) > 1e-3


# --- flat over hosts in blocks: each host's subtree in its segment, the rest across hosts -----
def _flat_over_hosts(threshold: int):
    """Flat Adasum of a fused group, of one tensor and of one element, with the world
    communicator's threshold for whole-vector steps in shared memory at ``threshold``: (the
    results, how many calls took the split at the hosts, how many pairs swapped whole
    vectors)."""
    import horovod_ext.torch as hvd
    from horovod_ext.algorithms.adasum import gather
    from horovod_ext.engine import runtime
    from horovod_ext.ops import adasum as adasum_op
    from tests.test_adasum import layers_for
    runtime.state.comms.world.whole_vector_steps_in_shared_memory_from_bytes = threshold
    counts = {"split": 0, "swap": 0}

    def counting(module, name, key):
        original = getattr(module, name)

        def counted(*args):
            counts[key] += 1
            return original(*args)

        setattr(module, name, counted)

    counting(adasum_op, "_by_host", "split")
    counting(gather, "_pair_", "swap")
    r = hvd.rank()
    fused = hvd.grouped_allreduce(layers_for(r, seed=90), op=hvd.Adasum, name="f.fused")
    single = hvd.allreduce(torch.arange(3001.0) * (r + 1) - r * 3, op=hvd.Adasum, name="f.one")
    # one element: the second rank of a host has an empty shard and still joins its host's sums
    tiny = hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Adasum, name="f.tiny")
    return fused, single, tiny, counts["split"], counts["swap"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend,hosts,env,split,swap", [
    ("gloo", "a a b b", {}, 3, 3), ("mpi", "a a b b", {}, 3, 3),
    ("gloo", "a a b b", {"HOROVOD_NATIVE_KERNELS": "0"}, 3, 3),     # the torch code
    ("gloo", "a b", {}, 0, 3),             # one rank a host: the pair swaps whole vectors
    ("gloo", "a a b b", {"HOROVOD_SHARED_MEMORY": "0"}, 0, 0),   # no segment: RVH over all
    ("gloo", "a b a b", {}, 0, 0),         # a host's ranks are not consecutive
    ("gloo", "a a b", {}, 0, 0)])          # unequal hosts, and 3 ranks fold across them
def test_flat_adasum_over_hosts_in_blocks(backend, hosts, env, split, swap):
    """Flat Adasum where hosts hold blocks of consecutive ranks, a power of two each, is the
    tree over all ranks in rank order, split at the hosts: each host's subtree through its
    segment, the tree over the hosts across them on shards, where two hosts swap their
    shards whole, as two ranks on two hosts swap their vectors.  Every result is the flat
    tree's (1e-5), and only such layouts take the split and the swap (every call of them, at
    a threshold of 0: with the transport's own, MPI's 4 MiB, the small calls would not)."""
    names = hosts.split()
    results = run_ranks(_flat_over_hosts, len(names), backend, hostnames=names, args=(0,),
                        env=env, timeout=150)
    n, shapes = len(names), [torch.Size(s) for s in LAYERS]
    expected = ref_tree([layers_for(r, 90) for r in range(n)], shapes)
    expected_single = ref_tree([[torch.arange(3001.0) * (r + 1) - r * 3] for r in range(n)],
                               [torch.Size([3001])])
    expected_tiny = ref_tree([[torch.tensor([r + 1.0])] for r in range(n)], [torch.Size([1])])
    for r, (fused, single, tiny, took_split, took_swap) in enumerate(results):
        assert rel_err(fused, expected) < 1e-5, (r, rel_err(fused, expected))
        assert rel_err([single], expected_single) < 1e-5, (r, rel_err([single], expected_single))
        assert rel_err([tiny], expected_tiny) < 1e-6, (r, tiny, expected_tiny)
        assert (took_split, took_swap) == (split, swap), r
    # every rank ends with the same bits
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got[0], results[0][0]))
        assert torch.equal(got[1], results[0][1])


# --- DistributedOptimizer: gradients (SGD) or parameter changes (Adam) combined ---------------
def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 + 10 * rank + step)
    return torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g)


def _loss(model, rank, step):
    x, y = _batch(rank, step)
    return ((model(x) - y) ** 2).mean()


def _optimizer_modes():
    import horovod_ext.torch as hvd
    from tests.test_adasum import _loss, _model
    r = hvd.rank()
    out = {}
    # SGD: gradients combined; clipping between synchronize() and step()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    for step in range(2):
        opt.zero_grad()
        _loss(model, r, step).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        with opt.skip_synchronize():
            opt.step()
    out["sgd"] = [p.detach().clone() for p in model.parameters()]
    # Adam: local steps, the parameter change combined (delta mode); k local steps per Adasum
    for k in (1, 2):
        model = _model()
        opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(),
                                       op=hvd.Adasum, backward_passes_per_step=k)
        for step in range(2 * k):
            opt.zero_grad()
            _loss(model, r, step).backward()
            opt.step()
        out[f"adam{k}"] = [p.detach().clone() for p in model.parameters()]
    # one rank's non-finite gradient reaches every rank at synchronize(), so GradScaler skips
    # the step everywhere alike instead of leaving the others waiting in the reduction
    opt.zero_grad()
    _loss(model, r, 0).backward()
    if r == 1:
        next(model.parameters()).grad[0, 0] = float("nan")
    opt.synchronize()
    out["finite_after_sync"] = all(torch.isfinite(p.grad).all() for p in model.parameters())
    return out


def _adasum_params(per_rank_deltas, starts):
    shapes = [s.shape for s in starts]
    combined = ref_tree(per_rank_deltas, shapes)
    return [s.double() + c for s, c in zip(starts, combined)]


@pytest.mark.timeout(200)
def test_distributed_optimizer_adasum():
    n = 3  # not a power of two: rank 2 is folded into rank 0
    results = run_ranks(_optimizer_modes, n, "gloo", timeout=150)
    # SGD: p -= lr * clip(Adasum(grads)), simulated in this process
    model = _model()
    for step in range(2):
        grads = []
        for r in range(n):
            model.zero_grad()
            _loss(model, r, step).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        combined = ref_tree(grads, [p.shape for p in model.parameters()])
        norm = torch.cat([c.reshape(-1) for c in combined]).norm()
        scale = min(1.0, 0.5 / (float(norm) + 1e-6))
        with torch.no_grad():
            for p, c in zip(model.parameters(), combined):
                p -= 0.1 * (c * scale).to(p.dtype)
    for r in range(n):
        assert rel_err(results[r]["sgd"], list(model.parameters())) < 1e-5, r
    # Adam in delta mode: each rank's own Adam (its state stays local), k steps, then Adasum
    for k in (1, 2):
        models = [_model() for _ in range(n)]
        opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in models]
        for step in range(2 * k):
            if step % k == 0:
                starts = [p.detach().clone() for p in models[0].parameters()]
            for r in range(n):
                opts[r].zero_grad()
                _loss(models[r], r, step).backward()
                opts[r].step()
            if step % k == k - 1:
                deltas = [[p.detach() - s for p, s in zip(models[r].parameters(), starts)]
                          for r in range(n)]
                new = _adasum_params(deltas, starts)
                with torch.no_grad():
                    for m in models:
                        for p, v in zip(m.parameters(), new):
                            p.copy_(v)
        for r in range(n):
            assert rel_err(results[r][f"adam{k}"], list(models[0].parameters())) < 1e-5, (k, r)
    assert [results[r]["finite_after_sync"] for r in range(n)] == [False] * n
