"""Crop sizes on the command line: an explicit --image-size over a preset's --resolution-schedule, the
notes on ramps that never start or shrink, one rule and one upper bound for every crop size (training,
evaluation, the ramp's ends), and the ramp's refusals, each one line naming the flag and the value."""
import json
import shutil

import pytest
import torch
import yaml

from helpers import read_metrics, run_train
from helpers.gpu import require_dali
from train import crops
from train.cli import parse
from train.command import CommandParser
from train.errors import UsageError

# the preset whose ramp (160 to 192 px between epochs 65 and 76) lies past a short run's end
FFCV_88 = ["--preset", "ffcv-rn50-88ep", "--arch", "resnet18", "--epochs", "2"]
TINY = ["--loader", "synthetic", "--synthetic-images", "128", "--synthetic-val-images", "64", "--global-batch-size", "64",
        "--max-steps", "2", "--no-tensorboard"]


def refusal(*argv) -> str:
    with pytest.raises(UsageError) as caught:
        parse([str(a) for a in argv])
    message = str(caught.value)
    assert "\n" not in message, message
    return message


# an explicit --image-size over a preset's ramp -----------------------------------------------------
def test_an_explicit_image_size_leaves_the_presets_ramp_and_evaluation_size_out_and_says_so():
    cfg = parse([*FFCV_88, "--image-size", "32"])
    assert (cfg.image_size, cfg.resolution_schedule, cfg.eval_image_size, cfg.eval_flip) == (32, "", 0, True)
    note = crops.crop_note(cfg)
    assert note == ("--resolution-schedule 160:192:65:76 and --eval-image-size 256 of preset ffcv-rn50-88ep left out: "
                    "--image-size 32 given"), note


def test_an_explicit_image_size_keeps_an_evaluation_size_given_with_it():
    cfg = parse([*FFCV_88, "--image-size", "32", "--eval-image-size", "40"])
    assert (cfg.resolution_schedule, cfg.eval_image_size) == ("", 40)
    assert crops.crop_note(cfg) == "--resolution-schedule 160:192:65:76 of preset ffcv-rn50-88ep left out: --image-size 32 given"
    no_ramp = parse(["--preset", "ffcv-rn50-16ep", "--image-size", "64"])  # (a preset without a ramp)
    assert (no_ramp.eval_image_size, crops.crop_note(no_ramp)) == (
        0, "--eval-image-size 256 of preset ffcv-rn50-16ep left out: --image-size 64 given")


def test_the_presets_ramp_stays_without_image_size_or_with_a_ramp_given():
    assert parse(FFCV_88).resolution_schedule == "160:192:65:76"
    given = parse([*FFCV_88, "--image-size", "32", "--resolution-schedule", "24:32:0:1:8"])
    assert (given.image_size, given.resolution_schedule) == (32, "24:32:0:1:8")
    assert crops.crop_note(given) == "--eval-image-size 256 of preset ffcv-rn50-88ep left out: --image-size 32 given"


def test_image_size_at_a_resume_leaves_the_saved_runs_ramp_out(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"image_size": 32, "resolution_schedule": "24:32:1:2:8"}))
    resumed = parse(["--resume", "--out-dir", str(tmp_path), "--image-size", "16"])
    assert (resumed.image_size, resumed.resolution_schedule) == (16, "")
    assert crops.crop_note(resumed).startswith("--resolution-schedule 24:32:1:2:8 of the run's saved config left out")
    assert parse(["--resume", "--out-dir", str(tmp_path)]).resolution_schedule == "24:32:1:2:8"


@pytest.mark.parametrize("no_ramp", ["", "none", "off", "None"])
def test_no_ramp_is_spelled_empty_none_or_off(no_ramp):
    cfg = parse([*FFCV_88, "--resolution-schedule", no_ramp])
    assert (cfg.resolution_schedule, cfg.image_size, crops.crop_note(cfg)) == ("", 192, "")  # (the preset's --image-size)


def test_a_ramp_that_never_starts_in_the_run_names_the_crop_size_it_trains_at():
    note = crops.crop_note(parse(FFCV_88))  # 2 epochs; the ramp moves after 65
    assert note == "the ramp keeps 160 px crops throughout this 2-epoch run (FROM 65)", note
    # FROM at the run's last epoch: the second epoch (epoch 1, 0-based) still trains at START
    note = crops.crop_note(parse(["--resolution-schedule", "24:32:1:2:8", "--epochs", "2"]))
    assert note == "the ramp keeps 24 px crops throughout this 2-epoch run (FROM 1)", note
    # moving from epoch 3 on, but by less than half of STEP by the last epoch: 160 + 16 x 7 / 11 = 170.2 rounds to 160
    note = crops.crop_note(parse(["--resolution-schedule", "160:176:2:13", "--epochs", "10"]))
    assert note == "the ramp keeps 160 px crops throughout this 10-epoch run (rounded to multiples of 32)", note
    assert crops.crop_note(parse(["--resolution-schedule", "24:32:0:1:8", "--epochs", "2"])) == ""  # (it moves: nothing to say)


def test_a_shrinking_ramp_is_accepted_with_a_note():
    cfg = parse(["--resolution-schedule", "32:16:0:2:8", "--epochs", "3"])
    assert cfg.resolution_schedule == "32:16:0:2:8"
    assert crops.crop_note(cfg) == "the ramp shrinks the training crops from 32 to 16 px"


def test_the_crops_note_reaches_the_header_notes():
    from train.engines.single import SingleProcess
    from train.startup import checked_setup
    cfg = parse([*FFCV_88, "--image-size", "32", *TINY])
    run, loader, *_ = result = checked_setup(cfg, SingleProcess(cfg), "")
    try:
        notes = result[4]
        assert "160:192:65:76 and --eval-image-size 256 of preset ffcv-rn50-88ep left out" in notes["crops"], notes
        assert (run.image_size, run.resolution_schedule) == (32, "")
    finally:
        loader.close()
    plain = parse(["--image-size", "32", *TINY])
    run, loader, _, _, notes, *_ = checked_setup(plain, SingleProcess(plain), "")
    loader.close()
    assert notes["crops"] == ""


@pytest.mark.slow
def test_the_ffcv_preset_at_image_size_32_trains_at_32_and_its_restart_is_the_same_run(tmp_path):
    run = tmp_path / "run"
    # (the preset's evaluation at 256 px, flipped, would double the test's time: evaluated at 32 here)
    command = [*FFCV_88, "--image-size", "32", *TINY, "--eval-image-size", "32", "--out-dir", run]
    done = run_train(*command, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    header = done.stdout.splitlines()[0]
    assert "crops 32 px" in header and "160:192:65:76 of preset ffcv-rn50-88ep left out" in header, header
    epochs = [r for r in read_metrics(run) if r["kind"] == "epoch"]
    assert [r["image_size"] for r in epochs] == [32], epochs
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert (saved["image_size"], saved["resolution_schedule"]) == (32, "")
    # the same command again: the same run (here finished at --max-steps), not "other settings"
    again = run_train(*command, cwd=tmp_path)
    assert again.returncode == 0 and "holds a finished run" in again.stdout, again.stdout + again.stderr
    # a run that recorded the preset's ramp beside --image-size 32 (made before the flag won) is its same command's run too
    older = tmp_path / "older"
    shutil.copytree(run, older)
    (older / "config.yaml").write_text(yaml.safe_dump({**saved, "out_dir": str(older),
                                                       "resolution_schedule": "160:192:65:76"}, sort_keys=False))
    kept = run_train(*command[:-1], older, cwd=tmp_path)
    assert kept.returncode == 0 and "holds a finished run" in kept.stdout, kept.stdout + kept.stderr


def test_show_recipe_of_the_ffcv_preset_at_image_size_32_trains_every_epoch_at_32(tmp_path):
    done = run_train(*FFCV_88, "--image-size", "32", "--show-recipe", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    recipe = json.loads(done.stdout)
    assert [e["image_size"] for e in recipe["epochs"]] == [32, 32]
    assert (recipe["config"]["image_size"], recipe["config"]["resolution_schedule"]) == (32, "")


# one upper bound for every crop size ---------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--image-size", "100000"], "--image-size must be a crop size from 16 to 1024 px, got 100000"),
    (["--eval-image-size", "100000"], "--eval-image-size must be 0 (as --image-size) or a crop size from 16 to 1024 px, "
                                      "got 100000"),
    (["--resolution-schedule", "24:100000:0:1:8"], "--resolution-schedule '24:100000:0:1:8': END 100000 is not a crop "
                                                   "size from 16 to 1024 px"),
    (["--image-size", "100000", "--show-recipe"], "--image-size must be a crop size from 16 to 1024 px, got 100000"),
])
def test_a_crop_size_past_the_bound_is_one_line_exit_2_and_writes_nothing(argv, message, tmp_path):
    run = tmp_path / "run"
    done = run_train("--arch", "resnet18", *TINY, "--out-dir", run, *argv, cwd=tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and message in lines[0], done.stderr
    assert not run.exists() and not (tmp_path / "runs").exists()


def test_test_only_at_an_evaluation_size_past_the_bound_is_refused_and_changes_nothing(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"arch": "resnet18", "image_size": 32, "loader": "synthetic"}))
    done = run_train("--test-only", "--out-dir", run, "--eval-image-size", "100000", cwd=tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "--eval-image-size must be 0 (as --image-size) or a crop size from 16 to 1024 px, got 100000" in lines[0]
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]


@pytest.mark.parametrize("name", ["image-size", "eval-image-size"])
def test_every_crop_size_flag_takes_whole_pixels_from_16_to_1024(name):
    for size in (16, 36, 37, 1024):
        assert getattr(parse([f"--{name}", str(size)]), name.replace("-", "_")) == size
    for size in (8, 15, 1025):
        assert refusal(f"--{name}", size).startswith(f"--{name} must be "), size
    assert parse(["--eval-image-size", "0"]).eval_image_size == 0  # (as --image-size)


def test_the_ramps_ends_follow_the_same_rule_and_its_step_stays_a_multiple_of_8():
    assert parse(["--resolution-schedule", "36:1024:0:4:8"]).resolution_schedule == "36:1024:0:4:8"
    assert "START 15 is not a crop size from 16 to 1024 px" in refusal("--resolution-schedule", "15:32:0:1")
    assert "END 1025 is not a crop size from 16 to 1024 px" in refusal("--resolution-schedule", "32:1025:0:1")
    message = refusal("--resolution-schedule", "160:192:65:76:12")
    assert "STEP 12 is not a positive multiple of 8 (the ramp rounds its sizes to multiples of STEP)" in message
    assert "e.g. 160:192:65:76:32" in message


# the ramp's messages -------------------------------------------------------------------------------
@pytest.mark.parametrize("value, said", [
    ("160:192:0.5:1.5", "FROM 0.5 is not a whole number of epochs"),
    ("160.5:192:0:1", "START 160.5 is not a whole number of pixels"),
    ("160:abc:0:1", "END 'abc' is not a number"),
    ("160:192:5", "has 3 values, not 4 or 5"),
    ("160:192:5:2", "FROM 5 is after TO 2"),
    ("160:192:-1:2", "FROM -1 is not 0 or more"),
    ("-8:32:0:1", "START -8 is not a crop size from 16 to 1024 px"),
])
def test_each_ramp_refusal_names_the_flag_the_value_and_what_to_give(value, said):
    message = refusal("--resolution-schedule", value)
    assert message.startswith(f"--resolution-schedule {value!r}: ") and said in message, message
    assert "e.g. 160:192:65:76" in message, message


def test_a_value_starting_with_minus_and_a_digit_reaches_the_flags_own_check():
    assert "--lr-phases '-1:2': give EPOCHS:FACTOR pairs with positive epochs" in refusal(
        "--lr-schedule", "phases", "--lr-phases", "-1:2")
    assert "--batch-schedule '-4:128'" in refusal("--batch-schedule", "-4:128")
    command = CommandParser(prog="python -m train.example")  # (every command of the package builds on it)
    command.add_argument("--span")
    assert command.parse_args(["--span", "-8:32"]).span == "-8:32"
    assert command.parse_args(["--span", "-.5"]).span == "-.5"
    with pytest.raises(UsageError, match="unrecognized arguments: --spam"):
        command.parse_args(["--span", "1", "--spam"])


# evaluation (and training) at a size that is not a multiple of 8, in both file loaders ------------
@pytest.mark.parametrize("size", [36, 37])
def test_both_loaders_train_and_evaluate_at_a_size_that_is_no_multiple_of_8(size, tmp_path):
    require_dali()
    from data.dali import DaliLoader
    from data.embedded import ensure_embedded
    from data.torch_loader import TorchLoader
    from data.tree import check_tree
    from train.config import Config
    root = ensure_embedded(train_per_class=1, val_per_class=2, root=tmp_path)
    cfg = Config(data_dir=str(root), image_size=size, eval_image_size=size, batch_size=4, workers=1)
    classes, cpu = check_tree(str(root)), torch.device("cpu")
    dali, torch_loader = DaliLoader(cfg, classes, 0, 1, cpu), TorchLoader(cfg, classes, 0, 1, cpu)
    try:
        for loader in (dali, torch_loader):
            assert {tuple(x.shape[1:]) for x, _ in loader.train_batches(epoch=0)} == {(3, size, size)}
        std_255 = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
        pairs = list(zip(dali.val_batches(), torch_loader.val_batches(), strict=True))
        assert sum(len(labels) for (_, labels), _ in pairs) == 20
        for (a, labels_a), (b, labels_b) in pairs:
            assert a.shape[1:] == (3, size, size) and torch.equal(labels_a, labels_b)
            # the same centred box in both: the resamplers' rounding apart (at most a level of 255), no pixel shift
            assert ((a - b).abs() * std_255).max() <= 1 + 1e-3
    finally:
        dali.close()
        torch_loader.close()
