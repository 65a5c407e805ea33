"""The reducers that send no gradients during backward: at one process (nothing to reduce), in
delta mode (the parameters' change is reduced after a local step), and on a rank outside the
optimizer's process set (it trains on its own gradients, as in Horovod)."""
from typing import Callable

import torch

from ..mpi_ops import allreduce_async_, grouped_allreduce_async_, synchronize as wait
from .base import GradientReducer, Reducer
from .requests import zero_gradient


class OutsideSetReducer(Reducer):
    """A rank outside the process set: the wrapped optimizer alone, every default."""


class AloneReducer(GradientReducer):
    """One process and an elementwise op: the reduction of each gradient is the gradient
    itself, so synchronize() finishes it without buckets (whose copy of autograd's fresh
    gradients is most of the cost at one process) or engine requests."""

    def synchronize(self) -> None:
        """What a reduction over one rank leaves of each gradient (compression's round trip,
        the scale factors), zeros where none came."""
        compression = self.settings.compression
        factors = [f for f in self.settings.scales() if f != 1.0]
        with torch.no_grad():
            for p in self.layout.params:
                if p.grad is None:
                    p.grad = zero_gradient(self.layout, p)
                if p.grad.is_sparse:
                    continue
                wire, ctx = compression.compress(p.grad)
                for factor in factors:
                    wire.mul_(factor)
                if wire is not p.grad:
                    p.grad.copy_(compression.decompress(wire, ctx))
        self.progress.synchronized = True


class DeltaReducer(Reducer):
    """Delta mode, for ops that must run after the local optimizer step (Adasum with a stateful
    optimizer, paper section 4.1 and Figure 3): the wrapped optimizer steps locally, the change
    of each parameter is reduced with the op, and the parameter becomes start + reduced change.
    ``backward_passes_per_step=k`` means k local steps between reductions (Adasum paper 5.2)."""

    def synchronize(self) -> None:
        """Optional: if any rank has a non-finite gradient, give every rank one, so that
        GradScaler (which checks local gradients only) skips this step everywhere alike."""
        grads = [p.grad for p in self.layout.params if p.grad is not None and p.grad.numel()]
        bad = torch.zeros(1)
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            bad.fill_(1.0)
        handle = allreduce_async_(bad, name="DistributedOptimizer.finite", op="max",
                                  process_set=self.settings.process_set)
        if float(wait(handle)) and grads:
            grads[0].view(-1)[0] = float("inf")

    def step(self, inner_step: Callable, closure, synchronize: Callable):
        progress, params = self.progress, self.layout.params
        if progress.local_steps == 0:
            progress.starts = [p.detach().clone() for p in params]
        result = inner_step(closure)
        progress.local_steps += 1
        if progress.local_steps < self.settings.backward_passes_per_step:
            return result
        progress.local_steps = 0
        starts, progress.starts = progress.starts, None
        current = [p.detach() for p in params]
        deltas = torch._foreach_sub(current, starts) if params else []
        pre, post = self.settings.scales()
        handle = grouped_allreduce_async_(deltas, name="DistributedOptimizer.delta",
                                          op=self.settings.op, prescale_factor=pre,
                                          postscale_factor=post,
                                          process_set=self.settings.process_set)
        wait(handle)
        if params:
            torch._foreach_add_(starts, deltas)
            torch._foreach_copy_(current, starts)
        return result
