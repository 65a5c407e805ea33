"""The interface every reducer implements, one reducer per way DistributedOptimizer can reduce
(per gradient, in groups, in buckets, at one process, in delta mode, outside the process set),
and the step shared by the reducers of gradients."""
import warnings
from typing import Callable

import torch

from .state import OptimizerState


class Reducer:
    """What DistributedOptimizer delegates to; the defaults do nothing, as a rank outside the
    process set needs."""

    # Whether each parameter's post-accumulate-grad hook should call on_gradient
    uses_gradient_hooks = False

    def __init__(self, state: OptimizerState):
        self.state = state
        self.settings = state.settings
        self.layout = state.layout
        self.progress = state.progress

    def on_gradient(self, p: torch.Tensor) -> None:
        """``p``'s gradient of this backward pass is accumulated."""

    def synchronize(self) -> None:
        """Finish this step's reductions: every gradient reduced."""

    def step(self, inner_step: Callable, closure, synchronize: Callable):
        """The optimizer's step; ``inner_step`` is the wrapped optimizer's, ``synchronize`` the
        DistributedOptimizer's (which first catches up with a re-initialisation)."""
        return inner_step(closure)

    def reset(self) -> None:
        """Forget the step in progress: its requests belong to an engine that is gone, or
        failed."""

    def zero_grad(self, set_to_none: bool) -> bool:
        """Raise while reductions are in flight; True when this reducer zeroed the gradients
        itself (in place, in its buckets), False to leave it to torch's zero_grad."""
        return False


class GradientReducer(Reducer):
    """Reduces gradients: step() synchronizes first, unless the user did (Horovod's protocol
    with ``synchronize()`` and ``skip_synchronize()``)."""

    uses_gradient_hooks = True

    def step(self, inner_step: Callable, closure, synchronize: Callable):
        progress = self.progress
        if not progress.skip_sync:
            if progress.synchronized:
                # Horovod reduces the gradients again here; this one uses them as they are
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(): call step() inside "
                              "`with optimizer.skip_synchronize():` (Horovod would reduce the "
                              "gradients again)", UserWarning, stacklevel=2)
            else:
                synchronize()
        result = inner_step(closure)
        progress.synchronized = False
        return result

    def reset(self) -> None:
        self.progress.passes.clear()

    def count_pass(self, p: torch.Tensor) -> bool:
        """Count a backward pass of ``p``; True when it completes ``backward_passes_per_step``
        of them (and the count starts over)."""
        if self.settings.backward_passes_per_step == 1:
            return True   # every hook's path: no count to keep
        passes = self.progress.passes
        passes[id(p)] = passes.get(id(p), 0) + 1
        if passes[id(p)] < self.settings.backward_passes_per_step:
            return False
        passes[id(p)] = 0
        return True

    def again_message(self, params) -> str:
        names = [self.layout.names[id(p)] for p in params]
        return (f"gradients of {names} were computed again before step(): call "
                f"optimizer.synchronize() first, or raise backward_passes_per_step")
