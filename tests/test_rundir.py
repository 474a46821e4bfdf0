"""The run directory (train/rundir.py): what a start does with each state of its --out-dir, config.yaml
read once per start, the flags read without torch, and saved settings under renamed keys."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers import REPO
from train import cli, rundir
from train.config import Config, to_dict
from train.errors import RunFinished, UsageError
from train.rundir import RunDir

TINY = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", "16", "--synthetic-images", "16",
        "--synthetic-val-images", "8", "--synthetic-classes", "4", "--epochs", "1", "--workers", "0",
        "--no-tensorboard"]


def saved_run(folder: Path, checkpoint: dict | None = None, **settings) -> Path:
    """A run directory holding a config.yaml of these settings, and a checkpoint with these entries."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(settings))
    if checkpoint is not None:
        torch.save({"model": {}, "step": 0, "epoch": 0, "step_in_epoch": 0, **checkpoint}, folder / "checkpoint.pt")
    return folder


def test_a_missing_or_empty_folder_is_a_new_run(tmp_path):
    assert rundir.decide(str(tmp_path / "none"), resume=False, test_only=False).kind == "new"
    assert rundir.decide(str(tmp_path), resume=False, test_only=False).kind == "new"
    assert rundir.decide("", resume=False, test_only=False).kind == "new"  # (a time-stamped folder, made later)


def test_a_config_without_a_checkpoint_is_a_restart_from_step_0_with_its_line(tmp_path):
    run = saved_run(tmp_path / "run", seed=0)
    start = rundir.decide(str(run), resume=False, test_only=False)
    assert (start.kind, start.restarted, start.from_checkpoint) == ("restart", True, False)
    assert start.reason == (f"{run} holds no checkpoint of its run yet: starting it again from step 0 (its logs "
                            "kept as *.lost)")


def test_a_config_with_a_checkpoint_is_a_restart_that_continues(tmp_path):
    run = saved_run(tmp_path / "run", {"step": 3}, seed=0)
    start = rundir.decide(str(run), resume=False, test_only=False)
    assert (start.kind, start.restarted, start.from_checkpoint) == ("restart", True, True)


def test_resume_without_a_checkpoint_is_refused(tmp_path):
    run = saved_run(tmp_path / "run", seed=0)
    cfg, start = cli.read_command([*TINY, "--resume", "--out-dir", str(run)])
    assert (start.kind, cfg.resume) == ("resume", True)
    with pytest.raises(UsageError, match=f"^{run} holds no checkpoint.pt to resume from; check --out-dir or drop --resume$"):
        start.run_dir.check(cfg, start)


def test_a_finished_run_is_said_finished(tmp_path):
    run = saved_run(tmp_path / "run", {"step": 16, "epoch": 2, "finished": "epochs"}, seed=0)
    with pytest.raises(RunFinished, match=rf"^{run} holds a finished run \(all 2 epochs done at step 16\); nothing to do, "
                                          "its files are unchanged$"):
        RunDir(run).check_continuable(Config(out_dir=str(run), epochs=2, resume=True))
    RunDir(run).check_continuable(Config(out_dir=str(run), epochs=3, resume=True))  # more epochs: steps left


def test_logs_without_their_config_are_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "mllog.txt").write_text("")
    start = rundir.decide(str(run), resume=False, test_only=False)
    assert start.kind == "new"  # (no config.yaml: not a run this command can continue)
    with pytest.raises(UsageError, match="already holds a run without the checkpoint.pt and config.yaml to continue it"):
        RunDir(run).check(Config(out_dir=str(run)), start)


def test_test_only_evaluates(tmp_path):
    run = saved_run(tmp_path / "run", {"step": 3}, seed=0, arch="resnet18")
    cfg, start = cli.read_command(["--test-only", "--out-dir", str(run)])
    assert (start.kind, start.from_checkpoint, cfg.resume, cfg.arch) == ("evaluate", False, False, "resnet18")


def test_a_restarts_batch_facts_are_the_starts_not_the_settings(tmp_path):
    run = saved_run(tmp_path / "run", global_batch_size=32, batch_size=8, accumulation_steps=4)
    cfg, start = cli.read_command(["--out-dir", str(run), "--batch-size", "4"])
    assert (start.saved_batch, start.command_batch) == ((8, 4), (4, 0))
    assert (cfg.batch_size, cfg.global_batch_size) == (0, 32)  # (the run's global batch; the per-rank one at start-up)
    assert not {"saved_batch", "command_batch", "restarted"} & set(vars(cfg))


def test_config_yaml_is_read_once_per_start(tmp_path, monkeypatch):
    from train.startup import prepare
    command = [*TINY, "--batch-size", "8", "--out-dir", str(tmp_path / "run")]
    first = prepare(*cli.read_command(command))  # the run's first start writes its config.yaml
    first.lock.release()
    first.loader.close()
    reads = []
    read_text = Path.read_text

    def counted(path, *args, **kwargs):
        if path.name == "config.yaml":
            reads.append(path)
        return read_text(path, *args, **kwargs)
    monkeypatch.setattr(Path, "read_text", counted)
    cfg, start = cli.read_command(command)  # the same command again: a restart of its run
    again = prepare(cfg, start)
    again.lock.release()
    again.loader.close()
    assert start.restarted and len(reads) == 1, reads


def test_the_flags_of_a_restart_are_read_without_torch(tmp_path):
    run = saved_run(tmp_path / "run", {"step": 3}, seed=0, global_batch_size=8)
    probe = ("import sys; from train import cli; cfg, start = cli.read_command(['--out-dir', sys.argv[1]]); "
             "print(start.kind, start.from_checkpoint, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe, str(run)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["restart", "True", "False"]


def test_saved_settings_under_an_old_key_are_read_under_the_new_one(tmp_path, monkeypatch):
    monkeypatch.setitem(rundir.RENAMED, "init_seed", "seed")
    run = saved_run(tmp_path / "run", {"step": 3, "config": {"init_seed": 5}}, init_seed=5)
    assert RunDir(run).saved_settings() == {"seed": 5}
    cfg, start = cli.read_command(["--resume", "--out-dir", str(run)])
    assert (start.kind, cfg.seed) == ("resume", 5)
    assert rundir.current_keys({"init_seed": 5, "arch": "resnet18"}) == {"seed": 5, "arch": "resnet18"}


@pytest.mark.parametrize("spelling", ["run", "run/", "./run"])
def test_a_config_made_by_parse_decides_as_the_command_line_does(tmp_path, monkeypatch, spelling):
    """run(cfg) and prepare(cfg) without the command line's Start (an API caller of cli.parse) restart
    the run they find as `python -m train` does: a restart (its same-run check), the saved per-rank batch
    and accumulation steps kept, the line naming the folder however --out-dir spells it."""
    monkeypatch.chdir(tmp_path)
    saved_run(tmp_path / "run", checkpoint={}, **{**yaml.safe_load(yaml.safe_dump(to_dict(cli.parse(TINY)))),
                                                 "global_batch_size": 32, "batch_size": 8, "accumulation_steps": 4})
    argv = [*TINY, "--out-dir", spelling]
    cfg, start = cli.read_command(argv)
    made = rundir.start_of(cli.parse(argv))
    assert (start.kind, start.from_checkpoint, start.saved_batch) == ("restart", True, (8, 4))
    assert (made.kind, made.from_checkpoint, made.saved_batch, made.reason) == \
        (start.kind, start.from_checkpoint, start.saved_batch, start.reason)
    assert start.reason.startswith("run holds its run's config.yaml and a checkpoint")
    assert not cfg.resume  # (the user's --resume: a restart is not one)
