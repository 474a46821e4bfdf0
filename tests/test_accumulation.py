"""Gradient accumulation end to end, under the real launchers on CPU/gloo: one process accumulating 4
batches, 4 torchrun ranks of one batch and 2 horovodrun ranks accumulating 2 are the same run; a run
killed on 4 ranks and restarted by the same command on 2 keeps its batch, accumulates the difference
and ends where the uninterrupted run ends; an accumulating run's MLPerf log passes the real compliance
checker; --show-recipe shows each epoch's accumulation."""
import json
import sys

import pytest
import torch

from helpers import compliance, kill_tree, launch, read_metrics, run_train, start, wait_until
from models import build_model

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
# resnet18 at 32 px on synthetic data under LARS, no evaluation
TINY = ["--loader", "synthetic", "--synthetic-val-images", 0, "--synthetic-classes", 10, "--arch", "resnet18",
        "--image-size", 32, "--optimizer", "lars", "--log-every", 1, "--threads", 1]
# global batch 32 cut into batches of 8: 3 LARS steps over 2 epochs of 64 images
THREE_STEPS = ["-m", "train", "--out-dir", "run", *TINY, "--synthetic-images", 64, "--epochs", 2, "--max-steps", 3]
ROUNDING = 1e-5  # float32 sums in another order: a few 1e-7 measured


def saved(run_dir) -> dict:
    return torch.load(run_dir / "checkpoint.pt", weights_only=True)


def initial_model() -> dict:
    """The weights every run here starts from (seed 0, resnet18, 10 classes), as the trainer builds them."""
    torch.manual_seed(0)
    return build_model("resnet18", 10, zero_init_residual=True, channels_last=True).state_dict()


def assert_same_model(a: dict, b: dict) -> None:
    """Every weight and BatchNorm running statistic of two checkpoints equal to rounding, each of them
    moved by training more than that (else equality would say nothing), and the batch counts equal."""
    start = initial_model()
    assert a["step"] == b["step"] and a["model"].keys() == b["model"].keys() == start.keys()
    for key, tensor in a["model"].items():
        if not tensor.is_floating_point():
            assert torch.equal(tensor, b["model"][key]), key  # num_batches_tracked: one per optimizer step
            continue
        assert (tensor - start[key]).abs().max() > 3 * ROUNDING, f"{key} did not move"
        torch.testing.assert_close(tensor, b["model"][key], rtol=0, atol=ROUNDING, msg=key)


def header(output: str) -> str:
    """The run's first line, rank 0's (horovodrun prefixes it)."""
    return next(line for line in output.splitlines() if "training resnet18 on synthetic data" in line)


@pytest.fixture(scope="module")
def one_process_accumulating_4(tmp_path_factory):
    """Batch and global batch given: start-up derives the 4 accumulation steps."""
    cwd = tmp_path_factory.mktemp("one")
    result = run_train(*THREE_STEPS[2:], "--batch-size", 8, "--global-batch-size", 32, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return saved(cwd / "run"), result.stdout


@pytest.mark.slow
def test_one_process_accumulating_4_says_so(one_process_accumulating_4):
    state, output = one_process_accumulating_4
    assert "| 1 rank(s) x batch 8 x 4 accumulated = global batch 32 |" in header(output)
    assert state["step"] == 3 and state["model"]["bn1.num_batches_tracked"] == 3  # BN counts optimizer steps


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher, ranks, split, said", [
    ("torch", 4, ["--batch-size", 8, "--global-batch-size", 32], " 4 rank(s) x batch 8 = global batch 32 |"),
    ("horovod", 2, ["--batch-size", 8, "--accumulation-steps", 2, "--engine", "horovod"],
     " 2 rank(s) x batch 8 x 2 accumulated = global batch 32 |"),
], ids=["torchrun-4x8", "horovodrun-2x8x2"])
def test_ranks_times_accumulation_is_the_same_run(launcher, ranks, split, said, one_process_accumulating_4,
                                                  tmp_path):
    result = launch(launcher, ranks, *THREE_STEPS, *split, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = header(result.stdout)
    assert said in line and ("accumulated" in line) == ("accumulated" in said)
    assert_same_model(saved(tmp_path / "run"), one_process_accumulating_4[0])


def step_checkpoint(run_dir, at_least: int) -> int | None:
    """The step of the run's checkpoint once one of step `at_least` or later is on disk, taken before the end."""
    path = run_dir / "checkpoint.pt"
    if not path.exists():
        return None
    # (written by an atomic rename: never half a file; mapped, not read: polled while the ranks train)
    state = torch.load(path, weights_only=True, mmap=True)
    return state["step"] if state["step"] >= at_least and not state["finished"] else None


# 128 images at global batch 32: 4 steps per epoch, 8 in all; at LR 0.5, where rounding stays rounding
# over 8 steps (at the preset's LR 4 two processes that differ only in their thread count end 1e-3 apart)
RESTARTED = ["-m", "train", "--out-dir", "run", *TINY, "--synthetic-images", 128, "--epochs", 2, "--lr", 0.5,
             "--checkpoint-every-steps", 1]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run the restarted one continues, whole: one process, 8 per batch x 4 accumulated."""
    cwd = tmp_path_factory.mktemp("whole")
    result = run_train(*RESTARTED[2:], "--batch-size", 8, "--accumulation-steps", 4, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return saved(cwd / "run")


@pytest.mark.multiprocess
@pytest.mark.parametrize("batch", [["--batch-size", 8], ["--global-batch-size", 32]], ids=["batch", "global-batch"])
def test_a_run_killed_on_4_ranks_and_restarted_on_2_accumulates_and_ends_where_the_whole_run_ends(
        batch, uninterrupted, tmp_path):
    # the same command both times, the batch given as on 4 ranks (a fresh run on 2 ranks would take 16
    # per rank from either: the restart keeps the run's 8 and accumulates 2)
    job = start([*TORCHRUN, "--nproc-per-node", 4, *RESTARTED, *batch], tmp_path, tmp_path / "four.log")
    try:
        killed_after = wait_until(lambda: step_checkpoint(tmp_path / "run", 2), 180,
                                  "a step checkpoint at step 2 or later", alive=[job])
    finally:
        kill_tree(job)  # the launcher's process group and its workers, SIGKILL: no chance to save
    assert " 4 rank(s) x batch 8 = global batch 32 |" in header((tmp_path / "four.log").read_text())

    restart = launch("torch", 2, *RESTARTED, *batch, cwd=tmp_path)
    assert restart.returncode == 0, restart.stdout[-3000:] + restart.stderr[-3000:]
    kept = [line for line in restart.stdout.splitlines() if " kept on " in line]
    assert kept == ["global batch 32 kept on 2 rank(s) as 8 per rank x 2 accumulated (was 4 rank(s) x 1 accumulated): "
                    "the same run, the per-rank batch unchanged"], restart.stdout[-3000:]
    assert " 2 rank(s) x batch 8 x 2 accumulated = global batch 32 |" in header(restart.stdout)

    records = read_metrics(tmp_path / "run")
    resumes = [r for r in records if r["kind"] == "resume"]
    assert len(resumes) == 1 and 2 <= killed_after <= resumes[0]["step"] < 8, (resumes, killed_after)
    trained = [r["step"] for r in records if r["kind"] == "train"]
    assert trained[-1] == 8 and resumes[0]["step"] + 1 in trained  # steps logged after the resume too
    restarted = saved(tmp_path / "run")
    assert restarted["finished"] and uninterrupted["finished"] and restarted["step"] == 8
    assert_same_model(restarted, uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("division", ["open", "closed"])
def test_an_accumulating_run_that_evaluates_passes_the_compliance_checker(division, tmp_path):
    result = run_train("--out-dir", "run", *TINY, "--synthetic-images", 64, "--synthetic-val-images", 16, "--epochs", 1,
                       "--batch-size", 8, "--accumulation-steps", 2, "--division", division, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (tmp_path / "run" / "mllog.txt").read_text()
    assert log.count('"key": "gradient_accumulation_steps"') == 1  # one N: the closed division asks exactly one
    assert '"key": "gradient_accumulation_steps", "value": 2,' in log
    assert '"key": "eval_accuracy"' in log
    checked = compliance(tmp_path / "run" / "mllog.txt", tmp_path)
    output = checked.stdout + checked.stderr
    if division == "open":
        assert checked.returncode == 0 and "SUCCESS" in output, output
    else:  # 4 steps of a tiny model are far from the closed division's 75.9% top-1, and nothing else fails
        problems = [line for line in output.splitlines() if line.startswith(("WARNING ", "ERROR ")) and "FAILED" not in line]
        assert checked.returncode != 0 and problems, output
        assert all("eval_accuracy" in line and "0.7590" in line for line in problems), problems


@pytest.mark.slow(seconds=30)
def test_a_batch_phase_beyond_what_a_rank_holds_accumulates_more_and_says_so(tmp_path):
    """One CPU process (256 per rank at most): global batch 512 as 256 x 2, then 1,024 from epoch 2 as 256
    x 4: the line, the metrics' batch record and MLLOG's gradient_accumulation_steps again, for epoch 2."""
    result = run_train("--out-dir", "run", *TINY, "--image-size", 16, "--synthetic-images", 1024, "--epochs", 2,
                       "--global-batch-size", 512, "--batch-schedule", "1:1024", "--eval-every", 0, "--threads", 2,
                       cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "1 rank(s) x batch 256 x 2 accumulated = global batch 512" in result.stdout, result.stdout
    assert "epoch 2: global batch 1024 (256 per rank x 4 accumulated)" in result.stdout, result.stdout
    change = next(r for r in read_metrics(tmp_path / "run") if r["kind"] == "batch")
    assert (change["step"], change["batch_size"], change["accumulation_steps"]) == (2, 256, 4), change
    steps = [json.loads(line.split(":::MLLOG ", 1)[1]) for line in (tmp_path / "run" / "mllog.txt").read_text().splitlines()
             if "gradient_accumulation_steps" in line]
    assert [(e["value"], e["metadata"].get("epoch_num")) for e in steps] == [(2, None), (4, 2)], steps


@pytest.mark.slow
def test_show_recipe_shows_each_epochs_accumulation(tmp_path):
    # one process on a CPU: batches of 256 per rank at most, so a global batch of 1,024 accumulates 4
    result = run_train("--show-recipe", "--global-batch-size", 1024, "--epochs", 3, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert [e["accumulation_steps"] for e in shown["epochs"]] == [4, 4, 4]
    assert shown["config"]["batch_size"] == 256 and shown["config"]["accumulation_steps"] == 4
    # mikami2018's batch schedule, 34,816 then 69,632 from epoch 31: N by phase
    result = run_train("--preset", "mikami2018", "--show-recipe", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    steps = {(e["global_batch"], e["accumulation_steps"]) for e in json.loads(result.stdout)["epochs"]}
    assert steps == {(34816, 136), (69632, 272)}
    # a global batch one rank holds at once: no accumulation
    result = run_train("--show-recipe", "--global-batch-size", 64, cwd=tmp_path)
    assert [e["accumulation_steps"] for e in json.loads(result.stdout)["epochs"]] == [1] * 16
