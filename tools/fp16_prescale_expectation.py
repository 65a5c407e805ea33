"""Why Horovod's float16 prescale tests cannot pass at 3 or 5 ranks, for any implementation.

Horovod's test_horovod_allreduce_prescale (and the reducescatter forms) compare the float16
result of summing ``size`` copies of ``fp16(factor * t)`` with ``size * fp16(factor * t)``
computed in float32, with tolerance 0 up to 3 ranks and 1e-4 up to 9.  A float16 result can only
hold float16 values: where ``size * x`` is not one, no sum can equal it.  This script rebuilds
the tests' data (same seeds, same generator calls) and counts those elements, and the error
of the best possible float16 result (``size * x`` rounded once) against each test's check.

    .venv/bin/python tools/fp16_prescale_expectation.py
"""
import itertools

import numpy as np
import torch


def allreduce_case(size, dim):
    torch.manual_seed(1234)
    np.random.seed(1234)
    factor = np.random.uniform()
    return factor, torch.FloatTensor(*([17] * dim)).random_(-100, 100)


def reducescatter_case(size, dim, state):
    torch.manual_seed(1234)
    factor = state.uniform()
    return factor, torch.FloatTensor(*([size * 4] * dim)).random_(-100, 100)


def check(size, dims=(1, 2, 3)):
    """Rows: (test, dim, elements, not representable, best max |error|, best max signed error,
    passes with the best float16 result)."""
    rows = []
    threshold = 0.0 if size <= 3 else 1e-4
    state = np.random.RandomState(12345)  # reducescatter seeds once, before its dtype loop
    # its loop runs int, long, float, double before half: draw their factors first
    for _ in range(4 * len(dims)):
        state.uniform()
    for test, dim in itertools.product(("allreduce_prescale", "reducescatter_prescale"), dims):
        if test == "allreduce_prescale":
            factor, t = allreduce_case(size, dim)
        else:
            factor, t = reducescatter_case(size, dim, state)
        x = (torch.tensor(factor, dtype=torch.float32) * t).half().float()
        expected = x * size                           # the test's float32 expectation
        best = expected.half().float()                # rounded once: the closest float16
        diff = best - expected
        if test == "allreduce_prescale":
            passes = torch.allclose(best, expected, threshold)
        else:
            passes = bool(diff.max() <= threshold)
        rows.append((test, dim, expected.numel(), int((best != expected).sum()),
                     float(diff.abs().max()), float(diff.max()), passes))
    return rows


def main():
    print(f"{'np':>3} {'test':<24} {'dim':>3} {'elements':>8} {'not fp16':>8} "
          f"{'max |err|':>10} {'max err':>10} {'passes':>6}")
    for size in (2, 3, 4, 5):
        for row in check(size):
            test, dim, n, bad, abs_err, signed, passes = row
            print(f"{size:>3} {test:<24} {dim:>3} {n:>8} {bad:>8} {abs_err:>10.3g} "
                  f"{signed:>10.3g} {str(passes):>6}")


if __name__ == "__main__":
    main()
