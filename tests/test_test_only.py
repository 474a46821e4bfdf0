"""--test-only reads only the validation split of the run's data (or --data-dir), and refuses, in one
line with exit 2, a model --arch does not build from the checkpoint and data whose classes are not the
run's (the same count with other names would be scored silently, near 0); a resumed run is held to its
classes the same way. It evaluates the checkpoint's run's model (BlurPool or not) and the weights the run
evaluated (its average, or with --raw-weights the trained weights), and refuses a model flag that
contradicts them."""
import shutil

import pytest
import torch
import yaml

from helpers import run_train
from test_errors import make_tree

RUN = ["--arch", "resnet18", "--image-size", 32, "--workers", 0, "--global-batch-size", 4, "--eval-every", 0,
       "--max-steps", 1, "--epochs", 2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("test_only")
    make_tree(root / "data", ["apple", "pear"], ["apple", "pear"])
    done = run_train("--data-dir", root / "data", "--out-dir", root / "run", *RUN, cwd=root)
    assert done.returncode == 0, done.stderr
    return root


def refused(result, *words):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and all(w in lines[0] for w in words), result.stderr
    return lines[0]


@pytest.mark.slow
def test_another_arch_is_one_line(trained):
    result = run_train("--test-only", "--out-dir", trained / "run", "--arch", "resnet50", cwd=trained)
    refused(result, "holds a resnet18", "--arch resnet50")


@pytest.mark.slow
def test_data_with_other_class_names_is_refused_by_name(trained, tmp_path):
    make_tree(tmp_path / "other", ["apple", "plum"], ["apple", "plum"])  # as many classes, another name
    result = run_train("--test-only", "--out-dir", trained / "run", "--data-dir", tmp_path / "other", cwd=tmp_path)
    refused(result, "not the run's", "'plum'", "'pear'")
    again = run_train("--resume", "--out-dir", trained / "run", "--data-dir", tmp_path / "other", "--max-steps", 2,
                      cwd=tmp_path)
    refused(again, "not those of the run")


@pytest.mark.slow
def test_a_training_split_smaller_than_a_global_batch_does_not_stop_an_evaluation(trained, tmp_path):
    make_tree(tmp_path / "small", ["apple", "pear"], ["apple", "pear"], images_per_class=1)  # 2 < global batch 4
    result = run_train("--test-only", "--out-dir", trained / "run", "--data-dir", tmp_path / "small", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("(2 images)")


# A run that changes its model (BlurPool) and evaluates an average of the weights: --test-only must
# evaluate that model, and refuse a flag that would evaluate another one.
AVERAGED_RUN = [*RUN, "--blurpool", "--ema-decay", 0.5]


@pytest.fixture(scope="module")
def averaged(tmp_path_factory):
    """A run trained with BlurPool and an average of the weights on a validation set of 3 apples and 1 pear."""
    root = tmp_path_factory.mktemp("test_only_averaged")
    make_tree(root / "data", ["apple", "pear"], ["apple"], images_per_class=3)
    (root / "data" / "val" / "pear").mkdir()
    shutil.copy(min((root / "data" / "train" / "pear").iterdir()), root / "data" / "val" / "pear")
    done = run_train("--data-dir", root / "data", "--out-dir", root / "run", *AVERAGED_RUN, cwd=root)
    assert done.returncode == 0, done.stderr
    return root


@pytest.mark.slow
@pytest.mark.parametrize("flags, words", [
    (["--no-blurpool"], ["--no-blurpool contradicts the checkpoint", "trained with --blurpool", "drop it"]),
    (["--ema-decay", 0], ["--ema-decay 0 contradicts the checkpoint", "--ema-decay 0.5", "--raw-weights"]),
    (["--ema-decay", 0.9], ["--ema-decay 0.9 contradicts the checkpoint", "--ema-decay 0.5", "drop it"]),
])
def test_a_model_flag_that_contradicts_the_checkpoint_is_one_line(averaged, flags, words):
    result = run_train("--test-only", "--out-dir", averaged / "run", *flags, cwd=averaged)
    refused(result, *words)


@pytest.mark.slow
def test_an_average_asked_of_a_run_that_kept_none_is_refused(trained):
    result = run_train("--test-only", "--out-dir", trained / "run", "--ema-decay", 0.9, cwd=trained)
    refused(result, "--ema-decay 0.9 contradicts the checkpoint", "kept no average")


def planted(run_dir, name, model_class: int, average_class: int) -> str:
    """A copy of the run's checkpoint whose trained weights answer class `model_class` for every image and
    whose average answers `average_class`: what is evaluated shows in the top-1."""
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    for weights, answer in ((state["model"], model_class), (state["ema"], average_class)):
        weights["fc.weight"].zero_()
        weights["fc.bias"].zero_()
        weights["fc.bias"][answer] = 10.0
    torch.save(state, run_dir / name)
    return name


@pytest.mark.slow
def test_the_run_evaluates_its_average_and_raw_weights_the_trained_weights(averaged):
    run_dir = averaged / "run"
    name = planted(run_dir, "checkpoint-planted.pt", model_class=0, average_class=1)  # apple 3 of 4, pear 1 of 4

    def top1(*flags):
        result = run_train("--test-only", "--out-dir", run_dir, "--checkpoint", name, *flags, cwd=averaged)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().splitlines()[-1].split()[1]
    assert top1() == "0.2500"  # the average: every image a pear
    assert top1("--raw-weights") == "0.7500"  # the trained weights: every image an apple
    # the evaluation's own settings may change: still the run's model and the average
    assert top1("--eval-flip", "--eval-image-size", 40, "--no-channels-last", "--no-zero-init-residual") == "0.2500"


@pytest.mark.slow
def test_a_model_setting_changed_after_the_checkpoint_is_the_checkpoints_not_a_contradiction(averaged, tmp_path):
    """A --resume may change --blurpool (config.yaml then says the new value); a kept checkpoint from before
    is evaluated with its own run's, without a flag to give."""
    shutil.copytree(averaged / "run", tmp_path / "run")
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump({**saved, "blurpool": False}))
    result = run_train("--test-only", "--out-dir", tmp_path / "run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    again = run_train("--test-only", "--out-dir", tmp_path / "run", "--blurpool", cwd=tmp_path)  # the run's own
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[-1] == result.stdout.splitlines()[-1]
    # a flag given that agrees with config.yaml but not with the checkpoint: still a contradiction
    refused(run_train("--test-only", "--out-dir", tmp_path / "run", "--no-blurpool", cwd=tmp_path),
            "--no-blurpool contradicts the checkpoint (its run trained with --blurpool)")


def test_raw_weights_without_test_only_is_one_line_and_writes_nothing(tmp_path):
    result = run_train("--out-dir", "run", "--loader", "synthetic", "--synthetic-images", 16, "--synthetic-val-images", 0,
                       "--arch", "resnet18", "--image-size", 16, "--global-batch-size", 4, "--max-steps", 1,
                       "--raw-weights", cwd=tmp_path)
    refused(result, "--raw-weights", "add --test-only")
    assert not (tmp_path / "run").exists()
