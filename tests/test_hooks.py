"""The loop's hooks (train/hooks.py): what watches the step from outside (the bench's timers, its
profiler trace, the GPU check's sync check) is told at named points, in the order the run meets them,
and nothing outside the loop replaces a method of Training or of a loader. Tiny runs: resnet18 at 16 px."""
import ast
import contextlib
import io

import pytest

from helpers import REPO
from train.hooks import LoopHooks

# 2 epochs of 3 steps (12 images, batch 4), logging every 2 steps
RUN = ["--arch", "resnet18", "--image-size", "16", "--batch-size", "4", "--loader", "synthetic", "--synthetic-images",
       "12", "--synthetic-classes", "4", "--synthetic-val-images", "4", "--epochs", "2", "--log-every", "2",
       "--threads", "1", "--no-tensorboard", "--no-checkpoints"]


class Recorder(LoopHooks):
    """Every point as it comes, with the run's step count at that moment."""

    def __init__(self):
        self.points = []

    def run_started(self, training):
        self.training = training
        self.points.append(("run_started", training.state.step))

    def batch_asked(self):
        self.points.append(("batch_asked", self.training.state.step))

    def batch_fetched(self, images, labels):
        assert images.shape == (4, 3, 16, 16) and labels.shape == (4,)
        self.points.append(("batch_fetched", self.training.state.step))

    def step_done(self, step, loss):
        assert step == self.training.state.step and loss.dim() == 0
        self.points.append(("step_done", step))

    def reads_start(self, what):
        self.points.append(("reads_start", what))

    def reads_end(self, what):
        self.points.append(("reads_end", what))

    def epoch_done(self):
        self.points.append(("epoch_done", self.training.state.epoch))


def step(n):
    return [("batch_asked", n - 1), ("batch_fetched", n - 1), ("step_done", n)]


def reads(what, inside=()):
    return [("reads_start", what), *inside, ("reads_end", what)]


@pytest.mark.slow(seconds=10)
def test_a_hook_is_told_each_point_in_the_order_the_run_meets_them(tmp_path):
    from train.cli import parse
    from train.loop import run
    first, second = Recorder(), Recorder()
    with contextlib.redirect_stdout(io.StringIO()):
        run(parse([*RUN, "--out-dir", str(tmp_path / "run")]), hooks=(first, second))
    epoch_end = reads("the epoch's end")  # (its evaluation and checkpoint inside)
    expected = [("run_started", 0),
                *step(1), *step(2), *reads("a logging point"), *step(3), ("batch_asked", 3), *epoch_end,
                ("epoch_done", 1),
                *step(4), *reads("a logging point"), *step(5), *step(6), *reads("a logging point"), ("batch_asked", 6),
                *epoch_end, ("epoch_done", 2),
                *reads("the end"), *reads("the end")]  # (the ranks' check of their replicas, then the run's end)
    assert first.points == expected, first.points
    assert second.points == first.points  # every hook, each point


def test_nothing_outside_the_loop_replaces_a_method_of_training_or_of_a_loader():
    """No assignment to an attribute named as a method of Training or of a Loader, in the packages and
    the scripts, outside the files that define them."""
    from data.loaders import Loader
    from train.loop import Training
    methods = {name for cls in (Training, Loader) for klass in cls.__mro__ if klass is not object
               for name, value in vars(klass).items() if callable(value)}
    own = {REPO / "train" / "loop.py"}
    found = []
    for path in [*REPO.glob("train/**/*.py"), *REPO.glob("data/*.py"), *REPO.glob("scripts/**/*.py")]:
        if path in own or "loaders" in path.name or path.name in ("dali.py", "torch_loader.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AnnAssign, ast.AugAssign)) else []
            calls = [node] if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr" else []
            found += [f"{path.relative_to(REPO)}:{node.lineno} .{t.attr}" for t in targets
                      if isinstance(t, ast.Attribute) and t.attr in methods]
            found += [f"{path.relative_to(REPO)}:{node.lineno} setattr(..., {c.args[1].value!r})" for c in calls
                      if len(c.args) > 1 and isinstance(c.args[1], ast.Constant) and c.args[1].value in methods]
    assert not found, found
