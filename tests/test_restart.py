"""Restart is resume: the same command started again continues its run from the latest checkpoint
(step and time checkpoints included, bit-exactly on CPU), finds its run directory from the launcher's
job id, refuses a folder holding a differently defined run; and --init-from starts a new run from
other weights."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torchvision

from helpers import child_env, files_of, launch, read_metrics, run_train
from train import checkpoint

# 128 images at global batch 8: 16 steps per epoch
RUN = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 16, "--synthetic-images", 128,
       "--synthetic-val-images", 16, "--synthetic-classes", 10, "--global-batch-size", 8, "--epochs", 2,
       "--eval-every", 0, "--log-every", 4]


def weights(run_dir):
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)


def assert_same_training(a, b):
    assert a["step"] == b["step"]
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for key, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], b["optimizer"]["state"][key]["momentum_buffer"]), key


@pytest.mark.slow
def test_a_killed_run_started_again_continues_from_its_step_checkpoint_bit_exactly(tmp_path):
    command = ["--out-dir", "run", *RUN, "--checkpoint-every-steps", 5]
    whole = run_train("--out-dir", "whole", *RUN, cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    # SIGKILL (no handler runs) once a mid-epoch step checkpoint is on disk
    proc = subprocess.Popen([sys.executable, "-m", "train", *map(str, command)], cwd=tmp_path, env=child_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    saved = tmp_path / "run" / "checkpoint.pt"
    deadline = time.time() + 120
    while not saved.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    killed_at = checkpoint.peek(saved)
    assert killed_at["step"] % 5 == 0 and killed_at["step_in_epoch"] > 0 and not killed_at["finished"]

    again = run_train(*command, cwd=tmp_path)  # the same command, no --resume
    assert again.returncode == 0, again.stderr
    assert f"resuming run at step {killed_at['step']}" in again.stdout
    assert_same_training(weights(tmp_path / "whole"), weights(tmp_path / "run"))
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.endswith(".tmp")]  # the killed write's leftovers
    written = [m["step"] for m in read_metrics(tmp_path / "run") if m["kind"] == "checkpoint"]
    assert {15, 16, 20, 25, 30, 32} <= set(written)  # every 5 steps, and at the epoch ends (16 steps each)


@pytest.mark.multiprocess
def test_checkpoints_every_few_minutes_agree_over_two_ranks_and_resume_bit_exactly(tmp_path):
    """Rank 0's clock decides, at the ranks' agreement points (every --stop-check-every steps); a run
    stopped there and started again ends where an uninterrupted one does."""
    command = ["-m", "train", "--out-dir", "run", *RUN, "--checkpoint-every-minutes", 0.001, "--stop-check-every", 3]
    first = launch("torch", 2, *command, "--max-steps", 20, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    written = [m["step"] for m in read_metrics(tmp_path / "run") if m["kind"] == "checkpoint"]
    timed = [step for step in written if step not in (16, 20)]  # (16: epoch 1's end; 20: the last step)
    assert len(timed) >= 3 and all(step % 3 == 0 for step in timed) and written[-1] == 20, written
    second = launch("torch", 2, *command, cwd=tmp_path)  # no --max-steps: the rest of the run
    assert second.returncode == 0 and "resuming run at step 20" in second.stdout, second.stderr[-3000:]
    whole = launch("torch", 2, "-m", "train", "--out-dir", "whole", *RUN, cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr[-3000:]
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "run")
    for key in a["model"]:
        if "running" not in key:  # BN running averages are averaged over the ranks at each checkpoint
            assert torch.equal(a["model"][key], b["model"][key]), key


@pytest.mark.multiprocess
def test_rank_0s_clock_alone_decides_the_minute_checkpoints(tmp_path):
    """Rank 1's clock runs a thousand times slow, so by its own clock no checkpoint is ever due: the
    ranks must still checkpoint together when rank 0's says so (each rank deciding alone would have
    rank 0 in the checkpoint's collectives while rank 1 trains on)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, time\n"
        "if os.environ.get('RANK') == '1':\n"
        "    _real, _start = time.time, time.time()\n"
        "    time.time = lambda: _start + (_real() - _start) / 1000\n")
    env = {"PYTHONPATH": os.pathsep.join([str(hook), child_env()["PYTHONPATH"]])}
    result = launch("torch", 2, "-m", "train", "--out-dir", "run", *RUN, "--checkpoint-every-minutes", 0.001,
                    "--stop-check-every", 3, "--max-steps", 10, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    written = [m["step"] for m in read_metrics(tmp_path / "run") if m["kind"] == "checkpoint"]
    assert {3, 6, 9} <= set(written), written


@pytest.mark.slow
def test_a_folder_holding_another_run_is_refused_naming_the_settings(tmp_path):
    first = run_train("--out-dir", "run", *RUN, "--max-steps", 3, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = files_of(tmp_path / "run")
    other = run_train("--out-dir", "run", *RUN, "--max-steps", 6, "--seed", 1, "--arch", "resnet34", cwd=tmp_path)
    assert other.returncode == 2, other.stderr
    lines = other.stderr.strip().splitlines()
    assert lines == ["error: run holds a run with other settings (arch 'resnet18' there, 'resnet34' here; seed 0 "
                     "there, 1 here); start it with its own settings to continue it, --resume to change them on purpose, or "
                     "choose another --out-dir"]
    assert files_of(tmp_path / "run") == before
    # run-length, logging and checkpoint settings may change
    longer = run_train("--out-dir", "run", *RUN, "--max-steps", 6, "--log-every", 1, "--checkpoint-every-steps", 4,
                       "--workers", 1, cwd=tmp_path)
    assert longer.returncode == 0 and "resuming run at step 3" in longer.stdout, longer.stderr
    assert weights(tmp_path / "run")["step"] == 6


@pytest.mark.slow
def test_a_folder_holding_a_runs_logs_but_no_checkpoint_is_refused_not_restarted(tmp_path):
    """A folder holding a run's logs (metrics.jsonl, mllog.txt) but neither its checkpoint.pt nor its
    config.yaml has nothing to continue from and no record of what run it was: a start there is
    refused and leaves the files as they were, instead of training over them."""
    first = run_train("--out-dir", "run", *RUN, "--max-steps", 2, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    for name in ("checkpoint.pt", "config.yaml"):
        (tmp_path / "run" / name).unlink()
    before = files_of(tmp_path / "run")
    assert {"mllog.txt", "metrics.jsonl"} <= set(before)
    for flags in ([], ["--resume"]):
        again = run_train("--out-dir", "run", *RUN, "--max-steps", 4, *flags, cwd=tmp_path)
        assert again.returncode == 2, again.stderr
        assert len(again.stderr.strip().splitlines()) == 1 and "resuming" not in again.stdout, again.stderr
        assert ("already holds a run without the checkpoint.pt and config.yaml" if not flags
                else "holds no config.yaml for --resume") in again.stderr
        assert files_of(tmp_path / "run") == before


def test_the_run_directory_is_judged_as_it_is_at_the_check_not_when_the_flags_were_read(tmp_path):
    """Under Horovod Elastic every worker checks the folder itself: a worker that read its flags before
    rank 0 made the run (config.yaml first, then the logs) must not take rank 0's new files for another
    run's; the same files without config.yaml are another run's."""
    from train.config import Config
    from train.errors import UsageError
    from train.rundir import RunDir
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    cfg = Config(out_dir=str(run))  # restarted False: no config.yaml when the flags were read
    with pytest.raises(UsageError, match="already holds a run without"):
        RunDir(run).check_continuable(cfg)
    (run / "config.yaml").write_text("seed: 0\n")
    RunDir(run).check_continuable(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("variable, value, folder", [("SLURM_JOB_ID", "4242", "smoke-slurm-4242"),
                                                     ("TORCHELASTIC_RUN_ID", "job7", "smoke-torchrun-job7")])
def test_without_out_dir_the_run_directory_comes_from_the_job_and_a_restart_finds_it(tmp_path, variable, value,
                                                                                      folder):
    env = {variable: value}
    first = run_train(*RUN, "--max-steps", 3, cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stderr
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [folder]
    again = run_train(*RUN, "--max-steps", 5, cwd=tmp_path, env=env)
    assert again.returncode == 0 and f"resuming runs{os.sep}{folder} at step 3" in again.stdout, again.stderr
    assert weights(tmp_path / "runs" / folder)["step"] == 5


@pytest.mark.slow
def test_without_a_job_id_each_start_is_a_new_timestamped_run(tmp_path):
    env = {"SLURM_JOB_ID": "", "TORCHELASTIC_RUN_ID": "none"}
    first = run_train(*RUN, "--max-steps", 1, cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stderr
    time.sleep(1.1)  # the folder's name has the time to the second
    again = run_train(*RUN, "--max-steps", 1, cwd=tmp_path, env=env)
    assert again.returncode == 0 and "resuming" not in again.stdout, again.stderr
    assert len(list((tmp_path / "runs").iterdir())) == 2


def fc_free_run(tmp_path, name, *flags):
    """A one-step run whose weights barely move (plain SGD, a tiny LR), to see where it started."""
    result = run_train("--out-dir", name, *RUN, "--max-steps", 1, "--optimizer", "sgd", "--lr", 1e-12, "--momentum", 0,
                       "--weight-decay", 0, *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    return result, weights(tmp_path / name)["model"]


@pytest.mark.slow
def test_init_from_another_runs_checkpoint_or_a_torchvision_state_dict(tmp_path):
    source = run_train("--out-dir", "source", *RUN, "--max-steps", 4, "--seed", 3, cwd=tmp_path)
    assert source.returncode == 0, source.stderr
    trained = weights(tmp_path / "source")["model"]
    torchvision_file = tmp_path / "resnet18.pth"
    torch.manual_seed(5)
    torch.save(torchvision.models.resnet18(num_classes=10).state_dict(), torchvision_file)
    from_torchvision = torch.load(torchvision_file, weights_only=True)
    _, fresh = fc_free_run(tmp_path, "fresh")
    for name, start in (("from-run", trained), ("from-torchvision", from_torchvision)):
        result, model = fc_free_run(tmp_path, name, "--init-from", tmp_path / ("source/checkpoint.pt" if name == "from-run"
                                                                             else "resnet18.pth"))
        assert "starting from the weights in" in result.stdout
        assert torch.allclose(model["conv1.weight"], start["conv1.weight"], atol=1e-6)
        assert torch.allclose(model["fc.weight"], start["fc.weight"], atol=1e-6)
        assert not torch.allclose(model["conv1.weight"], fresh["conv1.weight"], atol=1e-3)
        assert weights(tmp_path / name)["step"] == 1  # a new run: its own steps from 0
