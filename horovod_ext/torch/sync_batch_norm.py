"""``hvd.SyncBatchNorm``: batch normalisation over the global batch (Horovod's API).

In training, with more than one rank in the process set, the statistics are those of every
rank's batch together: the per-channel sums and the element count are allreduced, then the sums
of squared deviations from that global mean (two passes: no cancellation in E[x^2] - E[x]^2).
Both allreduces are differentiable (their backward allreduces the gradients), so backward gives
each rank the gradient of the sum of every rank's loss, as one BatchNorm over the whole batch
would.  In evaluation, or on one rank, it is torch's BatchNorm.
"""
import torch
from torch.nn.modules.batchnorm import _BatchNorm

from horovod_ext.ops import Sum
from horovod_ext.engine.process_sets import global_process_set
from .differentiable import allreduce


class SyncBatchNorm(_BatchNorm):
    """BatchNorm1d/2d/3d whose batch statistics span every rank of ``process_set``."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_set=global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of at least 2 dimensions "
                             f"(batch, channels, ...), got {input.dim()}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or self.process_set.size() == 1:
            return super().forward(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as torch's BatchNorm
                momentum = 1.0 / float(self.num_batches_tracked)
        dims = [0] + list(range(2, input.dim()))
        shape = [1, -1] + [1] * (input.dim() - 2)
        count = torch.tensor([input.numel() / input.size(1)], dtype=input.dtype,
                             device=input.device)
        totals = allreduce(torch.cat([input.sum(dims), count]), op=Sum,
                           process_set=self.process_set)
        n = totals[-1]
        if float(n) < 2:
            raise ValueError(f"SyncBatchNorm needs more than 1 value per channel over all "
                             f"ranks in training, got {int(n)}")
        mean = totals[:-1] / n
        centered = input - mean.view(shape)
        var = allreduce(centered.pow(2).sum(dims), op=Sum, process_set=self.process_set) / n
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
                unbiased = var.detach() * (n / (n - 1))
                self.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
        return out

    @classmethod
    def convert_sync_batchnorm(cls, module, process_set=global_process_set):
        """``module`` with every BatchNorm layer replaced by a SyncBatchNorm holding its
        parameters and running statistics (as torch.nn.SyncBatchNorm.convert_sync_batchnorm)."""
        converted = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            converted = cls(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_set)
            if module.affine:
                with torch.no_grad():
                    converted.weight = module.weight
                    converted.bias = module.bias
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
        for name, child in module.named_children():
            converted.add_module(name, cls.convert_sync_batchnorm(child, process_set))
        return converted


__all__ = ["SyncBatchNorm"]
