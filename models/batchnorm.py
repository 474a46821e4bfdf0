"""Distributed and ghost BatchNorm: batch statistics summed over a group of ranks (the span), and
optionally taken over groups of G consecutive images inside each rank's batch (ghost BatchNorm).

One implementation for every engine and device: the engine supplies an autograd-aware
all-reduce (torch.distributed's functional collectives / Horovod), so gradients flow back through the
shared statistics exactly as if the group's images were one batch. The module keeps BatchNorm2d's
parameters and buffers, so state_dicts stay torchvision's.
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
        n, channels = x.shape[:2]
        size = min(self.ghost, n) if self.ghost else n
        if n % size:
            raise ValueError(f"ghost BatchNorm: a batch of {n} images does not split into groups of {size}; "
                             "choose a group size that divides the per-rank batch")
        xf = x.float().reshape(n // size, size, *x.shape[1:])  # [groups, G, C, H, W]; a view, any memory format
        local = torch.cat([xf.sum(dim=(1, 3, 4)), (xf * xf).sum(dim=(1, 3, 4))], dim=1)  # [groups, 2C]
        total = self.all_reduce(local) if self.all_reduce is not None else local  # same batch on every rank
        count = size * x.shape[2] * x.shape[3] * self.span
        mean = total[:, :channels] / count
        var = (total[:, channels:] / count - mean * mean).clamp_min(0)
        with torch.no_grad():
            self.running_mean.lerp_(mean.mean(dim=0), self.momentum)
            self.running_var.lerp_((var * count / max(count - 1, 1)).mean(dim=0), self.momentum)
            self.num_batches_tracked += 1
        inv_std = torch.rsqrt(var + self.eps)
        scale = (self.weight * inv_std)[:, None, :, None, None]
        shift = (self.bias - mean * self.weight * inv_std)[:, None, :, None, None]
        return (xf * scale + shift).reshape(x.shape).to(x.dtype)


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
