"""End-to-end runs of the real CLI on the embedded dataset, a few steps each."""
import re
import resource
import shutil
import subprocess
import sys

import pytest
import torch
import torchvision
import yaml

from helpers import child_env, compliance, read_metrics, run_train
from data.embedded import ensure_embedded
from train.cli import parse, preset_names

FEW_STEPS = ["--max-steps", 3, "--workers", 1]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("short")
    result = run_train("--out-dir", "run", *FEW_STEPS, "--log-every", 1, cwd=cwd)
    assert result.returncode == 0, result.stderr
    return cwd, cwd / "run", result


@pytest.mark.slow
def test_short_run_writes_a_complete_run_directory(short_run):
    cwd, run_dir, result = short_run
    assert {p.name for p in run_dir.iterdir()} >= {"mllog.txt", "metrics.jsonl", "checkpoint.pt", "config.yaml"}
    assert re.search(r"epoch\s+1/16 .* img/s", result.stdout) and "top-1" in result.stdout
    metrics = read_metrics(run_dir)
    train = [m for m in metrics if m["kind"] == "train"]
    assert [m["step"] for m in train] == [1, 2, 3]
    assert all(m["img_per_s"] > 0 and m["images"] == 64 * m["step"] for m in train)
    evals = [m for m in metrics if m["kind"] == "eval"]
    assert len(evals) == 1 and evals[0]["eval_images"] == 300 and 0 <= evals[0]["top1"] <= evals[0]["top5"] <= 1
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["arch"] == "resnet50" and config["max_steps"] == 3 and config["preset"] == "smoke"


def test_checkpoint_holds_a_torchvision_loadable_model(short_run):
    _, run_dir, _ = short_run
    state = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert state["step"] == 3 and state["epoch"] == 0 and state["step_in_epoch"] == 3
    assert state["config"]["global_batch_size"] == 64 and "optimizer" in state
    model = torchvision.models.resnet50(num_classes=10)
    model.load_state_dict(state["model"])  # strict: key-for-key the torchvision model


def test_short_run_log_passes_the_real_compliance_checker(short_run):
    cwd, run_dir, _ = short_run
    result = compliance(run_dir / "mllog.txt", cwd)
    assert result.returncode == 0 and "SUCCESS" in result.stdout + result.stderr, result.stdout + result.stderr
    keys = {k for k in re.findall(r'"key": "(\w+)"', (run_dir / "mllog.txt").read_text())}
    assert {"lars_opt_base_learning_rate", "lars_epsilon", "model_bn_span", "global_batch_size", "train_samples",
            "eval_samples", "block_start", "block_stop", "eval_accuracy", "run_stop"} <= keys


@pytest.mark.slow
def test_closed_division_fails_only_on_the_accuracy_target(tmp_path):
    result = run_train("--out-dir", "run", *FEW_STEPS, "--division", "closed", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    checked = compliance(tmp_path / "run" / "mllog.txt", tmp_path)
    output = checked.stdout + checked.stderr
    assert checked.returncode != 0 and "FAILED" in output
    problems = [line for line in output.splitlines() if re.match(r"(WARNING|ERROR) ", line) and "FAILED" not in line]
    assert problems and all("eval_accuracy" in line and "0.7590" in line for line in problems), problems


def test_synthetic_loader_trains_a_few_steps(tmp_path):
    result = run_train("--out-dir", "run", "--loader", "synthetic", "--arch", "resnet18", "--image-size", 32,
                       "--batch-size", 8, "--global-batch-size", 0, "--synthetic-images", 64, "--synthetic-val-images", 20,
                       "--synthetic-classes", 10, "--max-steps", 3, "--log-every", 1, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    evals = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "eval"]
    assert evals[-1]["eval_images"] == 20


@pytest.mark.slow
def test_own_imagenet_layout_tree_with_flags(tmp_path):
    source = ensure_embedded()
    tree = tmp_path / "mydata"
    for split, keep in (("train", 8), ("val", 3)):
        for cls in ("blue_blobs", "red_hstripes", "yellow_checker"):
            (tree / split / cls).mkdir(parents=True)
            for f in sorted((source / split / cls).iterdir())[:keep]:
                shutil.copy(f, tree / split / cls / f.name.replace(".JPEG", ".jpg"))
    result = run_train("--data-dir", tree, "--out-dir", "run", "--arch", "resnet18", "--image-size", 32,
                       "--batch-size", 4, "--epochs", 2, "--eval-every", 1, "--workers", 0, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["preset"] == "" and config["batch_size"] == 4
    evals = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "eval"]
    assert [e["epoch"] for e in evals] == [1, 2] and all(e["eval_images"] == 9 for e in evals)
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert state["model"]["fc.weight"].shape == (3, 512) and state["step"] == 2 * (24 // 4)


# The MLPerf reference convergence points (docs/learning_rate.md): global batch -> base LR, warmup epochs, wd, momentum.
MLPERF_POINTS = {3264: (10.5, 2, 5e-5, 0.9), 8192: (17, 5, 2e-4, 0.9), 32768: (21.2, 16, 2.5e-5, 0.94),
                 65536: (24.699, 31, 1e-4, 0.951807)}


@pytest.mark.parametrize("batch", sorted(MLPERF_POINTS))
def test_mlperf_presets_carry_the_reference_hyperparameters(batch):
    cfg = parse(["--preset", f"mlperf-bs{batch}", "--data-dir", "/imagenet"])
    lr, warmup, wd, momentum = MLPERF_POINTS[batch]
    assert (cfg.global_batch_size, cfg.lr, cfg.warmup_epochs, cfg.weight_decay, cfg.momentum) == (batch, lr, warmup, wd, momentum)
    assert (cfg.optimizer, cfg.end_lr, cfg.lr_decay_power, cfg.lars_epsilon, cfg.label_smoothing) == ("lars", 1e-4, 2, 0, 0.1)
    assert cfg.image_size == 224 and cfg.eval_every == 4 and cfg.target_accuracy == 0.759 and cfg.division == "closed"


def test_flags_override_the_preset_and_no_flags_mean_smoke():
    assert parse([]).preset == "smoke" and parse([]).image_size == 32
    cfg = parse(["--preset", "mlperf-bs3264", "--lr", "3.0", "--no-channels-last"])
    assert cfg.lr == 3.0 and cfg.channels_last is False and cfg.global_batch_size == 3264
    assert set(preset_names()) >= {"smoke", "mlperf-bs3264", "mlperf-bs8192", "mlperf-bs32768", "mlperf-bs65536"}


def test_lr_per_256_scales_with_the_global_batch(tmp_path):
    result = run_train("--out-dir", "run", "--loader", "synthetic", "--arch", "resnet18", "--image-size", 32,
                       "--global-batch-size", 16, "--lr-per-256", 0.1, "--synthetic-images", 32,
                       "--synthetic-classes", 10, "--max-steps", 1, "--eval-every", 0, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    base_lr = re.search(r'"key": "lars_opt_base_learning_rate", "value": ([0-9.e-]+)', (tmp_path / "run" / "mllog.txt").read_text())
    assert float(base_lr.group(1)) == pytest.approx(0.1 * 16 / 256)


@pytest.mark.slow
def test_bf16_on_cpu_computes_in_bf16(tmp_path):
    args = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 32, "--global-batch-size", 8,
            "--synthetic-images", 32, "--synthetic-classes", 10, "--max-steps", 3, "--log-every", 1, "--eval-every", 0]
    runs = {}
    for precision in ("fp32", "bf16"):
        result = run_train("--out-dir", precision, *args, "--precision", precision, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        runs[precision] = [m["loss"] for m in read_metrics(tmp_path / precision) if m["kind"] == "train"]
    assert len(runs["bf16"]) == 3 and all(0 < loss < 20 for loss in runs["bf16"])
    # the same batches and weights: bf16's 8-bit mantissa shows in the loss, but only as rounding
    assert runs["bf16"] != runs["fp32"]
    assert runs["bf16"] == pytest.approx(runs["fp32"], rel=0.05)
    assert '"value": "bf16"' in (tmp_path / "bf16" / "mllog.txt").read_text()


@pytest.mark.slow
def test_logged_lr_follows_warmup_and_polynomial_decay(tmp_path):
    """10 steps per epoch, 1 warmup epoch, 3 epochs, peak 2.0, end 1e-4, power 2; values by hand."""
    result = run_train("--out-dir", "run", "--loader", "synthetic", "--arch", "resnet18", "--image-size", 16,
                       "--global-batch-size", 4, "--synthetic-images", 40, "--synthetic-classes", 10, "--epochs", 3,
                       "--lr", 2.0, "--warmup-epochs", 1, "--log-every", 1, "--eval-every", 0, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lr = {m["step"]: m["lr"] for m in read_metrics(tmp_path / "run") if m["kind"] == "train"}
    expected = {1: 0.2, 5: 1.0, 10: 2.0, 11: 1e-4 + (2.0 - 1e-4) * (19 / 20) ** 2, 20: 1e-4 + (2.0 - 1e-4) * 0.25,
                30: 1e-4}
    assert {step: lr[step] for step in expected} == pytest.approx(expected, rel=1e-12)


def test_a_warmup_longer_than_the_run_is_cut_and_said(tmp_path):
    result = run_train("--out-dir", "run", "--loader", "synthetic", "--arch", "resnet18", "--image-size", 16,
                       "--global-batch-size", 4, "--synthetic-images", 40, "--synthetic-classes", 10, "--epochs", 1,
                       "--warmup-epochs", 5, "--lr", 2.0, "--log-every", 1, "--eval-every", 0, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "warmup 0.4 epochs (warmup cut from 5 to 0.4 epochs: a warmup longer than the 1-epoch run leaves no decay)" \
        in result.stdout
    lr = {m["step"]: m["lr"] for m in read_metrics(tmp_path / "run") if m["kind"] == "train"}
    assert lr[4] == pytest.approx(2.0) and lr[10] == pytest.approx(1e-4)  # peak after 4 steps, the end LR at the end


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--eval-every", 4, "--epochs", 5], ["--optimizer", "sgd", "--max-steps", 3]])
def test_mlperf_schedules_and_sgd_pass_the_compliance_checker(tmp_path, extra):
    result = run_train("--out-dir", "run", "--arch", "resnet18", "--workers", 1, *extra, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    checked = compliance(tmp_path / "run" / "mllog.txt", tmp_path)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout + checked.stderr, checked.stdout + checked.stderr
    log = (tmp_path / "run" / "mllog.txt").read_text()
    if "sgd" in extra:
        assert '"key": "opt_name", "value": "sgd"' in log and "sgd_opt_base_learning_rate" in log
    else:
        evals = re.findall(r'"key": "eval_accuracy".*"epoch_num": (\d+)', log)
        assert evals == ["4", "5"]  # every 4 epochs, and at the end


def test_a_checkpoint_that_cannot_be_written_ends_the_run_with_exit_3(tmp_path):
    """A file-size limit of 20 MB: the logs fit, ResNet-18's 45 MB checkpoint does not (EFBIG, as a
    full disk would give ENOSPC)."""
    limit = 20 << 20
    result = subprocess.run([sys.executable, "-m", "train", "--out-dir", "run", "--arch", "resnet18", "--max-steps", "2",
                             "--workers", "1", "--eval-every", "0"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600, env=child_env(),
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert result.returncode == 3, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "could not write" in lines[0] and "checkpoint.pt" in lines[0]
    assert not (tmp_path / "run" / "checkpoint.pt").exists()
    assert [p for p in (tmp_path / "run").iterdir() if p.name.endswith(".tmp")] == []
    assert '"status": "aborted"' in (tmp_path / "run" / "mllog.txt").read_text().splitlines()[-1]


@pytest.mark.slow
def test_target_accuracy_stops_the_run_early(tmp_path):
    result = run_train("--out-dir", "run", "--arch", "resnet18", "--target-accuracy", 0.3, "--workers", 1, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    evals = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "eval"]
    assert evals[-1]["top1"] >= 0.3 and all(e["top1"] < 0.3 for e in evals[:-1])
    assert evals[-1]["epoch"] < 16  # stopped before the scheduled 16 epochs
    assert '"status": "success"' in (tmp_path / "run" / "mllog.txt").read_text().splitlines()[-1]
    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["step"] == evals[-1]["step"]
