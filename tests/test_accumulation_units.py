"""Gradient accumulation's parts (--accumulation-steps, docs/accumulation.md): how start-up splits a
global batch into ranks x batch x steps (train/batches.py) and refuses what does not split; how a
--batch-schedule phase splits; one gradient all-reduce per optimizer step on Horovod's wrappers and on
DDP; BatchNorm's running statistics moved once per step by the mean of its batches' statistics."""
import json
import re
from types import SimpleNamespace

import pytest
import torch

from helpers import REPO, launch, run_train
from train.batches import accumulates, batch_sizes, epoch_split, phase_split, split_phases
from train.bnstats import StepStatistics
from train.errors import UsageError


# --- the resolution table: (per-rank batch, global batch, steps) from any two ----------------------
@pytest.mark.parametrize("given, expected", [
    # batch and global batch: steps = 48 / (2 x 8)
    (dict(batch_size=8, global_batch_size=48, world_size=2), (8, 48, 3)),
    # batch and steps: global = 2 x 8 x 3
    (dict(batch_size=8, global_batch_size=0, world_size=2, accumulation_steps=3), (8, 48, 3)),
    # global batch and steps: batch = 48 / (2 x 3)
    (dict(batch_size=0, global_batch_size=48, world_size=2, accumulation_steps=3), (8, 48, 3)),
    # a global batch alone, 32 per rank, within the default 256: no accumulation
    (dict(batch_size=0, global_batch_size=64, world_size=2), (32, 64, 1)),
    # a global batch alone, 512 per rank, over the default 256: 2 steps of 256
    (dict(batch_size=0, global_batch_size=1024, world_size=2), (256, 1024, 2)),
    # 600 on one rank, default 256: 2 steps would be 300 (too many), so 3 of 200
    (dict(batch_size=0, global_batch_size=600, world_size=1), (200, 600, 3)),
    # 257 per rank (a prime) over the default 256: no whole split but batches of one image
    (dict(batch_size=0, global_batch_size=514, world_size=2), (1, 514, 257)),
    # a smaller default (a GPU's memory model): 96 per rank of at most 40 is 3 steps of 32
    (dict(batch_size=0, global_batch_size=192, world_size=2, default=40), (32, 192, 3)),
    # steps alone: the default batch, global = 2 x 256 x 4
    (dict(batch_size=0, global_batch_size=0, world_size=2, accumulation_steps=4), (256, 2048, 4)),
    # nothing: the default batch, one step
    (dict(batch_size=0, global_batch_size=0, world_size=3), (256, 768, 1)),
    (dict(batch_size=0, global_batch_size=0, world_size=3, default=32), (32, 96, 1)),
    # all three, consistent: 2 x 8 x 3 = 48
    (dict(batch_size=8, global_batch_size=48, world_size=2, accumulation_steps=3), (8, 48, 3)),
    # a batch above what fits, but no steps asked for: the user's batch stands (only asked steps are checked)
    (dict(batch_size=128, global_batch_size=256, world_size=1, fits=64), (128, 256, 2)),
    # a batch given with steps: the user's batch stands, above what fits too (only a batch start-up derives is checked)
    (dict(batch_size=128, global_batch_size=0, world_size=2, accumulation_steps=2, fits=64), (128, 512, 2)),
    # steps asked for with a batch that fits: taken
    (dict(batch_size=0, global_batch_size=512, world_size=2, accumulation_steps=4, fits=64), (64, 512, 4)),
])
def test_any_two_settings_give_the_third(given, expected):
    assert batch_sizes(**given) == expected


def suggested(message: str) -> list[tuple[int, int]]:
    """The (batch, steps) pairs a refusal offers."""
    return [(int(b), int(n)) for b, n in re.findall(r"--batch-size (\d+) --accumulation-steps (\d+)", message)]


@pytest.mark.parametrize("given, said, offered", [
    # all three, inconsistent: 2 x 8 x 2 = 32, not 48; 24 per rank in batches of at most 8
    (dict(batch_size=8, global_batch_size=48, world_size=2, accumulation_steps=2),
     "--batch-size 8 x 2 rank(s) x --accumulation-steps 2 = 32 disagrees with --global-batch-size 48; "
     "global batch 48 on 2 rank(s) is e.g. ", [(8, 3), (6, 4), (4, 6)]),
    # batch and global batch that leave no whole number of steps: 40 / (2 x 8) = 2.5; 20 per rank, batches of at most 8
    (dict(batch_size=8, global_batch_size=40, world_size=2),
     "--global-batch-size 40 is not a whole number of 2 rank(s) x --batch-size 8; global batch 40 on 2 rank(s) is e.g. ",
     [(5, 4), (4, 5), (2, 10)]),
    # global batch and steps that leave no whole batch: 50 / (2 x 3); 25 per rank splits into 1, 5 or 25 steps
    (dict(batch_size=0, global_batch_size=50, world_size=2, accumulation_steps=3),
     "--global-batch-size 50 does not split into 2 rank(s) x --accumulation-steps 3 whole batches; global batch 50 on "
     "2 rank(s) is e.g. ", [(25, 1), (5, 5), (1, 25)]),
    # steps asked for that leave a batch of 128 where 64 fits; 256 per rank in batches of at most 64
    (dict(batch_size=0, global_batch_size=512, world_size=2, accumulation_steps=2, fits=64),
     "--accumulation-steps 2 leaves a per-rank batch of 128, more than the 64 whose step fits this device; "
     "global batch 512 on 2 rank(s) is e.g. ", [(64, 4), (32, 8), (16, 16)]),
])
def test_what_does_not_split_is_refused_naming_values_that_work(given, said, offered):
    with pytest.raises(UsageError) as refused:
        batch_sizes(**given)
    message = str(refused.value)
    assert message.startswith(said) and "\n" not in message, message
    assert suggested(message) == offered, message
    for batch, steps in offered:  # (each offer is a split of the same global batch, within what fits)
        assert given["world_size"] * batch * steps == int(re.search(r"global batch (\d+) on", message).group(1))
        assert batch <= given.get("fits", batch)


def test_a_global_batch_that_does_not_divide_over_the_ranks_is_refused():
    with pytest.raises(UsageError, match="--global-batch-size 50 does not divide over 3 ranks; choose a multiple"):
        batch_sizes(0, 50, 3)


@pytest.mark.slow(seconds=10)
def test_an_inconsistent_command_is_one_line_exit_2_and_leaves_nothing(tmp_path):
    done = run_train("--loader", "synthetic", "--synthetic-images", 64, "--arch", "resnet18", "--image-size", 16,
                     "--batch-size", 8, "--global-batch-size", 24, "--accumulation-steps", 2, "--out-dir", "fresh",
                     "--max-steps", 1, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.splitlines() == [
        "error: --batch-size 8 x 1 rank(s) x --accumulation-steps 2 = 16 disagrees with --global-batch-size 24; "
        "global batch 24 on 1 rank(s) is e.g. --batch-size 8 --accumulation-steps 3 or --batch-size 6 "
        "--accumulation-steps 4 or --batch-size 4 --accumulation-steps 6"], done.stderr
    assert not (tmp_path / "fresh").exists()


# --- batch phases (--batch-schedule) ---------------------------------------------------------------
def test_a_phase_keeps_the_steps_while_its_batch_fits_and_adds_steps_where_it_would_not():
    assert phase_split(4096, 8, 2, 512) == (256, 2)  # 512 per rank in the run's 2 steps
    assert phase_split(69632, 8, 16, 1024) == (544, 16)  # 8704 per rank: 16 steps of 544, within 1024
    # 34816 on 8 ranks (4352 = 2^8 x 17 each) in batches of at most 512: the fewest steps are 16 (272)
    assert phase_split(34816, 8, 1, 512) == (272, 16)
    # 69632 (8704 = 2^9 x 17 each): 16 steps would be 544 > 512; 17 steps of 512
    assert phase_split(69632, 8, 16, 512) == (512, 17)


def test_mikamis_batch_schedule_grows_the_steps_where_the_per_rank_batch_would_not_fit():
    run = SimpleNamespace(batch_size=272, global_batch_size=34816, accumulation_steps=16, largest_batch=512,
                          batch_schedule="30:69632")
    assert split_phases(run) == [(0, 34816, 272, 16), (30, 69632, 512, 17)]
    assert epoch_split(run, 29) == (34816, 272, 16) and epoch_split(run, 30) == (69632, 512, 17)
    assert accumulates(run)
    roomier = SimpleNamespace(**{**vars(run), "largest_batch": 1024})  # the batch follows, the steps kept
    assert split_phases(roomier) == [(0, 34816, 272, 16), (30, 69632, 544, 16)]
    # without accumulation, the per-rank batch follows the phase as before accumulation existed
    plain = SimpleNamespace(batch_size=4352, global_batch_size=34816, accumulation_steps=1, largest_batch=8704,
                            batch_schedule="30:69632")
    assert split_phases(plain) == [(0, 34816, 4352, 1), (30, 69632, 8704, 1)] and not accumulates(plain)
    # a later phase that no longer fits is an accumulating run (DDP's static graph off for all of it)
    assert accumulates(SimpleNamespace(**{**vars(plain), "largest_batch": 4352}))


# --- one gradient all-reduce per optimizer step ------------------------------------------------------
@pytest.mark.multiprocess
def test_horovods_wrappers_issue_one_all_reduce_per_parameter_per_step(tmp_path):
    """tests/helpers/accumulation_check.py in one process (hvd.init() without a launcher): a step of 3
    passes with accumulating() around the first two issues each parameter's all-reduce (flat) or each
    bucket's first step (two-level) exactly once, during the last backward; without it, the second
    backward is refused."""
    done = launch("none", 1, REPO / "tests" / "helpers" / "accumulation_check.py", "horovod", tmp_path / "seen.json",
                  cwd=tmp_path, timeout=300, env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    seen = json.loads((tmp_path / "seen.json").read_text())
    for kind in ("flat", "two-level"):
        case = seen[f"{kind} accumulating"]
        assert case["units"] > 1 and len(case["per_step"]) == case["units"], case  # every parameter / bucket ...
        assert set(case["per_step"].values()) == {1}, case  # ... once
        assert case["during_backward"] == case["per_step"], case  # (issued in backward, none left to synchronize())
        assert case["farthest"] == 0, case  # the sum of the three passes' gradients (one rank)
        assert "a gradient was computed again before optimizer.synchronize()" in seen[f"{kind} plain"].get("raised", "")


@pytest.mark.multiprocess
def test_ddps_comm_hook_runs_once_per_bucket_per_step_under_no_sync(tmp_path):
    """tests/helpers/accumulation_check.py under torchrun (1 rank, gloo): the comm hook (the flat path's,
    and the engine's own two-level hook) is called once per bucket in a step of 3 passes with the
    engine's accumulating() (DDP's no_sync) around the first two, as in a step of one pass; 3 times
    per bucket without it."""
    done = launch("torch", 1, REPO / "tests" / "helpers" / "accumulation_check.py", "torch", tmp_path / "seen.json",
                  cwd=tmp_path, timeout=300, env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    seen = json.loads((tmp_path / "seen.json").read_text())
    for allreduce in ("flat", "hierarchical"):
        accumulating, plain = seen[f"{allreduce} accumulating"], seen[f"{allreduce} plain"]
        buckets = accumulating["one_pass_step"]
        assert buckets > 1, seen  # (resnet18: DDP's 1 MiB first bucket, then 25 MiB ones)
        assert accumulating["per_step"] == buckets, seen
        assert plain["one_pass_step"] == buckets and plain["per_step"] == 3 * buckets, seen
        assert accumulating["farthest"] == 0, seen


# --- BatchNorm's running statistics: once per step --------------------------------------------------
def test_running_statistics_move_once_per_step_by_the_mean_of_its_batches():
    """A step of N = 3 passes through BatchNorm -> ReLU -> BatchNorm: each layer's running mean and
    variance end at (1 - m) x start + m x the mean over the 3 batches of the batch's mean and unbiased
    variance (per channel, of the layer's input: for the second layer, the first normalised by its batch
    statistics), and the batch count one up."""
    momentum, passes = 0.25, 3
    model = torch.nn.Sequential(torch.nn.BatchNorm2d(4, momentum=momentum), torch.nn.ReLU(),
                                torch.nn.BatchNorm2d(4, momentum=momentum))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for bn in (model[0], model[2]):
            bn.weight.uniform_(0.5, 1.5, generator=generator)
            bn.bias.uniform_(-0.5, 0.5, generator=generator)
            bn.running_mean.uniform_(-1, 1, generator=generator)
            bn.running_var.uniform_(0.5, 2, generator=generator)
            bn.num_batches_tracked.fill_(7)
    start = [(bn.running_mean.clone(), bn.running_var.clone()) for bn in (model[0], model[2])]
    batches = [torch.randn(5, 4, 3, 3, generator=generator) * (i + 1) + i for i in range(passes)]

    def by_hand(x):  # per channel: the batch's mean and unbiased variance, and the first layer's output
        mean, var = x.mean(dim=(0, 2, 3)), torch.var(x, dim=(0, 2, 3), unbiased=True)
        shape = (1, -1, 1, 1)
        normalised = (x - mean.view(shape)) / torch.sqrt(torch.var(x, dim=(0, 2, 3), unbiased=False).view(shape) + 1e-5)
        return mean, var, torch.relu(normalised * model[0].weight.view(shape) + model[0].bias.view(shape))

    first = [by_hand(x) for x in batches]
    second = [by_hand(out)[:2] for *_, out in first]
    statistics = StepStatistics(model)
    model.train()
    with torch.no_grad():
        for index, x in enumerate(batches):
            statistics.before_pass(index)
            model(x)
        statistics.after_step(passes)
    for bn, (mean0, var0), per_batch in zip((model[0], model[2]), start, ([f[:2] for f in first], second)):
        batch_mean = torch.stack([mean for mean, _ in per_batch]).mean(0)
        batch_var = torch.stack([var for _, var in per_batch]).mean(0)
        torch.testing.assert_close(bn.running_mean, (1 - momentum) * mean0 + momentum * batch_mean)
        torch.testing.assert_close(bn.running_var, (1 - momentum) * var0 + momentum * batch_var)
        assert bn.num_batches_tracked.item() == 8


# --- the settings around a split: flags over a saved run, a restart in the closed division, CUDA graphs --
def test_one_batch_flag_on_resume_leaves_the_saved_runs_other_values_to_start_up(tmp_path):
    import yaml
    from train.cli import parse
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"batch_size": 8, "global_batch_size": 32, "accumulation_steps": 4}))
    steps = parse(["--resume", "--out-dir", str(run), "--accumulation-steps", "2"])  # the saved 32 split in 2 steps
    assert (steps.batch_size, steps.global_batch_size, steps.accumulation_steps) == (0, 32, 2)
    assert batch_sizes(steps.batch_size, steps.global_batch_size, 1, accumulation_steps=2) == (16, 32, 2)
    batch = parse(["--resume", "--out-dir", str(run), "--batch-size", "16"])  # a batch alone: one step of it per rank
    assert (batch.batch_size, batch.global_batch_size, batch.accumulation_steps) == (16, 0, 0)


def test_a_closed_division_run_continued_on_other_ranks_keeps_its_steps():
    from train.config import Config
    from train.batches import split_batch
    from train.rundir import Start
    engine = SimpleNamespace(world_size=2, device=torch.device("cpu"))
    saved = dict(global_batch_size=32)
    start = Start("restart", "", True, saved_batch=(8, 4))  # 1 rank x 8 x 4 before
    assert split_batch(Config(**saved), engine, "fp32", 224, start)[:3] == (8, 32, 2)  # open: the batch kept, N follows
    assert split_batch(Config(division="closed", **saved), engine, "fp32", 224, start)[:3] == (4, 32, 4)  # one N, MLPerf's rule


@pytest.mark.slow(seconds=10)
def test_cuda_graph_compile_modes_with_accumulation_are_one_line_exit_2(tmp_path):
    done = run_train("--out-dir", "fresh", "--loader", "synthetic", "--synthetic-images", 64, "--arch", "resnet18",
                     "--image-size", 16, "--batch-size", 4, "--global-batch-size", 8, "--compile", "--compile-mode",
                     "reduce-overhead", "--max-steps", 1, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--compile-mode reduce-overhead replays CUDA graphs" in done.stderr and not (tmp_path / "fresh").exists()
