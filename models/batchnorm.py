"""Distributed BatchNorm: batch statistics summed over a group of ranks.

One implementation for every engine and device: the engine supplies an autograd-aware
all-reduce (torch.distributed.nn / Horovod), so gradients flow back through the shared
statistics exactly as if the group's images were one batch. The module keeps BatchNorm2d's
parameters and buffers, so state_dicts stay torchvision's.
"""
import torch


class GroupBatchNorm2d(torch.nn.BatchNorm2d):
    def __init__(self, num_features: int, all_reduce, group_size: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__(num_features, eps=eps, momentum=momentum)
        self.all_reduce, self.group_size = all_reduce, group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        channels = x.shape[1]
        xf = x.float()
        local = torch.cat([xf.sum(dim=(0, 2, 3)), (xf * xf).sum(dim=(0, 2, 3))])
        total = self.all_reduce(local)  # same per-rank batch on every rank of the group
        count = x.numel() // channels * self.group_size
        mean = total[:channels] / count
        var = (total[channels:] / count - mean * mean).clamp_min(0)
        with torch.no_grad():
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * count / max(count - 1, 1), self.momentum)
            self.num_batches_tracked += 1
        scale = (self.weight * torch.rsqrt(var + self.eps)).view(1, -1, 1, 1)
        shift = (self.bias - mean * self.weight * torch.rsqrt(var + self.eps)).view(1, -1, 1, 1)
        return (xf * scale + shift).to(x.dtype)


def convert_batchnorm(model: torch.nn.Module, all_reduce, group_size: int) -> torch.nn.Module:
    """Replace every BatchNorm2d in place by a GroupBatchNorm2d holding the same tensors."""
    for name, child in model.named_children():
        if isinstance(child, torch.nn.BatchNorm2d) and not isinstance(child, GroupBatchNorm2d):
            new = GroupBatchNorm2d(child.num_features, all_reduce, group_size, child.eps, child.momentum)
            new.weight, new.bias = child.weight, child.bias
            new.running_mean, new.running_var = child.running_mean, child.running_var
            new.num_batches_tracked = child.num_batches_tracked
            setattr(model, name, new)
        else:
            convert_batchnorm(child, all_reduce, group_size)
    return model
