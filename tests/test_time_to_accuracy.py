"""The methods that cut epochs to a top-1 (docs/time_to_accuracy.md): test-time flips, evaluation at
its own resolution, and their flags, each against arithmetic done here by hand."""
import subprocess
import sys

import pytest
import torch

from data.loaders import SyntheticLoader
from train.config import Config
from train.engines.single import SingleProcess
from train.evaluate import evaluate
from train.precision import Precision


class Mirrored(torch.nn.Module):
    """A linear classifier of the whole image: mirroring an image changes its logits."""

    def __init__(self, size: int, classes: int):
        super().__init__()
        torch.manual_seed(3)
        self.linear = torch.nn.Linear(3 * size * size, classes)

    def forward(self, x):
        return self.linear(x.flatten(1))


@pytest.mark.parametrize("flip", [False, True])
def test_eval_flip_scores_the_mean_of_each_images_and_its_mirrors_logits(flip):
    cfg = Config(loader="synthetic", image_size=8, batch_size=16, synthetic_images=16, synthetic_val_images=64,
                 synthetic_classes=4, channels_last=False)
    loader, engine = SyntheticLoader(cfg, 0, 1, torch.device("cpu")), SingleProcess(cfg)
    model = Mirrored(8, 4)
    top1, top5, images = evaluate(model, loader, Precision("fp32", engine.device), engine, flip=flip)
    hits = hits_flipped = 0
    with torch.no_grad():
        for x, labels in loader.val_batches():  # by hand: the logits of x, and of x mirrored left to right
            logits = model.linear(x.reshape(len(x), -1))
            mirrored = model.linear(torch.flip(x, dims=[3]).reshape(len(x), -1))
            hits += int((logits.argmax(1) == labels).sum())
            hits_flipped += int(((logits + mirrored).argmax(1) == labels).sum())
    assert images == 64 and hits != hits_flipped  # (the mirror changes some predictions here)
    assert top1 == (hits_flipped if flip else hits) / 64


@pytest.mark.parametrize("argv, match", [
    (["--eval-image-size", "60"], "--eval-image-size must be 0 or a multiple of 8 from 16 on, got 60"),
    (["--eval-image-size", "8"], "--eval-image-size must be 0 or a multiple of 8 from 16 on, got 8"),
])
def test_bad_method_values_are_one_line_and_exit_2(argv, match, tmp_path):
    done = subprocess.run([sys.executable, "-m", "train", "--out-dir", str(tmp_path / "run"), *argv],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and match in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "run").exists()  # nothing half-written
