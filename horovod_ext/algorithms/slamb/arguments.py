"""Checks of SLAMB's constructor arguments, with the paper's ranges in the messages."""
from typing import Optional, Tuple

from horovod_ext.algorithms.lamb import check_lamb_args

SCALINGS = ("algorithm", "simplified")


def check_slamb_args(lr: float, betas: Tuple[float, float], beta3: float, eps: float,
                     weight_decay: float, ratio: float, sync_interval: int, min_coeff: float,
                     max_coeff: float, scaling: str, total_steps: Optional[int],
                     backward_passes_per_step: int, bucket_bytes: int) -> None:
    """Raise ValueError naming the first argument of ``SLAMB`` out of its range."""
    check_lamb_args(lr, betas, eps, weight_decay, min_coeff, max_coeff)
    if not 0.0 <= beta3 <= 1.0:
        raise ValueError(f"invalid beta3 {beta3!r}: must be in [0, 1] (paper: 0.93-0.95)")
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"invalid ratio {ratio!r}: the fraction k of elements synchronised "
                         f"per step must be in (0, 1]")
    if int(sync_interval) != sync_interval or sync_interval < 1:
        raise ValueError(f"invalid sync_interval {sync_interval!r}: a number of steps >= 1")
    if scaling not in SCALINGS:
        raise ValueError(f"invalid scaling {scaling!r}: one of {SCALINGS}")
    if total_steps is not None and total_steps < 1:
        raise ValueError(f"invalid total_steps {total_steps!r}")
    if int(backward_passes_per_step) != backward_passes_per_step or backward_passes_per_step < 1:
        raise ValueError(f"invalid backward_passes_per_step {backward_passes_per_step!r}: "
                         f"a number of backward passes >= 1")
    if bucket_bytes < 0:
        raise ValueError(f"invalid bucket_bytes {bucket_bytes!r}: >= 0 (0: one tensor each)")
