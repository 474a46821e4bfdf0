"""BatchNorm running statistics between training and evaluation.

- `share_bn_statistics`: ranks whose BN groups are smaller than the world see different images and
  so keep different running statistics; averaging them before every evaluation and checkpoint makes
  the evaluated model and the saved model one and the same.
- `recompute_bn_statistics` (--bn-recompute-batches K, Akiba et al.'s "BN without moving
  averages"): the running averages are replaced by the statistics of the last K training batches of
  every rank, computed as if those batches were one: each BN layer's input summed per channel over
  all of them (and their squares), all-reduced, then mean and unbiased variance.
"""
from collections import deque

import torch

BN_TYPES = torch.nn.modules.batchnorm._NormBase


def _batchnorms(model) -> list:
    return [m for m in model.modules() if isinstance(m, BN_TYPES) and m.running_mean is not None]


def share_bn_statistics(model, engine, bn_span: int) -> None:
    """BN running statistics averaged over all ranks (skipped when every rank already has the same).
    Training never reads them, so steps are unchanged."""
    if engine.world_size == 1 or bn_span == engine.world_size:
        return
    buffers = [b for m in _batchnorms(model) for b in (m.running_mean, m.running_var)]
    if not buffers:
        return
    mean = engine.all_reduce_sum(torch.cat([b.reshape(-1) for b in buffers])) / engine.world_size
    torch._foreach_copy_(buffers, [piece.view_as(b) for piece, b in zip(mean.split([b.numel() for b in buffers]), buffers)])


class RecentBatches:
    """The last K training batches of this rank (images only), kept for the recomputation."""

    def __init__(self, k: int):
        self.batches = deque(maxlen=k)

    def add(self, images: torch.Tensor) -> None:
        if self.batches.maxlen:  # a copy: a loader may reuse its output buffers (DALI on a CPU does)
            self.batches.append(images.clone())


@torch.no_grad()
def recompute_bn_statistics(model, batches, engine, precision) -> int:
    """Replace every BN layer's running mean and variance by the statistics of its inputs over
    `batches` on all ranks (a forward pass in training mode, as the training steps saw them).
    Returns the images used over all ranks; 0 (nothing changed) when no rank kept a batch."""
    layers = _batchnorms(model)
    sums = {m: [] for m in layers}
    hooks = [m.register_forward_pre_hook(lambda m, args: sums[m].append(_moments(args[0]))) for m in layers]
    was_training = model.training
    model.train()
    try:
        for images in batches:
            with precision.autocast():
                model(images)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    local = [torch.stack(sums[m]).sum(0) if sums[m] else torch.zeros(2 * m.num_features + 1, dtype=torch.float64,
                                                                      device=m.running_mean.device) for m in layers]
    total = engine.all_reduce_sum(torch.cat(local)) if local else torch.zeros(0)
    images = int(engine.all_reduce_sum(torch.tensor(sum(len(b) for b in batches), device=engine.device)).item())
    if not images:
        return 0
    for m, piece in zip(layers, total.split([2 * m.num_features + 1 for m in layers])):
        count = piece[-1]
        mean = piece[:m.num_features] / count
        var = (piece[m.num_features:-1] / count - mean * mean).clamp_min(0) * count / (count - 1).clamp_min(1)
        m.running_mean.copy_(mean)
        m.running_var.copy_(var)
    return images


def _moments(x: torch.Tensor) -> torch.Tensor:
    """Per-channel sum and sum of squares of a BN input (N, C, ...) in float64, and the value count."""
    x = x.detach().double().transpose(0, 1).reshape(x.shape[1], -1)
    return torch.cat([x.sum(1), (x * x).sum(1), torch.tensor([x.shape[1]], dtype=torch.float64, device=x.device)])
