"""Measurements behind a profile: the per-byte cost of each op's local work on one core, the
rate of PowerSGD's skinny matrix products, and the control plane's cost per peer.

Each figure is the median of repeated timed blocks on buffers larger than the caches (what a
gradient buffer is).  ``fit_op_work`` turns an op's unexplained time on loopback into the
profile's ``per_op`` entry.  ``benchmarks/calibrate.py`` adds what needs several processes
(loopback, shared memory, the engine's call cost) and the network lab's links, and writes the
profile.
"""
import itertools
import socket
import statistics
import time
from typing import Callable, Dict, Sequence

import torch

MiB = 1 << 20


def seconds_per_call(fn: Callable[[], object], repeats: int = 7,
                     min_block_s: float = 0.05) -> float:
    """Median over ``repeats`` blocks of the time of one call of ``fn`` (a block runs it as
    often as it takes to last ``min_block_s``)."""
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_block_s:
        fn()
        calls += 1
    per_block = max(1, calls)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(per_block):
            fn()
        times.append((time.perf_counter() - start) / per_block)
    return statistics.median(times)


def local_costs(nbytes: int = 32 * MiB, layers: int = 64) -> Dict[str, float]:
    """Seconds per byte (of the float32 input) of each op's local work, one thread."""
    from horovod_ext.algorithms.adasum.operator import LayerMap, combine_, coefficients, partial_dots
    from horovod_ext.algorithms.onebit.compression import compress, decompress
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = nbytes // 4
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
        out = {"reduce": seconds_per_call(lambda: a.add_(b)) / nbytes,
               "copy": seconds_per_call(lambda: a.copy_(b)) / nbytes}

        size = n // layers
        layer_map = LayerMap([(i * size, size) for i in range(layers)])
        piece = layer_map.piece(0, size * layers)
        x, y = a[:size * layers], b[:size * layers]

        def adasum_combine():
            dots = partial_dots(x, y, piece)
            combine_(x, y, True, coefficients(dots), piece)
        out["adasum"] = seconds_per_call(adasum_combine) / (4 * size * layers)

        lengths = [size] * layers
        packed, scales = compress(x, lengths)
        out["onebit_compress"] = seconds_per_call(lambda: compress(x, lengths, packed)) / \
            (4 * size * layers)
        target = torch.empty_like(x)
        out["onebit_decompress"] = seconds_per_call(
            lambda: decompress(packed, scales, lengths, torch.float32, target)) \
            / (4 * size * layers)

        k = n // 10
        index = torch.randperm(n, generator=g)[:k].sort().values
        picked = torch.empty(k)
        out["randomk_gather"] = seconds_per_call(
            lambda: torch.index_select(a, 0, index, out=picked)) / (4 * k)
        out["randomk_scatter"] = seconds_per_call(lambda: a.index_copy_(0, index, picked)) / (4 * k)
        out.update(optimizer_costs(a))
        return out
    finally:
        torch.set_num_threads(threads)


def optimizer_costs(buffer: torch.Tensor) -> Dict[str, float]:
    """Seconds per byte of parameters of an Adam step (torch) and a LAMB step (the fused
    kernels hvd.Lamb, 1-bit LAMB and SLAMB share; SLAMB's random-k work is counted apart)."""
    from horovod_ext.algorithms.lamb import Lamb
    nbytes = buffer.numel() * 4
    param = torch.nn.Parameter(buffer.clone())
    param.grad = torch.randn_like(param) * 1e-3
    adam = torch.optim.Adam([param], lr=1e-4)
    lamb = Lamb([param], lr=1e-4)
    return {"optimizer_adam": seconds_per_call(adam.step, repeats=5) / nbytes,
            "optimizer_lamb": seconds_per_call(lamb.step, repeats=5) / nbytes}


def matmul_flops_per_s(hidden: int = 1024, rank: int = 4) -> float:
    """Floating-point operations per second of PowerSGD's products (hidden^2 by hidden x rank),
    one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m, q = torch.randn(hidden, hidden), torch.randn(hidden, rank)
        return 2 * hidden * hidden * rank / seconds_per_call(lambda: m @ q)
    finally:
        torch.set_num_threads(threads)


def control_round_per_peer(frame: int = 64) -> float:
    """Seconds rank 0 spends per peer in a negotiation round: one small frame in, one out, over
    a TCP-like local socket pair."""
    left, right = socket.socketpair()
    payload = b"x" * frame
    try:
        def round_trip():
            left.sendall(payload)
            right.recv(frame)
            right.sendall(payload)
            left.recv(frame)
        return seconds_per_call(round_trip) / 2
    finally:
        left.close()
        right.close()


def fit_op_work(points: Sequence[Sequence[float]]) -> Dict[str, float]:
    """Least-squares fit, with no coefficient below zero, of ``seconds = call + per_byte *
    bytes + per_tensor * tensors`` to ``points`` of (bytes, tensors, seconds).

    Seconds are what an op took beyond the model's prediction; noise can make a term come out
    negative, which would predict less than nothing on other sizes, so each subset of the terms
    is fitted and the best one with no negative coefficient is kept."""
    import numpy as np
    x = np.array([[1.0, b, t] for b, t, _ in points])
    y = np.array([s for _, _, s in points])
    best, best_error = np.zeros(3), float(np.sum(y ** 2))
    for used in itertools.chain.from_iterable(itertools.combinations(range(3), k)
                                              for k in (1, 2, 3)):
        coef, *_ = np.linalg.lstsq(x[:, used], y, rcond=None)
        if (coef < 0).any():
            continue
        full = np.zeros(3)
        full[list(used)] = coef
        error = float(np.sum((x @ full - y) ** 2))
        if error < best_error:
            best, best_error = full, error
    return {"call": float(best[0]), "per_byte": float(best[1]), "per_tensor": float(best[2])}
