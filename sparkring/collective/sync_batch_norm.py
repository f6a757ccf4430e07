"""SyncBatchNorm: batch statistics computed over every rank's batch (CPU and GPU).

Written by hand because torch.nn.SyncBatchNorm only runs on GPUs; this one reduces the
statistics with sparkring's allreduce, and autograd carries the gradient back through a
differentiable allreduce.
"""
from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

from . import basics
from .mpi_ops import Sum, allreduce


class SyncBatchNorm(_BatchNorm):
    """Drop-in for torch.nn.BatchNorm{1,2,3}d whose training statistics span all ranks.

    >>> bn = sr.SyncBatchNorm(16)
    >>> y = bn(torch.randn(8, 16, 4, 4))  # doctest: +SKIP
    """

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2-D input (N, C, ...), got {input.dim()}-D")

    @override
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or not basics.is_initialized() or basics.size() == 1:
            return super().forward(input)
        channels = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        # statistics in float32 at least: in float16 a count or sum of squares past 65504
        # (N*H*W of one 32x56x56 batch) is inf, and E[x^2] - E[x]^2 cancels badly
        x = input if input.dtype in (torch.float32, torch.float64) else input.float()
        count = torch.tensor([input.numel() / channels], dtype=x.dtype, device=input.device)
        stats = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        stats = allreduce(stats, op=Sum)  # differentiable: its gradient is the summed gradient
        total = stats[-1]
        mean = stats[:channels] / total
        var = (stats[channels:2 * channels] / total - mean * mean).clamp_min(0)
        running_mean, running_var, tracked = self.running_mean, self.running_var, self.num_batches_tracked
        if self.track_running_stats and running_mean is not None and running_var is not None:
            with torch.no_grad():
                if tracked is not None:
                    tracked += 1
                if self.momentum is not None:
                    momentum = self.momentum
                else:  # cumulative moving average, as BatchNorm with momentum=None
                    momentum = 1.0 / float(tracked) if tracked is not None else 0.0
                unbiased = var * total / (total - 1).clamp_min(1)
                running_mean.mul_(1 - momentum).add_(momentum * mean.detach())
                running_var.mul_(1 - momentum).add_(momentum * unbiased.detach())
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)
