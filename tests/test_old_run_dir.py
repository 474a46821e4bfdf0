"""A run directory written by version 0.1.0 of the trainer is read by today's code as that version read
it: scored with the same figures and MLPerf verdict, started again from step 0 while it holds no
checkpoint, and resumed from a checkpoint holding its saved settings.

tests/fixtures/run-0.1.0 is what `python -m train COMMAND` of 0.1.0 wrote, run from a folder holding
the dataset `make_dataset` writes in data/: config.yaml (the old version's keys), metrics.jsonl and
mllog.txt. Its checkpoint.pt (90 MB) is left out, and so is the dataset, which the tests write again."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from helpers import read_metrics, run_module, run_train

FIXTURE = Path(__file__).parent / "fixtures" / "run-0.1.0"
COMMAND = ["--data-dir", "data", "--arch", "resnet18", "--image-size", "32", "--epochs", "2",
           "--global-batch-size", "8", "--workers", "0", "--eval-every", "1", "--out-dir", "run", "--no-tensorboard"]
RUN_STEPS = 8  # 32 training images at global batch 8, 2 epochs

# what `python -m train.score run --json` of 0.1.0 printed for the fixture
OLD_SCORE = {
    "time_to_quality_s": 7.756, "images": 64, "throughput_img_s": 8.25, "top1": 0.5, "total_flop": 16273768448,
    "flops": 2098216664.2599277, "valid_flops": 253558202.19193348, "mlperf_compliant": True,
    "mlperf_verdict": "SUCCESS", "mlperf_reason": "", "time_to_target_s": None, "reached_target": False,
    "training_time_s": 7.756, "wall_time_s": 7.756, "status": "complete", "hpc_ai500_level": "free",
    "level_reason": "the model changed (resnet18 at 32 px; reference resnet50 at 224)",
    "config_key": '{"arch": "resnet18", "augment_off_epoch": 0, "batch_schedule": "", "bn_group_size": 0, '
                  '"bn_recompute_batches": 0, "epochs": 2, "global_batch_size": 8, "image_size": 32, '
                  '"lr": 2.694749623827447, "lr_schedule": "warmup-poly", "optimizer": "lars", "preset": "", '
                  '"warmup_epochs": 0.8}',
    "notes": []}

COLOURS = [(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40)]


def make_dataset(root: Path) -> None:
    """The fixture run's data: 4 classes of noisy single-colour 32 px JPEGs, 8 per class to train, 4 to evaluate."""
    rng = np.random.default_rng(0)
    for split, per_class in (("train", 8), ("val", 4)):
        for index, colour in enumerate(COLOURS):
            folder = root / split / f"class{index}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                pixels = np.clip(np.array(colour) + rng.normal(0, 40, (32, 32, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.JPEG", quality=90)


def old_run(folder: Path) -> Path:
    """`folder`, holding a copy of the fixture as run/ and its dataset as data/: where COMMAND runs."""
    shutil.copytree(FIXTURE, folder / "run")
    make_dataset(folder / "data")
    return folder


def score(folder: Path) -> dict:
    scored = run_module("train.score", "run", "--json", cwd=folder)
    assert scored.returncode == 0, scored.stderr
    return json.loads(scored.stdout)


def test_the_old_run_is_scored_as_its_own_scorer_scored_it(tmp_path):
    got = score(old_run(tmp_path))
    assert got == {"run": "run", **OLD_SCORE} | {key: pytest.approx(value) for key, value in OLD_SCORE.items()
                                                 if isinstance(value, float)}


@pytest.mark.slow(seconds=15)
def test_the_old_run_without_its_checkpoint_starts_again_from_step_0(tmp_path):
    folder = old_run(tmp_path)
    again = run_train(*COMMAND, cwd=folder)
    assert again.returncode == 0, again.stderr
    assert ("run holds no checkpoint of its run yet: starting it again from step 0 (its logs kept as *.lost)"
            in again.stdout)
    for name in ("metrics.jsonl", "mllog.txt"):
        assert (folder / "run" / f"{name}.lost").read_bytes() == (FIXTURE / name).read_bytes()
    assert read_metrics(folder / "run")[-1]["step"] == RUN_STEPS
    scored = score(folder)
    assert (scored["status"], scored["images"], scored["mlperf_verdict"]) == ("complete", 64, "SUCCESS")


@pytest.mark.slow(seconds=20)
def test_the_old_run_resumes_from_a_checkpoint_holding_its_saved_settings(tmp_path):
    """The checkpoint is today's, stopped at step 6 by --max-steps on another copy of the run, with its
    "config" entry replaced by the fixture's config.yaml mapping: the old version's keys, as a checkpoint
    of 0.1.0 holds them. The run continues from step 6 and finishes; its logs, the fixture's with the
    resumed part appended, score as a resumed run."""
    stopped = old_run(tmp_path / "stopped")
    first_part = run_train(*COMMAND, "--max-steps", "6", cwd=stopped)
    assert first_part.returncode == 0, first_part.stderr
    saved = torch.load(stopped / "run" / "checkpoint.pt", weights_only=True)
    assert saved["step"] == 6
    saved["config"] = yaml.safe_load((FIXTURE / "config.yaml").read_text())

    folder = old_run(tmp_path / "resumed")
    torch.save(saved, folder / "run" / "checkpoint.pt")
    rest = run_train(*COMMAND, cwd=folder)
    assert rest.returncode == 0, rest.stderr
    assert "resuming run at step 6 " in rest.stdout
    assert f"done: step {RUN_STEPS} " in rest.stdout
    assert read_metrics(folder / "run")[-1]["step"] == RUN_STEPS
    scored = score(folder)
    assert (scored["status"], scored["images"]) == ("complete, resumed 1x", 64)
    assert scored["mlperf_verdict"].startswith("not checkable: resumed run")
