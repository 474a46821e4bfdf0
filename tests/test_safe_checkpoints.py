"""Checkpoints load as plain data only (torch.load weights_only=True): a planted or damaged file is
refused with exit 2 and one line, and nothing in it runs; checkpoints are written in the background,
at most one at a time, and a failed write ends the run with exit 3."""
import errno
import os
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import child_env, read_metrics, run_train
from train import checkpoint, host_memory

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


@pytest.mark.slow
def test_everything_the_trainer_saves_loads_as_plain_data(tmp_path):
    """fp16's loss scaler state, the rmsprop-warmup optimizer's state and the config all pass weights_only."""
    result = run_train("--out-dir", "run", *TINY, "--max-steps", 3, "--precision", "fp16", "--optimizer",
                       "rmsprop-warmup", cwd=tmp_path, env={"TRAINER_ALLOW_CPU_FP16": "1"})
    assert result.returncode == 0, result.stderr
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert state["step"] == 3 and state["precision"]["scale"] > 0 and state["config"]["optimizer"] == "rmsprop-warmup"
    assert state["optimizer"]["state"]  # per-parameter buffers are there


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_a_state_that_is_no_host_copy_is_written_by_a_thread_one_at_a_time_and_its_failure_raised(tmp_path,
                                                                                                   monkeypatch):
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
    for step in (2, 3, 4):  # (a plain tensor: not in the writer process's shared memory)
        writer.start(path, {"step": step, "w": torch.ones(2)}, step, copy_s=0.0)
    writer.wait()
    assert most[0] == 1 and torch.load(path, weights_only=True)["step"] == 4
    assert writer._process is None  # no writer process was started for these

    def disk_full(obj, f):
        f.write(b"partial bytes")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", disk_full)
    writer.start(path, {"step": 5, "w": torch.ones(2)}, 5, copy_s=0.0)
    with pytest.raises(OSError):
        writer.wait()
    assert writer.failed_step == 5 and torch.load(path, weights_only=True)["step"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_the_writer_process_writes_host_copies_one_at_a_time_with_the_values_at_the_copy(tmp_path):
    """The host memory is reused from one checkpoint to the next, and is not the live weights: training
    going on while the write runs does not reach the file."""
    path = tmp_path / "checkpoint.pt"
    live = {"w": torch.zeros(2_000_000), "n": torch.zeros((), dtype=torch.int64),
            "conv": torch.zeros(8, 4, 3, 3).to(memory_format=torch.channels_last)}
    writer, finished, addresses = checkpoint.Writer(), [], []
    for step in (1, 2, 3, 4, 5):
        if step <= 3:  # as the trainer does: the previous write waited for, then the copy
            writer.wait()
        for tensor in live.values():
            tensor.fill_(step)
        state = host_memory.host_copy({"model": live, "step": step, "groups": [{"lr": 0.1, "params": [0, 1]}]})
        addresses.append(state["model"]["w"].data_ptr())
        writer.start(path, state, step, copy_s=0.0)  # (waits for the previous write itself)
        del state  # (the writer holds it until the write is done)
        if writer.last:
            finished.append(writer.last)  # the previous write
            writer.last = None
        for tensor in live.values():
            tensor.fill_(-1)  # training goes on
    writer.wait()
    finished.append(writer.last)
    assert writer._process is not None and writer._process.alive()  # one long-lived process wrote them
    assert len(set(addresses[:3])) == 1  # the same host memory each time, no fresh allocation
    assert len(set(addresses)) == 2  # (a copy made while a write is in flight takes other memory)
    assert [w["step"] for w in finished] == [1, 2, 3, 4, 5]
    for before, after in zip(finished, finished[1:]):  # never two in flight
        assert after["started"] >= before["started"] + before["write_s"] - 1e-3
    saved = torch.load(path, weights_only=True)
    assert saved["step"] == 5 and saved["groups"] == [{"lr": 0.1, "params": [0, 1]}]
    for key, tensor in saved["model"].items():
        assert tensor.dtype == live[key].dtype and torch.equal(tensor, torch.full_like(live[key], 5)), key
    assert saved["model"]["conv"].stride() == live["conv"].stride()  # channels_last kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def written_once(tmp_path):
    """A writer process that has written checkpoint.pt once: (its path, the writer, the file's bytes)."""
    path = tmp_path / "checkpoint.pt"
    writer = checkpoint.Writer()
    writer.start(path, host_memory.host_copy({"step": 1, "model": {"w": torch.ones(3)}}), 1, copy_s=0.0)
    writer.wait()
    return path, writer, path.read_bytes()


def test_a_failed_write_in_the_writer_process_is_raised_and_keeps_the_previous_file(tmp_path):
    """A file-size limit on the writer process (as a full disk would): OSError with its errno."""
    path, writer, before = written_once(tmp_path)
    resource.prlimit(writer._process.proc.pid, resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    writer.start(path, host_memory.host_copy({"step": 2, "model": {"w": torch.ones(1_000_000)}}), 2, copy_s=0.0)
    with pytest.raises(OSError) as raised:
        writer.wait()
    assert raised.value.errno == errno.EFBIG and writer.failed_step == 2
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]


def test_a_writer_process_that_dies_is_a_failed_write_not_a_hang(tmp_path):
    path, writer, before = written_once(tmp_path)
    # killed in the middle of a write: its temporary file exists
    writer.start(path, host_memory.host_copy({"step": 2, "model": {"w": torch.randn(25_000_000)}}), 2, copy_s=0.0)
    pid = writer._process.proc.pid
    temporary = tmp_path / f".checkpoint.pt.{pid}.tmp"
    deadline = time.time() + 120
    while not temporary.exists() and time.time() < deadline:
        time.sleep(0.001)
    os.kill(pid, signal.SIGSTOP)  # (frozen where it is, then killed)
    assert temporary.exists()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(OSError, match="writer process ended .killed by signal 9. before the write was done"):
        writer.wait()
    assert writer.failed_step == 2
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    # killed while it waits for work: the write it is given next fails, the one after has a new process
    writer.start(path, host_memory.host_copy({"step": 3, "model": {"w": torch.ones(3)}}), 3, copy_s=0.0)
    writer.wait()
    os.kill(writer._process.proc.pid, signal.SIGSTOP)
    writer.start(path, host_memory.host_copy({"step": 4, "model": {"w": torch.ones(3)}}), 4, copy_s=0.0)
    os.kill(writer._process.proc.pid, signal.SIGKILL)
    with pytest.raises(OSError, match="writer process ended"):
        writer.wait()
    assert writer.failed_step == 4 and torch.load(path, weights_only=True)["step"] == 3
    writer.start(path, host_memory.host_copy({"step": 5, "model": {"w": torch.ones(3)}}), 5, copy_s=0.0)
    writer.wait()
    assert torch.load(path, weights_only=True)["step"] == 5 and writer.last["step"] == 5


def test_the_writer_process_ignores_stop_signals_and_ends_with_the_trainer(tmp_path):
    """SIGTERM/SIGINT/SIGUSR1 ask the trainer to checkpoint and stop, so the writer process must outlive
    them; when the trainer's process ends (even by SIGKILL) it ends too, so no write of a dead run lands."""
    script = ("import sys, time; from train import checkpoint, host_memory; writer = checkpoint.Writer(); "
              "writer.start(sys.argv[1], host_memory.host_copy({'step': 1}), 1, 0.0); writer.wait(); "
              "print(writer._process.proc.pid, flush=True); time.sleep(600)")
    trainer = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "checkpoint.pt")], env=child_env(),
                               stdout=subprocess.PIPE, text=True)
    try:
        pid = int(trainer.stdout.readline())
        for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            os.kill(pid, stop)
        time.sleep(0.5)
        assert process_state(pid) not in (None, "Z")
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.time() + 30
    while process_state(pid) not in (None, "Z") and time.time() < deadline:
        time.sleep(0.05)
    assert process_state(pid) in (None, "Z")


def process_state(pid: int):
    """A process's state letter (Z: a zombie), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_a_failed_background_write_ends_the_run_with_exit_3(tmp_path):
    """A 20 MB file-size limit: the logs fit, ResNet-18's checkpoint does not. The step checkpoint
    written in the background at step 2 fails; the run learns of it by the next checkpoint and stops.
    (The limit covers the shared host memory too, so this run copies to private memory and writes in a
    thread; a failed write in the writer process: the tests above.)"""
    limit = 20 << 20
    result = subprocess.run([sys.executable, "-m", "train", *map(str, ["--out-dir", "run", *TINY, "--log-every", 1,
                                                                  "--checkpoint-every-steps", 2, "--max-steps", 7])],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300, env=child_env(),
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert result.returncode == 3, result.stderr
    line = one_line(result)
    assert "could not write" in line and "checkpoint.pt at step 2" in line and "no checkpoint was written yet" in line
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.yaml", "metrics.jsonl", "mllog.txt",
                                                                    "tensorboard"]
    steps = [m["step"] for m in read_metrics(tmp_path / "run") if m["kind"] == "train"]
    assert max(steps) == 4  # stopped at the next checkpoint, not at the end
    assert '"status": "aborted"' in (tmp_path / "run" / "mllog.txt").read_text().splitlines()[-1]
