"""Which samples each rank reads.

Training: one permutation of the whole set per (seed, epoch); global step s takes the slice
[s*G, (s+1)*G) and rank r its r-th part of b = G / world, so N ranks with batch b see exactly
the global batches of one rank with batch N*b. A last partial global batch is dropped.
Evaluation: rank r takes r, r+world, ... so every validation image is counted exactly once.
"""
import torch

_SEED_STRIDE = 1 << 32  # room for 4 billion samples per epoch in a per-sample seed


def epoch_seed(seed: int, epoch: int) -> int:
    """The run's seed and the epoch mixed into one number: every random choice of an epoch (its
    order, each sample's augmentation, DALI's per-rank generators) starts from it."""
    return seed * 100_003 + epoch


def epoch_permutation(num_items: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    return torch.randperm(num_items, generator=generator)


def sample_seed(seed: int, epoch: int, position: int) -> int:
    """Augmentation seed of the sample at `position` in the epoch's global order."""
    return (epoch_seed(seed, epoch) * _SEED_STRIDE + position) % (1 << 63)


class TrainBatchSampler:
    """Yields this rank's batches as lists of (dataset index, augmentation seed).

    Set `epoch` and `start_step` before iterating; iteration is then deterministic.
    """

    def __init__(self, num_items: int, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0):
        self.num_items, self.batch_size = num_items, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.global_batch = batch_size * world_size
        self.epoch, self.start_step = 0, 0

    def __len__(self) -> int:
        return self.num_items // self.global_batch - self.start_step

    def positions(self, step: int) -> range:
        """This rank's positions in the epoch's global order at `step`."""
        first = step * self.global_batch + self.rank * self.batch_size
        return range(first, first + self.batch_size)

    def batches(self):
        """(positions, batch) for each step from `start_step` on: this rank's positions in the epoch's
        order and its batch of (dataset index, augmentation seed)."""
        order = epoch_permutation(self.num_items, self.seed, self.epoch).tolist()
        for step in range(self.start_step, self.num_items // self.global_batch):
            positions = self.positions(step)
            yield positions, [(order[p], sample_seed(self.seed, self.epoch, p)) for p in positions]

    def __iter__(self):
        return (batch for _, batch in self.batches())


def eval_batches(num_items: int, batch_size: int, rank: int = 0, world_size: int = 1):
    """This rank's evaluation batches as lists of dataset indices, with no padding."""
    mine = list(range(rank, num_items, world_size))
    return [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]
