"""What a run says at its end and on a restart is true: the done line counts this segment's steps and
images against this segment's seconds (and the run's total apart), in the singular for one step; a
preempted run without --out-dir names the --out-dir its restart needs; a restart's --batch-size and
--accumulation-steps that the kept global batch overrides are said, not dropped silently, and a restart
on fewer ranks that keeps the per-rank batch by accumulating more batches per step says so; the compute
threads are sized against the ranks on the host and the loader's threads, and --threads sets them."""
import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from helpers import child_env, launch, run_train
from train.startup import compute_threads

# 128 synthetic images at global batch 8: 16 steps an epoch
RUN = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 16, "--synthetic-images", 128,
       "--synthetic-val-images", 16, "--synthetic-classes", 10, "--global-batch-size", 8, "--epochs", 2,
       "--eval-every", 0, "--log-every", 4]


def done_line(result) -> str:
    return next(line for line in result.stdout.splitlines() if line.startswith("done: "))


@pytest.mark.slow
def test_the_done_line_counts_this_segment_and_says_one_step(tmp_path):
    first = run_train("--out-dir", "run", *RUN, "--max-steps", 1, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert re.match(r"done: 1 step, 8 images in [\d.]+ s; run directory run$", done_line(first)), first.stdout  # no eval: no top-1
    second = run_train("--out-dir", "run", *RUN, "--max-steps", 5, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    line = done_line(second)
    assert re.match(r"done: step 5 \(4 steps, 32 images in [\d.]+ s since the resume at step 1; 40 images in all\)", line), line


@pytest.mark.slow
def test_a_refusal_prints_auto_chosen_values_as_a_user_would_type_them(tmp_path):
    first = run_train("--out-dir", "run", *RUN, "--epochs", 3, "--warmup-epochs", 3, "--max-steps", 1, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    # a warmup as long as the run is cut to 40% of it (0.4 x 3 epochs in binary: 1.2000000000000002)
    longer = run_train("--out-dir", "run", *RUN, "--epochs", 6, "--warmup-epochs", 3, "--max-steps", 2, cwd=tmp_path)
    assert longer.returncode == 2, longer.stderr
    assert longer.stderr.startswith("error: run holds a run with other settings (warmup_epochs 1.2 there, 3 here)"), \
        longer.stderr


@pytest.mark.slow
def test_a_restarts_batch_size_that_the_run_overrides_is_said(tmp_path):
    first = run_train("--out-dir", "run", *RUN, "--max-steps", 1, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    command = [arg for arg in RUN if arg not in ("--global-batch-size", 8)]
    again = run_train("--out-dir", "run", *command, "--batch-size", 16, "--max-steps", 2, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "warning: --batch-size 16 not taken: run holds a run of global batch 8" in again.stdout, again.stdout
    assert "1 rank(s) x batch 8 = global batch 8" in again.stdout
    same = run_train("--out-dir", "run", *command, "--batch-size", 8, "--max-steps", 3, cwd=tmp_path)
    assert same.returncode == 0 and "not taken" not in same.stdout, same.stdout  # the run's own: nothing to say
    # the restart's own split of the kept global batch: both not taken, the run's 8 per rank in one step kept
    split = run_train("--out-dir", "run", *command, "--batch-size", 4, "--accumulation-steps", 2, "--max-steps", 4,
                      cwd=tmp_path)
    assert split.returncode == 0, split.stderr
    assert ("warning: --batch-size 4 and --accumulation-steps 2 not taken: run holds a run of global batch 8, kept on "
            "1 rank(s) as 8 per rank; change it with --resume --global-batch-size") in split.stdout, split.stdout
    assert "1 rank(s) x batch 8 = global batch 8" in split.stdout and "accumulated" not in split.stdout


@pytest.mark.multiprocess
def test_a_run_restarted_on_fewer_ranks_keeps_its_per_rank_batch_and_says_so(tmp_path):
    """2 ranks x batch 4 (global batch 8), the same command again on one rank: the per-rank batch kept,
    2 batches accumulated per step, said in one line; the restart's own --batch-size and
    --accumulation-steps are not taken, and said."""
    command = [arg for arg in RUN if arg not in ("--global-batch-size", 8)]  # (the per-rank batch given, as a user would)
    first = launch("torch", 2, "-m", "train", "--out-dir", "run", *command, "--batch-size", 4, "--max-steps", 1,
                   "--threads", 1, cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "2 rank(s) x batch 4 = global batch 8" in first.stdout, first.stdout
    again = run_train("--out-dir", "run", *command, "--batch-size", 4, "--max-steps", 2, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert ("global batch 8 kept on 1 rank(s) as 4 per rank x 2 accumulated (was 2 rank(s) x 1 accumulated): the same "
            "run, the per-rank batch unchanged") in again.stdout.splitlines(), again.stdout
    assert "1 rank(s) x batch 4 x 2 accumulated = global batch 8" in again.stdout and "not taken" not in again.stdout
    other = run_train("--out-dir", "run", *command, "--batch-size", 8, "--accumulation-steps", 1, "--max-steps", 3,
                      cwd=tmp_path)
    assert other.returncode == 0, other.stderr
    assert ("warning: --batch-size 8 and --accumulation-steps 1 not taken: run holds a run of global batch 8, kept on "
            "1 rank(s) as 4 per rank x 2 accumulated; change it with --resume --global-batch-size") in other.stdout, \
        other.stdout
    assert "1 rank(s) x batch 4 x 2 accumulated = global batch 8" in other.stdout


@pytest.mark.slow
def test_a_preempted_run_without_out_dir_names_the_out_dir_to_restart_with(tmp_path):
    job = subprocess.Popen([sys.executable, "-m", "train", *map(str, RUN), "--epochs", "50"], cwd=tmp_path,
                           env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and job.poll() is None:  # training: a train record logged
            if any('"train"' in p.read_text() for p in tmp_path.glob("runs/*/metrics.jsonl")):
                break
            time.sleep(0.05)
        job.send_signal(signal.SIGTERM)
        out, err = job.communicate(timeout=300)
    finally:
        job.kill()
    run_dir = next(tmp_path.glob("runs/*"))
    assert job.returncode == 75, err
    assert f"start the same command with --out-dir runs/{run_dir.name} again to continue" in err, err
    step = int(re.search(r"preempted at step (\d+)", err).group(1))
    again = run_train(*RUN, "--epochs", 50, "--out-dir", f"runs/{run_dir.name}", "--max-steps", step + 1, cwd=tmp_path)
    assert again.returncode == 0 and "resuming" in again.stdout, again.stderr


def settings(**changes):
    return SimpleNamespace(**{"threads": 0, "workers": 4, "loader": "torch", **changes})


def test_compute_threads_share_the_cores_with_the_ranks_and_a_gpu_runs_loader():
    cores = len(os.sched_getaffinity(0))
    assert compute_threads(settings(threads=3), 1, False, env={}) == 3  # --threads wins
    assert compute_threads(settings(), 1, False, env={"OMP_NUM_THREADS": "2"}) == 2  # then the variable
    assert compute_threads(settings(), 1, False, env={}) == cores  # a CPU run's loader threads mostly idle
    assert compute_threads(settings(), cores, False, env={}) == 1  # a rank a core
    assert compute_threads(settings(workers=1), 1, True, env={}) == max(1, cores - 1)  # a GPU run's loader is busy
    assert compute_threads(settings(workers=1, loader="synthetic"), 1, True, env={}) == cores  # nothing to decode
    assert compute_threads(settings(workers=cores), 1, True, env={}) == 1  # never below one


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--threads", 3], []])
def test_the_header_says_the_threads_and_threads_sets_them(tmp_path, flags):
    env = {"OMP_NUM_THREADS": ""}  # unset for the child: the trainer's own rule decides
    threads = 3 if flags else len(os.sched_getaffinity(0))
    done = run_train("--out-dir", "run", *RUN, "--loader", "torch", "--max-steps", 1, *flags, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert f"on cpu, {threads} thread{'s' if threads > 1 else ''} |" in done.stdout, done.stdout


def header_of(**settings) -> str:
    """The header line of a one-rank CPU run on synthetic data with these settings (start-up's notes
    among them: lr, batch, crops)."""
    import torch
    from train.config import Config
    from train.precision import Precision
    from train.runlog import run_header
    notes = {"lr": settings.pop("lr_note", ""), "batch": "", "crops": settings.pop("crops_note", "")}
    cfg = Config(**{"loader": "synthetic", "batch_size": 8, "global_batch_size": 8, "lr": 4.0, "warmup_epochs": 2.0,
                    "image_size": 32, **settings})
    setup = SimpleNamespace(engine=SimpleNamespace(device=torch.device("cpu"), hosts=None, world_size=1),
                            loader=SimpleNamespace(num_classes=10, train_images=100, val_images=20), notes=notes,
                            data_dir="", start=None)
    return run_header(setup, cfg, Precision("fp32", torch.device("cpu")), "run")[0]


def test_a_plain_runs_header_names_its_schedule_and_crops_and_no_more():
    parts = header_of().split(" | ")
    assert parts[0].startswith("training resnet50 on synthetic data: ")
    assert parts[2:4] == ["lars lr 4, warmup 2 epochs, then poly decay (power 2) to 0.0001", "crops 32 px"]


@pytest.mark.parametrize("settings, part, said", [
    ({"blurpool": True}, 0, "training resnet50 + BlurPool on synthetic data: 10 classes, 100 train / 20 val images"),
    ({"blurpool": True, "ema_decay": 0.9999}, 0,
     "training resnet50 + BlurPool + weight average (decay 0.9999) on synthetic data: 10 classes, 100 train / 20 val images"),
    ({"lr_schedule": "cosine", "lr_note": "lr from global batch 8"}, 2,
     "lars lr 4, warmup 2 epochs (lr from global batch 8), then cosine to 0"),
    ({"optimizer": "sgd", "lr_schedule": "linear"}, 2, "sgd lr 4, warmup 2 epochs, then linear to 0"),
    ({"lr_schedule": "multistep", "lr_decay_epochs": "3,6"}, 2, "lars lr 4, warmup 2 epochs, then multistep x0.1 after epochs 3,6"),
    ({"lr_decay_power": 1.5, "end_lr": 0.01}, 2, "lars lr 4, warmup 2 epochs, then poly decay (power 1.5) to 0.01"),
    ({"eval_image_size": 40}, 3, "crops 32 px, eval at 40 px"),
    ({"eval_flip": True}, 3, "crops 32 px, eval with flips"),
    ({"eval_image_size": 32, "eval_flip": True}, 3, "crops 32 px, eval with flips"),  # (its own size: plain)
    ({"resolution_schedule": "24:32:4:7:8", "eval_flip": True}, 3,
     "crops 24 to 32 px (ramp 24:32:4:7:8), eval at 32 px with flips"),
    ({"resolution_schedule": "160:192:65:76", "crops_note": "the ramp lies past the run's end"}, 3,
     "crops 160 to 192 px (ramp 160:192:65:76; the ramp lies past the run's end), eval at 32 px"),
    ({"crops_note": "a note on the crops"}, 3, "crops 32 px (a note on the crops)"),
])
def test_the_header_names_the_model_lr_schedule_crops_and_evaluation(settings, part, said):
    parts = header_of(**settings).split(" | ")
    assert len(parts) == 7 and parts[part] == said, parts


@pytest.mark.slow
def test_a_runs_header_says_its_methods_and_a_presets_lr_kept_for_another_batch(tmp_path):
    """The smoke preset's lr 4 is for global batch 64; a warmup longer than the run is cut."""
    done = run_train("--out-dir", "run", *RUN, "--max-steps", 1, "--blurpool", "--ema-decay", 0.5, "--lr-schedule",
                     "cosine", "--eval-flip", "--eval-image-size", 24, "--warmup-epochs", 3, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    parts = done.stdout.splitlines()[0].split(" | ")
    assert parts[0].startswith("training resnet18 + BlurPool + weight average (decay 0.5) on synthetic data:"), parts
    assert parts[2] == ("lars lr 4, warmup 0.8 epochs (the preset's lr 4 is for global batch 64, not 8; give --lr or "
                        "--lr-per-256 to change it; warmup cut from 3 to 0.8 epochs: a warmup longer than the 2-epoch "
                        "run leaves no decay), then cosine to 0"), parts
    assert parts[3] == "crops 16 px, eval at 24 px with flips", parts


def test_a_presets_lr_kept_for_another_global_batch_is_noted():
    from train.cli import parse

    def lr_part(*flags):  # (the header of the command's settings, at the global batch they give)
        cfg = parse(["--preset", "ffcv-rn50-16ep", "--data-dir", "/data", *flags])
        settings = {name: getattr(cfg, name) for name in ("preset", "optimizer", "lr", "lr_schedule", "preset_lr_batch")}
        return header_of(**settings, global_batch_size=cfg.global_batch_size or 8).split(" | ")[2]
    assert lr_part("--global-batch-size", "64") == ("sgd lr 1.7, warmup 2 epochs (the preset's lr 1.7 is for global batch "
                                                    "1024, not 64; give --lr or --lr-per-256 to change it), then linear to 0")
    assert "the preset's lr 1.7 is for global batch 1024, not 8" in lr_part("--batch-size", "8")  # (8 on one rank)
    assert lr_part() == "sgd lr 1.7, warmup 2 epochs, then linear to 0"  # the preset's own batch
    assert "preset" not in lr_part("--global-batch-size", "64", "--lr", "0.1")  # another --lr: the user's own
    assert "preset" not in lr_part("--global-batch-size", "64", "--lr", "1.7")  # the same value, given: the user's own
    assert "preset" not in lr_part("--global-batch-size", "64", "--lr-per-256", "0.425")  # follows the batch


def test_a_warmup_cut_to_fit_the_run_says_what_happened_in_order():
    from train.config import Config
    from train.rules import lr_and_warmup
    assert lr_and_warmup(Config(epochs=2, warmup_epochs=2, lr=1), 64)[1:] == (
        0.8, "warmup cut from 2 to 0.8 epochs: a warmup as long as the 2-epoch run leaves no decay")
    assert lr_and_warmup(Config(epochs=1, warmup_epochs=5, lr=1), 64)[2] == \
        "warmup cut from 5 to 0.4 epochs: a warmup longer than the 1-epoch run leaves no decay"
