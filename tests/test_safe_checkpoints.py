"""Checkpoints load as plain data only (torch.load weights_only=True): a planted or damaged file is
refused with exit 2 and one line, and nothing in it runs; checkpoints are written in the background,
at most one at a time, and a failed write ends the run with exit 3."""
import errno
import os
import resource
import subprocess
import sys
import time

import pytest
import torch

from helpers import child_env, read_metrics, run_train
from train import checkpoint

TINY = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 16, "--synthetic-images", 64,
        "--synthetic-val-images", 16, "--synthetic-classes", 10, "--global-batch-size", 8, "--epochs", 2,
        "--eval-every", 0, "--log-every", 2]


class RunsCode:
    """Unpickled with full pickle, this would run a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture
def run_dir(tmp_path):
    first = run_train("--out-dir", "run", *TINY, "--max-steps", 3, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    return tmp_path / "run"


def test_everything_the_trainer_saves_loads_as_plain_data(tmp_path):
    """fp16's loss scaler state, the rmsprop-warmup optimizer's state and the config all pass weights_only."""
    result = run_train("--out-dir", "run", *TINY, "--max-steps", 3, "--precision", "fp16", "--optimizer",
                       "rmsprop-warmup", cwd=tmp_path, env={"TRAINER_ALLOW_CPU_FP16": "1"})
    assert result.returncode == 0, result.stderr
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert state["step"] == 3 and state["precision"]["scale"] > 0 and state["config"]["optimizer"] == "rmsprop-warmup"
    assert state["optimizer"]["state"]  # per-parameter buffers are there


def test_a_checkpoint_whose_pickle_would_run_code_is_refused_and_nothing_runs(run_dir, tmp_path):
    marker = tmp_path / "MARKER"
    real = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    torch.save({**real, "step": RunsCode(marker)}, run_dir / "checkpoint.pt")
    planted = tmp_path / "planted.pt"
    torch.save({"conv1.weight": RunsCode(marker)}, planted)
    for command in (["--out-dir", "run", *TINY, "--max-steps", 6],  # restart is resume
                    ["--out-dir", "run", "--resume", "--max-steps", 6],
                    ["--out-dir", "run", "--test-only"],
                    ["--out-dir", "fresh", *TINY, "--max-steps", 1, "--init-from", planted]):
        result = run_train(*command, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        line = one_line(result)
        assert "posix.system" in line and "not plain data" in line and "nothing in it was run" in line, line
        assert ("checkpoint.pt" in line or "planted.pt" in line) and "Traceback" not in result.stderr
        assert not marker.exists()
    assert not (tmp_path / "fresh").exists()  # refused before the run directory was made


@pytest.mark.parametrize("damage", ["truncated", "not a checkpoint"])
def test_a_damaged_checkpoint_is_refused_in_one_line(run_dir, tmp_path, damage):
    path = run_dir / "checkpoint.pt"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] if damage == "truncated" else b"step: 3\n")
    result = run_train("--out-dir", "run", *TINY, "--max-steps", 6, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    line = one_line(result)
    assert line.startswith(f"error: cannot load run{os.sep}checkpoint.pt: it is truncated or not a torch checkpoint")
    assert "restore it from a copy you trust or move it away" in line


def test_the_writer_keeps_one_write_in_flight_and_raises_its_failure(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    checkpoint.save(path, {"step": 1})
    real_save, running, most = torch.save, [0], [0]

    def slow_save(obj, f):
        running[0] += 1
        most[0] = max(most[0], running[0])
        time.sleep(0.2)
        real_save(obj, f)
        running[0] -= 1
    monkeypatch.setattr(torch, "save", slow_save)
    writer = checkpoint.Writer()
    for step in (2, 3, 4):
        writer.start(path, {"step": step}, step, copy_s=0.0)
    writer.wait()
    assert most[0] == 1 and torch.load(path, weights_only=True)["step"] == 4

    def disk_full(obj, f):
        f.write(b"partial bytes")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", disk_full)
    writer.start(path, {"step": 5}, 5, copy_s=0.0)
    with pytest.raises(OSError):
        writer.wait()
    assert writer.failed_step == 5 and torch.load(path, weights_only=True)["step"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_a_failed_background_write_ends_the_run_with_exit_3(tmp_path):
    """A 20 MB file-size limit: the logs fit, ResNet-18's checkpoint does not. The step checkpoint
    written in the background at step 2 fails; the run learns of it by the next checkpoint and stops."""
    limit = 20 << 20
    result = subprocess.run([sys.executable, "-m", "train", *map(str, ["--out-dir", "run", *TINY, "--log-every", 1,
                                                                  "--checkpoint-every-steps", 2, "--max-steps", 7])],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300, env=child_env(),
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert result.returncode == 3, result.stderr
    line = one_line(result)
    assert "could not write" in line and "checkpoint.pt at step 2" in line and "previous checkpoint is kept" in line
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.yaml", "metrics.jsonl", "mllog.txt"]
    steps = [m["step"] for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]
    assert max(steps) == 4  # stopped at the next checkpoint, not at the end
    assert '"status": "aborted"' in (tmp_path / "run" / "mllog.txt").read_text().splitlines()[-1]
