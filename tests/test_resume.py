"""An interrupted run, resumed, ends with bit-identical weights to an uninterrupted one (CPU)."""
import time

import pytest
import torch
import yaml

from helpers import files_of, launch, read_metrics, run_train

RUN = ["--arch", "resnet18", "--epochs", 2, "--workers", 2, "--log-every", 4]


def weights(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=False)


@pytest.mark.slow
def test_resume_mid_epoch_is_bit_identical(tmp_path):
    whole = run_train("--out-dir", "whole", *RUN, cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    # stop in the middle of epoch 2 (15 steps per epoch), then continue with no step limit
    first = run_train("--out-dir", "parts", *RUN, "--max-steps", 20, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert weights(tmp_path / "parts")["step"] == 20
    second = run_train("--out-dir", "parts", "--resume", "--max-steps", 0, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "resuming" in second.stdout
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "parts")
    assert a["step"] == b["step"] == 30
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for key, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][key]["momentum_buffer"])


@pytest.mark.slow
def test_fp16_loss_scaler_state_resumes(tmp_path):
    """fp16 with loss scaling on CPU (allowed for tests): the scaler's state travels in the checkpoint,
    so a run interrupted after an overflow halved the scale ends where an uninterrupted one does."""
    args = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 16, "--synthetic-images", 32,
            "--synthetic-classes", 10, "--global-batch-size", 8, "--epochs", 2, "--eval-every", 0, "--precision", "fp16",
            "--log-every", 1]
    env = {"TRAINER_ALLOW_CPU_FP16": "1"}
    whole = run_train("--out-dir", "whole", *args, cwd=tmp_path, env=env)
    assert whole.returncode == 0, whole.stderr
    scales = {m["step"]: m["loss_scale"] for m in read_metrics(tmp_path / "whole") if m["kind"] == "train"}
    halved = min(step for step, scale in scales.items() if scale < 65536)  # the scaler's default start
    assert halved < 8, scales
    first = run_train("--out-dir", "parts", *args, "--max-steps", halved, cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stderr
    second = run_train("--out-dir", "parts", "--resume", "--max-steps", 0, cwd=tmp_path, env=env)
    assert second.returncode == 0, second.stderr
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "parts")
    assert a["step"] == b["step"] == 8 and a["precision"] == b["precision"]
    assert scales == {m["step"]: m["loss_scale"] for m in read_metrics(tmp_path / "parts") if m["kind"] == "train"}
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key


SHORT = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 16, "--synthetic-images", 64,
         "--synthetic-val-images", 16, "--synthetic-classes", 10, "--global-batch-size", 8, "--epochs", 2,
         "--log-every", 2]


@pytest.mark.slow
def test_a_finished_run_started_again_says_so_and_changes_nothing(tmp_path):
    done = run_train("--out-dir", "run", *SHORT, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    before = files_of(tmp_path / "run")
    for again in (["--out-dir", "run", "--resume"], ["--out-dir", "run", *SHORT]):  # --resume, and the same command
        result = run_train(*again, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "run holds a finished run (all 2 epochs done at step 16); nothing to do, " \
                                        "its files are unchanged"
        assert files_of(tmp_path / "run") == before
    longer = run_train("--out-dir", "run", "--resume", "--epochs", 3, cwd=tmp_path)  # more epochs: more to do
    assert longer.returncode == 0 and "resuming run at step 16" in longer.stdout, longer.stderr


@pytest.mark.slow
def test_a_run_stopped_by_max_steps_resumed_with_the_same_limit_changes_nothing(tmp_path):
    first = run_train("--out-dir", "run", *SHORT, "--max-steps", 5, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = files_of(tmp_path / "run")
    again = run_train("--out-dir", "run", "--resume", cwd=tmp_path)
    assert again.returncode == 0 and "at step 5, --max-steps 5" in again.stdout, again.stderr
    assert files_of(tmp_path / "run") == before


@pytest.mark.slow
def test_a_resumed_run_marks_its_segment_and_keeps_seconds_running(tmp_path):
    first = run_train("--out-dir", "run", *SHORT, "--max-steps", 8, "--eval-every", 0, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    time.sleep(1.5)  # the run is down for a while
    second = run_train("--out-dir", "run", "--resume", "--max-steps", 0, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    records = read_metrics(tmp_path / "run")
    resumes = [i for i, r in enumerate(records) if r["kind"] == "resume"]
    assert len(resumes) == 1
    resume, before = records[resumes[0]], records[resumes[0] - 1]
    assert resume["step"] == 8 and resume["seconds"] == before["seconds"]
    assert resume["gap_s"] >= 1.5 and resume["gap_s"] == pytest.approx(resume["time"] - before["time"], abs=0.01)
    seconds = [r["seconds"] for r in records]
    assert seconds == sorted(seconds)  # training time never runs backwards
    steps = [(r["kind"], r["step"]) for r in records]
    assert len(steps) == len(set(steps))  # no step logged twice


@pytest.mark.slow
def test_the_class_count_is_recorded_checked_on_resume_and_may_be_absent_in_older_runs(tmp_path):
    first = run_train("--out-dir", "run", *SHORT, "--max-steps", 5, "--eval-every", 0, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    config = tmp_path / "run" / "config.yaml"
    assert yaml.safe_load(config.read_text())["num_classes"] == 10
    other = run_train("--out-dir", "run", "--resume", "--max-steps", 0, "--synthetic-classes", 12, cwd=tmp_path)
    assert other.returncode == 2 and other.stderr.strip() == \
        "error: the synthetic data has 12 classes, the run 10; check --data-dir (or --num-classes)", other.stderr
    older = {k: v for k, v in yaml.safe_load(config.read_text()).items() if k != "num_classes"}
    config.write_text(yaml.safe_dump(older, sort_keys=False))  # as written before the count was recorded
    resumed = run_train("--out-dir", "run", "--resume", "--max-steps", 0, cwd=tmp_path)
    assert resumed.returncode == 0 and "resuming run at step 5" in resumed.stdout, resumed.stderr
    assert yaml.safe_load(config.read_text())["num_classes"] == 10


def each_position_once(count: int) -> dict:
    """The ledger of an epoch whose positions 0 .. count-1 were each trained once."""
    return {"count": count, "sum": count * (count - 1) // 2, "sum_sq": sum(p * p for p in range(count))}


@pytest.mark.multiprocess
def test_a_run_continued_on_another_rank_count_keeps_its_global_batch_and_trains_each_image_once(tmp_path):
    """3 ranks, then 2 (what an elastic launcher does after losing a node), then 1: the run's global
    batch is kept, whatever --batch-size says; the per-rank batch follows where the rank count does not
    divide the global batch by it (3 -> 2) and is kept, with accumulation, where it does (2 -> 1); every epoch's positions are trained
    exactly once over the segments; the training clock goes on from where the last segment stopped."""
    command = ["-m", "train", "--out-dir", "run", "--loader", "synthetic", "--arch", "resnet18", "--image-size", 16,
               "--synthetic-images", 96, "--synthetic-val-images", 12, "--synthetic-classes", 10, "--batch-size", 8,
               "--epochs", 2, "--eval-every", 0]  # global batch 3 x 8 = 24: 4 steps per epoch
    first = launch("torch", 3, *command, "--max-steps", 2, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    second = launch("torch", 2, *command, "--max-steps", 6, cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "2 rank(s) x batch 12 = global batch 24" in second.stdout
    third = launch("none", 1, *command, cwd=tmp_path)
    assert third.returncode == 0, third.stderr[-3000:]
    # (1 x 12 divides 24: the per-rank batch the run has now is kept, two batches accumulated per step)
    assert "1 rank(s) x batch 12 x 2 accumulated = global batch 24" in third.stdout
    records = read_metrics(tmp_path / "run")
    epochs = [r for r in records if r["kind"] == "epoch" and r["epoch"] in (1.0, 2.0)]
    assert [r["step"] for r in epochs] == [4, 8]
    assert all(r["samples"] == each_position_once(96) for r in epochs), epochs
    resumes = [r for r in records if r["kind"] == "resume"]
    assert [r["step"] for r in resumes] == [2, 6]
    before = [r for r in records[:records.index(resumes[0])] if "seconds" in r]
    assert resumes[0]["seconds"] == before[-1]["seconds"] > 0  # (the last record before, replicas, has none)
    too_many = launch("torch", 5, *command, cwd=tmp_path)  # 24 does not divide over 5 ranks
    assert too_many.returncode != 0 and "does not divide over 5 ranks" in too_many.stderr


@pytest.mark.multiprocess
def test_a_horovod_run_resumes_with_its_optimizer_state(tmp_path):
    """Horovod's optimizer wraps the run's own: the resumed run's momentum must reach the optimizer that
    steps (2 ranks: the averaged gradients are exact, so the runs agree bit for bit)."""
    command = ["-m", "train", "--loader", "synthetic", "--arch", "resnet18", "--image-size", 16, "--synthetic-images", 64,
               "--synthetic-val-images", 8, "--synthetic-classes", 10, "--batch-size", 8, "--epochs", 1,
               "--eval-every", 0, "--optimizer", "sgd", "--lr", 0.05]  # 4 steps
    whole = launch("horovod", 2, *command, "--out-dir", "whole", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = launch("horovod", 2, *command, "--out-dir", "parts", "--max-steps", 2, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    second = launch("horovod", 2, *command, "--out-dir", "parts", cwd=tmp_path)
    assert second.returncode == 0 and "resuming parts at step 2" in second.stdout, second.stderr[-3000:]
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "parts")
    assert a["step"] == b["step"] == 4
    for key in a["model"]:
        if "running" not in key:  # (BN running averages are averaged over the ranks at each checkpoint)
            assert torch.equal(a["model"][key], b["model"][key]), key


@pytest.mark.slow
def test_a_run_lost_before_its_first_checkpoint_starts_again_when_restarted(tmp_path):
    """A restart (the same command) finding config.yaml and logs but no checkpoint starts the run again
    from step 0 with fresh logs, instead of refusing the folder."""
    import signal
    import subprocess
    import sys
    from helpers import child_env, wait_until
    command = ["-m", "train", "--out-dir", "run", "--loader", "synthetic", "--arch", "resnet18", "--image-size", "16",
               "--synthetic-images", "256", "--synthetic-val-images", "8", "--synthetic-classes", "10",
               "--batch-size", "8", "--epochs", "1", "--eval-every", "0", "--log-every", "1"]  # 32 steps, one epoch
    proc = subprocess.Popen([sys.executable, *command], cwd=tmp_path, env=child_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and '"train"' in metrics.read_text(), 120, "a logged step", alive=[proc])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (tmp_path / "run" / "checkpoint.pt").exists()
    again = subprocess.run([sys.executable, *command], cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr
    assert "holds no checkpoint of its run yet: starting it again from step 0" in again.stdout
    assert (tmp_path / "run" / "metrics.jsonl.lost").exists()  # the lost attempt's log, moved aside
    steps = [r["step"] for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    assert steps == list(range(1, 33))  # the lost attempt's records are gone, not doubled


@pytest.mark.slow
def test_a_resume_says_its_crop_size_against_the_checkpoints(tmp_path):
    """Crops of 16 px in epochs 1 and 2, 24 px (the --image-size) in epoch 3; 4 steps an epoch. A resume
    into epoch 3 after epoch 2 says the size changed from the checkpoint's 16 px, though it is
    --image-size's; a resume in the middle of epoch 3 names the size it goes on with."""
    command = ["--out-dir", "run", "--loader", "synthetic", "--arch", "resnet18", "--image-size", 24,
               "--resolution-schedule", "16:24:1:2:8", "--synthetic-images", 32, "--synthetic-val-images", 8,
               "--synthetic-classes", 10, "--global-batch-size", 8, "--epochs", 3, "--eval-every", 0]

    def crop_lines(max_steps):
        done = run_train(*command, "--max-steps", max_steps, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        return [line for line in done.stdout.splitlines() if "training crops" in line]
    assert crop_lines(8) == ["epoch 1: training crops of 16 px"]  # (epoch 2: the same size, nothing to say)
    assert crop_lines(10) == ["epoch 3: training crops of 24 px (16 px before the resume)"]
    assert crop_lines(0) == ["epoch 3: training crops of 24 px"]
