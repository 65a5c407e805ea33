"""1-bit LAMB (Li et al., Algorithm 1) with DeepSpeed's argument names, on CPU and GPU.

Warm-up (steps 1 .. freeze_step): LAMB (``horovod_ext.algorithms.lamb``) on gradients averaged at
full precision, tracking each tensor's scaling-coefficient moving average
``c_avg = coeff_beta c_avg + (1 - coeff_beta) c_t``.  At the end of the warm-up the variance
``v_Tw`` is frozen, a fresh variance starts from it, and each tensor gets a fixed momentum scale
coefficient (section 4.3: the mean over tensors of ``||m||/sqrt(numel)`` divided by its own; 1
for a tensor whose momentum is zero).  Then each step:

- local momentum ``m = beta1 m + (1 - beta1) g``, multiplied by the tensor's scale coefficient;
- one compressed allreduce of the flat buffer all momenta are views of (momentum fusion, §4.2),
  then each momentum divided by its coefficient again;
- reconstructed gradient ``(m_t - beta1 m_{t-1}) / (1 - beta1)`` updates the fresh variance;
- ``r = max(v_Tw / v_fresh)`` clipped to ``[(1 - factor_threshold) r_prev, (1 +
  factor_threshold) r_prev]``, then to ``[factor_min, factor_max]`` (lines 17-19, in the paper's
  order); ``x -= lr * r * c_avg * (m / (sqrt(v_Tw) + eps) + weight_decay * x)``.

Choices: no bias correction by default (the paper's equation (2); DeepSpeed ignores the flag);
the frozen ``c_avg`` is bias-corrected, ``c_avg / (1 - coeff_beta^T_w)``, so that a short warm-up
(even freeze_step=1) does not shrink every later step (DeepSpeed's first step drops the batch and
leaves ``c_avg`` at 0 with freeze_step <= 1); elements where both variances are 0 are left out of
the ratio's maximum.  Elements whose frozen variance is 0 (no gradient in the whole warm-up) take
no momentum step, as in ``OnebitAdam`` (see its "Choices"): their momentum is held at 0 on both
sides of the compressed allreduce, so their reconstructed gradient and fresh variance stay 0 and
they stay out of the ratio; weight decay still moves them.
"""
from typing import Optional, Tuple

import torch

from horovod_ext.algorithms.lamb import (DEFAULT_MAX_COEFF, DEFAULT_MIN_COEFF, check_lamb_args,
                                         lamb_coefficient, lamb_update, update_moments_)

from ._base import OnebitOptimizer


class OnebitLamb(OnebitOptimizer):
    """``OnebitLamb(model.parameters(), lr=1e-3, freeze_step=1000)``; call ``step()`` after
    ``backward()`` on every rank (do not wrap in DistributedOptimizer: it communicates itself).

    ``state_dict()`` holds this rank's compression errors: save one file per rank."""

    def __init__(self, params, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = False, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, max_coeff: float = DEFAULT_MAX_COEFF,
                 min_coeff: float = DEFAULT_MIN_COEFF, amsgrad: bool = False,
                 coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1, topology=None, hierarchical: Optional[bool] = None,
                 name: Optional[str] = None, **deepspeed_only):
        if amsgrad:
            raise NotImplementedError("OnebitLamb does not support amsgrad (nor does DeepSpeed's)")
        if max_grad_norm:
            raise NotImplementedError("OnebitLamb: max_grad_norm is not supported; clip the "
                                      "gradients before step()")
        unknown = set(deepspeed_only) - {"deepspeed", "cuda_aware", "comm_backend_name"}
        if unknown:
            raise TypeError(f"OnebitLamb got unexpected arguments {sorted(unknown)}")
        check_lamb_args(lr, betas, eps, weight_decay, min_coeff, max_coeff)
        if not 0.0 <= coeff_beta < 1.0:
            raise ValueError(f"invalid coeff_beta {coeff_beta!r}: must be in [0, 1)")
        if not 0.0 < factor_min <= factor_max or not 0.0 <= factor_threshold < 1.0:
            raise ValueError(f"invalid factor_min={factor_min!r}, factor_max={factor_max!r} or "
                             f"factor_threshold={factor_threshold!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt,
                        max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults, freeze_step, topology, hierarchical, name)
        self.coeff_beta = coeff_beta
        self.factor_max, self.factor_min = factor_max, factor_min
        self.factor_threshold = factor_threshold

    def _init_state(self, p, state):
        super()._init_state(p, state)
        if "lamb_coeff_avg" not in state:
            state["lamb_coeff_avg"] = torch.zeros((), dtype=torch.float32, device=p.device)

    @torch.no_grad()
    def step(self, closure=None):
        loss, fused, t = self._begin_step(closure)
        if not self.onebit_state["frozen"]:
            grads = self._averaged_grads_by_param(fused)
            for group, p in self._groups():
                self._warmup_step(group, p, grads[id(p)], t)
            if t >= self.freeze_step:
                self._freeze(t)
            return loss
        previous = [f.flat.clone() for f in fused]
        for group, p in self._groups():
            beta1 = group["betas"][0]
            state = self.state[p]
            state["exp_avg"].mul_(beta1).add_(self._local_grad(p), alpha=1 - beta1)
            state["exp_avg"].mul_(state["scaling_coeff"].to(p.dtype))
        self._compress_momentum(fused, per_layer_scales=False)
        last = {}
        for f, prev in zip(fused, previous):
            for p, view in zip(f.params, f.views(prev)):
                last[id(p)] = view
        for group, p in self._groups():
            self._compressed_step(group, p, last[id(p)], t)
        return loss

    def _warmup_step(self, group, p, grad, t):
        beta1, beta2 = group["betas"]
        state = self.state[p]
        update_moments_(state["exp_avg"], state["exp_avg_sq"], grad, beta1, beta2)
        u = lamb_update(p, state["exp_avg"], state["exp_avg_sq"], t, beta1, beta2, group["eps"],
                        group["weight_decay"], group["bias_correction"], group["eps_inside_sqrt"])
        coeff = lamb_coefficient(p, u, group["min_coeff"], group["max_coeff"])
        state["lamb_coeff_avg"].mul_(self.coeff_beta).add_(coeff, alpha=1 - self.coeff_beta)
        p.sub_(u * (coeff.to(u.dtype) * group["lr"]))

    def _freeze(self, t):
        st = self.onebit_state
        st["frozen"], st["freeze_at"] = True, t
        params = [p for _, p in self._groups()]
        scales = [torch.linalg.vector_norm(self.state[p]["exp_avg"], dtype=torch.float32)
                  / max(p.numel(), 1) ** 0.5 for p in params]
        united = torch.stack(scales).mean() if scales else None
        correction = 1.0 - self.coeff_beta ** t
        for p, scale in zip(params, scales):
            state = self.state[p]
            ok = (scale > 0) & (united > 0)
            state["scaling_coeff"] = torch.where(ok, united / torch.where(ok, scale, 1.0),
                                                 torch.ones_like(scale))
            state["lamb_coeff_freeze"] = state["lamb_coeff_avg"] / correction
            state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
            state["last_factor"] = torch.ones((), dtype=torch.float32, device=p.device)

    def _compressed_step(self, group, p, m_prev, t):
        beta1, beta2 = group["betas"]
        state = self.state[p]
        m = state["exp_avg"]
        m.div_(state["scaling_coeff"].to(p.dtype))
        self._apply_mask(group, p, m)
        # m_prev is step()'s scratch copy: the reconstructed gradient may overwrite it
        grad = m_prev.mul_(-beta1).add_(m).div_(1.0 - beta1)
        fresh, frozen = state["exp_avg_sq_fresh"], state["exp_avg_sq"]
        fresh.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        # line 17: max over elements of v_Tw / v_t.  Dividing by v_t clamped to the smallest
        # normal number leaves 0/0 out (it gives 0) and turns x/0 into a huge ratio that lines
        # 18-19 clip exactly as they clip inf; a NaN still shows.
        if frozen.numel():
            tiny = torch.finfo(fresh.dtype).tiny
            ratio = torch.div(frozen, fresh.clamp(min=tiny), out=grad)
            r = ratio.max().to(torch.float32)
        else:
            r = torch.ones(())
        last = state["last_factor"]
        r = torch.minimum(torch.maximum(r, last * (1.0 - self.factor_threshold)),
                          last * (1.0 + self.factor_threshold))
        r = r.clamp(self.factor_min, self.factor_max)
        state["last_factor"] = r
        if group["bias_correction"]:
            m = m / (1.0 - beta1 ** t)
            frozen = frozen / (1.0 - beta2 ** self.onebit_state["freeze_at"])
        if group["eps_inside_sqrt"]:
            denom = (frozen + group["eps"]).sqrt_()
        else:
            denom = frozen.sqrt().add_(group["eps"])
        update = torch.div(m, denom, out=denom)
        if group["weight_decay"] > 0.0:
            update.add_(p, alpha=group["weight_decay"])
        coeff = r * state["lamb_coeff_freeze"]
        p.addcmul_(update, (coeff * group["lr"]).to(update.dtype), value=-1.0)
