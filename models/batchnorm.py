"""Distributed and ghost BatchNorm: batch statistics summed over a group of ranks (the span), and
optionally taken over groups of G consecutive images inside each rank's batch (ghost BatchNorm).

One autograd Function for every engine and device does what BatchNorm2d's fused kernels do, per
ghost group (a slice of the batch dimension: a contiguous view in NCHW and in channels_last): one
pass for the statistics, one all-reduce per layer for all the groups over the span (each rank's
group means and mean squares; none for a span of 1), one normalisation pass. The backward is alike:
one pass for the gradient sums, one all-reduce of them, one element-wise pass for the input gradient.
The engine supplies the all-reduce (torch.distributed's functional collectives / Horovod); the
Function calls it itself, as a plain sum, in both directions. Statistics are fp32 whatever the
input's dtype (bf16/fp16 under autocast); the output keeps the input's dtype and memory format. No
tensor value is read on the host.

The kernels per device (docs/batchnorm.md has the measurements behind the choices):
- CUDA: SyncBatchNorm's, `torch.batch_norm_stats` / `batch_norm_elemt` forward and
  `batch_norm_backward_reduce` / `batch_norm_backward_elemt` backward, one call per ghost group.
  (SyncBatchNorm all-gathers the ranks' statistics for `batch_norm_gather_stats_with_counts`; the
  span's ranks hold equal batches, so a sum carries the same, and the ghost groups' running
  statistics follow their own rule: the combination is a few operations on [groups, C] tensors.)
- CPU, where those are missing: `torch.batch_norm_update_stats` for the statistics,
  `torch.native_batch_norm` in evaluation mode with the batch's statistics for the normalisation,
  `native_batch_norm_backward` in evaluation mode for the gradient sums, and the input gradient as
  two multiply-adds over the whole batch (per-group coefficients broadcast over a [groups, G, C, H, W]
  view). A copy that puts each group's images on the channel axis, so that one call serves all the
  groups, costs more than the extra calls.

The module keeps BatchNorm2d's parameters and buffers, so state_dicts stay torchvision's.
"""
import torch


class GroupBatchNorm2d(torch.nn.BatchNorm2d):
    """BatchNorm2d whose training statistics cover `span` ranks (summed by `all_reduce`; None for a
    span of 1) and, with `ghost` G > 0, groups of G consecutive images: a rank's batch of N images
    (N a multiple of G; G larger than N counts as N) forms N/G groups, and group i of every rank of
    the span is one group of G x span images, normalised with its own mean and variance.

    Running statistics move once per step (momentum as BatchNorm2d) towards the mean over the groups
    of the group means and the mean over the groups of the unbiased group variances; with one group
    (ghost 0, or G = N) that is plain BatchNorm2d's update. Evaluation uses the running statistics."""

    def __init__(self, num_features: int, all_reduce, span: int, eps: float = 1e-5, momentum: float = 0.1,
                 ghost: int = 0):
        super().__init__(num_features, eps=eps, momentum=momentum)
        self.all_reduce, self.span, self.ghost = all_reduce, span, ghost

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        n = x.shape[0]
        size = min(self.ghost, n) if self.ghost else n
        if n % size:
            raise ValueError(f"ghost BatchNorm: a batch of {n} images does not split into groups of {size}; "
                             "choose a group size that divides the per-rank batch")
        return _GroupBatchNorm.apply(x, self.weight, self.bias, self, size)


class _GroupBatchNorm(torch.autograd.Function):
    """BatchNorm over ghost groups of `size` images and the module's span; updates the module's
    running statistics. Backward: input, weight and bias gradients (the weight and bias ones of
    this rank's images only: the engine averages parameter gradients over the ranks)."""

    @staticmethod
    def forward(ctx, x, weight, bias, bn: GroupBatchNorm2d, size: int):
        memory_format = torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) \
            else torch.contiguous_format
        x = x.contiguous(memory_format=memory_format)  # (no copy for either layout)
        kernels = _kernels(x)
        mean, var = kernels.statistics(x.split(size), bn.eps)  # [groups, C] each, fp32, biased variance
        if bn.all_reduce is not None:  # the span: every rank's batch is as large, so means average
            total = bn.all_reduce(torch.cat([mean, var + mean * mean], dim=1))
            mean, square = (total / bn.span).chunk(2, dim=1)
            var = (square - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + bn.eps)
        count = size * x.shape[2] * x.shape[3] * bn.span  # values per channel in one group of the span
        bn.running_mean.lerp_(mean.mean(dim=0), bn.momentum)
        bn.running_var.lerp_(var.mean(dim=0) * (count / max(count - 1, 1)), bn.momentum)
        bn.num_batches_tracked.add_(1)
        out = torch.empty_like(x)
        kernels.normalise(x.split(size), out.split(size), weight, bias, mean, var, invstd, bn.eps)
        ctx.save_for_backward(x, weight, mean, var, invstd)
        ctx.size, ctx.count, ctx.eps, ctx.memory_format = size, count, bn.eps, memory_format
        ctx.all_reduce = bn.all_reduce
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, var, invstd = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_out = grad_out.contiguous(memory_format=ctx.memory_format)
        kernels = _kernels(x)
        # per group and channel: sum(dy), sum(dy * (x - mean)), over this rank's images
        sum_dy, sum_dy_xmu = kernels.gradient_sums(grad_out.split(ctx.size), x.split(ctx.size), weight, mean, var,
                                                   invstd, ctx.eps)
        grad_weight = (sum_dy_xmu * invstd).sum(dim=0) if need_weight else None  # all groups
        grad_bias = sum_dy.sum(dim=0) if need_bias else None
        if not need_input:
            return None, grad_weight, grad_bias, None, None
        if ctx.all_reduce is not None:  # the span's sums: every rank's images count in every input gradient
            sum_dy, sum_dy_xmu = ctx.all_reduce(torch.cat([sum_dy, sum_dy_xmu], dim=1)).chunk(2, dim=1)
        grad_input = kernels.input_gradient(grad_out, x, ctx.size, ctx.count, weight, mean, invstd, sum_dy, sum_dy_xmu)
        return grad_input, grad_weight, grad_bias, None, None


def _kernels(x: torch.Tensor):
    return _CudaKernels if x.is_cuda else _CpuKernels


class _CudaKernels:
    """SyncBatchNorm's kernels, one call per ghost group (`parts`: the groups' views of the batch)."""

    @staticmethod
    def statistics(parts, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's per-channel mean and biased variance, fp32 (also for bf16/fp16 inputs), one pass each."""
        mean, invstd = (torch.stack(column) for column in zip(*(torch.batch_norm_stats(part, eps) for part in parts)))
        return mean, (invstd.pow(-2) - eps).clamp_min(0)  # (a variance near 0 may round below it)

    @staticmethod
    def normalise(parts, out_parts, weight, bias, mean, var, invstd, eps: float) -> None:
        for part, part_out, part_mean, part_invstd in zip(parts, out_parts, mean, invstd):
            torch.batch_norm_elemt(part, weight, bias, part_mean, part_invstd, eps, out=part_out)

    @staticmethod
    def gradient_sums(grad_parts, parts, weight, mean, var, invstd, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        sums = [torch.batch_norm_backward_reduce(dy, part, m, s, weight, True, False, False)[:2]
                for dy, part, m, s in zip(grad_parts, parts, mean, invstd)]
        return tuple(torch.stack(column) for column in zip(*sums))

    @staticmethod
    def input_gradient(grad_out, x, size: int, count: int, weight, mean, invstd, sum_dy, sum_dy_xmu) -> torch.Tensor:
        counts = torch.full((1,), count, dtype=torch.int32, device=x.device)  # the kernel divides by their sum
        parts = [torch.batch_norm_backward_elemt(dy, part, m, s, weight, sdy, sdyx, counts)
                 for dy, part, m, s, sdy, sdyx in zip(grad_out.split(size), x.split(size), mean, invstd,
                                                      sum_dy, sum_dy_xmu)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class _CpuKernels:
    """BatchNorm's CPU kernels (those above are CUDA-only), one call per ghost group, and the input
    gradient as two multiply-adds over the whole batch."""

    @staticmethod
    def statistics(parts, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        # float buffers make it compute and return fp32 statistics for bf16/fp16 inputs too; momentum 0
        # leaves them as they are
        scratch = torch.zeros(2, parts[0].shape[1])
        stats = [torch.batch_norm_update_stats(part, scratch[0], scratch[1], 0.0) for part in parts]
        return tuple(torch.stack(column) for column in zip(*stats))

    @staticmethod
    def normalise(parts, out_parts, weight, bias, mean, var, invstd, eps: float) -> None:
        nothing = mean.new_empty(0)  # the unused outputs (saved statistics, fp32) of evaluation mode
        for part, part_out, part_mean, part_var in zip(parts, out_parts, mean, var):
            # evaluation mode: normalised with the statistics given
            torch.native_batch_norm(part, weight, bias, part_mean, part_var, False, 0.0, eps,
                                    out=(part_out, nothing, nothing))

    @staticmethod
    def gradient_sums(grad_parts, parts, weight, mean, var, invstd, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        # evaluation mode's weight and bias gradients: sum(dy * (x - mean) * invstd) and sum(dy)
        sums = [torch.ops.aten.native_batch_norm_backward(dy, part, weight, m, v, None, None, False, eps,
                                                          [False, True, True])[1:]
                for dy, part, m, v in zip(grad_parts, parts, mean, var)]
        sum_dy_xhat, sum_dy = (torch.stack(column) for column in zip(*sums))
        return sum_dy, sum_dy_xhat / invstd

    @staticmethod
    def input_gradient(grad_out, x, size: int, count: int, weight, mean, invstd, sum_dy, sum_dy_xmu) -> torch.Tensor:
        """weight * invstd * (dy - sum_dy / count - (x - mean) * invstd^2 * sum_dy_xmu / count), as
        dy * k1 + x * k2 + k3 with per-group coefficients: two passes over the whole batch, fp32."""
        groups, channels = mean.shape
        k1 = invstd if weight is None else weight * invstd
        k2 = -k1 * invstd * invstd * sum_dy_xmu / count
        k3 = -k1 * sum_dy / count - k2 * mean
        per_group = (groups, 1, channels, 1, 1)
        grouped = (groups, size, *x.shape[1:])  # a view in either memory format
        grad = torch.addcmul(k3.view(per_group), x.view(grouped), k2.view(per_group))
        grad.addcmul_(grad_out.view(grouped), k1.view(per_group))
        return grad.view(x.shape).to(x.dtype)


def convert_batchnorm(model: torch.nn.Module, all_reduce, span: int, ghost: int = 0) -> torch.nn.Module:
    """Replace every BatchNorm2d in place by a GroupBatchNorm2d holding the same tensors."""
    for name, child in model.named_children():
        if isinstance(child, torch.nn.BatchNorm2d) and not isinstance(child, GroupBatchNorm2d):
            new = GroupBatchNorm2d(child.num_features, all_reduce, span, child.eps, child.momentum, ghost)
            new.weight, new.bias = child.weight, child.bias
            new.running_mean, new.running_var = child.running_mean, child.running_var
            new.num_batches_tracked = child.num_batches_tracked
            setattr(model, name, new)
        else:
            convert_batchnorm(child, all_reduce, span, ghost)
    return model
