"""What the run counts as it goes, on the device between logging points: the losses of a window
or an epoch (LossMeter), the positions of the epoch trained so far (SampleLedger), and the
unreadable files skipped (SkippedFiles)."""
import time

import torch

from data.transfer import to_device


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
        mine = engine.all_reduce_sum(to_device(torch.tensor(self.mine, dtype=torch.int64), engine.device)).tolist()
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


class SkippedFiles:
    """The unreadable files the loader skipped, over all ranks: those of the current training epoch
    (each counted once an epoch, kept in checkpoints so that a resume counts on), and those a warning
    has named (each named once a run: a bad file is skipped every epoch)."""

    def __init__(self, engine, warn):
        self.engine, self.warn = engine, warn
        self.in_epoch, self.warned_names = set(), set()

    def state_dict(self) -> dict:
        return {"skipped_in_epoch": sorted(self.in_epoch), "named_skips": sorted(self.warned_names)}

    def load_state_dict(self, saved: dict) -> None:
        self.in_epoch, self.warned_names = set(saved.get("skipped_in_epoch", ())), set(saved.get("named_skips", ()))

    def take(self, loader, split: str) -> set[str]:
        """The files `loader` skipped on all ranks since the last take (training ones join the epoch's);
        a warning names those no warning has named before."""
        count, names = loader.take_skipped()
        if not self.engine.any(count > 0):  # (rarely true: then every rank gathers)
            return set()
        skipped = {name for rank in self.engine.gather_object(names) for name in rank}
        new = sorted(skipped - self.warned_names)
        self.warned_names.update(new)
        if new:
            self.warn(f"skipped {len(new)} unreadable {split} image(s) not named before, e.g. {', '.join(new[:3])} "
                 "(metrics.jsonl counts each in every epoch it is skipped)")
        if split == "training":
            self.in_epoch |= skipped
        return skipped
