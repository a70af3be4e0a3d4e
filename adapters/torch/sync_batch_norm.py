"""Batch normalization whose batch statistics span every rank: ``SyncBatchNorm``.

Same name, arguments and semantics as ``horovod.torch.SyncBatchNorm``, plus
``process_set=``; unlike Horovod's it also runs on CPU tensors (the
statistics are computed with ordinary tensor ops, not CUDA-only kernels).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from dp_plugin.agree.check import check
from dp_plugin.agree.edge import calling
from dp_plugin.agree.request import Request
from dp_plugin.api.process_sets import engine_of
from dp_plugin.engines.base import ReduceOp
from dp_plugin.reduce.collective import fused_collective
from torch.autograd.function import Function
from torch.nn.modules.batchnorm import _BatchNorm


class SyncBatchNorm(_BatchNorm):
    """N-dimensional batch normalization over the samples of all ranks.

    In training mode with more than one rank, the mean and variance used to
    normalize (and to update ``running_mean``/``running_var``) are those of
    the global batch: the concatenation of every rank's input along dim 0.
    Ranks may hold different batch sizes, including zero; each rank's
    statistics are weighted by its sample count. The backward pass gives
    each rank's input the gradient it would get in the single-process
    computation on the global batch. ``weight``/``bias`` gradients stay
    local (this rank's samples only), as for any parameter: the
    ``DistributedOptimizer`` reduces them with the others.

    In eval mode, and when the job has a single rank, it is exactly
    ``torch.nn.BatchNorm{1,2,3}d``. (Eval mode never communicates, even with
    ``track_running_stats=False``, as in ``torch.nn.SyncBatchNorm``: ranks
    may evaluate different numbers of batches, and a collective there would
    hang.)

    Distributed contract: in training mode every forward is a
    synchronization point (one agreement, then one all-reduce of a table of
    2C+1 numbers per rank) and, when the input needs a gradient, so is every
    backward (one agreement, then one all-reduce of 2C numbers). While a
    rank has called ``hvd.join()`` it raises ``JoinedRankError`` on the
    ranks that call it (Horovod's SyncBatchNorm all-gathers, which join
    refuses too). All ranks of the process set must therefore call the
    layer's forward and backward the same number of times, in the same
    order relative to their other collectives.

    Arguments: ``num_features`` is C of inputs shaped (N, C, ...);
    ``eps``, ``momentum`` (``None`` for a cumulative average), ``affine``
    and ``track_running_stats`` as for ``torch.nn.BatchNorm2d``;
    ``process_set`` (default: all ranks) restricts the statistics to that
    set's ranks.

    Example::

        model = nn.Sequential(nn.Conv2d(3, 16, 3), hvd.SyncBatchNorm(16), nn.ReLU())
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_set: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects an input of shape (N, C, ...) with at least 2 "
                f"dimensions, got shape {tuple(input.shape)}; add a batch dimension"
            )
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) got an input with {input.shape[1]} "
                f"channels (shape {tuple(input.shape)}); dimension 1 must be num_features"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        # Buffers are updated only when tracked, and read only in eval mode.
        track = not self.training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None
        use_batch_stats = self.training or (running_mean is None and running_var is None)
        if self.training:
            with calling("hvd.SyncBatchNorm"):
                engine = engine_of(self.process_set)
            if engine.size > 1:
                return _SyncBatchNormFunction.apply(
                    input, self.weight, self.bias, running_mean, running_var,
                    self.eps, factor, engine,
                )
        return F.batch_norm(
            input, running_mean, running_var, self.weight, self.bias,
            use_batch_stats, factor, self.eps,
        )


def _sum(engine: Any, t: torch.Tensor, name: str) -> None:
    """Sum ``t`` over the ranks of ``engine``, in place: one fused collective
    (the statistics are a few numbers per channel, reduced where they lie).

    The check (``dp_plugin.agree.check``, one small all-reduce) runs first, so
    the data's all-reduce never pairs with the standing answer of a rank that
    called ``hvd.join()`` (``dp_plugin.agree.join``): every rank that called
    it raises ``JoinedRankError`` instead, or ``MismatchError`` when the
    ranks call their SyncBatchNorm layers in different orders or shapes."""
    check(engine, Request.of("allreduce", [t], name=f"SyncBatchNorm ({name})",
                             op=ReduceOp.SUM))
    fused_collective([t], engine=engine, name=name, names=[name]).finish()


def _shaped(v: torch.Tensor, ndim: int) -> torch.Tensor:
    """A per-channel vector (C,) broadcastable against (N, C, ...)."""
    return v.view(1, -1, *([1] * (ndim - 2)))


def _global_stats(engine: Any, xa: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Mean and M2 (sum of squared deviations) per channel over every rank's
    ``xa``, and the total count; one fused collective. Every rank gets the
    same numbers, so a too-small global batch raises on every rank."""
    channels = xa.shape[1]
    dims = [d for d in range(xa.dim()) if d != 1]
    count = xa.numel() // channels if channels else 0
    if count:
        mean = xa.mean(dims)
        m2 = (xa - _shaped(mean, xa.dim())).square().sum(dims)
    else:  # an empty shard contributes nothing (its count is 0)
        mean = xa.new_zeros(channels)
        m2 = xa.new_zeros(channels)
    # Per-rank (count, mean, M2), combined with Chan et al.'s pairwise
    # formula: stable where sum-of-squares cancels. float64 on the wire
    # keeps counts exact and costs nothing at this size.
    row = torch.cat([mean.new_tensor([float(count)]), mean, m2]).to(torch.float64)
    # Every rank's row, in rank order: each rank fills its own row of a
    # zero table, and one fused sum makes the table whole everywhere.
    table = torch.zeros(engine.size, row.numel(), dtype=torch.float64,
                        device=engine.buffer_device)
    table[engine.rank] = row
    _sum(engine, table, "sync_batch_norm.stats")
    table = table.to(xa.device)
    counts = table[:, :1]
    total = float(counts.sum())
    if total <= 1:
        raise ValueError(
            f"SyncBatchNorm in training mode needs more than 1 value per channel over all "
            f"ranks, got {total:g} (per-rank counts "
            f"{[int(c) for c in counts.view(-1).tolist()]}); use a larger batch or eval mode"
        )
    means, m2s = table[:, 1:1 + channels], table[:, 1 + channels:]
    g_mean = (counts * means).sum(0) / total
    g_m2 = (m2s + counts * (means - g_mean).square()).sum(0)
    return g_mean, g_m2, total


class _SyncBatchNormFunction(Function):
    """Forward: global mean/variance from every rank's (count, mean, M2).
    Backward: global sums of dy and dy*x_hat, then the usual BN input grad."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        factor: float,
        engine: Any,
    ) -> torch.Tensor:
        x = input.contiguous()
        # Half-precision inputs (autocast) get float32 statistics, as cuDNN does.
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        xa = x.to(acc)
        g_mean, g_m2, total = _global_stats(engine, xa)
        var = g_m2 / total
        invstd = torch.rsqrt(var + eps).to(acc)
        g_mean = g_mean.to(acc)

        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1 - factor).add_(g_mean.to(running_mean.dtype), alpha=factor)
            if running_var is not None:
                unbiased = (g_m2 / (total - 1)).to(running_var.dtype)
                running_var.mul_(1 - factor).add_(unbiased, alpha=factor)

        xhat = (xa - _shaped(g_mean, x.dim())) * _shaped(invstd, x.dim())
        out = xhat
        if weight is not None:
            out = out * _shaped(weight.to(acc), x.dim())
        if bias is not None:
            out = out + _shaped(bias.to(acc), x.dim())
        # The input, not x_hat, is kept: no extra activation-sized float32
        # copy for half-precision inputs; backward recomputes x_hat.
        ctx.save_for_backward(x, weight, g_mean, invstd)
        ctx.total = total
        ctx.engine = engine
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.to(x.dtype)

    @staticmethod
    def backward(
        ctx: Any, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        ndim = x.dim()
        dims = [d for d in range(ndim) if d != 1]
        xhat = (x.to(mean.dtype) - _shaped(mean, ndim)) * _shaped(invstd, ndim)
        dy = grad_output.contiguous().to(mean.dtype)
        channels = x.shape[1]
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)

        grad_input = None
        if need_input:
            engine = ctx.engine
            sums = torch.cat([sum_dy, sum_dy_xhat]).to(engine.buffer_device)
            _sum(engine, sums, "sync_batch_norm.grads")
            sums = sums.to(dy.device)
            mean_dy = _shaped(sums[:channels] / ctx.total, ndim)
            mean_dy_xhat = _shaped(sums[channels:] / ctx.total, ndim)
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            grad_input = ((dy - mean_dy - xhat * mean_dy_xhat) * _shaped(scale, ndim)).to(x.dtype)
        # This rank's share only: the optimizer reduces parameter gradients.
        grad_weight = sum_dy_xhat.to(weight.dtype) if need_weight else None
        grad_bias = sum_dy.to(ctx.bias_dtype) if need_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None
