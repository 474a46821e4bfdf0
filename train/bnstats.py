"""BatchNorm running statistics between training and evaluation.

- `share_bn_statistics`: ranks whose BN groups are smaller than the world see different images and
  so keep different running statistics; averaging them before every evaluation and checkpoint makes
  the evaluated model and the saved model one and the same.
- `recompute_bn_statistics` (--bn-recompute-batches K, Akiba et al.'s "BN without moving
  averages"): the running averages are replaced by the statistics of the last K training batches of
  every rank, computed as if those batches were one: each BN layer's input's mean and variance per
  channel in every batch, combined exactly over the batches and the ranks (mean and unbiased variance).
"""
from collections import deque

import torch

from data.transfer import to_device

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
    Returns the images used over all ranks; 0 (nothing changed) when no rank kept a batch.

    Each batch's statistics are taken per channel in fp32 (as BatchNorm's own kernels take them) and
    combined over the batches and the ranks exactly (Chan et al.'s pairwise update, in fp64 on
    per-channel vectors): two sums over the ranks, the global means first, then the squared
    deviations about them. The host sends one small tensor of counts and reads one number."""
    layers = _batchnorms(model)
    moments = {m: [] for m in layers}  # per layer, of each batch: (values per channel, mean, M2)
    hooks = [m.register_forward_pre_hook(lambda m, args: moments[m].append(_batch_moments(args[0]))) for m in layers]
    was_training = model.training
    model.train()
    try:
        for batch in batches:
            with precision.autocast():
                model(batch)
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    if not layers:
        return 0
    device = layers[0].running_mean.device
    counts = to_device(torch.tensor([sum(n for n, _, _ in moments[m]) for m in layers] + [sum(len(b) for b in batches)],
                                    dtype=torch.float64), device)
    channels = [m.num_features for m in layers]
    sums = [_total([n * mean for n, mean, _ in moments[m]], m, device) for m in layers]
    *sums, counts = engine.all_reduce_sum(torch.cat([*sums, counts])).split(channels + [len(layers) + 1])
    images = int(counts[-1].item())
    if not images:
        return 0
    means = [total / count for total, count in zip(sums, counts)]  # over all ranks
    squares = [_total([m2 + n * (mean - global_mean) ** 2 for n, mean, m2 in moments[m]], m, device)
               for m, global_mean in zip(layers, means)]
    squares = engine.all_reduce_sum(torch.cat(squares)).split(channels)
    for m, mean, m2, count in zip(layers, means, squares, counts):  # (a layer no batch reached keeps its own)
        m.running_mean.copy_(torch.where(count > 0, mean, m.running_mean))
        m.running_var.copy_(torch.where(count > 0, m2 / (count - 1).clamp_min(1), m.running_var))  # unbiased, as BatchNorm keeps it
    return images


def _batch_moments(x: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """A BN input's (N, C, ...) values per channel, and its per-channel mean and sum of squared
    deviations (M2) as fp64 vectors, computed in fp32: a half-precision input is read as fp32 one
    layer at a time, and no fp64 copy of the activation is made."""
    values = x.detach() if x.dtype == torch.float32 else x.detach().float()
    var, mean = torch.var_mean(values, dim=[0, *range(2, x.dim())], correction=0)
    count = x.numel() // x.shape[1]
    return count, mean.double(), var.double() * count


def _total(vectors: list[torch.Tensor], layer, device) -> torch.Tensor:
    """The sum of per-channel fp64 vectors (zeros for a rank that kept no batch)."""
    return torch.stack(vectors).sum(0) if vectors else torch.zeros(layer.num_features, dtype=torch.float64, device=device)


class StepStatistics:
    """--accumulation-steps N > 1: BatchNorm's running statistics move once per optimizer step, by the
    mean of the statistics of its N batches, as they would on N ranks of one batch each once averaged
    over the ranks (share_bn_statistics). Each pass starts from the statistics the step started from
    (and the batch count), and what each pass would have made of them is added up: the mean of those,
    (1 - m) x start + m x the mean of the batches' statistics, is the step's result. On the device, no
    host read; nothing is done for N = 1."""

    def __init__(self, model):
        modules = _batchnorms(model)
        self.buffers = [b for m in modules for b in (m.running_mean, m.running_var)]
        self.counts = [m.num_batches_tracked for m in modules if m.num_batches_tracked is not None]
        self.at_start = self.sums = None

    def before_pass(self, index: int) -> None:
        """Before pass `index` (0-based) of a step: the step's statistics kept (first pass), or the last
        pass's added up and the step's put back (later passes)."""
        if not self.buffers:
            return
        if index == 0:
            self.at_start = [b.clone() for b in self.buffers + self.counts]
            self.sums = None
            return
        if self.sums is None:
            self.sums = [b.clone() for b in self.buffers]
        else:
            torch._foreach_add_(self.sums, self.buffers)
        torch._foreach_copy_(self.buffers + self.counts, self.at_start)

    def after_step(self, passes: int) -> None:
        """After the step's last pass: the mean over its passes, and the batch count one more than at the start."""
        if not self.buffers or self.sums is None:
            return
        torch._foreach_add_(self.sums, self.buffers)
        torch._foreach_div_(self.sums, passes)
        torch._foreach_copy_(self.buffers, self.sums)
        for count, start in zip(self.counts, self.at_start[len(self.buffers):]):
            count.copy_(start + 1)
