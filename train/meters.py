"""What the run counts as it goes, on the device between logging points: the losses of a window
or an epoch (LossMeter), and the positions of the epoch trained so far (SampleLedger)."""
import time

import torch


class SampleLedger:
    """The positions of the epoch's global order trained so far, as count, sum and sum of squares: each
    position once (count = steps x global batch, sum = 0 + 1 + ...) shows in the log that no image was
    trained twice or skipped, across resumes and rank-count changes. `saved`: the total over all ranks
    at the last `total` (kept in checkpoints); `mine`: this rank's since."""

    def __init__(self, saved=(0, 0, 0)):
        self.saved, self.mine = [int(x) for x in saved], [0, 0, 0]

    def add(self, positions: range) -> None:
        first, n = positions.start, len(positions)
        for i, value in enumerate((n, n * first + n * (n - 1) // 2, _squares_below(first + n) - _squares_below(first))):
            self.mine[i] += value

    def total(self, engine) -> list[int]:
        """The epoch's total so far over all ranks (one small all-reduce; every rank calls it)."""
        mine = engine.all_reduce_sum(torch.tensor(self.mine, dtype=torch.int64, device=engine.device)).tolist()
        self.saved, self.mine = [a + b for a, b in zip(self.saved, mine)], [0, 0, 0]
        return list(self.saved)


def _squares_below(n: int) -> int:
    return (n - 1) * n * (2 * n - 1) // 6


class LossMeter:
    """Losses summed on the device since the meter was made; read (one host sync) at logging points."""

    def __init__(self, device: torch.device):
        self.total, self.steps, self.start = torch.zeros((), device=device), 0, time.time()

    def add(self, loss: torch.Tensor) -> None:
        self.total += loss
        self.steps += 1

    def mean(self, engine) -> float:
        total = engine.all_reduce_sum(self.total.clone())
        return round(total.item() / (max(self.steps, 1) * engine.world_size), 5)

    def seconds(self) -> float:
        return max(time.time() - self.start, 1e-9)
