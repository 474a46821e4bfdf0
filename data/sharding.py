"""Which samples each rank reads.

Training: one permutation of the whole set per (seed, epoch); optimizer step s takes the slice
[s*G, (s+1)*G) of it, G = world x b x N (N batches per step: gradient accumulation), cut into
world x N batches of b in order; batch k of the epoch's order goes to rank k % world as its pass
(k // world) % N of the step. So the global batch's samples are split into the same batches whatever
the rank count: N ranks with batch b see the batches of one rank with batch b and N accumulation
steps, and of one rank with batch N*b. A last partial global batch is dropped.
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
    """Yields this rank's batches as lists of (dataset index, augmentation seed), `accumulation` batches
    per optimizer step.

    Set `epoch` and `start_step` (an optimizer step) before iterating; iteration is then deterministic.
    """

    def __init__(self, num_items: int, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 accumulation: int = 1):
        self.num_items, self.rank, self.world_size, self.seed = num_items, rank, world_size, seed
        self.epoch, self.start_step = 0, 0
        self.resize(batch_size, accumulation)

    def resize(self, batch_size: int, accumulation: int = 1) -> None:
        """The per-rank batch and the batches per optimizer step (batch-size control, from the next epoch)."""
        self.batch_size, self.accumulation = batch_size, accumulation
        self.global_batch = batch_size * self.world_size  # the images of one batch of every rank
        self.steps = self.num_items // (self.global_batch * accumulation)  # optimizer steps per epoch

    def __len__(self) -> int:
        return (self.steps - self.start_step) * self.accumulation

    def positions(self, batch: int) -> range:
        """This rank's positions in the epoch's global order in the epoch's `batch`-th batch."""
        first = batch * self.global_batch + self.rank * self.batch_size
        return range(first, first + self.batch_size)

    def batches(self):
        """(positions, batch) for each batch from optimizer step `start_step` on: this rank's positions in
        the epoch's order and its batch of (dataset index, augmentation seed)."""
        order = epoch_permutation(self.num_items, self.seed, self.epoch).tolist()
        for batch in range(self.start_step * self.accumulation, self.steps * self.accumulation):
            positions = self.positions(batch)
            yield positions, [(order[p], sample_seed(self.seed, self.epoch, p)) for p in positions]

    def __iter__(self):
        return (batch for _, batch in self.batches())


def eval_batches(num_items: int, batch_size: int, rank: int = 0, world_size: int = 1):
    """This rank's evaluation batches as lists of dataset indices, with no padding."""
    mine = list(range(rank, num_items, world_size))
    return [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]
