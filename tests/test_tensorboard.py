"""--tensorboard: the train, epoch and eval records of metrics.jsonl as TensorBoard scalars, read back
with TensorBoard's own reader; a run killed after its last checkpoint and started again continues the
same curves at the right steps, each step once, with the resumed segment's values."""
import signal
import subprocess
import sys
import time

import pytest

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import child_env, read_metrics, run_train
from train import checkpoint

# 128 synthetic images at global batch 8: 16 steps an epoch
RUN = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 16, "--synthetic-images", 128,
       "--synthetic-val-images", 16, "--synthetic-classes", 10, "--global-batch-size", 8, "--epochs", 3,
       "--eval-every", 1, "--log-every", 2, "--precision", "fp32"]


def curves(run_dir) -> dict[str, dict[int, float]]:
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def expected(run_dir) -> dict[str, dict[int, float]]:
    """From metrics.jsonl: per kind and field, the value at each step, a later record of a step (the resumed
    segment's) replacing an earlier one (the killed segment's, logged after its last checkpoint)."""
    found: dict[str, dict[int, float]] = {}
    fields = {"train": ("img_per_s", "loss", "lr"), "epoch": ("img_per_s", "loss", "lr"), "eval": ("top1", "top5")}
    for record in read_metrics(run_dir):
        for name in fields.get(record["kind"], ()):
            found.setdefault(f"{record['kind']}/{name}", {})[record["step"]] = record[name]
    return found


@pytest.mark.slow
def test_a_runs_records_are_tensorboard_scalars_and_a_resumed_run_continues_its_curves(tmp_path):
    command = ["--out-dir", "run", *RUN, "--checkpoint-every-steps", 10]
    run_dir = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "train", *map(str, command)], cwd=tmp_path, env=child_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:  # killed once it has logged steps after its checkpoint at step 10, which the restart trains again
        deadline = time.time() + 300
        while first.poll() is None and time.time() < deadline:
            logged = [m["step"] for m in read_metrics(run_dir)] if (run_dir / "metrics.jsonl").exists() else []
            if (run_dir / "checkpoint.pt").exists() and max(logged, default=0) >= 14:
                break
            time.sleep(0.02)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    resumed_from = checkpoint.peek(run_dir / "checkpoint.pt")["step"]
    before = curves(run_dir)
    assert max(before["train/loss"]) > resumed_from  # the killed segment logged past its checkpoint

    again = run_train(*command, cwd=tmp_path)
    assert again.returncode == 0 and f"resuming run at step {resumed_from}" in again.stdout, again.stderr
    got, want = curves(run_dir), expected(run_dir)
    assert set(got) == set(want) and {"train/loss", "train/lr", "train/img_per_s", "eval/top1", "eval/top5"} <= set(got)
    for tag in want:  # every step once, at its place, with the value the run logged last for it
        assert sorted(got[tag]) == sorted(want[tag]), tag
        for step, value in want[tag].items():
            assert abs(got[tag][step] - value) <= 1e-6 * max(1.0, abs(value)), (tag, step)
    assert sorted(got["train/loss"]) == list(range(2, 49, 2)) and sorted(got["eval/top1"]) == [16, 32, 48]


def test_no_tensorboard_writes_none(tmp_path):
    done = run_train("--out-dir", "run", *RUN, "--max-steps", 2, "--no-tensorboard", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "run" / "tensorboard").exists() and (tmp_path / "run" / "metrics.jsonl").exists()
