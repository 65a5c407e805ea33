"""1-bit Adam (Tang et al., 2021, Algorithm 1) with DeepSpeed's argument names, on CPU and GPU.

Warm-up (steps 1 .. freeze_step): Adam on gradients averaged at full precision over all ranks.
Then the variance is frozen and each step updates the local momentum with the local gradient,
replaces it by the error-compensated 1-bit compressed average (all momenta fused in one buffer,
one scale per parameter) and steps with ``m / (sqrt(v_frozen) + eps)``.

Choices, where the paper and DeepSpeed leave room:
- No bias correction by default, as the paper's Adam (its equation (1)) and DeepSpeed's
  OnebitAdam (which accepts ``bias_correction`` but ignores it).  ``bias_correction=True`` divides
  the momentum by ``1 - beta1^t`` and the frozen variance by ``1 - beta2^T_w``, so that the
  warm-up equals ``torch.optim.Adam``.
- Weight decay as DeepSpeed: ``update = m / (sqrt(v) + eps) + weight_decay * x``.
- Every batch's gradient is used; DeepSpeed's first step only initialises and drops it.
- ``auto_freeze=True`` ends the warm-up early, as section 7.1 suggests, at the first step where
  ``||v_t||_1 / ||v_{t-D}||_1 >= auto_freeze_threshold`` (D = ``auto_freeze_interval``, default
  ``1 / (1 - beta2)``), never before ``lr_warmup_steps`` nor while a learning rate still rises;
  ``freeze_step`` stays the upper bound.
- At size 1 the algorithm runs unchanged (the momentum is still compressed), without
  communication.
- Elements whose frozen variance is exactly 0 (their averaged gradient was 0 all through the
  warm-up: a dead ReLU unit, an unused embedding row) take no momentum step after the freeze.
  1-bit compression never sends a 0, and ``sign * scale / (sqrt(0) + eps)`` would throw them
  about ``scale / eps`` away (NaN within steps); the paper assumes every ``v > 0``, DeepSpeed
  leaves it to a user ``exp_avg_mask``.  Their momentum is held at 0 before the compressed
  allreduce (a gradient they get later does not pile up in the worker error, which stays
  within one scale of their layer) and after it, on every rank alike (the variance comes from
  the averaged gradients).  Weight decay still moves them, as in the warm-up.  Bias correction
  and ``eps_inside_sqrt`` keep 0 at 0; ``eps`` must be > 0 where gradients are exactly 0 (0/0
  is NaN from the warm-up on, as in ``torch.optim.Adam``).  A variance that is tiny but not 0
  is used as it is.
"""
from typing import Optional, Tuple

import torch

from horovod_ext.algorithms.lamb import lamb_update, update_moments_

from ._base import OnebitOptimizer


class OnebitAdam(OnebitOptimizer):
    """``OnebitAdam(model.parameters(), lr=1e-3, freeze_step=1000)``; call ``step()`` after
    ``backward()`` on every rank (do not wrap in DistributedOptimizer: it communicates itself).

    ``state_dict()`` holds this rank's compression errors: save one file per rank."""

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = False, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, amsgrad: bool = False,
                 auto_freeze: bool = False, auto_freeze_threshold: float = 0.96,
                 auto_freeze_interval: Optional[int] = None, lr_warmup_steps: int = 0,
                 topology=None, hierarchical: Optional[bool] = None, name: Optional[str] = None,
                 **deepspeed_only):
        if amsgrad:
            raise NotImplementedError("OnebitAdam does not support amsgrad (nor does DeepSpeed's)")
        if max_grad_norm:
            raise NotImplementedError("OnebitAdam: max_grad_norm is not supported; clip the "
                                      "gradients before step()")
        unknown = set(deepspeed_only) - {"deepspeed", "cuda_aware", "comm_backend_name"}
        if unknown:
            raise TypeError(f"OnebitAdam got unexpected arguments {sorted(unknown)}")
        if not lr >= 0.0 or not eps >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"invalid lr={lr!r}, eps={eps!r} or weight_decay={weight_decay!r}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid betas {betas!r}: need two values in [0, 1)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt)
        super().__init__(params, defaults, freeze_step, topology, hierarchical, name)
        self.auto_freeze = auto_freeze
        self.auto_freeze_threshold = auto_freeze_threshold
        self.auto_freeze_interval = (auto_freeze_interval if auto_freeze_interval is not None
                                     else round(1.0 / (1.0 - betas[1])))
        self.lr_warmup_steps = lr_warmup_steps
        self.onebit_state.update(v_norms=[], last_lrs=None)

    @torch.no_grad()
    def step(self, closure=None):
        loss, fused, t = self._begin_step(closure)
        st = self.onebit_state
        if not st["frozen"]:
            grads = self._averaged_grads_by_param(fused)
            for group, p in self._groups():
                state = self.state[p]
                update_moments_(state["exp_avg"], state["exp_avg_sq"], grads[id(p)],
                                *group["betas"])
                self._apply(p, group, state, t, t)
            if self._warmup_ends(t):
                st["frozen"], st["freeze_at"] = True, t
            return loss
        for group, p in self._groups():
            beta1 = group["betas"][0]
            self.state[p]["exp_avg"].mul_(beta1).add_(self._local_grad(p), alpha=1 - beta1)
        self._compress_momentum(fused, per_layer_scales=True)
        for group, p in self._groups():
            state = self.state[p]
            self._apply_mask(group, p, state["exp_avg"])
            self._apply(p, group, state, t, st["freeze_at"])
        return loss

    @staticmethod
    def _apply(p, group, state, t, variance_step):
        """p -= lr * (m^ / (sqrt(v^) + eps) + weight_decay * p); the variance's bias correction
        uses the step it was last updated at (the freeze step after the warm-up)."""
        beta1, beta2 = group["betas"]
        update = lamb_update(p, state["exp_avg"], state["exp_avg_sq"], t, beta1, beta2,
                             group["eps"], group["weight_decay"], group["bias_correction"],
                             group["eps_inside_sqrt"], variance_step)
        p.add_(update, alpha=-group["lr"])

    def _warmup_ends(self, t: int) -> bool:
        if t >= self.freeze_step:
            return True
        if not self.auto_freeze:
            return False
        st = self.onebit_state
        norm = float(sum(self.state[p]["exp_avg_sq"].sum(dtype=torch.float64)
                         for p in self._all_params()))
        interval = self.auto_freeze_interval
        st["v_norms"] = (st["v_norms"] + [norm])[-(interval + 1):]
        lrs = [g["lr"] for g in self.param_groups]
        rising = st["last_lrs"] is not None and any(a > b for a, b in zip(lrs, st["last_lrs"]))
        st["last_lrs"] = lrs
        if rising or t < self.lr_warmup_steps or len(st["v_norms"]) <= interval:
            return False
        old = st["v_norms"][0]
        return old > 0 and norm / old >= self.auto_freeze_threshold
