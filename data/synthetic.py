"""Synthetic batches for pure-compute measurement.

Each sample is a function of (seed, global sample index) alone, computed on the device with
integer hashing, so the same global batch is generated whatever the number of ranks and the
generator costs almost nothing next to a training step.
"""
import torch

_MASK = (1 << 31) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash; every product stays below 2**62, so int64 never overflows."""
    for multiplier in (0x2C1B3C6D, 0x297A2D39, 0x1B873593):
        x = ((x ^ (x >> 13)) * multiplier) & _MASK
    return x ^ (x >> 16)


def synthetic_batch(indices: torch.Tensor, seed: int, image_size: int, num_classes: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (N, 3, S, S), roughly standard normal, and labels for global sample `indices`."""
    indices = indices.to(device=device, dtype=torch.int64)
    sample_key = _mix((_mix(indices & _MASK) ^ _mix((indices >> 31) + seed * 7919)) & _MASK)
    labels = sample_key % num_classes
    pixels = torch.arange(3 * image_size * image_size, device=device, dtype=torch.int64)
    noise = _mix((sample_key[:, None] * 2654435761 + pixels[None, :]) & _MASK).float() * (1.0 / _MASK)
    images = (noise - 0.5) * 3.4641  # uniform with unit variance
    return images.view(-1, 3, image_size, image_size), labels
