"""LAMB (You et al., 2020) as written in the 1-bit LAMB paper, equation (2): the math shared by
``onebit/`` (1-bit LAMB) and ``slamb/`` (SLAMB), and the plain ``Lamb`` torch optimizer that both
are compared with.

Per tensor (each weight and each bias has its own coefficient)::

    m = beta1 m + (1 - beta1) g                  v = beta2 v + (1 - beta2) g^2
    m^ = m / (1 - beta1^t), v^ = v / (1 - beta2^t)            (bias_correction=True)
    u = m^ / (sqrt(v^) + eps) + weight_decay * x               (eps_inside_sqrt=False)
    u = m^ / sqrt(v^ + eps) + weight_decay * x                 (eps_inside_sqrt=True, eq. 2)
    c = clip(||x|| / ||u||, min_coeff, max_coeff)              (1 before clipping if a norm is 0)
    x = x - lr * c * u

The clip bounds apply to the whole ratio, as the 1-bit LAMB paper does (footnote 3), not to
``||x||`` alone.  A zero norm (a zero-initialised bias, an all-zero update) gives ratio 1 before
clipping, as in the reference LAMB and DeepSpeed/Apex: a zero bias must still be able to move.

Everything here is torch ops on tensors (no ``.item()``), so it runs on CUDA without host syncs
and the helpers work equally on one norm or a batch of per-layer norms.  On the CPU, float32 and
float64 tensors take C kernels instead (``_lamb_kernels.c``: two passes over a tensor, shared
with SLAMB), where setup.py could build them.
"""
import ctypes
import math
from typing import Iterable, Optional, Tuple, Union

import torch

from horovod_ext.backends import native

from . import compiled

Number = Union[float, torch.Tensor]

# DeepSpeed's FusedLamb / OnebitLamb defaults for the clip bounds.
DEFAULT_MIN_COEFF = 0.01
DEFAULT_MAX_COEFF = 10.0

_P, _N, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
_LIB = native.load("horovod_ext.algorithms._lamb_kernels", {
    **{f"hx_lamb_moments_{t}": (_P, _P, _P, _P, _P, _N, _P, _N, _N, _D, _D, _D, _D, _D, _N, _D,
                                _P) for t in ("f32", "f64")},
    **{f"hx_lamb_update_{t}": (_P, _P, _P, _P, _N, _N, _D, _D, _D, _N, _D, _D, _D, _D)
       for t in ("f32", "f64")}})
# dtype -> (moments pass, update pass): see _lamb_kernels.c
KERNELS = {} if _LIB is None else {
    dtype: (getattr(_LIB, f"hx_lamb_moments_{t}"), getattr(_LIB, f"hx_lamb_update_{t}"))
    for dtype, t in ((torch.float32, "f32"), (torch.float64, "f64"))}


def trust_ratio(param_norm: torch.Tensor, update_norm: torch.Tensor,
                min_coeff: float = 0.0, max_coeff: float = math.inf) -> torch.Tensor:
    """LAMB's layer-wise coefficient ``clip(||x|| / ||u||, min_coeff, max_coeff)``; 1 (before
    clipping) wherever either norm is 0, so it never produces inf or nan.  Works element-wise
    on tensors of norms of any shape."""
    ok = (param_norm > 0) & (update_norm > 0)
    safe_den = torch.where(ok, update_norm, torch.ones_like(update_norm))
    ratio = torch.where(ok, param_norm / safe_den, torch.ones_like(param_norm))
    return ratio.clamp(min=min_coeff, max=max_coeff)


def bias_corrections(step: int, beta1: float, beta2: float,
                     bias_correction: bool = True) -> Tuple[float, float]:
    """(1 - beta1^t, 1 - beta2^t), or (1, 1) without bias correction; ``step`` counts from 1."""
    if not bias_correction:
        return 1.0, 1.0
    return 1.0 - beta1 ** step, 1.0 - beta2 ** step


def update_moments_(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                    beta1: float, beta2: float) -> None:
    """In place: m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2."""
    exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)


def adam_direction(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int, beta1: float,
                   beta2: float, eps: float, bias_correction: bool = True,
                   eps_inside_sqrt: bool = False,
                   variance_step: Optional[int] = None) -> torch.Tensor:
    """m^ / (sqrt(v^) + eps) (or m^ / sqrt(v^ + eps)) as a new tensor.  ``variance_step``: the
    step v was last updated at, when it lags (1-bit Adam freezes v), for its bias correction."""
    bc1, _ = bias_corrections(step, beta1, beta2, bias_correction)
    _, bc2 = bias_corrections(step if variance_step is None else variance_step, beta1, beta2,
                              bias_correction)
    return corrected_direction(exp_avg, exp_avg_sq, bc1, bc2, eps, eps_inside_sqrt)


def corrected_direction(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, bc1: float, bc2: float,
                        eps: float, eps_inside_sqrt: bool) -> torch.Tensor:
    """``adam_direction`` from the bias corrections (1 - beta^t) themselves."""
    v_hat = exp_avg_sq / bc2
    denom = (v_hat + eps).sqrt_() if eps_inside_sqrt else v_hat.sqrt_().add_(eps)
    return (exp_avg / bc1).div_(denom)


def lamb_update(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, step: int,
                beta1: float, beta2: float, eps: float, weight_decay: float = 0.0,
                bias_correction: bool = True, eps_inside_sqrt: bool = False,
                variance_step: Optional[int] = None) -> torch.Tensor:
    """LAMB's update direction u (before the trust ratio), weight decay included; also Adam's
    (AdamW-style) step direction.  The moments must already hold step ``step``."""
    u = adam_direction(exp_avg, exp_avg_sq, step, beta1, beta2, eps, bias_correction,
                       eps_inside_sqrt, variance_step)
    if weight_decay != 0.0:
        u.add_(param, alpha=weight_decay)
    return u


def lamb_coefficient(param: torch.Tensor, update: torch.Tensor, min_coeff: float,
                     max_coeff: float) -> torch.Tensor:
    """The clipped trust ratio of one tensor, as a 0-d tensor (computed in float32 at least)."""
    dtype = torch.promote_types(param.dtype, torch.float32)
    return trust_ratio(torch.linalg.vector_norm(param, dtype=dtype),
                       torch.linalg.vector_norm(update, dtype=dtype), min_coeff, max_coeff)


class Lamb(torch.optim.Optimizer):
    """LAMB with decoupled-into-the-update weight decay, a bias-correction switch, eps and the
    trust-ratio clip bounds.  ``state[p]`` holds ``step`` (int), ``exp_avg``, ``exp_avg_sq``
    and ``lamb_coeff`` (the last clipped coefficient, a 0-d tensor; 1-bit LAMB tracks it).

    >>> opt = Lamb(model.parameters(), lr=1e-3, weight_decay=0.01)
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0, bias_correction: bool = True,
                 min_coeff: float = DEFAULT_MIN_COEFF, max_coeff: float = DEFAULT_MAX_COEFF,
                 eps_inside_sqrt: bool = False):
        check_lamb_args(lr, betas, eps, weight_decay, min_coeff, max_coeff)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, min_coeff=min_coeff,
                        max_coeff=max_coeff, eps_inside_sqrt=eps_inside_sqrt)
        super().__init__(params, defaults)
        self.native_kernels = True   # False: the torch code even where the C kernels are built

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
            states = [self.state[p] for p in params]
            inside = bool(group["eps_inside_sqrt"])
            if params and self._fused(params):
                coeffs = fused_lamb_steps_(params, [p.grad for p in params],
                                           [s["exp_avg"] for s in states],
                                           [s["exp_avg_sq"] for s in states],
                                           _hyper(group, states[0]["step"]), inside)
                for state, coeff in zip(states, coeffs):
                    state["lamb_coeff"] = coeff
                continue
            for p, state in zip(params, states):
                if self.native_kernels and self._native_step(p, state, group):
                    continue
                state["lamb_coeff"] = lamb_step_(p, p.grad, state["exp_avg"],
                                                 state["exp_avg_sq"],
                                                 _hyper(group, state["step"]), inside)
        return loss

    def _fused(self, params) -> bool:
        """Whether the group's steps run as fused kernels (``compiled``): they serve these
        tensors, all on one device, all at the same step."""
        return (all(compiled.used_for(p) and p.device == params[0].device and p.is_contiguous()
                    for p in params)
                and len({self.state[p]["step"] for p in params}) == 1)

    @staticmethod
    def _native_step(p: torch.Tensor, state: dict, group: dict) -> bool:
        """One tensor's step in the C kernels' two passes (the momentum by torch, one pass);
        False (nothing done) where they cannot take it."""
        m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
        kernels = KERNELS.get(p.dtype)
        if kernels is None or not native.takes(p.dtype, p, g, m, v):
            return False
        moments, update = kernels
        beta1, beta2 = group["betas"]
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        bc1, bc2 = bias_corrections(state["step"], beta1, beta2, group["bias_correction"])
        eps, inside, wd = group["eps"], int(group["eps_inside_sqrt"]), group["weight_decay"]
        sums = torch.zeros(4, dtype=torch.float64)
        moments(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), None, p.numel(), None, 0,
                1, beta2, 0.0, bc1, bc2, eps, inside, wd, sums.data_ptr())
        coeff = trust_ratio(sums[0].sqrt(), sums[1].sqrt(), group["min_coeff"],
                            group["max_coeff"])
        state["lamb_coeff"] = coeff.to(torch.promote_types(p.dtype, torch.float32))
        update(p.data_ptr(), m.data_ptr(), v.data_ptr(), None, p.numel(), 1, bc1, bc2, eps,
               inside, wd, float(coeff) * group["lr"], 0.0, 0.0)
        return True


def _hyper(group: dict, step: int) -> Tuple[float, ...]:
    """``lamb_step_``'s hyper-parameters at ``step``, as plain floats: torch.compile passes
    them to the fused kernels as arguments (no copy to the device, no recompilation as the
    bias corrections change)."""
    beta1, beta2 = group["betas"]
    bc1, bc2 = bias_corrections(step, beta1, beta2, group["bias_correction"])
    return tuple(float(h) for h in (beta1, beta2, bc1, bc2, group["eps"], group["weight_decay"],
                                    group["lr"], group["min_coeff"], group["max_coeff"]))


def lamb_step_(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, hyper: Tuple[float, ...],
               eps_inside_sqrt: bool) -> torch.Tensor:
    """One tensor's LAMB step in place; ``hyper``: beta1, beta2, bc1, bc2, eps, weight_decay,
    lr, min_coeff, max_coeff.  Returns the clipped coefficient."""
    beta1, beta2, bc1, bc2, eps, weight_decay, lr, min_coeff, max_coeff = hyper
    update_moments_(exp_avg, exp_avg_sq, grad, beta1, beta2)
    u = corrected_direction(exp_avg, exp_avg_sq, bc1, bc2, eps, eps_inside_sqrt)
    if weight_decay != 0.0:
        u.add_(p, alpha=weight_decay)
    coeff = lamb_coefficient(p, u, min_coeff, max_coeff)
    p.sub_(u * (coeff.to(u.dtype) * lr))
    return coeff


@compiled.kernel
def fused_lamb_steps_(params, grads, exp_avgs, exp_avg_sqs, hyper: Tuple[float, ...],
                      eps_inside_sqrt: bool):
    """``lamb_step_`` of tensors alike in device, compiled together."""
    return [lamb_step_(p, g, m, v, hyper, eps_inside_sqrt)
            for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs)]


def check_lamb_args(lr: float, betas: Tuple[float, float], eps: float, weight_decay: float,
                    min_coeff: float, max_coeff: Optional[float]) -> None:
    """Clear errors for hyper-parameters LAMB cannot use (shared by every LAMB variant)."""
    if not lr >= 0.0:
        raise ValueError(f"invalid learning rate {lr!r}: must be >= 0")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"invalid betas {betas!r}: need two values in [0, 1)")
    if not eps >= 0.0:
        raise ValueError(f"invalid eps {eps!r}: must be >= 0")
    if not weight_decay >= 0.0:
        raise ValueError(f"invalid weight_decay {weight_decay!r}: must be >= 0")
    if not 0.0 <= min_coeff <= max_coeff:
        raise ValueError(f"invalid trust-ratio bounds min_coeff={min_coeff!r}, "
                         f"max_coeff={max_coeff!r}: need 0 <= min_coeff <= max_coeff")
