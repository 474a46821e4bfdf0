"""The loop's hooks: what watches or wraps the training step from outside the loop (python -m
train.bench's timers and profiler trace, the GPU check's sync check) is a LoopHooks that
`train.loop.run(cfg, hooks=...)` calls at named points, so that nothing outside the loop replaces a
method of Training or of a loader. A hook watches; what changes the run is the loop's own (Horovod
Elastic's commit, a collective every rank makes at the same step, is given to Training.run_epochs by
train/elastic.py). Imports nothing: a command's --help may name hooks without torch."""


class LoopHooks:
    """A subclass overrides the points it needs; each does nothing here. The points, in the order a
    run meets them: `run_started` once (the run's parts are built, its first step is next: a hook
    keeps the Training it needs); per step `batch_asked` (the loop is about to ask the loader for a
    batch; asked once more at an epoch's end, when the loader has none), `batch_fetched` (the batch is
    in hand, on the device, its copy perhaps still queued) and `step_done` (the optimizer step is
    queued; `step` counts the run's steps from 1, `loss` is still on the device); `epoch_done` after
    each epoch's end. Between `reads_start` and `reads_end` the host may read the device's values and
    wait for it (`what`: "a logging point", "the epoch's end" with its evaluation and checkpoint, "a
    checkpoint", "a commit", "the end"); they nest."""

    def run_started(self, training) -> None:
        pass

    def batch_asked(self) -> None:
        pass

    def batch_fetched(self, images, labels) -> None:
        pass

    def step_done(self, step: int, loss) -> None:
        pass

    def reads_start(self, what: str) -> None:
        pass

    def reads_end(self, what: str) -> None:
        pass

    def epoch_done(self) -> None:
        pass


class HookList(LoopHooks):
    """Several hooks as one: each point calls every hook's, in the order given."""

    def __init__(self, hooks=()):
        self.hooks = tuple(hooks)

    def run_started(self, training) -> None:
        for hook in self.hooks:
            hook.run_started(training)

    def batch_asked(self) -> None:
        for hook in self.hooks:
            hook.batch_asked()

    def batch_fetched(self, images, labels) -> None:
        for hook in self.hooks:
            hook.batch_fetched(images, labels)

    def step_done(self, step: int, loss) -> None:
        for hook in self.hooks:
            hook.step_done(step, loss)

    def reads_start(self, what: str) -> None:
        for hook in self.hooks:
            hook.reads_start(what)

    def reads_end(self, what: str) -> None:
        for hook in self.hooks:
            hook.reads_end(what)

    def epoch_done(self) -> None:
        for hook in self.hooks:
            hook.epoch_done()
