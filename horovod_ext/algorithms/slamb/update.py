"""SLAMB's per-tensor update, Algorithm 1 lines 10-19 (see ``slamb.optimizer``): the second
moment, the staleness ``c``, the LAMB direction ``u`` and the step ``x -= eta~ phi~ u`` (with
``/ ||u||`` for ``scaling="algorithm"``): in torch ops (``update_``), compiled as fused kernels
on CUDA tensors (up to CHUNK tensors of a parameter group in one call: ``fused_updates_``), or
in the C kernels' two passes where they can take the tensor.  The per-element coefficient
``eta~ phi~`` is a quadratic in ``c`` whose three terms both paths take from
``coefficient_terms``.
"""
import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from horovod_ext.algorithms import compiled
from horovod_ext.algorithms.lamb import (KERNELS, bias_corrections, corrected_direction,
                                         trust_ratio)
from horovod_ext.backends import native


def coefficient_terms(x_sq, u_sq, xm_sq, um_sq, rest: int, group: Dict[str, Any], n: int,
                      scaling: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, b, cc) with eta~ phi~ = a + (b + cc c) c per element (0-d tensors), from the
    squared norms of x and u over the tensor and over its selected elements; ``rest``: the
    number of elements not selected (0 for a tensor synchronised in full: then b = cc = 0)."""
    lo, hi = group["min_coeff"], group["max_coeff"]
    lr = group["lr"]
    if rest:
        xn_sq, un_sq = (x_sq - xm_sq).clamp_(min=0), (u_sq - um_sq).clamp_(min=0)
    else:   # nothing unsynchronised: phi_min has weight 1 - c = 0, keep it finite
        xn_sq, un_sq = torch.zeros_like(x_sq), torch.zeros_like(u_sq)
    if scaling == "simplified":
        phi_max = trust_ratio(xm_sq.sqrt(), um_sq.sqrt(), lo, hi)
        phi_min = trust_ratio(xn_sq.sqrt(), un_sq.sqrt(), lo, hi)
        scale = 1.0
    else:
        u_norm = u_sq.sqrt()
        phi_max = trust_ratio(xm_sq.sqrt() * u_norm, um_sq.sqrt(), lo, hi)
        phi_min = trust_ratio(xn_sq.sqrt() * u_norm, un_sq.sqrt(), lo, hi)
        scale = torch.where(u_norm > 0, 1.0 / u_norm.clamp(min=torch.finfo(u_norm.dtype).tiny),
                            torch.ones_like(u_norm))
    lr_n = lr / math.sqrt(n)
    phi_max, phi_min = phi_max * scale, phi_min * scale
    if not rest:
        zero = torch.zeros_like(phi_max)
        return phi_max * lr, zero, zero
    # eta~ phi~ = (lr_n + (lr - lr_n) c)(phi_min + (phi_max - phi_min) c)
    return (lr_n * phi_min, lr_n * (phi_max - phi_min) + (lr - lr_n) * phi_min,
            (lr - lr_n) * (phi_max - phi_min))


def coefficients(p: torch.Tensor, u: torch.Tensor, c: torch.Tensor, idx: Optional[torch.Tensor],
                 group: Dict[str, Any], n: int, scaling: str) -> torch.Tensor:
    """eta~ phi~ / ||u|| (algorithm) or eta~ phi~ (simplified): per element, or one 0-d
    tensor for a tensor synchronised in full (c = 1)."""
    dtype = torch.promote_types(p.dtype, torch.float32)
    x_sq = torch.linalg.vector_norm(p, dtype=dtype).square()
    u_sq = torch.linalg.vector_norm(u, dtype=dtype).square()
    if idx is None:
        xm_sq, um_sq = x_sq, u_sq
    else:
        xm_sq = torch.linalg.vector_norm(p.view(-1).index_select(0, idx), dtype=dtype).square()
        um_sq = torch.linalg.vector_norm(u.view(-1).index_select(0, idx), dtype=dtype).square()
    rest = 0 if idx is None else p.numel() - idx.numel()
    a, b, cc = coefficient_terms(x_sq, u_sq, xm_sq, um_sq, rest, group, n, scaling)
    if idx is None:     # c = 1 everywhere: eta~ phi~ = lr phi_max
        return a.to(p.dtype)
    coeff = torch.addcmul(b.to(p.dtype), c, cc.to(p.dtype))   # three passes over c
    return coeff.mul_(c).add_(a.to(p.dtype))


def torch_update_(p: torch.Tensor, g: torch.Tensor, idx: Optional[torch.Tensor],
                  state: Dict[str, Any], group: Dict[str, Any], n: int, scaling: str) -> None:
    """Lines 10-19 for one tensor in torch ops; ``state["step"]`` already counts this step."""
    update_(p, g, state["exp_avg"], state["exp_avg_sq"], state["staleness"], idx,
            _hyper(state, group), bool(group["eps_inside_sqrt"]), n, scaling)


def _hyper(state: Dict[str, Any], group: Dict[str, Any]) -> Tuple[float, ...]:
    """``update_``'s hyper-parameters for this step, as plain floats: torch.compile passes them
    to the fused kernel as arguments (no recompilation as the bias corrections change)."""
    beta1, beta2 = group["betas"]
    bc1, bc2 = bias_corrections(state["step"], beta1, beta2, group["bias_correction"])
    return tuple(float(h) for h in (beta2, group["beta3"], bc1, bc2, group["eps"],
                                    group["weight_decay"], group["lr"], group["min_coeff"],
                                    group["max_coeff"]))


def update_(p, g, m, v, c, idx: Optional[torch.Tensor], hyper: Tuple[float, ...],
            eps_inside_sqrt: bool, n: int, scaling: str) -> None:
    """Lines 10-19 on the tensors themselves; ``hyper``: beta2, beta3, bc1, bc2, eps,
    weight_decay, lr, min_coeff, max_coeff."""
    beta2, beta3, bc1, bc2, eps, weight_decay, lr, min_coeff, max_coeff = hyper
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)                      # line 10
    if idx is None:                                                      # line 13
        c.fill_(1.0)
    else:
        c.mul_(beta3).view(-1).index_fill_(0, idx, 1.0)
    u = corrected_direction(m, v, bc1, bc2, eps, eps_inside_sqrt)        # lines 11-12
    if weight_decay != 0.0:
        u.add_(p, alpha=weight_decay)
    bounds = {"lr": lr, "min_coeff": min_coeff, "max_coeff": max_coeff}
    p.addcmul_(u, coefficients(p, u, c, idx, bounds, n, scaling), value=-1.0)   # 14-19


def updates_(ps, gs, ms, vs, cs, idxs, hyper: Tuple[float, ...], eps_inside_sqrt: bool, n: int,
             scaling: str) -> None:
    """``update_`` of tensors alike in device and hyper-parameters: one compiled call for all
    of them (a call's own host work, guards and arguments, is paid once per step, not per
    tensor)."""
    for p, g, m, v, c, idx in zip(ps, gs, ms, vs, cs, idxs):
        update_(p, g, m, v, c, idx, hyper, eps_inside_sqrt, n, scaling)


_fused_updates = compiled.kernel(updates_, duck_shapes=False)
# Tensors per compiled call: a call's host work is paid once for all of them, and chunks alike
# in length and kind (masked or not) share one compiled graph, where one graph over all of a
# model's tensors would take longer to compile the more tensors there are.
CHUNK = 16


def native_update_(p: torch.Tensor, g: torch.Tensor, idx: Optional[torch.Tensor],
                   state: Dict[str, Any], group: Dict[str, Any], n: int, scaling: str) -> bool:
    """Lines 10-19 for one tensor in the C kernels' two passes; False (nothing done) where
    they cannot take it (not built, not on the CPU, not contiguous float32/float64)."""
    m, v, c = state["exp_avg"], state["exp_avg_sq"], state["staleness"]
    kernels = KERNELS.get(p.dtype)
    if kernels is None or not native.takes(p.dtype, p, g, m, v, c):
        return False
    moments, update = kernels
    beta1, beta2 = group["betas"]
    bc1, bc2 = bias_corrections(state["step"], beta1, beta2, group["bias_correction"])
    eps, inside, wd = group["eps"], int(group["eps_inside_sqrt"]), group["weight_decay"]
    sums = torch.zeros(4, dtype=torch.float64)
    full = idx is None
    moments(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), c.data_ptr(), p.numel(),
            None if full else idx.data_ptr(), 0 if full else idx.numel(), int(full),
            beta2, group["beta3"], bc1, bc2, eps, inside, wd, sums.data_ptr())
    rest = 0 if full else p.numel() - idx.numel()
    a, b, cc = coefficient_terms(sums[0], sums[1], sums[2], sums[3], rest, group, n, scaling)
    update(p.data_ptr(), m.data_ptr(), v.data_ptr(), c.data_ptr(), p.numel(), int(full),
           bc1, bc2, eps, inside, wd, float(a), float(b), float(cc))
    return True


def fused_updates_(items: List[Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor],
                                      Dict[str, Any], Dict[str, Any]]],
                   n: int, scaling: str) -> List[int]:
    """Lines 10-19 as fused kernels for the ``items`` (p, g, idx, state, group) they serve, in
    compiled calls of up to CHUNK tensors that share a device, a parameter group and a step;
    returns the indices of the items left to the other paths.  ``state["step"]`` already
    counts this step."""
    sets: Dict[tuple, List[int]] = {}
    left = []
    for k, (p, g, idx, state, group) in enumerate(items):
        if compiled.used_for(p) and p.is_contiguous() and g.is_contiguous():
            # masked tensors apart from the others, and one-element ones (their size
            # specialises): chunks alike share a compiled graph
            kind = (idx is None, p.numel() <= 1)
            sets.setdefault((p.device, id(group), state["step"], kind), []).append(k)
        else:
            left.append(k)
    for members in sets.values():
        for lo in range(0, len(members), CHUNK):
            _fused_chunk([items[k] for k in members[lo:lo + CHUNK]], n, scaling)
    return left


def _fused_chunk(chosen, n: int, scaling: str) -> None:
    """One compiled call over ``chosen`` (p, g, idx, state, group), the tensors passed as flat
    aliases (one graph whatever their shapes)."""
    ps, gs, idxs, states, groups = zip(*chosen)
    flat = compiled.flat_aliases
    _fused_updates(flat(ps), flat(gs), flat(s["exp_avg"] for s in states),
                   flat(s["exp_avg_sq"] for s in states), flat(s["staleness"] for s in states),
                   list(idxs), _hyper(states[0], groups[0]), bool(groups[0]["eps_inside_sqrt"]),
                   n, scaling)
