"""What a run says at its end and on a restart is true: the done line counts this segment's steps and
images against this segment's seconds (and the run's total apart), in the singular for one step; a
preempted run without --out-dir names the --out-dir its restart needs; a restart's --batch-size that the
kept global batch overrides is said, not dropped silently; the compute threads are sized against the
ranks on the host and the loader's threads, and --threads sets them."""
import os
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from helpers import child_env, run_train
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
