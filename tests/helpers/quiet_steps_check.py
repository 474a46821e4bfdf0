"""python tests/helpers/quiet_steps_check.py OUT_DIR: a benchmark's run as python -m train.bench train
makes it (1 warm-up and 3 measured steps, the loop given a StepTimer), with a hook on each side of the
timer reading the run at the last measured step: before the timer's quiet steps and after them. Prints
one JSON line: {"before": ..., "after": ..., "quiet_steps": N}, each side the run's step, its LR and
every optimizer parameter group's lr.

The run: resnet18 at 32 px on synthetic data, batch 16 of 1600 images (100 steps an epoch), LARS at
--lr 4 with --warmup-epochs 1: a warmup over 100 steps, so that the LR of step k is 4 k / 100.
"""
import json
import sys

from train.bench_hooks import StepTimer
from train.cli import parse
from train.hooks import LoopHooks
from train.loop import run

WARMUP_STEPS, STEPS = 1, 3


class ReadAtLastStep(LoopHooks):
    """What the run holds when the loop tells this hook that the last measured step is done."""

    def __init__(self):
        self.training, self.read = None, None

    def run_started(self, training) -> None:
        self.training = training

    def step_done(self, step: int, loss) -> None:
        if step == WARMUP_STEPS + STEPS:
            training = self.training
            self.read = {"step": training.state.step, "lr": training.lr,
                         "group_lrs": [group["lr"] for group in training.optimizer.param_groups]}


def main() -> None:
    out_dir = sys.argv[1]
    cfg = parse(["--loader", "synthetic", "--synthetic-images", "1600", "--synthetic-val-images", "0",
                 "--arch", "resnet18", "--image-size", "32", "--threads", "1", "--batch-size", "16",
                 "--optimizer", "lars", "--lr", "4", "--warmup-epochs", "1", "--no-checkpoints", "--eval-every", "0",
                 "--log-every", "1000000", "--no-tensorboard", "--max-steps", str(WARMUP_STEPS + STEPS),
                 "--out-dir", out_dir])
    before, timer, after = ReadAtLastStep(), StepTimer(WARMUP_STEPS, STEPS), ReadAtLastStep()
    run(cfg, hooks=(before, timer, after))
    print(json.dumps({"before": before.read, "after": after.read, "quiet_steps": len(timer.ranks[0][1])}))


if __name__ == "__main__":
    main()
