"""Bad input: one line naming the problem, exit code 2, and no run directory left behind."""
import shutil
import subprocess

import pytest
import torch

from helpers import run_train
from data.embedded import ensure_embedded
from train.cli import parse

TINY = ["--arch", "resnet18", "--image-size", 32, "--workers", 0]


def expect_usage_error(tmp_path, *args, match, fresh=False):
    result = run_train("--out-dir", "run", *args, cwd=tmp_path, fresh=fresh)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], result.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()
    return lines[0]


def make_tree(root, train_classes, val_classes, images_per_class=2):
    source = ensure_embedded() / "train" / "blue_blobs"
    picks = sorted(source.iterdir())[:images_per_class]
    for split, classes in (("train", train_classes), ("val", val_classes)):
        for cls in classes:
            (root / split / cls).mkdir(parents=True)
            for f in picks:
                shutil.copy(f, root / split / cls / f.name)
    return root


def test_missing_data_dir(tmp_path):
    expect_usage_error(tmp_path, "--data-dir", tmp_path / "nowhere", match="does not exist")


def test_empty_data_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    expect_usage_error(tmp_path, "--data-dir", tmp_path / "empty", match="no train/ folder")


@pytest.mark.slow
def test_data_dir_without_images(tmp_path):
    for split in ("train", "val"):
        (tmp_path / "d" / split / "cat").mkdir(parents=True)
        (tmp_path / "d" / split / "cat" / "notes.txt").write_text("no image here")
    expect_usage_error(tmp_path, "--data-dir", tmp_path / "d", *TINY, match="holds no images")


@pytest.mark.slow
def test_train_val_class_mismatch(tmp_path):
    tree = make_tree(tmp_path / "d", ["cat", "dog"], ["cat", "fox"])
    expect_usage_error(tmp_path, "--data-dir", tree, *TINY, match="train and val classes differ")


def test_unknown_arch(tmp_path):  # in a new interpreter, as a user's command line starts
    expect_usage_error(tmp_path, "--arch", "resnet51", match="unknown --arch 'resnet51'", fresh=True)


def test_unknown_preset(tmp_path):
    expect_usage_error(tmp_path, "--preset", "mlperf-bs1", match="unknown preset 'mlperf-bs1'")


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--batch-size", "--global-batch-size"])
def test_non_positive_batch_size(tmp_path, flag):
    expect_usage_error(tmp_path, "--batch-size", 0, match="--batch-size must be positive")
    expect_usage_error(tmp_path, flag, -4, match="must be positive")


@pytest.mark.slow
@pytest.mark.parametrize("content, match", [
    ("arch: [resnet50\n", "cannot be read as YAML"),
    ("- just\n- a list\n", "must be a mapping"),
    ("arch: resnet50\nlearning_rate: 3\n", "unknown setting 'learning_rate'"),
    ("batch_size: lots\n", "batch_size must be int"),
])
def test_malformed_preset_file(tmp_path, content, match):
    preset = tmp_path / "bad.yaml"
    preset.write_text(content)
    expect_usage_error(tmp_path, "--preset", preset, match=match)


def test_fp16_on_cpu_is_refused(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU, where fp16 is valid")
    expect_usage_error(tmp_path, "--precision", "fp16", match="fp16 needs a CUDA GPU")


def test_bf16_on_cpu_refuses_crops_where_torchs_convolution_gradient_is_broken(tmp_path):
    """At 16 px a ResNet's layer4 convolves a 1x1 input with stride 2, whose bf16 weight gradient
    torch's CPU kernel leaves partly unwritten (runs went NaN at random); a ramp starting there too."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU, where bf16 is not refused")
    synthetic = ["--loader", "synthetic", "--arch", "resnet18", "--max-steps", 1]
    expect_usage_error(tmp_path, *synthetic, "--precision", "bf16", "--image-size", 16, match="bf16 on a CPU cannot train 16 px")
    expect_usage_error(tmp_path, *synthetic, "--precision", "bf16", "--image-size", 32, "--resolution-schedule", "16:32:0:2:16",
                       match="cannot train 16 px")


def test_global_batch_larger_than_the_dataset(tmp_path):
    tree = make_tree(tmp_path / "d", ["cat", "dog"], ["cat", "dog"])
    expect_usage_error(tmp_path, "--data-dir", tree, *TINY, "--batch-size", 64, match="fewer than one global batch")


@pytest.mark.slow
def test_resume_without_a_run(tmp_path):
    expect_usage_error(tmp_path, "--resume", match="no config.yaml for --resume")


@pytest.mark.slow
def test_existing_run_is_not_overwritten(tmp_path):
    first = run_train("--out-dir", "run", *TINY, "--max-steps", 1, "--eval-every", 0, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = (tmp_path / "run" / "checkpoint.pt").read_bytes()
    # the same command would continue the run (tests/test_restart.py); another run's settings are refused
    again = run_train("--out-dir", "run", *TINY, "--max-steps", 2, "--seed", 1, cwd=tmp_path)
    assert again.returncode == 2 and "holds a run with other settings (seed 0 there, 1 here)" in again.stderr
    assert (tmp_path / "run" / "checkpoint.pt").read_bytes() == before


@pytest.mark.slow
def test_diverging_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    good = run_train("--out-dir", "run", *TINY, "--max-steps", 15, "--epochs", 3, cwd=tmp_path)
    assert good.returncode == 0, good.stderr
    before = (tmp_path / "run" / "checkpoint.pt").read_bytes()
    bad = run_train("--out-dir", "run", "--resume", "--max-steps", 0, "--lr", 1e30, "--max-bad-steps", 3,
                    "--log-every", 1, cwd=tmp_path)
    assert bad.returncode == 3, bad.stderr
    message = bad.stderr.strip().splitlines()
    assert len(message) == 1 and "loss was not finite" in message[0], message
    assert "the last good checkpoint (step 15) is kept" in message[0]
    assert (tmp_path / "run" / "checkpoint.pt").read_bytes() == before
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())
    assert '"status": "aborted"' in (tmp_path / "run" / "mllog.txt").read_text().splitlines()[-1]


def test_a_run_diverging_before_its_first_checkpoint_says_there_is_none(tmp_path):
    bad = run_train("--out-dir", "run", *TINY, "--lr", 1e30, "--max-bad-steps", 2, "--log-every", 1, cwd=tmp_path)
    message = bad.stderr.strip().splitlines()
    assert bad.returncode == 3 and len(message) == 1, bad.stderr
    assert "no checkpoint was written yet" in message[0] and "kept" not in message[0]
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_one_process_refuses_a_bn_span_it_does_not_have(tmp_path):
    expect_usage_error(tmp_path, "--bn-span", 2, *TINY, match="--bn-span 2 does not divide the 1 rank(s)")


def test_an_unknown_flag_is_one_line(tmp_path):
    expect_usage_error(tmp_path, "--learning-rate", 3, match="unrecognized arguments: --learning-rate")


@pytest.mark.slow
def test_test_only_without_a_run(tmp_path):
    expect_usage_error(tmp_path, "--test-only", match="no config.yaml for --test-only")


@pytest.fixture
def read_only_folder(tmp_path):
    """A read-only filesystem (a tmpfs mounted ro; the tests run as root, whom file modes do not stop)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True)
    assert mounted.returncode == 0, mounted.stderr
    yield folder
    subprocess.run(["umount", str(folder)])


@pytest.mark.slow
@pytest.mark.parametrize("where", ["file_parent", "read_only_parent", "read_only_folder"])
def test_an_out_dir_that_cannot_be_written_is_one_line(tmp_path, read_only_folder, where):
    (tmp_path / "afile").write_text("not a folder")
    out_dir = {"file_parent": tmp_path / "afile" / "run", "read_only_parent": read_only_folder / "a" / "run",
               "read_only_folder": read_only_folder}[where]
    result = run_train("--out-dir", out_dir, *TINY, "--max-steps", 1, cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: cannot write the run directory {out_dir}"), lines[0]
    assert (tmp_path / "afile").read_text() == "not a folder" and list(read_only_folder.iterdir()) == []


@pytest.mark.slow
def test_an_out_dir_whose_parents_are_made_leaves_none_behind_on_failure(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "c").write_text("a file where a folder is needed")
    result = run_train("--out-dir", tmp_path / "a" / "new" / "deeper" / "run", *TINY, "--max-steps", 1, cwd=tmp_path)
    assert result.returncode == 0, result.stderr  # a fresh path of new folders is made as a whole
    bad = run_train("--out-dir", tmp_path / "a" / "b" / "c" / "x" / "run", *TINY, "--max-steps", 1, cwd=tmp_path)
    assert bad.returncode == 2 and "cannot write the run directory" in bad.stderr
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b", "new"]


def test_numbers_in_exponent_form_are_accepted_in_presets(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("weight_decay: 5e-5\nlr: 1e1\n")  # YAML 1.1 reads these as strings
    cfg = parse(["--preset", str(preset)])
    assert cfg.weight_decay == 5e-5 and cfg.lr == 10.0
    preset.write_text("weight_decay: lots\n")
    expect_usage_error(tmp_path, "--preset", preset, match="weight_decay must be float, got 'lots'")


SYNTHETIC = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 16, "--synthetic-images", 32,
             "--synthetic-classes", 10, "--global-batch-size", 8]


@pytest.mark.slow
@pytest.mark.parametrize("flags, match", [
    (["--batch-schedule", "1:64"], "global batch 64 is more than the 32 training images"),
    (["--batch-schedule", "1:x"], "--batch-schedule '1:x': '1:x' is not NUMBER:NUMBER"),
    (["--batch-schedule", "2:16,1:32"], "epochs must be positive and increasing"),
    (["--bn-group-size", 3], "--bn-group-size 3 does not divide the per-rank batch 8"),
    (["--lr-schedule", "phases", "--lr-phases", "10"], "--lr-phases '10': '10' is not NUMBER:NUMBER"),
    (["--lr-schedule", "multistep", "--lr-decay-epochs", "30,x"], "is not a list of epochs"),
    (["--optimizer", "sgd", "--nesterov", "--momentum", 0], "--nesterov needs a positive --momentum"),
    (["--division", "closed", "--batch-schedule", "1:16"], "not allowed in the MLPerf closed division"),
    (["--target-accuracy", 75.9], "--target-accuracy 75.9 is a percentage; give the fraction 0.759"),
])
def test_bad_recipe_settings(tmp_path, flags, match):
    expect_usage_error(tmp_path, *SYNTHETIC, *flags, match=match)
