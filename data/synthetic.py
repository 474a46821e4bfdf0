"""Synthetic batches for pure-compute measurement.

Each sample is a function of (seed, global sample index) alone, so the same global batch is
generated whatever the number of ranks. Making a batch costs a gather: a bank of BANK_IMAGES images
per crop size, standard normal, is made once on the host from the seed and sent to the device; each
sample takes one of them and its label by a hash of its index, computed on the host for the batch's
few indices and sent with `to_device` (pinned, not waited for). The step never waits for it and
never pays for generating pixels.
"""
import torch

from data.transfer import to_device

BANK_IMAGES = 64  # distinct images per crop size: each sample is one of them
_MASK = (1 << 31) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash; every product stays below 2**62, so int64 never overflows."""
    for multiplier in (0x2C1B3C6D, 0x297A2D39, 0x1B873593):
        x = ((x ^ (x >> 13)) * multiplier) & _MASK
    return x ^ (x >> 16)


def sample_keys(indices: torch.Tensor, seed: int) -> torch.Tensor:
    """A 31-bit hash of each global sample index (int64, on the host) and the seed."""
    return _mix((_mix(indices & _MASK) ^ _mix((indices >> 31) + seed * 7919)) & _MASK)


class ImageBank:
    """The images synthetic samples are drawn from, of one crop size, on the run's device: (B, 3, S, S),
    channels_last or not as the run's batches are."""

    def __init__(self, seed: int, size: int, device: torch.device, channels_last: bool):
        self.size, self.device, self.channels_last = size, torch.device(device), channels_last
        generator = torch.Generator().manual_seed(seed * 1_000_003 + size)
        # NHWC memory for channels_last: a gather of whole images keeps the layout without a copy
        shape = (BANK_IMAGES, size, size, 3) if channels_last else (BANK_IMAGES, 3, size, size)
        self.images = to_device(torch.randn(shape, generator=generator), self.device)

    def batch(self, indices: torch.Tensor, seed: int, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Images (N, 3, S, S) and labels (N,) on the device for global sample `indices` (int64, on the
        host): each sample's image and label both from its key, independent of each other."""
        keys = sample_keys(indices, seed)
        picks = to_device(torch.stack([keys % BANK_IMAGES, (keys // BANK_IMAGES) % num_classes]), self.device)
        images = self.images.index_select(0, picks[0])
        return (images.permute(0, 3, 1, 2) if self.channels_last else images), picks[1]
