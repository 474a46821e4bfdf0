"""--keep-checkpoints N: beside checkpoint.pt, the checkpoints of the last N epochs and of the best top-1
so far, as files of their own beside the finished checkpoint.pt; counted on across restarts; read by
--test-only --checkpoint and --init-from, and by a resume when checkpoint.pt cannot be."""
import os
import re

import pytest
import torch

from helpers import read_metrics, run_train
from train import checkpoint
from train.cli import parse
from train.config import Config
from train.errors import UsageError
from train.rundir import RunDir
from train.startup import init_weights

# 32 images at global batch 8: 4 steps per epoch; an evaluation after every epoch. Seed 5's evaluations
# on this machine: 0.0469, 0.1250, 0.0469, 0.0625 (asserted below: the test depends on their order)
STEPS = 4
RUN = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 16, "--synthetic-images", 32,
       "--synthetic-val-images", 64, "--synthetic-classes", 10, "--global-batch-size", 8, "--epochs", 4,
       "--eval-every", 1, "--log-every", 4, "--seed", 5]


def kept(run_dir) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if re.fullmatch(r"checkpoint-.*\.pt", p.name))


def first_best(run_dir) -> dict:
    """The evaluation with the highest top-1 in the run's log (the earliest of equals)."""
    evals = [m for m in read_metrics(run_dir) if m["kind"] == "eval"]
    return max(evals, key=lambda m: (m["top1"], -m["step"]))


@pytest.mark.slow
def test_the_last_epochs_and_the_best_are_kept_across_a_restart(tmp_path):
    command = ["--out-dir", "run", *RUN, "--keep-checkpoints", 2]
    first = run_train(*command, "--max-steps", 2 * STEPS, cwd=tmp_path)  # stops at the end of epoch 2
    assert first.returncode == 0, first.stderr
    run = tmp_path / "run"
    assert kept(run) == ["checkpoint-best.pt", "checkpoint-epoch001.pt", "checkpoint-epoch002.pt"]
    again = run_train(*command, cwd=tmp_path)  # the same command: restart is resume
    assert again.returncode == 0 and f"resuming run at step {2 * STEPS}" in again.stdout, again.stderr

    evals = [m for m in read_metrics(run) if m["kind"] == "eval"]
    best = first_best(run)
    # what makes this test mean something: the best came before the restart and the first evaluation
    # after it is lower (a best top-1 forgotten at the restart would take that one)
    assert best["step"] <= 2 * STEPS and evals[2]["top1"] < best["top1"], evals
    assert kept(run) == ["checkpoint-best.pt", "checkpoint-epoch003.pt", "checkpoint-epoch004.pt"]
    assert not [p.name for p in run.iterdir() if p.name.endswith(".tmp")]
    assert checkpoint.peek(run / "checkpoint-best.pt")["step"] == best["step"]
    for epoch in (3, 4):
        saved = checkpoint.peek(run / f"checkpoint-epoch{epoch:03d}.pt")
        assert (saved["step"], saved["epoch"], saved["step_in_epoch"]) == (epoch * STEPS, epoch, 0)
    # a file of its own, with the finished file's bytes
    assert not os.path.samefile(run / "checkpoint-epoch004.pt", run / "checkpoint.pt")
    assert (run / "checkpoint-epoch004.pt").read_bytes() == (run / "checkpoint.pt").read_bytes()

    scored = run_train("--test-only", "--out-dir", "run", "--checkpoint", "checkpoint-best.pt", cwd=tmp_path)
    assert scored.returncode == 0, scored.stderr
    assert float(re.search(r"top-1 (\S+)", scored.stdout).group(1)) == pytest.approx(best["top1"], abs=1e-4)
    missing = run_train("--test-only", "--out-dir", "run", "--checkpoint", "checkpoint-epoch001.pt", cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        "error: --test-checkpoint checkpoint-epoch001.pt is neither a file in run nor a path; run holds checkpoint-best.pt, "
        "checkpoint-epoch003.pt, checkpoint-epoch004.pt, checkpoint.pt"]

    weights, _ = init_weights(Config(arch="resnet18", num_classes=10, init_from=str(run / "checkpoint-epoch003.pt")))
    saved = torch.load(run / "checkpoint-epoch003.pt", weights_only=True)["model"]
    assert weights.keys() == saved.keys() and all(torch.equal(weights[k], saved[k]) for k in saved)


@pytest.mark.slow
def test_copies_a_run_had_no_time_to_make_are_made_when_it_starts_again(tmp_path):
    """A run killed between a checkpoint's write and its copies, or one that turns --keep-checkpoints
    on at a restart, starts with the copies its checkpoint.pt earns."""
    first = run_train("--out-dir", "run", *RUN, "--max-steps", STEPS, cwd=tmp_path)  # no copies
    assert first.returncode == 0, first.stderr
    run = tmp_path / "run"
    assert kept(run) == []
    again = run_train("--out-dir", "run", *RUN, "--max-steps", STEPS + 1, "--keep-checkpoints", 1, cwd=tmp_path)
    assert again.returncode == 0 and f"resuming run at step {STEPS}" in again.stdout, again.stderr
    assert checkpoint.peek(run / "checkpoint-epoch001.pt")["step"] == STEPS  # made at the restart
    assert checkpoint.peek(run / "checkpoint-best.pt")["step"] == first_best(run)["step"]


def test_checkpoint_is_for_test_only():
    with pytest.raises(UsageError, match="^--test-checkpoint checkpoint-best.pt names what --test-only evaluates; to "
                                         "start a run from its weights, give --init-from$"):
        parse(["--checkpoint", "checkpoint-best.pt"])


@pytest.mark.slow
def test_kept_copies_survive_damage_to_checkpoint_pt_and_a_resume_takes_the_newest_intact_one(tmp_path):
    command = ["--out-dir", "run", *RUN, "--keep-checkpoints", 2]
    first = run_train(*command, "--max-steps", 2 * STEPS, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    run = tmp_path / "run"
    copies = {name: (run / name).read_bytes() for name in kept(run)}
    # damage in place, as a copy tool or a `>` redirect does: the same file, new bytes
    with open(run / "checkpoint.pt", "r+b") as latest:
        latest.truncate(1000)
    assert {name: (run / name).read_bytes() for name in kept(run)} == copies
    with open(run / "checkpoint-epoch002.pt", "w") as redirected:  # and the newest epoch copy too
        redirected.write("oops\n")
    assert checkpoint.peek(run / "checkpoint-best.pt")["step"] == 2 * STEPS == first_best(run)["step"]

    again = run_train(*command, cwd=tmp_path)  # the same command: restart is resume, from the best copy
    assert again.returncode == 0, again.stderr
    assert (f"warning: run{os.sep}checkpoint.pt cannot be read (it is truncated or not a torch checkpoint"
            in again.stdout), again.stdout
    assert (f"resuming from checkpoint-best.pt, the newest intact checkpoint of the run (step {2 * STEPS})"
            in again.stdout and f"resuming run at step {2 * STEPS}" in again.stdout), again.stdout
    assert checkpoint.peek(run / "checkpoint.pt")["epoch"] == 4
    assert kept(run) == ["checkpoint-best.pt", "checkpoint-epoch003.pt", "checkpoint-epoch004.pt"]

    for name in ["checkpoint.pt", *kept(run)]:  # nothing intact: checkpoint.pt's refusal, naming the copies
        (run / name).write_bytes(b"x")
    with pytest.raises(UsageError, match=r"^cannot load .*checkpoint.pt: it is truncated.*; the kept copies "
                                         r"checkpoint-best.pt, checkpoint-epoch003.pt, checkpoint-epoch004.pt "
                                         r"cannot be read either$"):
        RunDir(run).to_resume()


def test_a_copy_that_cannot_be_made_is_said_and_the_next_write_goes_on(tmp_path):
    writer = checkpoint.Writer()
    checkpoint.save(tmp_path / "checkpoint.pt", {"model": {}, "step": 4})
    writer.keep_copies(tmp_path, {"step": 4, "epoch": 1, "step_in_epoch": 0, "best_step": 4}, keep=1)
    writer.wait()
    assert writer.copy_failure is None and kept(tmp_path) == ["checkpoint-best.pt", "checkpoint-epoch001.pt"]
    (tmp_path / "checkpoint.pt").unlink()  # nothing to copy from
    writer.keep_copies(tmp_path, {"step": 8, "epoch": 2, "step_in_epoch": 0, "best_step": 4}, keep=1)
    writer.wait()
    assert writer.copy_failure == ("could not keep a copy of checkpoint.pt at step 8 (No such file or directory); "
                                   "checkpoint.pt itself is on disk")
    assert kept(tmp_path) == ["checkpoint-best.pt", "checkpoint-epoch001.pt"]  # nothing half-made
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
